"""The server under load (issue 18), bounded in count and time, on loopback: three rounds of mixed
requests (streaming and not, greedy and seeded, structured and not, completions and chat) from
concurrent clients, a third of which disconnect after their first chunk, with bad requests
interleaved. Afterwards every greedy and seeded answer equals the offline ``LLM.generate`` /
``LLM.chat``, every structured one is in its language, the KV cache is empty, nothing is left in
the engine or the server, the third round leaves no more of pagedlab's objects than the second,
and the /metrics counters agree with what the clients saw. A tiny random Llama with a real
tokenizer (test_server_support), so a round takes seconds on two cores."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import re
import time

import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine, RequestStream
from pagedlab.sampling_params import StructuredOutputsParams
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from pagedlab.server.app import ServerThread, build_app  # noqa: E402
from pagedlab.server.metrics import parse_metrics  # noqa: E402

PROMPTS = ["Why is the sky blue?", "The quick brown fox", "Paged attention stores", "Question: what is",
           "Once upon a time there", "A server streams tokens"]
MAX_TOKENS = 6
REQUESTS_PER_ROUND = 180
CONCURRENCY = 48
REGEX = r"(cat|dog)-[0-9]{2}"
CHOICES = ["red", "green", "blue"]
# Kinds of client, in turn; three of the nine disconnect after their first chunk.
KINDS = ["greedy", "greedy_stream", "seeded", "structured", "chat", "bad", "cancel", "cancel", "cancel"]
BAD_BODIES = [{"prompt": "hi", "n": 0}, {"prompt": "hi", "temperature": -1},
              {"prompt": "hi", "seed": 2 ** 70},
              {"prompt": "hi " * 700}, {"messages": "hi"}, {"prompt": "hi", "guided_regex": "("},
              "{not json"]
HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None


def _structured(i: int) -> tuple[dict, StructuredOutputsParams | None]:
    """Request fields and offline params of the i-th structured client (plain without xgrammar)."""
    if not HAS_XGRAMMAR:
        return {}, None
    if i % 2:
        return {"guided_regex": REGEX}, StructuredOutputsParams(regex=REGEX)
    return {"guided_choice": CHOICES}, StructuredOutputsParams(choice=CHOICES)


def _request(i: int) -> tuple[str, str, dict | str, tuple]:
    """(kind, path, body, key of the offline reference) of the i-th client."""
    kind, p = KINDS[i % len(KINDS)], i % len(PROMPTS)
    body = {"prompt": PROMPTS[p], "max_tokens": MAX_TOKENS, "temperature": 0}
    if kind == "greedy_stream" or kind == "cancel":
        return kind, "/v1/completions", {**body, "stream": True}, ("greedy", p)
    if kind == "seeded":
        return kind, "/v1/completions", {**body, "temperature": 0.8, "seed": p, "n": 2}, ("seeded", p)
    if kind == "structured":
        fields, _ = _structured(i)
        return kind, "/v1/completions", {**body, "max_tokens": 8, "stream": bool(i % 3), **fields}, (
            "structured", p, i % 2)
    if kind == "chat":
        return kind, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[p]}],
                                              "max_tokens": MAX_TOKENS, "temperature": 0}, ("chat", p)
    if kind == "bad":
        return kind, "/v1/completions", BAD_BODIES[i % len(BAD_BODIES)], ()
    return kind, "/v1/completions", body, ("greedy", p)


def _offline_references(llm: LLM) -> dict[tuple, list[str]]:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    refs = {("greedy", p): [o.outputs[0].text] for p, o in enumerate(outs)}
    seeded = [SamplingParams(temperature=0.8, seed=p, n=2, max_tokens=MAX_TOKENS)
              for p in range(len(PROMPTS))]
    for p, o in enumerate(llm.generate(PROMPTS, seeded, use_tqdm=False)):
        refs[("seeded", p)] = [c.text for c in o.outputs]
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    for p, o in enumerate(llm.chat(chats, greedy, use_tqdm=False)):
        refs[("chat", p)] = [o.outputs[0].text]
    for parity in (0, 1):
        spec = _structured(parity)[1]
        params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec)
        for p, o in enumerate(llm.generate(PROMPTS, params, use_tqdm=False)):
            refs[("structured", p, parity)] = [o.outputs[0].text]
    return refs


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llm = LLM(build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")),
              kv_cache_memory_bytes=TINY_KV_BYTES, max_num_seqs=16, async_scheduling=True)
    refs = _offline_references(llm)
    engine = AsyncEngine.from_llm(llm)
    app = build_app(engine, served_model_names=["tiny"])
    app.state.metrics.on_stats(engine.get_stats())  # the counters start with the offline references' tokens
    with ServerThread(app) as srv:
        yield {"url": srv.url, "engine": engine, "app": app, "refs": refs}
    engine.shutdown()
    llm.close()


async def _client(http, url: str, i: int) -> tuple[str, tuple, object]:
    """Run the i-th client: (kind, reference key, texts of its choices / its error / None if it left)."""
    kind, path, body, key = _request(i)
    if kind == "bad":
        raw = isinstance(body, str)
        r = await (http.post(url + path, content=body) if raw else http.post(url + path, json=body))
        return kind, key, (r.status_code, r.json())
    if not body.get("stream"):
        r = await http.post(url + path, json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        return kind, key, [c["message"]["content"] if "message" in c else c["text"] for c in choices]
    texts = {}
    async with http.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if kind == "cancel":
                return kind, key, None  # leaving the block closes the connection mid-stream
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return kind, key, [texts[k] for k in sorted(texts)]


async def _round(url: str, start: int) -> list[tuple[str, tuple, object]]:
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=CONCURRENCY)) as http:
        async def one(i):
            async with limit:
                return await _client(http, url, i)

        return await asyncio.gather(*(one(i) for i in range(start, start + REQUESTS_PER_ROUND)))


def _metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def _wait_idle(served, timeout: float = 30.0) -> dict[str, float]:
    """The metrics once the engine is idle and two scrapes agree (the engine thread publishes a
    finished request's stats just before its counters)."""
    deadline = time.monotonic() + timeout
    previous = None
    while True:
        m = _metrics(served["url"])
        stats = served["engine"].get_stats()
        idle = stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
        if idle and m == previous:
            return m
        previous = m if idle else None
        assert time.monotonic() < deadline, f"the server did not go idle: {stats}"
        time.sleep(0.1)


def _check_round(served, results, before: dict, after: dict) -> None:
    refs = served["refs"]
    finished = cancelled = 0
    for kind, key, got in results:
        if kind == "bad":
            status, body = got
            assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}, body
        elif got is None:
            cancelled += 1
        else:
            finished += 1
            assert got == refs[key], (kind, key, got, refs[key])
            if kind == "structured" and HAS_XGRAMMAR:
                assert re.fullmatch(REGEX, got[0]) if key[2] else got[0] in CHOICES
    assert cancelled == REQUESTS_PER_ROUND // 3 and finished > 0

    def delta(name: str) -> float:
        return after[name] - before[name]

    ended = delta("pagedlab:request_success_total") + delta("pagedlab:request_aborted_total")
    counts = {name: delta(name) for name in after if name.startswith("pagedlab:") and "{" not in name}
    assert ended == finished + cancelled, counts  # every request that reached the engine is counted once
    assert delta("pagedlab:request_success_total") >= finished, counts  # a few cancels may finish first
    assert delta("pagedlab:request_prompt_tokens_count") == ended, counts
    generated = delta("pagedlab:request_generation_tokens_sum")
    assert delta("pagedlab:generation_tokens_total") == generated, counts


