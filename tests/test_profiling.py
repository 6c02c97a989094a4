"""``LLM.start_profile()`` / ``stop_profile()``: a trace with a range per engine step and its
phases, each step labelled by kind, and a kernel (on the CPU: operator) table grouped by kind;
the GPU-side accounting (kernels, busy time, forward spans by kind) on synthetic events."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedlab import LLM, SamplingParams
from pagedlab.engine.profiling import (KIND_PREFIX, STEP_NAME, busy_intervals, busy_within, forward_spans,
                                       gpu_split, kernel_events, kernel_kind, step_label, summarize)

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def test_a_profile_holds_every_step_its_phases_and_a_kernel_table(tiny_llama, tmp_path):
    prompts = [[5 + i] * (20 + 7 * i) for i in range(3)]
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16) as llm:
        engine = llm.llm_engine
        llm.start_profile(str(tmp_path))
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        summary = llm.stop_profile()
        with pytest.raises(RuntimeError, match="no profile is running"):
            llm.stop_profile()
    # 16-token steps over 20/27/34-token prompts: prefill chunks, then chunks beside decodes, then decodes
    assert {"prefill", "mixed", "decode"} <= set(summary.steps)
    assert sum(s["count"] for s in summary.steps.values()) == steps
    assert all(s["host_gap_share"] is None for s in summary.steps.values())  # no GPU to be idle
    kinds = {k["kind"] for k in summary.kernels}
    assert {"gemm", "attention"} <= kinds and summary.time_by_kind_us["gemm"] > 0
    trace = json.loads(Path(summary.trace_path).read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"pagedlab.step", "schedule", "prepare", "forward", "sample", "process_output"} <= names
    assert "decode steps" in summary.format()


def test_profiles_do_not_nest(tiny_llama, tmp_path):
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=8 << 20) as llm:
        llm.start_profile(str(tmp_path))
        with pytest.raises(RuntimeError, match="already running"):
            llm.start_profile(str(tmp_path))
        llm.stop_profile()


def test_a_profile_without_a_directory_goes_where_vllms_variable_says(tiny_llama, tmp_path, monkeypatch):
    """vLLM's simple_profiling.py sets ``VLLM_TORCH_PROFILER_DIR`` and calls ``start_profile()``:
    the trace goes there (``PAGEDLAB_TORCH_PROFILER_DIR`` first, where both are set)."""
    monkeypatch.delenv("PAGEDLAB_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "vllm_profile"))
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=8 << 20) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=2)
        llm.start_profile()
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert Path(llm.stop_profile().trace_path).parent == tmp_path / "vllm_profile"
        monkeypatch.setenv("PAGEDLAB_TORCH_PROFILER_DIR", str(tmp_path / "ours"))
        llm.start_profile()
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert Path(llm.stop_profile().trace_path).parent == tmp_path / "ours"


@pytest.mark.parametrize(("name", "kind"), [
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("_one_shot_all_reduce_kernel", "communication"),
    ("paged_attention_kernel", "attention"),
    ("split_kv_reduce_kernel", "attention"),
    ("write_kv_kernel", "attention"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>",
     "sampling"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "element-wise"),
    ("Memcpy HtoD (Pinned -> Device)", "other"),
    ("Memset (Device)", "other"),
])
def test_kernels_are_grouped_by_kind(name, kind):
    assert kernel_kind(name) == kind


def profiler_event(name, start, end, device=CPU, children=(), annotation=False):
    """A profiler event as ``profile.events()`` gives it (the fields the accounting reads)."""
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           cpu_children=list(children), is_user_annotation=annotation)


def two_steps_and_their_kernels() -> list:
    """A mixed step whose forward (a CUDA-graph replay) runs on the GPU during the next, decode,
    step's wall time, as asynchronous scheduling leaves it; then the sampler and 3 us of idle GPU;
    then the decode step's forward with 2 us of idle inside it. Flat, as ``profile.events()``
    lists nested events too; the kind ranges are drawn on the GPU timeline as annotations."""
    kinds = [profiler_event(KIND_PREFIX + "mixed", 2, 3, children=[profiler_event("cudaGraphLaunch", 2, 3)]),
             profiler_event(KIND_PREFIX + "decode", 6, 8)]
    first = profiler_event(STEP_NAME, 0, 4, children=[profiler_event("forward", 2, 4, children=[kinds[0]])])
    second = profiler_event(STEP_NAME, 4, 30, children=[profiler_event("forward", 6, 8, children=[kinds[1]])])
    gpu = [profiler_event(KIND_PREFIX + "decode", 19, 29, CUDA, annotation=True),
           profiler_event(KIND_PREFIX + "mixed", 5, 15, CUDA, annotation=True),
           profiler_event("nvjet_sm90_tst_64x8", 5, 12, CUDA),
           profiler_event("paged_attention_kernel", 12, 15, CUDA),
           profiler_event("gumbel_argmax_chunk_kernel", 15, 16, CUDA),
           profiler_event("nvjet_sm90_tst_64x8", 19, 23, CUDA),
           profiler_event("rms_norm_kernel", 25, 29, CUDA)]
    return [first, second, *kinds, *gpu]


def test_busy_time_is_the_union_of_kernels_clipped_to_an_interval():
    kernels = [profiler_event("k", start, end, CUDA) for start, end in ((30, 40), (0, 10), (5, 20))]
    not_kernels = [profiler_event("step", 0, 100), profiler_event("forward", 0, 100, CUDA, annotation=True)]
    events = kernels + not_kernels
    kernels = kernel_events(events)
    assert [k.time_range.start for k in kernels] == [0, 5, 30]
    intervals = busy_intervals(kernels)
    assert intervals == [(0, 20), (30, 40)]
    assert busy_within(intervals, 15, 35) == 10
    assert busy_within(intervals, 20, 30) == 0
    assert busy_within(intervals, -5, 100) == 30


def test_kernels_go_to_the_forward_whose_gpu_span_holds_them_whenever_the_step_ran():
    events = two_steps_and_their_kernels()
    assert [step_label(e) for e in events[:2]] == ["mixed", "decode"]
    spans = forward_spans(events)
    assert spans == [("mixed", 5, 15), ("decode", 19, 29)]
    gpu = gpu_split(spans, kernel_events(events))
    assert gpu["mixed"] == {"forwards": 1, "forward_ms": 0.01, "idle_in_forward_ms": 0.0,
                            "idle_before_ms": 0.0, "kernel_ms": 0.01,
                            "kernel_ms_by_kind": {"gemm": 0.007, "attention": 0.003}}
    decode = gpu["decode"]
    assert decode["kernel_ms_by_kind"] == {"gemm": 0.004, "element-wise": 0.004}
    # 2 us idle inside; before it 15-19 less the sampler's 1 us
    assert decode["idle_in_forward_ms"] == 0.002 and decode["idle_before_ms"] == 0.003
    summary = summarize(events, "trace.json")  # the annotations are no kernels in its table
    assert {k["name"] for k in summary.kernels} == {"nvjet_sm90_tst_64x8", "paged_attention_kernel",
                                                   "gumbel_argmax_chunk_kernel", "rms_norm_kernel"}
    assert summary.steps["mixed"]["device_us"] == 10 and summary.steps["decode"]["device_us"] == 8
    assert summary.steps["decode"]["host_gap_share"] == pytest.approx(1 - 8 / 26)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_each_step_kind_has_its_forward_spans_and_kernels_graph_replays_included(tiny_llama,
                                                                                             tmp_path):
    """The profiler draws each kind range on the GPU timeline, decode graph replays and mixed-step
    graphs included, so every kind's device time is found and the spans are not kernels."""
    prompts = [[5 + i] * (20 + 7 * i) for i in range(3)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=32) as llm:
        assert llm.get_engine_info().mixed_cuda_graphs
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        llm.reset_prefix_cache()  # or the prompts' cached blocks leave one short prefill, no mixed step
        llm.start_profile(str(tmp_path))
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        summary = llm.stop_profile()
    assert {"prefill", "mixed", "decode"} <= set(summary.steps)
    for kind in ("prefill", "mixed", "decode"):
        assert summary.steps[kind]["device_us"] > 0, kind
    names = {k["name"] for k in summary.kernels}
    assert not names & {"forward", "prepare", "sample", "pagedlab.step", "pagedlab.kind:decode"}
