"""Triton kernels that write a step's keys and values into the paged KV cache: the plain KV write,
and the KV write fused with the q/k norms and rotary embedding before it. Their entry points are
``write_kv_triton`` and ``rotate_and_write_kv_triton`` (kv_write.py), which import this module
when they first run (as ``triton_kernels``; see its docstring for why late).

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``, head_dim
contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedlab.kernels.pdl_jit import pdl_wait_and_trigger
from pagedlab.kernels.triton_kernels import _round_to_e4m3


@triton.jit
def _cache_slot_offset(slot, stride_block, stride_token, BLOCK_SIZE: tl.constexpr):
    """Where cache slot ``slot`` (int64) starts: block ``slot // BLOCK_SIZE``, row ``slot % BLOCK_SIZE``."""
    return (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_token


@triton.jit
def _store_kv(cache_ptr, offsets, x, mask, scale_inverse, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Store the tile ``x`` at ``cache_ptr + offsets``: cast to the cache's dtype or, into an FP8
    cache, ``x * scale_inverse`` clamped to +-FP8_MAX (saturated, never inf/NaN) and rounded to
    nearest even. The KV write and the fused rotary write store through this one function."""
    if FP8:
        x = _round_to_e4m3(x.to(tl.float32) * scale_inverse, FP8_MAX)
    tl.store(cache_ptr + offsets, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def write_kv_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_inverse, v_scale_inverse,
        stride_key_token, stride_key_head, stride_value_token, stride_value_head,
        stride_kc_block, stride_kc_token, stride_kc_head,
        stride_vc_block, stride_vc_token, stride_vc_head,
        NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PADDED: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        FP8: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    """Program (token): copy all KV heads of one token into its cache slot (``_store_kv``); slot
    < 0 skips. PDL: waits first."""
    pdl_wait_and_trigger(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, NUM_KV_HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    key = tl.load(key_ptr + token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :],
                  mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + offs_h[:, None] * stride_value_head
                    + offs_d[None, :], mask=mask)
    k_dst = _cache_slot_offset(slot, stride_kc_block, stride_kc_token, BLOCK_SIZE)
    v_dst = _cache_slot_offset(slot, stride_vc_block, stride_vc_token, BLOCK_SIZE)
    _store_kv(k_cache_ptr, k_dst + offs_h[:, None] * stride_kc_head + offs_d[None, :], key, mask,
              k_scale_inverse, FP8, FP8_MAX)
    _store_kv(v_cache_ptr, v_dst + offs_h[:, None] * stride_vc_head + offs_d[None, :], value, mask,
              v_scale_inverse, FP8, FP8_MAX)


@triton.jit
def _rms_scale(x, rstd, weight, dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """float32 rows ``x`` times their ``rstd`` and ``weight`` (``[HEAD_DIM_PADDED]``), rounded to
    ``dtype`` where ``layers/norm.py`` rounds: ``weight * (x * rstd)`` with both products rounded,
    or (UNIT_OFFSET, Gemma) ``x * rstd * (1 + weight)`` rounded once. Returned as float32."""
    weight = weight.to(tl.float32)[None, :]
    if UNIT_OFFSET:
        return (x * rstd * (1.0 + weight)).to(dtype).to(tl.float32)
    return ((x * rstd).to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)


@triton.jit
def _norm_rotate_rows(row_ptrs, row_valid, weight_ptr, eps, cos, sin, offs_d, partner,
                      HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, NORM: tl.constexpr,
                      UNIT_OFFSET: tl.constexpr):
    """Rows ``row_ptrs[:, None] + d`` RMS-normalized (NORM) and rotated, in float32 (each value
    rounded where ``layers/norm.py`` and the rotation round it, the final cast left to the caller).

    NeoX rotation of the first ROTARY_DIM dims: ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x)[d] = -x[d + R/2]`` below R/2 and ``x[d - R/2]`` above; each lane loads its
    partner dim ``partner[d]`` a second time (normalized with the row's own statistics) instead of
    moving values between lanes. Dims from ROTARY_DIM on pass through."""
    dtype = row_ptrs.dtype.element_ty
    dim_valid = offs_d < HEAD_DIM
    rotating = offs_d < ROTARY_DIM
    x = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=row_valid[:, None] & dim_valid[None, :],
                other=0.0).to(tl.float32)
    x_partner = tl.load(row_ptrs[:, None] + partner[None, :], mask=row_valid[:, None] & rotating[None, :],
                        other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        weight = tl.load(weight_ptr + offs_d, mask=dim_valid, other=0.0)
        weight_partner = tl.load(weight_ptr + partner, mask=rotating, other=0.0)
        x = _rms_scale(x, rstd, weight, dtype, UNIT_OFFSET)
        x_partner = _rms_scale(x_partner, rstd, weight_partner, dtype, UNIT_OFFSET)
    rotated_half = tl.where(offs_d < ROTARY_DIM // 2, -x_partner, x_partner)
    return tl.where(rotating[None, :], x * cos[None, :] + rotated_half * sin[None, :], x)


@triton.jit
def rotate_write_kv_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr,
        k_cache_ptr, v_cache_ptr, slot_mapping_ptr, eps, k_scale_inverse, v_scale_inverse,
        stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
        stride_cos_token, stride_sin_token, stride_out_token, stride_out_head,
        stride_kc_block, stride_kc_token, stride_kc_head,
        stride_vc_block, stride_vc_token, stride_vc_head,
        GROUP: tl.constexpr, GROUP_PADDED: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PADDED: tl.constexpr, ROTARY_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
        PDL: tl.constexpr):
    """Program (token, kv_head): the GROUP query heads of one KV head, and that KV head's key and
    value, of one token. Queries and keys are RMS-normalized per head (NORM; UNIT_OFFSET: by
    ``1 + weight``) and rotated (``_norm_rotate_rows``); the queries go to ``q_out`` in its dtype,
    the key (rounded to the model's dtype first, as an unfused rotation would hand it on) and the
    value to the token's cache slot through ``_store_kv``, unless the slot is negative. Every load
    comes before the first store and none hangs on the slot, so the program waits for memory once
    (a decode step's latency). Every number a program computes depends on its own rows and the
    constexprs alone, so a token's output is the same in any batch (batch-invariant mode). PDL:
    waits first."""
    pdl_wait_and_trigger(PDL)
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = offs_d < HEAD_DIM
    rotating = offs_d < ROTARY_DIM
    partner = tl.where(offs_d < ROTARY_DIM // 2, offs_d + ROTARY_DIM // 2, offs_d - ROTARY_DIM // 2)
    cos = tl.load(cos_ptr + token * stride_cos_token + offs_d, mask=rotating, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin_token + offs_d, mask=rotating, other=0.0).to(tl.float32)
    offs_g = tl.arange(0, GROUP_PADDED)
    head = kv_head * GROUP + offs_g
    group_valid = offs_g < GROUP
    q = _norm_rotate_rows(q_ptr + token * stride_q_token + head * stride_q_head, group_valid, q_weight_ptr,
                          eps, cos, sin, offs_d, partner, HEAD_DIM, ROTARY_DIM, NORM, UNIT_OFFSET)
    row = tl.arange(0, 1)  # the key and the value as one-row tiles
    row_valid = row < 1
    key = _norm_rotate_rows(k_ptr + token * stride_k_token + kv_head * stride_k_head + row, row_valid,
                            k_weight_ptr, eps, cos, sin, offs_d, partner, HEAD_DIM, ROTARY_DIM, NORM,
                            UNIT_OFFSET)
    v_src = v_ptr + token * stride_v_token + kv_head * stride_v_head
    value = tl.load(v_src + row[:, None] + offs_d[None, :], mask=row_valid[:, None] & dim_valid[None, :])
    tl.store(q_out_ptr + token * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :],
             q.to(q_out_ptr.dtype.element_ty), mask=group_valid[:, None] & dim_valid[None, :])
    mask = ((row + slot) >= 0)[:, None] & dim_valid[None, :]  # the one row, where its slot is not padding
    k_dst = _cache_slot_offset(slot, stride_kc_block, stride_kc_token, BLOCK_SIZE) + kv_head * stride_kc_head
    v_dst = _cache_slot_offset(slot, stride_vc_block, stride_vc_token, BLOCK_SIZE) + kv_head * stride_vc_head
    _store_kv(k_cache_ptr, k_dst + row[:, None] + offs_d[None, :], key.to(k_ptr.dtype.element_ty), mask,
              k_scale_inverse, FP8, FP8_MAX)
    _store_kv(v_cache_ptr, v_dst + row[:, None] + offs_d[None, :], value, mask, v_scale_inverse, FP8, FP8_MAX)
