"""W4A16 linear: ``x @ W + bias`` with ``W`` in AWQ's 4-bit GEMM format, dequantized in registers.

The format (``qweight``/``qzeros`` int32 with eight interleaved 4-bit values per word, ``scales``
per group of input rows) is described in ``pagedlab.quantization.awq``, whose ``awq_linear_torch``
is the plain-torch reference of ``awq_linear_triton`` here.

A program owns ``block_n // 8`` whole int32 words of every weight row it reads: it loads them
coalesced along N (the packed row is contiguous), and unpacks each word into its eight nibbles
with eight shifts, in nibble order. Nibble ``i`` of word ``w`` is logical column
``8w + AWQ_PACK_ORDER[i]``, so the tile's columns are the logical ones permuted within each
word: the scales are loaded, and the output stored, through that permutation; the weight is
never reordered.

Two kernels, picked by the row count (host ints only, so a CUDA graph can capture the call), each
launched with a ``TileConfig`` from ``gemv_configs.awq_config`` (measured table, else heuristic):

- at most ``GEMV_MAX_ROWS`` rows: a split-K GEMV (``kernels/gemv.py`` describes the K segments
  and their deterministic in-kernel sum). Its time is the weight read (half a byte per weight),
  so it keeps the arithmetic per weight small: a K step lies in one group, whose zero point
  and scale come out of the sum (``sum_k x (q - z) s = s (sum_k x q - z sum_k x)``), and a
  4-bit value becomes a float by OR-ing it into a float's mantissa (the ``magic`` constants:
  no int-to-float conversion instruction). On the CUDA cores (``block_m == 0``): fp32
  ``2**23 + q`` less ``2**23``, exactly ``q``. With ``tl.dot`` (``block_m == 16``): the 16-bit
  float ``128 + q`` (bf16) or ``1024 + q`` (fp16) straight into the dot, the offset taken out
  with the zero point.
- more rows: a dequantize-in-the-loop GEMM: each K tile of the weight becomes ``(q - z) * s`` in
  ``x``'s dtype in registers and feeds ``tl.dot`` with fp32 accumulation.

This module imports triton when it loads; Triton decides at decoration time whether a kernel is
compiled or interpreted (``TRITON_INTERPRET=1``), so import it lazily, after that is settled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.kernels.gemv import (TRITON_DTYPES, dot_settings, gemv_block_m, k_segments, num_sms,
                                   split_k_epilogue, split_k_scratch)
from pagedlab.kernels.gemv_configs import GEMV_MAX_ROWS, TileConfig, awq_config
from pagedlab.quantization.awq import VALUES_PER_INT32, awq_shapes

# A 16-bit float whose low mantissa bits are a 4-bit value q reads 128 + q (bf16) or 1024 + q (fp16).
_MAGIC_BITS = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@triton.jit
def _tile_columns(pid_n, BLOCK_W: tl.constexpr):
    """The tile's int32 words, and the logical output column of each of its ``8 * BLOCK_W``
    columns in nibble order (nibble ``i`` of a word is column ``2 * (i % 4) + i // 4`` of its 8)."""
    offs_w = pid_n * BLOCK_W + tl.arange(0, BLOCK_W)
    column = tl.arange(0, BLOCK_W * 8)
    nibble = column % 8
    offs_n = pid_n * BLOCK_W * 8 + (column - nibble) + (nibble % 4) * 2 + nibble // 4
    return offs_w, offs_n


@triton.jit
def _unpack_words(words, ROWS: tl.constexpr, BLOCK_W: tl.constexpr):
    """int32 ``[ROWS, BLOCK_W]`` -> their 4-bit values ``[ROWS, 8 * BLOCK_W]`` in nibble order."""
    shifts = tl.arange(0, 8) * 4
    # >> is arithmetic on int32: the mask drops the copies of a set sign bit.
    nibbles = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    return tl.reshape(nibbles, (ROWS, BLOCK_W * 8))


@triton.jit
def _group_zeros_scales(qzeros_ptr, scales_ptr, group, offs_w, offs_n, w_valid, n_valid,
                        stride_qzeros, stride_scales, BLOCK_W: tl.constexpr):
    """The zero points (int, ``[1, 8 * BLOCK_W]``) and fp32 scales (``[8 * BLOCK_W]``) of one group."""
    zero_words = tl.load(qzeros_ptr + group * stride_qzeros + offs_w, mask=w_valid, other=0)
    zeros = _unpack_words(zero_words[None, :], 1, BLOCK_W)
    scales = tl.load(scales_ptr + group * stride_scales + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    return zeros, scales


@triton.jit(do_not_specialize=["M", "num_splits"])
def _awq_gemv_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                     M, N_WORDS, K, K_PER_SPLIT, num_splits, stride_x, stride_qweight, stride_qzeros,
                     stride_scales, stride_out, stride_partial_split, stride_partial_row,
                     GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_DOT: tl.constexpr, W_DTYPE: tl.constexpr, W_BITS: tl.constexpr,
                     W_OFFSET: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (column tile of BLOCK_W words, K segment) for all M <= BLOCK_M rows. Each K step
    (within one group) adds ``s * (sum_k x q' - (z + W_OFFSET) * sum_k x)`` where ``q' = q + W_OFFSET``
    is the float the nibble became."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_w, offs_n = _tile_columns(pid_n, BLOCK_W)
    w_valid = offs_w < N_WORDS
    n_valid = offs_n < N_WORDS * 8
    offs_m = tl.arange(0, BLOCK_M)
    m_valid = offs_m < M
    x_rows = x_ptr + offs_m[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_W * 8), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    for k_start in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        words = tl.load(qweight_ptr + offs_k[:, None] * stride_qweight + offs_w[None, :],
                        mask=w_valid[None, :], other=0)
        x = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None], other=0.0)
        nibbles = _unpack_words(words, BLOCK_K, BLOCK_W)
        if USE_DOT:
            if W_BITS:
                w = (nibbles | W_BITS).to(tl.int16).to(W_DTYPE, bitcast=True)
            else:
                w = nibbles.to(W_DTYPE)
            dots = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        else:
            w = (nibbles | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            dots = tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
        zeros, scales = _group_zeros_scales(qzeros_ptr, scales_ptr, k_start // GROUP_SIZE, offs_w, offs_n,
                                            w_valid, n_valid, stride_qzeros, stride_scales, BLOCK_W)
        x_sums = tl.sum(x.to(tl.float32), axis=1)
        acc += scales[None, :] * (dots - (zeros.to(tl.float32) + W_OFFSET) * x_sums[:, None])
    split_k_epilogue(acc, offs_m, offs_n, m_valid, n_valid, pid_n, split, num_splits,
                     partial_ptr, stride_partial_split, stride_partial_row, counter_ptr,
                     bias_ptr, out_ptr, stride_out, HAS_BIAS, SPLIT)


@triton.jit
def _awq_gemm_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, bias_ptr, out_ptr, M, N_WORDS, K,
                     stride_x, stride_qweight, stride_qzeros, stride_scales, stride_out,
                     GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Program (row tile, column tile) of the output. Row tiles vary fastest over the grid, so
    programs running together share a weight tile (dequantized from L2, read from HBM once)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w, offs_n = _tile_columns(pid_n, BLOCK_W)
    m_valid = offs_m < M
    w_valid = offs_w < N_WORDS
    n_valid = offs_n < N_WORDS * 8
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_W * 8), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        words = tl.load(qweight_ptr + offs_k[:, None] * stride_qweight + offs_w[None, :],
                        mask=w_valid[None, :], other=0)
        zeros, scales = _group_zeros_scales(qzeros_ptr, scales_ptr, k_start // GROUP_SIZE, offs_w, offs_n,
                                            w_valid, n_valid, stride_qzeros, stride_scales, BLOCK_W)
        w = ((_unpack_words(words, BLOCK_K, BLOCK_W) - zeros).to(tl.float32) * scales[None, :]).to(DOT_DTYPE)
        x = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None], other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), w, acc, input_precision=DOT_PRECISION)
    split_k_epilogue(acc, offs_m, offs_n, m_valid, n_valid, pid_n, 0, 1, out_ptr, 0, 0, out_ptr,
                     bias_ptr, out_ptr, stride_out, HAS_BIAS, False)


