"""W4A16 linear: ``x @ W.T + bias`` with ``W`` ``[N, K]`` in the repacked AWQ layout, dequantized in
registers.

The layout (``pagedlab.quantization.awq.repack_awq``, made once at load from AutoAWQ's GEMM
tensors): ``qweight`` int32 ``[N, K / 8]`` with eight consecutive k of one output column per word
(nibble i holds k = 8j + i), ``qzeros`` int32 ``[N, ceil(groups / 8)]`` packed the same way along the
groups, ``scales`` ``[N, groups]``. Each column's weights are contiguous along K, as an
``nn.Linear`` weight row is, so a program owning ``block_n`` columns streams ``block_k / 2`` bytes of
each per K step, with no K split needed to make enough programs. ``repacked_linear_torch`` in
``pagedlab.quantization.awq`` is the plain-torch reference of ``awq_linear_triton`` here.

A word unpacks in the thread that loaded it (``_unpack_words``): each nibble is one constant shift
and one logic op, OR-ed into the mantissa of fp32 128.0, which makes the float ``128 + q`` (no
int-to-float instruction; exact in bf16/fp16 too). The joins only place registers. The CUDA-core
sums unpack two nibbles per shift and logic op (``_unpack_words_paired``), the second of each
pair moved by an integer multiply-add on the FMA pipe: those sums are bound by the logic pipe's
half-rate issue, and in the sm_90 SASS their loop went from 4.1-4.6 to 3.4-4.0 instructions a
weight (the one-row GEMVs of a Llama-3-8B layer from 56 to 45 us). The pairing leaves each high
nibble with its low partner times 2^-16: float32 x cancels it exactly (``_row_sums``), 16-bit x
keeps it, below the rounding of the 16-bit weights the reference multiplies.

Three paths, picked by the row count (host ints only, so a CUDA graph can capture the call), each
launched with a ``TileConfig`` from ``gemv_configs.awq_config`` (measured table, else heuristic):

- at most ``GEMV_MAX_ROWS`` rows: a GEMV; each program owns ``block_n`` columns and walks its K
  segment (all of K unless the config sets ``split_k``: ``kernels/gemv.py`` describes the segments
  and their deterministic in-kernel sum) in ``block_k`` steps. The zero point, scale and the 128
  come out of each group's sum: ``sum_k x (q - z) s = s (sum_k x (128 + q) - (128 + z) sum_k x)``.
  ``block_m == 0`` multiplies on the CUDA cores, a K step covering one group, part of one, or
  several: nibble i of each word meets ``x[8w + i]`` and a word's eight products are one chain of
  FMAs, only the words' sums are summed per group (``_row_sums``); one row (``_one_row_step``) or
  up to ``AWQ_CUDA_CORE_MAX_ROWS`` (``_rows_step``: each step's words unpacked once, then every
  row's sums). 1 to 16 rows with ``block_m == 16`` go through ``tl.dot``, a K step within one
  group; ``gemv_bench.py`` measures both for 2-8 rows.
- up to ``AWQ_GEMM_MAX_ROWS`` rows (a decode batch), where ``AWQ_CONFIGS`` lists the shape: a
  dequantize-in-the-loop GEMM: x's tiles and the weight words arrive by TMA (staged ahead by the
  pipeliner), each K tile of the weight (within one group) becomes ``(q - z) * s`` in ``x``'s dtype
  in registers and feeds ``tl.dot`` with fp32 accumulation, as its B operand (``x @ w.T``) or,
  where the config sets ``swap_ab``, as its A operand (``w @ x.T``, the rows on the dot's N:
  Hopper's wgmma takes A from registers); K split where the tiles are few (down_proj's 4,096
  columns). The table holds the form ``benchmarks/gemv_bench.py`` measured faster for the shape.
- more rows otherwise (prefill chunks, shapes the table leaves out, operands TMA cannot read): one
  kernel writes the dequantized weight ``[N, K]`` and cuBLAS multiplies (``F.linear``). All three
  read the same repacked tensors: the model holds one copy of its weights.

This module imports triton when it loads; Triton decides at decoration time whether a kernel is
compiled or interpreted (``TRITON_INTERPRET=1``), so import it lazily, after that is settled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedlab.kernels.device import tma_loads
from pagedlab.kernels.gemv import (check_gated, column_tile, dot_settings, gemv_block_m, k_segments, num_sms,
                                   split_k_epilogue, split_k_scratch)
from pagedlab.kernels.gemv_configs import AWQ_CUDA_CORE_MAX_ROWS, GEMV_MAX_ROWS, TileConfig, awq_config
from pagedlab.kernels.norm_fold import FoldedRMSNorm
from pagedlab.kernels.norm_fold_kernels import fold_args, fold_rstd, load_input
from pagedlab.kernels.pdl import pdl_launch
from pagedlab.kernels.pdl_jit import pdl_wait_and_trigger
from pagedlab.quantization.awq import repacked_shapes

# fp32 128.0: a 4-bit value q OR-ed into mantissa bits 16..19 makes the float 128 + q.
_BITS_OF_128 = 0x43000000
# What a nibble in the low half of a register adds to the float32 the register reads as (2^-16,
# ``_unpack_words_paired``).
_PAIR_CARRY = tl.constexpr(2.0 ** -16)
# A K step reads at least two int32 words of each column.
MIN_BLOCK_K = 16


@triton.jit
def _nibble(words, BIT: tl.constexpr, AT_BIT: tl.constexpr, bits):
    """The 4-bit values at bit BIT of ``words``, moved to bit AT_BIT, OR ``bits``."""
    if BIT <= AT_BIT:
        moved = words << (AT_BIT - BIT)
    else:
        moved = words >> (BIT - AT_BIT)  # arithmetic: the mask drops the copies of a set sign bit
    return (moved & (0xF << AT_BIT)) | bits


@triton.jit
def _unpack_words(words, bits):
    """int32 ``[R, W]`` -> fp32 ``[R, W, 8]`` in K order: ``[r, w, i]`` is ``128 + q`` of nibble ``i``
    of word ``w``, q in the mantissa bits 16..19 of 128.0 (``bits``; exact in bf16 and fp16 too).
    Each nibble is a constant shift and one logic op in the thread that loaded the word; the joins
    only place registers, the last axis being ``i = 4a + 2b + c`` of the joins' (a, b, c)."""
    values = tl.join(tl.join(tl.join(_value(words, 0, bits), _value(words, 16, bits)),
                             tl.join(_value(words, 8, bits), _value(words, 24, bits))),
                     tl.join(tl.join(_value(words, 4, bits), _value(words, 20, bits)),
                             tl.join(_value(words, 12, bits), _value(words, 28, bits))))
    return tl.reshape(values, (words.shape[0], words.shape[1], 8))


