"""The mixture-of-experts MLP: routing, a plain-torch reference that loops over experts, and the
fused Triton version.

``x`` is ``[tokens, hidden]``; ``w13`` ``[experts, 2 * inter, hidden]`` holds each expert's gate
rows then up rows, ``w2`` ``[experts, hidden, inter]`` its down projection (under tensor
parallelism ``inter`` is this rank's slice; the caller sums the ranks' outputs). A token's
output is the sum over its ``top_k`` experts of ``weight * down(silu(gate(x)) * up(x))``.

The fused version has two paths. The grouped path runs five launches: routing (softmax, top-k,
renormalize) and the sort of the (token, expert) pairs by expert, each expert's run padded to a
whole number of ``block_m`` rows (two Triton kernels, ``route_and_align_triton``; the torch ops
``select_experts`` + ``align_by_expert`` are their reference, and run instead for very many
pairs); a grouped GEMM writing ``silu(gate) * up`` per pair; a grouped GEMM of the down
projection (K optionally split); a reduce summing each token's splits and ``top_k`` pairs
weighted by the router. The GEMV path, for decode batches, runs two: a GEMV per (pair, column
tile) that first routes its pair itself from the token's logits (the route kernel's choice and
weight, which column tile 0 stores; the other tiles find the expert alone) and writes
``silu(gate) * up`` in the same layout, and a GEMV per (pair, column tile) of the down
projection weighted by the router whose (token, column tile)'s last program sums the token's
``top_k`` shares in slot order (``gemv.split_k_epilogue``'s ticket fold: no routing launch, no
reduce). At batch 1 the grouped GEMMs' 16-row tiles hold one real row each; the GEMVs stream
the routed experts' weights with CUDA-core FMAs, like the dense one-row GEMV
(``kernels/gemv.py``). The GEMV path takes at most ``MOE_GEMV_MAX_EXPERTS`` experts (every
program routes its pair from all of its token's logits): beyond, a ``MoeGemvConfig`` is refused
with a ValueError and the default config is always the grouped path's. ``fused_moe_configs``
picks the path, tiles and splits by shape and token count (the GEMV path only where
``MOE_GEMV_CONFIGS``, measured by ``benchmarks/moe_bench.py``, lists that exact batch).
Everything runs on the device without host syncs and every shape follows from the token count,
so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedlab.kernels.fused_moe_configs import (MOE_GEMV_MAX_EXPERTS, ROUTE_ALIGN_TRITON_MAX_PAIRS, MoeConfig,
                                                MoeGemmConfig, MoeGemvConfig, MoeGemvLaunch, moe_config,
                                                moe_gemv_config, route_num_warps)
from pagedlab.kernels.pdl import pdl_launch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts by softmax probability and their weights (renormalized over
    the chosen ones where ``renormalize``, as Mixtral always and Qwen3-MoE by ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts


def moe_torch(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool, routes: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE MLP, looping over the experts that have tokens (the reference); ``routes`` as in
    ``fused_moe_triton``."""
    weights, experts = select_experts(router_logits, top_k, renormalize, x.dtype)
    record_routes(routes, experts)
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        token, slot = torch.where(experts == expert)
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        out.index_add_(0, token, F.linear(F.silu(gate) * up, w2[expert]) * weights[token, slot, None])
    return out


def record_routes(routes: torch.Tensor | None, experts: torch.Tensor) -> None:
    """Copy each token's experts (``[tokens, top_k]``, the ones its output is computed with) into
    the first rows of ``routes`` (``[rows >= tokens, top_k]``, any integer dtype), where given."""
    if routes is not None:
        routes[:experts.shape[0]].copy_(experts)


