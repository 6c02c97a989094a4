"""Latency of one all-reduce on the GPUs of one host: NCCL against pagedlab's one-shot kernel
over peer memory, eager and replayed in a CUDA graph, over message sizes from a decode step's
few kilobytes to a prefill's megabytes.

    PYTHONPATH=src python3 benchmarks/all_reduce_bench.py --world-size 2 --out all_reduce.json

Each figure is the mean over ``--iters`` back-to-back all-reduces (in a graph: ``--iters``
captured once and replayed). The one-shot kernel is checked against NCCL at every size.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_BYTES = [2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]


def _time_eager(fn, x: torch.Tensor, iters: int) -> float:
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _time_graph(fn, x: torch.Tensor, iters: int) -> float:
    fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _rank(rank: int, world_size: int, port: int, iters: int, out: str) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    from pagedlab.distributed.peer_all_reduce import PeerAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            device_id=device)
    peer = PeerAllReduce.from_cuda_ipc(dist.group.WORLD, device, max_bytes=max(SIZES_BYTES))

    def nccl(t: torch.Tensor) -> None:
        dist.all_reduce(t)

    rows = []
    for nbytes in SIZES_BYTES:
        generator = torch.Generator(device).manual_seed(rank)
        x = torch.randn(nbytes // 2, device=device, generator=generator).bfloat16()
        expected = x.clone()
        dist.all_reduce(expected)
        assert torch.equal(peer.all_reduce(x.clone()), expected), f"one-shot != NCCL at {nbytes} bytes"
        row = {"bytes": nbytes}
        for name, fn in (("nccl", nccl), ("one_shot", peer.all_reduce)):
            row[f"{name}_eager_us"] = _time_eager(fn, x.clone(), iters)
            row[f"{name}_graph_us"] = _time_graph(fn, x.clone(), iters)
        rows.append(row)
    if rank == 0:
        print(f"{'bytes':>9} | {'NCCL eager':>10} {'NCCL graph':>10} | "
              f"{'1-shot eager':>12} {'1-shot graph':>12}")
        for r in rows:
            print(f"{r['bytes']:>9} | {r['nccl_eager_us']:>8.1f}us {r['nccl_graph_us']:>8.1f}us | "
                  f"{r['one_shot_eager_us']:>10.1f}us {r['one_shot_graph_us']:>10.1f}us")
        if out:
            with open(out, "w") as f:
                json.dump({"world_size": world_size, "gpu": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args.world_size, port, args.iters, args.out), nprocs=args.world_size)


if __name__ == "__main__":
    main()
