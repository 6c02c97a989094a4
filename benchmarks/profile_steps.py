"""Where a workload's time goes, step by step, on the GPU.

Runs one workload (dummy weights) through ``LLMEngine.step`` and reports, for each step kind
(``decode``: every request past its prompt; ``mixed``: decodes and prefill chunks; ``prefill``:
prompt tokens only, as ``pagedlab.engine.profiling.step_kind`` labels them):

- ``steps`` and ``wall_ms``: the engine's ``pagedlab.step`` ranges, their count and summed length;
- ``busy_ms``: how long the GPU ran any kernel inside the steps' wall time, and
  ``host_gap_ms`` = wall - busy: how long it sat idle while the host ran those steps (under the
  profiler, which slows the host about 2x: W-nano's 5% here was no idle at all in a timed run,
  BENCHMARKS.md session 57);
- ``gpu``, on the GPU's clock: the steps' forward passes (``forward_ms``: each the span the
  profiler draws for the step's kind range, from its first kernel to its last, CUDA-graph replays
  included: ``pagedlab.engine.profiling.forward_spans``), the time of the kernels inside those
  spans by kernel kind (attention, gemm, element-wise (norms included), communication, sampling,
  other: the ``--profile`` classifier, ``pagedlab.engine.profiling.kernel_kind``), the GPU idle
  inside them (``idle_in_forward_ms``) and before them (``idle_before_ms``: from the previous
  forward's end less the kernels run in between, the sampler's): the GPU waiting for the host to
  launch the step. With asynchronous scheduling a step's range returns before its kernels run,
  so these go by the GPU's spans, not by the step's wall interval;
- ``prefill_phase``: the mixed and prefill steps' wall time against the prompts' FLOPs at the
  matmul peak (issue 21's "prefill at 70% of 809 TFLOP/s").

The workload runs three times: once to warm up (kernels compile for new shapes), once timed
(``run_s``, output tok/s, the physical floor's share of the time, and ``telemetry``: the GPU's
mean SM clock and power and how much of the run it was throttled), once under the profiler.
``--mixed-graphs both`` (the default) repeats all of it with ``cuda_graph_mixed_steps`` off and
on in the same process (the weights stay loaded), so the two columns compare like for like.

    PYTHONPATH=src python3 benchmarks/profile_steps.py --workload W-seed --batch-size 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedlab import LLM
from pagedlab.engine.profiling import (STEP_NAME, busy_intervals, busy_within, forward_spans, gpu_split,
                                       kernel_events, kernel_table, step_label)
from pagedlab.physical_floor import H200_BF16_FLOPS
from pagedlab.workloads import (DEFAULT_SHAPES, engine_floor, format_telemetry, gpu_telemetry, make_workload,
                                shape_dir)

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


def step_records(events) -> list[dict]:
    """Per engine step (by start): its kind and wall interval (us, the profiler's clock)."""
    records = [{"kind": step_label(e), "start": e.time_range.start, "end": e.time_range.end} for e in events
               if e.name == STEP_NAME and e.device_type == torch.autograd.DeviceType.CPU]
    return sorted(records, key=lambda r: r["start"])


def breakdown(records: list[dict], intervals: list[tuple[float, float]],
              gpu: dict[str, dict]) -> dict[str, dict]:
    """Each step kind's count, wall (ms), GPU-busy time within it and host gap (wall - busy: the
    GPU idle while the host ran the steps), with ``gpu_split``'s figures for the kind."""
    result = {}
    for kind in STEP_KINDS + ("idle",):
        steps = [r for r in records if r["kind"] == kind]
        if not steps:
            continue
        wall = sum(r["end"] - r["start"] for r in steps)
        busy = sum(busy_within(intervals, r["start"], r["end"]) for r in steps)
        result[kind] = {
            "steps": len(steps), "wall_ms": wall / 1e3, "wall_ms_per_step": wall / 1e3 / len(steps),
            "busy_ms": busy / 1e3, "host_gap_ms": (wall - busy) / 1e3,
            "host_gap_share": (wall - busy) / wall if wall else None, "gpu": gpu.get(kind)}
    return result


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
    """Warm-up run, timed run (with the GPU's telemetry over it: ``workloads.gpu_telemetry``) and
    profiled run of the workload under the engine's current plan."""
    engine = llm.llm_engine
    run_workload(engine, workload, "warm")
    llm.reset_prefix_cache()
    with gpu_telemetry() as telemetry:
        seconds = run_workload(engine, workload, "timed")
    llm.reset_prefix_cache()
    events = profile_workload(llm, workload, "profiled")
    records, kernels = step_records(events), kernel_events(events)
    gpu = gpu_split(forward_spans(events), kernels)
    kinds = breakdown(records, busy_intervals(kernels), gpu)
    kernels_ms = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3
    output_tokens = sum(workload.output_lens)
    return {"run_s": seconds, "output_tok_s": output_tokens / seconds, "floor_s": floor_s,
            "floor_share": floor_s / seconds, "telemetry": telemetry,
            "mixed_cuda_graphs": llm.get_engine_info().mixed_cuda_graphs,
            # sampling, copies to the host, warm-up fills: the kernels of no forward pass
            "outside_forward_ms": kernels_ms - sum(g["kernel_ms"] for g in gpu.values()),
            "step_kinds": kinds, "prefill_phase": prefill_phase(kinds, prefill_floor_s),
            "top_kernels": kernel_table(events, kernels)[:top]}


def print_setting(label: str, result: dict) -> None:
    print(f"\n== {label}: {result['run_s']:.3f} s, {result['output_tok_s']:,.0f} output tok/s, "
          f"floor {result['floor_s']:.3f} s ({result['floor_share']:.0%} of the time); "
          f"{result['outside_forward_ms']:.1f} ms of kernels outside the forward passes (sampling, copies)"
          f"{format_telemetry(result['telemetry'])}")
    print(f"{'kind':<8} {'steps':>6} {'wall ms':>10} {'busy ms':>10} {'host gap':>13} {'fwd ms':>10} "
          f"{'idle in':>8} {'before':>8}  forward kernels by kind (ms)")
    for kind, s in result["step_kinds"].items():
        g = s["gpu"] or {"forward_ms": 0.0, "idle_in_forward_ms": 0.0, "idle_before_ms": 0.0,
                         "kernel_ms_by_kind": {}}
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in g["kernel_ms_by_kind"].items())
        gap = f"{s['host_gap_share']:.0%}" if s["host_gap_share"] is not None else "n/a"
        print(f"{kind:<8} {s['steps']:6d} {s['wall_ms']:10.1f} {s['busy_ms']:10.1f} {s['host_gap_ms']:8.1f} "
              f"{gap:>4} {g['forward_ms']:10.1f} {g['idle_in_forward_ms']:8.1f} {g['idle_before_ms']:8.1f}  "
              f"{kinds}")
    phase = result["prefill_phase"]
    if phase["peak_share"] is not None:
        print(f"prefill phase (mixed and prefill steps): {phase['wall_ms']:.1f} ms against "
              f"{phase['floor_ms']:.1f} at the matmul peak: {phase['tflops']:.0f} TFLOP/s, "
              f"{phase['peak_share']:.0%} of {H200_BF16_FLOPS / 1e12:.0f}")
    for k in result["top_kernels"]:
        print(f"  {k['total_us'] / 1e3:10.2f} ms {k['calls']:7d} calls  {k['kind']:<13} {k['name'][:90]}")


def floors(llm, hf_config, workload_name: str, workload) -> tuple[float, float]:
    """The workload's physical floor on ``llm`` (``workloads.engine_floor``: its weights, KV dtype,
    tensor parallelism and prefix cache) and that of its prefill alone (no decode step)."""
    return (engine_floor(llm, hf_config, workload_name, workload),
            engine_floor(llm, hf_config, workload_name, workload, [1] * len(workload.prompts)))


def main() -> None:
    args = parse_args()
    model, workload, engine_args, hf_config = engine_setup(args)
    settings = {"on": [True], "off": [False], "both": [False, True]}[args.mixed_graphs]
    report = {"workload": args.workload, "batch_size": args.batch_size, "model": model,
              "engine_args": engine_args, "settings": {}}
    with LLM(model, **{**engine_args, "cuda_graph_mixed_steps": settings[0]}) as llm:
        floor_s, prefill_floor_s = floors(llm, hf_config, args.workload, workload)
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
