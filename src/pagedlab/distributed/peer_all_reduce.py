"""The one-shot all-reduce for small messages (``pagedlab.kernels.all_reduce``) with its peer
memory: each rank's staging buffer and signal pad, mapped on every GPU of the group through
CUDA IPC (plain peer-to-peer loads and atomics over NVLink; no multicast). Messages over
``max_bytes`` and tensors it cannot take go to NCCL.

(torch's symmetric memory would do the mapping too, but its rendezvous numbers exchanges per
process: a driver process that builds a second engine no longer meets its fresh workers.)"""

from __future__ import annotations

from dataclasses import dataclass

import inspect

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

# Up to 2 MiB the one-shot kernel beats NCCL on two H200s, eager and in CUDA graphs; from 4 MiB
# NCCL is faster (measured: BENCHMARKS.md).
DEFAULT_MAX_BYTES = 2 << 20
MAX_PROGRAMS = 32  # programs per launch; each uses world_size int32 flags of a signal pad
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class PeerAllReduce:
    """Every rank's staging buffer (``buffer_ptrs``) and signal pad (``signal_pad_ptrs``) as int64
    address tensors on this rank's device; ``keepalive`` holds whatever owns the mappings."""

    rank: int
    world_size: int
    buffer_ptrs: torch.Tensor
    signal_pad_ptrs: torch.Tensor
    max_bytes: int
    keepalive: object = None

    @classmethod
    def from_cuda_ipc(cls, group, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> PeerAllReduce:
        """Allocate this rank's buffer and signal pad and map every other rank's into this GPU's
        address space through CUDA IPC (a collective over ``group``: every rank calls it)."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        buffer = torch.empty(buffer_bytes(world_size, max_bytes), dtype=torch.uint8, device=device)
        pad = torch.zeros(pad_flags(world_size), dtype=torch.int32, device=device)
        shared = [None] * world_size
        dist.all_gather_object(shared, (reduce_tensor(buffer), reduce_tensor(pad)), group=group)
        peers = [(buffer, pad) if r == rank else (_open(b, device), _open(p, device))
                 for r, (b, p) in enumerate(shared)]
        torch.cuda.synchronize(device)  # the peers' pads are zeroed before any kernel signals them
        dist.barrier(group=group)
        return cls(rank, world_size, _addresses([b.data_ptr() for b, _ in peers], device),
                   _addresses([p.data_ptr() for _, p in peers], device), max_bytes, keepalive=peers)

    def can_reduce(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the one-shot kernel (else through NCCL)."""
        return (x.device == self.buffer_ptrs.device and x.dtype in SUPPORTED_DTYPES
                and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place; bitwise the same on every rank."""
        from pagedlab.kernels.all_reduce import one_shot_all_reduce_triton

        return one_shot_all_reduce_triton(x, x, self.buffer_ptrs, self.signal_pad_ptrs, self.rank,
                                          self.world_size, self.max_bytes, MAX_PROGRAMS)


def buffer_bytes(world_size: int, max_bytes: int) -> int:
    """Bytes of each rank's buffer: a slot of ``max_bytes`` per rank and call parity."""
    return 2 * world_size * max_bytes


def pad_flags(world_size: int) -> int:
    """int32 flags of each rank's signal pad: one per (program, sender), one parity per program."""
    return MAX_PROGRAMS * (world_size + 1)


def _open(shared, device: torch.device) -> torch.Tensor:
    """A peer's tensor (``reduce_tensor``'s output) mapped into ``device``'s context: opened under
    this GPU rather than the owner's, so no context is created on the peer's GPU and this GPU's
    kernels reach it over NVLink (CUDA enables the peer access when it maps the handle)."""
    rebuild, args = shared
    arguments = inspect.signature(rebuild).bind(*args).arguments
    arguments["storage_device"] = device.index
    return rebuild(**arguments)


def _addresses(pointers, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(pointers), dtype=torch.int64, device=device)
