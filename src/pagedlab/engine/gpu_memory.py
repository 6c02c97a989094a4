"""What share of a GPU the engine may take: ``gpu_memory_utilization`` is a fraction of the GPU's
total memory for this engine alone (weights, activations, KV cache), as in vLLM; what other
processes held when it started is outside it, and so is this process's CUDA context.

The process looks at the GPU once (``record_memory_baseline``), before its process group and its
weights; the memory profile then counts what the process added outside torch since (NCCL, peer
all-reduce buffers) as the engine's, and a share larger than was free at that look is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryBaseline:
    """A GPU's memory at this process's first look (its CUDA context already made):
    ``used_outside_torch`` is other processes' and that context's."""

    free: int
    total: int
    used_outside_torch: int


_MEMORY_BASELINES: dict[int, MemoryBaseline] = {}  # per GPU index


def record_memory_baseline(device: torch.device) -> MemoryBaseline | None:
    """The device's ``MemoryBaseline``, taken at the first call for it (None off CUDA)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MEMORY_BASELINES:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        _MEMORY_BASELINES[index] = MemoryBaseline(free, total, _used_outside_torch(device, free, total))
    return _MEMORY_BASELINES[index]


def requested_memory(device: torch.device, gpu_memory_utilization: float) -> float:
    """Bytes the engine may use on ``device``: ``gpu_memory_utilization`` of its total; a
    ValueError (vLLM's start-up check) when that is more than other processes left at the first
    look (this process's own torch memory then is in the profile's peak, so it does not count)."""
    baseline = record_memory_baseline(device)
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


def memory_added_outside_torch(device: torch.device) -> int:
    """Bytes this process holds on ``device`` outside torch's allocator beyond what the baseline
    saw (other processes' growth since counts too: the safe side)."""
    baseline = record_memory_baseline(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return max(_used_outside_torch(device, free, total) - baseline.used_outside_torch, 0)


def _used_outside_torch(device: torch.device, free: int, total: int) -> int:
    return total - free - torch.cuda.memory_reserved(device)
