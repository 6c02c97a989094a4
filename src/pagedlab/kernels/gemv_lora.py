"""The LoRA expand in the dense GEMV's epilogue (``kernels/gemv.py``'s ``_dense_gemv_kernel``,
``kernels/lora.py``'s ``linear_with_lora``): ``GemvLoRA``, what the launch passes, and the Triton
pieces that read each row's slot, the shrink's partial sums and the slot's B rows. Imports triton
when it loads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def lora_row_slots(slots_ptr, offs_m, m_valid, split, tile_start, size0, size1):
    """The rows that add a LoRA delta (those with a slot, in K segment 0 only: it is added once),
    their slots, and the column tile's slice (the tile lies in one) with its first column."""
    slot = tl.load(slots_ptr + offs_m, mask=m_valid, other=-1).to(tl.int64)
    rows = tl.where(split == 0, slot, -1) >= 0
    part = (tile_start >= size0).to(tl.int32) + (tile_start >= size0 + size1).to(tl.int32)
    first = tl.where(part == 2, size0 + size1, tl.where(part == 1, size0, 0))
    return rows, slot, part, first


@triton.jit
def lora_partials(h_ptr, part, rows, offs_m, splits, rank, stride_h_split, stride_h_slice, stride_h_row,
                  BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """The LoRA shrink's fp32 partial sums ``[BLOCK_S, BLOCK_M, BLOCK_R]`` of ``rows`` (token
    order) in slice ``part``, every split's in one load (zero elsewhere), to be summed over the
    splits (axis 0: one fixed order)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    cells = (h_ptr + part * stride_h_slice + offs_s[:, None, None] * stride_h_split
             + offs_m[None, :, None] * stride_h_row + offs_r[None, None, :])
    mask = (offs_s < splits)[:, None, None] & rows[None, :, None] & (offs_r < rank)[None, None, :]
    return tl.load(cells, mask=mask, other=0.0)


@triton.jit
def lora_delta(h, b_ptr, rows, slot, part, first, offs_n, n_valid, rank, stride_b_slot, stride_b_slice,
               stride_b_row, BLOCK_R: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` fp32: the rows' shrink sums ``h`` ``[BLOCK_M, BLOCK_R]`` times their
    slots' B rows for the tile's columns (zero for the other rows)."""
    offs_r = tl.arange(0, BLOCK_R)
    b = tl.load(b_ptr + slot[:, None, None] * stride_b_slot + part * stride_b_slice
                + (offs_n - first)[None, :, None] * stride_b_row + offs_r[None, None, :],
                mask=rows[:, None, None] & n_valid[None, :, None] & (offs_r < rank)[None, None, :], other=0.0)
    return tl.sum(h[:, None, :] * b.to(tl.float32), axis=2)


@dataclass(frozen=True)
class GemvLoRA:
    """The adapter deltas the GEMV's epilogue adds (``kernels/lora.py``): ``h`` the LoRA shrink's
    fp32 partial sums ``[splits, slices, tokens, rank]`` (token order), ``lora_b`` the stacked B
    ``[slots, slices, max_out, rank]``, ``token_slots`` each row's slot (int32, -1: none) and the
    output columns of each slice, in order (each slice but the last a whole number of column tiles)."""

    h: torch.Tensor
    lora_b: torch.Tensor
    token_slots: torch.Tensor
    slice_sizes: Sequence[int]

    def check(self, rows: int, out_features: int, block_n: int) -> None:
        """Raise ValueError unless this fits a GEMV of ``rows`` rows, ``out_features`` outputs and
        column tiles of ``block_n``."""
        sizes, slices = list(self.slice_sizes), self.lora_b.shape[1]
        if not 1 <= len(sizes) <= 3 or len(sizes) != slices or self.h.shape[1] != slices or \
                sum(sizes) != out_features or max(sizes) > self.lora_b.shape[2]:
            raise ValueError(f"LoRA slices {sizes} do not fit B {tuple(self.lora_b.shape)}, h "
                             f"{tuple(self.h.shape)} and {out_features} outputs (1 to 3 slices)")
        if any(size % block_n for size in sizes[:-1]):
            raise ValueError(f"LoRA slices {sizes}: block_n={block_n} must divide each but the last")
        h, b = self.h, self.lora_b
        if h.dtype != torch.float32 or h.shape[2] < rows or self.token_slots.numel() < rows or \
                h.shape[3] != b.shape[3] or h.stride(3) != 1 or b.stride(3) != 1:
            raise ValueError(f"LoRA h {tuple(self.h.shape)} {self.h.dtype}, B {tuple(self.lora_b.shape)} and "
                             f"{self.token_slots.numel()} token slots do not fit {rows} rows")

    def kernel_args(self) -> dict:
        """The LoRA arguments of ``_dense_gemv_kernel``."""
        h, b = self.h, self.lora_b
        sizes = [*self.slice_sizes, 0][:2]
        return dict(lora_h_ptr=h, lora_b_ptr=b, lora_slots_ptr=self.token_slots, lora_rank=b.shape[3],
                    lora_splits=h.shape[0], lora_size0=sizes[0], lora_size1=sizes[1],
                    stride_h_split=h.stride(0), stride_h_slice=h.stride(1), stride_h_row=h.stride(2),
                    stride_b_slot=b.stride(0), stride_b_slice=b.stride(1), stride_b_row=b.stride(2),
                    LORA=True, LORA_BLOCK_S=triton.next_power_of_2(h.shape[0]),
                    LORA_BLOCK_R=triton.next_power_of_2(b.shape[3]))


def no_lora_args(out: torch.Tensor) -> dict:
    names = ("lora_rank", "lora_splits", "lora_size0", "lora_size1", "stride_h_split", "stride_h_slice",
             "stride_h_row", "stride_b_slot", "stride_b_slice", "stride_b_row")
    return dict(dict.fromkeys(names, 0), lora_h_ptr=out, lora_b_ptr=out, lora_slots_ptr=out, LORA=False,
                LORA_BLOCK_S=1, LORA_BLOCK_R=1)
