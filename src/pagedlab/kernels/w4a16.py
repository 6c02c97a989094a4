"""W4A16 linear: ``x @ W + bias`` with ``W`` in AWQ's 4-bit GEMM format, dequantized in registers.

The format (``qweight``/``qzeros`` int32 with eight interleaved 4-bit values per word, ``scales``
per group of input rows) is described in ``pagedlab.quantization.awq``, whose ``awq_linear_torch``
is the plain-torch reference of ``awq_linear_triton`` here.

A program owns ``block_n // 8`` whole int32 words of every weight row it reads: it loads them
coalesced along N (the packed row is contiguous, 16 bytes a thread) and unpacks each word in the
thread that loaded it, one constant shift and one logic op per value, into the logical column
order (``_unpack_words``), so scales, zeros and outputs use plain column offsets.

Two kernels, picked by the row count (host ints only, so a CUDA graph can capture the call), each
launched with a ``TileConfig`` from ``gemv_configs.awq_config`` (measured table, else heuristic):

- at most ``GEMV_MAX_ROWS`` rows: a split-K GEMV (``kernels/gemv.py`` describes the K segments
  and their deterministic in-kernel sum). Its time is the weight read (half a byte per weight),
  so it keeps the instructions per weight few (checked in the SASS: about 4.4 per weight on the
  CUDA cores): a 4-bit value OR-ed into the mantissa of fp32 128.0 is the float ``128 + q``
  (no int-to-float instruction; exact in bf16/fp16 too), and a K step lies in one group, whose
  zero point, scale and the 128 come out of the sum:
  ``sum_k x (q - z) s = s (sum_k x (128 + q) - (128 + z) sum_k x)``. One row (``block_m == 0``)
  multiplies on the CUDA cores, keeping a partial sum per row of threads until the end; 1 to 16
  rows (``block_m == 16``) go through ``tl.dot``.
- more rows, where ``AWQ_CONFIGS`` lists the shape: a dequantize-in-the-loop GEMM: each K tile
  of the weight becomes ``(q - z) * s`` in ``x``'s dtype in registers and feeds ``tl.dot`` with
  fp32 accumulation.
- more rows otherwise (prefill chunks, most large decode batches): one kernel writes the
  dequantized weight and cuBLAS multiplies; on an H200 that beat the dequantizing GEMM at 64 and
  256 rows for every Llama-3-8B shape but gate/up at 64 (``benchmarks/gemv_bench.py``).

This module imports triton when it loads; Triton decides at decoration time whether a kernel is
compiled or interpreted (``TRITON_INTERPRET=1``), so import it lazily, after that is settled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.kernels.gemv import (dot_settings, gemv_block_m, k_segments, num_sms,
                                   split_k_epilogue, split_k_scratch)
from pagedlab.kernels.gemv_configs import GEMV_MAX_ROWS, TileConfig, awq_config
from pagedlab.kernels.pdl import pdl_launch
from pagedlab.kernels.pdl_jit import pdl_wait_and_trigger
from pagedlab.quantization.awq import VALUES_PER_INT32, awq_shapes

# fp32 128.0: a 4-bit value q OR-ed into mantissa bits 16..19 makes the float 128 + q.
_BITS_OF_128 = 0x43000000


@triton.jit
def _nibble(words, BIT: tl.constexpr, AT_BIT: tl.constexpr, bits):
    """The 4-bit values at bit BIT of ``words``, moved to bit AT_BIT, OR ``bits``."""
    if BIT <= AT_BIT:
        moved = words << (AT_BIT - BIT)
    else:
        moved = words >> (BIT - AT_BIT)  # arithmetic: the mask drops the copies of a set sign bit
    return (moved & (0xF << AT_BIT)) | bits


@triton.jit
def _unpack_words(words, AT_BIT: tl.constexpr, bits):
    """int32 ``[R, W]`` -> ``[R, 8 * W]`` int32 in logical column order: column ``j`` of a word
    holds the 4-bit value of nibble ``(j % 2) * 4 + j // 2`` at bits ``AT_BIT..AT_BIT+3``, OR
    ``bits``. Each nibble is a shift by a constant and one or two logic ops on the loaded words,
    in the thread that loaded them; the interleaves only place registers."""
    evens = tl.interleave(tl.interleave(_nibble(words, 0, AT_BIT, bits), _nibble(words, 8, AT_BIT, bits)),
                          tl.interleave(_nibble(words, 4, AT_BIT, bits), _nibble(words, 12, AT_BIT, bits)))
    odds = tl.interleave(tl.interleave(_nibble(words, 16, AT_BIT, bits), _nibble(words, 24, AT_BIT, bits)),
                         tl.interleave(_nibble(words, 20, AT_BIT, bits), _nibble(words, 28, AT_BIT, bits)))
    return tl.interleave(evens, odds)


@triton.jit
def _group_zeros_scales(qzeros_ptr, scales_ptr, group, offs_w, offs_n, w_valid, n_valid,
                        stride_qzeros, stride_scales, w_bits):
    """One group's zero points as fp32 ``128 + z`` (``[1, N]``) and its fp32 scales (``[N]``)."""
    zero_words = tl.load(qzeros_ptr + group * stride_qzeros + offs_w, mask=w_valid, other=0)
    zeros = _unpack_words(zero_words[None, :], 16, w_bits).to(tl.float32, bitcast=True)
    scales = tl.load(scales_ptr + group * stride_scales + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    return zeros, scales


@triton.jit
def _awq_gemv_tile(qweight_ptr, qzeros_ptr, scales_ptr, k_start, offs_w, offs_n, w_valid, n_valid,
                   stride_qweight, stride_qzeros, stride_scales, w_bits, GROUP_SIZE: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """The GEMV's K step at ``k_start`` (within one group): its weight words, zero points, scales."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    words = tl.load(qweight_ptr + offs_k[:, None] * stride_qweight + offs_w[None, :], mask=w_valid[None, :],
                    other=0)
    zeros, scales = _group_zeros_scales(qzeros_ptr, scales_ptr, k_start // GROUP_SIZE, offs_w, offs_n,
                                        w_valid, n_valid, stride_qzeros, stride_scales, w_bits)
    return words, zeros, scales


@triton.jit
def _awq_gemv_step(acc, words, zeros, scales, x_ptr, x_rows, k_start, m_valid, w_bits, BLOCK_K: tl.constexpr,
                   BLOCK_W: tl.constexpr, USE_DOT: tl.constexpr, ROW_THREADS: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc`` plus one K step: ``s * (sum_k x (128 + q) - (128 + z) * sum_k x)``."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    # fp32 128 + q: q in the mantissa bits 16..19 of 128.0 (w_bits); exact in bf16 and fp16 too
    w = _unpack_words(words, 16, w_bits).to(tl.float32, bitcast=True)
    if USE_DOT:
        x = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None], other=0.0)
        dots = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        x_sums = tl.sum(x.to(tl.float32), axis=1)
    else:  # one row
        x = tl.reshape(tl.load(x_ptr + offs_k).to(tl.float32), (BLOCK_K // ROW_THREADS, ROW_THREADS))
        w = tl.reshape(w, (BLOCK_K // ROW_THREADS, ROW_THREADS, BLOCK_W * 8))
        dots = tl.sum(x[:, :, None] * w, axis=0)
        x_sums = tl.sum(x, axis=0)
    return acc + scales[None, :] * (dots - zeros * x_sums[:, None])


@triton.jit(do_not_specialize=["M", "num_splits", "w_bits"])
def _awq_gemv_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                     M, N_WORDS, K, K_PER_SPLIT, num_splits, stride_x, stride_qweight, stride_qzeros,
                     stride_scales, stride_out, stride_partial_split, stride_partial_row, w_bits,
                     GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_DOT: tl.constexpr, ROW_THREADS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (column tile of BLOCK_W words, K segment) for all M <= BLOCK_M rows (tl.dot), or
    for the one row (CUDA cores), one ``_awq_gemv_step`` per K step. ``w_bits`` (the bits of 128.0)
    is a runtime value so that the compiler merges its OR with the nibble's AND into one logic op.
    With PDL the first K step's weights are read before the wait (``kernels/pdl.py``; segments
    are never empty, so that step always exists); without, the loop is the whole K segment."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_w = pid_n * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_n = pid_n * BLOCK_W * 8 + tl.arange(0, BLOCK_W * 8)
    w_valid = offs_w < N_WORDS
    n_valid = offs_n < N_WORDS * 8
    offs_m = tl.arange(0, BLOCK_M)
    m_valid = offs_m < M
    x_rows = x_ptr + offs_m[:, None] * stride_x
    # The CUDA cores keep one partial sum per row of threads (ROW_THREADS of them split a K step)
    # and add them up once at the end, not across threads at every step.
    acc = tl.zeros((BLOCK_M if USE_DOT else ROW_THREADS, BLOCK_W * 8), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    loop_begin = k_begin
    if PDL:  # the first K step's weights before the wait, the rest in the loop
        words, zeros, scales = _awq_gemv_tile(qweight_ptr, qzeros_ptr, scales_ptr, k_begin, offs_w, offs_n,
                                              w_valid, n_valid, stride_qweight, stride_qzeros, stride_scales,
                                              w_bits, GROUP_SIZE, BLOCK_K)
        pdl_wait_and_trigger(PDL)
        acc = _awq_gemv_step(acc, words, zeros, scales, x_ptr, x_rows, k_begin, m_valid, w_bits, BLOCK_K,
                             BLOCK_W, USE_DOT, ROW_THREADS, DOT_DTYPE, DOT_PRECISION)
        loop_begin = k_begin + BLOCK_K
    for k_start in range(loop_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        words, zeros, scales = _awq_gemv_tile(qweight_ptr, qzeros_ptr, scales_ptr, k_start, offs_w, offs_n,
                                              w_valid, n_valid, stride_qweight, stride_qzeros, stride_scales,
                                              w_bits, GROUP_SIZE, BLOCK_K)
        acc = _awq_gemv_step(acc, words, zeros, scales, x_ptr, x_rows, k_start, m_valid, w_bits, BLOCK_K,
                             BLOCK_W, USE_DOT, ROW_THREADS, DOT_DTYPE, DOT_PRECISION)
    if not USE_DOT:
        acc = tl.sum(acc, axis=0)[None, :]
    split_k_epilogue(acc, offs_m, offs_n, m_valid, n_valid, pid_n, split, num_splits,
                     partial_ptr, stride_partial_split, stride_partial_row, counter_ptr,
                     bias_ptr, out_ptr, stride_out, HAS_BIAS, SPLIT)


@triton.jit
def _dequantized_tile(qweight_ptr, qzeros_ptr, scales_ptr, offs_k, offs_w, offs_n, w_valid, n_valid, group,
                      stride_qweight, stride_qzeros, stride_scales, w_bits):
    """The float32 weights ``(q - z) * s`` of rows ``offs_k`` (one group) and words ``offs_w``."""
    words = tl.load(qweight_ptr + offs_k.to(tl.int64)[:, None] * stride_qweight + offs_w[None, :],
                    mask=w_valid[None, :], other=0)
    zeros, scales = _group_zeros_scales(qzeros_ptr, scales_ptr, group, offs_w, offs_n, w_valid, n_valid,
                                        stride_qzeros, stride_scales, w_bits)
    # 128 + q, as in the GEMV, less 128 + z
    return (_unpack_words(words, 16, w_bits).to(tl.float32, bitcast=True) - zeros) * scales[None, :]


@triton.jit(do_not_specialize=["w_bits"])
def _awq_gemm_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr, M, N_WORDS, K,
                     stride_x, stride_qweight, stride_qzeros, stride_scales, stride_out, w_bits,
                     GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (row tile, column tile) of the output. Row tiles vary fastest over the grid, so
    programs running together share a weight tile (dequantized from L2, read from HBM once).
    PDL: waits first (a prefill-sized GEMM has nothing to gain from one early weight tile)."""
    pdl_wait_and_trigger(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = pid_n * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_n = pid_n * BLOCK_W * 8 + tl.arange(0, BLOCK_W * 8)
    m_valid = offs_m < M
    w_valid = offs_w < N_WORDS
    n_valid = offs_n < N_WORDS * 8
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_W * 8), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        w = _dequantized_tile(qweight_ptr, qzeros_ptr, scales_ptr, offs_k, offs_w, offs_n, w_valid, n_valid,
                              k_start // GROUP_SIZE, stride_qweight, stride_qzeros, stride_scales,
                              w_bits).to(DOT_DTYPE)
        x = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None], other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), w, acc, input_precision=DOT_PRECISION)
    split_k_epilogue(acc, offs_m, offs_n, m_valid, n_valid, pid_n, 0, 1, out_ptr, 0, 0, out_ptr,
                     bias_ptr, out_ptr, stride_out, HAS_BIAS, False)


