"""The server on the real embedded model (SmolLM2-135M-Instruct), one module-scoped server.

Kept small (the CPU is shared): a few chats and completions, greedy, compared with the offline
``LLM`` on the same engine core.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re

import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.sampling_params import StructuredOutputsParams
from pagedlab.engine.async_engine import AsyncEngine

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from pagedlab.server.app import ServerThread, build_app  # noqa: E402  (needs the optional packages above)

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 24
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are a terse assistant."},
          {"role": "user", "content": "Name three primary colors."}]]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The first president of the"]
CITY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
               "properties": {"city": {"type": "string", "maxLength": 20},
                              "country": {"type": "string", "maxLength": 20}}}
STRUCTURED = [  # (the grammar, the same as request fields), each on one chat
    (StructuredOutputsParams(json=CITY_SCHEMA, disable_any_whitespace=True),
     {"structured_outputs": {"json": CITY_SCHEMA, "disable_any_whitespace": True}}),
    (StructuredOutputsParams(regex=r"[0-9]{1,3} degrees"), {"guided_regex": r"[0-9]{1,3} degrees"}),
    (StructuredOutputsParams(choice=["Paris", "London"]), {"guided_choice": ["Paris", "London"]}),
]
STRUCTURED_CHATS = [[{"role": "user", "content": "The capital of France as JSON with city and country."}],
                    [{"role": "user", "content": "At what temperature in Celsius does water boil?"}],
                    CHATS[0]]


@pytest.fixture(scope="module")
def served():
    llm = LLM(MODEL, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = {"chats": [o.outputs[0] for o in llm.chat(CHATS, greedy, use_tqdm=False)],
                "texts": [o.outputs[0] for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]}
    if importlib.util.find_spec("xgrammar") is not None:
        structured = [greedy.clone(max_tokens=32, structured_outputs=spec) for spec, _ in STRUCTURED]
        outs = llm.chat(STRUCTURED_CHATS, structured, use_tqdm=False)
        expected["structured"] = [o.outputs[0] for o in outs]
    engine = AsyncEngine.from_llm(llm)
    with ServerThread(build_app(engine)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield {"url": srv.url, "client": client, "expected": expected}
    engine.shutdown()
    llm.close()


def test_chat_matches_offline_chat(served):
    client = served["client"]
    for conversation, want in zip(CHATS, served["expected"]["chats"]):
        r = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=MAX_TOKENS,
                                           temperature=0)
        assert r.choices[0].message.content == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.completion_tokens == len(want.token_ids)
    assert "Paris" in served["expected"]["chats"][0].text


def test_streamed_chat_equals_full_response(served):
    client = served["client"]
    want = served["expected"]["chats"][1]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_concurrent_streamed_completions_match_offline(served):
    async def main():
        client = openai.AsyncOpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0,
                                    timeout=120)

        async def one(prompt):
            text = ""
            chunks = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True)
            async for chunk in chunks:
                text += "".join(c.text for c in chunk.choices)
            return text

        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await client.close()

    texts = asyncio.run(asyncio.wait_for(main(), 300))
    assert texts == [w.text for w in served["expected"]["texts"]]


def test_logprobs_and_stop(served):
    client = served["client"]
    r = client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)
    want = served["expected"]["texts"][0].text
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  stop=["."])
    assert r.choices[0].text == want.split(".")[0]


def test_structured_chats_validate_and_match_offline(served):
    pytest.importorskip("xgrammar")
    client = served["client"]
    for (spec, fields), chat, want in zip(STRUCTURED, STRUCTURED_CHATS, served["expected"]["structured"]):
        r = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=32, temperature=0,
                                           extra_body=fields)
        text = r.choices[0].message.content
        assert text == want.text and r.choices[0].finish_reason == "stop"
        if spec.json is not None:
            import jsonschema

            jsonschema.validate(json.loads(text), CITY_SCHEMA)
        elif spec.regex is not None:
            assert re.fullmatch(spec.regex, text)
        else:
            assert text in spec.choice
