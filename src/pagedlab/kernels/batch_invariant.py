"""Batch-invariant Triton kernels: a fixed-tile matmul, per-row RMSNorm/LayerNorm and a per-row
log-softmax/softmax, each beside its plain-torch reference. In every one, the arithmetic that
produces one output row is the same whatever the other rows are and however many there are, so
a prompt's numbers do not depend on the batch it runs in (``pagedlab.layers.batch_invariant``
switches the model onto them).

The matmul ``y = x @ weight.T + bias`` multiplies ``TileConfig`` tiles of ``block_m`` x
``block_n`` x ``block_k`` and cuts K into ``split_k`` segments, both fixed per weight shape
(``gemv_configs.batch_invariant_config``: the measured ``BATCH_INVARIANT_CONFIGS``, else
``BATCH_INVARIANT_TILE`` with ``batch_invariant_splits`` segments, enough programs for a decode
batch to fill the GPU). Each segment is accumulated from zero over its K steps, and the segments
are added in segment order. The table may give a batch bucket other tiles (fewer rows, so that a
decode step does not pay for 128-row tensor-core tiles) only with the same ``block_k`` and
``split_k`` and where the GPU found the result bitwise the same (``benchmarks/
batch_invariant_bench.py``, ``tests/test_batch_invariant_gpu.py``). One kernel computes the
sum through three launches:

- in-program: one program per output tile loops over the segments itself;
- persistent (prefill: ``BATCH_INVARIANT_PERSISTENT_MIN_ROWS`` rows or more, on Hopper): one
  program per SM loops over the output tiles in the same grouped order, each summed as the
  in-program launch does, in ``BATCH_INVARIANT_PERSISTENT_TILE``'s 128 x 256 tiles with the
  table's ``block_k`` and ``split_k``; the operands come through TMA descriptors made on the
  host (``TensorDescriptor``: no device-side scratch, passed by value, so a CUDA graph keeps them);
- split across programs: one program per (tile, segment), the fp32 segment sums meet in a scratch
  buffer and the last program of each tile adds them in segment order (``split_k_epilogue``, as
  the GEMVs do) - for batches whose tiles alone would leave most SMs idle.

Which launch runs may depend on M; what is computed may not, and the tests check that all three
give bitwise the same output. This module imports triton when it loads: import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedlab.kernels.device import tma_loads
from pagedlab.kernels.gemv import (_store_output, check_dense_operands, dot_settings, k_segments, num_sms,
                                   split_k_epilogue, split_k_scratch)
from pagedlab.kernels.gemv_configs import (BATCH_INVARIANT_PERSISTENT_MIN_ROWS,
                                           BATCH_INVARIANT_PERSISTENT_TILE, TileConfig,
                                           batch_invariant_config, batch_invariant_persistent_config,
                                           batch_invariant_split_launch, check_batch_invariant_config)
from pagedlab.kernels.pdl import pdl_launch
from pagedlab.kernels.pdl_jit import pdl_wait_and_trigger
from pagedlab.kernels.triton_kernels import _round_to_e4m3
from pagedlab.quantization.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX, QuantizedActivations

# Columns of the log-softmax loop: a row of any vocabulary is read in chunks of this many.
SOFTMAX_BLOCK = 4096
# Widest row a norm program holds at once.
MAX_NORM_WIDTH = 1 << 16


@triton.jit
def _segment_sum(x_ptr, w_ptr, x_desc, w_desc, first_row, first_col, M, N, K, k_begin, k_end, stride_x,
                 stride_w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BROADCAST_DOT: tl.constexpr):
    """One K segment's fp32 sum from zero, K steps chained in order through ``tl.dot``'s
    accumulator. TMA fills the rows past M or N and the columns past K with zeros, as the
    pointer loads' masks do. BROADCAST_DOT multiplies and sums instead of ``tl.dot``: the
    interpreter's ``tl.dot`` is numpy's BLAS, which rounds a row differently depending on its
    place in the tile."""
    offs_m = first_row + tl.arange(0, BLOCK_M)
    offs_n = first_col + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        if USE_TMA:
            x = x_desc.load([first_row, k_start])
            w = w_desc.load([first_col, k_start])
        else:
            offs_k = k_start + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None], other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=n_valid[:, None], other=0.0)
            else:
                k_valid = offs_k < K
                x = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        if BROADCAST_DOT:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        else:
            acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _matmul_tile(tile, x_ptr, w_ptr, x_desc, w_desc, bias_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K,
                 K_PER_SEGMENT, num_segments, stride_x, stride_w, stride_out, stride_partial_split,
                 stride_partial_row, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ONE_SEGMENT: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BROADCAST_DOT: tl.constexpr):
    """Output tile number ``tile``: tiles run in groups of GROUP_M row tiles per column tile (L2
    reuse of the weight). Its value is ``((0 + s0) + s1) + ...`` over the segment sums, or ``s0``
    for ONE_SEGMENT (equal but for the sign of a zero, without a second fp32 tile live over the K
    loop); SPLIT: only segment ``program_id(1)``, the epilogue adds them."""
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    tiles_per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    first_row = (first_m + (tile % tiles_per_group) % group_rows) * BLOCK_M
    first_col = ((tile % tiles_per_group) // group_rows) * BLOCK_N
    offs_m = first_row + tl.arange(0, BLOCK_M)
    offs_n = first_col + tl.arange(0, BLOCK_N)
    if ONE_SEGMENT:
        total = _segment_sum(x_ptr, w_ptr, x_desc, w_desc, first_row, first_col, M, N, K, 0, K, stride_x,
                             stride_w, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, DOT_DTYPE, DOT_PRECISION,
                             BROADCAST_DOT)
    else:
        if SPLIT:
            first_segment = tl.program_id(1)
            last_segment = first_segment + 1
        else:
            first_segment = 0
            last_segment = num_segments
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for segment in range(first_segment, last_segment):
            k_begin = segment * K_PER_SEGMENT
            total += _segment_sum(x_ptr, w_ptr, x_desc, w_desc, first_row, first_col, M, N, K, k_begin,
                                  tl.minimum(k_begin + K_PER_SEGMENT, K), stride_x, stride_w, BLOCK_M,
                                  BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, DOT_DTYPE, DOT_PRECISION, BROADCAST_DOT)
    if SPLIT:  # total is this segment's sum plus 0.0, which the epilogue's sum adds the same way
        split_k_epilogue(total, offs_m, offs_n, offs_m < M, offs_n < N, tile, tl.program_id(1), num_segments,
                         partial_ptr, stride_partial_split, stride_partial_row, counter_ptr,
                         bias_ptr, out_ptr, stride_out, HAS_BIAS, True)
    else:
        _store_output(total, offs_m, offs_n, (offs_m < M)[:, None] & (offs_n < N)[None, :], offs_n < N,
                      bias_ptr, out_ptr, stride_out, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "num_segments"])
def _fixed_tile_matmul_kernel(x_ptr, w_ptr, x_desc, w_desc, bias_ptr, out_ptr, partial_ptr, counter_ptr, M, N,
                              K, K_PER_SEGMENT, num_segments, stride_x, stride_w, stride_out,
                              stride_partial_split, stride_partial_row, HAS_BIAS: tl.constexpr,
                              SPLIT: tl.constexpr, ONE_SEGMENT: tl.constexpr, PERSISTENT: tl.constexpr,
                              EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                              DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                              BROADCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    """Program (output tile[, segment]), or with PERSISTENT program p of P computing tiles p,
    p + P, ... in the same grouped order. USE_TMA: ``x_desc``/``w_desc`` are tensor descriptors
    of x and the weight (``[BLOCK_M | BLOCK_N, BLOCK_K]`` blocks) that the loads go through.
    PDL: waits first."""
    pdl_wait_and_trigger(PDL)
    if PERSISTENT:
        for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
            _matmul_tile(tile, x_ptr, w_ptr, x_desc, w_desc, bias_ptr, out_ptr, partial_ptr, counter_ptr, M,
                         N, K, K_PER_SEGMENT, num_segments, stride_x, stride_w, stride_out,
                         stride_partial_split, stride_partial_row, HAS_BIAS, SPLIT, ONE_SEGMENT, EVEN_K,
                         USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_DTYPE, DOT_PRECISION, BROADCAST_DOT)
    else:
        _matmul_tile(tl.program_id(0), x_ptr, w_ptr, x_desc, w_desc, bias_ptr, out_ptr, partial_ptr,
                     counter_ptr, M, N, K, K_PER_SEGMENT, num_segments, stride_x, stride_w, stride_out,
                     stride_partial_split, stride_partial_row, HAS_BIAS, SPLIT, ONE_SEGMENT, EVEN_K, USE_TMA,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_DTYPE, DOT_PRECISION, BROADCAST_DOT)


def fixed_tile_matmul_torch(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32, cast to ``x``'s dtype: the reference of
    ``fixed_tile_matmul_triton`` (equal up to rounding, not bitwise)."""
    out = x.float() @ weight.float().T
    return (out if bias is None else out + bias.float()).to(x.dtype)


