"""One step's tokens by LoRA slot, and the plain-torch references of the shrink/expand kernels in
``pagedlab.kernels.lora`` (the path the CPU runs; see that module for the layout of the stacked
weights). Importable without triton.

The kernels work on row tiles: ``sorted_token_ids`` lists the tokens of slot 0, then slot 1, ...,
and the tile table cuts each slot's run into tiles of at most ``block_m`` rows, so a tile never
spans two slots (as the block-aligned MoE kernels cut each expert's tokens). A table per block
size in ``TILE_BLOCK_MS``, each row ``[count, (slot, start, rows) per tile ...]``: ``start`` is
the tile's first row in ``sorted_token_ids``. Slots without tokens get no tile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

TILE_BLOCK_MS = (16, 64)  # the row-tile sizes the kernels choose from (a tile table each)


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """The most row tiles ``num_tokens`` tokens of up to ``num_slots`` slots can need: every
    occupied slot may end in a partial tile. Depends only on the counts, so a captured graph's
    grid covers any mapping of that many tokens."""
    occupied = min(num_slots, num_tokens)
    return (num_tokens - occupied) // block_m + occupied


@dataclass
class LoRAMapping:
    """One step's tokens by LoRA slot (int32 tensors on the model's device, static buffers that
    captured graphs read; only the listed part of ``sorted_token_ids`` is meaningful).
    ``token_slots`` is -1 past the step's tokens and everywhere after ``clear``: a graph of more
    rows than the step has tokens, or replayed without adapters, reads it (the GEMV's LoRA
    epilogue in ``kernels/gemv.py``)."""

    token_slots: torch.Tensor  # [>= tokens] slot of each token, -1 for none
    sorted_token_ids: torch.Tensor  # [>= tokens] token indices grouped by slot
    tile_tables: torch.Tensor  # [len(TILE_BLOCK_MS), 1 + 3 * max tiles]: see the module docstring
    num_slots: int

    @classmethod
    def empty(cls, max_tokens: int, num_slots: int, device: torch.device) -> LoRAMapping:
        """Static buffers for up to ``max_tokens`` tokens, every token without a slot."""
        width = 1 + 3 * max_tiles(max_tokens, num_slots, min(TILE_BLOCK_MS))
        return cls(torch.full((max_tokens,), -1, dtype=torch.int32, device=device),
                   torch.zeros(max_tokens, dtype=torch.int32, device=device),
                   torch.zeros(len(TILE_BLOCK_MS), width, dtype=torch.int32, device=device), num_slots)

    def tiles(self, block_m: int) -> torch.Tensor:
        """The tile table for tiles of ``block_m`` rows."""
        if block_m not in TILE_BLOCK_MS:
            raise ValueError(f"block_m={block_m}: the mapping has tile tables for {TILE_BLOCK_MS} only")
        return self.tile_tables[TILE_BLOCK_MS.index(block_m)]

    def clear(self) -> None:
        """No tiles and no token with a slot: every kernel program returns at once or adds nothing
        (what a graph captures, and a step without adapters, whose graph replay runs the kernels
        all the same)."""
        self.tile_tables[:, 0].zero_()
        self.token_slots.fill_(-1)

    def fill(self, token_slots, to_device) -> None:
        """Write the slots of a step's tokens (-1: none) and their tile tables; ``to_device(array,
        dtype)`` copies host data to the device (without waiting, on CUDA)."""
        token_slots = np.asarray(token_slots, dtype=np.int32)
        if len(token_slots) > self.token_slots.shape[0]:
            raise RuntimeError(f"a step of {len(token_slots)} tokens exceeds the LoRA mapping's "
                               f"{self.token_slots.shape[0]}")
        if len(token_slots) and (token_slots.min() < -1 or token_slots.max() >= self.num_slots):
            raise ValueError(f"token slots must lie in [-1, {self.num_slots}), got {token_slots.min()}.."
                             f"{token_slots.max()}")
        order, counts, starts = sort_tokens_by_slot(token_slots, self.num_slots)
        tables = [tile_table(counts, starts, block_m) for block_m in TILE_BLOCK_MS]
        host = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
        for row, table in zip(host, tables):
            row[:len(table)] = table
        self.token_slots[:len(token_slots)].copy_(to_device(token_slots, torch.int32), non_blocking=True)
        self.token_slots[len(token_slots):].fill_(-1)
        self.sorted_token_ids[:len(order)].copy_(to_device(order, torch.int32), non_blocking=True)
        self.tile_tables[:, :host.shape[1]].copy_(to_device(host, torch.int32), non_blocking=True)


def sort_tokens_by_slot(token_slots, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted token ids, count per slot, start per slot) of ``token_slots`` (-1: no slot), int32."""
    token_slots = np.asarray(token_slots, dtype=np.int64)
    order = np.argsort(token_slots, kind="stable")
    order = order[token_slots[order] >= 0]
    counts = np.bincount(token_slots[token_slots >= 0], minlength=num_slots)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return order.astype(np.int32), counts.astype(np.int32), starts.astype(np.int32)


def tile_table(counts: np.ndarray, starts: np.ndarray, block_m: int) -> np.ndarray:
    """``[count, (slot, start, rows) per tile ...]`` (int32): each slot's run of sorted rows cut
    into tiles of at most ``block_m`` rows, slot by slot."""
    counts = np.asarray(counts, dtype=np.int64)
    per_slot = -(-counts // block_m)
    slots = np.repeat(np.arange(len(counts)), per_slot)
    first_tile = np.cumsum(per_slot) - per_slot
    index = np.arange(len(slots)) - first_tile[slots]  # the tile's place within its slot
    tiles = np.stack([slots, np.asarray(starts)[slots] + index * block_m,
                      np.minimum(block_m, counts[slots] - index * block_m)], axis=1)
    return np.concatenate(([len(slots)], tiles.ravel())).astype(np.int32)


def _rows_by_slot(mapping: LoRAMapping, num_tokens: int):
    token_slots = mapping.token_slots[:num_tokens].long()
    for slot in torch.unique(token_slots[token_slots >= 0]).tolist():
        yield slot, (token_slots == slot).nonzero().squeeze(1)


def lora_shrink_torch(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """``[slices, tokens, rank]`` fp32: each token's input times its slot's A of every slice
    (zeros for tokens without a slot)."""
    _, slices, rank, _ = lora_a.shape
    h = torch.zeros(slices, x.shape[0], rank, dtype=torch.float32, device=x.device)
    for slot, rows in _rows_by_slot(mapping, x.shape[0]):
        h[:, rows] = torch.einsum("tk,srk->str", x[rows].float(), lora_a[slot].float())
    return h


def lora_expand_torch(h: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping, y: torch.Tensor,
                      slice_sizes: Sequence[int]) -> None:
    """``y[t, offset_j:offset_j + size_j] += h[j, t] @ B[slot(t), j].T`` for every slice ``j``
    (the slices' columns follow each other: ``offset_j`` is the sum of the sizes before), in place."""
    offsets = np.cumsum([0, *slice_sizes[:-1]]).tolist()
    for slot, rows in _rows_by_slot(mapping, y.shape[0]):
        for part, (offset, size) in enumerate(zip(offsets, slice_sizes)):
            delta = h[part, rows] @ lora_b[slot, part, :size].float().T
            y[rows, offset:offset + size] += delta.to(y.dtype)


def add_lora_torch(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   mapping: LoRAMapping, slice_sizes: Sequence[int]) -> None:
    """``y += `` each token's adapter delta (shrink then expand)."""
    lora_expand_torch(lora_shrink_torch(x, lora_a, mapping), lora_b, mapping, y, slice_sizes)