@triton.jit(do_not_specialize=["w_bits"])
def _awq_dequantize_kernel(qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, N_WORDS, K, stride_qweight,
                           stride_qzeros, stride_scales, stride_out, w_bits, GROUP_SIZE: tl.constexpr,
                           BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (K tile within one group, column tile): ``(q - z) * s`` rounded to the output's dtype,
    the same values the GEMM's tiles feed tl.dot. It reads only the weight, so with PDL it computes
    the tile before the wait and only stores after it."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_w = pid_n * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_n = pid_n * BLOCK_W * 8 + tl.arange(0, BLOCK_W * 8)
    w_valid = offs_w < N_WORDS
    n_valid = offs_n < N_WORDS * 8
    w = _dequantized_tile(qweight_ptr, qzeros_ptr, scales_ptr, offs_k, offs_w, offs_n, w_valid, n_valid,
                          pid_k * BLOCK_K // GROUP_SIZE, stride_qweight, stride_qzeros, stride_scales, w_bits)
    pdl_wait_and_trigger(PDL)
    out = out_ptr + offs_k.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=n_valid[None, :])


def awq_dequantize_triton(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """Triton version of ``dequantize_awq``: the weight ``[in_features, out_features]`` in ``dtype``
    (each value ``(q - z) * s`` computed in float32, then rounded), for cuBLAS to multiply."""
    in_features, out_features = awq_shapes(qweight, qzeros, scales, group_size)
    out = torch.empty(in_features, out_features, dtype=dtype, device=qweight.device)
    block_k, block_w = min(group_size, 32), 32
    grid = (in_features // block_k, triton.cdiv(qweight.shape[1], block_w))
    _awq_dequantize_kernel[grid](qweight, qzeros, scales, out, qweight.shape[1], in_features,
                                 qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
                                 _BITS_OF_128, GROUP_SIZE=group_size, BLOCK_W=block_w, BLOCK_K=block_k,
                                 **pdl_launch(qweight.device), num_warps=4)
    return out


def awq_linear_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      group_size: int, bias: torch.Tensor | None = None,
                      config: TileConfig | None = None) -> torch.Tensor:
    """Triton version of ``awq_linear_torch``: ``x`` ``[..., in_features]`` in float16, bfloat16
    or float32 -> ``[..., out_features]`` in ``x``'s dtype.

    The tensors may be views (e.g. tensor-parallel shards) as long as their last dimension is
    contiguous. ``config`` (default: ``gemv_configs.awq_config``) sets the tiles; with at most
    ``GEMV_MAX_ROWS`` rows it runs the GEMV; more rows run the GEMM where the table lists it,
    else the weight is dequantized and cuBLAS multiplies (measured faster for most shapes)."""
    in_features, out_features = awq_shapes(qweight, qzeros, scales, group_size)
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the AWQ weight {in_features} inputs")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not supported: float16, bfloat16 or float32")
    x2d = x.reshape(-1, in_features)
    rows = x2d.shape[0]
    tensors = {"x": x2d, "qweight": qweight, "qzeros": qzeros, "scales": scales, "bias": bias}
    for name, tensor in tensors.items():
        if tensor is not None and tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    config = config or awq_config(rows, out_features, in_features, group_size, num_sms(x.device))
    if config is None:
        out = x2d @ awq_dequantize_triton(qweight, qzeros, scales, group_size, x.dtype)
        return (out if bias is None else out + bias.to(x.dtype)).view(*x.shape[:-1], out_features)
    check_awq_config(config, rows, group_size)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows:
        launch = _launch_gemv if rows <= GEMV_MAX_ROWS else _launch_gemm
        launch(x2d, qweight, qzeros, scales, bias, out, group_size, config)
    return out.view(*x.shape[:-1], out_features)


def check_awq_config(config: TileConfig, rows: int, group_size: int) -> None:
    """Raise ValueError if ``config`` cannot run the AWQ kernel for ``rows`` rows and this group size."""
    config.check(rows, gemv=rows <= GEMV_MAX_ROWS)
    if rows > 1 and rows <= GEMV_MAX_ROWS and not config.block_m:
        raise ValueError(f"{config}: the AWQ GEMV runs {rows} rows on tensor cores only (block_m=16); "
                         "block_m=0 (CUDA cores) is for one row")
    if config.block_n < VALUES_PER_INT32:
        raise ValueError(f"block_n={config.block_n} must hold whole int32 words: at least 8 columns")
    if group_size % config.block_k:
        raise ValueError(f"block_k={config.block_k} must divide group_size={group_size}: a K step reads "
                         "one group's zero points and scales")


def row_threads(block_w: int, block_k: int, num_warps: int) -> int:
    """How many threads share a column of the GEMV's ``[block_k, block_w]`` word tile in Triton's
    coalesced layout (16-byte loads: 4 words a thread along N, the rest of a warp and then the
    warps along K). Only a performance hint: any power of two up to block_k gives the same sums."""
    lanes_n = min(32, max(1, block_w // 4))
    warps_n = min(num_warps, max(1, block_w // (4 * lanes_n)))
    return min(block_k, (32 // lanes_n) * (num_warps // warps_n))


def _launch_gemv(x, qweight, qzeros, scales, bias, out, group_size: int, config: TileConfig) -> None:
    rows, in_features = x.shape
    out_features = out.shape[1]
    k_per_split, num_splits = k_segments(in_features, config.block_k, config.split_k)
    tiles = triton.cdiv(out_features, config.block_n)
    partial, counters = split_k_scratch(rows, out_features, num_splits, tiles, out)
    _awq_gemv_kernel[(tiles, num_splits)](
        x, qweight, qzeros, scales, out if bias is None else bias, out, partial, counters,
        rows, qweight.shape[1], in_features, k_per_split, num_splits, x.stride(0), qweight.stride(0),
        qzeros.stride(0), scales.stride(0), out.stride(0), partial.stride(0), partial.stride(1), _BITS_OF_128,
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, SPLIT=num_splits > 1,
        BLOCK_M=gemv_block_m(rows, config), BLOCK_W=config.block_n // VALUES_PER_INT32,
        BLOCK_K=config.block_k, USE_DOT=config.block_m > 0,
        ROW_THREADS=row_threads(config.block_n // VALUES_PER_INT32, config.block_k, config.num_warps),
        **dot_settings(x), **pdl_launch(x.device), num_warps=config.num_warps, num_stages=config.num_stages)


def _launch_gemm(x, qweight, qzeros, scales, bias, out, group_size: int, config: TileConfig) -> None:
    rows, in_features = x.shape
    grid = (triton.cdiv(rows, config.block_m), triton.cdiv(out.shape[1], config.block_n))
    _awq_gemm_kernel[grid](
        x, qweight, qzeros, scales, out if bias is None else bias, out, rows, qweight.shape[1], in_features,
        x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0), _BITS_OF_128,
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, BLOCK_M=config.block_m,
        BLOCK_W=config.block_n // VALUES_PER_INT32, BLOCK_K=config.block_k, **dot_settings(x),
        **pdl_launch(x.device), num_warps=config.num_warps, num_stages=config.num_stages)
