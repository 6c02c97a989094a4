"""W4A16 linear: ``x @ W + bias`` with ``W`` in AWQ's 4-bit GEMM format, dequantized in registers.

The format (``qweight``/``qzeros`` int32 with eight interleaved 4-bit values per word, ``scales``
per group of input rows) is described in ``pagedlab.quantization.awq``, whose ``awq_linear_torch``
is the plain-torch reference of ``awq_linear_triton`` here. Logical column ``j`` of a word is
nibble ``(j % 2) * 4 + (j % 8) // 2``; every kernel reads it with that shift, so the weight is
never unpacked in memory.

Two kernels, picked from host ints only (no ``.item()``, so a CUDA graph can capture the call):

- decode-sized batches (at most ``GEMV_MAX_ROWS`` rows) run a split-K GEMV: the time is the weight
  read (0.5 byte per weight), and a grid over output columns alone has too few programs to keep
  the memory system busy (4096 columns in tiles of 64 are 64 programs on 132 SMs). So K is also
  cut, into segments of a FIXED number of rows (``SPLIT_K_SIZE``), each program writes its
  fp32 partial sums, and a second pass adds the segments in order: no atomics, so the result is
  the same from run to run. (Not across batch sizes: one row multiplies on the CUDA cores, 2 to 16
  rows pad to 16 for ``tl.dot``, more take the GEMM.)
- larger batches run a dequantize-in-the-loop GEMM: each K tile of the weight is dequantized to
  ``x``'s dtype in registers and fed to ``tl.dot`` with fp32 accumulation.

A K tile never crosses a group boundary (``BLOCK_K`` divides the group size), so each tile loads
one row of zero points and scales.

The tile sizes and ``SPLIT_K_SIZE`` are first choices, not yet tuned on a GPU: the ``gpu`` tests
in ``tests/test_awq.py`` print each path's time and bandwidth next to a dense bf16 matmul's.

This module imports triton when it loads; Triton decides at decoration time whether a kernel is
compiled or interpreted (``TRITON_INTERPRET=1``), so import it lazily, after that is settled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.quantization.awq import awq_shapes

# Batches of at most this many rows take the split-K GEMV; larger ones the GEMM.
GEMV_MAX_ROWS = 16
# Rows of K per split-K segment (a multiple of 64). Fixed, so a row's sum order depends only on K.
SPLIT_K_SIZE = 512
_TORCH_TO_TRITON = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _dequantize_tile(qweight_ptr, qzeros_ptr, scales_ptr, k_start, offs_n, n_valid,
                     stride_qweight, stride_qzeros, stride_scales,
                     GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 weight tile ``[BLOCK_K, BLOCK_N]`` of rows ``k_start..`` (within one group)."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    words = offs_n // 8
    shifts = ((offs_n % 2) * 4 + (offs_n % 8) // 2) * 4
    q = tl.load(qweight_ptr + offs_k[:, None] * stride_qweight + words[None, :], mask=n_valid[None, :],
                other=0)
    group = k_start // GROUP_SIZE
    z = tl.load(qzeros_ptr + group * stride_qzeros + words, mask=n_valid, other=0)
    s = tl.load(scales_ptr + group * stride_scales + offs_n, mask=n_valid, other=0.0)
    # >> is arithmetic on int32: the mask drops the copies of a set sign bit.
    q = (q >> shifts[None, :]) & 0xF
    z = (z >> shifts) & 0xF
    return (q - z[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]


@triton.jit
def _awq_gemv_split_k_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, partial_ptr, M, N, K,
                             stride_x, stride_qweight, stride_qzeros, stride_scales,
                             stride_partial_split, stride_partial_row,
                             K_PER_SPLIT: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                             DOT_PRECISION: tl.constexpr):
    """Program (column tile, K segment): fp32 partial sums of the segment for every row.
    BLOCK_M == 1 multiplies on the CUDA cores, keeping a product per weight and summing over K once
    at the end (not once per tile); BLOCK_M >= 16 pads the rows for ``tl.dot``."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    products = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    for k_start in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        w = _dequantize_tile(qweight_ptr, qzeros_ptr, scales_ptr, k_start, offs_n, n_valid,
                             stride_qweight, stride_qzeros, stride_scales, GROUP_SIZE, BLOCK_K)
        offs_k = k_start + tl.arange(0, BLOCK_K)
        if BLOCK_M == 1:
            products += tl.load(x_ptr + offs_k).to(tl.float32)[:, None] * w
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=m_valid[:, None],
                        other=0.0)
            acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    if BLOCK_M == 1:
        acc = tl.sum(products, axis=0)[None, :]
    partial = (partial_ptr + split * stride_partial_split + offs_m[:, None] * stride_partial_row
               + offs_n[None, :])
    tl.store(partial, acc, mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def _split_k_reduce_kernel(partial_ptr, bias_ptr, out_ptr, N, num_splits,
                           stride_partial_split, stride_partial_row, stride_out,
                           HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (row, column tile): the segments' sums added in segment order, plus the bias."""
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for split in range(0, num_splits):
        acc += tl.load(partial_ptr + split * stride_partial_split + row * stride_partial_row + offs_n,
                       mask=n_valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_valid)


@triton.jit
def _awq_gemm_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr, M, N, K,
                     stride_x, stride_qweight, stride_qzeros, stride_scales, stride_out,
                     GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Program (row tile, column tile) of the output. Row tiles vary fastest over the grid, so
    programs running together share a weight tile (dequantized from L2, read from HBM once)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        w = _dequantize_tile(qweight_ptr, qzeros_ptr, scales_ptr, k_start, offs_n, n_valid,
                             stride_qweight, stride_qzeros, stride_scales, GROUP_SIZE, BLOCK_K)
        x = tl.load(x_rows + (k_start + tl.arange(0, BLOCK_K))[None, :], mask=m_valid[:, None], other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def awq_linear_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      group_size: int, bias: torch.Tensor | None = None,
                      split_k_size: int = SPLIT_K_SIZE) -> torch.Tensor:
    """Triton version of ``awq_linear_torch``: ``x`` ``[..., in_features]`` in float16, bfloat16
    or float32 -> ``[..., out_features]`` in ``x``'s dtype.

    The tensors may be views (e.g. tensor-parallel shards) as long as their last dimension is
    contiguous. ``split_k_size`` (rows of K per GEMV segment, a multiple of 64) is for tests."""
    in_features, out_features = awq_shapes(qweight, qzeros, scales, group_size)
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the AWQ weight {in_features} inputs")
    if x.dtype not in _TORCH_TO_TRITON:
        raise ValueError(f"x dtype {x.dtype} is not supported: float16, bfloat16 or float32")
    if split_k_size <= 0 or split_k_size % 64:
        raise ValueError(f"split_k_size={split_k_size} must be a positive multiple of 64")
    x2d = x.reshape(-1, in_features)
    tensors = {"x": x2d, "qweight": qweight, "qzeros": qzeros, "scales": scales}
    if bias is not None:
        tensors["bias"] = bias
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    out = torch.empty(x2d.shape[0], out_features, dtype=x.dtype, device=x.device)
    if x2d.shape[0]:
        weight = (qweight, qzeros, scales, bias)
        if x2d.shape[0] <= GEMV_MAX_ROWS:
            _launch_gemv(x2d, *weight, out, group_size, split_k_size)
        else:
            _launch_gemm(x2d, *weight, out, group_size)
    return out.view(*x.shape[:-1], out_features)


def _dot_settings(x: torch.Tensor) -> dict:
    # The interpreter's tl.dot is wrong for bf16: upcast there. fp32 wants exact products, not tf32.
    upcast = x.dtype == torch.bfloat16 and x.device.type == "cpu"
    dot_dtype = tl.float32 if upcast else _TORCH_TO_TRITON[x.dtype]
    return dict(DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32")


def _launch_gemv(x, qweight, qzeros, scales, bias, out, group_size: int, split_k_size: int) -> None:
    rows, in_features = x.shape
    out_features = out.shape[1]
    block_n, block_k = 64, min(group_size, 64)
    num_splits = triton.cdiv(in_features, split_k_size)
    partial = torch.empty(num_splits, rows, out_features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(out_features, block_n), num_splits)
    _awq_gemv_split_k_kernel[grid](
        x, qweight, qzeros, scales, partial, rows, out_features, in_features,
        x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0),
        partial.stride(0), partial.stride(1),
        K_PER_SPLIT=split_k_size, GROUP_SIZE=group_size, BLOCK_M=1 if rows == 1 else 16,
        BLOCK_N=block_n, BLOCK_K=block_k, **_dot_settings(x), num_warps=4)
    reduce_block = 256
    _split_k_reduce_kernel[(rows, triton.cdiv(out_features, reduce_block))](
        partial, out if bias is None else bias, out, out_features, num_splits,
        partial.stride(0), partial.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=reduce_block, num_warps=4)


def _launch_gemm(x, qweight, qzeros, scales, bias, out, group_size: int) -> None:
    rows, in_features = x.shape
    out_features = out.shape[1]
    block_m, block_n, block_k = 64, 128, min(group_size, 64)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n))
    _awq_gemm_kernel[grid](
        x, qweight, qzeros, scales, out if bias is None else bias, out, rows, out_features, in_features,
        x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, **_dot_settings(x), num_warps=4, num_stages=3)
