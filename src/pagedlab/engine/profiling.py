"""Where an engine's time goes: named step ranges for the torch profiler and Nsight Systems, and
a summary of a profiled stretch of steps (``LLM.start_profile()`` / ``LLM.stop_profile()``).

Each ``LLMEngine.step`` is a range named ``pagedlab.step`` holding ``schedule``, a marker
``pagedlab.kind:<kind>`` (decode, prefill or mixed), ``prepare``, ``forward``, ``sample`` and
``process_output`` ranges. They
are recorded while a profiler runs, and as NVTX ranges when ``PAGEDLAB_NVTX=1`` (so ``nsys
profile`` shows them); otherwise they cost one attribute check.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

STEP_NAME = "pagedlab.step"
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "process_output")
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

    def mark(self, name: str) -> None:
        """An empty range: a label on the range it sits in."""
        with self.range(name):
            pass


_IDLE = contextlib.nullcontext()


@dataclass
class ProfileSummary:
    """A profiled stretch: the Chrome/Perfetto trace file, the kernels (on the CPU: the aten
    operators) by total time, their time by kind, and per step kind the steps' count, wall time,
    device time and the share of wall time the device sat idle waiting on the host, and the host
    time spent in each phase of the steps (``STEP_PHASES``)."""

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


def summarize(events, trace_path: str) -> ProfileSummary:
    """The summary of a profiler's events (``torch.profiler.profile.events()``)."""
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    timed = device or [e for e in events if e.name.startswith("aten::")]  # on the CPU: the operators
    kernels: dict[str, dict] = {}
    for e in timed:
        entry = kernels.setdefault(e.name, {"name": e.name, "kind": kernel_kind(e.name), "total_us": 0.0,
                                            "calls": 0})
        entry["total_us"] += e.device_time if device else e.self_cpu_time_total
        entry["calls"] += 1
    table = sorted(kernels.values(), key=lambda k: -k["total_us"])
    by_kind: dict[str, float] = {}
    for k in table:
        by_kind[k["kind"]] = by_kind.get(k["kind"], 0.0) + k["total_us"]
    steps: dict[str, dict] = {}
    for e in events:
        if e.name == STEP_NAME and e.device_type == torch.autograd.DeviceType.CPU:
            kinds = [c.name[len(KIND_PREFIX):] for c in e.cpu_children if c.name.startswith(KIND_PREFIX)]
            s = steps.setdefault(kinds[0] if kinds else "idle",
                                 {"count": 0, "wall_us": 0.0, "device_us": 0.0})
            s["count"] += 1
            s["wall_us"] += e.time_range.elapsed_us()
            s["device_us"] += e.device_time_total
    phases = {name: 0.0 for name in STEP_PHASES}
    for e in events:
        if e.name in phases and e.device_type == torch.autograd.DeviceType.CPU:
            phases[e.name] += e.time_range.elapsed_us()
    for s in steps.values():
        s["host_gap_share"] = max(0.0, 1 - s["device_us"] / s["wall_us"]) if device and s["wall_us"] else None
    return ProfileSummary(trace_path, table, by_kind, steps, phases if any(phases.values()) else {})
