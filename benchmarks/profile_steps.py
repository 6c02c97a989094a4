"""Where a workload's time goes, step by step, on the GPU.

Runs one workload (dummy weights) through ``LLMEngine.step`` and reports, for each step kind
(``decode``: every request past its prompt; ``mixed``: decodes and prefill chunks; ``prefill``:
prompt tokens only, as ``pagedlab.engine.profiling.step_kind`` labels them):

- ``steps`` and ``wall_ms``: the engine's ``pagedlab.step`` ranges, their count and summed length;
- ``gpu_ms`` by kernel kind (attention, gemm, element-wise (norms included), communication,
  sampling, other: the ``--profile`` classifier, ``pagedlab.engine.profiling.kernel_kind``) of
  the kernels each step launched. Kernels are attributed through the step's range (the launch,
  or the CUDA-graph launch, that queued them), not by timestamps: with asynchronous scheduling a
  step returns before its kernels run (it waits for the previous step's sampled tokens, not its
  own), so the kernels running during a step's wall time are mostly the step before's;
- ``busy_ms``: how long the GPU ran any kernel inside the steps' wall time, and
  ``host_gap_ms`` = wall - busy: how long it sat idle waiting on the host;
- ``prefill_phase``: the mixed and prefill steps' wall time against the prompts' FLOPs at the
  matmul peak (issue 21's "prefill at 70% of 809 TFLOP/s").

The workload runs three times: once to warm up (kernels compile for new shapes), once timed
(``run_s``, output tok/s and the physical floor's share of the time), once under the profiler.
``--mixed-graphs both`` (the default) repeats all of it with ``cuda_graph_mixed_steps`` off and
on in the same process (the weights stay loaded), so the two columns compare like for like.

    PYTHONPATH=src python3 benchmarks/profile_steps.py --workload W-seed --batch-size 256 --json out.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedlab import LLM
from pagedlab.engine.profiling import KIND_PREFIX, STEP_NAME, kernel_kind
from pagedlab.physical_floor import H200_BF16_FLOPS, physical_floor
from pagedlab.workloads import DEFAULT_SHAPES, make_workload, shape_dir

STEP_KINDS = ("decode", "mixed", "prefill")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W-seed", choices=sorted(DEFAULT_SHAPES))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model", help="a model directory instead of the workload's shape (dummy weights)")
    parser.add_argument("--mixed-graphs", choices=("on", "off", "both"), default="both",
                        help="cuda_graph_mixed_steps for the runs (both: off, then on)")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per setting")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--engine-args", default="{}", help="JSON of extra LLM arguments")
    return parser.parse_args()


def engine_setup(args: argparse.Namespace):
    """(model path, workload, LLM arguments, HF config) of the run."""
    from transformers import AutoConfig

    model = args.model or shape_dir(DEFAULT_SHAPES[args.workload])
    hf_config = AutoConfig.from_pretrained(model)
    workload = make_workload(args.workload, hf_config.vocab_size, args.batch_size, args.input_len,
                             args.output_len)
    longest = max(len(p) + o for p, o in zip(workload.prompts, workload.output_lens))
    engine_args = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": -(-longest // 64) * 64,
                   "max_num_seqs": max(256, len(workload.prompts)), **workload.engine_args,
                   **json.loads(args.engine_args)}
    return model, workload, engine_args, hf_config


def run_workload(engine, workload, tag: str) -> float:
    """Drive the engine over every request of the workload; returns the wall seconds."""
    for i, (prompt, params) in enumerate(zip(workload.prompts, workload.sampling_params())):
        engine.add_request(f"{tag}{i}", prompt, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step(stream=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def profile_workload(llm, workload, tag: str):
    """The workload once under the torch profiler, with the engine's step ranges recorded."""
    engine = llm.llm_engine
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        engine.ranges.recording = True
        try:
            run_workload(engine, workload, tag)
        finally:
            engine.ranges.recording = False
    llm.reset_prefix_cache()
    return prof.events()


def _subtree(event):
    """The event and every CPU event nested in it."""
    stack = [event]
    while stack:
        child = stack.pop()
        yield child
        stack.extend(child.cpu_children)


def step_records(events) -> list[dict]:
    """Per engine step: its kind, wall interval (us, the profiler's clock) and the GPU time of the
    kernels it launched, by kernel kind."""
    records = []
    for event in events:
        if event.name != STEP_NAME or event.device_type != torch.autograd.DeviceType.CPU:
            continue
        kind, gpu_us = "idle", {}
        for child in _subtree(event):
            if child.name.startswith(KIND_PREFIX):
                kind = child.name[len(KIND_PREFIX):]
            for kernel in child.kernels:
                group = kernel_kind(kernel.name)
                gpu_us[group] = gpu_us.get(group, 0.0) + kernel.duration
        records.append({"kind": kind, "start": event.time_range.start, "end": event.time_range.end,
                        "gpu_us": gpu_us})
    return records


def busy_intervals(events) -> list[tuple[float, float]]:
    """The union of every GPU kernel's interval (us), sorted and disjoint."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    merged: list[list[float]] = []
    for start, end in spans:
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


def breakdown(records: list[dict], intervals: list[tuple[float, float]]) -> dict[str, dict]:
    """Each step kind's count, wall, kernel time by kind, GPU-busy time and host gap (ms)."""
    result = {}
    for kind in STEP_KINDS + ("idle",):
        steps = [r for r in records if r["kind"] == kind]
        if not steps:
            continue
        wall = sum(r["end"] - r["start"] for r in steps)
        busy = sum(busy_within(intervals, r["start"], r["end"]) for r in steps)
        by_kind: dict[str, float] = {}
        for r in steps:
            for group, us in r["gpu_us"].items():
                by_kind[group] = by_kind.get(group, 0.0) + us
        result[kind] = {
            "steps": len(steps), "wall_ms": wall / 1e3, "wall_ms_per_step": wall / 1e3 / len(steps),
            "gpu_ms": sum(by_kind.values()) / 1e3,
            "gpu_ms_by_kind": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "busy_ms": busy / 1e3, "host_gap_ms": (wall - busy) / 1e3,
            "host_gap_share": (wall - busy) / wall if wall else None}
    return result


