"""Dense 16-bit GEMV for small batches, ``y = x @ weight.T + bias`` with ``weight`` ``[N, K]`` as
``nn.Linear`` stores it, and the split-K machinery it shares with the W4A16 kernels.

At batch 1 to 16 a linear layer is a weight read: every program owns ``block_n`` weight rows (or
columns of a packed weight) and one of ``split_k`` segments of K, so that enough programs run to
keep HBM busy. The segments' fp32 partial sums go to a scratch buffer; each program then takes a
ticket from a per-column-tile counter, and the program that draws the last ticket adds the
segments in segment order (the same order whichever program finishes last, so results repeat
from run to run), adds the bias, writes the output and resets the counter for the next launch.
One kernel per linear, no host sync, no memset: a CUDA graph captures it as is.

The counters live in one buffer per device made at the first split-K call (the model runner's
eager warm-up, before any capture); two split-K kernels must not run at once on one device
(the engine runs one stream).

With a ``GemvLoRA`` (``kernels/gemv_lora.py``; ``kernels/lora.py``'s ``linear_with_lora``, a
LoRA linear whose base runs this kernel) the epilogue also adds each row's adapter delta, in fp32
before the output is rounded: the LoRA shrink's partial sums of the row (summed over the shrink's
splits) times the B rows of the row's slot for the program's columns, a column tile lying in one
fused slice. With split-K it rides in segment 0's partial sums, so the last program's in-order sum
adds it once. Rows without a slot add nothing. This replaces the separate ``lora_expand`` launch
after the GEMV.

``dense_gemv_torch`` is the reference; ``pagedlab.quantization.linear_method.dense_linear`` picks
this kernel only where ``gemv_configs.DENSE_GEMV_CONFIGS`` (measured) says it beats cuBLAS.
This module imports triton when it loads: import it lazily (see ``kernels/w4a16.py``).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from pagedlab.kernels.norm_fold import FoldedRMSNorm
from pagedlab.kernels.norm_fold_kernels import fold_args, fold_rstd, folded_rstd, load_input, norm_sums
from pagedlab.kernels.gemv_configs import GEMV_MAX_ROWS, TileConfig, default_dense_gemv_config
from pagedlab.kernels.gemv_lora import GemvLoRA, lora_delta, lora_partials, lora_row_slots, no_lora_args
from pagedlab.kernels.pdl import pdl_launch
from pagedlab.kernels.pdl_jit import pdl_wait_and_trigger

SPLIT_K_COUNTERS = 1 << 16
# A one-row launch (block_m=0, one row) with num_stages of at least this reads each next K step's
# weights and activations before this step's products (the kernel's PREFETCH). Fewer stages leave
# that loop as it was: it holds no tl.dot, so Triton's pipeliner stages nothing in it (the sm_90
# SASS of the tables' one-row tiles is the same byte for byte at num_stages 1, 2 and 3).
ONE_ROW_PREFETCH_STAGES = 4
# K of a swapped FP8 dot summed on the tensor cores before its sum joins the fp32 accumulator:
# DeepSeek-V3's interval for Hopper's FP8 GEMMs (their report, section 3.3.2).
FP8_PROMOTION_K = 128
TRITON_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def split_k_epilogue(acc, offs_m, offs_n, m_valid, n_valid, pid_n, split, num_splits,
                     partial_ptr, stride_partial_split, stride_partial_row, counter_ptr,
                     bias_ptr, out_ptr, stride_out, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     GATED: tl.constexpr = False, tile_max_ptr=None, TILE_MAX: tl.constexpr = False):
    """Write ``acc`` ``[BLOCK_M, BLOCK_N]`` (rows ``offs_m``, output columns ``offs_n`` in any
    order) plus the bias; with SPLIT, as this segment's share, the last segment of the column
    tile to finish summing all of them in segment order. GATED, TILE_MAX: ``_store_output``'s."""
    mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT:
        cells = offs_m[:, None] * stride_partial_row + offs_n[None, :]
        tl.store(partial_ptr + split * stride_partial_split + cells, acc, mask=mask)
        # Every thread's partial sums are stored before one thread publishes them (release).
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            total = tl.zeros_like(acc)
            for segment in range(0, num_splits):
                total += tl.load(partial_ptr + segment * stride_partial_split + cells, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(counter_ptr + pid_n, 0)
            _store_output(total, offs_m, offs_n, mask, n_valid, bias_ptr, out_ptr, stride_out, HAS_BIAS,
                          GATED, tile_max_ptr, pid_n, TILE_MAX)
    else:
        _store_output(acc, offs_m, offs_n, mask, n_valid, bias_ptr, out_ptr, stride_out, HAS_BIAS, GATED,
                      tile_max_ptr, pid_n, TILE_MAX)


@triton.jit
def column_tile(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """``(offs_n, n_valid)``: the output columns of column tile ``pid_n``, BLOCK_N in a row, or
    GATED in two halves, BLOCK_N / 2 gate columns c.. then the up columns c + N / 2.. (for
    ``_store_output``)."""
    if GATED:
        lanes = tl.arange(0, BLOCK_N)
        gate_cols = pid_n * (BLOCK_N // 2) + lanes % (BLOCK_N // 2)
        return gate_cols + (lanes // (BLOCK_N // 2)) * (N // 2), gate_cols < N // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_n, offs_n < N


@triton.jit
def _store_output(acc, offs_m, offs_n, mask, n_valid, bias_ptr, out_ptr, stride_out, HAS_BIAS: tl.constexpr,
                  GATED: tl.constexpr = False, tile_max_ptr=None, pid_n=0, TILE_MAX: tl.constexpr = False):
    """GATED: the columns come in two halves, gate columns c.. then up columns ``c + N / 2``..
    (``column_tile``): write ``silu(gate) * up`` at column c, each of gate and up first rounded to
    the output's dtype as the GEMV writes them (``silu_and_mul`` after the GEMV, compiled).
    TILE_MAX: also ``max|out|`` of each row's columns of this tile, as written (in the output's
    dtype), into ``tile_max[row, pid_n]`` (float32, a row per launch's column tiles): an FP8
    quantization's per-row scale is the maximum of these (``kernels/fp8_linear.py``)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    if GATED:
        half: tl.constexpr = acc.shape[1] // 2
        rounded = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # as the GEMV writes gate and up
        gate, up = tl.split(tl.permute(tl.reshape(rounded, (acc.shape[0], 2, half)), (0, 2, 1)))
        acc = gate * tl.sigmoid(gate) * up
        offs_n, _ = tl.split(tl.permute(tl.reshape(offs_n, (2, half)), (1, 0)))
        mask, _ = tl.split(tl.permute(tl.reshape(mask.to(tl.int8), (acc.shape[0], 2, half)), (0, 2, 1)))
        mask = mask != 0
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if TILE_MAX:
        written = tl.abs(acc.to(out_ptr.dtype.element_ty).to(tl.float32))
        row_max = tl.max(tl.where(mask, written, 0.0), axis=1)
        row_valid = tl.max(mask.to(tl.int32), axis=1) > 0
        tl.store(tile_max_ptr + offs_m.to(tl.int64) * tl.num_programs(0) + pid_n, row_max, mask=row_valid)


@triton.jit
def _weight_tile(w_rows, offs_k, n_valid, K):
    """The weight rows ``w_rows`` at columns ``offs_k`` (zero past N and K)."""
    return tl.load(w_rows + offs_k[None, :], mask=n_valid[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _gemv_step(acc, squares, x_rows, res_rows, g_ptr, summed_ptr, write_summed, offs_k, m_valid, K, w,
               USE_DOT: tl.constexpr,
               ONE_ROW: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
               SWAP_AB: tl.constexpr, FP8_ACC_CHUNK: tl.constexpr, NORM: tl.constexpr,
               RESIDUAL: tl.constexpr, NORM_SUMS: tl.constexpr):
    """``(acc, squares)``: ``acc`` plus one K step's products of ``w`` (the step's weight tile,
    already loaded) and x (NORM: ``load_input``'s), and (NORM_SUMS, one row) ``squares`` plus the
    step's squares of the norm's ``x + residual``, which ``write_summed`` stores; SWAP_AB: ``acc``
    is ``[BLOCK_N, BLOCK_M]``, the weight tile the dot's A operand."""
    k_valid = offs_k < K
    if ONE_ROW:
        x, summed = load_input(x_rows + offs_k, res_rows + offs_k, g_ptr + offs_k, k_valid, k_valid, NORM,
                               RESIDUAL)
        acc = acc + x.to(tl.float32)[None, :] * w.to(tl.float32)
        if NORM_SUMS:
            squares += summed * summed
            if RESIDUAL and write_summed:
                tl.store(summed_ptr + offs_k, summed.to(summed_ptr.dtype.element_ty), mask=k_valid)
    else:
        x, _ = load_input(x_rows + offs_k[None, :], res_rows + offs_k[None, :], g_ptr + offs_k[None, :],
                       m_valid[:, None] & k_valid[None, :], k_valid[None, :], NORM, RESIDUAL)
        if USE_DOT and SWAP_AB:
            acc = tl.dot(w.to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION,
                         max_num_imprecise_acc=FP8_ACC_CHUNK)
        elif USE_DOT:
            acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
        else:
            acc = acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc, squares


@triton.jit
def _fp8_pairs(pairs):
    """The two bytes (little-endian) of each int16 of ``pairs``, side by side in a new last axis,
    as the float32 of their FP8 E4M3."""
    fp8 = tl.join(pairs & 0xFF, (pairs >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return fp8.to(tl.float32)


@triton.jit
def _step_x(x_rows, res_rows, g_ptr, offs, end, w, PAIRS: tl.constexpr, NORM: tl.constexpr,
            RESIDUAL: tl.constexpr):
    """One-row PREFETCH: the activations at ``offs`` (zero from ``end`` on; NORM: ``load_input``'s);
    PAIRS (FP8) in ``w``'s shape and layout, each thread its own (from L1) rather than broadcast
    through shared memory (a store, a load and two barriers a step in the plain loop's sm_90 SASS)."""
    if PAIRS:
        return tl.load(x_rows + tl.broadcast_to(offs[None, :], w.shape), mask=offs[None, :] < end, other=0)
    else:
        valid = offs < end
        return load_input(x_rows + offs, res_rows + offs, g_ptr + offs, valid, valid, NORM, RESIDUAL)[0]


@triton.jit
def _prefetch_step(acc, x, w, x_rows, res_rows, g_ptr, w_rows, offs, n_valid, end, BLOCK: tl.constexpr,
                   PAIRS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """One-row PREFETCH: ``acc`` plus the products of ``x`` and ``w`` (this step's activations and
    weight tile at ``offs``, read a step earlier), with the next step's read first (nothing from
    ``end`` on), so that they are in flight during these products; returns them too. PAIRS (FP8):
    ``offs``, ``end`` and ``BLOCK`` count int16 pairs of values, ``acc`` is ``[BLOCK_N, BLOCK,
    2]``. FP8 bytes carried over the loop's back edge took a register each and were repacked
    for the converts (sm_90 SASS, the 4 x 512 tile: 131 instructions a step, 50 registers); pairs
    convert as loaded (96 instructions, 48 registers, no barrier; the plain loop's 84 hold two)."""
    next_offs = offs + BLOCK
    next_w = _weight_tile(w_rows, next_offs, n_valid, end)
    next_x = _step_x(x_rows, res_rows, g_ptr, next_offs, end, next_w, PAIRS, NORM, RESIDUAL)
    if PAIRS:
        acc = acc + _fp8_pairs(x) * _fp8_pairs(w)
    else:
        acc = acc + x.to(tl.float32)[None, :] * w.to(tl.float32)
    return acc, next_x, next_w


@triton.jit(do_not_specialize=["M", "num_splits"])
def _dense_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr, row_scale_ptr,
                       col_scale_ptr, M, N, K, K_PER_SPLIT, num_splits, stride_x, stride_w, stride_out,
                       stride_partial_split, stride_partial_row, lora_h_ptr, lora_b_ptr, lora_slots_ptr,
                       lora_rank, lora_splits, lora_size0, lora_size1, stride_h_split, stride_h_slice,
                       stride_h_row, stride_b_slot, stride_b_slice, stride_b_row, res_ptr, norm_w_ptr,
                       summed_ptr, normed_ptr, eps, HAS_BIAS: tl.constexpr,
                       SPLIT: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                       ONE_ROW: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       LORA: tl.constexpr, LORA_BLOCK_S: tl.constexpr, LORA_BLOCK_R: tl.constexpr,
                       PREFETCH: tl.constexpr, SWAP_AB: tl.constexpr, FP8_ACC_CHUNK: tl.constexpr,
                       NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
                       WRITE_NORMED: tl.constexpr, NORM_SUMS: tl.constexpr, GATED: tl.constexpr,
                       PDL: tl.constexpr, tile_max_ptr=None, TILE_MAX: tl.constexpr = False):
    """Program (weight-row tile, K segment) for all M <= BLOCK_M rows of x. On the CUDA cores
    (not USE_DOT) the products are kept per K lane and summed once at the end (ONE_ROW: a 2-D
    tile, which compiles to plain vector loads and FMAs; more rows: a 3-D one); with USE_DOT the rows
    are padded to BLOCK_M for tensor cores, as the dot's A operand or (SWAP_AB) its B, the weight
    tile then being A, BLOCK_N on wgmma's M. SCALED (FP8 operands): each segment's sums are
    multiplied by the row's and the output column's float32 scales. For one row the first K step
    is peeled out of the loop and its weight tile read before the PDL wait (``kernels/pdl.py``:
    weights do not depend on the previous kernel), the form measured fastest on the H200. With
    PREFETCH (one row only, ``ONE_ROW_PREFETCH_STAGES``) every step first reads the next step's
    weights and activations (the first step's before the wait, as without), so that a thread has
    loads in flight while it multiplies: the plain loop's thread issues one step's loads and waits
    for them (sm_90 SASS: the FP8 4 x 512 tile, one 16-byte weight load a thread a step). The
    products are the same either way, each K lane's sum in the same order (FP8: its lanes summed
    in another, ``_prefetch_step``). The dot
    and multi-row paths wait first and loop over the whole K segment, as measured without PDL:
    peeled under PDL (few K steps per split left to pipeline), Gemma-2-9B, whose GEMVs take these
    paths, ran a batch-1 step in 6.68 ms against 6.31 with PDL off (not yet isolated).
    LORA: segment 0 adds each row's adapter delta (the module docstring). One row reads its slot
    (the step's constant) with its first weight tile, the shrink's partial sums right after the
    wait, and sums them over the splits after its first K step (whose weights it waits for
    anyway); B only after the loop: B, or the unsummed partial sums, held through the loop took
    the one-row q/k/v tile (8 x 512) from 96 to 107-109 registers (ptxas, sm_90), one program less
    per SM; as placed, no Llama-3-8B one-row tile needs more registers than without LoRA. More
    rows read everything after the loop. NORM: x is a folded RMSNorm's input (``kernels/norm_fold.py``):
    each program takes its rows' 1/rms right after the wait (``fold_rstd``; program (0, 0) writes the
    norm's outputs), multiplies ``load_input``'s values and scales its sums by the 1/rms. With
    NORM_SUMS (one row over the whole of K, no PREFETCH) it sums the squares in its loop instead:
    program p stores step p's ``x + residual`` there, and program 0 the normalized copy after it."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n, n_valid = column_tile(pid_n, N, BLOCK_N, GATED)
    m_valid = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    if ONE_ROW:
        x_rows = x_ptr
        res_rows = res_ptr
        if PREFETCH and SCALED:  # int16 pairs of FP8 values (_prefetch_step)
            w_rows = w_ptr.to(tl.pointer_type(tl.int16)) + offs_n.to(tl.int64)[:, None] * (stride_w // 2)
            x_rows = x_ptr.to(tl.pointer_type(tl.int16))
            acc = tl.zeros((BLOCK_N, BLOCK_K // 2, 2), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        x_rows = x_ptr + offs_m[:, None] * stride_x
        res_rows = res_ptr + offs_m[:, None] * stride_x
        if USE_DOT and SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        elif USE_DOT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    loop_begin = k_begin
    UNIT: tl.constexpr = 2 if SCALED else 1  # the one-row PREFETCH reads FP8 in int16 pairs
    if ONE_ROW:  # the first weight tile (before the PDL wait), the rest in the loop
        if PREFETCH:  # in units of UNIT values
            offs_k = k_begin // UNIT + tl.arange(0, BLOCK_K // UNIT)
            w = _weight_tile(w_rows, offs_k, n_valid, K // UNIT)
        else:
            offs_k = k_begin + tl.arange(0, BLOCK_K)
            w = _weight_tile(w_rows, offs_k, n_valid, K)
        if LORA:
            lora_rows, lora_slot, part, first = lora_row_slots(lora_slots_ptr, offs_m, m_valid, split,
                                                               pid_n * BLOCK_N, lora_size0, lora_size1)
        pdl_wait_and_trigger(PDL)
        if NORM and not NORM_SUMS:
            rstd = fold_rstd(x_ptr, res_ptr, norm_w_ptr, summed_ptr, normed_ptr, stride_x, M, K, eps,
                             (pid_n == 0) & (split == 0), BLOCK_M, NORM_BLOCK, RESIDUAL, WRITE_NORMED)
        if LORA:
            lora_h = lora_partials(lora_h_ptr, part, lora_rows, offs_m, lora_splits, lora_rank,
                                   stride_h_split, stride_h_slice, stride_h_row, LORA_BLOCK_S, LORA_BLOCK_R)
        if PREFETCH:
            k_end = tl.minimum(k_begin + K_PER_SPLIT, K) // UNIT
            x = _step_x(x_rows, res_rows, norm_w_ptr, offs_k, K // UNIT, w, SCALED, NORM, RESIDUAL)
            acc, x, w = _prefetch_step(acc, x, w, x_rows, res_rows, norm_w_ptr, w_rows, offs_k, n_valid,
                                       k_end, BLOCK_K // UNIT, SCALED, NORM, RESIDUAL)
        else:
            acc, squares = _gemv_step(acc, squares, x_rows, res_rows, norm_w_ptr, summed_ptr, pid_n == 0,
                                      offs_k, m_valid, K, w, USE_DOT, ONE_ROW, DOT_DTYPE, DOT_PRECISION,
                                      SWAP_AB, FP8_ACC_CHUNK, NORM, RESIDUAL, NORM_SUMS)
        if LORA:
            lora_h = tl.sum(lora_h, axis=0)
        loop_begin = k_begin + BLOCK_K
    else:
        pdl_wait_and_trigger(PDL)
        if NORM:
            rstd = fold_rstd(x_ptr, res_ptr, norm_w_ptr, summed_ptr, normed_ptr, stride_x, M, K, eps,
                             (pid_n == 0) & (split == 0), BLOCK_M, NORM_BLOCK, RESIDUAL, WRITE_NORMED)
    for k_start in range(loop_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        if PREFETCH:
            offs_k = k_start // UNIT + tl.arange(0, BLOCK_K // UNIT)
            acc, x, w = _prefetch_step(acc, x, w, x_rows, res_rows, norm_w_ptr, w_rows, offs_k, n_valid,
                                       k_end, BLOCK_K // UNIT, SCALED, NORM, RESIDUAL)
        else:
            offs_k = k_start + tl.arange(0, BLOCK_K)
            w = _weight_tile(w_rows, offs_k, n_valid, K)
            # NORM_SUMS: program p stores step p's x + residual
            acc, squares = _gemv_step(acc, squares, x_rows, res_rows, norm_w_ptr, summed_ptr,
                                      pid_n == (k_start - k_begin) // BLOCK_K, offs_k, m_valid, K, w,
                                      USE_DOT, ONE_ROW, DOT_DTYPE, DOT_PRECISION, SWAP_AB, FP8_ACC_CHUNK,
                                      NORM, RESIDUAL, NORM_SUMS)
    if ONE_ROW:
        if PREFETCH and SCALED:
            acc = tl.sum(acc, axis=2)
        acc = tl.sum(acc, axis=1)[None, :]
    elif not USE_DOT:
        acc = tl.sum(acc, axis=2)
    elif SWAP_AB:
        acc = tl.trans(acc)
    if SCALED:
        acc *= tl.load(row_scale_ptr + offs_m, mask=m_valid, other=0.0)[:, None]
        acc *= tl.load(col_scale_ptr + offs_n, mask=n_valid, other=0.0)[None, :]
    if NORM_SUMS:
        rstd = folded_rstd(tl.sum(squares), x_ptr, res_ptr, norm_w_ptr, summed_ptr, normed_ptr, K, eps,
                           pid_n == 0, NORM_BLOCK, RESIDUAL, WRITE_NORMED)
    if NORM:
        acc *= rstd[:, None]
    if LORA:
        if not ONE_ROW:
            lora_rows, lora_slot, part, first = lora_row_slots(lora_slots_ptr, offs_m, m_valid, split,
                                                               pid_n * BLOCK_N, lora_size0, lora_size1)
            lora_h = tl.sum(lora_partials(lora_h_ptr, part, lora_rows, offs_m, lora_splits, lora_rank,
                                          stride_h_split, stride_h_slice, stride_h_row, LORA_BLOCK_S,
                                          LORA_BLOCK_R), axis=0)
        acc += lora_delta(lora_h, lora_b_ptr, lora_rows, lora_slot, part, first, offs_n, n_valid, lora_rank,
                          stride_b_slot, stride_b_slice, stride_b_row, LORA_BLOCK_R)
    split_k_epilogue(acc, offs_m, offs_n, m_valid, n_valid, pid_n, split, num_splits,
                     partial_ptr, stride_partial_split, stride_partial_row, counter_ptr,
                     bias_ptr, out_ptr, stride_out, HAS_BIAS, SPLIT, GATED, tile_max_ptr, TILE_MAX)


def dense_gemv_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in ``x``'s dtype: the reference of ``dense_gemv_triton``."""
    out = x @ weight.to(x.dtype).T
    return out if bias is None else out + bias.to(x.dtype)


def dense_gemv_triton(x: torch.Tensor | FoldedRMSNorm, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: TileConfig | None = None, lora: GemvLoRA | None = None,
                      gated: bool = False) -> torch.Tensor:
    """Triton version of ``dense_gemv_torch`` for ``x`` ``[..., K]`` of at most ``GEMV_MAX_ROWS``
    rows (float16, bfloat16 or float32, ``weight``'s dtype); ``config`` defaults to
    ``default_dense_gemv_config``. With ``lora``, plus each row's adapter delta. ``x`` may be a
    ``FoldedRMSNorm``: the norm computed in the kernel (its reference: ``x.materialize()`` first)."""
    norm = x if isinstance(x, FoldedRMSNorm) else None
    if norm is not None:
        norm.check()
        x = norm.x
    out_features, in_features = weight.shape
    check_dense_operands(x, weight)
    x2d = x.reshape(-1, in_features)
    rows = x2d.shape[0]
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"{rows} rows is over the GEMV's {GEMV_MAX_ROWS}: use F.linear")
    for name, tensor in {"x": x2d, "weight": weight, "bias": bias}.items():
        if tensor is not None and tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    config = config or default_dense_gemv_config(rows, out_features, in_features, num_sms(x.device))
    out = torch.empty(rows, out_features // 2 if gated else out_features, dtype=x.dtype, device=x.device)
    if rows:
        launch_dense_gemv(x2d, weight, bias, out, config, lora=lora, norm=norm, gated=gated)
    return out.view(*x.shape[:-1], out.shape[1])


def check_dense_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise ValueError unless ``x`` ``[..., K]`` fits ``weight`` ``[N, K]`` and both are float16,
    bfloat16 or float32 of one dtype."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.shape[1]} inputs")
    if x.dtype not in TRITON_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x dtype {x.dtype} with weight dtype {weight.dtype}: both must be one of "
                         "float16, bfloat16, float32")


def launch_dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                      config: TileConfig, row_scales: torch.Tensor | None = None,
                      col_scales: torch.Tensor | None = None, lora: GemvLoRA | None = None,
                      norm: FoldedRMSNorm | None = None, gated: bool = False,
                      tile_max: torch.Tensor | None = None) -> None:
    """``out`` ``[rows, N]`` = ``x`` ``[rows, K]`` @ ``weight.T`` (times ``row_scales[m] *
    col_scales[n]`` when given: FP8 operands) + ``bias`` (+ the ``lora`` deltas, not with FP8);
    with ``norm`` (16-bit operands, no LoRA), x is ``norm.x`` and the norm is folded in; with
    ``gated`` (no LoRA) ``out`` is ``[rows, N / 2]``, ``silu(gate) * up`` of the two halves of
    the product, and ``tile_max`` (gated only; float32 ``[rows, column tiles]``, contiguous) takes
    each row's ``max|out|`` per column tile; shapes checked by the caller."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    config.check(rows, gemv=True)
    if (norm is not None and row_scales is not None) or ((norm is not None or gated) and lora is not None):
        raise ValueError("the GEMV folds an RMSNorm into 16-bit operands, and an RMSNorm or SiLU-and-mul "
                         "without LoRA, only")
    check_gated(gated, out_features, config)
    if lora is not None:
        if row_scales is not None:
            raise ValueError("the GEMV adds LoRA deltas to 16-bit operands only, not FP8")
        lora.check(rows, out_features, config.block_n)
    k_per_split, num_splits = k_segments(in_features, config.block_k, config.split_k)
    tiles = triton.cdiv(out_features, config.block_n)  # gated: half the columns, in tiles of half
    _check_tile_max(tile_max, gated, rows, tiles)
    partial, counters = split_k_scratch(rows, out_features, num_splits, tiles, out)
    scaled = row_scales is not None
    one_row = rows == 1 and config.block_m == 0
    prefetch = one_row and config.num_stages >= ONE_ROW_PREFETCH_STAGES
    if prefetch and scaled and (in_features % 2 or weight.stride(0) % 2 or weight.data_ptr() % 2 or
                                x.data_ptr() % 2):
        raise ValueError(f"{config}: the FP8 prefetch reads pairs of bytes, K={in_features} and the weight's "
                         f"row stride {weight.stride(0)} must be even (and x and the weight 2-byte aligned)")
    _dense_gemv_kernel[(tiles, num_splits)](
        x, weight, out if bias is None else bias, out, partial, counters,
        row_scales if scaled else out, col_scales if scaled else out, rows, out_features,
        in_features, k_per_split, num_splits, x.stride(0), weight.stride(0), out.stride(0),
        partial.stride(0), partial.stride(1), HAS_BIAS=bias is not None, SPLIT=num_splits > 1, SCALED=scaled,
        BLOCK_M=gemv_block_m(rows, config), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=config.block_m > 0, ONE_ROW=one_row, **gemv_dot_settings(x, config),
        PREFETCH=prefetch,
        **(lora.kernel_args() if lora is not None else no_lora_args(out)), **fold_args(x, norm),
        NORM_SUMS=norm_sums(norm, one_row and not prefetch, num_splits, k_per_split // config.block_k, tiles),
        GATED=gated, tile_max_ptr=out if tile_max is None else tile_max, TILE_MAX=tile_max is not None,
        **pdl_launch(x.device), num_warps=config.num_warps, num_stages=config.num_stages)


def _check_tile_max(tile_max: torch.Tensor | None, gated: bool, rows: int, tiles: int) -> None:
    if tile_max is not None and (not gated or tile_max.shape != (rows, tiles) or not tile_max.is_contiguous()
                                 or tile_max.dtype != torch.float32):
        raise ValueError(f"tile_max {tuple(tile_max.shape)} {tile_max.dtype} must be a gated launch's "
                         f"contiguous float32 ({rows}, {tiles}): a row's maximum per column tile")


def check_gated(gated: bool, out_features: int, config: TileConfig) -> None:
    """Raise ValueError unless a gated launch (``column_tile``) can pair this output's halves."""
    if gated and (out_features % 2 or config.block_n < 2):
        raise ValueError(f"a gated GEMV needs an even N ({out_features}) and block_n >= 2 ({config.block_n})")


def gemv_block_m(rows: int, config: TileConfig) -> int:
    """The padded row count of a GEMV program: the dot tile, or the next power of two."""
    return config.block_m or triton.next_power_of_2(rows)


def k_segments(in_features: int, block_k: int, split_k: int) -> tuple[int, int]:
    """``(rows of K per segment, number of segments)``: at most ``split_k`` segments of whole
    ``block_k`` steps, none empty."""
    steps = triton.cdiv(in_features, block_k)
    steps_per_split = triton.cdiv(steps, min(split_k, steps))
    return steps_per_split * block_k, triton.cdiv(steps, steps_per_split)


def split_k_scratch(rows: int, out_features: int, num_splits: int, tiles: int,
                    out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partial sums ``[num_splits, rows, out_features]`` and the ticket counters of a
    split-K launch (``out`` stands in for both when there is one segment: nothing reads them)."""
    if num_splits == 1:
        return out, out
    if tiles > SPLIT_K_COUNTERS:
        raise ValueError(f"{tiles} column tiles is over the {SPLIT_K_COUNTERS} split-K counters: use a "
                         "larger block_n")
    counters = _counters.get(out.device)
    if counters is None:
        if out.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K counters are made at the first split-K call, which must run "
                               "eagerly: run the model once before capturing a CUDA graph")
        counters = _counters[out.device] = torch.zeros(SPLIT_K_COUNTERS, dtype=torch.int32, device=out.device)
    partial = torch.empty(num_splits, rows, out_features, dtype=torch.float32, device=out.device)
    return partial, counters


def dot_settings(x: torch.Tensor) -> dict:
    """``DOT_DTYPE``/``DOT_PRECISION`` for x's dtype. The interpreter's tl.dot is wrong for bf16:
    upcast there. fp32 wants exact products, not tf32. FP8 operands become bf16 (exactly)."""
    dtype = torch.bfloat16 if x.dtype == torch.float8_e4m3fn else x.dtype
    upcast = dtype == torch.bfloat16 and x.device.type == "cpu"
    dot_dtype = tl.float32 if upcast else TRITON_DTYPES[dtype]
    return dict(DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32")


def gemv_dot_settings(x: torch.Tensor, config: TileConfig) -> dict:
    """``dot_settings`` of the GEMV's launch, plus ``SWAP_AB`` and ``FP8_ACC_CHUNK``: a swapped
    tile's FP8 operands go to the GPU's tensor cores as they are (wgmma multiplies E4M3 with the
    weight tile as A and the padded rows as B, both K-major; the plain tile's 16 rows make no
    wgmma), their products summed in fp32 every FP8_PROMOTION_K of K (wgmma's FP8 accumulator
    keeps fewer bits, so Triton adds each chunk's sum into a full fp32 one)."""
    native_fp8 = config.swap_ab and x.dtype == torch.float8_e4m3fn and x.is_cuda
    if not native_fp8:
        return dict(dot_settings(x), SWAP_AB=config.swap_ab, FP8_ACC_CHUNK=None)
    return dict(DOT_DTYPE=tl.float8e4nv, DOT_PRECISION="tf32", SWAP_AB=True,
                FP8_ACC_CHUNK=min(FP8_PROMOTION_K, config.block_k))


@cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The device's SM count (132, an H100/H200's, for the interpreter on the CPU)."""
    return _num_sms(device) if device.type == "cuda" else 132
