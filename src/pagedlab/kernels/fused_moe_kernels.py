"""Triton kernels of the fused MoE MLP (entry point: ``fused_moe.fused_moe_triton``), imported
only when it first runs, like ``triton_kernels``.

Routing and the sort by expert (``moe_route_kernel``, ``moe_align_kernel``): two launches in
place of some twenty torch ops, which at decode cost more than the GEMMs. The route kernel
takes a block of tokens per program: softmax, top-k, renormalization, then per expert the
count of the block's pairs and each pair's rank among them. The align kernel, one program per
token block, sums every block's counts into padded runs and writes its block's pairs at
``run start + pairs of that expert in earlier blocks + rank``; program 0 also writes the
padding and each row block's expert. Every address is written once, so no program waits on
another. When one token block holds every token (decode), the route kernel does the align
kernel's work itself from its registers: one launch.

The grouped GEMMs (``moe_gate_up_kernel``, ``moe_down_kernel``) run over row blocks of pairs
sorted by expert: a program reads its block's expert, gathers the rows it names (padding rows
hold ``num_pairs`` and are masked off) and multiplies them by that expert's weights. The down
kernel may split K; ``moe_reduce_kernel`` then sums each token's splits and ``top_k`` pairs,
weighted by the router, in a fixed order (the same result every run).

The GEMV path (``moe_gate_up_gemv_kernel``, ``moe_down_gemv_kernel``), for decode batches, has
no routing launch and no sort: a gate/up program takes one pair and a column tile, computes the
pair's expert and weight from its token's logits (``_route_slot``: the same choice as the route
kernel) and walks all of K with one row of x (the dense one-row GEMV's form: a 2-D float32
product tile, summed once at the end); a down program takes one pair and a column tile, and the
last of a token's ``top_k`` programs of that tile to finish sums their router-weighted shares in
slot order (``gemv.split_k_epilogue``: one ticket counter per (token, column tile)).

Every kernel takes part in programmatic dependent launch (``kernels/pdl.py``) and waits first:
even the grouped GEMMs' weights hang on the step's routing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedlab.kernels.gemv import split_k_epilogue
from pagedlab.kernels.pdl_jit import pdl_wait_and_trigger


@triton.jit
def moe_route_kernel(logits_ptr, weights_ptr, experts_ptr, local_rank_ptr, block_counts_ptr, sorted_pairs_ptr,
                     block_experts_ptr, num_tokens, num_experts, stride_logits, capacity, TOP_K: tl.constexpr,
                     RENORMALIZE: tl.constexpr, TOKENS_BLOCK: tl.constexpr, EXPERTS_BLOCK: tl.constexpr,
                     TOP_K_BLOCK: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr,
                     PDL: tl.constexpr):
    """Per token: the ``TOP_K`` experts of highest softmax probability (the lowest index among
    equal logits) and their weights; per pair ``token * TOP_K + slot``: its rank among this block's
    pairs of the same expert; per expert: this block's count of pairs. With ``ALIGN`` (one token
    block, so its counts are all the counts) it also does the align kernel's work."""
    pdl_wait_and_trigger(PDL)
    block = tl.program_id(0)
    offs_t = block * TOKENS_BLOCK + tl.arange(0, TOKENS_BLOCK)
    offs_e = tl.arange(0, EXPERTS_BLOCK)
    offs_k = tl.arange(0, TOP_K_BLOCK)
    token_valid = offs_t < num_tokens
    expert_valid = offs_e < num_experts
    logits = tl.load(logits_ptr + offs_t.to(tl.int64)[:, None] * stride_logits + offs_e[None, :],
                     mask=token_valid[:, None] & expert_valid[None, :], other=0.0).to(tl.float32)
    logits = tl.where(expert_valid[None, :], logits, float("-inf"))
    row_max = tl.max(logits, axis=1)
    denominator = tl.sum(tl.exp(logits - row_max[:, None]), axis=1)
    # chosen by logit (softmax keeps the order, and the logits carry no rounding of exp)
    remaining = logits
    chosen = tl.zeros([TOKENS_BLOCK, TOP_K_BLOCK], dtype=tl.int32)
    chosen_probs = tl.zeros([TOKENS_BLOCK, TOP_K_BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)
        best_expert = tl.min(tl.where(remaining == best[:, None], offs_e[None, :], EXPERTS_BLOCK), axis=1)
        chosen = tl.where(offs_k[None, :] == slot, best_expert[:, None], chosen)
        probs = tl.exp(best - row_max) / denominator
        chosen_probs = tl.where(offs_k[None, :] == slot, probs[:, None], chosen_probs)
        remaining = tl.where(offs_e[None, :] == best_expert[:, None], float("-inf"), remaining)
    if RENORMALIZE:
        chosen_probs = chosen_probs / tl.sum(chosen_probs, axis=1)[:, None]
    pair_valid = token_valid[:, None] & (offs_k[None, :] < TOP_K)
    pairs = offs_t[:, None] * TOP_K + offs_k[None, :]
    tl.store(weights_ptr + pairs, chosen_probs.to(weights_ptr.dtype.element_ty), mask=pair_valid)
    tl.store(experts_ptr + pairs, chosen, mask=pair_valid)
    # flat in pair order (t * TOP_K_BLOCK + slot grows with t * TOP_K + slot); -1 marks no pair
    flat_pairs = tl.reshape(tl.where(pair_valid, pairs, -1), [TOKENS_BLOCK * TOP_K_BLOCK])
    flat_experts = tl.reshape(tl.where(pair_valid, chosen, -1), [TOKENS_BLOCK * TOP_K_BLOCK])
    onehot = (flat_experts[:, None] == offs_e[None, :]).to(tl.int32)
    if TOKENS_BLOCK == 1:  # one token's experts are distinct: each pair is the first of its expert
        rank = tl.zeros([TOP_K_BLOCK], dtype=tl.int32)
    else:
        rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    if ALIGN:
        # align_capacity's row blocks: at most one a pair, and at most pairs / BLOCK_M + experts
        PAIRS: tl.constexpr = TOKENS_BLOCK * TOP_K_BLOCK
        _place_pairs(sorted_pairs_ptr, block_experts_ptr, flat_pairs, flat_experts, rank, flat_pairs >= 0,
                     tl.sum(onehot, axis=0), tl.zeros([EXPERTS_BLOCK], dtype=tl.int32), True,
                     num_tokens * TOP_K, num_experts, capacity, BLOCK_M, EXPERTS_BLOCK,
                     min(PAIRS, 2 * max(PAIRS // BLOCK_M, EXPERTS_BLOCK)))
    else:
        tl.store(local_rank_ptr + flat_pairs, rank, mask=flat_pairs >= 0)
        tl.store(block_counts_ptr + block * num_experts + offs_e, tl.sum(onehot, axis=0), mask=expert_valid)


@triton.jit
def _place_pairs(sorted_pairs_ptr, block_experts_ptr, pairs, experts, rank, pair_valid, counts, earlier,
                 with_padding, num_pairs, num_experts, capacity, BLOCK_M: tl.constexpr,
                 EXPERTS_BLOCK: tl.constexpr, MAX_ROW_BLOCKS: tl.constexpr):
    """Each pair at row ``its expert's run start + earlier[expert] + rank``, the runs being the
    experts' ``counts`` each padded to a multiple of BLOCK_M, in expert order; with
    ``with_padding`` also the padding and the row blocks' experts (``_write_padding``)."""
    offs_e = tl.arange(0, EXPERTS_BLOCK)
    expert_valid = offs_e < num_experts
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_ends = tl.cumsum(padded, axis=0)
    first_row = tl.where(expert_valid, run_ends - padded + earlier, 0)
    row = tl.sum(tl.where(experts[:, None] == offs_e[None, :], first_row[None, :], 0), axis=1) + rank
    tl.store(sorted_pairs_ptr + row, pairs, mask=pair_valid)
    if with_padding:
        _write_padding(sorted_pairs_ptr, block_experts_ptr, counts, padded, run_ends, expert_valid, num_pairs,
                       num_experts, capacity, BLOCK_M, EXPERTS_BLOCK, MAX_ROW_BLOCKS)


@triton.jit
def _write_padding(sorted_pairs_ptr, block_experts_ptr, counts, padded, run_ends, expert_valid, num_pairs,
                   num_experts, capacity, BLOCK_M: tl.constexpr, EXPERTS_BLOCK: tl.constexpr,
                   MAX_ROW_BLOCKS: tl.constexpr):
    """Each row block's expert (the run holding its first row; -1 past the last run) and
    ``num_pairs`` into its rows past that run's pairs (all its rows past the last run), a chunk of
    row blocks at a time. ``MAX_ROW_BLOCKS`` (a power of two), a bound of ``capacity // BLOCK_M``
    (128 or more: none), sizes the chunk so that decode's few row blocks take few lanes (the loop
    covers every row block whatever it is)."""
    BLOCKS_CHUNK: tl.constexpr = min(MAX_ROW_BLOCKS, 128, 2048 // BLOCK_M)
    offs_e = tl.arange(0, EXPERTS_BLOCK)
    offs_r = tl.arange(0, BLOCK_M)
    pad_from = tl.where(expert_valid, run_ends - padded + counts, 0)
    num_row_blocks = capacity // BLOCK_M
    for start in range(0, num_row_blocks, BLOCKS_CHUNK):
        blocks = start + tl.arange(0, BLOCKS_CHUNK)
        block_valid = blocks < num_row_blocks
        first_rows = blocks * BLOCK_M
        before = (run_ends[None, :] <= first_rows[:, None]) & expert_valid[None, :]
        expert = tl.sum(before.to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.where(expert < num_experts, expert, -1), mask=block_valid)
        block_pad_from = tl.sum(tl.where(offs_e[None, :] == expert[:, None], pad_from[None, :], 0), axis=1)
        rows = first_rows[:, None] + offs_r[None, :]
        tl.store(sorted_pairs_ptr + rows, num_pairs,
                 mask=block_valid[:, None] & (rows >= block_pad_from[:, None]))


@triton.jit
def moe_align_kernel(experts_ptr, local_rank_ptr, block_counts_ptr, sorted_pairs_ptr, block_experts_ptr,
                     num_pairs, num_experts, num_token_blocks, capacity, TOP_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, TOKENS_BLOCK: tl.constexpr, EXPERTS_BLOCK: tl.constexpr,
                     TOP_K_BLOCK: tl.constexpr, COUNT_ROWS: tl.constexpr, PDL: tl.constexpr):
    """Program ``block`` writes its token block's pairs into their experts' padded runs (the
    same layout as ``align_by_expert``); program 0 also the padding and the row blocks' experts."""
    pdl_wait_and_trigger(PDL)
    block = tl.program_id(0)
    offs_e = tl.arange(0, EXPERTS_BLOCK)
    expert_valid = offs_e < num_experts
    counts = tl.zeros([EXPERTS_BLOCK], dtype=tl.int32)
    earlier = tl.zeros([EXPERTS_BLOCK], dtype=tl.int32)
    for start in range(0, num_token_blocks, COUNT_ROWS):
        rows = start + tl.arange(0, COUNT_ROWS)
        tile = tl.load(block_counts_ptr + rows[:, None] * num_experts + offs_e[None, :],
                       mask=(rows < num_token_blocks)[:, None] & expert_valid[None, :], other=0)
        counts += tl.sum(tile, axis=0)
        earlier += tl.sum(tl.where((rows < block)[:, None], tile, 0), axis=0)
    offs_p = tl.arange(0, TOKENS_BLOCK * TOP_K_BLOCK)
    pairs = block * (TOKENS_BLOCK * TOP_K) + offs_p
    pair_valid = (offs_p < TOKENS_BLOCK * TOP_K) & (pairs < num_pairs)
    experts = tl.load(experts_ptr + pairs, mask=pair_valid, other=-1)
    rank = tl.load(local_rank_ptr + pairs, mask=pair_valid, other=0)
    _place_pairs(sorted_pairs_ptr, block_experts_ptr, pairs, experts, rank, pair_valid, counts, earlier,
                 block == 0, num_pairs, num_experts, capacity, BLOCK_M, EXPERTS_BLOCK, 128)


@triton.jit
def _tile_position(num_row_blocks, num_col_blocks, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program: ``GROUP_M`` row blocks walk each column tile
    together (so the row blocks of one expert share its weight tile in L2)."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_col_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_row_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit(do_not_specialize=["num_pairs"])
def moe_gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, top_k,
                       hidden, inter, num_row_blocks, stride_x, stride_w_expert, stride_w_row, stride_out,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       PDL: tl.constexpr):
    """``out[pair, n] = silu(x[token] . gate[n]) * (x[token] . up[n])`` for columns
    ``n`` of this program, the expert's gate rows at ``n`` and up rows at ``inter + n``; the
    dots in DOT_DTYPE (``gemv.dot_settings``: x's dtype, float32 for bf16 under the interpreter)."""
    pdl_wait_and_trigger(PDL)
    pid_m, pid_n = _tile_position(num_row_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_valid = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + offs_k[None, :]
    # columns past inter wrap onto real rows (loaded, never stored): no column mask in the loop
    gate_ptrs = (w13_ptr + expert.to(tl.int64) * stride_w_expert
                 + (offs_n % inter).to(tl.int64)[None, :] * stride_w_row + offs_k[:, None])
    up_ptrs = gate_ptrs + inter * stride_w_row
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, hidden, BLOCK_K):
        k_valid = offs_k < hidden - k_start
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        gate = tl.load(gate_ptrs, mask=k_valid[:, None], other=0.0)
        up = tl.load(up_ptrs, mask=k_valid[:, None], other=0.0)
        a = a.to(DOT_DTYPE)
        acc_gate = tl.dot(a, gate.to(DOT_DTYPE), acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, up.to(DOT_DTYPE), acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    activated = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + offs_n[None, :],
             activated.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (offs_n < inter)[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def moe_down_kernel(h_ptr, w2_ptr, partial_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, hidden, inter,
                    num_row_blocks, k_per_split, stride_h, stride_w_expert, stride_w_row, stride_split,
                    stride_partial, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    PDL: tl.constexpr):
    """``partial[split, pair, n] = h[pair, K segment] . down[n, K segment]`` for hidden
    columns ``n``; segment ``program_id(1)`` of ``k_per_split`` (a multiple of BLOCK_K); the dots
    in DOT_DTYPE, as ``moe_gate_up_kernel``'s."""
    pdl_wait_and_trigger(PDL)
    pid_m, pid_n = _tile_position(num_row_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_valid = pairs < num_pairs
    pairs = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(inter, k_begin + k_per_split)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pairs[:, None] * stride_h + (k_begin + offs_k)[None, :]
    w_ptrs = (w2_ptr + expert.to(tl.int64) * stride_w_expert
              + (offs_n % hidden).to(tl.int64)[None, :] * stride_w_row + (k_begin + offs_k)[:, None])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        k_valid = offs_k < k_end - k_start
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = (partial_ptr + tl.program_id(1) * stride_split + pairs[:, None] * stride_partial
                + offs_n[None, :])
    tl.store(out_ptrs, acc.to(partial_ptr.dtype.element_ty),
             mask=row_valid[:, None] & (offs_n < hidden)[None, :])


@triton.jit
def moe_reduce_kernel(partial_ptr, weights_ptr, out_ptr, hidden, stride_split, stride_partial, stride_out,
                      SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, TOP_K_BLOCK: tl.constexpr,
                      BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """``out[token, n] = sum over slots of weight[pair] * (sum over splits of partial[split, pair, n])``
    with ``pair = token * TOP_K + slot``, splits then slots in order."""
    pdl_wait_and_trigger(PDL)
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, TOP_K_BLOCK)
    pairs = (token * TOP_K + offs_k).to(tl.int64)
    mask = (offs_k < TOP_K)[:, None] & (offs_h < hidden)[None, :]
    ptrs = partial_ptr + pairs[:, None] * stride_partial + offs_h[None, :]
    acc = tl.zeros([TOP_K_BLOCK, BLOCK_H], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(ptrs + split * stride_split, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weights_ptr + pairs, mask=offs_k < TOP_K, other=0.0).to(tl.float32)
    out = tl.sum(acc * weight[:, None], axis=0)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + offs_h, out.to(out_ptr.dtype.element_ty),
             mask=offs_h < hidden)


@triton.jit
def _expert_keys(logits, experts):
    """Keys in the route kernel's order of experts: by logit (the float's bits made an
    order-preserving int; ``+ 0.0`` turns -0.0 into +0.0, an equal logit), then the lower index
    (its complement in the low 16 bits): int32 for 16-bit logits, whose reductions then take
    one shuffle and one integer max a step, int64 for float32."""
    SIXTEEN: tl.constexpr = logits.dtype.primitive_bitwidth == 16
    if SIXTEEN:
        bits = (logits + 0.0).to(logits.dtype).to(tl.int16, bitcast=True)
        ordered = bits ^ ((bits >> 15) & 0x7FFF)
        return (ordered.to(tl.int32) << 16) | (0xFFFF - experts)
    else:
        bits = (logits + 0.0).to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 16) | (0xFFFF - experts).to(tl.int64)


@triton.jit
def _key_logit(key, logits):
    """The logit (float32) that ``_expert_keys`` packed into ``key``; ``logits``: their tensor."""
    SIXTEEN: tl.constexpr = logits.dtype.primitive_bitwidth == 16
    if SIXTEEN:
        ordered = (key >> 16).to(tl.int16)
        return (ordered ^ ((ordered >> 15) & 0x7FFF)).to(logits.dtype, bitcast=True).to(tl.float32)
    else:
        ordered = (key >> 16).to(tl.int32)
        return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _routing_keys(logits_row, NUM_EXPERTS: tl.constexpr, EXPERTS_BLOCK: tl.constexpr, COPIES: tl.constexpr):
    """One token's logits row held COPIES times, its keys (``_expert_keys``) and the key that
    marks an expert taken (below every key)."""
    experts = tl.arange(0, EXPERTS_BLOCK)[None, :] + tl.zeros([COPIES, 1], tl.int32)
    logits = tl.load(logits_row + experts, mask=experts < NUM_EXPERTS, other=float("-inf"))
    keys = _expert_keys(logits, experts)
    SIXTEEN: tl.constexpr = logits.dtype.primitive_bitwidth == 16
    if SIXTEEN:
        taken = -(2 ** 31)
    else:
        taken = -(2 ** 63)
    return logits, keys, taken


@triton.jit
def _route_expert(logits_row, slot, NUM_EXPERTS: tl.constexpr, EXPERTS_BLOCK: tl.constexpr,
                  COPIES: tl.constexpr):
    """``_route_slot``'s expert alone, after ``slot + 1`` maxima instead of TOP_K and without its
    weight: the gate/up GEMV's programs that store no weight start their loads sooner."""
    _, keys, taken = _routing_keys(logits_row, NUM_EXPERTS, EXPERTS_BLOCK, COPIES)
    best = tl.max(keys, axis=1)
    for _ in range(0, slot):
        keys = tl.where(keys == best[:, None], taken, keys)
        best = tl.max(keys, axis=1)
    return tl.max(0xFFFF - (best & 0xFFFF).to(tl.int32), axis=0)


@triton.jit
def _route_slot(logits_row, slot, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                EXPERTS_BLOCK: tl.constexpr, COPIES: tl.constexpr):
    """The ``slot``-th expert of one token's logits row and its weight, as ``moe_route_kernel``
    chooses them (highest logit first, the lowest index among equal logits; the softmax weight,
    renormalized over the TOP_K chosen with RENORMALIZE): TOP_K maxima over the row of keys
    (``_expert_keys``), each taking its expert out of the row. The row is held COPIES times
    (the launch's warps: a copy a warp, so most of each maximum is warp shuffles) and the copies
    agree once at the end: in the sm_90 SASS at 128 experts and bf16 logits 304 instructions a
    thread and 3 barriers against 256 and 15 with one copy; Qwen3-30B-A3B's batch-1 step 2.714
    against 2.734 ms (H200, triton 3.6). A ranking of per-row candidates that the maxima replaced
    chose wrong experts on an H200 in most layouts at 256 and 512 experts and with one warp
    (right under the interpreter); this form was right in every layout tried (1-8 warps, 8-512
    experts, float32/bfloat16/float16 logits). NUM_EXPERTS is a constexpr so that a row of a
    power of two experts loads unmasked."""
    logits, keys, taken = _routing_keys(logits_row, NUM_EXPERTS, EXPERTS_BLOCK, COPIES)
    expert = tl.zeros([COPIES], tl.int32)
    prob = tl.zeros([COPIES], tl.float32)
    chosen = tl.zeros([COPIES], tl.float32)
    row_max = tl.zeros([COPIES], tl.float32)
    for s in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)
        if s == 0:
            row_max = _key_logit(best, logits)
        exp = tl.exp(_key_logit(best, logits) - row_max)
        chosen += exp
        expert = tl.where(slot == s, 0xFFFF - (best & 0xFFFF).to(tl.int32), expert)
        prob = tl.where(slot == s, exp, prob)
        keys = tl.where(keys == best[:, None], taken, keys)
    if not RENORMALIZE:
        chosen = tl.sum(tl.exp(logits.to(tl.float32) - row_max[:, None]), axis=1)
    return tl.max(expert, axis=0), tl.max(prob / chosen, axis=0)


@triton.jit
def _step_weights(rows_a, rows_b, offs_k, K, EVEN_K: tl.constexpr, TWO: tl.constexpr):
    """One K step's weight rows ``rows_a`` (and ``rows_b`` with TWO, else a [1, 1] zero) at
    ``offs_k``, zero from K on unless EVEN_K (K a multiple of the step: no mask)."""
    mask = None if EVEN_K else offs_k[None, :] < K
    other = None if EVEN_K else 0
    a = tl.load(rows_a + offs_k[None, :], mask=mask, other=other)
    if TWO:
        b = tl.load(rows_b + offs_k[None, :], mask=mask, other=other)
    else:
        b = tl.zeros([1, 1], dtype=tl.float32)
    return a, b


@triton.jit
def _add_products(acc, x, w, PAIRS: tl.constexpr):
    """``acc`` plus ``x * w`` in float32; PAIRS: both hold two bf16 values a uint32 (low half
    first), each widened by one shift or mask (the bf16 convert took a PRMT and a shift for the
    high half: 1.5 instructions a value in the sm_90 SASS)."""
    if PAIRS:
        acc += (x << 16).to(tl.float32, bitcast=True) * (w << 16).to(tl.float32, bitcast=True)
        acc += (x & 0xFFFF0000).to(tl.float32, bitcast=True) * (w & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        acc += x.to(tl.float32) * w.to(tl.float32)
    return acc


@triton.jit
def _step_products(acc_a, acc_b, x_row, a, b, offs_k, K, EVEN_K: tl.constexpr, TWO: tl.constexpr,
                   PAIRS: tl.constexpr):
    """``acc_a`` (and ``acc_b`` with TWO) plus x at ``offs_k`` times the step's weights ``a``
    (``b``). x is read here, in the weight tile's shape: each thread its own values (L1 hits, one
    load and one convert per value a thread holds, whatever the rows), not a row broadcast through
    shared memory (a store, a load and two barriers a step in the sm_90 SASS); not carried over
    the PREFETCH loop's back edge either (a copy per row there)."""
    x_ptrs = x_row + tl.broadcast_to(offs_k[None, :], a.shape)
    x = tl.load(x_ptrs, mask=None if EVEN_K else offs_k[None, :] < K, other=None if EVEN_K else 0)
    acc_a = _add_products(acc_a, x, a, PAIRS)
    if TWO:
        acc_b = _add_products(acc_b, x, b, PAIRS)
    return acc_a, acc_b


@triton.jit
def _row_dots(x_row, rows_a, rows_b, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              PREFETCH: tl.constexpr, TWO: tl.constexpr, PAIRS: tl.constexpr):
    """The float32 dot products over K of x with each weight row of ``rows_a`` (and of ``rows_b``
    with TWO: gate and up share x's loads), ``[BLOCK_N]`` each. A 2-D product tile per row set,
    summed once at the end (the dense one-row GEMV's form: 16-byte loads and FMAs). PREFETCH: each
    step first issues the next step's weight loads (the first step peeled before the loop, the
    last step's products after it, so that no load runs past K), as ``gemv._prefetch_step``.
    PAIRS (bf16, K even, rows 4-byte aligned): x and the weights read as uint32 pairs of values
    (``_add_products``); K, the step and the offsets then count pairs."""
    if PAIRS:
        x_row = x_row.to(tl.pointer_type(tl.uint32))
        rows_a = rows_a.to(tl.pointer_type(tl.uint32))
        rows_b = rows_b.to(tl.pointer_type(tl.uint32))
    UNIT: tl.constexpr = 2 if PAIRS else 1
    STEP: tl.constexpr = BLOCK_K // UNIT
    K = K // UNIT
    acc_a = tl.zeros([BLOCK_N, STEP], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N, STEP] if TWO else [1, 1], dtype=tl.float32)
    offs_k = tl.arange(0, STEP)
    if PREFETCH:
        a, b = _step_weights(rows_a, rows_b, offs_k, K, EVEN_K, TWO)
        for k_start in range(STEP, K, STEP):
            next_a, next_b = _step_weights(rows_a, rows_b, k_start + offs_k, K, EVEN_K, TWO)
            acc_a, acc_b = _step_products(acc_a, acc_b, x_row, a, b, k_start - STEP + offs_k, K, EVEN_K, TWO,
                                          PAIRS)
            a, b = next_a, next_b
        last = (tl.cdiv(K, STEP) - 1) * STEP
        acc_a, acc_b = _step_products(acc_a, acc_b, x_row, a, b, last + offs_k, K, EVEN_K, TWO, PAIRS)
    else:
        for k_start in range(0, K, STEP):
            a, b = _step_weights(rows_a, rows_b, k_start + offs_k, K, EVEN_K, TWO)
            acc_a, acc_b = _step_products(acc_a, acc_b, x_row, a, b, k_start + offs_k, K, EVEN_K, TWO, PAIRS)
    return tl.sum(acc_a, axis=1), tl.sum(acc_b, axis=1)


@triton.jit
def _row_index(offs_n, n, EVEN_N: tl.constexpr):
    """The weight row of each output column ``offs_n``: itself where the column tiles divide ``n``
    (EVEN_N), else wrapped onto a real row (``% n``, an integer division a row: about a hundred
    sm_90 instructions before the down GEMV's first load at 16 rows)."""
    if EVEN_N:
        return offs_n
    else:
        return offs_n % n


@triton.jit
def moe_gate_up_gemv_kernel(x_ptr, logits_ptr, w13_ptr, out_ptr, weights_ptr, experts_ptr, hidden, inter,
                            stride_x, stride_logits, stride_w_expert, stride_w_row, stride_out,
                            NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                            EXPERTS_BLOCK: tl.constexpr, COPIES: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                            PREFETCH: tl.constexpr, PAIRS: tl.constexpr, PDL: tl.constexpr):
    """Pair ``program_id(1)`` (``token * TOP_K + slot``) routes itself on the token's logits
    (column tile 0 with ``_route_slot`` and stores the pair's weight and expert for the down
    launch; the other tiles their expert alone, ``_route_expert``), then
    ``out[pair, n] = silu(x[token] . gate[n]) * (x[token] . up[n])`` for the columns ``n`` of tile
    ``program_id(0)``, the expert's gate rows at ``n`` and up rows at ``inter + n`` (columns past
    inter read real rows, ``n % inter``, and store nothing: no row mask in the loop; EVEN_N: the
    tiles divide inter, no wrap)."""
    pdl_wait_and_trigger(PDL)
    pair = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    if tl.program_id(0) == 0:
        expert, weight = _route_slot(logits_ptr + token * stride_logits, pair % TOP_K, NUM_EXPERTS, TOP_K,
                                     RENORMALIZE, EXPERTS_BLOCK, COPIES)
        tl.store(weights_ptr + pair, weight.to(weights_ptr.dtype.element_ty))
        tl.store(experts_ptr + pair, expert)
    else:
        expert = _route_expert(logits_ptr + token * stride_logits, pair % TOP_K, NUM_EXPERTS, EXPERTS_BLOCK,
                               COPIES)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_rows = (w13_ptr + expert.to(tl.int64) * stride_w_expert
                 + _row_index(offs_n, inter, EVEN_N).to(tl.int64)[:, None] * stride_w_row)
    gate, up = _row_dots(x_ptr + token * stride_x, gate_rows, gate_rows + inter * stride_w_row, hidden,
                         BLOCK_N, BLOCK_K, EVEN_K, PREFETCH, True, PAIRS)
    tl.store(out_ptr + pair.to(tl.int64) * stride_out + offs_n,
             (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=offs_n < inter)


@triton.jit
def moe_down_gemv_kernel(h_ptr, w2_ptr, out_ptr, weights_ptr, experts_ptr, partial_ptr, counter_ptr, hidden,
                         inter, num_col_tiles, stride_h, stride_w_expert, stride_w_row, stride_out,
                         stride_partial_split, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                         PREFETCH: tl.constexpr, PAIRS: tl.constexpr, ALL_PAIRS: tl.constexpr,
                         TOP_K_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """The router-weighted sum of a token's pair shares ``weight[pair] * (h[pair] . down[n])``
    for the hidden columns ``n`` of tile ``program_id(0)`` (float32, all of inter). ALL_PAIRS:
    program ``program_id(1)`` is a token and sums its TOP_K pairs itself (``_token_down``). Else
    it is a pair, and ``gemv.split_k_epilogue`` folds the shares with the slots as segments: each
    pair stores its share and takes a ticket of the (token, column tile) counter; the last sums
    the token's TOP_K shares in slot order, writes the output and resets the counter."""
    pdl_wait_and_trigger(PDL)
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = _row_index(offs_n, hidden, EVEN_N).to(tl.int64)[:, None] * stride_w_row
    if ALL_PAIRS:
        token = tl.program_id(1)
        total = _token_down(h_ptr, w2_ptr, weights_ptr, experts_ptr, token, rows, inter, stride_h,
                            stride_w_expert, TOP_K, TOP_K_BLOCK, BLOCK_K, EVEN_K, PREFETCH, PAIRS)
        tl.store(out_ptr + token.to(tl.int64) * stride_out + offs_n, total.to(out_ptr.dtype.element_ty),
                 mask=offs_n < hidden)
    else:
        pair = tl.program_id(1)
        token = pair // TOP_K
        expert_rows = w2_ptr + tl.load(experts_ptr + pair).to(tl.int64) * stride_w_expert + rows
        dots, _ = _row_dots(h_ptr + pair.to(tl.int64) * stride_h, expert_rows, expert_rows, inter, BLOCK_N,
                            BLOCK_K, EVEN_K, PREFETCH, False, PAIRS)
        share = tl.load(weights_ptr + pair).to(tl.float32) * dots
        offs_m = token + tl.arange(0, 1)
        split_k_epilogue(share[None, :], offs_m, offs_n, offs_m >= 0, offs_n < hidden,
                         token * num_col_tiles + pid_n, pair % TOP_K, TOP_K, partial_ptr,
                         stride_partial_split, hidden, counter_ptr, out_ptr, out_ptr, stride_out, False,
                         TOP_K > 1)


@triton.jit
def _token_step(w_rows, x_rows, valid, offs_k, K, FULL: tl.constexpr):
    """One K step of ``_token_down``: the pairs' weight rows and activations at ``offs_k``
    (``[1, 1, step]``), unmasked where FULL (whole steps, every slot a pair)."""
    if FULL:
        w = tl.load(w_rows + offs_k)
        return w, tl.load(x_rows + tl.broadcast_to(offs_k, w.shape))
    mask = valid[:, None, None] & (offs_k < K)
    w = tl.load(w_rows + offs_k, mask=mask, other=0)
    return w, tl.load(x_rows + tl.broadcast_to(offs_k, w.shape), mask=mask, other=0)


@triton.jit
def _token_down(h_ptr, w2_ptr, weights_ptr, experts_ptr, token, rows, inter, stride_h, stride_w_expert,
                TOP_K: tl.constexpr, TOP_K_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                PREFETCH: tl.constexpr, PAIRS: tl.constexpr):
    """``sum_slot weight[pair] * (h[pair] . down[n])`` over the token's TOP_K pairs, float32, for
    the weight rows at offsets ``rows`` (``[BLOCK_N, 1]``) of each pair's expert. Each K step
    reads all the pairs' rows as one ``[TOP_K_BLOCK, BLOCK_N, step]`` tile, so that their loads
    are in flight together (a loop over the pairs ran one pair's loads, products and sum after
    another in the sm_90 SASS); PREFETCH: each next step's loads go out before this step's
    products (the first before the loop, the last step's products after it), two steps in
    flight; PAIRS as in ``_row_dots``."""
    slots = tl.arange(0, TOP_K_BLOCK)
    valid = slots < TOP_K
    pairs = token * TOP_K + slots
    experts = tl.load(experts_ptr + pairs, mask=valid, other=0).to(tl.int64)
    w_rows = w2_ptr + experts[:, None, None] * stride_w_expert + rows[None, :, :]
    x_rows = h_ptr + pairs.to(tl.int64)[:, None, None] * stride_h
    if PAIRS:
        w_rows = w_rows.to(tl.pointer_type(tl.uint32))
        x_rows = x_rows.to(tl.pointer_type(tl.uint32))
    UNIT: tl.constexpr = 2 if PAIRS else 1
    STEP: tl.constexpr = BLOCK_K // UNIT
    K = inter // UNIT
    full: tl.constexpr = EVEN_K and TOP_K == TOP_K_BLOCK
    offs_k = tl.arange(0, STEP)[None, None, :]
    acc = tl.zeros([TOP_K_BLOCK, rows.shape[0], STEP], dtype=tl.float32)
    if PREFETCH:
        w, x = _token_step(w_rows, x_rows, valid, offs_k, K, full)
        for k_start in range(STEP, K, STEP):
            next_w, next_x = _token_step(w_rows, x_rows, valid, k_start + offs_k, K, full)
            acc = _add_products(acc, x, w, PAIRS)
            w, x = next_w, next_x
        acc = _add_products(acc, x, w, PAIRS)
    else:
        for k_start in range(0, K, STEP):
            w, x = _token_step(w_rows, x_rows, valid, k_start + offs_k, K, full)
            acc = _add_products(acc, x, w, PAIRS)
    weights = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    return tl.sum(tl.sum(acc, axis=2) * weights[:, None], axis=0)
