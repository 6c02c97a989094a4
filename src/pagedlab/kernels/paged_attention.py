"""Varlen causal attention over the paged KV cache.

One call covers prefill, chunked prefill, prefix-cache hits and decode. The queries of all
sequences are packed: ``q`` is ``[num_tokens, num_heads, head_dim]`` and sequence ``i`` owns
rows ``query_start_loc[i]:query_start_loc[i+1]``. Its keys and values (``seq_lens[i]`` of them,
the new ones already written) are read from the cache through ``block_tables[i]``.
Query ``j`` of a sequence with context ``c = seq_len - query_len`` sees keys ``0..c+j``.
Caches in FP8 (see ``kv_write``) are read times their ``k_scale``/``v_scale``.

Two per-layer options: ``sliding_window`` W (Mistral, Gemma 2/3's local layers; HF's
convention) lets the query at position p see only keys (p - W, p], and keys older than the
first query's window are never read, since the KV manager may have freed their blocks;
``softcap`` (Gemma 2's ``attn_logit_softcapping``) turns the scaled scores s into
``softcap * tanh(s / softcap)`` before the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedlab.kernels.attention_configs import TILE_N, AttentionLaunch, attention_launch, padded_head_dim
from pagedlab.kernels.attention_tuning import (PrefillShape, PrefillTileTuner, device_fingerprint,
                                               kernel_fingerprint, query_bucket, tuning_prompts)
from pagedlab.kernels.kv_write import FP8_KV_DTYPE, check_fp8_supported, dequantize_kv_torch, is_fp8
from pagedlab.kernels.pdl import pdl_launch


@dataclass
class TorchAttentionPlan:
    """What ``paged_attention_torch`` derives from the batch layout alone; every layer of a step
    shares it, so a model runner builds it once per step."""

    decode_tokens: torch.Tensor | None  # query rows of the single-token sequences (None: all rows)
    decode_slots: torch.Tensor | None  # [seqs, keys] cache slots to read (past the end: slot of key 0)
    decode_bias: torch.Tensor | None  # [seqs, 1, 1, keys] additive mask: 0 on the sequence's keys, else -inf
    sequences: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (start, end, blocks, causal mask)


def plan_torch_attention(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                         block_size: int, sliding_window: int | None = None) -> TorchAttentionPlan:
    """The masks and cache slots of one batch layout (for layers with ``sliding_window``)."""
    device = block_tables.device
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    tokens = slots = bias = None
    if decode:
        rows = torch.tensor(decode, device=device)
        num_blocks = -(-max(lens[i] for i in decode) // block_size)
        tables = block_tables[rows, :num_blocks].long()
        key_pos = torch.arange(num_blocks * block_size, device=device)[None, :]
        ends = seq_lens[rows][:, None].long()
        mask = key_pos < ends
        if sliding_window is not None:
            mask &= key_pos >= ends - sliding_window
        slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
        # Slots past a sequence's end hold stale data, maybe NaN, which a mask cannot cancel
        # (0 * NaN), and blocks before a window may be freed: read the sequence's last key there
        # instead, then mask it out.
        slots = torch.where(mask, slots, slots.gather(1, ends - 1))
        bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))[:, None, None, :]
        if len(decode) < starts[-1]:
            tokens = query_start_loc[rows].long()
    sequences = []
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if end - start > 1:
            first_block = 0  # the first block any query sees
            if sliding_window is not None:
                first_block = max(seq_len - (end - start) - sliding_window + 1, 0) // block_size
            blocks = block_tables[i, first_block:-(-seq_len // block_size)].long()
            query_pos = torch.arange(seq_len - (end - start), seq_len, device=device)
            key_pos = torch.arange(first_block * block_size, seq_len, device=device)[None, :]
            causal = key_pos <= query_pos[:, None]
            if sliding_window is not None:
                causal &= key_pos > query_pos[:, None] - sliding_window
            sequences.append((start, end, blocks, causal))
    return TorchAttentionPlan(tokens, slots, bias, sequences)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, scale: float,
                          plan: TorchAttentionPlan | None = None, k_scale: float = 1.0,
                          v_scale: float = 1.0, sliding_window: int | None = None,
                          softcap: float | None = None) -> torch.Tensor:
    """Reference implementation in float32: every single-token (decode) sequence in one batched
    masked SDPA, every other sequence in its own causal SDPA. FP8 caches are dequantized with
    ``k_scale``/``v_scale``. A given ``plan`` must be built for the same ``sliding_window``."""
    if plan is None:
        plan = plan_torch_attention(query_start_loc, seq_lens, block_tables, k_cache.shape[1], sliding_window)
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    if plan.decode_slots is not None:
        k = dequantize_kv_torch(k_cache.flatten(0, 1)[plan.decode_slots].transpose(1, 2), k_scale)
        v = dequantize_kv_torch(v_cache.flatten(0, 1)[plan.decode_slots].transpose(1, 2), v_scale)
        rows = plan.decode_tokens
        # The query heads sharing a KV head stand in the "query" axis: GQA without copying K/V.
        qd = (q[:k.shape[0]] if rows is None else q[rows]).float().unflatten(1, (k.shape[1], group))
        o = _attention(qd, k, v, plan.decode_bias, scale, softcap).flatten(1, 2)
        if rows is None and o.shape[0] == q.shape[0]:
            return o.to(q.dtype)
        out[rows if rows is not None else slice(0, o.shape[0])] = o.to(q.dtype)
    for start, end, blocks, causal in plan.sequences:
        seq_len = causal.shape[1]
        k = dequantize_kv_torch(k_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1), k_scale)
        v = dequantize_kv_torch(v_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1), v_scale)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        o = _attention(q[start:end].transpose(0, 1).float(), k, v, causal, scale, softcap)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


def _attention(q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """SDPA, or with ``softcap`` the same written out (SDPA has no soft-capping); ``mask`` is
    boolean (True: seen) or additive."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.tanh(q @ k.transpose(-1, -2) * (scale / softcap)) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1) @ v