@triton.jit
def _unpack_words_paired(words, bits):
    """``_unpack_words`` with half the logic ops, for the CUDA-core sums: one shift and one logic op
    put nibbles J and J + 4 of each word in the two halves of a register (``_nibble_pair``), whose
    float32 reading is ``128 + q`` of nibble J + 4 plus ``q_J * 2^-16`` (its low mantissa bits,
    which ``_row_sums`` cancels through x); an integer multiply-add (on the FMA pipe, which has
    twice the logic pipe's throughput) moves nibble J under the exponent of 128: ``128 + q``
    exactly."""
    low0, high0 = _nibble_pair(words, 0, bits)
    low1, high1 = _nibble_pair(words, 1, bits)
    low2, high2 = _nibble_pair(words, 2, bits)
    low3, high3 = _nibble_pair(words, 3, bits)
    values = tl.join(tl.join(tl.join(low0, high0), tl.join(low2, high2)),
                     tl.join(tl.join(low1, high1), tl.join(low3, high3)))
    return tl.reshape(values, (words.shape[0], words.shape[1], 8))


@triton.jit
def _nibble_pair(words, J: tl.constexpr, bits):
    """float32 ``(128 + q_J, 128 + q_(J+4) + q_J 2^-16)`` of the nibbles J and J + 4 of ``words``."""
    pair = ((words >> (4 * J)) & 0xF000F) | bits  # arithmetic shift: the mask drops a sign's copies
    low = (pair * 65536 + bits).to(tl.float32, bitcast=True)
    return low, pair.to(tl.float32, bitcast=True)


@triton.jit
def _value(words, BIT: tl.constexpr, bits):
    """fp32 ``128 + q`` of the nibble at bit BIT of ``words``."""
    return _nibble(words, BIT, 16, bits).to(tl.float32, bitcast=True)


