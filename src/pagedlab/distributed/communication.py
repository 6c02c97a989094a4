"""Collectives over the tensor-parallel group. At world size 1 each one returns its input
untouched, without a ``torch.distributed`` call, so TP=1 runs the code of a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedlab.distributed.parallel_state import get_peer_all_reduce, get_tp_group, get_tp_world_size


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, computed in place in ``x``: small messages through the
    one-shot kernel over peer memory when it is set up, the rest through the process group."""
    group = get_tp_group()
    if group is None:
        return x
    peer = get_peer_all_reduce()
    if peer is not None and peer.can_reduce(x):
        return peer.all_reduce(x)
    dist.all_reduce(x, group=group)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order."""
    group = get_tp_group()
    if group is None:
        return x
    world_size = get_tp_world_size()
    # rank after rank along dim 0: the one output layout gloo accepts as well as NCCL
    gathered = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
    return torch.cat(gathered.chunk(world_size), dim=dim)


def tensor_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``x`` as rank ``src`` holds it, on every rank (in place)."""
    group = get_tp_group()
    if group is not None:
        dist.broadcast(x, src=src, group=group)
    return x


def tensor_parallel_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value`` (e.g. the KV blocks each rank's memory holds)."""
    if get_tp_group() is None:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=get_tp_group())
    return int(tensor.item())
