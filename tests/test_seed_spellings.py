"""The seed's spellings, as printed: ``chunked_prefill_size``, ``benchmark(..., use_beam_search=...)``,
``trust_remote_code=True`` (no repository code ever runs) and a ``set_model_args`` loop over every
plan-level field."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch

from conftest import hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.config import PLAN_FIELDS
from pagedlab.lab.testing import make_tiny_model

KV = 16 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prefill_tokens_per_step(llm, *prompts: list[int]) -> list[int]:
    """Prompt tokens each engine step computed for the requests (submitted at once, one token
    each, the prefix cache emptied first), read from the engine's counters."""
    engine = llm.llm_engine
    llm.reset_prefix_cache()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"chunked-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    per_step, before = [], llm.get_stats().prompt_tokens_computed
    while engine.has_unfinished_requests():
        engine.step()
        now = llm.get_stats().prompt_tokens_computed
        per_step.append(now - before)
        before = now
    return [n for n in per_step if n]


def test_chunked_prefill_size_is_the_step_token_budget(tiny_llama):
    prompt = random_prompts(1, min_len=50, max_len=50, seed=4)[0]
    expected = hf_greedy(tiny_llama.hf_model, prompt, GREEDY.max_tokens)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV, chunked_prefill_size=16) as llm:
        assert llm.get_engine_info().max_num_batched_tokens == 16
        assert _prefill_tokens_per_step(llm, prompt) == [16, 16, 16, 2]
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
        llm.set_model_args(chunked_prefill_size=32)  # a plan field: the weights stay
        assert _prefill_tokens_per_step(llm, prompt) == [32, 18]
    with pytest.raises(ValueError, match="chunked_prefill_size=16 is invalid with enable_chunked_prefill"):
        LLM(tiny_llama.path, device="cpu", chunked_prefill_size=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="next to max_num_batched_tokens=64: both set the token budget"):
        LLM(tiny_llama.path, device="cpu", chunked_prefill_size=16, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def long_llm(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("seed") / "tiny", tokenizer=False,
                           max_position_embeddings=1024)
    with LLM(str(path), device="cpu", kv_cache_memory_bytes=64 << 20) as llm:
        yield llm


def test_benchmark_as_the_seed_prints_it(long_llm):
    result = long_llm.benchmark(batch_size=[4, 8, 16], input_len=512, output_len=128, use_beam_search=False)
    assert [r.batch_size for r in result.runs] == [4, 8, 16]
    for r in result.runs:
        assert not r.use_beam_search
        assert r.prompt_tokens == r.batch_size * 512
        assert r.output_tokens == r.engine_generation_tokens == r.batch_size * 128


@pytest.mark.parametrize("beam_width", [2, 3])
def test_benchmark_use_beam_search_runs_beam_search(long_llm, beam_width):
    result = long_llm.benchmark(batch_size=[2, 4], input_len=32, output_len=6, use_beam_search=True,
                                beam_width=beam_width, warmup=0)
    for r in result.runs:
        assert r.use_beam_search and r.output_tokens == r.batch_size * 6  # the best beam of each prompt
        # beam search's own trace: the first step extends the prompt alone, every later one each of
        # beam_width live beams (ignore_eos keeps them all alive)
        assert r.engine_generation_tokens == r.batch_size * (1 + 5 * beam_width)
    assert result.settings["beam_width"] == beam_width


def test_trust_remote_code_is_accepted_and_repository_code_never_runs(tiny_llama, tmp_path):
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV, trust_remote_code=True) as llm:
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(
            tiny_llama.hf_model, [5, 6, 7], GREEDY.max_tokens)
    custom = tmp_path / "custom"
    shutil.copytree(tiny_llama.path, custom)
    sentinel = tmp_path / "repository-code-ran"
    config = json.loads((custom / "config.json").read_text())
    config.update(architectures=["MyModelForCausalLM"], model_type="my_model",
                  auto_map={"AutoConfig": "modeling_my.MyConfig",
                            "AutoModelForCausalLM": "modeling_my.MyModelForCausalLM"})
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "modeling_my.py").write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
    with pytest.raises(ValueError, match=r"\['MyModelForCausalLM'\] \(model_type='my_model'\) is not "
                                         r"supported; supported architectures: \[.*'LlamaForCausalLM'.*never "
                                         r"a model repository's code"):
        LLM(str(custom), device="cpu", kv_cache_memory_bytes=KV, trust_remote_code=True)
    assert not sentinel.exists()