def paged_attention_rows_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                               block_tables: torch.Tensor, scale: float, k_scale: float = 1.0,
                               v_scale: float = 1.0, sliding_window: int | None = None,
                               softcap: float | None = None) -> torch.Tensor:
    """``paged_attention_torch`` one query row at a time (batch-invariant mode): each token's
    query heads attend in their own call over exactly the keys it sees, so the call, and its
    result, is the same whether the token is decoded, prefilled whole or in chunks, or sits in
    any batch. Slow for long prefills: meant for the CPU."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        blocks = block_tables[i, :-(-seq_len // block_size)].long()
        k = dequantize_kv_torch(k_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1), k_scale)
        v = dequantize_kv_torch(v_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1), v_scale)
        context_len = seq_len - (end - start)
        for row in range(start, end):
            visible = context_len + row - start + 1
            first = 0 if sliding_window is None else max(0, visible - sliding_window)
            query = q[row].float().unflatten(0, (num_kv_heads, group))  # [kv_heads, group, head_dim]
            seen = torch.ones(1, visible - first, dtype=torch.bool)
            o = _attention(query, k[:, first:visible], v[:, first:visible], seen, scale, softcap)
            out[row] = o.flatten(0, 1).to(q.dtype)
    return out


# Split-KV: decode batches too small to fill the GPU split each sequence's keys into segments of a
# FIXED number of tokens (never a fixed count, so a row's arithmetic does not depend on the batch).
# Measured on an H200 under CUDA graphs (bf16, 8 KV heads, GQA 4, head_dim 128): split 256 cuts
# decode of 4 x 8,192 keys from 200 to 48 us and of 16 x 8,192 from 237 to 152 us; at 32
# sequences (256 programs) it is a wash and at 128 sequences it loses (85 -> 105 us at 576 keys).
# 128 is better for tiny batches of short sequences, 512 for long ones; 256 is never far off.
SPLIT_KV_SIZE = 256
# Smaller segments for a batch whose split grid would still leave most SMs idle: the smallest of
# these whose grid (sequences x KV heads x segments) stays within SPLIT_KV_TARGET_PROGRAMS, about
# one program per SM. One sequence of 640 keys (8 KV heads, head_dim 128, H200, 2026-12-01): 9.0 us
# with 64-key segments (80 programs), 9.7 with 128, 11.7 with 256; 16 x 8,192 keys: 256 best.
SPLIT_KV_SMALL_SIZES = (64, 128)
SPLIT_KV_TARGET_PROGRAMS = 128
# The segment size is chosen for sequences of at most this many keys; a CUDA graph sized for
# longer ones (its ``max_model_len``) keeps that size for the short sequences it mostly runs.
SPLIT_KV_SHORT_SEQ = 1024
# At most this many segments per sequence in a default-mode split launch: a longer sequence's
# segments grow instead (``paged_attention_triton``'s ``max_kv_segments``), so a launch sized for
# max_model_len keys neither runs nor reduces hundreds of segments per sequence. 32 segments of
# ``SPLIT_KV_SIZE`` hold 8,192 keys: up to there a sequence splits as when the launch is sized for it.
# On an H200 (2026-12-04, Qwen3-30B-A3B heads) one sequence of 640 keys in a launch sized for 40,960
# took 26.5 us before (256-key segments, 160 of them reduced) and 9.0 with the cap and the size
# chosen for short sequences (7.9 sized for 640); 1 x 40,000 keys 59.9 -> 54.4 us.
SPLIT_KV_MAX_SEGMENTS = 32
# Split only below this many (sequence, KV head) programs: about one wave of resident programs.
SPLIT_KV_MIN_PROGRAMS = 256
# A decode launch's sequences lie on grid axis 1, whose size CUDA caps at 65,535.
MAX_DECODE_SEQS = 65535
# Query-start entries each program scans per step when it looks up its sequence.
SEQUENCE_SEARCH_CHUNK = 256
# Rows of every query tile in batch-invariant mode (prefill's tile; decode pads up to it).
BATCH_INVARIANT_BLOCK_M = 64
# Key segment of batch-invariant mode (tokens, from key 0; no window): every launch, split or
# not, attends each segment from a fresh softmax state and folds them in segment order, so a small
# decode batch may split its keys (``split_kv_size`` = this) and still match a prefill bitwise.
# 0: no segments and no split (one run over the keys, in 64-key tiles from key 0). On one H200
# (W-seed, 2026-12-01) 64-key segments took batch-1 TPOT from 5.06 to 4.77 ms and cost batch 256
# 0.6%; 128 gave 4.81 ms and cost 5.5% (BENCHMARKS.md, issue 14).
BATCH_INVARIANT_SPLIT_KV_SIZE = 64


def choose_split_kv_size(num_seqs: int, num_kv_heads: int, max_query_len: int,
                         max_seq_len: int | None = None, split_kv_size: int | None = None) -> int | None:
    """Split-KV policy: the split size (tokens) to use, or None for the plain 2D launch.

    Splits only decode-only batches (``max_query_len == 1``) whose 2D grid would have fewer than
    ``SPLIT_KV_MIN_PROGRAMS`` programs, and only when a sequence can be longer than one
    ``SPLIT_KV_SIZE`` segment. The size: ``split_kv_size`` where given (batch-invariant mode's
    fixed segments), else the smallest of ``SPLIT_KV_SMALL_SIZES`` whose grid over sequences of
    ``min(max_seq_len, SPLIT_KV_SHORT_SEQ)`` keys fits in ``SPLIT_KV_TARGET_PROGRAMS``, else
    ``SPLIT_KV_SIZE``. Every argument is a host int, so a CUDA-graph runner can fix the choice
    per captured size (pass its ``max_model_len`` as ``max_seq_len``).
    """
    programs = num_seqs * num_kv_heads
    if max_query_len != 1 or programs >= SPLIT_KV_MIN_PROGRAMS:
        return None
    if max_seq_len is not None and max_seq_len <= (split_kv_size or SPLIT_KV_SIZE):
        return None
    if split_kv_size is not None or max_seq_len is None:
        return split_kv_size or SPLIT_KV_SIZE
    short = min(max_seq_len, SPLIT_KV_SHORT_SEQ)
    return next((size for size in SPLIT_KV_SMALL_SIZES
                 if programs * -(-short // size) <= SPLIT_KV_TARGET_PROGRAMS), SPLIT_KV_SIZE)


def split_kv_num_segments(max_seq_len: int, split_kv_size: int, max_kv_segments: int | None = None) -> int:
    """Segments of a split launch: ``max_seq_len`` keys in ``split_kv_size`` ones, at most
    ``max_kv_segments`` (None: no cap)."""
    num_segments = -(-max_seq_len // split_kv_size)
    return num_segments if max_kv_segments is None else min(num_segments, max_kv_segments)


def allocate_split_kv_scratch(num_tokens: int, num_heads: int, head_dim: int, max_seq_len: int,
                              split_kv_size: int, device: torch.device | str,
                              max_kv_segments: int | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 partials for split-KV: ``(acc [T, H, S, D'], max [T, H, S], sum [T, H, S])``.

    ``S = split_kv_num_segments(max_seq_len, split_kv_size, max_kv_segments)``, ``D'`` = head_dim
    padded to a power of two. Allocate once at the largest sizes to reuse it (e.g. across
    CUDA-graph replays).
    """
    num_segments = split_kv_num_segments(max_seq_len, split_kv_size, max_kv_segments)
    head_dim_padded = padded_head_dim(head_dim)
    acc = torch.empty(num_tokens, num_heads, num_segments, head_dim_padded, dtype=torch.float32,
                      device=device)
    row_max = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=device)
    row_sum = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=device)
    return acc, row_max, row_sum


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, *,
                           max_query_len: int | None = None, max_seq_len: int | None = None,
                           split_kv_size: int | None = None, max_kv_segments: int | None = None,
                           out: torch.Tensor | None = None,
                           scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0, sliding_window: int | None = None,
                           softcap: float | None = None, batch_invariant: bool = False,
                           prefill_tuner: PrefillTileTuner | None = None,
                           seq_order: torch.Tensor | None = None) -> torch.Tensor:
    """Triton varlen paged attention; same arguments and result as ``paged_attention_torch``.

    One launch covers prefill, chunked prefill, prefix hits, decode and mixes of them. No host
    sync: ``max_query_len`` (picks the query tile; default ``num_tokens``) and ``max_seq_len``
    (sizes split-KV; default ``block_tables.shape[1] * block_size``) are upper bounds given as
    ints. ``split_kv_size`` (tokens, a multiple of ``TILE_N``) turns on split-KV with a second
    reduce launch; see ``choose_split_kv_size``. ``max_kv_segments`` caps the segments a
    sequence is cut into (``SPLIT_KV_MAX_SEGMENTS`` in the engine; None: ``max_seq_len`` over the
    size): a longer sequence's segments grow to a multiple of the size, and a decode launch's
    reduce folds only the segments each sequence fills. Decode (``max_query_len == 1``) takes its
    key tile, warps and stages from ``DECODE_ATTENTION_CONFIGS`` (attention_configs.py) where it
    lists the shape, and its sequences in the order ``seq_order`` gives (int32, a permutation;
    longest first, ``decode_order``, no long sequence starts last; results never change). ``out``,
    ``scratch`` (``allocate_split_kv_scratch``) may be preallocated, e.g. for CUDA graphs. Output
    rows past ``query_start_loc[-1]`` (padding) stay untouched. FP8 caches are read at
    ``k_scale``/``v_scale``; ``sliding_window``/``softcap`` as in ``paged_attention_torch``.
    ``batch_invariant``: one query tile size for every batch and, without a window, keys in
    segments of ``BATCH_INVARIANT_SPLIT_KV_SIZE`` folded in one order whether split across
    programs or not, so a token's output is bitwise the same in decode, in a prefill chunk and in
    any batch; ``split_kv_size`` may then only be that size (no split with a window).
    ``prefill_tuner``: an unsplit default-mode launch of longer queries takes its tile from it.
    """
    segment_size = _batch_invariant_segment_size(split_kv_size, sliding_window) if batch_invariant else 0
    kernels = _AttentionKernels(q, k_cache, v_cache, scale, k_scale, v_scale, sliding_window, softcap,
                                batch_invariant, _checked_order(seq_order, seq_lens, max_query_len))
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    max_query_len = num_tokens if max_query_len is None else max_query_len
    max_seq_len = block_tables.shape[1] * k_cache.shape[1] if max_seq_len is None else max_seq_len
    if split_kv_size is None:
        kernels.attend(out, query_start_loc, seq_lens, block_tables, max_query_len, segment_size=segment_size,
                       tuner=prefill_tuner)
        return out

    _check_split(split_kv_size, max_kv_segments, batch_invariant)
    num_segments = split_kv_num_segments(max_seq_len, split_kv_size, max_kv_segments)
    if scratch is None:
        scratch = allocate_split_kv_scratch(num_tokens, q.shape[1], q.shape[2], max_seq_len, split_kv_size,
                                            q.device, max_kv_segments)
    _check_scratch(scratch, num_tokens, q.shape[1], num_segments, kernels.head_dim_padded)
    kernels.attend(scratch, query_start_loc, seq_lens, block_tables, max_query_len, split_kv_size,
                   num_segments)
    kernels.reduce(out, scratch, query_start_loc, seq_lens, num_segments, split_kv_size,
                   decode=max_query_len == 1)
    return out