@triton.jit
def _sum_eights(values, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """``[ROWS, WORDS, 8]`` -> ``[ROWS, WORDS]``: the last axis (in-thread) summed as one chain of
    adds, which the compiler fuses with the products before it into FMAs (tl.sum adds a tree)."""
    even, odd = tl.split(tl.reshape(values, (ROWS, WORDS, 2, 2, 2)))
    v04, v26 = tl.split(even)
    v15, v37 = tl.split(odd)
    v0, v4 = tl.split(v04)
    v2, v6 = tl.split(v26)
    v1, v5 = tl.split(v15)
    v3, v7 = tl.split(v37)
    return v0 + v1 + v2 + v3 + v4 + v5 + v6 + v7


@triton.jit
def _step_word_offsets(k_start, BLOCK_K: tl.constexpr):
    """The word offsets of the K step at ``k_start``, marked as aligned as they are (a step starts
    at a multiple of BLOCK_K), so that the compiler loads four words, or eight 16-bit x, at a time."""
    return tl.multiple_of(k_start // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)


@triton.jit
def _step_words(weight_rows, n_valid, k_start, k_end, BLOCK_K: tl.constexpr):
    """The int32 words ``[BLOCK_N, BLOCK_K // 8]`` of the columns' K step at ``k_start`` (zero
    from ``k_end`` on: none for a step past the end)."""
    offs_w = _step_word_offsets(k_start, BLOCK_K)
    # k_end is K (a multiple of the group size, at least 32) or a segment's end (of BLOCK_K)
    if BLOCK_K >= 32:
        end_word = tl.multiple_of(k_end // 8, 4)
    else:
        end_word = tl.multiple_of(k_end // 8, 2)
    return tl.load(weight_rows + offs_w[None, :], mask=n_valid[:, None] & (offs_w < end_word)[None, :],
                   other=0)


@triton.jit
def _step_zeros_scales(zero_rows, scale_rows, n_valid, k_start, k_end, GROUP_SIZE: tl.constexpr,
                       STEP_GROUPS: tl.constexpr):
    """The zero points as fp32 ``128 + z`` and the fp32 scales, ``[BLOCK_N, STEP_GROUPS]``, of the
    STEP_GROUPS groups from the one holding ``k_start`` (those of groups from ``k_end`` on unread)."""
    offs_g = k_start // GROUP_SIZE + tl.arange(0, STEP_GROUPS)
    mask = n_valid[:, None] & (offs_g < (k_end + GROUP_SIZE - 1) // GROUP_SIZE)[None, :]
    zero_words = tl.load(zero_rows + (offs_g // 8)[None, :], mask=mask, other=0)
    zeros = ((zero_words >> ((offs_g % 8) * 4)[None, :]) & 0xF).to(tl.float32) + 128.0
    scales = tl.load(scale_rows + offs_g[None, :], mask=mask, other=0.0).to(tl.float32)
    return zeros, scales


@triton.jit
def _row_sums(values, zeros, scales, x_row, res_row, g_ptr, k_start, K, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, STEP_GROUPS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """``[BLOCK_N, STEP_GROUPS]``: one row's share of one K step on the CUDA cores, from the
    step's unpacked weights ``values`` (``_unpack_words_paired``). The sum's order within a word is
    free, so no value is moved: nibble i of every word meets ``x[8w + i]``, eight fused
    multiply-adds a word (the x of a word is one 16-byte load, split in registers), and only the
    words' sums are summed per group (x from K on reads as zero). The pairing's ``q * 2^-16``
    terms stay in 16-bit x's sums: at most ``15 * 2^-16 * s * sum |x|``, under the rounding of the
    16-bit weights the reference multiplies; float32 x cancels them exactly. NORM: x is
    ``load_input``'s folded RMSNorm input."""
    offs_w = _step_word_offsets(k_start, BLOCK_K)
    offs_k = offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]
    k_valid = offs_k < K
    x, _ = load_input(x_row + offs_k, res_row + offs_k, g_ptr + offs_k, k_valid, k_valid, NORM, RESIDUAL)
    exact: tl.constexpr = x_row.dtype.element_ty == tl.float32
    x = x.to(tl.float32)
    x_paired = x
    if exact:
        # nibble i + 4 reads 128 + q plus q of nibble i times 2^-16, which x[i] - 2^-16 x[i + 4]
        # cancels in the sum, leaving -2^-9 x[i + 4]: the group's sum of those is added back
        low_x, high_x = tl.split(tl.permute(tl.reshape(x, (BLOCK_K // 8, 2, 4)), (0, 2, 1)))
        x_paired = tl.join(low_x - high_x * _PAIR_CARRY, high_x)
        x_paired = tl.reshape(tl.permute(x_paired, (0, 2, 1)), (BLOCK_K // 8, 8))
    word_dots = _sum_eights(values * x_paired[None, :, :], BLOCK_N, BLOCK_K // 8)
    dots = tl.sum(tl.reshape(word_dots, (BLOCK_N, STEP_GROUPS, BLOCK_K // 8 // STEP_GROUPS)), axis=2)
    x_sums = tl.sum(tl.reshape(x, (STEP_GROUPS, BLOCK_K // STEP_GROUPS)), axis=1)
    if exact:
        high_sums = tl.sum(tl.reshape(high_x, (STEP_GROUPS, BLOCK_K // 2 // STEP_GROUPS)), axis=1)
        dots += (128.0 * _PAIR_CARRY) * high_sums[None, :]
    return scales * (dots - zeros * x_sums[None, :])


@triton.jit
def _one_row_step(acc, words, zeros, scales, x_ptr, res_ptr, g_ptr, k_start, K, w_bits,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_GROUPS: tl.constexpr, NORM: tl.constexpr,
                  RESIDUAL: tl.constexpr):
    """``acc`` ``[BLOCK_N, STEP_GROUPS]`` plus one K step of the one row, on the CUDA cores."""
    return acc + _row_sums(_unpack_words_paired(words, w_bits), zeros, scales, x_ptr, res_ptr, g_ptr, k_start,
                           K, BLOCK_N, BLOCK_K, STEP_GROUPS, NORM, RESIDUAL)


@triton.jit
def _rows_step(acc, words, zeros, scales, x_ptr, res_ptr, g_ptr, stride_x, k_start, K, M, w_bits,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_GROUPS: tl.constexpr,
               NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """``acc`` ``[BLOCK_M, BLOCK_N, STEP_GROUPS]`` plus one K step of each of the M rows on the
    CUDA cores: the step's words unpacked once for all of them, then each row's sums as one row's
    (``_row_sums``; a row from M on reads no x and adds zero)."""
    values = _unpack_words_paired(words, w_bits)
    offs_m = tl.arange(0, BLOCK_M)
    for row in tl.static_range(BLOCK_M):
        row_k = tl.where(row < M, K, 0)
        sums = _row_sums(values, zeros, scales, x_ptr + row * stride_x, res_ptr + row * stride_x, g_ptr,
                         k_start, row_k, BLOCK_N, BLOCK_K, STEP_GROUPS, NORM, RESIDUAL)
        acc = tl.where((offs_m == row)[:, None, None], acc + sums[None, :, :], acc)
    return acc


@triton.jit
def _dot_step(acc, words, zeros, scales, x_rows, res_rows, g_ptr, k_start, K, m_valid, w_bits,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
              DOT_PRECISION: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """``acc`` ``[BLOCK_M, BLOCK_N]`` plus one K step (within one group) of every row, on tensor
    cores: the weights unpacked in K order, ``128 + q``."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w = tl.reshape(_unpack_words(words, w_bits), (BLOCK_N, BLOCK_K))
    k_valid = (offs_k < K)[None, :]
    x, _ = load_input(x_rows + offs_k[None, :], res_rows + offs_k[None, :], g_ptr + offs_k[None, :],
                      m_valid[:, None] & k_valid, k_valid, NORM, RESIDUAL)
    dots = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    x_sums = tl.sum(x.to(tl.float32), axis=1)
    zeros = tl.reshape(zeros, (BLOCK_N,))
    scales = tl.reshape(scales, (BLOCK_N,))
    return acc + scales[None, :] * (dots - zeros[None, :] * x_sums[:, None])


@triton.jit
def _gemv_step(acc, words, zeros, scales, x_ptr, res_ptr, g_ptr, stride_x, k_start, K, M, m_valid, w_bits,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_GROUPS: tl.constexpr,
               USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
               NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """``acc`` plus one K step: ``s * (sum_k x (128 + q) - (128 + z) * sum_k x)`` per group (NORM:
    x as ``load_input`` folds it)."""
    if USE_DOT:
        rows = tl.arange(0, BLOCK_M)[:, None] * stride_x
        return _dot_step(acc, words, zeros, scales, x_ptr + rows, res_ptr + rows, g_ptr, k_start, K, m_valid,
                         w_bits, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, NORM, RESIDUAL)
    elif BLOCK_M == 1:
        return _one_row_step(acc, words, zeros, scales, x_ptr, res_ptr, g_ptr, k_start, K, w_bits, BLOCK_N,
                             BLOCK_K, STEP_GROUPS, NORM, RESIDUAL)
    else:
        return _rows_step(acc, words, zeros, scales, x_ptr, res_ptr, g_ptr, stride_x, k_start, K, M, w_bits,
                          BLOCK_M, BLOCK_N, BLOCK_K, STEP_GROUPS, NORM, RESIDUAL)


@triton.jit(do_not_specialize=["M", "num_splits", "w_bits"])
def _awq_gemv_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                     M, N, K, K_PER_SPLIT, num_splits, stride_x, stride_qweight, stride_qzeros,
                     stride_scales, stride_out, stride_partial_split, stride_partial_row, w_bits, res_ptr,
                     norm_w_ptr, summed_ptr, normed_ptr, eps, GROUP_SIZE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_GROUPS: tl.constexpr,
                     USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr, NORM: tl.constexpr,
                     NORM_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, WRITE_NORMED: tl.constexpr,
                     GATED: tl.constexpr, PDL: tl.constexpr):
    """Program (column tile of BLOCK_N, K segment) for all M <= BLOCK_M rows, through tl.dot or
    on the CUDA cores (one row, or up to ``AWQ_CUDA_CORE_MAX_ROWS`` sharing each step's unpacked
    words), one ``_gemv_step`` per K step. ``w_bits`` (the bits of 128.0) is a
    runtime value so that the compiler merges its OR with the nibble's AND into one logic op.
    The CUDA cores' partial sums stay per (row, column, group of the step) until the end. The first K
    step's weights, zero points and scales are read before the PDL wait (``kernels/pdl.py``:
    constant weights only; segments are never empty, so that step always exists). With PREFETCH
    (``num_stages > 1``) each next step's are read before this step's sums, so that a program
    keeps two steps of loads in flight (the loop holds no tl.dot for Triton's pipeliner to stage
    loads for): one register copy more of a step's words. NORM: x is a folded RMSNorm's input, as in
    ``kernels/gemv.py``'s ``_dense_gemv_kernel``, its 1/rms always read first (``fold_rstd``):
    summing the squares in the loop (NORM_SUMS there) made a Llama-3-8B AWQ batch-1 step 0.2 ms
    slower on the H200 (2.471 against 2.258 ms)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n, n_valid = column_tile(pid_n, N, BLOCK_N, GATED)
    columns = offs_n.to(tl.int64)[:, None]
    weight_rows = qweight_ptr + columns * stride_qweight
    zero_rows = qzeros_ptr + columns * stride_qzeros
    scale_rows = scales_ptr + columns * stride_scales
    offs_m = tl.arange(0, BLOCK_M)
    m_valid = offs_m < M
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, STEP_GROUPS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, STEP_GROUPS), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    # the first K step's weights before the PDL wait; each next one's during (PREFETCH) or after
    # this one's sums (past the segment's end: nothing read)
    words = _step_words(weight_rows, n_valid, k_begin, k_end, BLOCK_K)
    zeros, scales = _step_zeros_scales(zero_rows, scale_rows, n_valid, k_begin, k_end, GROUP_SIZE,
                                       STEP_GROUPS)
    pdl_wait_and_trigger(PDL)
    if NORM:
        rstd = fold_rstd(x_ptr, res_ptr, norm_w_ptr, summed_ptr, normed_ptr, stride_x, M, K, eps,
                         (pid_n == 0) & (split == 0), BLOCK_M, NORM_BLOCK, RESIDUAL, WRITE_NORMED)
    for k_start in range(k_begin, k_end, BLOCK_K):
        if PREFETCH:
            next_words = _step_words(weight_rows, n_valid, k_start + BLOCK_K, k_end, BLOCK_K)
            next_zeros, next_scales = _step_zeros_scales(zero_rows, scale_rows, n_valid, k_start + BLOCK_K,
                                                         k_end, GROUP_SIZE, STEP_GROUPS)
        acc = _gemv_step(acc, words, zeros, scales, x_ptr, res_ptr, norm_w_ptr, stride_x, k_start, K, M,
                         m_valid, w_bits, BLOCK_M, BLOCK_N, BLOCK_K, STEP_GROUPS, USE_DOT, DOT_DTYPE,
                         DOT_PRECISION, NORM, RESIDUAL)
        if PREFETCH:
            words, zeros, scales = next_words, next_zeros, next_scales
        else:
            words = _step_words(weight_rows, n_valid, k_start + BLOCK_K, k_end, BLOCK_K)
            zeros, scales = _step_zeros_scales(zero_rows, scale_rows, n_valid, k_start + BLOCK_K, k_end,
                                               GROUP_SIZE, STEP_GROUPS)
    if not USE_DOT and BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[None, :]
    elif not USE_DOT:
        acc = tl.sum(acc, axis=2)
    if NORM:
        acc *= rstd[:, None]
    split_k_epilogue(acc, offs_m, offs_n, m_valid, n_valid, pid_n, split, num_splits,
                     partial_ptr, stride_partial_split, stride_partial_row, counter_ptr,
                     bias_ptr, out_ptr, stride_out, HAS_BIAS, SPLIT, GATED)


@triton.jit
def _dequantized_words(words, zero_rows, scale_rows, n_valid, k_start, K, w_bits, GROUP_SIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 weights ``(q - z) * s`` ``[BLOCK_N, BLOCK_K]`` of the columns' K tile at
    ``k_start`` (within one group) from its words ``[BLOCK_N, BLOCK_K // 8]``."""
    zeros, scales = _step_zeros_scales(zero_rows, scale_rows, n_valid, k_start, K, GROUP_SIZE, 1)
    # 128 + q, as in the GEMV, less 128 + z
    return (tl.reshape(_unpack_words(words, w_bits), (BLOCK_N, BLOCK_K)) - zeros) * scales


@triton.jit(do_not_specialize=["w_bits"])
def _awq_gemm_kernel(x_desc, qweight_desc, qzeros_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr,
                     counter_ptr, M, N, K, k_per_split, num_splits, stride_qzeros, stride_scales, stride_out,
                     stride_partial_split, stride_partial_row, w_bits, GROUP_SIZE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr, PDL: tl.constexpr):
    """Program (row tile, column tile, K segment) of the output. Row tiles vary fastest over the
    grid, so programs running together share a weight tile (read from HBM once). The x tiles and
    the weight words come through TMA descriptors (rows past M, columns past N and K past its end
    read as zeros), which the pipeliner stages in shared memory ``num_stages`` K steps ahead; the
    zero points and scales are pointer loads. With SPLIT each segment stores its share and the last
    to finish sums them in segment order (``split_k_epilogue``): the same bits whichever finishes
    last. PDL: waits first (nothing to gain from one early weight tile).

    SWAP_AB computes the transposed tile, ``acc[BLOCK_N, BLOCK_M] += w @ x.T``, transposed for the
    epilogue: the dequantized weight is the dot's A operand and the rows its N. For sm_90 (Triton
    3.6, bf16, groups of 128) both forms compile to asynchronous wgmma; the swapped one takes the
    weights from registers, the plain one stores each weight tile to shared memory, where wgmma
    reads it as B. tests/test_kernels_hopper_compile.py checks the operands."""
    pdl_wait_and_trigger(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    columns = offs_n.to(tl.int64)[:, None]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = split * k_per_split
    for k_start in range(k_begin, tl.minimum(K, k_begin + k_per_split), BLOCK_K):
        words = qweight_desc.load([pid_n * BLOCK_N, k_start // 8])
        w = _dequantized_words(words, qzeros_ptr + columns * stride_qzeros,
                               scales_ptr + columns * stride_scales, n_valid, k_start, K, w_bits, GROUP_SIZE,
                               BLOCK_N, BLOCK_K).to(DOT_DTYPE)
        x = x_desc.load([pid_m * BLOCK_M, k_start]).to(DOT_DTYPE)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)
    split_k_epilogue(acc, offs_m, offs_n, offs_m < M, n_valid, pid_m * tl.num_programs(1) + pid_n, split,
                     num_splits, partial_ptr, stride_partial_split, stride_partial_row, counter_ptr, bias_ptr,
                     out_ptr, stride_out, HAS_BIAS, SPLIT)


@triton.jit(do_not_specialize=["w_bits"])
def _awq_dequantize_kernel(qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, N, K, stride_qweight,
                           stride_qzeros, stride_scales, stride_out, w_bits, GROUP_SIZE: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (K tile within one group, column tile): ``(q - z) * s`` rounded to the output's dtype
    into the ``[N, K]`` weight, the same values the GEMM's tiles feed tl.dot. It reads only the
    weight, so with PDL it computes the tile before the wait and only stores after it."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    columns = offs_n.to(tl.int64)[:, None]
    words = _step_words(qweight_ptr + columns * stride_qweight, n_valid, pid_k * BLOCK_K, K, BLOCK_K)
    w = _dequantized_words(words, qzeros_ptr + columns * stride_qzeros, scales_ptr + columns * stride_scales,
                           n_valid, pid_k * BLOCK_K, K, w_bits, GROUP_SIZE, BLOCK_N, BLOCK_K)
    pdl_wait_and_trigger(PDL)
    tl.store(out_ptr + columns * stride_out + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_valid[:, None] & (offs_k < K)[None, :])


def awq_dequantize_triton(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """Triton version of ``dequantize_repacked``: the weight ``[out_features, in_features]`` (as
    ``nn.Linear`` holds it) in ``dtype`` (each value ``(q - z) * s`` computed in float32, then
    rounded), for cuBLAS to multiply."""
    in_features, out_features = repacked_shapes(qweight, qzeros, scales, group_size)
    out = torch.empty(out_features, in_features, dtype=dtype, device=qweight.device)
    block_n, block_k = 32, min(group_size, 128)
    grid = (triton.cdiv(in_features, block_k), triton.cdiv(out_features, block_n))
    _awq_dequantize_kernel[grid](qweight, qzeros, scales, out, out_features, in_features,
                                 qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
                                 _BITS_OF_128, GROUP_SIZE=group_size, BLOCK_N=block_n, BLOCK_K=block_k,
                                 **pdl_launch(qweight.device), num_warps=4)
    return out


def awq_linear_triton(x: torch.Tensor | FoldedRMSNorm, qweight: torch.Tensor, qzeros: torch.Tensor,
                      scales: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
                      config: TileConfig | None = None, gated: bool = False) -> torch.Tensor:
    """Triton version of ``repacked_linear_torch`` (repacked tensors, ``repack_awq``): ``x``
    ``[..., in_features]`` in float16, bfloat16 or float32 -> ``[..., out_features]`` in ``x``'s dtype.

    The tensors may be views (e.g. a shard's rows) as long as their last dimension is contiguous.
    ``config`` (default: ``gemv_configs.awq_config``) sets the tiles; with at most
    ``GEMV_MAX_ROWS`` rows it runs the GEMV; more rows run the GEMM where the table lists it (or
    ``config`` is given) and TMA can read x and the weight words (Hopper on, 16-byte aligned),
    else the weight is dequantized and cuBLAS multiplies. ``x`` may be a ``FoldedRMSNorm``: the GEMV
    folds it in; the other paths multiply ``x.materialize()``."""
    norm = x if isinstance(x, FoldedRMSNorm) else None
    if norm is not None:
        norm.check()
        x = norm.x
    in_features, out_features = repacked_shapes(qweight, qzeros, scales, group_size)
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the AWQ weight {in_features} inputs")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not supported: float16, bfloat16 or float32")
    x2d = x.reshape(-1, in_features)
    rows = x2d.shape[0]
    tensors = {"x": x2d, "qweight": qweight, "qzeros": qzeros, "scales": scales, "bias": bias}
    for name, tensor in tensors.items():
        if tensor is not None and tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    config = config or awq_config(rows, out_features, in_features, group_size, num_sms(x.device))
    if config is not None:
        check_awq_config(config, rows, group_size)
        if rows > GEMV_MAX_ROWS and not tma_loads(x2d, qweight):
            config = None  # the GEMM reads x and the words through TMA, which these cannot feed
    if norm is not None and (config is None or rows > GEMV_MAX_ROWS):
        x2d, norm = norm.materialize(), None
    if gated and (config is None or rows > GEMV_MAX_ROWS):
        raise ValueError(f"the AWQ kernels fold SiLU-and-mul into the GEMV only (1-{GEMV_MAX_ROWS} rows), "
                         f"not {rows} rows")
    if config is None:
        weight = awq_dequantize_triton(qweight, qzeros, scales, group_size, x.dtype)
        out = F.linear(x2d, weight, None if bias is None else bias.to(x.dtype))
        return out.view(*x.shape[:-1], out_features)
    out = torch.empty(rows, out_features // 2 if gated else out_features, dtype=x.dtype, device=x.device)
    if rows <= GEMV_MAX_ROWS:
        _launch_gemv(x2d, qweight, qzeros, scales, bias, out, group_size, config, norm, gated)
    elif rows:
        _launch_gemm(x2d, qweight, qzeros, scales, bias, out, group_size, config)
    return out.view(*x.shape[:-1], out.shape[1])


def check_awq_config(config: TileConfig, rows: int, group_size: int) -> None:
    """Raise ValueError if ``config`` cannot run the AWQ kernel for ``rows`` rows and this group size."""
    config.check(rows, gemv=rows <= GEMV_MAX_ROWS)
    if rows > AWQ_CUDA_CORE_MAX_ROWS and rows <= GEMV_MAX_ROWS and not config.block_m:
        raise ValueError(f"{config}: the AWQ GEMV runs {rows} rows on tensor cores only (block_m=16); "
                         f"block_m=0 (CUDA cores) is for at most {AWQ_CUDA_CORE_MAX_ROWS} rows")
    if config.swap_ab and rows <= GEMV_MAX_ROWS:
        raise ValueError(f"{config}: the AWQ GEMV has no swapped form; swap_ab=True is for its GEMM "
                         f"(more than {GEMV_MAX_ROWS} rows)")
    if config.block_k < MIN_BLOCK_K:
        raise ValueError(f"block_k={config.block_k} is under {MIN_BLOCK_K}: a K step reads at least two "
                         "int32 words (8 k each) of every column")
    if config.block_m and group_size % config.block_k:
        raise ValueError(f"block_k={config.block_k} must divide group_size={group_size} on tl.dot "
                         "(block_m > 0): a K step there lies in one group")
    tile = max(config.block_m, config.block_n, config.block_k)
    if rows > GEMV_MAX_ROWS and (config.block_k < 32 or tile > 256):
        raise ValueError(f"{config}: the GEMM's TMA tiles need block_k >= 32 (16 bytes of words) and "
                         "block_m, block_n, block_k <= 256")


def _launch_gemv(x, qweight, qzeros, scales, bias, out, group_size: int, config: TileConfig,
                 norm: FoldedRMSNorm | None, gated: bool) -> None:
    rows, in_features = x.shape
    if not rows:
        return
    out_features = qweight.shape[0]
    check_gated(gated, out_features, config)
    k_per_split, num_splits = k_segments(in_features, config.block_k, config.split_k)
    tiles = triton.cdiv(out_features, config.block_n)
    partial, counters = split_k_scratch(rows, out_features, num_splits, tiles, out)
    _awq_gemv_kernel[(tiles, num_splits)](
        x, qweight, qzeros, scales, out if bias is None else bias, out, partial, counters,
        rows, out_features, in_features, k_per_split, num_splits, x.stride(0), qweight.stride(0),
        qzeros.stride(0), scales.stride(0), out.stride(0), partial.stride(0), partial.stride(1), _BITS_OF_128,
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, SPLIT=num_splits > 1,
        BLOCK_M=gemv_block_m(rows, config), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        STEP_GROUPS=max(1, config.block_k // group_size), USE_DOT=config.block_m > 0,
        PREFETCH=config.num_stages > 1, **fold_args(x, norm), GATED=gated,
        **dot_settings(x), **pdl_launch(x.device), num_warps=config.num_warps, num_stages=config.num_stages)


def _launch_gemm(x, qweight, qzeros, scales, bias, out, group_size: int, config: TileConfig) -> None:
    rows, in_features = x.shape
    k_per_split, num_splits = k_segments(in_features, config.block_k, config.split_k)
    grid = (triton.cdiv(rows, config.block_m), triton.cdiv(out.shape[1], config.block_n), num_splits)
    partial, counters = split_k_scratch(rows, out.shape[1], num_splits, grid[0] * grid[1], out)
    _awq_gemm_kernel[grid](
        TensorDescriptor.from_tensor(x, [config.block_m, config.block_k]),
        TensorDescriptor.from_tensor(qweight, [config.block_n, config.block_k // 8]), qzeros, scales,
        out if bias is None else bias, out, partial, counters, rows, out.shape[1], in_features, k_per_split,
        num_splits, qzeros.stride(0), scales.stride(0), out.stride(0), partial.stride(0), partial.stride(1),
        _BITS_OF_128, GROUP_SIZE=group_size, HAS_BIAS=bias is not None, SPLIT=num_splits > 1,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SWAP_AB=config.swap_ab,
        **dot_settings(x), **pdl_launch(x.device), num_warps=config.num_warps, num_stages=config.num_stages)
