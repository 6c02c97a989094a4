"""Probe: can a persistent and/or TMA Triton matmul keep the batch-invariant matmul's reduction order
and close its prefill gap to cuBLAS (issue 14)?

``kernels/batch_invariant.py``'s ``_fixed_tile_matmul_kernel`` fixes each output's sum per weight
shape: ``block_k`` K steps chained through ``tl.dot``'s accumulator, cut into ``split_k`` segments,
each summed from zero, the segments added in order into a second fp32 tile (``total``). The
candidates here compute that same sum, so they can be bitwise equal to it:

- ``ptr``/``tma``: operands through pointer loads, or through device-side tensor descriptors (TMA,
  Hopper; ``tl.make_tensor_descriptor``, scratch from ``triton.set_allocator``);
- ``persistent``: one program per SM looping over the output tiles in the same grouped order
  (``per-tile``: one program per tile, as the current kernel);
- one segment (``split_k`` 1, gate_up) never holds ``total``: the current kernel keeps both fp32
  tiles live over the K loop (256 registers a thread at 128x256 with 8 warps);
- ``scratch``: with segments, ``total`` waits in a per-program fp32 tile in global memory (L2)
  instead of registers.

For each weight (Llama-3-8B's qkv, o, gate_up, down; bf16) and row count it times, as CUDA-graph
replays (``gemv_bench.graph_seconds``), cuBLAS (``F.linear``), the current kernel with the table's
config (``fixed_tile_matmul_triton``, dispatched) and each candidate with the table's ``block_k``
and ``split_k``, and checks the candidate's output is bitwise equal (``torch.equal``) to the
current kernel's on the same input, and that its rows computed from 1, 8 and 256 rows of input
equal the same rows of the full batch. Each (shape, rows) runs in a child process (``--one``,
``child_runs``): a candidate that kills its CUDA context or hangs loses itself only (an error
record; a new child goes on from the next), and every error keeps its whole message. Past
``--budget-s`` seconds the rest are skipped (and listed); ``--shapes``/``--rows`` pick a subset.
The summary gives per shape the fastest candidate that is bitwise equal and row-invariant, and
per row count the sum over the four shapes (one layer's linears).

    PYTHONPATH=src:benchmarks python3 benchmarks/invariant_gemm_probe.py --out probe.json
    PYTHONPATH=src:benchmarks python3 benchmarks/invariant_gemm_probe.py --quick   # gate_up, 8,192 rows
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/invariant_gemm_probe.py --cpu-check

``--cpu-check`` runs every variant under the Triton interpreter at tiny sizes (float32 and float16)
against the current kernel (bitwise) and torch (close), no GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from child_runs import emit, run_resumable
from pagedlab.kernels.batch_invariant import fixed_tile_matmul_torch, fixed_tile_matmul_triton
from pagedlab.kernels.gemv import dot_settings, k_segments, num_sms
from pagedlab.kernels.gemv_configs import TileConfig, batch_invariant_config

# (name, N, K) of Llama-3-8B's linears, gate_up first: the largest gap.
SHAPES = (("gate_up", 28672, 4096), ("qkv", 6144, 4096), ("down", 4096, 14336), ("o", 4096, 4096))
ROWS = (8192, 1024)
# Row counts whose outputs must equal the same rows of the full batch.
INVARIANCE_ROWS = (1, 8, 256)
GROUP_M = 8  # as the current kernel: the grouped tile order is part of neither sum, only of L2 reuse


@dataclass(frozen=True)
class Candidate:
    """One kernel variant and launch; ``block_k``/``split_k`` come from the table."""

    tma: bool
    persistent: bool
    scratch_total: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        kind = ("tma" if self.tma else "ptr") + ("-persistent" if self.persistent else "-per-tile")
        kind += "-scratch" if self.scratch_total else ""
        return f"{kind} {self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


# A handful per shape, the likeliest first (each new one compiles: a few seconds; the budget may
# cut the tail). Pointer loads one program per tile run only for one segment (else it is the
# current kernel); scratch totals only for more.
GPU_CANDIDATES = (
    Candidate(False, False, False, 256, 128, 8, 3),  # the 8,192-row gate_up launch minus `total`
    Candidate(True, True, False, 128, 256, 8, 3),
    Candidate(True, True, True, 128, 256, 8, 3),
    Candidate(True, True, False, 128, 128, 8, 4),
    Candidate(False, True, False, 128, 256, 8, 3),
    Candidate(True, True, False, 128, 256, 8, 4),
    Candidate(True, True, False, 256, 128, 8, 3),
    Candidate(True, True, True, 256, 128, 8, 3),
    Candidate(True, True, False, 128, 128, 8, 5),
    Candidate(True, False, False, 128, 256, 8, 3),
)


@triton.jit
def _segment_sum(x_ptr, w_ptr, x_desc, w_desc, first_row, first_col, M, N, k_begin, k_end, stride_x, stride_w,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BROADCAST_DOT: tl.constexpr):
    """One K segment's sum from zero, ``tl.dot`` chained in K order (the current kernel's loop).
    TMA fills rows past M or N with zeros, as the pointer loads' masks do."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_m = first_row + tl.arange(0, BLOCK_M)
    offs_n = first_col + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    for k_start in range(k_begin, k_end, BLOCK_K):
        if USE_TMA:
            x = x_desc.load([first_row, k_start])
            w = w_desc.load([first_col, k_start])
        else:
            offs_k = k_start + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + offs_k[None, :], mask=(offs_m < M)[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=(offs_n < N)[:, None], other=0.0)
        if BROADCAST_DOT:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        else:
            acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["M", "num_segments"])