def fixed_tile_matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                             config: TileConfig | None = None, num_segments: int | None = None,
                             split_across_programs: bool | None = None, persistent: bool | None = None,
                             max_programs: int | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``weight`` ``[N, K]``, float16/bfloat16/float32 like ``x``) with
    one reduction order per weight shape, whatever ``x``'s row count: see the module docstring.
    ``config`` defaults to ``batch_invariant_config``'s for this batch and weight,
    ``num_segments`` to the config's ``split_k``. ``split_across_programs`` and ``persistent``
    pick the launch, not the result: None leaves them to ``fixed_tile_matmul_launch``;
    ``persistent=True`` runs ``config``'s tiles on at most ``max_programs`` programs (default:
    one per SM), each looping over the output tiles."""
    out_features, in_features = weight.shape
    check_dense_operands(x, weight)
    x2d = x.reshape(-1, in_features)
    if x2d.stride(-1) != 1 or weight.stride(-1) != 1:
        x2d, weight = x2d.contiguous(), weight.contiguous()
    rows = x2d.shape[0]
    config, split, persistent = fixed_tile_matmul_launch(x2d, weight, config, split_across_programs,
                                                         persistent)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.view(*x.shape[:-1], out_features)
    k_per_segment, num_segments = k_segments(in_features, config.block_k, num_segments or config.split_k)
    split = split and num_segments > 1
    tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(out_features, config.block_n)
    if max_programs is not None and max_programs < 1:
        raise ValueError(f"max_programs={max_programs}: want at least 1")
    programs = min(tiles, max_programs or num_sms(x.device)) if persistent else tiles
    tma = persistent and tma_loads(x2d, weight)
    x_desc, w_desc = x2d, weight  # stand-ins the kernel does not read without TMA
    if tma:
        x_desc = TensorDescriptor.from_tensor(x2d, [config.block_m, config.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    partial, counters = split_k_scratch(rows, out_features, num_segments if split else 1, tiles, out)
    _fixed_tile_matmul_kernel[(programs, num_segments if split else 1)](
        x2d, weight, x_desc, w_desc, out if bias is None else bias, out, partial, counters, rows,
        out_features, in_features, k_per_segment, num_segments, x2d.stride(0), weight.stride(0),
        out.stride(0), partial.stride(0) if split else 0, partial.stride(1) if split else 0,
        HAS_BIAS=bias is not None, SPLIT=split, ONE_SEGMENT=num_segments == 1, PERSISTENT=persistent,
        EVEN_K=in_features % config.block_k == 0, USE_TMA=tma, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=8, BROADCAST_DOT=x.device.type == "cpu",
        **dot_settings(x), **pdl_launch(x.device), num_warps=config.num_warps, num_stages=config.num_stages)
    return out.view(*x.shape[:-1], out_features)


def fixed_tile_matmul_launch(x2d: torch.Tensor, weight: torch.Tensor, config: TileConfig | None = None,
                             split_across_programs: bool | None = None,
                             persistent: bool | None = None) -> tuple[TileConfig, bool, bool]:
    """``(config, split across programs, persistent)`` of ``fixed_tile_matmul_triton(x2d, weight,
    ...)`` (``x2d`` 2-D, rows contiguous). Left to the dispatch (``config`` None), the split
    launch is ``batch_invariant_split_launch``'s choice, and a batch the in-program launch would
    run takes the persistent one where ``_persistent_launch_fits``, with
    BATCH_INVARIANT_PERSISTENT_TILE's tiles and the table's block_k and split_k. For a given
    ``config``: split when its output tiles alone fill less than half the SMs, never persistent."""
    rows, (out_features, in_features) = x2d.shape[0], weight.shape
    sms = num_sms(x2d.device)
    dispatched = config is None
    config = config or batch_invariant_config(rows, out_features, in_features, sms)
    check_batch_invariant_config(config)
    if persistent:
        if split_across_programs:
            raise ValueError("persistent=True with split_across_programs=True: the launches exclude "
                             "each other")
        return config, False, True
    if split_across_programs is None:
        tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(out_features, config.block_n)
        split_across_programs = (batch_invariant_split_launch(rows, out_features, in_features, tiles, sms)
                                 if dispatched else 2 * tiles <= sms)
    if (persistent is None and dispatched and not split_across_programs
            and _persistent_launch_fits(x2d, weight, config)):
        return batch_invariant_persistent_config(config), False, True
    return config, split_across_programs, False


def _persistent_launch_fits(x2d: torch.Tensor, weight: torch.Tensor, config: TileConfig) -> bool:
    """Whether the dispatch runs this batch on the persistent launch: as measured (16-bit operands
    through TMA, whole K steps of BATCH_INVARIANT_PERSISTENT_TILE's block_k) from
    BATCH_INVARIANT_PERSISTENT_MIN_ROWS rows, on a CUDA GPU. Host facts only, so a CUDA graph
    replays the launch it captured."""
    return (x2d.is_cuda and x2d.shape[0] >= BATCH_INVARIANT_PERSISTENT_MIN_ROWS
            and x2d.dtype in (torch.float16, torch.bfloat16)
            and config.block_k == BATCH_INVARIANT_PERSISTENT_TILE.block_k
            and weight.shape[1] % config.block_k == 0 and tma_loads(x2d, weight))


@triton.jit
def _norm_kernel(x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr, q_ptr, scale_ptr,
                 N, eps, stride_x, stride_residual, stride_out, stride_residual_out, stride_q,
                 LAYER_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                 BLOCK: tl.constexpr, STORE_OUT: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                 MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    """Program (row): ``x (+ residual)``, then RMSNorm (scaled by ``weight``, or by ``1 + weight``
    with UNIT_OFFSET) or LayerNorm (``weight``, ``bias``), reduced in float32 in one fixed tree.
    FP8: the output, in x's dtype, also quantized per row as ``_per_token_quant_kernel`` does
    (the row's scale and its E4M3 values); STORE_OUT: the output itself written. The weight row
    is read before the PDL wait."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    weight = tl.load(weight_ptr + cols, mask=valid, other=0.0)
    pdl_wait_and_trigger(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_residual + cols, mask=valid, other=0.0)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=valid)
    xf = x.to(tl.float32)
    if LAYER_NORM:
        centred = tl.where(valid, xf - tl.sum(xf, 0) / N, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 0) / N + eps)
        bias = tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        out = centred * rstd * weight.to(tl.float32) + bias
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
        if UNIT_OFFSET:
            out = xf * rstd * (1.0 + weight.to(tl.float32))
        else:  # as the torch layer: normalized, cast, then scaled in the model's dtype
            out = (xf * rstd).to(x.dtype) * weight
    out = out.to(out_ptr.dtype.element_ty)
    if STORE_OUT:
        tl.store(out_ptr + row * stride_out + cols, out, mask=valid)
    if FP8:  # masked columns hold 0, which leaves the row's maximum alone
        y = out.to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), 0), FP8_MAX), MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        q = _round_to_e4m3(tl.math.div_rn(y, scale), FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=valid)


