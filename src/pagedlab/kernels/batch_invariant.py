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
batch_invariant_bench.py``, ``tests/test_batch_invariant_gpu.py``). Two launches compute the sum:

- in-program: one program per output tile loops over the segments itself (large M);
- split across programs: one program per (tile, segment), the fp32 segment sums meet in a scratch
  buffer and the last program of each tile adds them in segment order (``split_k_epilogue``, as
  the GEMVs do) - for batches whose tiles alone would leave most SMs idle.

Which launch runs may depend on M; what is computed may not, and the tests check that both give
bitwise the same output. This module imports triton when it loads: import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.kernels.gemv import (_store_output, check_dense_operands, dot_settings, k_segments, num_sms,
                                   split_k_epilogue, split_k_scratch)
from pagedlab.kernels.gemv_configs import (TileConfig, batch_invariant_config, batch_invariant_split_launch,
                                           check_batch_invariant_config)

# Columns of the log-softmax loop: a row of any vocabulary is read in chunks of this many.
SOFTMAX_BLOCK = 4096
# Widest row a norm program holds at once.
MAX_NORM_WIDTH = 1 << 16


@triton.jit(do_not_specialize=["M", "num_segments"])
def _fixed_tile_matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K,
                              K_PER_SEGMENT, num_segments, stride_x, stride_w, stride_out,
                              stride_partial_split, stride_partial_row,
                              HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                              BROADCAST_DOT: tl.constexpr):
    """Program (output tile[, segment]). Tiles run in groups of GROUP_M row tiles per column
    tile (L2 reuse of the weight); SPLIT: this program adds only segment ``program_id(1)``.
    BROADCAST_DOT multiplies and sums instead of ``tl.dot``: the interpreter's ``tl.dot`` is
    numpy's BLAS, which rounds a row differently depending on its place in the tile."""
    tile = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_n_tiles
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (tile % tiles_per_group) % group_rows
    pid_n = (tile % tiles_per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    if SPLIT:
        first_segment = tl.program_id(1)
        last_segment = first_segment + 1
    else:
        first_segment = 0
        last_segment = num_segments
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for segment in range(first_segment, last_segment):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = segment * K_PER_SEGMENT
        for k_start in range(k_begin, tl.minimum(k_begin + K_PER_SEGMENT, K), BLOCK_K):
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
        total += acc
    if SPLIT:  # total is this segment's sum plus 0.0, which the epilogue's sum adds the same way
        split_k_epilogue(total, offs_m, offs_n, m_valid, n_valid, tile, first_segment, num_segments,
                         partial_ptr, stride_partial_split, stride_partial_row, counter_ptr,
                         bias_ptr, out_ptr, stride_out, HAS_BIAS, True)
    else:
        _store_output(total, offs_m, offs_n, m_valid[:, None] & n_valid[None, :], n_valid, bias_ptr,
                      out_ptr, stride_out, HAS_BIAS)


def fixed_tile_matmul_torch(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32, cast to ``x``'s dtype: the reference of
    ``fixed_tile_matmul_triton`` (equal up to rounding, not bitwise)."""
    out = x.float() @ weight.float().T
    return (out if bias is None else out + bias.float()).to(x.dtype)


def fixed_tile_matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                             config: TileConfig | None = None, num_segments: int | None = None,
                             split_across_programs: bool | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``weight`` ``[N, K]``, float16/bfloat16/float32 like ``x``) with
    one reduction order per weight shape, whatever ``x``'s row count: see the module docstring.
    ``config`` defaults to ``batch_invariant_config``'s for this batch and weight,
    ``num_segments`` to the config's ``split_k``; ``split_across_programs`` picks the launch, not
    the result (None: ``batch_invariant_split_launch``'s choice for the dispatched config; for a
    given one, when its output tiles alone fill less than half the SMs)."""
    out_features, in_features = weight.shape
    check_dense_operands(x, weight)
    x2d = x.reshape(-1, in_features)
    if x2d.stride(-1) != 1 or weight.stride(-1) != 1:
        x2d, weight = x2d.contiguous(), weight.contiguous()
    rows = x2d.shape[0]
    sms = num_sms(x.device)
    dispatched = config is None
    config = config or batch_invariant_config(rows, out_features, in_features, sms)
    check_batch_invariant_config(config)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.view(*x.shape[:-1], out_features)
    k_per_segment, num_segments = k_segments(in_features, config.block_k, num_segments or config.split_k)
    tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(out_features, config.block_n)
    if split_across_programs is None:
        split_across_programs = (batch_invariant_split_launch(rows, out_features, in_features, tiles, sms)
                                 if dispatched else 2 * tiles <= sms)
    split = split_across_programs and num_segments > 1
    partial, counters = split_k_scratch(rows, out_features, num_segments if split else 1, tiles, out)
    _fixed_tile_matmul_kernel[(tiles, num_segments if split else 1)](
        x2d, weight, out if bias is None else bias, out, partial, counters, rows, out_features, in_features,
        k_per_segment, num_segments, x2d.stride(0), weight.stride(0), out.stride(0),
        partial.stride(0) if split else 0, partial.stride(1) if split else 0,
        HAS_BIAS=bias is not None, SPLIT=split, EVEN_K=in_features % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=8,
        BROADCAST_DOT=x.device.type == "cpu", **dot_settings(x), num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out.view(*x.shape[:-1], out_features)


@triton.jit
def _norm_kernel(x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr, N, eps,
                 stride_x, stride_residual, stride_out, stride_residual_out,
                 LAYER_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program (row): ``x (+ residual)``, then RMSNorm (scaled by ``weight``, or by ``1 + weight``
    with UNIT_OFFSET) or LayerNorm (``weight``, ``bias``), reduced in float32 in one fixed tree."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_residual + cols, mask=valid, other=0.0)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=valid)
    xf = x.to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=valid, other=0.0)
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
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=valid)


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
                     unit_offset: bool = False, residual: torch.Tensor | None = None):
    """``rows_norm_torch`` one program per row; with ``residual`` returns
    ``(norm(x + residual), x + residual)``."""
    width = x.shape[-1]
    if width > MAX_NORM_WIDTH:
        raise ValueError(f"a norm over {width} features is over the kernel's {MAX_NORM_WIDTH}")
    x2d = x.reshape(-1, width).contiguous()
    out = torch.empty_like(x2d)
    res2d = residual.reshape(-1, width).contiguous() if residual is not None else x2d
    residual_out = torch.empty_like(x2d) if residual is not None else out
    if x2d.shape[0]:
        block = triton.next_power_of_2(width)
        _norm_kernel[(x2d.shape[0],)](
            x2d, res2d, weight, weight if bias is None else bias, out, residual_out, width, eps,
            x2d.stride(0), res2d.stride(0), out.stride(0), residual_out.stride(0),
            LAYER_NORM=bias is not None, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
            BLOCK=block, num_warps=min(16, max(1, block // 256)))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(x.shape)


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, N, stride_x, stride_out, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row): the row's max and sum of exponentials in one pass over chunks of BLOCK
    columns (per lane, combined in a fixed tree at the end), then log-softmax or softmax."""
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
                                         num_warps=8)
    return out.view(x.shape)
