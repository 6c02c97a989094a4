"""``LLM.start_profile()`` / ``stop_profile()``: a trace with a range per engine step and its
phases, each step labelled by kind, and a kernel (on the CPU: operator) table grouped by kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.engine.profiling import kernel_kind


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
