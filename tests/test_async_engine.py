"""AsyncEngine: online continuous batching, token-by-token streams, abort, errors, shutdown."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from conftest import hf_greedy
from pagedlab import LLM, SamplingParams
from pagedlab.config import EngineConfig
from pagedlab.engine.async_engine import AsyncEngine, EngineDeadError
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["Why is the sky blue?", "The quick brown fox", "Paged attention stores", "hello world, how are",
           "Question: what is two plus two?", "Once upon a time"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module", params=[False, True], ids=["sync-steps", "async-steps"])
def offline(model_dir, request):
    """Offline results first, then the same engine core served by an AsyncEngine; with the
    synchronous and the asynchronous step loop (the GPU default)."""
    llm = LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, async_scheduling=request.param)
    expected = {p: o.outputs[0] for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False))}
    long = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    seeded = llm.generate(PROMPTS[1], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8),
                          use_tqdm=False)[0].outputs
    engine = AsyncEngine.from_llm(llm)
    yield engine, expected, long, seeded
    engine.shutdown()
    llm.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def collect(engine, prompt, params):
    outs = []
    async for out in engine.generate(prompt, params):
        outs.append(out)
    return outs


def test_streams_token_by_token_and_matches_offline(offline):
    engine, expected, _, _ = offline
    outs = run(collect(engine, PROMPTS[0], GREEDY))
    final = outs[-1]
    assert final.finished and all(not o.finished for o in outs[:-1])
    want = expected[PROMPTS[0]]
    assert final.outputs[0].token_ids == want.token_ids
    assert final.outputs[0].text == want.text
    # Alone in the engine, every step adds one token; outputs the consumer had not read yet are
    # merged (they are cumulative), which a loaded machine may cause now and then.
    counts = [len(o.outputs[0].token_ids) for o in outs]
    assert counts == sorted(set(counts)) and counts[-1] == len(want.token_ids)
    assert sum(b - a == 1 for a, b in zip([0] + counts, counts)) >= len(counts) // 2
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))


def test_concurrent_requests_match_offline(offline):
    engine, expected, _, _ = offline

    async def main():
        return await asyncio.gather(*(collect(engine, p, GREEDY) for p in PROMPTS))

    results = run(main())
    for prompt, outs in zip(PROMPTS, results):
        assert outs[-1].outputs[0].token_ids == expected[prompt].token_ids
        assert outs[-1].outputs[0].text == expected[prompt].text
    assert engine.get_stats().num_running == 0


def test_requests_join_a_running_batch(offline):
    """A request added while another is decoding gets its tokens before the first one ends."""
    engine, expected, long, _ = offline
    long_params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def main():
        events = []

        async def first():
            async for out in engine.generate(PROMPTS[0], long_params):
                events.append(("long", len(out.outputs[0].token_ids), out.finished))
            return out

        async def second():
            while not any(e[0] == "long" and e[1] >= 5 for e in events):
                await asyncio.sleep(0.001)
            final = None
            async for out in engine.generate(PROMPTS[1], GREEDY):
                events.append(("short", len(out.outputs[0].token_ids), out.finished))
                final = out
            return final

        a, b = await asyncio.gather(first(), second())
        return events, a, b

    events, a, b = run(main())
    assert a.outputs[0].token_ids == long.token_ids
    assert b.outputs[0].token_ids == expected[PROMPTS[1]].token_ids
    short_done = next(i for i, e in enumerate(events) if e[0] == "short" and e[2])
    long_done = next(i for i, e in enumerate(events) if e[0] == "long" and e[2])
    assert short_done < long_done  # finished inside the long request's run
    first_short = next(i for i, e in enumerate(events) if e[0] == "short")
    assert events[first_short - 1][0] == "long" and events[first_short - 1][1] < 60


def test_n_and_seed_match_offline(offline):
    engine, _, _, seeded = offline
    outs = run(collect(engine, PROMPTS[1], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)))
    assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in seeded]


def _wait_idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.get_stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"the engine did not go idle: {engine.get_stats()}")


def test_abort_frees_blocks(offline):
    engine, _, _, _ = offline
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        stream = engine.add_request(PROMPTS[2], params)
        seen = 0
        async for out in stream:
            seen = len(out.outputs[0].token_ids)
            if seen >= 3:
                assert engine.get_stats().kv_blocks_used > 0
                break  # leaving the iteration early aborts
        stream.abort()
        return seen

    assert run(main()) >= 3
    _wait_idle(engine)
    assert not engine.call(lambda e: e.has_unfinished_requests()).result(10)


def test_closing_generator_aborts_and_explicit_abort_reports_abort(offline):
    engine, _, _, _ = offline
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        gen = engine.generate(PROMPTS[3], params, request_id="to-close")
        await gen.__anext__()
        await gen.aclose()
        stream = engine.add_request(PROMPTS[4], params, request_id="to-abort")
        await stream.__anext__()
        engine.abort("to-abort")  # from outside: the stream ends with finish_reason "abort"
        last = None
        async for out in stream:
            last = out
        return last

    last = run(main())
    assert last is not None and last.finished and last.outputs[0].finish_reason == "abort"
    _wait_idle(engine)


def test_cancelled_task_aborts(offline):
    engine, _, _, _ = offline
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        task = asyncio.create_task(collect(engine, PROMPTS[5], params))
        while engine.get_stats().num_running == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    _wait_idle(engine)


def test_public_surface_for_the_server(offline, model_dir):
    """What the server reads: the engine's info, its limits, and prompt checks without queueing."""
    engine, _, _, _ = offline
    info = engine.info
    assert str(info.model_path) == model_dir and info.max_model_len == engine.max_model_len
    assert info.tokenizer is engine.tokenizer and engine.model_name == model_dir
    engine.validate_prompt([5, 6, 7])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.validate_prompt([5] * engine.max_model_len)
    with pytest.raises(ValueError, match="out of range"):
        engine.validate_prompt([1, info.hf_config.vocab_size])
    with pytest.raises(ValueError, match="empty"):
        engine.validate_prompt([])
    assert engine.get_stats().num_running == 0 and engine.get_stats().num_waiting == 0


