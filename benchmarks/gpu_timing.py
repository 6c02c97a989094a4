"""GPU timing shared by the kernel benches: a kernel's seconds as CUDA-graph replays, with its
operands read from HBM and no launch gaps (``graph_seconds``: an L2 flush before each call;
``decode_seconds``: the weights' copies in turn, as a decode step calls each layer's own), and
a sweep's Triton configs compiled in parallel before they are timed (``precompile``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

PEAK_BYTES_PER_S = 4.8e12
# decode_seconds: at least this many calls in a graph, and at most this many bytes of weight
# copies a measurement (two copies of Gemma-2-9B's LM head, the largest weight benched: 3.4 GiB).
MIN_GRAPH_CALLS = 32
COPY_CAP_BYTES = 4 << 30


def graph_seconds(fn, calls: int = 16) -> float:
    """Seconds one ``fn()`` takes on the GPU in a CUDA graph: ``calls`` of it captured in one
    graph, each after a write of 64 MiB (more than the H200's 50 MB L2, so its inputs come from
    HBM), less the same graph without ``fn``. A graph has no launch gaps, which a timing of eager
    calls adds to every small kernel. The linear layers' tables use ``decode_seconds`` instead:
    on an H200 this timing put Llama-3-8B's batch-1 linears 22-28% above their time in
    ``pdl_probe.py``'s chain of decode-step linears and picked split-K tiles that lost there."""
    flush = torch.empty(64 << 20, dtype=torch.int8, device="cuda")

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                flush.zero_()
                if with_fn:
                    fn()
        return graph
    return max(replay_seconds(capture(True)) - replay_seconds(capture(False)), 1e-9) / calls


def precompile(module, kernel_names: tuple[str, ...], calls) -> None:
    """Run every one of ``calls`` with the Triton kernels ``kernel_names`` of ``module`` only
    compiled, not launched (each becomes its ``warmup``), on a thread pool (Triton's
    ``AsyncCompileMode``): a sweep's candidates compile in parallel before it times them. Other
    kernels the calls launch run as usual; a config that fails is left to fail when measured."""
    import triton

    kernels = {name: getattr(module, name) for name in kernel_names}

    class Warmup:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)
    try:
        for name, kernel in kernels.items():
            setattr(module, name, Warmup(kernel))
        with (ThreadPoolExecutor(max(4, os.cpu_count() or 1)) as pool,
              triton.AsyncCompileMode(pool, ignore_errors=True)):
            for call in calls:
                call()
    except Exception as e:  # e.g. a Triton without AsyncCompileMode: each config compiles as it first runs
        print(f"  (no parallel compile: {type(e).__name__}: {e})")
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)


def replay_seconds(graph: torch.cuda.CUDAGraph, repeats: int = 5) -> float:
    """The median seconds of ``repeats`` replays of ``graph``, after one untimed replay."""
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return sorted(times)[repeats // 2]


def operand_copies(copy_bytes: int, l2_bytes: int, cap_bytes: int = COPY_CAP_BYTES) -> int:
    """How many copies of a call's weights (``copy_bytes`` a copy) ``decode_seconds`` cycles
    through: the fewest, and at least two, whose total exceeds twice the L2, so that between two
    reads of one copy the others stream more than the L2 holds and every read comes from HBM.
    Where that total would pass ``cap_bytes``: one copy, if it alone exceeds twice the L2."""
    if copy_bytes < 1 or l2_bytes < 1 or cap_bytes < 1:
        raise ValueError(f"copy_bytes={copy_bytes}, l2_bytes={l2_bytes} and cap_bytes={cap_bytes} "
                         "must be positive")
    copies = max(2, 2 * l2_bytes // copy_bytes + 1)
    if copies * copy_bytes <= cap_bytes:
        return copies
    if 2 * l2_bytes < copy_bytes <= cap_bytes:
        return 1
    raise ValueError(f"copies of {copy_bytes} bytes totalling over twice the L2 ({2 * l2_bytes} bytes) do "
                     f"not fit in the cap of {cap_bytes} bytes a measurement")


def graph_calls(copies: int, min_calls: int = MIN_GRAPH_CALLS) -> int:
    """Calls in ``decode_seconds``'s graph: whole rounds over the copies, at least ``min_calls``."""
    if copies < 1 or min_calls < 1:
        raise ValueError(f"copies={copies} and min_calls={min_calls} must be >= 1")
    return copies * -(-min_calls // copies)


def operand_sets(operands: tuple[torch.Tensor, ...], l2_bytes: int,
                 cap_bytes: int = COPY_CAP_BYTES) -> list[tuple[torch.Tensor, ...]]:
    """``operands`` (a call's weights and scales) and ``operand_copies - 1`` clones of them, each
    in its own memory: the sets ``decode_seconds`` calls in turn."""
    copy_bytes = sum(t.numel() * t.element_size() for t in operands)
    copies = operand_copies(copy_bytes, l2_bytes, cap_bytes)
    return [tuple(operands)] + [tuple(t.clone() for t in operands) for _ in range(copies - 1)]


def decode_seconds(fn, operands: tuple[torch.Tensor, ...], min_calls: int = MIN_GRAPH_CALLS,
                   cap_bytes: int = COPY_CAP_BYTES) -> float:
    """Seconds one ``fn(*operands)`` takes as a decode step's CUDA graph runs it, where each layer
    reads its own weights from HBM and nothing else writes between the linears: one graph calls
    ``fn`` on each of ``operand_sets`` (copies of the weights, together over twice the GPU's L2)
    in turn, ``graph_calls`` calls, with no flush; the replay's time over the calls. ``fn`` must
    have run once eagerly (Triton compiles, the split-K counters are made)."""
    sets = operand_sets(operands, torch.cuda.get_device_properties(operands[0].device).L2_cache_size,
                        cap_bytes)
    calls = graph_calls(len(sets), min_calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(calls):
            fn(*sets[call % len(sets)])
    return replay_seconds(graph) / calls