def awq_linear_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      group_size: int, bias: torch.Tensor | None = None,
                      config: TileConfig | None = None) -> torch.Tensor:
    """Triton version of ``awq_linear_torch``: ``x`` ``[..., in_features]`` in float16, bfloat16
    or float32 -> ``[..., out_features]`` in ``x``'s dtype.

    The tensors may be views (e.g. tensor-parallel shards) as long as their last dimension is
    contiguous. ``config`` (default: ``gemv_configs.awq_config``) sets the tiles; with at most
    ``GEMV_MAX_ROWS`` rows it runs the GEMV, else the GEMM."""
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
    check_awq_config(config, rows, group_size)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows:
        launch = _launch_gemv if rows <= GEMV_MAX_ROWS else _launch_gemm
        launch(x2d, qweight, qzeros, scales, bias, out, group_size, config)
    return out.view(*x.shape[:-1], out_features)


def check_awq_config(config: TileConfig, rows: int, group_size: int) -> None:
    """Raise ValueError if ``config`` cannot run the AWQ kernel for ``rows`` rows and this group size."""
    config.check(rows, gemv=rows <= GEMV_MAX_ROWS)
    if config.block_n < VALUES_PER_INT32:
        raise ValueError(f"block_n={config.block_n} must hold whole int32 words: at least 8 columns")
    if group_size % config.block_k:
        raise ValueError(f"block_k={config.block_k} must divide group_size={group_size}: a K step reads "
                         "one group's zero points and scales")


