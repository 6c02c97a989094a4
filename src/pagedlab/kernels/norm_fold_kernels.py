"""The Triton side of an RMSNorm folded into a GEMV (``kernels/norm_fold.py``'s ``FoldedRMSNorm``):
the pieces the dense (``kernels/gemv.py``) and AWQ (``kernels/w4a16.py``) GEMV kernels share,
and their launch arguments. Their reference is ``FoldedRMSNorm.materialize`` followed by the
GEMV's; ``tests/test_norm_fold.py`` compares them. Imports triton when it loads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.kernels.norm_fold import FoldedRMSNorm


@triton.jit
def load_input(x_ptrs, res_ptrs, g_ptrs, mask, g_mask, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """``(values, summed)``: the activations at ``x_ptrs`` (zero where not ``mask``), twice; NORM:
    those of a folded RMSNorm (``kernels/norm_fold.py``) before its 1/rms, ``(x + residual) *
    weight`` in float32, and ``x + residual`` in float32, the residual at ``res_ptrs``
    (RESIDUAL) and the norm weight at ``g_ptrs`` (``g_mask``)."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    summed = x
    if NORM:
        if RESIDUAL:
            x = x + tl.load(res_ptrs, mask=mask, other=0.0)
        summed = x.to(tl.float32)
        x = summed * tl.load(g_ptrs, mask=g_mask, other=0.0).to(tl.float32)
    return x, summed


# K values of every row a program reads at once when it folds a norm over several rows
# (``_fold_rstd_rows``): a [16, 256] fp32 tile of squares is 32 registers a thread at 4 warps (512
# made the swapped 16-row tile's sm_90 spills 384 bytes, 256 made them 284; 208 without the fold).
FOLD_ROWS_CHUNK = tl.constexpr(256)


@triton.jit
def fold_rstd(x_ptr, res_ptr, g_ptr, summed_ptr, normed_ptr, stride_x, M, K, eps, write,
              BLOCK_M: tl.constexpr, NORM_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
              WRITE_NORMED: tl.constexpr, WRITE_SUMMED: tl.constexpr = True):
    """A folded RMSNorm's 1/rms of each of the M rows, ``[BLOCK_M]`` (0 from M on); with ``write``
    also stores each row's ``x + residual`` (RESIDUAL and WRITE_SUMMED) and normalized input
    (WRITE_NORMED), rounded as ``layers.norm.add_rms_norm`` rounds them. One row is read whole
    (``NORM_BLOCK`` >= K), the form timed at batch 1; several rows in K chunks, all rows at once
    (``_fold_rstd_rows``: row by row, a whole-row load and a block-wide sum each, the 16 rows of
    a tl.dot tile ran one after another, and W-seed batch 4 took 6.19 ms against 4.64 unfolded)."""
    if BLOCK_M > 1:
        return _fold_rstd_rows(x_ptr, res_ptr, g_ptr, summed_ptr, normed_ptr, stride_x, M, K, eps, write,
                               BLOCK_M, RESIDUAL, WRITE_NORMED, WRITE_SUMMED)
    offs = tl.arange(0, NORM_BLOCK)
    k_valid = offs < K
    offs_m = tl.arange(0, BLOCK_M)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for row in tl.static_range(BLOCK_M):
        mask = offs < tl.where(row < M, K, 0)
        cells = row * stride_x + offs
        summed = tl.load(x_ptr + cells, mask=mask, other=0.0)
        if RESIDUAL:
            summed = summed + tl.load(res_ptr + cells, mask=mask, other=0.0)
        values = summed.to(tl.float32)
        row_rstd = tl.math.rsqrt(tl.sum(values * values) / K + eps)
        rstd = tl.where(offs_m == row, row_rstd, rstd)
        if write:
            if RESIDUAL and WRITE_SUMMED:
                tl.store(summed_ptr + cells, summed, mask=mask)
            if WRITE_NORMED:
                g = tl.load(g_ptr + offs, mask=k_valid, other=0.0)
                tl.store(normed_ptr + cells, g * (values * row_rstd).to(g.dtype), mask=mask)
    return rstd


