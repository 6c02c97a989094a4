"""Write the new tokens' keys and values into the paged KV cache.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot
``s`` lives at block ``s // block_size``, offset ``s % block_size``. Negative slots (padding)
are skipped.
"""

from __future__ import annotations

import torch


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Reference: ``key``/``value`` are ``[num_tokens, num_kv_heads, head_dim]``."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)
