"""Where a workload's time goes, step by step, on the GPU.

Runs one workload (dummy weights) through ``LLMEngine.step`` and prints, for prefill-carrying
steps and decode-only steps apart: the number of steps, wall time per step, GPU kernel time per
step (from the CUDA profiler) and the kernels that take the most of it. Wall time well above
kernel time is host work the GPU waits for.

    PYTHONPATH=src python3 benchmarks/profile_steps.py --workload W-seed --batch-size 256
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedlab import LLM, SamplingParams
from pagedlab.workloads import DEFAULT_SHAPES, make_workload, shape_dir


def kernel_table(prof, steps: int, top: int) -> list[tuple[str, float, int]]:
    """(kernel name, microseconds per step, calls per step) of the ``top`` costliest kernels."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:90]]
            entry[0] += event.device_time
            entry[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [(name, t / steps, n // steps) for name, (t, n) in rows]


def run_steps(engine, workload):
    """Drive the engine over the workload; per step: (kind, wall seconds)."""
    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=workload.temperature,
                                                           max_tokens=out_len, ignore_eos=True,
                                                           detokenize=False))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        waiting_before = sum(r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running) \
            or bool(engine.scheduler.waiting)
        engine.step(stream=False)
        steps.append(("prefill" if waiting_before else "decode", time.perf_counter() - start))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", default="W-seed")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json")
    parser.add_argument("--engine-args", default="{}", help="JSON of extra LLM arguments")
    args = parser.parse_args()

    model = shape_dir(DEFAULT_SHAPES[args.workload])
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model).vocab_size
    workload = make_workload(args.workload, vocab, args.batch_size, args.input_len, args.output_len)
    longest = max(len(p) + o for p, o in zip(workload.prompts, workload.output_lens))
    engine_args = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": -(-longest // 64) * 64,
                   "max_num_seqs": max(256, len(workload.prompts)), **workload.engine_args,
                   **json.loads(args.engine_args)}
    report = {"workload": args.workload, "batch_size": args.batch_size, "engine_args": engine_args}
    with LLM(model, **engine_args) as llm:
        llm.generate(workload.prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        engine = llm.llm_engine
        for run in ("first", "second"):  # the first run may still compile kernels for new shapes
            torch.cuda.synchronize()
            start = time.perf_counter()
            steps = run_steps(engine, workload)
            torch.cuda.synchronize()
            report[f"total_s_{run}_run"] = time.perf_counter() - start
            llm.reset_prefix_cache()
            slowest = sorted(range(len(steps)), key=lambda i: -steps[i][1])[:5]
            report[f"slowest_steps_{run}_run"] = [(i, steps[i][0], round(steps[i][1] * 1e3, 1))
                                                  for i in slowest]
        for kind in ("prefill", "decode"):
            times = [t for k, t in steps if k == kind]
            report[kind] = {"steps": len(times), "wall_s": sum(times),
                            "wall_ms_per_step_p50": 1e3 * sorted(times)[len(times) // 2] if times else None}
        print(json.dumps(report, indent=1), flush=True)

        # Kernel time: profile every step of a second identical run, split by step kind.
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            steps = run_steps(engine, workload)
            torch.cuda.synchronize()
        llm.reset_prefix_cache()
        gpu_total = sum(e.device_time for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA)
        report["gpu_kernel_s_total"] = gpu_total / 1e6
        report["kernels_per_run"] = kernel_table(prof, 1, args.top)
        print(json.dumps({k: report[k] for k in ("gpu_kernel_s_total",)}, indent=1))
        for name, us, calls in report["kernels_per_run"]:
            print(f"{us / 1e3:10.1f} ms  {calls:6d} calls  {name}")

        # Decode alone: one decode-only step, profiled over a few repetitions in steady state.
        for i, p in enumerate(workload.prompts):
            engine.add_request(f"d{i}", p, SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step(stream=False)
        for _ in range(5):
            engine.step(stream=False)
        torch.cuda.synchronize()
        n = 10
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                engine.step(stream=False)
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / n
        gpu = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / n
        report["decode_step"] = {"wall_ms": wall * 1e3, "gpu_kernel_ms": gpu / 1e3,
                                 "kernels": kernel_table(prof, n, args.top)}
        print(f"decode step: wall {wall * 1e3:.2f} ms, kernels {gpu / 1e3:.2f} ms")
        for name, us, calls in report["decode_step"]["kernels"]:
            print(f"{us / 1e3:10.3f} ms  {calls:6d} calls  {name}")
        cpu_rows = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(cpu_rows)
        while engine.has_unfinished_requests():
            engine.step(stream=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
