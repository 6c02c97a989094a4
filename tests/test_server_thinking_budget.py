"""``thinking_token_budget`` over HTTP (vLLM's chat and completions field): the same tokens as the
offline ``LLM``, the section counted from the returned ids; bad values and a server without
markers give a 400 naming the field; ``--reasoning-parser`` gives the engine its markers."""

from __future__ import annotations

import argparse

import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine
from pagedlab.server.cli import reasoning_config_from_args
from test_server_support import TINY_KV_BYTES, build_tiny_thinking_model
from test_thinking_budget import sections

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from pagedlab.server.app import ServerThread, build_app  # noqa: E402

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Two servers of one model, with the qwen3 parser's markers and with none, and an offline
    ``LLM`` of the first's settings (the served ones run on their engine threads)."""
    model_dir = build_tiny_thinking_model(tmp_path_factory.mktemp("thinking"))
    markers = {"reasoning_config": {"reasoning_parser": "qwen3"}}
    llms = {name: LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, **args)
            for name, args in (("markers", markers), ("plain", {}), ("offline", markers))}
    engines = {name: AsyncEngine.from_llm(llms[name]) for name in ("markers", "plain")}
    threads = {name: ServerThread(build_app(engine, enable_metrics=False, tool_calling={
        "reasoning_parser": "qwen3"})) for name, engine in engines.items()}
    try:
        yield {"llm": llms["offline"], **{name: thread.__enter__().url for name, thread in threads.items()}}
    finally:
        for thread in threads.values():
            thread.__exit__(None, None, None)
        for engine in engines.values():
            engine.shutdown()
        for llm in llms.values():
            llm.close()


def _post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(url + path, json={"temperature": 0, "return_token_ids": True, **body}, timeout=60)


@pytest.mark.parametrize("budget", [0, 3])
def test_chat_forces_the_end_marker_as_offline(served, budget):
    llm, tokenizer = served["llm"], served["llm"].get_tokenizer()
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    r = _post(served["markers"], "/v1/chat/completions", messages=QUESTION, max_tokens=10,
              thinking_token_budget=budget, skip_special_tokens=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    offline = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=10, thinking_token_budget=budget),
                       use_tqdm=False)[0]
    assert choice["token_ids"] == offline.outputs[0].token_ids
    (first, closed), = sections(offline.prompt_token_ids + choice["token_ids"], [think], [end])
    assert closed - first == max(budget, 1)  # the template's "<think>\n": its newline counts
    assert choice["message"]["content"] is not None  # the reasoning parser split at the forced tag


def test_completions_count_from_a_prompt_that_opens_the_section(served):
    think, end = served["llm"].get_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
    prompt = [30, 31, 32, think]
    r = _post(served["markers"], "/v1/completions", prompt=prompt, max_tokens=8, thinking_token_budget=2)
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]["token_ids"]
    assert sections(prompt + out, [think], [end])[0] == (4, 6)
    unlimited = _post(served["markers"], "/v1/completions", prompt=prompt, max_tokens=8,
                      thinking_token_budget=-1)
    plain = _post(served["markers"], "/v1/completions", prompt=prompt, max_tokens=8)
    assert unlimited.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("value, message", [
    (-2, "thinking_token_budget=-2 is invalid"), (2.5, "2.5 is not valid for 'thinking_token_budget'"),
    (True, "True is not valid for 'thinking_token_budget'"),
    ("4", "'4' is not valid for 'thinking_token_budget'"),
])
def test_bad_budgets_are_400s_naming_the_field(served, value, message):
    r = _post(served["markers"], "/v1/chat/completions", messages=QUESTION, thinking_token_budget=value)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "thinking_token_budget" and message in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_server_without_markers_refuses_a_budget(served, stream):
    for path, body in (("/v1/completions", {"prompt": "hello"}),
                       ("/v1/chat/completions", {"messages": QUESTION})):
        r = _post(served["plain"], path, thinking_token_budget=5, stream=stream, **body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "thinking_token_budget" and "--reasoning-parser" in error["message"]
        unlimited = _post(served["plain"], path, thinking_token_budget=-1, stream=stream, **body)
        assert unlimited.status_code == 200


def test_the_reasoning_parser_flag_gives_the_engine_its_markers():
    def config(parser, given):
        return reasoning_config_from_args(argparse.Namespace(reasoning_parser=parser, reasoning_config=given))

    assert config(None, None) is None
    assert config("qwen3", None) == {"reasoning_parser": "qwen3"}
    ends = {"reasoning_end_str": "ok</think>"}
    assert config("deepseek_r1", ends) == {"reasoning_parser": "deepseek_r1", **ends}
    assert config("qwen3", {"reasoning_parser": "deepseek_r1"}) == {"reasoning_parser": "deepseek_r1"}
