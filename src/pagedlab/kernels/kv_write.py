"""Write the new tokens' keys and values into the paged KV cache, and the FP8 cache's numerics.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot
``s`` lives at block ``s // block_size``, offset ``s % block_size``. Negative slots (padding)
are skipped.

An FP8 cache (``kv_cache_dtype="fp8"``: E4M3, ``torch.float8_e4m3fn``) stores ``x / scale``
rounded to nearest even after clamping to +-448 (so out-of-range values saturate instead of
becoming NaN), with one scale per layer for keys and one for values (``k_scale``/``v_scale``,
vLLM's per-tensor scales); readers multiply by the scale. The scales apply to FP8 caches only:
a cache in the model's dtype stores the values as they are.
"""

from __future__ import annotations

import torch

from pagedlab.kernels.device import compute_capability
from pagedlab.kernels.pdl import pdl_launch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv_torch(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` in FP8 E4M3 at ``scale``: multiplied by the float32 reciprocal of the scale (what the
    Triton write does too, so both round the same), clamped, cast."""
    inverse = torch.tensor(1.0 / scale, dtype=torch.float32)
    return (x.float() * inverse).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv_torch(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache entries as float32: FP8 ones times their scale, the others as they are."""
    return x.float() * scale if is_fp8(x) else x.float()


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """Reference: ``key``/``value`` are ``[num_tokens, num_kv_heads, head_dim]``; an FP8 cache
    stores them quantized at ``k_scale``/``v_scale``."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for source, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = source[keep]
        cache.view(-1, *cache.shape[2:])[slots] = (quantize_kv_torch(rows, scale) if is_fp8(cache)
                                                   else rows.to(cache.dtype))


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
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
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} must have one dtype")
    check_fp8_supported(k_cache)
    triton_kernels.write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PADDED=1 << (num_kv_heads - 1).bit_length(),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=1 << (head_dim - 1).bit_length(),
        BLOCK_SIZE=k_cache.shape[1], FP8=is_fp8(k_cache), FP8_MAX=FP8_E4M3_MAX, **pdl_launch(key.device),
        num_warps=4)


def check_fp8_supported(cache: torch.Tensor) -> None:
    """Triton converts to and from E4M3 on compute capability 8.9 (Ada, Hopper) and up; on older
    GPUs an FP8 cache is refused here, by name, instead of failing inside the compiler."""
    if not is_fp8(cache) or cache.device.type != "cuda":
        return
    major, minor = compute_capability(cache.device)
    if (major, minor) < (8, 9):
        raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer for the "
                         f"Triton kernels; this one is {major}.{minor}: use kv_cache_dtype='auto' or "
                         "attention_backend='torch'")