@triton.jit
def _fold_rstd_rows(x_ptr, res_ptr, g_ptr, summed_ptr, normed_ptr, stride_x, M, K, eps, write,
                    BLOCK_M: tl.constexpr, RESIDUAL: tl.constexpr, WRITE_NORMED: tl.constexpr,
                    WRITE_SUMMED: tl.constexpr):
    """``fold_rstd`` of BLOCK_M > 1 rows: each pass over K reads FOLD_ROWS_CHUNK values of every
    row at once (rows from M on masked off), the squares kept per lane and summed once; the
    normalized input, which needs the 1/rms, in a second pass."""
    offs_m = tl.arange(0, BLOCK_M)
    m_valid = offs_m < M
    offs = tl.arange(0, FOLD_ROWS_CHUNK)
    squares = tl.zeros((BLOCK_M, FOLD_ROWS_CHUNK), dtype=tl.float32)
    for start in range(0, K, FOLD_ROWS_CHUNK):
        summed, cells, mask = _chunk_sum(x_ptr, res_ptr, stride_x, offs_m, m_valid, start + offs, K, RESIDUAL)
        values = summed.to(tl.float32)
        squares += values * values
        if write and RESIDUAL and WRITE_SUMMED:
            tl.store(summed_ptr + cells, summed, mask=mask)
    rstd = tl.math.rsqrt(tl.sum(squares, axis=1) / K + eps)
    if write and WRITE_NORMED:
        for start in range(0, K, FOLD_ROWS_CHUNK):
            summed, cells, mask = _chunk_sum(x_ptr, res_ptr, stride_x, offs_m, m_valid, start + offs, K,
                                             RESIDUAL)
            g = tl.load(g_ptr + start + offs, mask=start + offs < K, other=0.0)[None, :]
            tl.store(normed_ptr + cells, g * (summed.to(tl.float32) * rstd[:, None]).to(g.dtype), mask=mask)
    return tl.where(m_valid, rstd, 0.0)


@triton.jit
def _chunk_sum(x_ptr, res_ptr, stride_x, offs_m, m_valid, offs_k, K, RESIDUAL: tl.constexpr):
    """``(x + residual, cells, mask)`` of the rows ``offs_m`` at ``offs_k``, in x's dtype."""
    mask = m_valid[:, None] & (offs_k < K)[None, :]
    cells = offs_m[:, None] * stride_x + offs_k[None, :]
    summed = tl.load(x_ptr + cells, mask=mask, other=0.0)
    if RESIDUAL:
        summed = summed + tl.load(res_ptr + cells, mask=mask, other=0.0)
    return summed, cells, mask


@triton.jit
def folded_rstd(squares, x_ptr, res_ptr, g_ptr, summed_ptr, normed_ptr, K, eps, write,
                NORM_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, WRITE_NORMED: tl.constexpr):
    """NORM_SUMS: the one row's 1/rms, ``[1]``, from ``squares``, the sum of squares its program
    took over the whole of K; with ``write`` (and WRITE_NORMED) the program also writes the
    normalized input (``fold_rstd``; the loop wrote ``x + residual``)."""
    if write and WRITE_NORMED:
        fold_rstd(x_ptr, res_ptr, g_ptr, summed_ptr, normed_ptr, 0, 1, K, eps, True, 1, NORM_BLOCK, RESIDUAL,
                  WRITE_NORMED, False)
    return tl.zeros((1,), dtype=tl.float32) + tl.math.rsqrt(squares / K + eps)


# The most K steps over which a one-row dense GEMV sums the norm's squares in its loop. On the
# H200 (batch-1 TPOT, 2026-12-03) the loop's sums won where the loop is short (Qwen3-30B-A3B's
# qkv and router, 2 steps of 1,024: 2.559 against 2.588 ms with the row read first) and lost
# where it is long (Llama-3-8B's qkv and gate/up, 8 and 16 steps: 4.197 against 4.074 ms).
NORM_SUMS_MAX_STEPS = 2


def norm_sums(norm: FoldedRMSNorm | None, one_row_loop: bool, num_splits: int, steps: int,
              tiles: int) -> bool:
    """Whether a folding dense GEMV's one program a column tile sums the norm's squares in its loop
    of ``steps`` K steps (one row, one K segment: it reads all of x anyway) rather than reading
    the row first. Program p writes step p's ``x + residual``, so it takes at least as many
    column ``tiles`` as steps (a router of 8 experts in one tile would leave step 1 unwritten)."""
    return (norm is not None and one_row_loop and num_splits == 1 and steps <= NORM_SUMS_MAX_STEPS
            and steps <= tiles)


def fold_args(x: torch.Tensor, norm: FoldedRMSNorm | None) -> dict:
    """The folding arguments of the GEMV kernels for ``x`` ``[rows, K]``: ``norm``'s, or none (the
    unused pointers stand in as ``x``)."""
    if norm is None:
        return dict(res_ptr=x, norm_w_ptr=x, summed_ptr=x, normed_ptr=x, eps=0.0, NORM=False, NORM_BLOCK=1,
                    RESIDUAL=False, WRITE_NORMED=False)
    return dict(res_ptr=x if norm.residual is None else norm.residual, norm_w_ptr=norm.weight,
                summed_ptr=x if norm.summed is None else norm.summed,
                normed_ptr=x if norm.normed is None else norm.normed, eps=norm.eps, NORM=True,
                NORM_BLOCK=triton.next_power_of_2(x.shape[1]), RESIDUAL=norm.residual is not None,
                WRITE_NORMED=norm.normed is not None)