def test_bad_requests_fail_alone(offline):
    engine, expected, _, _ = offline

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request(list(range(3, 3 + engine.max_model_len)), GREEDY)
        with pytest.raises(ValueError, match="out of range"):
            engine.add_request([1, 10_000_000], GREEDY)
        with pytest.raises(ValueError, match="empty"):
            engine.add_request([], GREEDY)
        with pytest.raises(ValueError, match=r"^params=\{'max_tokens': 4\} is invalid: give a Sampling"):
            engine.add_request(PROMPTS[0], {"max_tokens": 4})
        stream = engine.add_request(PROMPTS[0], GREEDY, request_id="dup")
        dup = engine.add_request(PROMPTS[0], GREEDY, request_id="dup")
        with pytest.raises(ValueError, match="already in use"):
            await dup.result()
        abandoned = engine.add_request(PROMPTS[0], GREEDY, request_id="dup")
        abandoned.abort()  # before reading its refusal: it must not abort the request it collided with
        return await stream.result()

    out = run(main())
    assert out.outputs[0].token_ids == expected[PROMPTS[0]].token_ids


def test_call_runs_in_the_engine_thread(offline):
    engine, _, _, _ = offline
    name = engine.call(lambda e: threading.current_thread().name).result(10)
    assert name == "pagedlab-engine" and name != threading.current_thread().name
    run(engine.reset_prefix_cache())
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda e: 1 / 0).result(10)
    assert engine.is_running


class Listener:
    """A StatsListener that keeps what it is told."""

    def __init__(self):
        self.stats, self.finished = [], []

    def on_stats(self, stats):
        self.stats.append(stats)

    def on_request_finished(self, output):
        self.finished.append(output)


def test_listener_sees_stats_and_finished_requests(offline):
    engine, _, _, _ = offline
    listener = Listener()
    engine.add_listener(listener)
    try:
        run(collect(engine, PROMPTS[1], GREEDY))
        _wait_idle(engine)
    finally:
        engine.listeners.remove(listener)
    assert len(listener.finished) == 1 and listener.finished[0].finished
    m = listener.finished[0].metrics
    assert m.first_token_time >= m.arrival_time and m.finished_time >= m.first_token_time
    assert listener.stats and listener.stats[-1].generation_tokens > 0


