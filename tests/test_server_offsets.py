"""``/v1/completions`` logprobs with ``echo`` and streaming: how many top logprobs an echoed prompt
position carries, and ``text_offset`` (the running length of the token strings, as vLLM's), on a
tiny random Llama with a real tokenizer served live on 127.0.0.1. The references are the
tokenizer's own decode of each token, the response without ``echo`` and the non-streamed response.
The engine's ``max_logprobs`` (``--max-logprobs``) is 30 here, the server's cap in place of 20."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from pagedlab.server.app import ServerThread, build_app  # noqa: E402
from pagedlab.server.cli import add_serve_args  # noqa: E402

MODEL = "tiny"
MAX_LOGPROBS = 30  # the engine's cap, above the server's default 20
PROMPT = "The sky is"
# the greedy completion of PROMPT has tokens that end mid-character (their text waits for the next)
SPLIT_CHARACTER = {"prompt": PROMPT}
# a stop string that never matches: the stream holds text back while its tokens go out
HELD_BACK = {"prompt": [322, 74, 409, 305], "stop": ["zzzzzz"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    llm = LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, max_logprobs=MAX_LOGPROBS)
    offline = llm.chat([{"role": "user", "content": PROMPT}],
                       SamplingParams(temperature=0.0, max_tokens=3, logprobs=MAX_LOGPROBS), use_tqdm=False)
    engine = AsyncEngine.from_llm(llm)
    with ServerThread(build_app(engine, served_model_names=[MODEL])) as srv:
        yield {"url": srv.url, "tokenizer": llm.get_tokenizer(), "offline_chat": offline[0].outputs[0],
               "engine": engine}
    engine.shutdown()
    llm.close()


def _complete(served, body: dict) -> dict:
    r = httpx.post(served["url"] + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(served, body: dict, path: str = "/v1/completions") -> list[dict]:
    """The chunks of a streamed completion (or chat completion)."""
    chunks = []
    with httpx.stream("POST", served["url"] + path,
                      json={"model": MODEL, **body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def _tokens_and_offsets(logprobs: dict) -> list[tuple[str, int]]:
    return list(zip(logprobs["tokens"], logprobs["text_offset"], strict=True))


def test_echoed_positions_carry_logprobs_plus_one(served):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": 1, "echo": True,
            "return_token_ids": True}
    plain = _complete(served, body)["choices"][0]
    wide = _complete(served, {**body, "prompt_logprobs": 5})["choices"][0]
    # prompt_logprobs keeps its own count: the chosen token and the 5 most likely at each position
    assert all(sorted(e["rank"] for e in pos.values())[:5] == [1, 2, 3, 4, 5]
               for pos in wide["prompt_logprobs"][1:])
    # the echoed positions do not: the chosen token and the `logprobs` most likely, as without it
    assert wide["logprobs"]["top_logprobs"] == plain["logprobs"]["top_logprobs"]
    for top, pos, token in zip(wide["logprobs"]["top_logprobs"][1:], wide["prompt_logprobs"][1:],
                               wide["prompt_token_ids"][1:]):
        kept = [(tid, e) for tid, e in pos.items() if e["rank"] <= 1 or int(tid) == token]
        # tokens that decode alike share one entry, the most likely one's
        want = {e["decoded_token"]: e["logprob"] for _, e in sorted(kept, key=lambda kv: -kv[1]["rank"])}
        assert top == pytest.approx(want)


def test_prompt_logprobs_keep_their_count_beside_echo(served):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    alone = _complete(served, body)["choices"][0]["prompt_logprobs"]
    with_echo = _complete(served, {**body, "logprobs": 3, "echo": True})["choices"][0]
    assert with_echo["prompt_logprobs"] == alone
    assert max(len(top) for top in with_echo["logprobs"]["top_logprobs"][1:]) == 4


def test_echo_offsets_run_over_prompt_then_completion_tokens(served):
    tokenizer = served["tokenizer"]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0, "return_token_ids": True}
    echoed = _complete(served, {**body, "echo": True})["choices"][0]
    plain = _complete(served, body)["choices"][0]
    n_prompt = len(echoed["prompt_token_ids"])
    strings = [tokenizer.decode([t]) for t in echoed["prompt_token_ids"] + echoed["token_ids"]]
    assert echoed["logprobs"]["tokens"] == strings
    want = list(itertools.accumulate((len(s) for s in strings[:-1]), initial=0))
    assert echoed["logprobs"]["text_offset"] == want
    # the completion's offsets are those without echo, after the prompt's token strings
    prompt_len = sum(len(s) for s in strings[:n_prompt])
    assert [o - prompt_len for o in want[n_prompt:]] == plain["logprobs"]["text_offset"]


@pytest.mark.parametrize("extra", [
    SPLIT_CHARACTER, HELD_BACK, {**SPLIT_CHARACTER, "echo": True}, {**HELD_BACK, "echo": True},
    {"prompt": [PROMPT, "Once upon"], "stop": ["zzzzzz"], "n": 2, "seed": 3, "temperature": 1.0},
], ids=["split-character", "held-back", "split-character-echo", "held-back-echo", "prompts-and-n"])
def test_streamed_offsets_equal_the_full_response(served, extra):
    body = {"max_tokens": 10, "temperature": 0, "logprobs": 0, **extra}
    full = sorted(_complete(served, body)["choices"], key=lambda c: c["index"])
    streamed: dict[int, list[tuple[str, int]]] = {c["index"]: [] for c in full}
    texts = dict.fromkeys(streamed, "")
    for chunk in _stream(served, body):
        for c in chunk["choices"]:
            streamed[c["index"]] += _tokens_and_offsets(c["logprobs"])
            texts[c["index"]] += c["text"]
    for choice in full:
        assert texts[choice["index"]] == choice["text"]
        assert streamed[choice["index"]] == _tokens_and_offsets(choice["logprobs"])


def test_echo_with_max_tokens_zero_returns_the_prompt_scored(served):
    """vLLM's (and OpenAI's legacy) scoring call, echo with max_tokens=0: the choice is the prompt
    alone, its logprobs those of the prompt positions exactly as echo with one generated token
    gives them, no generated token in text, logprobs or token_ids; streamed the same; without
    echo max_tokens=0 is a 400 naming max_tokens."""
    body = {"prompt": PROMPT, "temperature": 0, "logprobs": 1, "echo": True, "return_token_ids": True}
    scored = _complete(served, {**body, "max_tokens": 0})["choices"][0]
    one = _complete(served, {**body, "max_tokens": 1})["choices"][0]
    num_prompt = len(one["prompt_token_ids"])
    assert scored["text"] == PROMPT and one["text"].startswith(PROMPT) and one["text"] != PROMPT
    assert scored["token_ids"] == [] and scored["prompt_token_ids"] == one["prompt_token_ids"]
    assert scored["finish_reason"] == "length"
    assert scored["logprobs"] == {key: values[:num_prompt] for key, values in one["logprobs"].items()}
    assert scored["logprobs"]["token_logprobs"][0] is None and len(scored["logprobs"]["tokens"]) == num_prompt
    chunks = _stream(served, {**body, "max_tokens": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for lp in streamed for t in lp["tokens"]] == scored["logprobs"]["tokens"]
    assert [t for lp in streamed for t in lp["text_offset"]] == scored["logprobs"]["text_offset"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    r = httpx.post(served["url"] + "/v1/completions",
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_tokens" and "needs echo=true" in error["message"]


def test_bench_serve_sizes_sharegpt_turns_by_the_servers_tokenizer(served, tmp_path):
    """`bench serve --dataset` over ShareGPT records counts each turn through the server's
    /tokenize: every request asks for its reply's token count (ignore_eos makes the server
    generate exactly that), so the output total is the replies' token counts by the tokenizer, and
    the single-turn record is left out."""
    from pagedlab.server.bench_serve import main

    tokenizer = served["tokenizer"]
    pairs = [("Why is the sky blue on a clear day?", "Because air scatters blue light more."),
             ("Name three colors of the rainbow please.", "Red, orange and yellow are three.")]
    records = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]}
               for p, r in pairs]
    records.append({"conversations": [{"from": "human", "value": "A single turn has no reply to size."}]})
    data, out = tmp_path / "sharegpt.json", tmp_path / "result.json"
    data.write_text(json.dumps(records))
    assert main(["--base-url", served["url"], "--dataset", str(data), "--num-prompts", "2", "--ignore-eos",
                 "--temperature", "0", "--disable-tqdm", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 2
    assert result["total_output_tokens"] == sum(len(tokenizer(r).input_ids) for _, r in pairs)
    assert result["total_input_tokens"] == sum(len(tokenizer(p).input_ids) for p, _ in pairs)


def test_max_logprobs_is_the_servers_cap(served):
    """As vLLM's ``--max-logprobs``: up to the engine's cap the server answers, past it a 400 naming
    the field; the top logprobs served are the offline engine's."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3,
            "temperature": 0.0, "logprobs": True, "top_logprobs": MAX_LOGPROBS}
    r = httpx.post(served["url"] + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    want = served["offline_chat"]
    for entry, position, token in zip(r.json()["choices"][0]["logprobs"]["content"], want.logprobs,
                                      want.token_ids, strict=True):
        assert entry["logprob"] == pytest.approx(position[token].logprob, abs=1e-5)
        top = sorted(lp.logprob for lp in position.values() if lp.rank <= MAX_LOGPROBS)
        assert sorted(t["logprob"] for t in entry["top_logprobs"]) == pytest.approx(top, abs=1e-5)
        assert len(top) == MAX_LOGPROBS
    text, over = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}, MAX_LOGPROBS + 1
    assert _complete(served, {**text, "logprobs": MAX_LOGPROBS})["choices"][0]["logprobs"]["top_logprobs"]
    for path, body, param in [("/v1/chat/completions", {**chat, "top_logprobs": over}, "top_logprobs"),
                              ("/v1/completions", {**text, "logprobs": over}, "logprobs"),
                              ("/v1/completions", {**text, "logprobs": -1}, "logprobs")]:
        r = httpx.post(served["url"] + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert f"in [0, {MAX_LOGPROBS}]" in r.json()["error"]["message"]


def _as_ids(token_ids: list[int]) -> list[str]:
    return [f"token_id:{t}" for t in token_ids]


def _completion_parts(served, body: dict, stream: bool) -> tuple[str, list[int], dict]:
    """(text, prompt and generated token ids, logprobs) of one completion, streamed or not."""
    if not stream:
        c = _complete(served, body)["choices"][0]
        return c["text"], c["prompt_token_ids"] + c["token_ids"], c["logprobs"]
    text, ids, logprobs = "", [], {"tokens": [], "top_logprobs": []}
    for chunk in _stream(served, body):
        c = chunk["choices"][0]
        text += c["text"]
        ids += c.get("prompt_token_ids", []) + c["token_ids"]
        for key in logprobs:
            logprobs[key] += c["logprobs"][key]
    return text, ids, logprobs


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_completion_tokens_as_token_ids(served, stream):
    """vLLM's return_tokens_as_token_ids: every logprobs token (echoed prompt's included, and the
    top_logprobs keys) is "token_id:{id}" of the response's own token ids; the text is unchanged."""
    tokenizer = served["tokenizer"]
    body = {**SPLIT_CHARACTER, "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True,
            "return_token_ids": True}
    text, ids, logprobs = _completion_parts(served, {**body, "return_tokens_as_token_ids": True}, stream)
    plain_text, plain_ids, plain = _completion_parts(served, {**body, "return_tokens_as_token_ids": False},
                                                     stream)
    assert (text, ids) == (plain_text, plain_ids)
    assert logprobs["tokens"] == _as_ids(ids)
    assert plain["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["top_logprobs"][0] is None
    for top, token in zip(logprobs["top_logprobs"][1:], _as_ids(ids)[1:]):
        assert token in top and len(top) >= 2 and all(k.startswith("token_id:") for k in top)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_chat_tokens_as_token_ids(served, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}

    def parts(as_ids: bool) -> tuple[str, list[int], list[dict]]:
        asked = {**body, "return_tokens_as_token_ids": as_ids}
        if not stream:
            r = httpx.post(served["url"] + "/v1/chat/completions", json=asked, timeout=60)
            c = r.json()["choices"][0]
            return c["message"]["content"], c["token_ids"], c["logprobs"]["content"]
        choices = [chunk["choices"][0] for chunk in _stream(served, asked, "/v1/chat/completions")]
        return ("".join(c["delta"].get("content") or "" for c in choices),
                [t for c in choices for t in c["token_ids"]],
                [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]])

    (text, ids, content), (plain_text, plain_ids, plain) = parts(True), parts(False)
    assert (text, ids) == (plain_text, plain_ids) and ids
    assert [e["token"] for e in content] == _as_ids(ids)
    assert [e["bytes"] for e in content] == [list(t.encode()) for t in _as_ids(ids)]
    assert all(len(e["top_logprobs"]) == 2 and t["token"].startswith("token_id:")
               for e in content for t in e["top_logprobs"])
    assert [e["top_logprobs"][0]["token"] for e in content] == _as_ids(ids)  # greedy: the chosen is the best
    assert [e["token"] for e in plain] == [served["tokenizer"].decode([t]) for t in ids]


def test_server_flag_sets_tokens_as_token_ids_default(served):
    """vLLM's --return-tokens-as-token-ids: a request that leaves return_tokens_as_token_ids out
    gets "token_id:{id}" tokens on completions and chat; one that sets it, either way, wins."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert not parser.parse_args(["--model", "m"]).return_tokens_as_token_ids
    flags = parser.parse_args(["--model", "m", "--return-tokens-as-token-ids"])
    app = build_app(served["engine"], served_model_names=[MODEL], enable_metrics=False,
                    return_tokens_as_token_ids=flags.return_tokens_as_token_ids)
    decode = served["tokenizer"].decode
    text = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "temperature": 0, "logprobs": True, "return_token_ids": True}
    with ServerThread(app) as srv:
        for asked, as_ids in [({}, True), ({"return_tokens_as_token_ids": False}, False),
                              ({"return_tokens_as_token_ids": True}, True)]:
            r = httpx.post(srv.url + "/v1/completions", json={**text, **asked}, timeout=60)
            c = r.json()["choices"][0]
            want = _as_ids(c["token_ids"]) if as_ids else [decode([t]) for t in c["token_ids"]]
            assert c["logprobs"]["tokens"] == want, asked
            r = httpx.post(srv.url + "/v1/chat/completions", json={**chat, **asked}, timeout=60)
            c = r.json()["choices"][0]
            want = _as_ids(c["token_ids"]) if as_ids else [decode([t]) for t in c["token_ids"]]
            assert [e["token"] for e in c["logprobs"]["content"]] == want, asked
    plain = _complete(served, {k: v for k, v in text.items() if k != "model"})["choices"][0]
    assert plain["logprobs"]["tokens"] == [decode([t]) for t in plain["token_ids"]]
