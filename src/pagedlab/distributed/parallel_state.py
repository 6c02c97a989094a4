"""The one process-group state of tensor parallelism: which rank of how many this process is.

Every process of a tensor-parallel model calls ``init_tensor_parallel(world_size, rank, ...)``
before it builds the model: the parallel layers read ``get_tp_rank()``/``get_tp_world_size()``
when they are constructed, and ``pagedlab.distributed.communication`` reads the group when they
run. Without it (or with ``world_size=1``) a process is the only rank and no process group
exists, so TP=1 makes no ``torch.distributed`` call at all. The tensor-parallel group is the
default (world) group: tensor parallelism is the only kind of parallelism pagedlab has.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedlab.distributed.peer_all_reduce import PeerAllReduce

# NVLink multicast (NVLS) must stay off on the H200 hosts: set before NCCL builds a communicator.
_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                  "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class TensorParallelState:
    """This process's place among the tensor-parallel ranks; ``group`` is None at world size 1."""

    world_size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    peer_all_reduce: PeerAllReduce | None = None  # the one-shot all-reduce of small messages


_STATE = TensorParallelState()


def init_tensor_parallel(world_size: int = 1, rank: int = 0, backend: str = "gloo",
                         init_method: str = "env://", timeout: timedelta | None = None,
                         store: dist.Store | None = None) -> None:
    """Join the tensor-parallel group as ``rank`` of ``world_size`` processes.

    ``backend`` is "gloo" for CPU tensors and "nccl" for CUDA ones (then call
    ``torch.cuda.set_device`` for this rank's GPU first); ``init_method`` is where the ranks meet
    ("tcp://host:port", "file:///path" or "env://"), unless they share a ``store`` already;
    ``timeout`` bounds every collective.
    """
    global _STATE
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank={rank} of world_size={world_size} is invalid: "
                         "world_size must be >= 1 and 0 <= rank < world_size")
    if _STATE.group is not None:
        raise RuntimeError(f"tensor parallelism is already initialised (rank {_STATE.rank} of "
                           f"{_STATE.world_size}): call destroy_tensor_parallel() first")
    if world_size == 1:
        _STATE = TensorParallelState()
        return
    for name, value in _MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    kwargs = {} if timeout is None else {"timeout": timeout}
    kwargs.update({"init_method": init_method} if store is None else {"store": store})
    dist.init_process_group(backend, world_size=world_size, rank=rank, **kwargs)
    _STATE = TensorParallelState(world_size, rank, dist.group.WORLD)


def enable_peer_all_reduce(peer: PeerAllReduce) -> None:
    """Route this group's small all-reduces through the one-shot kernel over ``peer``'s memory
    (``PeerAllReduce.from_cuda_ipc(get_tp_group(), device)`` on CUDA)."""
    global _STATE
    if _STATE.group is None or peer.world_size != _STATE.world_size or peer.rank != _STATE.rank:
        raise ValueError(f"a one-shot all-reduce of rank {peer.rank} of {peer.world_size} does not fit "
                         f"tensor-parallel rank {_STATE.rank} of {_STATE.world_size}")
    _STATE = replace(_STATE, peer_all_reduce=peer)


def destroy_tensor_parallel() -> None:
    """Leave the tensor-parallel group (if any); the process is a single rank again."""
    global _STATE
    group = _STATE.group
    _STATE = TensorParallelState()  # the peer buffers go before the group they were exchanged over
    if group is not None:
        dist.destroy_process_group()


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's ``vllm.distributed.cleanup_dist_env_and_memory``: after ``del llm`` (an LLM dropped
    without ``close()``), leave its tensor-parallel group and free what it held, so that a new
    ``LLM`` can start in this process; ``shutdown_ray`` stops Ray too, where it runs."""
    destroy_tensor_parallel()
    ray = sys.modules.get("ray")  # never imported: nothing of Ray to stop
    if shutdown_ray and ray is not None:
        ray.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def get_tp_rank() -> int:
    """This process's tensor-parallel rank (0 without tensor parallelism)."""
    return _STATE.rank


def get_tp_world_size() -> int:
    """How many ranks shard the model (1 without tensor parallelism)."""
    return _STATE.world_size


def get_tp_group() -> dist.ProcessGroup | None:
    """The tensor-parallel process group; None at world size 1."""
    return _STATE.group


def get_peer_all_reduce() -> PeerAllReduce | None:
    """The one-shot all-reduce of this group, if ``enable_peer_all_reduce`` set it up."""
    return _STATE.peer_all_reduce