def decode_order(seq_lens) -> np.ndarray:
    """A decode batch's sequences longest first (int32; ties in batch order): the ``seq_order``
    that keeps a launch's tail short."""
    return np.argsort(-np.asarray(seq_lens, dtype=np.int64), kind="stable").astype(np.int32)


def _check_split(split_kv_size: int, max_kv_segments: int | None, batch_invariant: bool) -> None:
    if split_kv_size <= 0 or split_kv_size % TILE_N:
        raise ValueError(f"split_kv_size={split_kv_size} must be a positive multiple of {TILE_N}")
    if max_kv_segments is not None and (max_kv_segments < 1 or batch_invariant):
        raise ValueError(f"max_kv_segments={max_kv_segments} must be a positive count, and None in "
                         "batch_invariant mode (its segments never grow)")


def _checked_order(seq_order: torch.Tensor | None, seq_lens: torch.Tensor,
                   max_query_len: int | None) -> torch.Tensor | None:
    if seq_order is None:
        return None
    num_seqs = seq_lens.shape[0]
    if (max_query_len != 1 or seq_order.shape != (num_seqs,) or seq_order.dtype != torch.int32
            or seq_order.device != seq_lens.device):
        raise ValueError(f"seq_order (shape {tuple(seq_order.shape)}, {seq_order.dtype}, {seq_order.device}) "
                         f"must be int32 of shape ({num_seqs},) on {seq_lens.device}, for a decode launch "
                         f"(max_query_len=1, got {max_query_len})")
    return seq_order


