"""vLLM's newer sampling features on the GPU path: decode and mixed-step CUDA graphs, the
asynchronous step loop and the GPU sampler, each in one batch of many requests. A thinking budget
forces its end marker after exactly B tokens (counted from the output ids) that are the unlimited
run's own; repetition detection cuts each forced cycle where the brute-force reference first finds
it; fixed-token prompt scores and trace replay's logprobs match HF transformers' float32
log-softmax, and each ``logprobs_mode``'s values a reference built from it."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from pagedlab import LLM, SamplingParams
from test_logprobs_mode import MODES, assert_mode_in_one_batch
from test_prompt_token_id_logprobs import IDS, assert_scores
from test_repetition_detection import assert_cycles_cut
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model, build_tiny_thinking_model
from test_thinking_budget import QWEN3, greedy, ids_of, sections
from test_trace_replay import assert_replayed, traced_params, traces

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = dict(device="cuda", kv_cache_memory_bytes=TINY_KV_BYTES, cuda_graph_mixed_steps=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_thinking_budgets_in_one_batch(tmp_path, dtype):
    with LLM(build_tiny_thinking_model(tmp_path), dtype=dtype, reasoning_config=QWEN3, **GPU) as llm:
        assert llm.get_engine_info().cuda_graphs
        think, end = ids_of(llm, "<think>"), ids_of(llm, "</think>")
        prompt = ids_of(llm, "Why is the sky blue?") + think
        budgets = [None, 0, 1, 2, 5, 9, 17] * 4
        outs = llm.generate([{"prompt_token_ids": prompt}] * len(budgets),
                            [greedy(24, thinking_token_budget=b) for b in budgets], use_tqdm=False)
    free = outs[0].outputs[0].token_ids
    assert not sections(free, think, end)  # the model alone never closes the section
    for budget, out in zip(budgets, outs):
        tokens = out.outputs[0].token_ids
        if budget is None:
            assert tokens == free
            continue
        (first, closed), = sections(prompt + tokens, think, end)
        assert closed - first == budget and tokens[:budget] == free[:budget], budget


def test_repetition_detection_cuts_every_cycle(tmp_path):
    with LLM(build_tiny_chat_model(tmp_path), dtype="bfloat16", **GPU) as llm:
        assert_cycles_cut(llm)


@pytest.mark.parametrize("max_num_batched_tokens", [None, 48])
def test_prompt_token_id_scores_match_hf(tiny_llama, max_num_batched_tokens):
    prompts = random_prompts(12, min_len=12, max_len=90, seed=11)
    starts = [0, 3, 11, 40] * 3
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprob_token_ids=IDS,
                             prompt_logprob_start=s) for s in starts]
    args = {**GPU, "kv_cache_memory_bytes": 64 << 20}
    if max_num_batched_tokens:
        args["max_num_batched_tokens"] = max_num_batched_tokens
    with LLM(tiny_llama.path, dtype="float32", **args) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, start in zip(outs, starts):
        assert_scores(out, tiny_llama, start)


def test_trace_replay_matches_hf(tiny_llama):
    prompts = random_prompts(6, min_len=4, max_len=30, seed=11)
    given = traces() * 2
    params = [p.clone(trace_decode_token_ids=t) for p, t in zip(traced_params() * 2, given)]
    with LLM(tiny_llama.path, dtype="float32", enable_trace_replay=True, **GPU) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, trace in zip(outs, given):
        assert_replayed(out, tiny_llama, trace)


def test_logprobs_modes_match_hf(tiny_llama):
    """Each logprobs_mode (switched by set_model_args) on the GPU sampler and its Gumbel kernel:
    the values of a mixed greedy / filtered / tempered batch against HF float32's reference."""
    with LLM(tiny_llama.path, dtype="float32", **GPU) as llm:
        for mode in MODES:
            llm.set_model_args(logprobs_mode=mode)
            assert_mode_in_one_batch(llm, tiny_llama, mode)