def _weight_format(x: torch.Tensor, config: TileConfig) -> dict:
    """How the GEMV turns nibbles into the dot's operand: the 16-bit magic floats on tensor cores
    (bf16 and fp16), an exact conversion in fp32; the CUDA cores make their own fp32."""
    bits, offset = _MAGIC_BITS.get(x.dtype, (0, 0.0)) if config.block_m else (0, 0.0)
    return dict(W_DTYPE=TRITON_DTYPES[x.dtype], W_BITS=bits, W_OFFSET=offset)


def _launch_gemv(x, qweight, qzeros, scales, bias, out, group_size: int, config: TileConfig) -> None:
    rows, in_features = x.shape
    out_features = out.shape[1]
    k_per_split, num_splits = k_segments(in_features, config.block_k, config.split_k)
    tiles = triton.cdiv(out_features, config.block_n)
    partial, counters = split_k_scratch(rows, out_features, num_splits, tiles, out)
    _awq_gemv_kernel[(tiles, num_splits)](
        x, qweight, qzeros, scales, out if bias is None else bias, out, partial, counters,
        rows, qweight.shape[1], in_features, k_per_split, num_splits, x.stride(0), qweight.stride(0),
        qzeros.stride(0), scales.stride(0), out.stride(0), partial.stride(0), partial.stride(1),
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, SPLIT=num_splits > 1,
        BLOCK_M=gemv_block_m(rows, config), BLOCK_W=config.block_n // VALUES_PER_INT32,
        BLOCK_K=config.block_k, USE_DOT=config.block_m > 0, **_weight_format(x, config), **dot_settings(x),
        num_warps=config.num_warps, num_stages=config.num_stages)


def _launch_gemm(x, qweight, qzeros, scales, bias, out, group_size: int, config: TileConfig) -> None:
    rows, in_features = x.shape
    grid = (triton.cdiv(rows, config.block_m), triton.cdiv(out.shape[1], config.block_n))
    _awq_gemm_kernel[grid](
        x, qweight, qzeros, scales, out if bias is None else bias, out, rows, qweight.shape[1], in_features,
        x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, BLOCK_M=config.block_m,
        BLOCK_W=config.block_n // VALUES_PER_INT32, BLOCK_K=config.block_k, **dot_settings(x),
        num_warps=config.num_warps, num_stages=config.num_stages)
