"""Triton kernels over the paged KV cache: varlen paged attention and its split-KV reduces (the KV
writes are in ``kv_write_kernels.py``), and the E4M3 rounding the FP8 kernels share.

The public entry point is ``paged_attention_triton`` (paged_attention.py). This module is imported
only when one of them first runs: the package must import without triton, and triton decides at
decoration time whether a kernel is compiled or interpreted (``TRITON_INTERPRET=1``), so
importing late lets that choice follow the environment of the first call.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``, head_dim
contiguous.

Integer arguments that change from step to step (sequence counts, the block table's width) are
not specialized: Triton would otherwise compile a new variant whenever one of them turns
divisible by 16 or equal to 1, a stall of about a second in the middle of a run.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from pagedlab.kernels.pdl_jit import pdl_wait_and_trigger

# Whether triton runs kernels in its interpreter, as it decides when a kernel is decorated (this
# module loads before any of them runs): ``_round_to_e4m3`` rounds in software only there.
_INTERPRETED: tl.constexpr = tl.constexpr(
    os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y"))


@triton.jit
def _tanh(x):
    """tanh from one exp2 of -2|x| (no cancellation near 0, no overflow for large |x|)."""
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_tile(acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                 k_head_offset, v_head_offset, tile_start, key_end, query_pos, context_len,
                 offs_d, dim_valid, qk_scale,
                 stride_k_block, stride_k_token, stride_v_block, stride_v_token,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PAD_DIM: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 key_lo, sliding_window, softcap_scale, softcap,
                 SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, BROADCAST_DOT: tl.constexpr):
    """One key tile of the online softmax. MASKED=False is for tiles every row sees in full.
    SLIDING: row r sees only keys after ``context_len + query_pos[r] - sliding_window``, and no
    key below ``key_lo`` is read (its block may be freed); SOFTCAP: scores become
    ``softcap * tanh(scores * softcap_scale)`` before the mask. BROADCAST_DOT multiplies and sums
    instead of ``tl.dot`` (batch-invariant mode under the interpreter, whose ``tl.dot`` rounds a
    row by its place in the tile)."""
    key_pos = tile_start + tl.arange(0, TILE_N)
    if MASKED:
        key_valid = key_pos < key_end
        if SLIDING:
            key_valid = key_valid & (key_pos >= key_lo)
        block_ids = tl.load(block_table_row_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
    else:
        block_ids = tl.load(block_table_row_ptr + key_pos // BLOCK_SIZE)
    slot_in_block = key_pos % BLOCK_SIZE
    # int64: block_id * stride overflows int32 for caches above 2**31 elements per layer
    token_offset_k = block_ids.to(tl.int64) * stride_k_block + slot_in_block * stride_k_token
    token_offset_v = block_ids.to(tl.int64) * stride_v_block + slot_in_block * stride_v_token
    k_ptrs = k_cache_ptr + k_head_offset + token_offset_k[:, None] + offs_d[None, :]
    v_ptrs = v_cache_ptr + v_head_offset + token_offset_v[:, None] + offs_d[None, :]
    # Slots past the sequence may hold anything (NaN included): keep them out of the loads,
    # since 0 * NaN in P @ V would poison the row.
    kv_mask = None
    if MASKED:
        kv_mask = key_valid[:, None]
        if PAD_DIM:
            kv_mask = kv_mask & dim_valid[None, :]
    elif PAD_DIM:
        kv_mask = dim_valid[None, :]
    if kv_mask is None:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    # FP8 entries become q's dtype (exactly: E4M3 fits in fp16/bf16/fp32); their scales are
    # folded into qk_scale and the final output. Under UPCAST q is float32 already.
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    if BROADCAST_DOT:
        scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2)
    else:
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFTCAP:
        scores = softcap * _tanh(scores * softcap_scale)
    if MASKED:
        visible = (key_pos[None, :] <= context_len + query_pos[:, None]) & key_valid[None, :]
        if SLIDING:
            visible = visible & (key_pos[None, :] > context_len + query_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
    # Max and exponent in log2 units (qk_scale carries log2(e)); the scale folds into one FMA.
    new_max = tl.maximum(row_max, tl.max(scores, 1) * qk_scale)
    if MASKED:
        # A row that has seen no key yet keeps max -inf; exp2(-inf - -inf) would be NaN.
        new_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.math.exp2(row_max - new_max)
    p = tl.math.exp2(scores * qk_scale - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    if BROADCAST_DOT:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def _merge_segment(acc, total_sum, total_max, segment_acc, segment_sum, segment_max):
    """Fold one key segment's softmax partials (unnormalized ``[rows, dim]`` output, sum, max in
    log2 units; max -inf: no key) into the running ones. The same code in a SEGMENTED attention
    program and in ``invariant_split_kv_reduce_kernel``, with explicit FMAs, so that the compiler
    has no contraction left to choose differently in the two."""
    new_max = tl.maximum(total_max, segment_max)
    new_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.math.exp2(total_max - new_max)
    weight = tl.math.exp2(segment_max - new_max)
    total_sum = tl.fma(total_sum, alpha, weight * segment_sum)
    acc = tl.fma(acc, tl.broadcast_to(alpha[:, None], acc.shape), weight[:, None] * segment_acc)
    return acc, total_sum, new_max


@triton.jit
def _attend_segments(q, k_cache_ptr, v_cache_ptr, block_table_row_ptr, k_head_offset, v_head_offset,
                     all_rows_end, key_end, segment_size, query_pos, context_len, offs_d, dim_valid, qk_scale,
                     v_scale, stride_k_block, stride_k_token, stride_v_block, stride_v_token,
                     BLOCK_M: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     TILE_N: tl.constexpr, PAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     softcap_scale, softcap, SOFTCAP: tl.constexpr, BROADCAST_DOT: tl.constexpr,
                     TILE_SEGMENTS: tl.constexpr):
    """Keys [0, key_end) in segments of ``segment_size`` from key 0, each attended from a fresh
    state with the tiles a split program of that segment runs (unmasked below ``all_rows_end``,
    masked after), scaled by ``v_scale`` and folded in segment order. Returns the unnormalized
    output and its softmax sum. TILE_SEGMENTS (``segment_size == TILE_N``): one tile a segment,
    in two flat loops the compiler can pipeline instead of a loop of one-tile loops."""
    total_acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    total_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    total_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if TILE_SEGMENTS:
        for masked in tl.static_range(2):  # the tiles every row sees in full, then the masked ones
            for tile_start in range(all_rows_end * masked, key_end if masked else all_rows_end, TILE_N):
                total_acc, total_sum, total_max = _attend_tile_segment(
                    total_acc, total_sum, total_max, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                    k_head_offset, v_head_offset, tile_start, key_end, query_pos, context_len, offs_d,
                    dim_valid, qk_scale, v_scale, stride_k_block, stride_k_token, stride_v_block,
                    stride_v_token, BLOCK_M, HEAD_DIM_PADDED, BLOCK_SIZE, TILE_N, PAD_DIM, masked == 1,
                    DOT_PRECISION, softcap_scale, softcap, SOFTCAP, BROADCAST_DOT)
        return total_acc, total_sum
    for segment_start in range(0, key_end, segment_size):
        segment_end = tl.minimum(segment_start + segment_size, key_end)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for tile_start in range(segment_start, tl.minimum(all_rows_end, segment_end), TILE_N):
            acc, row_sum, row_max = _attend_tile(
                acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                k_head_offset, v_head_offset, tile_start, segment_end, query_pos, context_len,
                offs_d, dim_valid, qk_scale, stride_k_block, stride_k_token, stride_v_block, stride_v_token,
                BLOCK_SIZE, TILE_N, PAD_DIM, False, DOT_PRECISION,
                0, 0, softcap_scale, softcap, False, SOFTCAP, BROADCAST_DOT)
        for tile_start in range(tl.maximum(all_rows_end, segment_start), segment_end, TILE_N):
            acc, row_sum, row_max = _attend_tile(
                acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                k_head_offset, v_head_offset, tile_start, segment_end, query_pos, context_len,
                offs_d, dim_valid, qk_scale, stride_k_block, stride_k_token, stride_v_block, stride_v_token,
                BLOCK_SIZE, TILE_N, PAD_DIM, True, DOT_PRECISION,
                0, 0, softcap_scale, softcap, False, SOFTCAP, BROADCAST_DOT)
        segment_max = tl.where(row_sum > 0, row_max, float("-inf"))  # as a split program stores it
        total_acc, total_sum, total_max = _merge_segment(total_acc, total_sum, total_max, acc * v_scale,
                                                         row_sum, segment_max)
    return total_acc, total_sum


@triton.jit
def _attend_tile_segment(total_acc, total_sum, total_max, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                         k_head_offset, v_head_offset, tile_start, key_end, query_pos, context_len, offs_d,
                         dim_valid, qk_scale, v_scale, stride_k_block, stride_k_token, stride_v_block,
                         stride_v_token, BLOCK_M: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PAD_DIM: tl.constexpr,
                         MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, softcap_scale, softcap,
                         SOFTCAP: tl.constexpr, BROADCAST_DOT: tl.constexpr):
    """One tile as a segment of its own: attended from a fresh state, as a split program of a
    one-tile segment does, and folded into the running partials."""
    acc, row_sum, row_max = _attend_tile(
        tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
        tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
        k_head_offset, v_head_offset, tile_start, tl.minimum(tile_start + TILE_N, key_end), query_pos,
        context_len, offs_d, dim_valid, qk_scale, stride_k_block, stride_k_token, stride_v_block,
        stride_v_token, BLOCK_SIZE, TILE_N, PAD_DIM, MASKED, DOT_PRECISION, 0, 0, softcap_scale, softcap,
        False, SOFTCAP, BROADCAST_DOT)
    segment_max = tl.where(row_sum > 0, row_max, float("-inf"))  # as a split program stores it
    return _merge_segment(total_acc, total_sum, total_max, acc * v_scale, row_sum, segment_max)


@triton.jit
def _segment_keys(seq_len, split_kv_size, num_segments):
    """Keys per split-KV segment of a sequence of ``seq_len`` keys: ``split_kv_size``, or the
    smallest multiple of it that covers the sequence in ``num_segments`` segments (a launch whose
    segments are capped below its longest sequence's need: the segments grow with the sequence)."""
    return split_kv_size * tl.maximum(tl.cdiv(seq_len, split_kv_size * num_segments), 1)


@triton.jit
def _prefetch_first_tile(block_table_row_ptr, k_cache_ptr, v_cache_ptr, k_head_offset, v_head_offset,
                         key_start, key_end, stride_k_block, stride_k_token, stride_v_block, stride_v_token,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """Before a split decode program's PDL wait (sm_90 only: inline PTX): its first key tile's
    block ids, step inputs written before the step, read into L1, and that tile's K and V rows
    asked of L2 (``prefetch.global.L2``, a hint: a slot the step writes meanwhile is read again
    after the wait), so that the tile's loads after the wait hit L1 and L2 instead of going to
    HBM. Split launches only (small batches, whose programs each read a tile or two: Qwen3-30B-A3B
    batch 1 2.407 -> 2.386 ms a step on an H200); the unsplit launch of a large batch lost with it
    (Llama-3-8B W-seed batch 64 TPOT 7.63 -> 8.05 ms), BENCHMARKS.md session 34."""
    ELEMENT_BYTES: tl.constexpr = k_cache_ptr.dtype.element_ty.primitive_bitwidth // 8
    LINE: tl.constexpr = 128 // ELEMENT_BYTES  # elements in a 128-byte line
    LINES: tl.constexpr = (HEAD_DIM + LINE - 1) // LINE
    LINES_PADDED: tl.constexpr = 1 if LINES <= 1 else 2 ** (LINES - 1).bit_length()
    key_pos = key_start + tl.arange(0, TILE_N)
    valid = key_pos < key_end
    block_ids = tl.load(block_table_row_ptr + key_pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = key_pos % BLOCK_SIZE
    lines = tl.arange(0, LINES_PADDED)
    wanted = (valid[:, None] & (lines[None, :] < LINES)).to(tl.int32)
    _prefetch_rows_l2(k_cache_ptr + k_head_offset + block_ids * stride_k_block + slot * stride_k_token,
                      lines * LINE, wanted)
    _prefetch_rows_l2(v_cache_ptr + v_head_offset + block_ids * stride_v_block + slot * stride_v_token,
                      lines * LINE, wanted)


@triton.jit
def _prefetch_rows_l2(rows, line_offsets, wanted):
    """``prefetch.global.L2`` of each row's lines (``rows [N]`` pointers, ``line_offsets [L]``
    elements) where ``wanted [N, L]`` is nonzero."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l,r",
        [rows[:, None] + line_offsets[None, :], wanted], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _sequence_bounds(query_start_loc_ptr, seq_lens_ptr, seq_idx):
    """Sequence ``seq_idx``'s first query token, query length and key count."""
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    return q_start, tl.load(query_start_loc_ptr + seq_idx + 1) - q_start, tl.load(seq_lens_ptr + seq_idx)


@triton.jit(do_not_specialize=["num_seqs", "stride_block_table"])
def paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        partial_acc_ptr, partial_max_ptr, partial_sum_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, key_offset_ptr, seq_order_ptr,
        num_seqs, qk_scale, v_scale, split_kv_size, partial_segment_offset,
        stride_q_token, stride_q_head, stride_out_token, stride_out_head,
        stride_k_block, stride_k_token, stride_k_head,
        stride_v_block, stride_v_token, stride_v_head,
        stride_block_table,
        stride_pacc_token, stride_pacc_head, stride_pacc_segment,
        stride_pstat_token, stride_pstat_head,
        sliding_window, softcap_scale, softcap,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, USE_SPLIT: tl.constexpr, SEQ_CHUNK: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        PREFIX_ONLY: tl.constexpr, KEY_OFFSET: tl.constexpr,
        SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, BROADCAST_DOT: tl.constexpr, PDL: tl.constexpr,
        SEGMENTED: tl.constexpr = False, TILE_SEGMENTS: tl.constexpr = False, DECODE: tl.constexpr = False,
        ORDERED: tl.constexpr = False):
    """Program (q_block, kv_head[, segment]): BLOCK_Q query tokens x the GROUP query heads of one
    KV head, as BLOCK_M = BLOCK_Q * GROUP (padded) rows; row m is token m // GROUP, head m % GROUP.

    Without split the program writes the normalized output; with split it covers keys
    [segment * size, (segment + 1) * size), size = ``_segment_keys`` (``split_kv_size``, larger
    for a sequence longer than the grid's segments of that size hold), and writes fp32 partials
    (unnormalized acc, running max in log2 units, running sum) for the reduce kernel, as partial
    segment ``segment + partial_segment_offset`` (cascade attention puts two launches' segments
    side by side).

    Cascade attention's two launches read their bounds from device memory, so a CUDA graph can
    replay them for any shared prefix: PREFIX_ONLY stops every row at its sequence's context
    (the shared prefix, seen whole by every query), KEY_OFFSET starts every row at the key
    ``*key_offset_ptr`` (a multiple of TILE_N: the keys after the prefix).

    An FP8 cache's key scale is part of ``qk_scale`` and its value scale is ``v_scale`` (1.0
    for other caches), applied to the accumulated output.

    SLIDING (a local-attention layer): query position p sees keys (p - sliding_window, p]. The
    keys split in three runs of tiles: masked ones up to where the last row's window starts,
    unmasked ones every row sees, masked ones to the causal end. Keys older than the first
    row's window are never read: the KV manager may have freed their blocks. SOFTCAP (Gemma 2):
    scores are ``softcap * tanh(q.k * softcap_scale)``; ``qk_scale`` is then log2(e) alone.

    SEGMENTED (batch-invariant mode, no window, no split): the program itself cuts the keys into
    segments of ``split_kv_size`` from key 0, attends each from a fresh softmax state exactly as
    a split program would, and folds them in segment order with ``_merge_segment``, as
    ``invariant_split_kv_reduce_kernel`` folds a split launch's partials: a token's output is
    then bitwise the same whichever launch computed it. TILE_SEGMENTS: segments of one key tile.

    DECODE (no sequence has more than one query token): the grid is (kv_head, sequence[,
    segment]), one program per sequence and KV head, found without the search: program (h, i)
    takes sequence i, or with ORDERED sequence ``seq_order[i]``. The GPU starts programs in grid
    order in practice, KV heads fastest, so a batch ordered longest first starts its longest
    sequences first and ends on short ones, where batch order can leave a long one running alone
    at the end.

    PDL (``kernels/pdl.py``): a decode program reads its sequence's place in the order, query
    start and length (step inputs, written before the step) before the wait, and a split one
    its first key tile's block ids, asking L2 for that tile's K and V (``_prefetch_first_tile``);
    everything else it loads is the step's data, after the wait.
    """
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    if DECODE:
        kv_head = tl.program_id(0)
        seq_idx = tl.program_id(1)
        if ORDERED:
            seq_idx = tl.load(seq_order_ptr + seq_idx)
        q_start, query_len, seq_len = _sequence_bounds(query_start_loc_ptr, seq_lens_ptr, seq_idx)
        if PDL and USE_SPLIT and not (PREFIX_ONLY or KEY_OFFSET or SLIDING):
            first_key = segment * _segment_keys(seq_len, split_kv_size, tl.num_programs(2))
            _prefetch_first_tile(block_tables_ptr + seq_idx * stride_block_table, k_cache_ptr, v_cache_ptr,
                                 kv_head * stride_k_head, kv_head * stride_v_head, first_key, seq_len,
                                 stride_k_block, stride_k_token, stride_v_block, stride_v_token, HEAD_DIM,
                                 BLOCK_SIZE, TILE_N)
        pdl_wait_and_trigger(PDL)
    else:
        pdl_wait_and_trigger(PDL)
        # Sequence i owns q blocks starting at query_start_loc[i] // BLOCK_Q + i (an upper bound on
        # the blocks before it, so the grid needs no host sync): ours is the last start <= q_block_global.
        # Counting starts a chunk at a time costs one memory round trip per chunk, where a binary
        # search costs log2(num_seqs) dependent ones: it matters for short prefills.
        num_starts_before = tl.zeros([], dtype=tl.int32)
        for chunk_start in range(0, num_seqs, SEQ_CHUNK):
            seq_ids = chunk_start + tl.arange(0, SEQ_CHUNK)
            starts = tl.load(query_start_loc_ptr + seq_ids, mask=seq_ids < num_seqs, other=2**30)
            num_starts_before += tl.sum((starts // BLOCK_Q + seq_ids <= q_block_global).to(tl.int32), 0)
        seq_idx = num_starts_before - 1
        q_start, query_len, seq_len = _sequence_bounds(query_start_loc_ptr, seq_lens_ptr, seq_idx)

    q_block = 0
    if not DECODE:
        q_block = q_block_global - (q_start // BLOCK_Q + seq_idx)
    if q_block * BLOCK_Q >= query_len:
        return
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = offs_d < HEAD_DIM
    query_pos = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (query_pos < query_len)
    token = q_start + query_pos
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :],
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys [0, all_rows_end) are visible to every row; the last row sees [0, key_end).
    first_pos = q_block * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q, query_len) - 1
    key_end = context_len + last_pos + 1
    all_rows_end = ((context_len + first_pos + 1) // TILE_N) * TILE_N
    key_start = 0
    if USE_SPLIT:
        segment_keys = _segment_keys(seq_len, split_kv_size, tl.num_programs(2))
        key_start = segment * segment_keys
        key_end = tl.minimum(key_end, key_start + segment_keys)
    if PREFIX_ONLY:
        key_end = tl.minimum(key_end, context_len)
    if KEY_OFFSET:
        key_start = tl.maximum(key_start, tl.load(key_offset_ptr))
    key_lo = 0
    full_start = key_start
    if SLIDING:
        key_lo = tl.maximum(context_len + first_pos - sliding_window + 1, 0)
        key_start = tl.maximum(key_start, (key_lo // TILE_N) * TILE_N)
        last_row_lo = tl.maximum(context_len + last_pos - sliding_window + 1, 0)
        full_start = ((last_row_lo + TILE_N - 1) // TILE_N) * TILE_N
        full_start = tl.minimum(tl.maximum(full_start, key_start), key_end)
    full_end = tl.minimum(all_rows_end, key_end)
    masked_start = tl.maximum(all_rows_end, full_start)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    block_table_row_ptr = block_tables_ptr + seq_idx * stride_block_table
    k_head_offset = kv_head * stride_k_head
    v_head_offset = kv_head * stride_v_head
    PAD_DIM: tl.constexpr = HEAD_DIM != HEAD_DIM_PADDED

    if SEGMENTED:
        acc, row_sum = _attend_segments(
            q, k_cache_ptr, v_cache_ptr, block_table_row_ptr, k_head_offset, v_head_offset,
            all_rows_end, key_end, split_kv_size, query_pos, context_len, offs_d, dim_valid, qk_scale,
            v_scale, stride_k_block, stride_k_token, stride_v_block, stride_v_token, BLOCK_M,
            HEAD_DIM_PADDED, BLOCK_SIZE, TILE_N, PAD_DIM, DOT_PRECISION, softcap_scale, softcap, SOFTCAP,
            BROADCAST_DOT, TILE_SEGMENTS)
    else:
        if SLIDING:
            for tile_start in range(key_start, full_start, TILE_N):
                acc, row_sum, row_max = _attend_tile(
                    acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                    k_head_offset, v_head_offset, tile_start, key_end, query_pos, context_len,
                    offs_d, dim_valid, qk_scale, stride_k_block, stride_k_token, stride_v_block,
                    stride_v_token, BLOCK_SIZE, TILE_N, PAD_DIM, True, DOT_PRECISION,
                    key_lo, sliding_window, softcap_scale, softcap, SLIDING, SOFTCAP, BROADCAST_DOT)
        for tile_start in range(full_start, full_end, TILE_N):
            acc, row_sum, row_max = _attend_tile(
                acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                k_head_offset, v_head_offset, tile_start, key_end, query_pos, context_len,
                offs_d, dim_valid, qk_scale, stride_k_block, stride_k_token, stride_v_block, stride_v_token,
                BLOCK_SIZE, TILE_N, PAD_DIM, False, DOT_PRECISION,
                key_lo, sliding_window, softcap_scale, softcap, SLIDING, SOFTCAP, BROADCAST_DOT)
        for tile_start in range(masked_start, key_end, TILE_N):
            acc, row_sum, row_max = _attend_tile(
                acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                k_head_offset, v_head_offset, tile_start, key_end, query_pos, context_len,
                offs_d, dim_valid, qk_scale, stride_k_block, stride_k_token, stride_v_block, stride_v_token,
                BLOCK_SIZE, TILE_N, PAD_DIM, True, DOT_PRECISION,
                key_lo, sliding_window, softcap_scale, softcap, SLIDING, SOFTCAP, BROADCAST_DOT)
        acc = acc * v_scale  # (SEGMENTED scales each segment, as a split launch does)
    if USE_SPLIT:
        # int64: scratch for many tokens x segments can pass 2**31 elements
        token = token.to(tl.int64)
        stat_offset = token * stride_pstat_token + head * stride_pstat_head + segment + partial_segment_offset
        tl.store(partial_max_ptr + stat_offset, tl.where(row_sum > 0, row_max, float("-inf")), mask=row_valid)
        tl.store(partial_sum_ptr + stat_offset, row_sum, mask=row_valid)
        # A segment past the visible keys has nothing to add; the reduce skips it by its max.
        if key_start < key_end:
            acc_ptrs = (partial_acc_ptr + token[:, None] * stride_pacc_token
                        + head[:, None] * stride_pacc_head
                        + (segment + partial_segment_offset) * stride_pacc_segment + offs_d[None, :])
            tl.store(acc_ptrs, acc, mask=row_valid[:, None])
    else:
        out = acc / row_sum[:, None]
        out_ptrs = (out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head
                    + offs_d[None, :])
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _segments_used(query_start_loc_ptr, seq_lens_ptr, token, num_seqs, num_segments, split_kv_size,
                   DECODE: tl.constexpr):
    """Segments a reduce program folds: with DECODE, where sequence ``token`` holds exactly query
    token ``token`` (a decode batch: one token a sequence), only those that hold its keys
    (``_segment_keys``), so a launch sized for long sequences folds a short one's few; else all
    ``num_segments``. Its loads do not wait for one another."""
    if DECODE:
        own = token < num_seqs
        seq_len = tl.load(seq_lens_ptr + token, mask=own, other=0)
        start = tl.load(query_start_loc_ptr + token, mask=own, other=-1)
        end = tl.load(query_start_loc_ptr + token + 1, mask=own, other=-1)
        used = tl.cdiv(seq_len, _segment_keys(seq_len, split_kv_size, num_segments))
        return tl.where((start == token) & (end == token + 1), used, num_segments)
    return num_segments


@triton.jit
def _reduce_row_bounds(query_start_loc_ptr, seq_lens_ptr, token, num_seqs, num_segments, split_kv_size,
                       DECODE: tl.constexpr):
    """A reduce program's ``(_segments_used, query tokens of the step)``, from the step's inputs
    (written before the step): read before the PDL wait, as only the partials come from the
    attention launch."""
    used = _segments_used(query_start_loc_ptr, seq_lens_ptr, token, num_seqs, num_segments, split_kv_size,
                          DECODE)
    return used, tl.load(query_start_loc_ptr + num_seqs)


@triton.jit(do_not_specialize=["num_seqs", "num_segments"])
def split_kv_reduce_kernel(
        out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, query_start_loc_ptr, seq_lens_ptr,
        num_seqs, num_segments, split_kv_size,
        stride_out_token, stride_out_head,
        stride_pacc_token, stride_pacc_head, stride_pacc_segment,
        stride_pstat_token, stride_pstat_head,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, DECODE: tl.constexpr,
        SEGMENT_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (token, head): merge the per-segment partials of one output row, the segments
    ``_segments_used`` counts (PDL: reads those counts' step inputs before the wait, the
    partials after it)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    num_segments, num_tokens = _reduce_row_bounds(query_start_loc_ptr, seq_lens_ptr, token, num_seqs,
                                                  num_segments, split_kv_size, DECODE)
    pdl_wait_and_trigger(PDL)
    if token >= num_tokens:
        return  # padding rows past the last sequence own no partials
    offs_s = tl.arange(0, SEGMENT_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = offs_d < HEAD_DIM
    stat_base = token.to(tl.int64) * stride_pstat_token + head * stride_pstat_head
    acc_base = token.to(tl.int64) * stride_pacc_token + head * stride_pacc_head

    acc = tl.zeros([HEAD_DIM_PADDED], dtype=tl.float32)
    total_sum = tl.zeros([], dtype=tl.float32)
    total_max = tl.full([], float("-inf"), dtype=tl.float32)
    for chunk_start in range(0, num_segments, SEGMENT_CHUNK):
        seg = chunk_start + offs_s
        seg_max = tl.load(partial_max_ptr + stat_base + seg, mask=seg < num_segments, other=float("-inf"))
        seg_sum = tl.load(partial_sum_ptr + stat_base + seg, mask=seg < num_segments, other=0.0)
        # Empty segments (max -inf) never wrote their acc: read with the stats, then dropped.
        has_keys = seg_max > float("-inf")
        seg_acc = tl.load(partial_acc_ptr + acc_base + seg[:, None] * stride_pacc_segment + offs_d[None, :],
                          mask=(seg < num_segments)[:, None] & dim_valid[None, :], other=0.0)
        seg_acc = tl.where(has_keys[:, None], seg_acc, 0.0)
        new_max = tl.maximum(total_max, tl.max(seg_max, 0))
        new_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.math.exp2(total_max - new_max)
        weight = tl.math.exp2(seg_max - new_max)
        total_sum = total_sum * alpha + tl.sum(weight * seg_sum, 0)
        acc = acc * alpha + tl.sum(weight[:, None] * seg_acc, 0)
        total_max = new_max
    out = acc / total_sum
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=dim_valid)


@triton.jit(do_not_specialize=["num_seqs", "num_segments"])
def invariant_split_kv_reduce_kernel(
        out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, query_start_loc_ptr, seq_lens_ptr,
        num_seqs, num_segments, split_kv_size,
        stride_out_token, stride_out_head,
        stride_pacc_token, stride_pacc_head, stride_pacc_segment,
        stride_pstat_token, stride_pstat_head,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, DECODE: tl.constexpr, PDL: tl.constexpr):
    """Program (token, head), batch-invariant mode: the segments' partials (``_segments_used``)
    folded one at a time in segment order by ``_merge_segment``, the arithmetic a SEGMENTED
    attention program does (PDL: as ``split_kv_reduce_kernel``)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    num_segments, num_tokens = _reduce_row_bounds(query_start_loc_ptr, seq_lens_ptr, token, num_seqs,
                                                  num_segments, split_kv_size, DECODE)
    pdl_wait_and_trigger(PDL)
    if token >= num_tokens:
        return  # padding rows past the last sequence own no partials
    row = tl.arange(0, 1)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = offs_d < HEAD_DIM
    stat_base = token.to(tl.int64) * stride_pstat_token + head * stride_pstat_head
    acc_ptrs = (partial_acc_ptr + token.to(tl.int64) * stride_pacc_token + head * stride_pacc_head
                + row[:, None] * 0 + offs_d[None, :])
    acc = tl.zeros([1, HEAD_DIM_PADDED], dtype=tl.float32)
    total_sum = tl.zeros([1], dtype=tl.float32)
    total_max = tl.full([1], float("-inf"), dtype=tl.float32)
    for segment in range(0, num_segments):
        segment_max = tl.load(partial_max_ptr + stat_base + segment + row)
        segment_sum = tl.load(partial_sum_ptr + stat_base + segment + row)
        # An empty segment (max -inf) never wrote its acc: read zeros, which fold in as nothing.
        segment_acc = tl.load(acc_ptrs + segment * stride_pacc_segment,
                              mask=(segment_max > float("-inf"))[:, None] & dim_valid[None, :], other=0.0)
        acc, total_sum, total_max = _merge_segment(acc, total_sum, total_max, segment_acc, segment_sum,
                                                   segment_max)
    out = acc / total_sum[:, None]
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + row[:, None] * 0 + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=dim_valid[None, :])


@triton.jit
def _round_to_e4m3(x, FP8_MAX: tl.constexpr):
    """float32 ``x`` clamped to +-FP8_MAX, ready for the cast to E4M3, which must round it to the
    nearest E4M3 value, ties to even. Compiled, the cast does that itself (sm_90's
    ``cvt.rn.satfinite.e4m3x2.f32``). The Triton interpreter's float32 -> E4M3 cast neither
    carries into the exponent nor rounds ties to even, so under it (``_INTERPRETED``) the rounding
    is done here, leaving a float32 that the cast keeps exactly: the same numbers as the GPU."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    if _INTERPRETED:
        # Normal E4M3 values keep 3 of float32's 23 mantissa bits: round the other 20 away, ties
        # to even; a carry moves into the exponent, as it should. (448 is E4M3: nothing passes it.)
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        # Below 2**-6 E4M3 is subnormal, in steps of 2**-9: round |x| * 2**9 to an integer by
        # adding and taking away 1.5 * 2**23 (float32 addition rounds to nearest even), then put
        # the sign back (so -0.001 gives -0, as torch's cast does).
        magnitude = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        subnormal = (magnitude.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return x
