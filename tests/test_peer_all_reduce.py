"""The one-shot all-reduce over peer memory against the process group's own all-reduce.

On the CPU, peer memory is POSIX shared memory mapped into two or three gloo processes and the
kernel runs under the Triton interpreter: the same kernel, barrier and rank-order sum as on
GPUs, checked against gloo's sum. On two GPUs (``pytest -m gpu``) it runs over CUDA IPC
mappings against NCCL, eagerly and replayed in a CUDA graph."""

from __future__ import annotations

import os
import random
import socket
import time
from multiprocessing import shared_memory

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedlab.distributed.peer_all_reduce import PeerAllReduce, buffer_bytes, pad_flags

MAX_BYTES = 1 << 15


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_peer_all_reduce(rank: int, world_size: int, names: list[str]):
    """A PeerAllReduce over shared-memory segments (one buffer and pad per rank)."""
    segments = [shared_memory.SharedMemory(name=name) for name in names]
    views = [torch.frombuffer(segment.buf, dtype=torch.uint8) for segment in segments]
    buffers = torch.tensor([view.data_ptr() for view in views])
    peer = PeerAllReduce(rank, world_size, buffers, buffers + buffer_bytes(world_size, MAX_BYTES), MAX_BYTES,
                         keepalive=(segments, views))
    return peer, segments


def _cpu_rank(rank: int, world_size: int, port: int, names: list[str]) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    peer, segments = _host_peer_all_reduce(rank, world_size, names)
    skew = random.Random(rank)
    try:
        for dtype in (torch.float32, torch.float16):
            for numel in (1, 7, 1024, 1500, 5000):
                x = torch.randn(numel, generator=torch.Generator().manual_seed(97 * rank + numel)).to(dtype)
                gathered = [torch.empty_like(x) for _ in range(world_size)]
                dist.all_gather(gathered, x)
                expected = x.clone()
                dist.all_reduce(expected)
                assert peer.can_reduce(x)
                time.sleep(skew.uniform(0, 0.05))  # ranks arrive out of step
                got = peer.all_reduce(x.clone())
                # the reference's rank-order float32 sum, bitwise; gloo's own sum, to its rounding
                torch.testing.assert_close(got, _reference(gathered), rtol=0, atol=0)
                torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
                same = [torch.empty_like(got) for _ in range(world_size)]
                dist.all_gather(same, got)
                assert all(torch.equal(s, got) for s in same), "ranks disagree on the sum"
    finally:
        dist.destroy_process_group()
        for segment in segments:
            segment.close()


def _reference(gathered):
    from pagedlab.kernels.all_reduce import one_shot_all_reduce_reference

    return one_shot_all_reduce_reference(gathered)


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_shot_all_reduce_equals_the_gloo_sum(world_size):
    size = buffer_bytes(world_size, MAX_BYTES) + 4 * pad_flags(world_size)
    segments = [shared_memory.SharedMemory(create=True, size=size) for _ in range(world_size)]
    try:
        for segment in segments:
            segment.buf[:] = bytes(len(segment.buf))  # signal pads start at zero
        mp.spawn(_cpu_rank, args=(world_size, _free_port(), [s.name for s in segments]), nprocs=world_size)
    finally:
        for segment in segments:
            segment.close()
            segment.unlink()


def test_messages_the_one_shot_kernel_does_not_take_go_to_the_process_group():
    empty = torch.zeros(2, dtype=torch.int64)
    peer = PeerAllReduce(0, 2, empty, empty, max_bytes=4096)
    assert peer.can_reduce(torch.zeros(1024))  # 4096 bytes
    assert not peer.can_reduce(torch.zeros(1025))
    assert not peer.can_reduce(torch.zeros(8, dtype=torch.int32))
    assert not peer.can_reduce(torch.zeros(8, 8).t())  # not contiguous


def _gpu_rank(rank: int, world_size: int, port: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank))
    peer = PeerAllReduce.from_cuda_ipc(dist.group.WORLD, torch.device("cuda", rank))
    try:
        for dtype in (torch.bfloat16, torch.float32):
            largest = peer.max_bytes // torch.finfo(dtype).bits * 8
            for numel in (1, 4096, 8 * 4096, 48 * 4096 + 5, largest):
                generator = torch.Generator("cuda").manual_seed(rank + numel)
                x = torch.randn(numel, device="cuda", generator=generator).to(dtype)
                expected = x.clone()
                dist.all_reduce(expected)
                torch.testing.assert_close(peer.all_reduce(x.clone()), expected, rtol=0, atol=0)
        _check_in_cuda_graph(peer, rank)
    finally:
        dist.destroy_process_group()


def _check_in_cuda_graph(peer: PeerAllReduce, rank: int) -> None:
    """Captured once, replayed on new inputs: each replay gives NCCL's sum of those inputs."""
    static = torch.zeros(3 * 4096, device="cuda", dtype=torch.bfloat16)
    peer.all_reduce(static)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):  # consecutive reductions reuse the buffers and flags
            peer.all_reduce(static)
    for step in range(5):
        fresh = torch.randn(static.shape, device="cuda",
                            generator=torch.Generator("cuda").manual_seed(10 * rank + step)).to(static.dtype)
        expected = fresh.clone()
        for _ in range(4):
            dist.all_reduce(expected)
        static.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(static, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_shot_all_reduce_equals_nccl_eager_and_in_a_cuda_graph():
    mp.spawn(_gpu_rank, args=(2, _free_port()), nprocs=2)