def _batch_invariant_segment_size(split_kv_size: int | None, sliding_window: int | None) -> int:
    """The key segment of a batch-invariant launch (0: none, with a window), after checking the
    split it is asked for."""
    segment_size = BATCH_INVARIANT_SPLIT_KV_SIZE if sliding_window is None else 0
    if segment_size < 0 or segment_size % TILE_N:
        raise ValueError(f"BATCH_INVARIANT_SPLIT_KV_SIZE={segment_size} must be 0 or a positive multiple "
                         f"of {TILE_N}")
    if split_kv_size not in (None, segment_size or None):
        raise ValueError(f"batch_invariant attention with split_kv_size={split_kv_size}: it splits "
                         f"keys only in its {BATCH_INVARIANT_SPLIT_KV_SIZE}-key segments, never with a "
                         "window")
    return segment_size


def _check_scratch(scratch, num_tokens: int, num_heads: int, num_segments: int, head_dim_padded: int) -> None:
    partial_acc, partial_max, partial_sum = scratch
    if (partial_acc.shape[0] < num_tokens or partial_acc.shape[1] != num_heads
            or partial_acc.shape[2] < num_segments or partial_acc.shape[3] != head_dim_padded):
        raise ValueError(f"scratch acc {tuple(partial_acc.shape)} is too small for {num_tokens} tokens, "
                         f"{num_heads} heads, {num_segments} segments, head_dim {head_dim_padded}")
    if (partial_max.shape != partial_acc.shape[:3] or partial_sum.shape != partial_acc.shape[:3]
            or partial_max.stride() != partial_sum.stride() or partial_max.stride(-1) != 1
            or partial_acc.stride(-1) != 1):
        raise ValueError("scratch (acc, max, sum) must come from allocate_split_kv_scratch: max and sum "
                         "shaped like acc's first three dims, with equal strides and contiguous last dims")