def top_kernels(events, count: int) -> list[dict]:
    """The ``count`` kernels with the most GPU time over the profiled run."""
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(e.name, [0.0, 0])
            entry[0] += e.time_range.end - e.time_range.start
            entry[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:count]
    return [{"name": name[:120], "kind": kernel_kind(name), "ms": us / 1e3, "calls": calls}
            for name, (us, calls) in rows]


def prefill_phase(kinds: dict[str, dict], prefill_floor_s: float) -> dict:
    """The prefill phase (every step with prompt tokens: mixed and prefill steps): its wall time and
    the share of the matmul peak it ran at, ``prefill_floor_s`` (the workload's prefill FLOPs at
    ``H200_BF16_FLOPS``, as the physical floor counts them) over that wall time. Mixed steps also
    run decodes, so the share is a lower bound."""
    wall_ms = sum(kinds[kind]["wall_ms"] for kind in ("mixed", "prefill") if kind in kinds)
    return {"wall_ms": wall_ms, "floor_ms": prefill_floor_s * 1e3,
            "peak_share": prefill_floor_s * 1e3 / wall_ms if wall_ms else None,
            "tflops": prefill_floor_s * H200_BF16_FLOPS / (wall_ms / 1e3) / 1e12 if wall_ms else None}


def measure(llm, workload, floor_s: float, prefill_floor_s: float, top: int) -> dict:
    """Warm-up run, timed run and profiled run of the workload under the engine's current plan."""
    engine = llm.llm_engine
    run_workload(engine, workload, "warm")
    llm.reset_prefix_cache()
    seconds = run_workload(engine, workload, "timed")
    llm.reset_prefix_cache()
    events = profile_workload(llm, workload, "profiled")
    records = step_records(events)
    kinds = breakdown(records, busy_intervals(events))
    kernels_ms = sum(e.time_range.end - e.time_range.start for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    output_tokens = sum(workload.output_lens)
    return {"run_s": seconds, "output_tok_s": output_tokens / seconds, "floor_s": floor_s,
            "floor_share": floor_s / seconds,
            "mixed_cuda_graphs": llm.get_engine_info().mixed_cuda_graphs,
            # kernel time no step range claims (e.g. warm-up copies); large would mean lost links
            "unattributed_gpu_ms": kernels_ms - sum(s["gpu_ms"] for s in kinds.values()),
            "step_kinds": kinds, "prefill_phase": prefill_phase(kinds, prefill_floor_s),
            "top_kernels": top_kernels(events, top)}


def print_setting(label: str, result: dict) -> None:
    print(f"\n== {label}: {result['run_s']:.3f} s, {result['output_tok_s']:,.0f} output tok/s, "
          f"floor {result['floor_s']:.3f} s ({result['floor_share']:.0%} of the time), "
          f"{result['unattributed_gpu_ms']:.1f} ms of kernels outside the steps")
    print(f"{'kind':<8} {'steps':>6} {'wall ms':>10} {'gpu ms':>10} {'busy ms':>10} {'host gap':>10}  "
          "kernel time by kind (ms)")
    for kind, s in result["step_kinds"].items():
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in s["gpu_ms_by_kind"].items())
        gap = f"{s['host_gap_share']:.0%}" if s["host_gap_share"] is not None else "n/a"
        print(f"{kind:<8} {s['steps']:6d} {s['wall_ms']:10.1f} {s['gpu_ms']:10.1f} {s['busy_ms']:10.1f} "
              f"{s['host_gap_ms']:7.1f} {gap:>3}  {kinds}")
    phase = result["prefill_phase"]
    if phase["peak_share"] is not None:
        print(f"prefill phase (mixed and prefill steps): {phase['wall_ms']:.1f} ms against "
              f"{phase['floor_ms']:.1f} at the matmul peak: {phase['tflops']:.0f} TFLOP/s, "
              f"{phase['peak_share']:.0%} of {H200_BF16_FLOPS / 1e12:.0f}")
    for k in result["top_kernels"]:
        print(f"  {k['ms']:10.2f} ms {k['calls']:7d} calls  {k['kind']:<13} {k['name'][:90]}")


def main() -> None:
    args = parse_args()
    model, workload, engine_args, hf_config = engine_setup(args)
    settings = {"on": [True], "off": [False], "both": [False, True]}[args.mixed_graphs]
    prompt_lens = [len(p) for p in workload.prompts]
    floor_s = physical_floor(hf_config, prompt_lens, workload.output_lens)
    prefill_floor_s = physical_floor(hf_config, prompt_lens, [1] * len(prompt_lens))  # no decode step
    report = {"workload": args.workload, "batch_size": args.batch_size, "model": model,
              "engine_args": engine_args, "settings": {}}
    with LLM(model, **{**engine_args, "cuda_graph_mixed_steps": settings[0]}) as llm:
        for mixed in settings:
            if mixed != llm.get_engine_info().config.cuda_graph_mixed_steps:
                llm.set_model_args(cuda_graph_mixed_steps=mixed)
            label = f"cuda_graph_mixed_steps={mixed}"
            report["settings"][label] = result = measure(llm, workload, floor_s, prefill_floor_s, args.top)
            print_setting(label, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
