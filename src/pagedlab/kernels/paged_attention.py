"""Varlen causal attention over the paged KV cache.

One call covers prefill, chunked prefill, prefix-cache hits and decode. The queries of all
sequences are packed: ``q`` is ``[num_tokens, num_heads, head_dim]`` and sequence ``i`` owns
rows ``query_start_loc[i]:query_start_loc[i+1]``. Its keys and values (``seq_lens[i]`` of them,
the new ones already written) are read from the cache through ``block_tables[i]``.
Query ``j`` of a sequence with context ``c = seq_len - query_len`` sees keys ``0..c+j``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference implementation: one masked SDPA per sequence, computed in float32."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        if query_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        qi = q[start:end].transpose(0, 1).float()
        ki = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
        vi = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start:end] = oi.transpose(0, 1).to(q.dtype)
    return out
