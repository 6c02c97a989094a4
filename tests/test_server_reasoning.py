"""Reasoning parsers (vLLM's ``--reasoning-parser``): the split of texts written by hand for each
parser, streams cut at every boundary adding up to the whole split, and a live server whose
tiny model is forced by a regex to think first: message.reasoning / content, their deltas,
include_reasoning=False, and tool calls read from the content only."""

from __future__ import annotations

import json
import random

import pytest

from pagedlab import LLM
from pagedlab.engine.async_engine import AsyncEngine
from pagedlab.reasoning_parsers import REASONING_PARSERS, ReasoningStream, reasoning_parser_named
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")

from pagedlab.server.app import ServerThread, build_app  # noqa: E402

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("text, deepseek_r1, qwen3", [
    ("<think>plan</think>answer", ("plan", "answer"), ("plan", "answer")),
    ("\n<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer"), ("\nplan\n", "\n\nanswer")),
    ("plan</think>answer", ("plan", "answer"), (None, "plan</think>answer")),  # R1's template opens it
    ("<think>still thinking", ("still thinking", None), ("still thinking", None)),  # cut by max_tokens
    ("just an answer", ("just an answer", None), (None, "just an answer")),
    ("<think>plan</think>", ("plan", None), ("plan", None)),
    ("<think></think>answer", ("", "answer"), ("", "answer")),
    ("a <think>b</think>c", ("a <think>b", "c"), (None, "a <think>b</think>c")),
])
def test_split_by_hand(text, deepseek_r1, qwen3):
    assert R1.split(text) == deepseek_r1
    assert QWEN3.split(text) == qwen3


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match=r"--reasoning-parser 'r2' is invalid: choose one of "
                                         r"\['deepseek_r1', 'qwen3'\]"):
        reasoning_parser_named("r2")


@pytest.mark.parametrize("parser", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
def test_streams_cut_anywhere_add_up_to_the_split(parser):
    """Random texts of tags, partial tags and words, streamed in random pieces: the reasoning and
    content deltas concatenate to the whole text's split, and nothing sent is ever taken back."""
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<", "</", "</th", "<thi", "think", ">", " ", "\n", "a", "plan", "ok"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        stream, reasoning, content = ReasoningStream(parser), "", ""
        for end in cuts + [len(text)]:
            r, c, so_far = stream.step(text[:end], finished=end == len(text) and end == cuts[-1])
            reasoning, content = reasoning + (r or ""), content + (c or "")
            assert so_far.startswith(content) or content.startswith(so_far)
        r, c, _ = stream.step(text, finished=True)
        reasoning, content = reasoning + (r or ""), content + (c or "")
        want_reasoning, want_content = parser.split(text)
        assert (reasoning, content) == (want_reasoning or "", want_content or ""), (text, cuts)


THINKING = r"<think>[a-z ]{4,12}</think>[a-z ]{2,8}"  # the model thinks, then answers
CALLING = (r'<think>[a-z ]{2,6}</think><tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}'
           r"</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One engine behind three servers: no parser, deepseek_r1 (with hermes tool calls), qwen3."""
    model_dir = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    llm = LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES)
    engine = AsyncEngine.from_llm(llm)
    apps = {"plain": build_app(engine, enable_metrics=False),
            "deepseek_r1": build_app(engine, enable_metrics=False, tool_calling={
                "reasoning_parser": "deepseek_r1", "tool_call_parser": "hermes",
                "enable_auto_tool_choice": True}),
            "qwen3": build_app(engine, enable_metrics=False, tool_calling={"reasoning_parser": "qwen3"})}
    threads = {name: ServerThread(app) for name, app in apps.items()}
    try:
        yield {name: thread.__enter__().url for name, thread in threads.items()}
    finally:
        for thread in threads.values():
            thread.__exit__(None, None, None)
        engine.shutdown()
        llm.close()


def _chat(url: str, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "Think, then answer."}], "temperature": 0,
            "max_tokens": 40, **body}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _streamed(url: str, **body) -> dict[str, str]:
    """Each delta field's concatenation over a stream."""
    body = {"messages": [{"role": "user", "content": "Think, then answer."}], "temperature": 0,
            "max_tokens": 40, "stream": True, **body}
    fields: dict[str, str] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for key, value in json.loads(line[6:])["choices"][0]["delta"].items():
                    if isinstance(value, str) and key != "role":
                        fields[key] = fields.get(key, "") + value
    return fields