class ExpertRouting(NamedTuple):
    """Each token's experts and weights, and its pairs sorted by expert into padded runs."""

    weights: torch.Tensor  # [tokens, top_k] router weights, x's dtype
    experts: torch.Tensor  # [tokens, top_k] expert indices, highest weight first
    sorted_pairs: torch.Tensor  # [capacity] int32 pair index token * top_k + slot; padding tokens * top_k
    block_experts: torch.Tensor  # [capacity // block_m] int32 each row block's expert, -1 past the last run
    block_m: int


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted layout, sized for the worst case (every expert that can have a pair
    has one, each run padded by ``block_m - 1``), so the shapes depend on the token count alone."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-worst // block_m) * block_m


def align_by_expert(experts: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs sorted by expert (in pair order within an expert), each expert's
    run padded to a multiple of ``block_m``: ``sorted_pairs`` and ``block_experts`` as in
    ``ExpertRouting`` (the reference of ``moe_align_kernel``)."""
    flat = experts.flatten().long()
    num_pairs = flat.numel()
    capacity = align_capacity(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[(run_ends - padded)[sorted_experts] + rank_in_expert] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(run_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_pairs, block_experts


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")


def route_and_align_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int,
                          dtype: torch.dtype) -> ExpertRouting:
    """``select_experts`` then ``align_by_expert``: the reference of ``route_and_align_triton``."""
    num_experts = router_logits.shape[1]
    _check_top_k(top_k, num_experts)
    weights, experts = select_experts(router_logits, top_k, renormalize, dtype)
    sorted_pairs, block_experts = align_by_expert(experts, num_experts, block_m)
    return ExpertRouting(weights.contiguous(), experts, sorted_pairs, block_experts, block_m)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


_MAX_WARPS = 32  # a CUDA block's 1024 threads


def _route_blocks(num_tokens: int, num_experts: int, top_k: int) -> tuple[int, int, int]:
    """Tokens, experts and slots of a route program's tiles (powers of two)."""
    experts_block, top_k_block = _next_power_of_2(num_experts), _next_power_of_2(top_k)
    # a block's logits and its pairs-by-experts one-hot stay a few thousand values a program
    tokens_block = max(1, min(_next_power_of_2(num_tokens), 4096 // experts_block,
                              16384 // (experts_block * top_k_block)))
    return tokens_block, experts_block, top_k_block


def route_warps(num_tokens: int, num_experts: int, top_k: int) -> int:
    """The warps ``route_and_align_triton`` launches with by default (``fused_moe_configs.route_num_warps``
    for its programs' tiles)."""
    tokens_block, experts_block, top_k_block = _route_blocks(num_tokens, num_experts, top_k)
    return route_num_warps(num_tokens, num_experts, top_k, tokens_block * top_k_block, experts_block)


def route_and_align_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int,
                           dtype: torch.dtype, num_warps: int | None = None) -> ExpertRouting:
    """Routing and the sort by expert in two Triton launches (one when the tokens fit one route
    program: decode); the same experts, sorted pairs and row blocks as ``route_and_align_torch``
    (weights within float rounding; int32 experts). ``num_warps`` (both launches) defaults to
    ``fused_moe_configs.route_num_warps``."""
    from pagedlab.kernels import fused_moe_kernels

    num_tokens, num_experts = router_logits.shape
    _check_top_k(top_k, num_experts)
    if num_warps is not None and not (1 <= num_warps <= _MAX_WARPS and num_warps & (num_warps - 1) == 0):
        raise ValueError(f"num_warps={num_warps} must be a power of two from 1 to {_MAX_WARPS}")
    logits = router_logits.contiguous()
    device, num_pairs = logits.device, num_tokens * top_k
    tokens_block, experts_block, top_k_block = _route_blocks(num_tokens, num_experts, top_k)
    num_token_blocks = -(-num_tokens // tokens_block)
    capacity = align_capacity(num_pairs, num_experts, block_m)
    weights = torch.empty(num_tokens, top_k, dtype=dtype, device=device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    local_rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    block_counts = torch.empty(num_token_blocks, num_experts, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    sizes = dict(TOP_K=top_k, TOKENS_BLOCK=tokens_block, EXPERTS_BLOCK=experts_block, TOP_K_BLOCK=top_k_block,
                 BLOCK_M=block_m, num_warps=num_warps or route_warps(num_tokens, num_experts, top_k))
    # one token block holds every count: the route kernel sorts too (one launch instead of two)
    fused_moe_kernels.moe_route_kernel[(num_token_blocks,)](
        logits, weights, experts, local_rank, block_counts, sorted_pairs, block_experts, num_tokens,
        num_experts, logits.stride(0), capacity, RENORMALIZE=renormalize, ALIGN=num_token_blocks == 1,
        **sizes, **pdl_launch(device))
    if num_token_blocks > 1:
        fused_moe_kernels.moe_align_kernel[(num_token_blocks,)](
            experts, local_rank, block_counts, sorted_pairs, block_experts, num_pairs, num_experts,
            num_token_blocks, capacity, COUNT_ROWS=max(1, 2048 // experts_block), **sizes,
            **pdl_launch(device))
    return ExpertRouting(weights, experts, sorted_pairs, block_experts, block_m)


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int,
                    dtype: torch.dtype) -> ExpertRouting:
    """The Triton routing and sort up to ``ROUTE_ALIGN_TRITON_MAX_PAIRS`` pairs, else the torch ops."""
    num_pairs = router_logits.shape[0] * top_k
    in_triton = 0 < num_pairs <= ROUTE_ALIGN_TRITON_MAX_PAIRS
    routed = route_and_align_triton if in_triton else route_and_align_torch
    return routed(router_logits, top_k, renormalize, block_m, dtype)


def moe_gate_up_triton(x: torch.Tensor, w13: torch.Tensor, routing: ExpertRouting,
                       gemm: MoeGemmConfig) -> torch.Tensor:
    """``silu(gate) * up`` of every pair, ``[tokens * top_k, inter]`` in pair order (one launch)."""
    from pagedlab.kernels import fused_moe_kernels
    from pagedlab.kernels.gemv import dot_settings

    num_tokens, hidden = x.shape
    inter, top_k = w13.shape[1] // 2, routing.weights.shape[1]
    num_row_blocks = routing.block_experts.shape[0]
    activated = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    grid = (num_row_blocks * -(-inter // gemm.block_n),)
    fused_moe_kernels.moe_gate_up_kernel[grid](
        x, w13, activated, routing.sorted_pairs, routing.block_experts, num_tokens * top_k, top_k, hidden,
        inter, num_row_blocks, x.stride(0), w13.stride(0), w13.stride(1), activated.stride(0),
        BLOCK_M=routing.block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k, GROUP_M=gemm.group_m,
        **dot_settings(x), **pdl_launch(x.device), num_warps=gemm.num_warps,
        num_stages=gemm.num_stages)
    return activated


def moe_down_triton(activated: torch.Tensor, w2: torch.Tensor, routing: ExpertRouting,
                    gemm: MoeGemmConfig) -> torch.Tensor:
    """Each token's router-weighted sum of its pairs' down projections, ``[tokens, hidden]``: the
    grouped GEMM (per K split, float32 partial sums when split) and the reduce (two launches)."""
    from pagedlab.kernels import fused_moe_kernels
    from pagedlab.kernels.gemv import dot_settings

    num_pairs, inter = activated.shape
    pdl = pdl_launch(activated.device)
    hidden = w2.shape[1]
    num_tokens, top_k = routing.weights.shape
    num_row_blocks = routing.block_experts.shape[0]
    k_steps = -(-inter // gemm.block_k)
    k_per_split = -(-k_steps // gemm.split_k) * gemm.block_k
    partial = torch.empty(gemm.split_k, num_pairs, hidden, device=activated.device,
                          dtype=activated.dtype if gemm.split_k == 1 else torch.float32)
    grid = (num_row_blocks * -(-hidden // gemm.block_n), gemm.split_k)
    fused_moe_kernels.moe_down_kernel[grid](
        activated, w2, partial, routing.sorted_pairs, routing.block_experts, num_pairs, hidden, inter,
        num_row_blocks, k_per_split, activated.stride(0), w2.stride(0), w2.stride(1), partial.stride(0),
        partial.stride(1), BLOCK_M=routing.block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k,
        GROUP_M=gemm.group_m, **dot_settings(activated), **pdl, num_warps=gemm.num_warps,
        num_stages=gemm.num_stages)
    out = torch.empty(num_tokens, hidden, dtype=activated.dtype, device=activated.device)
    top_k_block = _next_power_of_2(top_k)
    block_h = min(max(128, 2048 // top_k_block), _next_power_of_2(hidden))
    fused_moe_kernels.moe_reduce_kernel[(num_tokens, -(-hidden // block_h))](
        partial, routing.weights, out, hidden, partial.stride(0), partial.stride(1), out.stride(0),
        SPLIT_K=gemm.split_k, TOP_K=top_k, TOP_K_BLOCK=top_k_block, BLOCK_H=block_h, **pdl)
    return out


# CUDA's limit on a grid's second axis, which holds the GEMV path's pairs
_GRID_Y_MAX = 65535


def _bf16_pairs(k: int, launch: MoeGemvLaunch, *tensors: torch.Tensor) -> bool:
    """Whether a GEMV over K ``k`` may read ``tensors`` (x and the weights) as uint32 pairs of
    bf16 values: bf16, K and the K step even, every row and base 4-byte aligned."""
    aligned = (t.dtype == torch.bfloat16 and t.data_ptr() % 4 == 0
               and all(stride % 2 == 0 for stride in t.stride()[:-1]) for t in tensors)
    return k % 2 == 0 and launch.block_k > 1 and all(aligned)


def _check_gemv_routing(router_logits: torch.Tensor, num_tokens: int, num_experts: int, top_k: int) -> None:
    _check_top_k(top_k, num_experts)
    if num_experts > MOE_GEMV_MAX_EXPERTS:
        raise ValueError(f"{num_experts} experts is over the GEMV path's fused routing "
                         f"({MOE_GEMV_MAX_EXPERTS} experts at most): use a MoeConfig")
    if tuple(router_logits.shape) != (num_tokens, num_experts) or router_logits.stride(-1) != 1:
        raise ValueError(f"router_logits {tuple(router_logits.shape)} must be [tokens={num_tokens}, "
                         f"experts={num_experts}] with a contiguous last dimension")
    if num_tokens * top_k > _GRID_Y_MAX:
        raise ValueError(f"{num_tokens * top_k} (token, expert) pairs is over the GEMV path's {_GRID_Y_MAX}: "
                         "use a MoeConfig")


def moe_gate_up_gemv_triton(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, top_k: int,
                            renormalize: bool, launch: MoeGemvLaunch
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GEMV path's first launch, routing included: ``silu(gate) * up`` of every pair,
    ``[tokens * top_k, inter]`` in pair order, and each token's weights and experts as
    ``ExpertRouting`` holds them (``[tokens, top_k]``, x's dtype and int32; the experts equal
    ``select_experts``'s, the weights within float rounding). One GEMV program per (column tile,
    pair), each computing its pair's expert from the logits (no routing launch)."""
    from pagedlab.kernels import fused_moe_kernels

    num_tokens, hidden = x.shape
    num_experts, two_inter = w13.shape[:2]
    inter = two_inter // 2
    _check_gemv_routing(router_logits, num_tokens, num_experts, top_k)
    num_pairs = num_tokens * top_k
    activated = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    weights = torch.empty(num_tokens, top_k, dtype=x.dtype, device=x.device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    if num_pairs:
        fused_moe_kernels.moe_gate_up_gemv_kernel[(-(-inter // launch.block_n), num_pairs)](
            x, router_logits, w13, activated, weights, experts, hidden, inter, x.stride(0),
            router_logits.stride(0), w13.stride(0), w13.stride(1), activated.stride(0),
            NUM_EXPERTS=num_experts, TOP_K=top_k, RENORMALIZE=renormalize,
            EXPERTS_BLOCK=_next_power_of_2(num_experts), COPIES=launch.num_warps,
            BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, EVEN_N=inter % launch.block_n == 0,
            EVEN_K=hidden % launch.block_k == 0,
            PREFETCH=launch.prefetch, PAIRS=_bf16_pairs(hidden, launch, x, w13), **pdl_launch(x.device),
            num_warps=launch.num_warps, num_stages=1)
    return activated, weights, experts


def moe_down_gemv_triton(activated: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                         experts: torch.Tensor, launch: MoeGemvLaunch) -> torch.Tensor:
    """The GEMV path's second launch: each token's router-weighted sum of its pairs' down
    projections, ``[tokens, hidden]``. One GEMV program per (column tile, pair) over all of inter;
    the last program of a (token, column tile) to finish sums the token's ``top_k`` shares in
    slot order (``gemv.split_k_epilogue``'s ticket fold, on its counters buffer: made eagerly at
    the first call, like the dense GEMV's). With ``launch.all_pairs`` one program per (column
    tile, token) reads all its pairs' rows a K step and sums their weighted shares itself (a tree
    over the slots: within float32 rounding of the fold's)."""
    from pagedlab.kernels import fused_moe_kernels
    from pagedlab.kernels.gemv import split_k_scratch

    num_pairs, inter = activated.shape
    hidden = w2.shape[1]
    num_tokens, top_k = weights.shape
    out = torch.empty(num_tokens, hidden, dtype=activated.dtype, device=activated.device)
    if num_pairs == 0:
        return out
    tiles = -(-hidden // launch.block_n)
    if launch.all_pairs:
        partial = counters = out  # unused
    else:
        partial, counters = split_k_scratch(num_tokens, hidden, top_k, num_tokens * tiles, out)
    fused_moe_kernels.moe_down_gemv_kernel[(tiles, num_tokens if launch.all_pairs else num_pairs)](
        activated, w2, out, weights, experts, partial, counters, hidden, inter, tiles, activated.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0), partial.stride(0), TOP_K=top_k, BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, EVEN_N=hidden % launch.block_n == 0, EVEN_K=inter % launch.block_k == 0,
        PREFETCH=launch.prefetch, PAIRS=_bf16_pairs(inter, launch, activated, w2),
        ALL_PAIRS=launch.all_pairs, TOP_K_BLOCK=_next_power_of_2(top_k), **pdl_launch(activated.device),
        num_warps=launch.num_warps, num_stages=1)
    return out


def fused_moe_triton(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     top_k: int, renormalize: bool, config: MoeConfig | MoeGemvConfig | None = None,
                     routes: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE MLP, the same result as ``moe_torch``: the grouped path (five launches) for a
    ``MoeConfig``, the GEMV path (two) for a ``MoeGemvConfig``. ``config`` defaults to
    ``fused_moe_configs.moe_gemv_config`` for this shape and token count where it has one, else
    ``fused_moe_configs.moe_config``. ``routes`` (``enable_return_routed_experts``): each token's
    experts are copied into its rows, those the kernels chose (the route kernel's, or the GEMV
    path's own routing), one copy launch more; None adds nothing."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [experts, 2 * inter, "
                         f"hidden={hidden}] and [experts, hidden, inter]")
    if config is None:
        config = moe_gemv_config(num_tokens, num_experts, hidden, inter, top_k)
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        config = moe_config(num_tokens, num_experts, hidden, inter, top_k, sms)
    config.check()
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    if isinstance(config, MoeGemvConfig):
        activated, weights, experts = moe_gate_up_gemv_triton(x, router_logits.contiguous(), w13, top_k,
                                                              renormalize, config.gate_up)
        record_routes(routes, experts)
        return moe_down_gemv_triton(activated, w2, weights, experts, config.down)
    routing = route_and_align(router_logits, top_k, renormalize, config.block_m, x.dtype)
    record_routes(routes, routing.experts)
    return moe_down_triton(moe_gate_up_triton(x, w13, routing, config.gate_up), w2, routing, config.down)
