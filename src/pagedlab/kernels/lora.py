"""Batched multi-LoRA: the low-rank products of many adapters in one launch each (punica's
shrink then expand, as vLLM's sgmv kernels do).

A LoRA linear holds every GPU slot's weights stacked: ``lora_a`` ``[slots, slices, rank, in]``
and ``lora_b`` ``[slots, slices, out, rank]`` (``lora_alpha`` scaling folded into B, ranks below
the maximum zero-padded). A fused linear (q/k/v, gate/up) has one slice per part, each with its
own A and B, written to its own column range of the output. Each token of a step belongs to one
slot, or to none (-1: the base model only).

``LoRAMapping`` describes the tokens of one step sorted by slot: ``sorted_token_ids`` lists the
tokens of slot 0, then slot 1, ...; slot s owns ``slot_counts[s]`` of them from
``slot_starts[s]``. The kernels' grids depend only on the number of tokens and slots, never on
the mapping, so a CUDA graph captures them with the mapping in static buffers; a program whose
tile lies past its slot's tokens returns at once.

- ``lora_shrink``: ``h[slice, t] = x[t] @ A[slot(t), slice].T`` (fp32, ``[slices, tokens, rank]``);
- ``lora_expand``: ``y[t, offset[slice]:+size[slice]] += h[slice, t] @ B[slot(t), slice].T``.

``pagedlab.lora.ops`` holds ``LoRAMapping`` and the plain-torch references of both kernels
(``lora_shrink_torch``/``lora_expand_torch``, the CPU path), which read only ``token_slots``.
This module imports triton when it loads: import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.lora.ops import LoRAMapping

BLOCK_M = 16


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, h_ptr, sorted_ptr, counts_ptr, starts_ptr, K, R,
                        stride_x, stride_a_slot, stride_a_slice, stride_a_rank, stride_h_slice, stride_h_row,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Program (token tile, slice, slot): ``BLOCK_M`` tokens of one slot times its A of one slice."""
    pid_m = tl.program_id(0)
    part = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    # This program's tokens among the slot's.
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs_m < count
    tokens = tl.load(sorted_ptr + tl.load(starts_ptr + slot) + offs_m, mask=valid, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    a_base = a_ptr + slot.to(tl.int64) * stride_a_slot + part * stride_a_slice
    # tl.full, not tl.zeros: the standard library's jit functions cannot be interpreted when triton
    # was imported before TRITON_INTERPRET was set (as in a test session that loaded peft first).
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tokens[:, None] * stride_x + offs_k[None, :],
                    mask=valid[:, None] & (offs_k < K)[None, :], other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_a_rank + offs_k[:, None],
                    mask=(offs_r < R)[None, :] & (offs_k < K)[:, None], other=0.0)
        acc = tl.dot(x, a.to(x.dtype), acc, input_precision=DOT_PRECISION)
    out = h_ptr + part * stride_h_slice + tokens[:, None] * stride_h_row + offs_r[None, :]
    tl.store(out, acc, mask=valid[:, None] & (offs_r < R)[None, :])


@triton.jit
def _lora_expand_kernel(h_ptr, b_ptr, y_ptr, sorted_ptr, counts_ptr, starts_ptr, offsets_ptr, sizes_ptr,
                        R, num_n_tiles, stride_h_slice, stride_h_row, stride_b_slot, stride_b_slice,
                        stride_b_row, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (token tile x output tile, slice, slot): adds ``h @ B.T`` into ``BLOCK_N`` columns
    of the slice's range of ``y``. Each output element has exactly one program: no atomics."""
    pid = tl.program_id(0)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    part = tl.program_id(1)
    slot = tl.program_id(2)
    size = tl.load(sizes_ptr + part)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count or pid_n * BLOCK_N >= size:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs_m < count
    tokens = tl.load(sorted_ptr + tl.load(starts_ptr + slot) + offs_m, mask=valid, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < size
    h = tl.load(h_ptr + part * stride_h_slice + tokens[:, None] * stride_h_row + offs_r[None, :],
                mask=valid[:, None] & (offs_r < R)[None, :], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_b_slot + part * stride_b_slice
                + offs_n[None, :] * stride_b_row + offs_r[:, None],
                mask=n_valid[None, :] & (offs_r < R)[:, None], other=0.0)
    delta = tl.dot(h.to(b.dtype), b, input_precision=DOT_PRECISION)
    out = y_ptr + tokens[:, None] * stride_y + tl.load(offsets_ptr + part) + offs_n[None, :]
    mask = valid[:, None] & n_valid[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _block_rank(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """``[slices, tokens, rank]`` fp32: each token's input times its slot's A of every slice (rows
    of tokens without a slot are left unwritten)."""
    x = x.contiguous()
    slots, slices, rank, k = lora_a.shape
    h = torch.empty(slices, x.shape[0], rank, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(x.shape[0], BLOCK_M), slices, slots)
    _lora_shrink_kernel[grid](
        x, lora_a, h, mapping.sorted_token_ids, mapping.slot_counts, mapping.slot_starts, k, rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), h.stride(0), h.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=_block_rank(rank), BLOCK_K=32, DOT_PRECISION=_dot_precision(x.dtype))
    return h


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping, y: torch.Tensor,
                slice_offsets: torch.Tensor, slice_sizes: torch.Tensor) -> None:
    """``y[t, offset_j:offset_j + size_j] += h[j, t] @ B[slot(t), j].T`` for every slice ``j``
    (offsets and sizes: int32 device tensors), in place."""
    slots, slices, max_out, rank = lora_b.shape
    block_n = 64
    num_n_tiles = triton.cdiv(max_out, block_n)
    grid = (triton.cdiv(y.shape[0], BLOCK_M) * num_n_tiles, slices, slots)
    _lora_expand_kernel[grid](
        h, lora_b, y, mapping.sorted_token_ids, mapping.slot_counts, mapping.slot_starts, slice_offsets,
        slice_sizes, rank, num_n_tiles, h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1),
        lora_b.stride(2), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=_block_rank(rank),
        DOT_PRECISION=_dot_precision(lora_b.dtype))
