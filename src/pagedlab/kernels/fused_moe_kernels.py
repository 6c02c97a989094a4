"""Triton kernels of the fused MoE MLP (entry point: ``fused_moe.fused_moe_triton``), imported
only when it first runs, like ``triton_kernels``.

Both are grouped GEMMs over row blocks of (token, expert) pairs sorted by expert: program
(row block, column block) reads its block's expert, gathers the rows it names (padding rows
hold ``num_pairs`` and are masked off) and multiplies them by that expert's weights.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pairs"])
def moe_gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, top_k,
                       hidden, inter, stride_x, stride_w_expert, stride_w_row, stride_out,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """``out[pair, n] = silu(x[token] . gate[n]) * (x[token] . up[n])`` for columns
    ``n`` of this program, the expert's gate rows at ``n`` and up rows at ``inter + n``."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_valid = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = offs_n < inter
    w_base = w13_ptr + expert.to(tl.int64) * stride_w_expert
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, hidden, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_valid = offs_k < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + offs_k[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & col_valid[None, :]
        gate = tl.load(w_base + offs_n[None, :] * stride_w_row + offs_k[:, None], mask=w_mask, other=0.0)
        up = tl.load(w_base + (inter + offs_n)[None, :] * stride_w_row + offs_k[:, None], mask=w_mask,
                     other=0.0)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
    activated = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + offs_n[None, :],
             activated.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def moe_down_kernel(h_ptr, w2_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr, num_pairs,
                    hidden, inter, stride_h, stride_w_expert, stride_w_row, stride_out,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """``out[pair, n] = weight[pair] * (h[pair] . down[n])`` for hidden columns ``n``."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_valid = pairs < num_pairs
    pairs = pairs.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = offs_n < hidden
    w_base = w2_ptr + expert.to(tl.int64) * stride_w_expert
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, inter, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_valid = offs_k < inter
        a = tl.load(h_ptr + pairs[:, None] * stride_h + offs_k[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_w_row + offs_k[:, None],
                    mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    weight = tl.load(weights_ptr + pairs, mask=row_valid, other=0.0).to(tl.float32)
    out = (acc * weight[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + pairs[:, None] * stride_out + offs_n[None, :], out,
             mask=row_valid[:, None] & col_valid[None, :])
