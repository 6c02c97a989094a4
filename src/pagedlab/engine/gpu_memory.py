"""What share of a GPU the engine may take: ``gpu_memory_utilization`` is a fraction of the GPU's
total memory for this engine alone (weights, activations, KV cache), as in vLLM; what other
processes held when it started is outside it, and so is this process's CUDA context.

Each engine (each tensor-parallel rank) looks at its GPU once as it starts, before its process
group and its weights (``take_memory_baseline``); the memory profile then counts what the process
added outside torch since (NCCL, peer all-reduce buffers) as the engine's, and a share larger than
was free at that look is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryBaseline:
    """A GPU's memory as an engine starts (this process's CUDA context already made):
    ``used_outside_torch`` is other processes' and that context's."""

    free: int
    total: int
    used_outside_torch: int


def take_memory_baseline(device: torch.device) -> MemoryBaseline | None:
    """``device``'s memory now (None off CUDA); call it with ``device`` current."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryBaseline(free, total, _used_outside_torch(device, free, total))


def requested_memory(baseline: MemoryBaseline, gpu_memory_utilization: float) -> float:
    """Bytes the engine may use: ``gpu_memory_utilization`` of the GPU's total; a ValueError
    (vLLM's start-up check) when that is more than other processes left at the ``baseline``
    (this process's own torch memory then is in the profile's peak, so it does not count)."""
    requested = baseline.total * gpu_memory_utilization
    left = baseline.total - baseline.used_outside_torch
    if left < requested:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} asks for {requested / GIB:.2f} GiB of the "
            f"GPU's {baseline.total / GIB:.2f} GiB, but other processes (and this one's CUDA context) held "
            f"{baseline.used_outside_torch / GIB:.2f} GiB when the engine started, leaving "
            f"{left / GIB:.2f} GiB: lower gpu_memory_utilization to at most "
            f"{int(left / baseline.total * 100) / 100:.2f} or free the GPU")
    return requested


def memory_added_outside_torch(device: torch.device, baseline: MemoryBaseline) -> int:
    """Bytes this process holds on ``device`` outside torch's allocator beyond what ``baseline``
    saw (other processes' growth since counts too: the safe side)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return max(_used_outside_torch(device, free, total) - baseline.used_outside_torch, 0)


def _used_outside_torch(device: torch.device, free: int, total: int) -> int:
    return total - free - torch.cuda.memory_reserved(device)


def cache_too_small(plan, bytes_per_block: int, num_blocks: int, min_blocks: int) -> str:
    """vLLM's check_enough_kv_cache_memory, for a ``RunnerPlan`` whose cache got ``num_blocks`` of
    ``bytes_per_block``: what one max_model_len sequence needs, what the setting that sized the
    cache gives, and the longest max_model_len that would fit."""
    num_blocks = max(num_blocks, 0)  # a profile can leave less than nothing
    tokens = num_blocks * plan.block_size
    setting = "kv_cache_memory_bytes" if plan.kv_cache_memory_bytes is not None else "gpu_memory_utilization"
    lower = f" or lower max_model_len to at most {tokens}" if tokens else ""
    return (f"the KV cache cannot hold one sequence: max_model_len={plan.max_model_len} needs "
            f"{min_blocks * bytes_per_block} bytes ({min_blocks} blocks of {plan.block_size} tokens), and "
            f"{setting}={getattr(plan, setting)} leaves {num_blocks * bytes_per_block} bytes ({num_blocks} "
            f"blocks); raise {setting}{lower}")
