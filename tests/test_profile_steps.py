"""benchmarks/profile_steps.py's accounting: GPU-busy time as the union of kernel intervals
clipped to a step, kernels attributed to the step whose range launched them, and on a tiny CPU
run every engine step found in the profile with its kind."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

from conftest import KV_BYTES, random_prompts
from pagedlab import LLM
from pagedlab.engine.profiling import KIND_PREFIX, STEP_NAME
from pagedlab.workloads import Workload

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_steps.py"
_spec = importlib.util.spec_from_file_location("profile_steps", _SCRIPT)
profile_steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_steps)

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _event(name, start, end, device=CPU, children=(), kernels=()):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           cpu_children=list(children), kernels=list(kernels))


def test_busy_time_is_the_union_of_kernels_clipped_to_the_step():
    kernels = [_event("k", 0, 10, CUDA), _event("k", 5, 20, CUDA), _event("k", 30, 40, CUDA),
               _event("step", 0, 100)]  # a CPU event: not GPU time
    intervals = profile_steps.busy_intervals(kernels)
    assert intervals == [(0, 20), (30, 40)]
    assert profile_steps.busy_within(intervals, 15, 35) == 10
    assert profile_steps.busy_within(intervals, 20, 30) == 0
    assert profile_steps.busy_within(intervals, -5, 100) == 30


def test_kernels_go_to_the_step_that_launched_them_whenever_they_ran():
    """With asynchronous scheduling step 1's kernels run during step 2: they still count as step 1's."""
    gemm = SimpleNamespace(name="nvjet_sm90_tst_64x8", device=0, duration=7.0)
    attention = SimpleNamespace(name="paged_attention_kernel", device=0, duration=3.0)
    launch = _event("cudaGraphLaunch", 2, 3, kernels=[gemm, attention])
    first = _event(STEP_NAME, 0, 4, children=[_event(KIND_PREFIX + "mixed", 1, 1),
                                               _event("forward", 2, 4, children=[launch])])
    second = _event(STEP_NAME, 4, 10, children=[_event(KIND_PREFIX + "decode", 5, 5)])
    records = profile_steps.step_records([first, second, _event("k", 4, 14, CUDA)])
    assert [(r["kind"], r["gpu_us"]) for r in records] == [("mixed", {"gemm": 7.0, "attention": 3.0}),
                                                           ("decode", {})]
    result = profile_steps.breakdown(records, [(4, 14)])
    assert result["mixed"]["gpu_ms"] == 0.01 and result["mixed"]["host_gap_ms"] == 0.004
    assert result["decode"]["busy_ms"] == 0.006 and result["decode"]["host_gap_share"] == 0
    assert profile_steps.prefill_phase(result, 0.0)["wall_ms"] == 0.004  # the mixed step only
    assert profile_steps.prefill_phase({"decode": result["decode"]}, 1.0)["peak_share"] is None


def test_every_profiled_engine_step_is_found_with_its_kind(tiny_llama):
    prompts = random_prompts(4, min_len=20, max_len=40, seed=2)
    workload = Workload("custom", prompts, [6, 3, 8, 2])
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32) as llm:
        engine, profiled_steps = llm.llm_engine, []
        step = engine.step
        engine.step = lambda **kwargs: profiled_steps.append(engine.ranges.recording) or step(**kwargs)
        result = profile_steps.measure(llm, workload, floor_s=0.5, prefill_floor_s=0.2, top=5)
    kinds = result["step_kinds"]
    assert set(kinds) == {"prefill", "mixed", "decode"}
    assert sum(s["steps"] for s in kinds.values()) == sum(profiled_steps) > 0
    assert all(s["wall_ms"] > 0 and s["host_gap_ms"] == s["wall_ms"] for s in kinds.values())  # no GPU
    assert result["unattributed_gpu_ms"] == 0 and result["output_tok_s"] == 19 / result["run_s"]
    assert not result["mixed_cuda_graphs"]  # the CPU runs eagerly
    phase = result["prefill_phase"]  # the steps with prompt tokens, against 0.2 s at the peak
    assert phase["wall_ms"] == kinds["prefill"]["wall_ms"] + kinds["mixed"]["wall_ms"]
    assert phase["peak_share"] == 200 / phase["wall_ms"]