# One setting per plan-level field, and what the engine resolved it to (resolved_settings()).
ABLATION_PARAMS = [
    {"max_model_len": 256}, {"block_size": 32}, {"gpu_memory_utilization": 0.5},
    {"kv_cache_memory_bytes": 8 << 20}, {"max_num_seqs": 3}, {"max_num_batched_tokens": 64},
    {"enable_prefix_caching": False}, {"enable_chunked_prefill": False}, {"chunked_prefill_size": 32},
    {"kv_cache_dtype": "fp8"}, {"enforce_eager": True}, {"async_scheduling": True},
    {"enable_cascade_attention": False}, {"disable_log_stats": False}, {"batch_invariant": True},
    {"cuda_graph_mixed_steps": False}, {"scheduling_policy": "priority"}, {"stream_interval": 3},
    {"enable_return_routed_experts": True}, {"logprobs_mode": "processed_logprobs"},
    {"speculative_config": {"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                            "method": "ngram"}},
]


def test_set_model_args_loop_over_every_plan_field(tiny_llama):
    assert sorted(k for p in ABLATION_PARAMS for k in p) == sorted(PLAN_FIELDS), "a plan field is untested"
    prompts = random_prompts(6, min_len=20, max_len=40, seed=5)
    expected = [hf_greedy(tiny_llama.hf_model, p, GREEDY.max_tokens) for p in prompts]
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV) as llm:
        defaults = llm.get_engine_info().config
        blocks = llm.get_engine_info().num_kv_blocks
        for p in ABLATION_PARAMS:
            (field, value), = p.items()
            if field == "enable_return_routed_experts":  # a dense model refuses it (MoE: test_routed_experts)
                with pytest.raises(ValueError, match="LlamaForCausalLM has no mixture-of-experts layers"):
                    llm.set_model_args(**p)
                assert not llm.get_engine_info().config.enable_return_routed_experts
                continue
            llm.set_model_args(**p)
            info = llm.get_engine_info()
            resolved = info.resolved_settings()
            assert resolved[field] == (value if field != "kv_cache_dtype" else "float8_e4m3fn"), field
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            if field != "kv_cache_dtype":  # FP8 KV rounds the cache: tokens may differ
                assert [o.outputs[0].token_ids for o in outputs] == expected, field
            _check_effect(llm, field, value, blocks)
            llm.set_model_args(**{field: getattr(defaults, field)})
        assert llm.get_engine_info().num_kv_blocks == blocks


def _check_effect(llm, field: str, value, default_blocks: int) -> None:
    """What the engine does differently under one plan setting, beyond echoing it."""
    info, stats = llm.get_engine_info(), llm.get_stats()
    if field == "block_size":
        assert stats.block_size == value
    elif field == "kv_cache_memory_bytes":
        assert stats.kv_cache_bytes <= value and info.num_kv_blocks < default_blocks
    elif field in ("max_num_batched_tokens", "chunked_prefill_size"):
        assert info.max_num_batched_tokens == value
    elif field == "max_model_len":
        assert info.max_model_len == value
    elif field == "kv_cache_dtype":
        assert info.kv_cache_dtype == torch.float8_e4m3fn
    elif field == "batch_invariant":  # a prompt's logprobs do not move with its batch
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        alone = llm.generate([[5] * 20], params, use_tqdm=False)[0].prompt_logprobs
        mixed = llm.generate([[7] * 33, [5] * 20, [3] * 9], params, use_tqdm=False)[1].prompt_logprobs
        assert alone == mixed
    elif field == "max_num_seqs":  # six prompts at once, three a step
        assert _prefill_tokens_per_step(llm, *([t] * 20 for t in range(4, 10))) == [value * 20] * (6 // value)
    elif field == "enable_chunked_prefill":  # under a 64-token budget, whole prompts or none
        llm.set_model_args(max_model_len=64, max_num_batched_tokens=64)  # unchunked: budget >= length
        assert _prefill_tokens_per_step(llm, [4] * 50, [6] * 40) == [50, 40]  # chunked: [64, 26]
        llm.set_model_args(max_model_len=None, max_num_batched_tokens=None)
    elif field == "disable_log_stats":  # the stats line is logged
        records, logger = [], logging.getLogger("pagedlab.stats")
        handler, level = logging.Handler(), logger.level
        handler.emit = records.append
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            llm.generate([[4] * 20], GREEDY, use_tqdm=False)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        assert "KV cache" in records[-1].getMessage()
    elif field == "logprobs_mode":  # a top-2 row's logprobs: its two tokens share all the mass
        params = SamplingParams(temperature=0.5, top_k=2, seed=1, max_tokens=1, logprobs=3)
        step = llm.generate([[4] * 20], params, use_tqdm=False)[0].outputs[0].logprobs[0]
        values = sorted((lp.logprob for lp in step.values()), reverse=True)
        assert values[2] == float("-inf") and math.exp(values[0]) + math.exp(values[1]) == pytest.approx(1.0)
    elif field == "speculative_config":  # a repeating prompt's continuation is proposed and checked
        llm.generate([[4, 5, 6, 7] * 8], GREEDY, use_tqdm=False)
        assert llm.get_stats().spec_decode_num_drafts > 0
    elif field == "stream_interval":  # a stream's outputs: its first token, then every k-th, the last
        engine, shown = llm.llm_engine, []
        engine.add_request("interval", [4] * 20, GREEDY)
        while engine.has_unfinished_requests():
            shown += [len(o.outputs[0].token_ids) for o in engine.step()]
        total = shown[-1]
        assert shown == sorted(set(range(1, total, value)) | {total}) and total > value
    elif field == "scheduling_policy":  # priorities are taken (refused under FCFS)
        assert llm.generate([[4] * 20, [5] * 20], GREEDY, use_tqdm=False, priority=[1, 0])
    elif field == "enable_prefix_caching":
        llm.generate([[9] * 40], GREEDY, use_tqdm=False)
        llm.generate([[9] * 40], GREEDY, use_tqdm=False)
        assert llm.get_stats().prefix_cache_hit_tokens == 0