def test_reasoning_and_content_of_a_thinking_model(served):
    """The same forced output without a parser, split by hand: both parsers put the think block in
    reasoning (and reasoning_content) and the rest in content; streams add up to the same."""
    text = _chat(served["plain"], guided_regex=THINKING)["message"]["content"]
    assert text.startswith("<think>") and "</think>" in text
    thought, _, answer = text[len("<think>"):].partition("</think>")
    for name in ("deepseek_r1", "qwen3"):
        message = _chat(served[name], guided_regex=THINKING)["message"]
        assert (message["reasoning"], message["reasoning_content"]) == (thought, thought)
        assert message["content"] == answer
        assert _streamed(served[name], guided_regex=THINKING) == {
            "reasoning": thought, "reasoning_content": thought, "content": answer}
    hidden = _chat(served["qwen3"], guided_regex=THINKING, include_reasoning=False)["message"]
    assert "reasoning" not in hidden and hidden["content"] == answer
    assert _streamed(served["qwen3"], guided_regex=THINKING, include_reasoning=False) == {"content": answer}


def test_unterminated_thinking_follows_each_parsers_rule(served):
    """Free text without tags (a model cut before </think>): deepseek_r1 calls it all reasoning,
    qwen3 all content; a plain server's stream chunks keep vLLM's "content" key, empty or not."""
    text = _chat(served["plain"], max_tokens=12)["message"]["content"]
    assert "think>" not in text
    assert _chat(served["deepseek_r1"], max_tokens=12)["message"] == {
        "role": "assistant", "content": None, "tool_calls": [], "reasoning": text, "reasoning_content": text}
    assert _streamed(served["deepseek_r1"], max_tokens=12) == {"reasoning": text, "reasoning_content": text}
    assert _chat(served["qwen3"], max_tokens=12)["message"] == {"role": "assistant", "content": text,
                                                               "tool_calls": []}
    assert _streamed(served["qwen3"], max_tokens=12) == {"content": text}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "stream": True,
            "logprobs": True}
    with httpx.stream("POST", served["plain"] + "/v1/chat/completions", json=body, timeout=60) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert deltas and all("content" in d for d in deltas)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"],
                         ids=["named", "required"])
def test_a_grammar_forced_output_is_content_unless_its_tags_say_otherwise(served, tool_choice):
    """A named or "required" tool_choice's grammar forces the call from the first token: with
    deepseek_r1 the call stays a call (no </think>, no reasoning), whole and streamed, as on a
    server without a parser; a grammar that writes the tags still gives reasoning."""
    want = _chat(served["plain"], tools=TOOLS, tool_choice=tool_choice, max_tokens=200)["message"]
    got = _chat(served["deepseek_r1"], tools=TOOLS, tool_choice=tool_choice, max_tokens=200)["message"]
    assert "reasoning" not in got and got["content"] == want["content"]
    assert [c["function"] for c in got["tool_calls"]] == [c["function"] for c in want["tool_calls"]]
    assert "reasoning" not in _streamed(served["deepseek_r1"], tools=TOOLS, tool_choice=tool_choice,
                                        max_tokens=200)
    assert want["tool_calls"] or tool_choice == "required"  # "required" may run out of tokens: content then
    forced = _chat(served["deepseek_r1"], guided_regex=THINKING)["message"]
    assert forced["reasoning"] and forced["content"]


def test_tool_calls_are_read_from_the_content_only(served):
    """A call after the think block is a tool call (hermes); the reasoning stays reasoning."""
    text = _chat(served["plain"], guided_regex=CALLING, max_tokens=200)["message"]["content"]
    thought = text[len("<think>"):].partition("</think>")[0]
    choice = _chat(served["deepseek_r1"], guided_regex=CALLING, tools=TOOLS, tool_choice="auto",
                   max_tokens=200)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] == thought
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == [("get_time", {"zone": "UTC"})]
    assert not choice["message"]["content"]
