"""Where an engine's time goes: named step ranges for the torch profiler and Nsight Systems, and
a summary of a profiled stretch of steps (``LLM.start_profile()`` / ``LLM.stop_profile()``).

Each ``LLMEngine.step`` is a range named ``pagedlab.step`` holding ``schedule``, ``prepare``,
``forward``, ``sample`` and ``process_output`` ranges; inside ``forward`` a range
``pagedlab.kind:<kind>`` (decode, prefill or mixed) labels the step. They are recorded while a
profiler runs, and as NVTX ranges when ``PAGEDLAB_NVTX=1`` (so ``nsys profile`` shows them);
otherwise they cost one attribute check. The profiler draws each range on the GPU timeline too,
from the first kernel launched inside it to the last, CUDA-graph replays included: the kind range's
span is the step's forward pass on the GPU's clock (``forward_spans``), whenever it ran.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

STEP_NAME = "pagedlab.step"
STEP_PHASES = ("schedule", "propose", "prepare", "forward", "sample", "process_output")
KIND_PREFIX = "pagedlab.kind:"
# Kinds of kernels (or, on the CPU, of aten operators) by a fragment of their name, first match wins;
# the rest (norms, activations, rotary, residual adds) is element-wise.
KERNEL_KINDS = (
    ("other", ("memcpy", "memset")),  # the profiler's copy and fill activities
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "broadcast", "c10d")),
    ("attention", ("attention", "split_kv", "write_kv", "cascade", "sdpa", "flash")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::linear", "w4a16", "awq", "scaled_mm", "splitkreduce")),
    ("sampling", ("argmax", "softmax", "topk", "top_k", "sort", "multinomial", "exponential", "sampler")),
)


def kernel_kind(name: str) -> str:
    """attention, gemm, communication, sampling, other (copies and fills) or element-wise."""
    lowered = name.lower()
    for kind, fragments in KERNEL_KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "element-wise"


def step_kind(batch) -> str:
    """decode (every request past its prompt), prefill (none) or mixed."""
    decoding = [r.num_computed_tokens >= r.num_prompt_tokens for r in batch.requests]
    if all(decoding):
        return "decode"
    return "mixed" if any(decoding) else "prefill"


class StepRanges:
    """Opens named ranges while a profiler records or NVTX is asked for (``PAGEDLAB_NVTX=1``);
    otherwise ``range`` hands back one shared no-op context, so the step loop pays nothing."""

    def __init__(self):
        self.nvtx = os.environ.get("PAGEDLAB_NVTX") == "1" and torch.cuda.is_available()
        self.recording = False

    @property
    def active(self) -> bool:
        return self.recording or self.nvtx

    def range(self, name: str):
        return self._open(name) if self.active else _IDLE

    @contextlib.contextmanager
    def _open(self, name: str):
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            if self.recording:
                with torch.profiler.record_function(name):
                    yield
            else:
                yield
        finally:
            if self.nvtx:
                torch.cuda.nvtx.range_pop()

    def kind_range(self, batch):
        """The range ``pagedlab.kind:<step_kind(batch)>``, around the step's forward pass."""
        return self._open(KIND_PREFIX + step_kind(batch)) if self.active else _IDLE


_IDLE = contextlib.nullcontext()


@dataclass
class ProfileSummary:
    """A profiled stretch: the Chrome/Perfetto trace file, the kernels (on the CPU: the aten
    operators) by total time, their time by kind, and per step kind the steps' count, wall time,
    device time (the kernels of their forward passes, ``gpu_split``) and the share of wall time
    the device sat idle waiting on the host, and the host time spent in each phase of the steps
    (``STEP_PHASES``)."""

    trace_path: str
    kernels: list[dict] = field(default_factory=list)
    time_by_kind_us: dict[str, float] = field(default_factory=dict)
    steps: dict[str, dict] = field(default_factory=dict)
    host_us_by_phase: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self, top: int = 15) -> str:
        lines = [f"trace: {self.trace_path}"]
        for kind, s in self.steps.items():
            gap = "n/a (no GPU)" if s["host_gap_share"] is None else f"{s['host_gap_share']:.0%}"
            count = max(s["count"], 1)
            lines.append(f"{kind} steps: {s['count']}, wall {s['wall_us'] / count / 1e3:.2f} ms each, device "
                         f"{s['device_us'] / count / 1e3:.2f} ms each, host gap {gap}")
        total = sum(self.time_by_kind_us.values()) or 1.0
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in self.time_by_kind_us.items())
        lines.append(f"time by kind: {shares}")
        if self.host_us_by_phase:
            lines.append("host time by phase: " + ", ".join(
                f"{k} {v / 1e3:.1f} ms" for k, v in self.host_us_by_phase.items()))
        lines += [f"  {k['total_us'] / 1e3:9.3f} ms {k['calls']:7d} calls  {k['kind']:<13} {k['name'][:80]}"
                  for k in self.kernels[:top]]
        return "\n".join(lines)


class EngineProfiler:
    """One torch profiler session over the engine's steps, written to ``output_dir``."""

    def __init__(self, ranges: StepRanges, output_dir: str | os.PathLike):
        self.ranges = ranges
        self.output_dir = Path(output_dir)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)

    def start(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._profile.start()
        self.ranges.recording = True

    def stop(self) -> ProfileSummary:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ranges.recording = False
        self._profile.stop()
        trace = self.output_dir / f"pagedlab-trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        self._profile.export_chrome_trace(str(trace))
        return summarize(self._profile.events(), str(trace))


def kernel_events(events) -> list:
    """The GPU kernels, copies and fills of a profile (not the ranges drawn on the GPU timeline),
    by start time."""
    found = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
             and not getattr(e, "is_user_annotation", False)]
    return sorted(found, key=lambda e: e.time_range.start)


