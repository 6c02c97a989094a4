"""One step's tokens by LoRA slot, and the plain-torch references of the shrink/expand kernels in
``pagedlab.kernels.lora`` (the path the CPU runs; see that module for the layout of the stacked
weights). Importable without triton."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRAMapping:
    """One step's tokens by LoRA slot (int32 tensors on the model's device; only the first tokens
    of ``token_slots`` and the listed part of ``sorted_token_ids`` are meaningful): slot s owns
    the ``slot_counts[s]`` token indices of ``sorted_token_ids`` from ``slot_starts[s]``."""

    token_slots: torch.Tensor  # [>= tokens] slot of each token, -1 for none
    sorted_token_ids: torch.Tensor  # [>= tokens] token indices grouped by slot
    slot_counts: torch.Tensor  # [slots]
    slot_starts: torch.Tensor  # [slots]

    @classmethod
    def empty(cls, max_tokens: int, num_slots: int, device: torch.device) -> LoRAMapping:
        """Static buffers for up to ``max_tokens`` tokens, every token without a slot."""
        def zeros(n):
            return torch.zeros(n, dtype=torch.int32, device=device)
        return cls(torch.full((max_tokens,), -1, dtype=torch.int32, device=device), zeros(max_tokens),
                   zeros(num_slots), zeros(num_slots))


def sort_tokens_by_slot(token_slots, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted token ids, count per slot, start per slot) of ``token_slots`` (-1: no slot), int32."""
    token_slots = np.asarray(token_slots, dtype=np.int64)
    order = np.argsort(token_slots, kind="stable")
    order = order[token_slots[order] >= 0]
    counts = np.bincount(token_slots[token_slots >= 0], minlength=num_slots)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return order.astype(np.int32), counts.astype(np.int32), starts.astype(np.int32)


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
                      slice_offsets: torch.Tensor, slice_sizes: torch.Tensor) -> None:
    """``y[t, offset_j:offset_j + size_j] += h[j, t] @ B[slot(t), j].T`` for every slice ``j``, in place."""
    parts = list(zip(slice_offsets.tolist(), slice_sizes.tolist()))
    for slot, rows in _rows_by_slot(mapping, y.shape[0]):
        for part, (offset, size) in enumerate(parts):
            delta = h[part, rows] @ lora_b[slot, part, :size].float().T
            y[rows, offset:offset + size] += delta.to(y.dtype)
