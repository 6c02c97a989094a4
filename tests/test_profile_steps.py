"""benchmarks/profile_steps.py's accounting: GPU-busy time as the union of kernel intervals
clipped to a step, kernels attributed to the step whose range launched them, and on a tiny CPU
run every engine step found in the profile with its kind."""

from __future__ import annotations

import importlib.util
from pathlib import Path


from conftest import KV_BYTES, random_prompts
from test_profiling import profiler_event, two_steps_and_their_kernels
from pagedlab import LLM
from pagedlab.engine.profiling import STEP_NAME
from pagedlab.workloads import Workload

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_steps.py"
_spec = importlib.util.spec_from_file_location("profile_steps", _SCRIPT)
profile_steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_steps)

def test_steps_take_their_kind_and_the_gpu_split_of_their_forward_passes():
    """The mixed step's forward runs on the GPU during the decode step's wall time (asynchronous
    scheduling): its kernels still count as the mixed step's; the idle step launched nothing."""
    events = two_steps_and_their_kernels() + [profiler_event(STEP_NAME, 30, 31)]
    records, kernels = profile_steps.step_records(events), profile_steps.kernel_events(events)
    assert [(r["kind"], r["start"], r["end"]) for r in records] == [("mixed", 0, 4), ("decode", 4, 30),
                                                                    ("idle", 30, 31)]
    gpu = profile_steps.gpu_split(profile_steps.forward_spans(events), kernels)
    result = profile_steps.breakdown(records, profile_steps.busy_intervals(kernels), gpu)
    assert result["mixed"]["busy_ms"] == 0.0 and result["mixed"]["host_gap_ms"] == 0.004
    assert result["mixed"]["gpu"]["kernel_ms_by_kind"] == {"gemm": 0.007, "attention": 0.003}
    assert result["decode"]["busy_ms"] == 0.019 and result["decode"]["gpu"] is gpu["decode"]
    assert result["idle"]["gpu"] is None and result["idle"]["host_gap_share"] == 1
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
    # no GPU: every step's wall is host time, and no forward span or kernel was drawn
    assert all(s["wall_ms"] > 0 and s["host_gap_ms"] == s["wall_ms"] and s["gpu"] is None
               for s in kinds.values())
    assert result["outside_forward_ms"] == 0 and result["output_tok_s"] == 19 / result["run_s"]
    assert not result["mixed_cuda_graphs"]  # the CPU runs eagerly
    assert result["telemetry"]["host_max_rss_bytes"] > 0  # the timed run's; the GPU's too on a GPU
    phase = result["prefill_phase"]  # the steps with prompt tokens, against 0.2 s at the peak
    assert phase["wall_ms"] == kinds["prefill"]["wall_ms"] + kinds["mixed"]["wall_ms"]
    assert phase["peak_share"] == 200 / phase["wall_ms"]


def test_floors_follow_the_engines_prefix_cache_and_stored_weights(tiny_llama):
    """W-prefix with prefix caching on (the engine's default): every request after the first
    finds the 2,048-token prefix cached, as ``pagedlab bench``'s "prefix-cache on" row counts it;
    off, every prompt is computed. The weights read are the engine's own (float32 here: 4 bytes
    a parameter, not bf16's 2)."""
    from pagedlab.physical_floor import decode_weight_bytes, physical_floor
    from pagedlab.workloads import make_workload

    config = tiny_llama.hf_model.config
    workload = make_workload("W-prefix", config.vocab_size, num_prompts=3)
    lens = [len(p) for p in workload.prompts]
    for caching, cached in ((True, 2048), (False, 0)):
        with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, dtype="float32",
                 enable_prefix_caching=caching) as llm:
            info = llm.get_engine_info()
            floor_s, prefill_floor_s = profile_steps.floors(llm, config, "W-prefix", workload)
        weights = decode_weight_bytes(info)
        assert floor_s == physical_floor(config, lens, workload.output_lens, cached_prefix=cached,
                                         kv_dtype_bytes=4, decode_weight_bytes=weights)
        assert prefill_floor_s == physical_floor(config, lens, [1] * 3, cached_prefix=cached)
