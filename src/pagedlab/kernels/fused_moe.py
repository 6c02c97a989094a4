"""The mixture-of-experts MLP: routing, a plain-torch reference that loops over experts, and the
fused Triton version (two grouped GEMM launches over all experts).

``x`` is ``[tokens, hidden]``; ``w13`` ``[experts, 2 * inter, hidden]`` holds each expert's gate
rows then up rows, ``w2`` ``[experts, hidden, inter]`` its down projection (under tensor
parallelism ``inter`` is this rank's slice; the caller sums the ranks' outputs). A token's
output is the sum over its ``top_k`` experts of ``weight * down(silu(gate(x)) * up(x))``.

The fused version sorts the (token, expert) pairs by expert, each expert's run padded to a
whole number of ``BLOCK_M`` rows (``align_by_expert``), so that every row block of the grouped
GEMMs belongs to one expert: the gate/up launch writes ``silu(gate) * up`` per pair, the down
launch multiplies by the router weight, and the ``top_k`` rows of each token are summed. The
sort runs on the device without host syncs and the grids are sized from ``tokens`` alone, so a
decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
              top_k: int, renormalize: bool) -> torch.Tensor:
    """The MoE MLP, looping over the experts that have tokens (the reference)."""
    weights, experts = select_experts(router_logits, top_k, renormalize, x.dtype)
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        token, slot = torch.where(experts == expert)
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        out.index_add_(0, token, F.linear(F.silu(gate) * up, w2[expert]) * weights[token, slot, None])
    return out


def align_by_expert(experts: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs sorted by expert, each expert's run padded to a multiple of
    ``block_m``: ``sorted_pairs`` (flat pair index ``token * top_k + slot``; padding holds
    ``tokens * top_k``) and ``block_experts`` (each row block's expert, -1 past the last run).
    Sized for the worst case, so the shapes depend on the token count alone."""
    flat = experts.flatten()
    num_pairs = flat.numel()
    capacity = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
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


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small when each expert gets few pairs (decode), up to 64 for prefills."""
    per_expert = max(num_pairs // num_experts, 1)
    return min(64, max(16, 1 << (per_expert - 1).bit_length()))


def fused_moe_triton(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     top_k: int, renormalize: bool) -> torch.Tensor:
    """The MoE MLP in two grouped GEMM launches over all experts; same result as ``moe_torch``."""
    from pagedlab.kernels import fused_moe_kernels

    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [experts, 2 * inter, "
                         f"hidden={hidden}] and [experts, hidden, inter]")
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights, experts = select_experts(router_logits, top_k, renormalize, x.dtype)
    num_pairs = num_tokens * top_k
    block_m = _block_m(num_pairs, num_experts)
    sorted_pairs, block_experts = align_by_expert(experts, num_experts, block_m)
    activated = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    common = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64 if hidden >= 64 else 32,
                  DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    num_blocks = block_experts.shape[0]
    fused_moe_kernels.moe_gate_up_kernel[(num_blocks, -(-inter // 64))](
        x, w13, activated, sorted_pairs, block_experts, num_pairs, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), activated.stride(0), **common)
    fused_moe_kernels.moe_down_kernel[(num_blocks, -(-hidden // 64))](
        activated, w2, per_pair, sorted_pairs, block_experts, weights.reshape(-1), num_pairs, hidden, inter,
        activated.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0),
        **{**common, "BLOCK_K": 64 if inter >= 64 else 32})
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)