class _AttentionKernels:
    """Launches of the attention and reduce kernels for one (q, cache) pair, checked once."""

    def __init__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 k_scale: float = 1.0, v_scale: float = 1.0, sliding_window: int | None = None,
                 softcap: float | None = None, batch_invariant: bool = False,
                 seq_order: torch.Tensor | None = None):
        from pagedlab.kernels import triton_kernels

        self.triton_kernels = triton_kernels
        self.options = (scale, k_scale, v_scale, sliding_window, softcap, batch_invariant)
        self.pdl = pdl_launch(q.device)
        _num_tokens, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
        if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
            raise ValueError(f"q head_dim {head_dim} and caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)}"
                             " must agree: caches are [num_blocks, block_size, num_kv_heads, head_dim]")
        if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8_KV_DTYPE):
            raise ValueError(f"cache dtypes {k_cache.dtype}/{v_cache.dtype} must both be q's dtype {q.dtype} "
                             f"or {FP8_KV_DTYPE}")
        check_fp8_supported(k_cache)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if block_size % 16:
            raise ValueError(f"block_size={block_size} must be a multiple of 16")
        if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("q, k_cache and v_cache need a contiguous head_dim")
        self.q, self.k_cache, self.v_cache = q, k_cache, v_cache
        self.num_kv_heads, self.group = num_kv_heads, num_heads // num_kv_heads
        self.head_dim, self.head_dim_padded = head_dim, padded_head_dim(head_dim)
        # The interpreter's tl.dot is wrong for bf16; fp32 caches want exact fp32 products, not tf32.
        upcast = q.dtype == torch.bfloat16 and q.device.type == "cpu"
        self.kv_dtype_bits = k_cache.element_size() * 8
        self.common = dict(HEAD_DIM=head_dim, HEAD_DIM_PADDED=self.head_dim_padded, GROUP=self.group,
                           BLOCK_SIZE=block_size, UPCAST=upcast,
                           DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
                           SEQ_CHUNK=SEQUENCE_SEARCH_CHUNK,
                           # the interpreter's tl.dot (numpy's BLAS) rounds a row by its place in the tile
                           BROADCAST_DOT=batch_invariant and q.device.type == "cpu")
        self.batch_invariant = batch_invariant
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be a positive number of keys or None")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap={softcap} must be positive or None")
        self.common.update(SLIDING=sliding_window is not None, SOFTCAP=softcap is not None)
        fp8 = is_fp8(k_cache)
        # log2(e): the kernel uses exp2; an FP8 cache's scales multiply the scores and the output.
        # With soft-capping the scale goes inside the tanh and only log2(e) stays outside.
        score_scale = scale * (k_scale if fp8 else 1.0)
        self.qk_scale = 1.4426950408889634 * (1.0 if softcap else score_scale)
        self.window_args = (sliding_window or 0, score_scale / softcap if softcap else 1.0, softcap or 1.0)
        self.v_scale = v_scale if fp8 else 1.0
        self.seq_order = seq_order  # a decode launch's sequence order (see the kernel)
        self.cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))

    def attend(self, target, query_start_loc, seq_lens, block_tables, max_query_len: int,
               split_kv_size: int = 0, num_segments: int = 0, segment_offset: int = 0,
               prefix_only: bool = False, key_offset: torch.Tensor | None = None,
               segment_size: int = 0, tuner: PrefillTileTuner | None = None) -> None:
        """Normalized output into ``target`` (a tensor like q), or with ``split_kv_size`` the
        partials of segments ``segment_offset ..`` into ``target`` = scratch (acc, max, sum).
        ``prefix_only`` / ``key_offset``: the two halves of a cascade step (see the kernel);
        ``segment_size``: the normalized output folded from key segments of that size (SEGMENTED).
        A default-mode decode launch may take a tuned key tile (``attention_launch``), a
        default-mode unsplit prefill launch the query tile ``tuner`` chooses (``attention_tuning``)."""
        tunable = not prefix_only and key_offset is None
        launch = attention_launch(
            max_query_len, self.group, self.head_dim, self.kv_dtype_bits,
            batch_invariant_rows=BATCH_INVARIANT_BLOCK_M if self.batch_invariant else 0,
            tunable=tunable, split_kv_size=split_kv_size)
        prefill = max_query_len > 1 and not (split_kv_size or self.batch_invariant)
        if tuner is not None and tunable and prefill:
            bucket = query_bucket(max_query_len)
            dtype = str(self.q.dtype).removeprefix("torch.")
            shape = PrefillShape(self.head_dim, self.group, self.num_kv_heads, dtype, self.kv_dtype_bits,
                                 self.common["SLIDING"], self.common["SOFTCAP"], bucket, launch.block_m)
            launch = tuner.launch(shape, self._fingerprint(), launch, lambda: self._tuning_run(bucket))
        self.launch(launch, target, query_start_loc, seq_lens, block_tables, split_kv_size, num_segments,
                    segment_offset, prefix_only, key_offset, segment_size, decode=max_query_len == 1)

    def launch(self, launch: AttentionLaunch, target, query_start_loc, seq_lens, block_tables,
               split_kv_size: int = 0, num_segments: int = 0, segment_offset: int = 0,
               prefix_only: bool = False, key_offset: torch.Tensor | None = None,
               segment_size: int = 0, decode: bool = False) -> None:
        """One attention launch of shape ``launch``; ``decode``: no sequence has more than one query
        token (one program per sequence); the other arguments as ``attend``'s."""
        q, num_seqs = self.q, seq_lens.shape[0]
        if decode and num_seqs > MAX_DECODE_SEQS:
            raise ValueError(f"a decode launch of {num_seqs} sequences: its grid holds {MAX_DECODE_SEQS}")
        grid = ((self.num_kv_heads, num_seqs) if decode else (q.shape[0] // launch.block_q + num_seqs,
                                                              self.num_kv_heads))
        grid += (num_segments,) if split_kv_size else ()
        ordered = decode and self.seq_order is not None
        if split_kv_size:
            partial_acc, partial_max, partial_sum = target
            out = q  # unused by the split variant
            partial_strides = (partial_acc.stride(0), partial_acc.stride(1), partial_acc.stride(2),
                               partial_max.stride(0), partial_max.stride(1))
        else:
            out = partial_acc = partial_max = partial_sum = target
            partial_strides = (0, 0, 0, 0, 0)
        self.triton_kernels.paged_attention_kernel[grid](
            q, self.k_cache, self.v_cache, out, partial_acc, partial_max, partial_sum,
            query_start_loc, seq_lens, block_tables, seq_lens if key_offset is None else key_offset,
            self.seq_order if ordered else seq_lens, num_seqs, self.qk_scale, self.v_scale,
            split_kv_size or segment_size, segment_offset,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *self.cache_strides,
            block_tables.stride(0), *partial_strides, *self.window_args, USE_SPLIT=bool(split_kv_size),
            PREFIX_ONLY=prefix_only, KEY_OFFSET=key_offset is not None, BLOCK_Q=launch.block_q,
            BLOCK_M=launch.block_m, TILE_N=launch.tile_n, SEGMENTED=segment_size > 0,
            TILE_SEGMENTS=segment_size == launch.tile_n, DECODE=decode, ORDERED=ordered,
            num_warps=launch.num_warps, num_stages=launch.num_stages, **self.common, **self.pdl)

    def _tuning_run(self, bucket: int):
        """``run(launch)`` over the tuning batch of the ``bucket`` (``tuning_prompts``: fresh
        prompts, random values in this call's dtypes, heads, block size and options), so a shape
        is timed on the same work whichever call meets it first."""
        lens = tuning_prompts(bucket)
        block_size, device = self.k_cache.shape[1], self.q.device
        blocks = [-(-n // block_size) for n in lens]
        cache_shape = (sum(blocks), block_size, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = (torch.randn(cache_shape, device=device).to(self.k_cache.dtype) for _ in range(2))
        q = torch.randn(sum(lens), *self.q.shape[1:], device=device).to(self.q.dtype)
        kernels = _AttentionKernels(q, k_cache, v_cache, *self.options)
        out = torch.empty_like(q)
        starts = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        block_tables = torch.arange(sum(blocks), dtype=torch.int32, device=device).view(len(lens), blocks[0])
        return lambda launch: kernels.launch(launch, out, starts, seq_lens, block_tables)

    def _fingerprint(self) -> str:
        """The GPU, Triton and the kernel's code: what a tuned launch holds for."""
        kernel = kernel_fingerprint(self.triton_kernels.paged_attention_kernel)
        return f"{device_fingerprint(self.q.device)}|{kernel}"

    def reduce(self, out, scratch, query_start_loc, seq_lens, num_segments: int, split_kv_size: int,
               decode: bool = False) -> None:
        """The split launch's partials (``num_segments`` segments of at least ``split_kv_size``
        keys) merged into ``out``; ``decode`` (a decode launch's partials): each row folds only
        the segments its sequence fills."""
        partial_acc, partial_max, partial_sum = scratch
        args = (out, partial_acc, partial_max, partial_sum, query_start_loc, seq_lens, seq_lens.shape[0],
                num_segments, split_kv_size, out.stride(0), out.stride(1), *partial_acc.stride()[:3],
                partial_max.stride(0), partial_max.stride(1))
        grid = (out.shape[0], out.shape[1])
        dims = dict(HEAD_DIM=self.head_dim, HEAD_DIM_PADDED=self.head_dim_padded, DECODE=decode, num_warps=4,
                    **self.pdl)
        if self.batch_invariant:  # one segment at a time, as a SEGMENTED program folds them
            self.triton_kernels.invariant_split_kv_reduce_kernel[grid](*args, **dims)
        else:
            self.triton_kernels.split_kv_reduce_kernel[grid](*args, SEGMENT_CHUNK=16, **dims)


# Cascade attention: in a decode batch whose sequences start with the same cache blocks (a shared
# system prompt or few-shot prefix, found by the prefix cache), the shared keys are attended once
# for all queries together instead of once per sequence (in segments, to fill the GPU), each
# sequence's own keys after them, and the split-KV reduce merges the softmax partials (one per
# prefix segment, one for the own keys). On an H200 (W-prefix: 256 sequences x 2,048 shared
# keys, Qwen3-0.6B shape) decode steps went from 12.8 to 4.2 ms, with the model runner's input
# staging of the same change. The shared length lives in device memory (CascadeBuffers), so
# decode CUDA graphs capture the cascade form once per batch size and replay it for any prefix.
# When it pays to run it is the Triton backend's planner's call (layers/attention/triton_backend.py).
CASCADE_MAX_PREFIX_SEGMENTS = 32


@dataclass
class CascadeBuffers:
    """A cascade step's shared length, on the device, for ``num_rows`` query rows (a CUDA graph
    keeps one per captured size and sets the length before each replay)."""

    prefix_len: torch.Tensor  # [1] int32: the shared keys P (a multiple of TILE_N; 0: none)
    prefix_seq_len: torch.Tensor  # [1] int32: P + num_rows, so every row sees all P keys
    prefix_query_start_loc: torch.Tensor  # [0, num_rows]: every query row as one sequence
    num_rows: int

    @classmethod
    def allocate(cls, num_rows: int, device) -> CascadeBuffers:
        # built on the device (no host copies, which would wait for the GPU)
        return cls(torch.zeros(1, dtype=torch.int32, device=device),
                   torch.full((1,), num_rows, dtype=torch.int32, device=device),
                   torch.arange(2, dtype=torch.int32, device=device) * num_rows, num_rows)

    def set_prefix_len(self, prefix_len: int) -> None:
        """Stream-ordered fills: no host sync."""
        if prefix_len % TILE_N:
            raise ValueError(f"prefix_len={prefix_len} must be a multiple of the key tile, {TILE_N}")
        self.prefix_len.fill_(prefix_len)
        self.prefix_seq_len.fill_(prefix_len + self.num_rows)


def cascade_prefix_split(max_seq_len: int) -> int:
    """Keys per segment of the prefix launch: ``SPLIT_KV_SIZE``, or more so that a prefix of up
    to ``max_seq_len`` keys has at most ``CASCADE_MAX_PREFIX_SEGMENTS`` segments."""
    per_segment = -(-max_seq_len // CASCADE_MAX_PREFIX_SEGMENTS)
    return max(SPLIT_KV_SIZE, -(-per_segment // TILE_N) * TILE_N)


def cascade_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             block_tables: torch.Tensor, buffers: CascadeBuffers, scale: float,
                             max_seq_len: int, k_scale: float = 1.0, v_scale: float = 1.0,
                             softcap: float | None = None) -> torch.Tensor:
    """Decode attention (query row i is sequence i's last token; rows past the sequences are
    padding) over a batch whose first ``buffers.prefix_len`` keys are the same blocks in every
    row of ``block_tables``: the same result as ``paged_attention_torch``. ``max_seq_len`` bounds
    every sequence, as a host int.

    The prefix launch runs all query rows against the shared keys, split into segments of
    ``cascade_prefix_split(max_seq_len)`` keys so that a long prefix spreads over the GPU; the
    own-keys launch adds one partial per row; the split-KV reduce merges them. FP8 caches are
    read at ``k_scale``/``v_scale``; ``softcap`` as in ``paged_attention_torch`` (a sliding
    window has no shared prefix to attend once)."""
    kernels = _AttentionKernels(q, k_cache, v_cache, scale, k_scale, v_scale, softcap=softcap)
    num_rows = q.shape[0]
    if buffers.num_rows != num_rows:
        raise ValueError(f"cascade buffers for {buffers.num_rows} rows given {num_rows} query rows")
    split = cascade_prefix_split(max_seq_len)
    num_prefix_segments = -(-max_seq_len // split)
    span = num_prefix_segments * split  # one segment holds every own key
    scratch = allocate_split_kv_scratch(num_rows, q.shape[1], q.shape[2], (num_prefix_segments + 1) * split,
                                        split, q.device)
    kernels.attend(scratch, buffers.prefix_query_start_loc, buffers.prefix_seq_len, block_tables[:1],
                   num_rows, split, num_prefix_segments, prefix_only=True)
    kernels.attend(scratch, query_start_loc, seq_lens, block_tables, 1, span, 1,
                   segment_offset=num_prefix_segments, key_offset=buffers.prefix_len)
    out = torch.empty_like(q)
    kernels.reduce(out, scratch, query_start_loc, seq_lens, num_prefix_segments + 1, split)
    return out
