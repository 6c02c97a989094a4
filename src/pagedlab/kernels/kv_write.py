"""Write the new tokens' keys and values into the paged KV cache, and the FP8 cache's numerics.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot
``s`` lives at block ``s // block_size``, offset ``s % block_size``. Negative slots (padding)
are skipped.

An FP8 cache (``kv_cache_dtype="fp8"``: E4M3, ``torch.float8_e4m3fn``) stores ``x / scale``
rounded to nearest even after clamping to +-448 (so out-of-range values saturate instead of
becoming NaN), with one scale per layer for keys and one for values (``k_scale``/``v_scale``,
vLLM's per-tensor scales); readers multiply by the scale. The scales apply to FP8 caches only:
a cache in the model's dtype stores the values as they are.

A layer with rotary embedding writes through ``rotate_and_write_kv_triton`` instead: one launch
that normalizes q and k per head (Qwen3, Gemma 3: ``QKNorm``), rotates them, returns the rotated
queries and stores the rotated keys and the values exactly as ``write_kv_triton`` does (in a
batch-1 decode step every launch costs microseconds: the rotation's compiled kernels and the
write were three a layer). ``rotate_and_write_kv_torch`` is its reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedlab.kernels.device import compute_capability
from pagedlab.kernels.pdl import pdl_launch
from pagedlab.layers.norm import rms_norm, rms_norm_unit_offset
from pagedlab.layers.rotary import apply_rotary

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
    from pagedlab.kernels import kv_write_kernels

    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("key, value, k_cache and v_cache need a contiguous head_dim")
    _check_caches(key, k_cache, v_cache)
    kv_write_kernels.write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PADDED=1 << (num_kv_heads - 1).bit_length(),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=1 << (head_dim - 1).bit_length(),
        BLOCK_SIZE=k_cache.shape[1], FP8=is_fp8(k_cache), FP8_MAX=FP8_E4M3_MAX, **pdl_launch(key.device),
        num_warps=4)


def _check_caches(key: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]) or v_cache.shape != k_cache.shape:
        raise ValueError(f"key {tuple(key.shape)} does not fit caches "
                         f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)} "
                         "([num_blocks, block_size, num_kv_heads, head_dim])")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} must have one dtype")
    check_fp8_supported(k_cache)


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


class QKNorm(NamedTuple):
    """Per-head RMSNorm of the queries and keys before the rotation: their weights (``[head_dim]``),
    one eps, and ``unit_offset`` (Gemma's ``1 + weight``)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    unit_offset: bool = False


def rotate_and_write_kv_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                              norm: QKNorm | None = None) -> torch.Tensor:
    """Reference of ``rotate_and_write_kv_triton``: ``q``/``k`` normalized by ``norm`` where given
    (``layers.norm``'s RMSNorm, rounded where it rounds), rotated by ``cos``/``sin``
    (``[tokens, 1, rotary_dim]``, ``layers.rotary``'s NeoX rotation) in float32 and rounded once
    to their dtype; then ``write_kv_torch`` of the keys and ``v``. Returns the rotated queries."""
    dtype = q.dtype
    if norm is not None:
        rms = rms_norm_unit_offset if norm.unit_offset else rms_norm
        q, k = rms(q, norm.q_weight, norm.eps), rms(k, norm.k_weight, norm.eps)
    q, k = apply_rotary(q.float(), k.float(), cos.float(), sin.float())
    write_kv_torch(k.to(dtype), v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q.to(dtype)


def rotate_and_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                               norm: QKNorm | None = None) -> torch.Tensor:
    """``rotate_and_write_kv_torch`` in one Triton launch: a program per (token, KV head) covers
    that KV head's query heads, key and value. ``q``/``k``/``v`` may be strided views (slices of a
    fused QKV output) with a contiguous head_dim. No host sync: it can be captured in a CUDA graph."""
    from pagedlab.kernels import kv_write_kernels

    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, rotary_dim = k.shape[1], cos.shape[-1]
    _check_rotate_inputs(q, k, v, cos, sin, k_cache, v_cache, norm)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_padded, head_dim_padded = 1 << (group - 1).bit_length(), 1 << (head_dim - 1).bit_length()
    weights = (q, q) if norm is None else (norm.q_weight, norm.k_weight)
    kv_write_kernels.rotate_write_kv_kernel[(num_tokens, num_kv_heads)](
        q, k, v, cos, sin, *weights, out, k_cache, v_cache, slot_mapping,
        0.0 if norm is None else norm.eps, 1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, GROUP_PADDED=group_padded, HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded,
        ROTARY_DIM=rotary_dim, BLOCK_SIZE=k_cache.shape[1], NORM=norm is not None,
        UNIT_OFFSET=norm is not None and norm.unit_offset, FP8=is_fp8(k_cache), FP8_MAX=FP8_E4M3_MAX,
        **pdl_launch(q.device), num_warps=max(1, min(4, group_padded * head_dim_padded // 256)))
    return out


def _check_rotate_inputs(q, k, v, cos, sin, k_cache, v_cache, norm: QKNorm | None) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         "[tokens, heads, head_dim], [tokens, kv_heads, head_dim] twice, heads a multiple "
                         "of kv_heads")
    rotary_dim = cos.shape[-1]
    if (cos.shape != sin.shape or cos.shape != (num_tokens, 1, rotary_dim) or rotary_dim % 2
            or not 2 <= rotary_dim <= head_dim):
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [{num_tokens}, 1, "
                         f"rotary_dim] with rotary_dim even and at most head_dim={head_dim}")
    if norm is not None and (norm.q_weight.shape != (head_dim,) or norm.k_weight.shape != (head_dim,)):
        raise ValueError(f"q/k norm weights {tuple(norm.q_weight.shape)}/{tuple(norm.k_weight.shape)} must "
                         f"be [head_dim={head_dim}]")
    tensors = (q, k, v, cos, sin, k_cache, v_cache) + (() if norm is None else (norm.q_weight, norm.k_weight))
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("q, k, v, cos, sin, the caches and the norm weights need a contiguous last "
                         "dimension")
    _check_caches(k, k_cache, v_cache)
