"""The asynchronous step loop (step N+1 launched before step N is read back) against the
synchronous one, which the HF parity tests check; on the CPU both run the same kernels."""

from __future__ import annotations

import pytest

from conftest import KV_BYTES, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams


def _generate(path, prompts, params, **engine_args):
    with LLM(path, **{"kv_cache_memory_bytes": KV_BYTES, **engine_args}) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
    return outs, stats


def _summary(outs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
              c.logprobs, o.prompt_logprobs) for c in o.outputs] for o in outs]


def test_mixed_sampling_is_the_same_with_and_without_running_ahead(tiny_llama):
    prompts = random_prompts(12, max_len=70, seed=60)
    greedy = hf_greedy(tiny_llama.hf_model, prompts[3], 10, eos_token_id=None)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=12, n=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[greedy[4]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[greedy[4]], min_tokens=8,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.7, seed=13, max_tokens=1, logprobs=0),
        SamplingParams(temperature=0.5, min_p=0.1, seed=14, max_tokens=25, ignore_eos=True),
    ] + [SamplingParams(temperature=0.0, max_tokens=5 + 3 * i) for i in range(4)]
    sync, _sync_stats = _generate(tiny_llama.path, prompts, params, async_scheduling=False,
                                  max_num_batched_tokens=64)
    ahead, ahead_stats = _generate(tiny_llama.path, prompts, params, async_scheduling=True,
                                   max_num_batched_tokens=64)
    assert _summary(ahead) == _summary(sync)
    stop = greedy[4]
    assert ahead[3].outputs[0].token_ids == greedy[:greedy.index(stop) + 1]  # stopped at its first occurrence
    assert len(ahead[4].outputs[0].token_ids) >= 8
    assert ahead_stats.generation_tokens == sum(len(c.token_ids) for o in ahead for c in o.outputs)
    assert ahead_stats.kv_blocks_used == 0


def test_a_step_is_read_back_one_call_later(tiny_llama):
    prompt = random_prompts(1, seed=61)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    seen = {}
    for mode in (False, True):
        with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, async_scheduling=mode) as llm:
            engine = llm.llm_engine
            engine.add_request("r", prompt, params)
            counts = []
            while engine.has_unfinished_requests():
                counts.append([len(o.outputs[0].token_ids) for o in engine.step()])
            seen[mode] = counts
    assert seen[False] == [[1], [2], [3], [4]]
    assert seen[True] == [[], [1], [2], [3], [4]]  # the first call only launches


def test_no_token_is_computed_past_max_tokens(tiny_llama):
    """A request that has sampled all it may is not scheduled again while its last token is in flight."""
    prompts = random_prompts(6, max_len=40, seed=62)
    out_lens = [1, 2, 5, 9, 13, 20]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, async_scheduling=True) as llm:
        runner = llm.llm_engine.runner
        launch, computed = runner.launch, []

        def counting(batch, previous=None):
            computed.append(batch.total_tokens)
            return launch(batch, previous)

        runner.launch = counting
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == out_lens
    # every prompt token once, and each output token but the last fed back once
    assert sum(computed) == sum(map(len, prompts)) + sum(n - 1 for n in out_lens)


