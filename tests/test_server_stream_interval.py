"""The server's streaming under a stream interval: ``--stream-interval 2`` (the engine's) and a
request's ``stream_interval`` (vLLM's completions and chat field, clamped up to the server's). Each
chunk ends on a boundary of the interval (1, 1 + k, 1 + 2k, ... and the finish; the server's reader
may merge outputs it was slow to take, never split them), and the chunks add up to the
non-streamed response: text, token ids, logprobs and text offsets."""

from __future__ import annotations

import itertools

import pytest

from pagedlab import LLM
from pagedlab.engine.async_engine import AsyncEngine
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model
from test_stream_interval import boundaries

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from pagedlab.server.app import ServerThread, build_app  # noqa: E402  (needs the optional packages above)

MODEL = "tiny"
N = 11
BODY = dict(model=MODEL, max_tokens=N, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    llm = LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, stream_interval=2)
    engine = AsyncEngine.from_llm(llm)
    with ServerThread(build_app(engine, served_model_names=[MODEL])) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    engine.shutdown()
    llm.close()


def extra(request_k: int | None, **fields) -> dict:
    return {**BODY["extra_body"], **fields, **({} if request_k is None else {"stream_interval": request_k})}


@pytest.mark.parametrize("request_k, k", [(None, 2), (1, 2), (3, 3), (40, 40)])
def test_completion_chunks_end_on_boundaries_and_add_up(client, request_k, k):
    args = dict(BODY, prompt="Why is the sky blue?", logprobs=2,
                extra_body=extra(request_k, return_token_ids=True))
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))
    assert set(ends) <= set(boundaries(k)) and ends[-1] == N
    assert len(chunks) <= len(boundaries(k))  # 40: the first token, then the rest at the finish
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c.logprobs, field)] == getattr(whole.logprobs, field)
    assert chunks[-1].finish_reason == whole.finish_reason == "length"


@pytest.mark.parametrize("request_k, k", [(None, 2), (3, 3)])
def test_chat_chunks_end_on_boundaries_and_add_up(client, request_k, k):
    args = dict(BODY, messages=[{"role": "user", "content": "hello world"}], logprobs=True, top_logprobs=1,
                extra_body=extra(request_k))
    whole = client.chat.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**args, stream=True) if c.choices]
    sized = [c for c in chunks if c.logprobs is not None]  # the role chunk carries no token
    ends = list(itertools.accumulate(len(c.logprobs.content) for c in sized))
    assert set(ends) <= set(boundaries(k)) and ends[-1] == N
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
    assert [p.model_dump() for c in sized for p in c.logprobs.content] == \
        [p.model_dump() for p in whole.logprobs.content]