def forward_spans(events) -> list[tuple[str, float, float]]:
    """(step kind, start, end) in us of every step's forward pass on the GPU's clock, in order:
    the GPU spans of the kind ranges (none on the CPU)."""
    spans = [(e.name[len(KIND_PREFIX):], e.time_range.start, e.time_range.end) for e in events
             if e.name.startswith(KIND_PREFIX) and e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(spans, key=lambda span: span[1])


def busy_intervals(kernels) -> list[tuple[float, float]]:
    """The union of the kernels' intervals (us), sorted and disjoint."""
    merged: list[list[float]] = []
    for start, end in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def busy_within(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Microseconds of ``[start, end]`` covered by the sorted disjoint ``intervals``."""
    first = max(bisect.bisect_right(intervals, (start, float("inf"))) - 1, 0)
    covered = 0.0
    for lo, hi in intervals[first:]:
        if lo >= end:
            break
        covered += max(0.0, min(hi, end) - max(lo, start))
    return covered


def gpu_split(spans: list[tuple[str, float, float]], kernels: list) -> dict[str, dict]:
    """Per step kind, on the GPU's clock: the forward passes' time (ms), their kernels' time by
    kernel kind (a kernel belongs to the span holding its start), the GPU idle inside them
    (launches the host had not made yet) and before them: from the previous forward's end, less
    the kernels run in between (sampling), the GPU waiting on the host to launch the step."""
    intervals = busy_intervals(kernels)
    starts = [k.time_range.start for k in kernels]
    result: dict[str, dict] = {}
    previous_end = None
    for kind, start, end in spans:
        entry = result.setdefault(kind, {"forwards": 0, "forward_ms": 0.0, "idle_in_forward_ms": 0.0,
                                         "idle_before_ms": 0.0, "kernel_ms_by_kind": {}})
        entry["forwards"] += 1
        entry["forward_ms"] += (end - start) / 1e3
        entry["idle_in_forward_ms"] += (end - start - busy_within(intervals, start, end)) / 1e3
        if previous_end is not None and start > previous_end:
            between = start - previous_end - busy_within(intervals, previous_end, start)
            entry["idle_before_ms"] += between / 1e3
        previous_end = end
        by_kind = entry["kernel_ms_by_kind"]
        for k in kernels[bisect.bisect_left(starts, start):bisect.bisect_left(starts, end)]:
            group = kernel_kind(k.name)
            by_kind[group] = by_kind.get(group, 0.0) + (k.time_range.end - k.time_range.start) / 1e3
    for entry in result.values():
        entry["kernel_ms"] = sum(entry["kernel_ms_by_kind"].values())
        entry["kernel_ms_by_kind"] = dict(sorted(entry["kernel_ms_by_kind"].items(), key=lambda kv: -kv[1]))
    return result


def step_label(step_event) -> str:
    """The kind a ``pagedlab.step`` range's kind range names; ``idle`` for a step that launched
    nothing."""
    stack = list(step_event.cpu_children)
    while stack:
        child = stack.pop()
        if child.name.startswith(KIND_PREFIX):
            return child.name[len(KIND_PREFIX):]
        stack.extend(child.cpu_children)
    return "idle"


def kernel_table(events, device: list) -> list[dict]:
    """The kernels (``device``: ``kernel_events(events)``; on the CPU, where there are none, the
    aten operators by self time) of a profile by total time, each ``{"name", "kind", "total_us",
    "calls"}``."""
    timed = device or [e for e in events if e.name.startswith("aten::")]
    kernels: dict[str, dict] = {}
    for e in timed:
        entry = kernels.setdefault(e.name, {"name": e.name, "kind": kernel_kind(e.name), "total_us": 0.0,
                                            "calls": 0})
        entry["total_us"] += e.time_range.end - e.time_range.start if device else e.self_cpu_time_total
        entry["calls"] += 1
    return sorted(kernels.values(), key=lambda k: -k["total_us"])


def summarize(events, trace_path: str) -> ProfileSummary:
    """The summary of a profiler's events (``torch.profiler.profile.events()``)."""
    device = kernel_events(events)
    table = kernel_table(events, device)
    by_kind: dict[str, float] = {}
    for k in table:
        by_kind[k["kind"]] = by_kind.get(k["kind"], 0.0) + k["total_us"]
    steps: dict[str, dict] = {}
    gpu = gpu_split(forward_spans(events), device)
    for e in events:
        if e.name == STEP_NAME and e.device_type == torch.autograd.DeviceType.CPU:
            kind = step_label(e)
            s = steps.setdefault(kind, {"count": 0, "wall_us": 0.0,
                                        "device_us": gpu[kind]["kernel_ms"] * 1e3 if kind in gpu else 0.0})
            s["count"] += 1
            s["wall_us"] += e.time_range.end - e.time_range.start
    phases = {name: 0.0 for name in STEP_PHASES}
    for e in events:
        if e.name in phases and e.device_type == torch.autograd.DeviceType.CPU:
            phases[e.name] += e.time_range.elapsed_us()
    for s in steps.values():
        s["host_gap_share"] = max(0.0, 1 - s["device_us"] / s["wall_us"]) if device and s["wall_us"] else None
    return ProfileSummary(trace_path, table, by_kind, steps, phases if any(phases.values()) else {})