def test_from_engine_config_and_shutdown(model_dir):
    engine = AsyncEngine.from_engine_config(EngineConfig(model=model_dir,
                                                         kv_cache_memory_bytes=TINY_KV_BYTES))
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)

    async def main():
        stream = engine.add_request(PROMPTS[0], params)
        await stream.__anext__()
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            engine.add_request(PROMPTS[0], params)

    run(main())
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        engine.call(lambda e: None).result(1)
    engine.close()


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(offline):
    """The requests in flight fail with the step's error; listeners see each finish once, as
    aborted (the server's request_aborted_total counts them); the next request runs."""
    engine, expected, _, _ = offline
    listener = Listener()
    runner = engine.engine.runner
    real_launch = runner.launch
    calls = {"n": 0}

    def flaky(batch, previous=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real_launch(batch, previous)

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gate = threading.Event()
        engine.call(lambda e: gate.wait(10))  # hold the engine thread so the three arrive together
        streams = [engine.add_request(p, params, request_id=f"failing-{i}")
                   for i, p in enumerate(PROMPTS[:3])]
        runner.launch = flaky
        engine.add_listener(listener)
        gate.set()
        return await asyncio.gather(*(s.result() for s in streams), return_exceptions=True)

    try:
        results = run(main())
    finally:
        runner.launch = real_launch
        engine.listeners.remove(listener)
    assert calls["n"] >= 2
    assert all(isinstance(r, RuntimeError) and "injected failure" in str(r) for r in results), results
    assert sorted(out.request_id for out in listener.finished) == ["failing-0", "failing-1", "failing-2"]
    assert all(c.finish_reason == "abort" for out in listener.finished for c in out.outputs)
    _wait_idle(engine)
    out = run(collect(engine, PROMPTS[0], GREEDY))[-1]
    assert out.outputs[0].token_ids == expected[PROMPTS[0]].token_ids


def test_final_only_requests(offline):
    """stream=False: only the final output is wanted; mixed with a streaming request, both right."""
    engine, expected, _, _ = offline

    async def main():
        quiet = [engine.add_request(p, GREEDY, stream=False) for p in PROMPTS[:3]]
        outs = []
        for stream in quiet:  # (an async comprehension inside a list comprehension needs Python 3.11)
            outs.append([o async for o in stream])
        mixed_quiet = engine.add_request(PROMPTS[3], GREEDY, stream=False)
        loud = await collect(engine, PROMPTS[4], GREEDY)
        return outs, await mixed_quiet.result(), loud

    outs, mixed_quiet, loud = run(main())
    for prompt, got in zip(PROMPTS[:3], outs):
        assert len(got) == 1 and got[0].finished
        assert got[0].outputs[0].token_ids == expected[prompt].token_ids
        assert got[0].outputs[0].text == expected[prompt].text
    assert mixed_quiet.outputs[0].token_ids == expected[PROMPTS[3]].token_ids
    assert len(loud) > 1 and loud[-1].outputs[0].token_ids == expected[PROMPTS[4]].token_ids
    assert engine._num_token_streams == 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(offline, model_dir):
    """A prompt longer than max_model_len is served from its last truncate_prompt_tokens tokens
    (-1: the most that leave room for one token), as HF continues those tokens alone."""
    import transformers

    engine, _, _, _ = offline
    ids = [5 + i % 300 for i in range(engine.max_model_len + 10)]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request(ids, greedy)
        cut = await engine.add_request(ids, greedy.clone(truncate_prompt_tokens=20)).result()
        longest = await engine.add_request(ids, greedy.clone(max_tokens=1, truncate_prompt_tokens=-1)
                                           ).result()
        return cut, longest

    cut, longest = run(main())
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert cut.prompt_token_ids == ids[-20:]
    assert cut.outputs[0].token_ids == hf_greedy(hf, ids[-20:], 3, eos_token_id=None)
    assert longest.prompt_token_ids == ids[-(engine.max_model_len - 1):]
