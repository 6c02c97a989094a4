"""``scheduling_policy="priority"`` (vLLM's) through the public API: ``LLM.generate(priority=...)``,
``AsyncEngine.add_request(priority=...)`` and the server's ``priority`` field run the lower
priorities first (one sequence at a time, the finishing order shows it), every output still HF
transformers' greedy tokens; a priority other than 0 under FCFS, a count other than one per
prompt or a non-integer is an error naming it. The scheduler's own rules: test_scheduler.py."""

from __future__ import annotations

import asyncio

import pytest

from conftest import KV_BYTES, assert_hf_tokens_and_logprobs, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine

MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
PRIORITIES = [2, 0, 3, 1]


def _engine(path, **engine_args) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_num_seqs=1, **engine_args)


def test_generate_runs_lower_priorities_first(tiny_llama):
    prompts = random_prompts(len(PRIORITIES), max_len=30, seed=31)
    with _engine(tiny_llama.path, scheduling_policy="priority") as llm:
        finished = list(llm.generate_as_completed(prompts, GREEDY, use_tqdm=False, priority=PRIORITIES))
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=PRIORITIES)
    assert [i for i, _ in finished] == [1, 3, 0, 2]
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, prompts, outs, MAX_TOKENS)


def test_bad_priorities_are_errors_naming_them(tiny_llama):
    prompts = [[1, 2, 3], [4, 5]]
    with _engine(tiny_llama.path) as fcfs:
        with pytest.raises(ValueError, match=r"priority=1 is invalid: .*scheduling_policy='priority' "
                                             r"\(this engine's is 'fcfs'\)"):
            fcfs.generate(prompts, GREEDY, use_tqdm=False, priority=[0, 1])
        assert fcfs.generate(prompts, GREEDY, use_tqdm=False, priority=[0, 0])  # 0 is every request's
        assert not fcfs.llm_engine.has_unfinished_requests()
    with _engine(tiny_llama.path, scheduling_policy="priority") as llm:
        with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
            llm.generate(prompts, GREEDY, use_tqdm=False, priority=[1])
        for whole in (5, "5"):
            with pytest.raises(ValueError, match=rf"priority={whole!r} is invalid: give a list of one"):
                llm.generate(prompts, GREEDY, use_tqdm=False, priority=whole)
        for bad in (1.5, True, "1"):
            with pytest.raises(ValueError, match=rf"priority={bad!r} is invalid: a priority is an integer"):
                llm.generate(prompts, GREEDY, use_tqdm=False, priority=[0, bad])
        assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued
    choices = r"scheduling_policy='lifo' is invalid: .*one of \('fcfs', 'priority'\)"
    with pytest.raises(ValueError, match=choices):
        LLM(tiny_llama.path, scheduling_policy="lifo")


def test_async_engine_and_server_take_priorities(tiny_llama):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from pagedlab.server.app import ServerThread, build_app

    prompts = random_prompts(len(PRIORITIES), max_len=30, seed=32)
    greedy = GREEDY.clone(detokenize=False)  # no tokenizer in the tiny model

    async def in_priority_order(engine):
        """Queued while a first request (priority -1) holds the one sequence slot, so every one
        of them waits and the queue's order alone decides."""
        long = SamplingParams(max_tokens=300, ignore_eos=True, detokenize=False)
        blocker = engine.add_request([9, 9, 9], long, priority=-1)
        await blocker.__anext__()  # running
        finished = []

        async def one(i):
            out = await engine.add_request(prompts[i], greedy, priority=PRIORITIES[i]).result()
            finished.append(i)
            return out

        outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        await blocker.aclose()
        return outs, finished

    with _engine(tiny_llama.path, scheduling_policy="priority", max_model_len=512) as llm:
        engine = AsyncEngine.from_llm(llm)
        try:
            outs, finished = asyncio.run(asyncio.wait_for(in_priority_order(engine), 120))
            with ServerThread(build_app(engine, enable_metrics=False)) as srv:
                body = {"prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True}
                r = httpx.post(srv.url + "/v1/completions", json={**body, "priority": -4}, timeout=60)
                assert r.status_code == 200
                assert r.json()["choices"][0]["token_ids"] == outs[0].outputs[0].token_ids
                r = httpx.post(srv.url + "/v1/completions", json={**body, "priority": "high"}, timeout=60)
                assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        finally:
            engine.shutdown()
    assert finished == [1, 3, 0, 2]
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, prompts, outs, MAX_TOKENS)