def _probe_matmul_kernel(x_ptr, w_ptr, out_ptr, scratch_ptr, M, N, K, K_PER_SEGMENT, num_segments,
                         stride_x, stride_w, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP: tl.constexpr, ONE_SEGMENT: tl.constexpr,
                         USE_TMA: tl.constexpr, SCRATCH_TOTAL: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, BROADCAST_DOT: tl.constexpr):
    """Programs loop over the output tiles (grouped as the current kernel's grid; one tile each
    when there are as many programs as tiles). A tile's output is ``((0 + s0) + s1) + ...`` of
    its segment sums, as the current kernel's: ONE_SEGMENT stores ``s0`` (equal up to the sign of
    a zero), SCRATCH_TOTAL keeps the running sum in this program's fp32 scratch tile."""
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP * num_n_tiles
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_x, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_w, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        x_desc = x_ptr
        w_desc = w_ptr
    scratch = (scratch_ptr + tl.program_id(0).to(tl.int64) * (BLOCK_M * BLOCK_N)
               + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
    for tile in range(tl.program_id(0), num_m_tiles * num_n_tiles, tl.num_programs(0)):
        first_m = (tile // tiles_per_group) * GROUP
        group_rows = tl.minimum(num_m_tiles - first_m, GROUP)
        first_row = (first_m + (tile % tiles_per_group) % group_rows) * BLOCK_M
        first_col = ((tile % tiles_per_group) // group_rows) * BLOCK_N
        offs_m = first_row + tl.arange(0, BLOCK_M)
        offs_n = first_col + tl.arange(0, BLOCK_N)
        out_tile = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
        out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        if ONE_SEGMENT:
            acc = _segment_sum(x_ptr, w_ptr, x_desc, w_desc, first_row, first_col, M, N, 0, K, stride_x,
                               stride_w, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, DOT_DTYPE, DOT_PRECISION,
                               BROADCAST_DOT)
            tl.store(out_tile, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        elif SCRATCH_TOTAL:
            for segment in range(0, num_segments):
                k_begin = segment * K_PER_SEGMENT
                acc = _segment_sum(x_ptr, w_ptr, x_desc, w_desc, first_row, first_col, M, N, k_begin,
                                   tl.minimum(k_begin + K_PER_SEGMENT, K), stride_x, stride_w, BLOCK_M,
                                   BLOCK_N, BLOCK_K, USE_TMA, DOT_DTYPE, DOT_PRECISION, BROADCAST_DOT)
                if segment > 0:
                    acc = tl.load(scratch) + acc
                    # every thread has read the tile before any overwrites it (other layouts)
                    tl.debug_barrier()
                if segment < num_segments - 1:
                    tl.store(scratch, acc)
                    tl.debug_barrier()  # the next segment's load sees every thread's store
                else:
                    tl.store(out_tile, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for segment in range(0, num_segments):
                k_begin = segment * K_PER_SEGMENT
                total += _segment_sum(x_ptr, w_ptr, x_desc, w_desc, first_row, first_col, M, N, k_begin,
                                      tl.minimum(k_begin + K_PER_SEGMENT, K), stride_x, stride_w, BLOCK_M,
                                      BLOCK_N, BLOCK_K, USE_TMA, DOT_DTYPE, DOT_PRECISION, BROADCAST_DOT)
            tl.store(out_tile, total.to(out_ptr.dtype.element_ty), mask=out_mask)


def probe_matmul(x: torch.Tensor, weight: torch.Tensor, candidate: Candidate, block_k: int, split_k: int,
                 max_programs: int | None = None) -> torch.Tensor:
    """``x @ weight.T`` (2-D, contiguous) by ``candidate`` with the current kernel's sum for
    ``block_k`` and ``split_k`` (``k_segments``); a persistent launch runs
    ``max_programs`` (default: the SM count) programs at most."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if in_features % block_k:
        raise ValueError(f"K={in_features} is not a multiple of block_k={block_k}: the probe needs whole "
                         "K steps")
    if candidate.scratch_total and not candidate.persistent:
        raise ValueError(f"{candidate.name}: a scratch total needs the persistent launch (one scratch tile "
                         "per program)")
    k_per_segment, segments = k_segments(in_features, block_k, split_k)
    tiles = triton.cdiv(rows, candidate.block_m) * triton.cdiv(out_features, candidate.block_n)
    programs = min(tiles, max_programs or num_sms(x.device)) if candidate.persistent else tiles
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    scratch = out
    if candidate.scratch_total and segments > 1:
        scratch = torch.empty(programs, candidate.block_m * candidate.block_n, dtype=torch.float32,
                              device=x.device)
    _probe_matmul_kernel[(programs,)](
        x, weight, out, scratch, rows, out_features, in_features, k_per_segment, segments, x.stride(0),
        weight.stride(0), out.stride(0), BLOCK_M=candidate.block_m, BLOCK_N=candidate.block_n,
        BLOCK_K=block_k, GROUP=GROUP_M, ONE_SEGMENT=segments == 1, USE_TMA=candidate.tma,
        SCRATCH_TOTAL=candidate.scratch_total, BROADCAST_DOT=x.device.type == "cpu", **dot_settings(x),
        num_warps=candidate.num_warps, num_stages=candidate.num_stages)
    return out


def row_invariance(run, x: torch.Tensor, full: torch.Tensor) -> dict[int, bool]:
    """Per row count r of INVARIANCE_ROWS (at most x's): whether ``run(x[:r])`` equals ``full[:r]``."""
    return {r: torch.equal(run(x[:r].contiguous()), full[:r]) for r in INVARIANCE_ROWS if r <= x.shape[0]}


# Tiny cases of --cpu-check: every variant, partial tiles, and fewer programs than tiles.
CPU_CANDIDATES = (
    Candidate(False, False, False, 16, 32, 4, 2), Candidate(False, True, False, 32, 16, 4, 2),
    Candidate(False, True, True, 16, 32, 4, 2), Candidate(True, False, False, 16, 32, 4, 2),
    Candidate(True, True, False, 32, 16, 4, 2), Candidate(True, True, True, 16, 32, 4, 2),
)


def use_torch_allocator(device: str) -> None:
    """Give Triton torch memory for the tensor descriptors' scratch (TMA candidates)."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))


def cpu_check(candidates=CPU_CANDIDATES, max_programs: int = 4) -> list[dict]:
    """Each candidate under the interpreter (float32, float16; 1 and 3 K segments) against the
    current kernel with the same block_k/split_k (bitwise) and torch (max error), and its row
    invariance. ``max_programs`` caps the persistent grid so that programs loop over tiles."""
    use_torch_allocator("cpu")
    generator = torch.Generator().manual_seed(0)
    results = []
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(40, 112, generator=generator).to(dtype)
        weight = (torch.randn(80, 112, generator=generator) / 8).to(dtype)
        expected = fixed_tile_matmul_torch(x, weight).float()
        for split_k in (1, 3):  # 7 K steps of 16: one segment, or segments of 3, 3 and 1 steps
            config = TileConfig(block_n=32, block_k=16, split_k=split_k, block_m=16, num_stages=2)
            reference = fixed_tile_matmul_triton(x, weight, config=config, split_across_programs=False)
            for candidate in candidates:
                record = dict(kernel=candidate.name, dtype=str(dtype), split_k=split_k)
                record.update(_cpu_case(x, weight, candidate, split_k, reference, expected, max_programs))
                results.append(record)
                print(record, flush=True)
    return results


def _cpu_case(x, weight, candidate: Candidate, split_k: int, reference, expected, max_programs: int) -> dict:
    """One --cpu-check case's checks, or the error it raised."""
    def run(rows):
        return probe_matmul(rows, weight, candidate, 16, split_k, max_programs)
    try:
        out = run(x)
        max_error = (out.float() - expected).abs().max().item()
        return dict(bitwise_vs_table=torch.equal(out, reference), max_error=max_error,
                    row_invariant=row_invariance(run, x, out))
    except Exception as error:  # one variant failing must not stop the check
        return dict(error=error_text(error))


def error_text(error: BaseException, limit: int = 4000) -> str:
    """The exception's type and whole message (a CUDA error's first line names it; a compile
    error's last line), then those of the exceptions it was raised from or while handling (a
    failed CUDA graph capture's end reports the capture's first error that way), each cut to its
    beginning and end past ``limit`` characters."""
    parts: list[str] = []
    link = ""
    while error is not None and len(parts) < 4:
        text = f"{link}{type(error).__name__}: {str(error).strip()}"
        parts.append(text if len(text) <= limit else f"{text[:limit // 2]}\n[...]\n{text[-limit // 2:]}")
        link = "raised from " if error.__cause__ else "raised while handling "
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return "\n  ".join(parts)


class Probe:
    """The GPU run of one process: records, progress lines against the clock (from ``start``,
    epoch seconds: the parent's) and the budget. ``seconds(fn, calls)`` times a call (default:
    ``gemv_bench.graph_seconds``; the CPU test passes its own); ``emit`` (a child's
    ``child_runs.emit``) reports each record and each candidate begun to the parent."""

    def __init__(self, budget_s: float, device: str = "cuda", seconds=None, start: float | None = None,
                 emit=None):
        if seconds is None:
            from gemv_bench import graph_seconds as seconds  # benchmarks/ is on the path for the GPU run
        self.seconds = seconds
        self.device = torch.device(device)
        self.start = time.time() if start is None else start
        self.budget_s = budget_s
        self.emit = emit
        self.records: list[dict] = []
        self.sms = num_sms(self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def log(self, text: str) -> None:
        print(f"[{time.time() - self.start:6.1f}s] {text}", flush=True)

    def timed(self, record: dict, fn, flops: float, cublas_s: float | None) -> None:
        """Add ``fn``'s graph-replay time to ``record`` (fewer calls per graph for big GEMMs). One
        eager call first: cuBLAS creates its handle and workspace at its first call, which inside
        a graph capture fails (CUBLAS_STATUS_NOT_INITIALIZED, then the capture's end), and Triton
        compiles there."""
        fn()
        self.synchronize()
        seconds = self.seconds(fn, calls=4 if flops > 1e12 else 16)
        record.update(us=seconds * 1e6, tflops=flops / seconds / 1e12,
                      vs_cublas=seconds / cublas_s if cublas_s else 1.0)

    def inputs(self, n: int, k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 activations and weight, the same in every process for the same shape."""
        generator = torch.Generator(device=self.device).manual_seed(rows + n + k)
        x = torch.randn(rows, k, device=self.device, generator=generator).to(torch.bfloat16)
        weight = (torch.randn(n, k, device=self.device, generator=generator) / k ** 0.5).to(torch.bfloat16)
        return x, weight

    def baselines(self, base: dict, x, weight, config: TileConfig, flops: float) -> float:
        """Time cuBLAS and the current kernel (dispatched: the table's config); cuBLAS's us."""
        cublas = dict(base, kernel="cublas")
        self.timed(cublas, lambda: F.linear(x, weight), flops, None)
        self.add(cublas)
        table = dict(base, kernel="table", config=asdict(config))
        started = time.time()
        fixed_tile_matmul_triton(x, weight)
        self.synchronize()
        table["first_call_s"] = time.time() - started
        self.timed(table, lambda: fixed_tile_matmul_triton(x, weight), flops, cublas["us"] * 1e-6)
        self.add(table)
        return cublas["us"]

    def shape(self, name: str, n: int, k: int, rows: int, candidates, first: int = 0,
              cublas_us: float | None = None) -> bool:
        """cuBLAS, the current kernel and ``candidates[first:]``; with ``cublas_us`` (a resumed
        run) cuBLAS and the current kernel are not timed again. False when a candidate's error
        left the CUDA context unusable: the rest need a fresh process."""
        x, weight = self.inputs(n, k, rows)
        flops = 2.0 * rows * n * k
        base = dict(shape=name, n=n, k=k, rows=rows)
        config = batch_invariant_config(rows, n, k, self.sms)
        if cublas_us is None:
            cublas_us = self.baselines(base, x, weight, config, flops)
        table_out = fixed_tile_matmul_triton(x, weight)
        segments = k_segments(k, config.block_k, config.split_k)[1]
        for index, candidate in enumerate(candidates):
            if index < first or (candidate.scratch_total and segments == 1):
                continue  # done by an earlier process; or the same kernel as without: no total to keep
            if not candidate.tma and not candidate.persistent and segments > 1:
                continue  # the current kernel itself
            record = dict(base, kernel=candidate.name, index=index, candidate=asdict(candidate),
                          block_k=config.block_k, split_k=config.split_k)
            if time.time() - self.start > self.budget_s:
                record["skipped"] = f"over the {self.budget_s:.0f} s budget"
            else:
                if self.emit:
                    self.emit("begin", record=record)
                self.candidate(record, candidate, x, weight, config, table_out, flops, cublas_us * 1e-6)
            self.add(record)
            if "error" in record and not self.context_usable():
                return False
        return True

    def context_usable(self) -> bool:
        """Whether this process can still run and capture CUDA work after an error."""
        if self.device.type != "cuda":
            return True
        try:
            value = torch.zeros(1, device=self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                value.add_(1)
            graph.replay()
            return value.item() == 1.0
        except Exception as error:
            self.log(f"CUDA context unusable: {error_text(error)}")
            return False

    def candidate(self, record: dict, candidate: Candidate, x, weight, config: TileConfig, table_out,
                  flops: float, cublas_s: float) -> None:
        """Compile and check ``candidate`` against the current kernel's output, then time it."""
        def run(rows):
            return probe_matmul(rows, weight, candidate, config.block_k, config.split_k)
        try:
            started = time.time()
            out = run(x)
            self.synchronize()
            record["first_call_s"] = time.time() - started
            record["bitwise_vs_table"] = torch.equal(out, table_out)
            record["max_abs_diff_vs_table"] = (out.float() - table_out.float()).abs().max().item()
            record["row_invariant"] = row_invariance(run, x, out)
            del out
            self.timed(record, lambda: run(x), flops, cublas_s)
        except Exception as error:  # one failing compile or launch must not stop the run
            record["error"] = error_text(error)

    def add(self, record: dict) -> None:
        self.records.append(record)
        log_record(record, self.log)
        if self.emit:
            self.emit("record", record=record)


def log_record(record: dict, log) -> None:
    """One progress line for ``record``."""
    where = f"{record['shape']} {record['rows']} {record['kernel']}"
    if "error" in record or "skipped" in record:
        log(f"{where}: {record.get('error') or record['skipped']}")
        return
    checks = ""
    if "bitwise_vs_table" in record:
        rows_ok = ",".join(f"{r}:{'ok' if ok else 'DIFF'}" for r, ok in record["row_invariant"].items())
        checks = (f" bitwise={'yes' if record['bitwise_vs_table'] else 'NO'}"
                  f" (max diff {record['max_abs_diff_vs_table']:.3g}) rows {rows_ok}")
    first = f" first call {record['first_call_s']:.1f}s" if "first_call_s" in record else ""
    log(f"{where}: {record['us']:9.1f} us {record['tflops']:6.1f} TFLOP/s "
        f"{record['vs_cublas']:.2f}x cuBLAS{checks}{first}")


def valid(record: dict) -> bool:
    """A timed candidate whose output is bitwise the current kernel's and whose rows are invariant."""
    return ("us" in record and record.get("bitwise_vs_table", False)
            and all(record.get("row_invariant", {False: False}).values()))


def summarize(records: list[dict]) -> list[dict]:
    """Per (shape, rows): cuBLAS, the table's kernel and the fastest valid candidate; then per
    row count the sum over the shapes (one layer's linears), where every shape ran."""
    lines = []
    for shape, rows in dict.fromkeys((r["shape"], r["rows"]) for r in records):
        mine = [r for r in records if (r["shape"], r["rows"]) == (shape, rows)]
        by_kernel = {r["kernel"]: r for r in mine if "us" in r}
        if "cublas" not in by_kernel or "table" not in by_kernel:
            continue
        best = min((r for r in mine if valid(r)), key=lambda r: r["us"], default=None)
        lines.append(dict(shape=shape, rows=rows, cublas_us=by_kernel["cublas"]["us"],
                          table_us=by_kernel["table"]["us"], best=best["kernel"] if best else None,
                          best_us=best["us"] if best else None))
    for rows in dict.fromkeys(line["rows"] for line in lines):
        per_shape = [line for line in lines if line["rows"] == rows]
        if len(per_shape) == len(SHAPES):
            lines.append(dict(shape="layer", rows=rows, best=None,
                              cublas_us=sum(line["cublas_us"] for line in per_shape),
                              table_us=sum(line["table_us"] for line in per_shape),
                              best_us=sum(line["best_us"] or line["table_us"] for line in per_shape)))
    return lines


def print_summary(lines: list[dict]) -> None:
    print(f"\n{'shape':8} {'rows':>5} {'cuBLAS us':>10} {'table us':>9} {'x cuBLAS':>8} "
          f"{'best valid us':>13} {'x cuBLAS':>8} {'x table':>7}  best candidate")
    for line in lines:
        best_us = line["best_us"]
        best = (f"{best_us:13.1f} {best_us / line['cublas_us']:8.2f} {best_us / line['table_us']:7.2f}"
                if best_us else f"{'-':>13} {'-':>8} {'-':>7}")
        print(f"{line['shape']:8} {line['rows']:5d} {line['cublas_us']:10.1f} {line['table_us']:9.1f} "
              f"{line['table_us'] / line['cublas_us']:8.2f} {best} "
              f"{line['best'] or ('(sum; table where none)' if line['shape'] == 'layer' else 'none valid')}")


# Past the budget, the candidate under way gets this much more before its child is killed.
GRACE_S = 25.0


def child_argv(name: str, rows: int, started: float, budget_s: float, first: int,
               records: list[dict]) -> list[str]:
    """The command of a child that runs ``name`` at ``rows`` rows from candidate ``first`` on
    (after ``records``: with cuBLAS's time from them, not measured again)."""
    argv = [sys.executable, os.path.abspath(__file__), "--one", f"{name},{rows}", "--first-candidate",
            str(first), "--started", repr(started), "--budget-s", repr(budget_s)]
    cublas = [r["us"] for r in records if r["kernel"] == "cublas" and "us" in r]
    return argv + (["--cublas-us", repr(cublas[0])] if cublas else [])


def run_gpu(args) -> dict:
    """The probe on the GPU: every shape (``--shapes``) at 8,192 rows first, then 1,024
    (``--rows``; --quick: gate_up at 8,192 rows), each (shape, rows) in child processes
    (``child_runs.run_resumable``). Past the budget, shapes not begun are skipped."""
    if not torch.cuda.is_available():
        raise SystemExit("the probe needs a CUDA GPU (--cpu-check runs the kernels under the interpreter)")
    start = time.time()

    def log(text: str) -> None:
        print(f"[{time.time() - start:6.1f}s] {text}", flush=True)
    shapes = [shape for shape in SHAPES if shape[0] in (["gate_up"] if args.quick else args.shapes)]
    records: list[dict] = []
    info: dict = {}
    for rows in [8192] if args.quick else args.rows:
        for name, n, k in shapes:
            base = dict(shape=name, n=n, k=k, rows=rows)
            if time.time() - start > args.budget_s:
                records.append(dict(base, kernel="all", skipped=f"over the {args.budget_s:.0f} s budget"))
                log_record(records[-1], log)
                continue
            argv_for = functools.partial(child_argv, name, rows, start, args.budget_s)
            found, found_info = run_resumable(base, argv_for, len(GPU_CANDIDATES),
                                              start + args.budget_s + GRACE_S,
                                              functools.partial(log_record, log=log))
            records += found
            info = info or found_info
    lines = summarize(records)
    print_summary(lines)
    skipped = [f"{r['shape']} {r['rows']} {r['kernel']}" for r in records if "skipped" in r]
    if skipped:
        print(f"\nskipped past the budget: {', '.join(skipped)}")
    log("done")
    return dict(device=info.get("device"), torch=info.get("torch"), triton=info.get("triton"),
                records=records, summary=lines)


def run_one(args) -> None:
    """A child of ``run_gpu``: one (shape, rows) from ``--first-candidate`` on, each record and
    each candidate begun reported to the parent (``child_runs.emit``); exit status 3 when a
    candidate left the CUDA context unusable."""
    name, n, k, rows = args.one
    use_torch_allocator("cuda")
    probe = Probe(args.budget_s, start=args.started, emit=emit)
    if args.first_candidate == 0:
        probe.log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
                  f"{probe.sms} SMs")
    emit("info", device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
         sms=probe.sms)
    try:
        finished = probe.shape(name, n, k, rows, GPU_CANDIDATES, args.first_candidate, args.cublas_us)
    except Exception as error:  # cuBLAS or the current kernel failed: nothing to compare with
        probe.add(dict(shape=name, n=n, k=k, rows=rows, kernel="all", error=error_text(error)))
        finished = True
    if not finished:
        raise SystemExit(3)
    emit("done")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="gate_up at 8,192 rows only")
    names = [name for name, _, _ in SHAPES]
    parser.add_argument("--shapes", type=lambda text: text.split(","), default=names,
                        help=f"comma-separated, of {','.join(names)}")
    parser.add_argument("--rows", type=lambda text: [int(r) for r in text.split(",")], default=list(ROWS),
                        help="comma-separated row counts (default 8192,1024)")
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="seconds after which the remaining candidates and shapes are skipped")
    parser.add_argument("--cpu-check", action="store_true",
                        help="every variant under TRITON_INTERPRET=1 at tiny sizes, no GPU")
    parser.add_argument("--out", help="write the records and summary as JSON here")
    parser.add_argument("--one", help="SHAPE,ROWS: run one in this process, reporting to a parent probe")
    parser.add_argument("--first-candidate", type=int, default=0, help="with --one: GPU_CANDIDATES index")
    parser.add_argument("--started", type=float, help="with --one: the parent's start (epoch seconds)")
    parser.add_argument("--cublas-us", type=float, help="with --one: cuBLAS's time, already measured")
    args = parser.parse_args()
    unknown = sorted(set(args.shapes) - set(names))
    if unknown:
        parser.error(f"--shapes {','.join(unknown)}: not one of {','.join(names)}")
    if args.one:
        name, _, rows = args.one.partition(",")
        if name not in names or not rows.isdigit() or int(rows) == 0:
            parser.error(f"--one {args.one}: want SHAPE,ROWS, SHAPE one of {','.join(names)}, ROWS > 0")
        args.one = (*next(shape for shape in SHAPES if shape[0] == name), int(rows))
    return args


def main() -> None:
    args = parse_args()
    if args.one:
        run_one(args)
        return
    if args.cpu_check:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--cpu-check needs TRITON_INTERPRET=1 set before the kernels load")
        records = cpu_check()
        failed = [r for r in records if r.get("error") or not r["bitwise_vs_table"]
                  or not all(r["row_invariant"].values())]
        print(f"{len(records) - len(failed)}/{len(records)} cases bitwise equal and row-invariant")
        result = dict(cpu_check=records)
    else:
        result = run_gpu(args)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