def rows_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None,
                    unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension (LayerNorm with a ``bias``) in float32: the reference of
    ``rows_norm_triton``."""
    xf = x.float()
    if bias is not None:
        return torch.nn.functional.layer_norm(xf, weight.shape, weight.float(), bias.float(), eps).to(x.dtype)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype) if unit_offset else weight * normed.to(x.dtype)


def rows_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None,
                     unit_offset: bool = False, residual: torch.Tensor | None = None, fp8: bool = False,
                     normed_out: torch.Tensor | None = None):
    """``rows_norm_torch`` one program per row; with ``residual`` returns
    ``(norm(x + residual), x + residual)``. With ``fp8`` the norm comes quantized per row, as
    ``QuantizedActivations`` (the values ``quantize_fp8_per_row`` gives for it), from the same
    program and is not written out, unless into ``normed_out`` (the tests' view of it)."""
    width = x.shape[-1]
    if width > MAX_NORM_WIDTH:
        raise ValueError(f"a norm over {width} features is over the kernel's {MAX_NORM_WIDTH}")
    x2d = x.reshape(-1, width).contiguous()
    rows = x2d.shape[0]
    if normed_out is not None and (normed_out.shape != x2d.shape or not normed_out.is_contiguous()):
        raise ValueError(f"normed_out of shape {tuple(normed_out.shape)} must be contiguous "
                         f"{tuple(x2d.shape)}")
    out = normed_out if normed_out is not None else torch.empty(0 if fp8 else x2d.shape, dtype=x.dtype,
                                                                device=x.device)
    res2d = residual.reshape(-1, width).contiguous() if residual is not None else x2d
    residual_out = torch.empty_like(x2d) if residual is not None else out
    values = torch.empty(rows, width if fp8 else 0, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(rows if fp8 else 0, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(width)
        _norm_kernel[(rows,)](
            x2d, res2d, weight, weight if bias is None else bias, out, residual_out, values, scales, width,
            eps, x2d.stride(0), res2d.stride(0), width, residual_out.stride(0), values.stride(0),
            LAYER_NORM=bias is not None, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
            BLOCK=block, STORE_OUT=not fp8 or normed_out is not None, FP8=fp8, FP8_MAX=FP8_MAX,
            MIN_SCALE=_MIN_SCALE, **pdl_launch(x.device), num_warps=min(16, max(1, block // 256)))
    normed = QuantizedActivations(values, scales, x.dtype) if fp8 else out.view(x.shape)
    return normed if residual is None else (normed, residual_out.view(x.shape))


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, N, stride_x, stride_out, LOG: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    """Program (row): the row's max and sum of exponentials in one pass over chunks of BLOCK
    columns (per lane, combined in a fixed tree at the end), then log-softmax or softmax. PDL:
    waits first."""
    pdl_wait_and_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    lane_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a lane with no finite value yet
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, 0)
    row_sum = tl.sum(tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - row_max)), 0)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        if LOG:
            out = x - row_max - tl.log(row_sum)
        else:
            out = tl.exp(x - row_max) / row_sum
        tl.store(out_ptr + row * stride_out + cols, out, mask=cols < N)


def softmax_torch(x: torch.Tensor, log: bool) -> torch.Tensor:
    """float32 (log-)softmax over the last dimension: the reference of ``softmax_triton``."""
    return x.float().log_softmax(-1) if log else x.float().softmax(-1)


def softmax_triton(x: torch.Tensor, log: bool) -> torch.Tensor:
    """``softmax_torch`` one program per row, in float32."""
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2d.shape, dtype=torch.float32, device=x.device)
    if x2d.numel():
        _softmax_kernel[(x2d.shape[0],)](x2d, out, x2d.shape[1], x2d.stride(0), out.stride(0), LOG=log,
                                         BLOCK=min(SOFTMAX_BLOCK, triton.next_power_of_2(x2d.shape[1])),
                                         **pdl_launch(x.device), num_warps=8)
    return out.view(x.shape)
