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


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton version of ``write_kv_torch``: one program per token, negative slots skipped.

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV output) as long as
    head_dim is contiguous. No host sync, so it can be captured in a CUDA graph.
    """
    from pagedlab.kernels import triton_kernels

    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("key, value, k_cache and v_cache need a contiguous head_dim")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"key {tuple(key.shape)} does not fit caches "
                         f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)} "
                         "([num_blocks, block_size, num_kv_heads, head_dim])")
    triton_kernels.write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PADDED=1 << (num_kv_heads - 1).bit_length(),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=1 << (head_dim - 1).bit_length(),
        BLOCK_SIZE=k_cache.shape[1], num_warps=4)