def test_no_token_is_computed_past_max_model_len(tiny_llama):
    """A request whose sampled tokens reach max_model_len (33) is not scheduled again while the
    last is in flight: position 32 would need a third block of the four, and the request beside
    it (two blocks) would be preempted for a token that is thrown away. As the synchronous loop:
    no preemption, the same tokens (HF's)."""
    prompts = random_prompts(1, min_len=20, max_len=20, seed=66) + random_prompts(1, min_len=16, max_len=16)
    params = [SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 slots, 2 KV heads of 16, float32
    runs = {mode: _generate(tiny_llama.path, prompts, params, async_scheduling=mode, max_model_len=33,
                            kv_cache_memory_bytes=4 * block_bytes) for mode in (False, True)}
    (sync, sync_stats), (ahead, ahead_stats) = runs[False], runs[True]
    assert ahead_stats.num_kv_blocks == 4
    assert ahead_stats.num_preemptions == sync_stats.num_preemptions == 0
    assert ahead_stats.prompt_tokens_computed == sync_stats.prompt_tokens_computed
    assert _summary(ahead) == _summary(sync)
    assert [o.outputs[0].token_ids for o in ahead] == [
        hf_greedy(tiny_llama.hf_model, p, n, eos_token_id=None) for p, n in zip(prompts, (13, 16))]


def test_abort_while_a_step_is_in_flight(tiny_llama):
    prompts = random_prompts(2, max_len=30, seed=63)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = hf_greedy(tiny_llama.hf_model, prompts[1], 30, eos_token_id=None)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, async_scheduling=True) as llm:
        engine = llm.llm_engine
        engine.add_request("a", prompts[0], params)
        engine.add_request("b", prompts[1], params)
        for _ in range(4):
            engine.step()
        used_before = engine.get_stats().kv_blocks_used
        aborted = engine.abort_request("a")
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        assert engine.get_stats().kv_blocks_used < used_before
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id == "b"
                final = out
        assert final.outputs[0].token_ids == expected
        assert engine.get_stats().kv_blocks_used == 0


def test_penalties_wait_for_every_token(tiny_llama):
    """A penalty reads the tokens sampled so far, so the loop does not run ahead of it."""
    prompts = random_prompts(3, max_len=30, seed=64)
    params = [SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.5, frequency_penalty=0.4,
                             ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, presence_penalty=1.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    sync, _ = _generate(tiny_llama.path, prompts, params, async_scheduling=False)
    ahead, _ = _generate(tiny_llama.path, prompts, params, async_scheduling=True)
    assert _summary(ahead) == _summary(sync)
    expected = hf_greedy(tiny_llama.hf_model, prompts[0], 16, eos_token_id=None, repetition_penalty=1.5)
    plain_ahead, _ = _generate(tiny_llama.path, prompts[:1],
                               SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.5,
                                              ignore_eos=True),
                               async_scheduling=True)
    assert plain_ahead[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("flag", [True, False])
def test_async_scheduling_is_a_plan_setting(tiny_llama, flag):
    prompts = random_prompts(3, max_len=30, seed=65)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        assert llm.llm_engine.async_scheduling is False  # the CPU default
        before = llm.generate(prompts, params, use_tqdm=False)
        llm.set_model_args(async_scheduling=flag)
        assert llm.llm_engine.async_scheduling is flag
        after = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_an_abort_while_its_prompt_logprobs_chunk_runs_leaves_the_rest_alone(tiny_llama):
    """With the next step launched before this one is read back, a request aborted (and its id
    reused) while its prompt chunk with prompt_logprobs runs: the chunk is dropped, the other
    request and the id's new request finish as they do alone."""
    prompt, other, reused = list(range(10, 60)), [1, 5, 6], [7, 8, 9, 10]
    logprobs = SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    args = dict(async_scheduling=True, max_num_batched_tokens=16, enable_chunked_prefill=True)
    alone = {tuple(p): _generate(tiny_llama.path, [p], s, **args)[0][0] for p, s in
             ((other, greedy), (reused, logprobs))}
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, **args) as llm:
        engine = llm.llm_engine
        engine.add_request("a", prompt, logprobs)
        engine.add_request("b", other, greedy)
        assert engine.step() == []  # the first chunk of "a" is in flight, nothing read back
        assert engine.abort_request("a").outputs[0].finish_reason == "abort"
        engine.add_request("a", reused, logprobs)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert llm.get_stats().kv_blocks_used == 0
    assert done["b"].outputs[0].token_ids == alone[tuple(other)].outputs[0].token_ids
    new, expected = done["a"], alone[tuple(reused)]  # its own prompt's records, none of the old chunk's
    assert new.outputs[0].token_ids == expected.outputs[0].token_ids
    assert len(new.prompt_logprobs) == len(reused) and new.prompt_logprobs[0] is None
    for got, want in zip(new.prompt_logprobs[1:], expected.prompt_logprobs[1:], strict=True):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