def _live_objects(timeout: float = 30.0) -> int:
    """pagedlab's objects alive once the server's handlers have let go of every request stream (a
    client reads its last chunk before the handler that sent it finishes). Only pagedlab's types
    are counted: a loaded server's event loop may still hold a round's connection timers and
    handler frames (asyncio's and uvicorn's objects, hundreds on two busy cores) for seconds."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        objects = [o for o in gc.get_objects()
                   if str(getattr(type(o), "__module__", "")).startswith("pagedlab.")]
        if not any(isinstance(o, RequestStream) for o in objects):
            return len(objects)
        assert time.monotonic() < deadline, "the server still holds request streams"
        del objects
        time.sleep(0.1)


def test_mixed_load_rounds(served):
    engine, app = served["engine"], served["app"]
    counts = []
    for start in (0, REQUESTS_PER_ROUND, 2 * REQUESTS_PER_ROUND):
        before = _metrics(served["url"])
        results = asyncio.run(asyncio.wait_for(_round(served["url"], start), 240))
        after = _wait_idle(served)
        _check_round(served, results, before, after)
        assert engine.engine.output_processor.num_unfinished == 0 and not engine._streams
        assert app.state.admission.num_live_sequences() == 0
        counts.append(_live_objects())
    # the third round keeps none of its requests' objects: the last few finished requests (with
    # their metrics, parameters and grammar) may stay referenced until the next step replaces them,
    # up to about 20 objects seen; one kept object per request would be 180
    assert counts[2] - counts[1] < 40, counts
