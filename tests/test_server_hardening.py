"""Server hardening (issue 18): requests that used to take the server down or hold it, each a
regression test, and vLLM's prompt_logprobs and stream_options. A tiny random Llama with a real
tokenizer, served live on 127.0.0.1; offline ``LLM`` results are the reference."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import threading
import time

import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from pagedlab.server.app import ServerThread, build_app  # noqa: E402
from pagedlab.server.limits import ServerLimits  # noqa: E402
from pagedlab.server.metrics import parse_metrics  # noqa: E402
from pagedlab.server.protocol import INT64_MAX, INT64_MIN  # noqa: E402

MODEL = "tiny"
PROMPT = "Why is the sky blue? Because"
CHAT = [{"role": "user", "content": "Why is the sky blue?"}]
LIMITS = ServerLimits(max_waiting_requests=4, max_sequences_per_request=16, max_tokens_per_request=3000,
                      max_request_body_bytes=64 << 10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A live server whose engine runs at most two sequences at once, so others wait."""
    model_dir = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    llm = LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, max_num_seqs=2)
    tokenizer = llm.get_tokenizer()
    reference = {
        "prompt": llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
                               use_tqdm=False)[0],
        "chat": llm.chat([CHAT], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1),
                         use_tqdm=False)[0],
    }
    engine = AsyncEngine.from_llm(llm)
    app = build_app(engine, served_model_names=[MODEL], limits=LIMITS)
    with ServerThread(app) as srv:
        yield {"url": srv.url, "app": app, "engine": engine, "reference": reference, "tokenizer": tokenizer}
    engine.shutdown()
    llm.close()


def _post(served, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(served["url"] + path, json=body, timeout=30, **kwargs)


def _error(resp: httpx.Response, status: int) -> dict:
    """The body of an OpenAI-shaped error response with ``status``."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def _healthy(served) -> None:
    r = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


# ---- defect 1: one request may not hold the engine ------------------------------------------------
@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "hi", "n": 1_000_000, "max_tokens": 1}, "n", "less than or equal to 128"),
    ({"prompt": "hi", "n": 2, "best_of": 1000}, "best_of", "less than or equal to 128"),
    ({"prompt": ["a", "b", "c"], "n": 6, "max_tokens": 1}, "n", "18 sequences"),
    ({"prompt": "hi", "n": 8, "max_tokens": 400}, "max_tokens", "more than the 3000"),
])
def test_request_size_is_bounded(served, body, param, says):
    err = _error(_post(served, "/v1/completions", body), 400)
    assert err["param"] == param and says in err["message"]


def test_full_waiting_queue_answers_503_with_retry_after(served):
    engine, release = served["engine"], threading.Event()
    engine.call(lambda _: release.wait(30))  # hold the engine thread: whatever is admitted now waits
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    try:
        with httpx.Client(timeout=30) as http, contextlib.ExitStack() as streams:
            waiting = [streams.enter_context(http.stream("POST", served["url"] + "/v1/completions",
                                                         json={**body, "n": n})) for n in (3, 1)]
            busy = http.post(served["url"] + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
            err = _error(busy, 503)
            assert err["code"] == "server_busy" and "4 sequences are waiting (at most 4)" in err["message"]
            assert busy.headers["retry-after"] == "1"
            release.set()
            for r in waiting:  # the admitted ones are served in full
                assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    finally:
        release.set()
    deadline = time.monotonic() + 15
    while served["engine"].get_stats().kv_blocks_used:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    _healthy(served)


def test_a_slow_stream_finished_by_the_engine_is_not_waiting(served):
    """A client that stops reading its stream leaves the final output unread after the engine has
    finished the request: that request no longer waits, so a queue of one takes the next (a 503)."""
    app = build_app(served["engine"], [MODEL], enable_metrics=False,
                    limits=ServerLimits(max_waiting_requests=1))
    with ServerThread(app) as srv, socket.socket() as client:
        srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the server's writes block soon
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((srv.host, srv.port))
        body = json.dumps({"prompt": list(range(3, 403)), "echo": True, "logprobs": 20, "max_tokens": 20,
                           "ignore_eos": True, "stream": True}).encode()  # echo: a first chunk of ~200 kB
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        client.settimeout(30)
        received = client.recv(4096)
        while b"data: " not in received:  # prefilled; then the client reads no more for a while
            received += client.recv(4096)
        deadline = time.monotonic() + 15
        while served["engine"].get_stats().kv_blocks_used:  # until the engine has finished it
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert app.state.admission.num_live_sequences() == 1  # its end is not read yet
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
        assert r.status_code == 200, r.text
        while b"data: [DONE]" not in received[-100:]:  # the slow stream is served in full
            more = client.recv(1 << 16)
            assert more
            received += more


def test_waiting_queue_limit_holds_while_grammars_compile(served, monkeypatch):
    """Five requests whose grammars compile at the same time, against a queue of four: each is
    admitted only once its grammar is ready, so one of them gets the 503 (counted before the
    compile, all five saw an empty queue and all were admitted)."""
    engine, release, gate = served["engine"], threading.Event(), threading.Event()
    compiler = engine.grammar_compiler
    compile_now, arrived = compiler.compile, []

    def compile_together(spec):
        arrived.append(spec)
        if len(arrived) == 5:
            gate.set()
        gate.wait(10)
        return compile_now(spec)

    monkeypatch.setattr(compiler, "compile", compile_together)
    engine.call(lambda _: release.wait(30))  # hold the engine thread: whatever is admitted waits
    body = {"prompt": PROMPT, "max_tokens": 2, "guided_regex": "[ab]+"}
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            posts = [pool.submit(_post, served, "/v1/completions", body) for _ in range(5)]
            concurrent.futures.wait(posts, timeout=10, return_when=concurrent.futures.FIRST_COMPLETED)
            release.set()
            statuses = sorted(post.result().status_code for post in posts)
    finally:
        release.set()
    assert statuses == [200, 200, 200, 200, 503]
    _healthy(served)


# ---- defect 2: integers beyond the engine's range -----------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("seed", 99999999999999999999999), ("seed", INT64_MIN - 1), ("top_k", 10 ** 30),
    ("min_tokens", 2 ** 64), ("max_tokens", -(10 ** 25)),
])
def test_integers_out_of_int64_are_400_naming_the_field(served, field, value):
    err = _error(_post(served, "/v1/completions", {"prompt": "hi", field: value}), 400)
    assert err["param"] == field and err["type"] == "invalid_request_error"
    if field == "seed":
        assert f"[{INT64_MIN}, {INT64_MAX}]" in err["message"]
    _healthy(served)


def test_seed_range_offline():
    SamplingParams(seed=INT64_MAX)
    SamplingParams(seed=INT64_MIN)
    for seed in (INT64_MAX + 1, INT64_MIN - 1):
        with pytest.raises(ValueError, match=r"seed=.* is invalid: seed must be None or an integer in"):
            SamplingParams(seed=seed)


def test_token_ids_out_of_vocabulary(served):
    """As vLLM: stop ids past the vocabulary are accepted and never stop a request (with
    min_tokens banning the stop ids, which once failed the whole step); the other token-id fields
    past it are 400s naming the field."""
    vocab = len(served["tokenizer"])
    body = {"prompt": "hi", "min_tokens": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = _post(served, "/v1/completions", body)
    beyond = _post(served, "/v1/completions", {**body, "stop_token_ids": [vocab + 5, vocab + 9]})
    assert plain.status_code == beyond.status_code == 200, beyond.text
    assert beyond.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    err = _error(_post(served, "/v1/completions", {**body, "logit_bias": {str(vocab + 5): 1.0}}), 400)
    assert err["param"] == "logit_bias" and "out of vocabulary" in err["message"]
    _healthy(served)


# ---- defect 3: input no tokenizer or parser can take -------------------------------------------------
@pytest.mark.parametrize("raw, code, param", [
    (b'{"prompt": "a\\ud800b", "max_tokens": 1}', "invalid_unicode", "prompt"),
    (b'{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "invalid_unicode", "prompt[1]"),
    (b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 1}', "invalid_unicode", "prompt"),
    (b'{"prompt": "' + b"[" * 60_000 + b'"}', None, "prompt"),  # a string: fine, just long
    (b"[" * 60_000, "invalid_json", None),
    (b'{"prompt": "hi", "temperature": NaN}', "invalid_json", None),
    (b'{"prompt": "hi", "temperature": 1e999}', "invalid_json", None),
    (b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", "invalid_json", None),
], ids=["escaped-surrogate", "low-surrogate-in-list", "utf8-surrogate", "bracket-string", "deep-nesting",
        "nan", "float-overflow", "5000-digit-int"])
def test_unparseable_input_is_400(served, raw, code, param):
    resp = httpx.post(served["url"] + "/v1/completions", content=raw,
                      headers={"content-type": "application/json"}, timeout=30)
    if code is None:  # a long prompt of brackets is a valid prompt, too long for this model
        err = _error(resp, 400)
        assert err["code"] == "context_length_exceeded"
    else:
        err = _error(resp, 400)
        assert err["code"] == code and err["param"] == param
    _healthy(served)


def test_chat_surrogates_are_400(served):
    raw = b'{"messages": [{"role": "user", "content": "x\\udc00"}]}'
    err = _error(httpx.post(served["url"] + "/v1/chat/completions", content=raw, timeout=30), 400)
    assert err["param"] == "messages[0].content"
    valid_pair = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'  # an emoji, escaped
    assert httpx.post(served["url"] + "/v1/completions", content=valid_pair, timeout=30).status_code == 200


def test_body_size_limit_is_413(served):
    err = _error(_post(served, "/v1/completions", {"prompt": "x" * (70 << 10)}), 413)
    assert err["code"] == "request_too_large" and str(64 << 10) in err["message"]
    _healthy(served)


# ---- defect 4: an unexpected failure leaves the connection usable -------------------------------
def _http_exchange(sock: socket.socket, body: bytes) -> tuple[int, dict]:
    """One keep-alive request and its complete response (status, JSON body)."""
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the keep-alive connection"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-response"
        rest += chunk
    return int(head.split()[1]), json.loads(rest)


def test_unhandled_error_is_openai_shaped_and_keeps_the_connection(served, monkeypatch):
    serving = served["app"].state.serving_completion

    async def broken(request, disconnected=None):
        raise RuntimeError("a bug nobody anticipated")

    good = json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    with socket.create_connection((served["url"].split("//")[1].split(":")[0],
                                   int(served["url"].rsplit(":", 1)[1])), timeout=30) as sock:
        monkeypatch.setattr(serving, "create_completion", broken)
        status, body = _http_exchange(sock, good)
        assert status == 500 and body["error"]["type"] == "server_error"
        assert "a bug nobody anticipated" in body["error"]["message"]
        monkeypatch.undo()
        status, body = _http_exchange(sock, good)  # the same connection
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"


# ---- defect 5: prompt_logprobs -----------------------------------------------------------------------
def _check_prompt_logprobs(got: list, want) -> None:
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for position, expected, token in zip(got[1:], want.prompt_logprobs[1:], want.prompt_token_ids[1:]):
        assert set(map(int, position)) == set(expected)
        assert position[str(token)]["logprob"] == pytest.approx(expected[token].logprob, abs=1e-4)
        assert position[str(token)]["rank"] == expected[token].rank
        assert position[str(token)]["decoded_token"] == expected[token].decoded_token


def test_prompt_logprobs_on_completions(served):
    want = served["reference"]["prompt"]
    r = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                          "prompt_logprobs": 2})
    choice = r.json()["choices"][0]
    _check_prompt_logprobs(choice["prompt_logprobs"], want)
    assert choice["text"] == want.outputs[0].text
    plain = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).json()["choices"][0]
    assert "prompt_logprobs" not in plain
    err = _error(_post(served, "/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1}),
                 400)
    assert err["param"] == "prompt_logprobs" and "not available when `stream=True`" in err["message"]


def test_prompt_logprobs_on_chat(served):
    want = served["reference"]["chat"]
    r = _post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                               "prompt_logprobs": 1})
    body = r.json()
    _check_prompt_logprobs(body["prompt_logprobs"], want)
    assert body["choices"][0]["message"]["content"] == want.outputs[0].text
    plain = _post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain


# ---- defect 6: stream_options ------------------------------------------------------------------------
def _chunks(served, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", served["url"] + path, json={**body, "stream": True}, timeout=30) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [PROMPT, "hello"], "n": 2, "max_tokens": 5, "temperature": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 5, "temperature": 0}),
])
def test_stream_options_usage(served, path, body):
    body = {**body, "return_token_ids": True}
    plain = _chunks(served, path, body)
    assert all("usage" not in c for c in plain)  # no stream_options: no usage anywhere
    once = _chunks(served, path, {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in c for c in once[:-1])
    generated = sum(len(c["choices"][0]["token_ids"]) for c in once[:-1])
    assert once[-1]["choices"] == [] and once[-1]["usage"]["completion_tokens"] == generated > 0
    continuous = _chunks(served, path, {**body, "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": True}})
    assert all("usage" in c for c in continuous)
    sent: dict[int, int] = {}
    for c in continuous[:-1]:  # each chunk: its choice's prompt and the tokens that choice sent so far
        choice, usage = c["choices"][0], c["usage"]
        sent[choice["index"]] = sent.get(choice["index"], 0) + len(choice["token_ids"])
        assert usage["completion_tokens"] == sent[choice["index"]]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert sum(sent.values()) == continuous[-1]["usage"]["completion_tokens"] == generated
    # continuous_usage_stats alone changes nothing (vLLM: only together with include_usage)
    alone = _chunks(served, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in alone)


def test_streamed_prompt_token_ids_come_once_per_choice(served):
    """With return_token_ids, a completion stream carries each choice's prompt_token_ids on that
    choice's first chunk only (as vLLM), not again on every token's chunk."""
    tokenizer = served["tokenizer"]
    prompts = [PROMPT, "hello"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 12, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}
    sent: dict[int, list[list[int]]] = {}
    for chunk in _chunks(served, "/v1/completions", body):
        choice = chunk["choices"][0]
        sent.setdefault(choice["index"], []).append(choice.get("prompt_token_ids"))
    for index, per_chunk in sent.items():
        assert len(per_chunk) > 1
        assert per_chunk[0] == tokenizer(prompts[index // 2]).input_ids
        assert per_chunk[1:] == [None] * (len(per_chunk) - 1)


# ---- logits controls ---------------------------------------------------------------------------------
def test_logit_bias_and_allowed_token_ids(served):
    allowed = [40, 41, 42]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 1, "ignore_eos": True,
            "return_token_ids": True}
    r = _post(served, "/v1/completions", {**body, "allowed_token_ids": allowed}).json()
    assert set(r["choices"][0]["token_ids"]) <= set(allowed)
    r = _post(served, "/v1/completions", {**body, "logit_bias": {"57": 100}}).json()
    assert r["choices"][0]["token_ids"] == [57] * 6
    vocab = len(served["tokenizer"])
    body = {"messages": CHAT, "logit_bias": {str(vocab): 1}}
    err = _error(_post(served, "/v1/chat/completions", body), 400)
    assert err["param"] == "logit_bias" and "out of vocabulary" in err["message"]


# ---- vLLM's extra endpoints --------------------------------------------------------------------------
def test_tokenize_detokenize_version_and_models(served):
    tokenizer = served["tokenizer"]
    r = _post(served, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer(PROMPT).input_ids and r["count"] == len(r["tokens"])
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    assert r["max_model_len"] == served["engine"].max_model_len
    bare = _post(served, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert "token_strs" not in bare
    assert bare["tokens"] == tokenizer(PROMPT, add_special_tokens=False).input_ids
    chat = _post(served, "/tokenize", {"messages": CHAT}).json()
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    detokenized = _post(served, "/detokenize", {"tokens": r["tokens"]}).json()
    assert detokenized == {"prompt": tokenizer.decode(r["tokens"])}
    err = _error(_post(served, "/detokenize", {"tokens": [1, 10 ** 6]}), 400)
    assert err["param"] == "tokens" and "out of vocabulary" in err["message"]
    _error(_post(served, "/tokenize", {"prompt": PROMPT, "model": "other"}), 404)
    assert httpx.get(served["url"] + "/version").json()["version"]
    card = httpx.get(served["url"] + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == served["engine"].max_model_len


def test_chat_template_kwargs_win_over_the_template_arguments(served):
    """As vLLM's server, chat_template_kwargs naming add_generation_prompt override the request's
    own (it was a 400: the argument given twice): the conversation renders without the prompt."""
    tokenizer = served["tokenizer"]
    body = {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}
    r = _post(served, "/tokenize", body)
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    assert rendered != tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def test_continue_final_message_leaves_the_last_message_open(served):
    """vLLM's continue_final_message (a prefill): the conversation renders without the end of its
    last (assistant) message, in /tokenize and in the prompt a chat completion runs; with
    add_generation_prompt left true it is a 400."""
    tokenizer = served["tokenizer"]
    prefill = [*CHAT, {"role": "assistant", "content": "The sky"}]
    rendered = tokenizer.apply_chat_template(prefill, add_generation_prompt=False,
                                             continue_final_message=True, tokenize=False)
    want = tokenizer(rendered, add_special_tokens=False).input_ids
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    assert rendered.endswith("The sky") and _post(served, "/tokenize", body).json()["tokens"] == want
    r = _post(served, "/v1/chat/completions", {**body, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
    err = _error(_post(served, "/v1/chat/completions", {**body, "add_generation_prompt": True}), 400)
    assert "continue_final_message" in err["message"]


def test_reply_without_generation_prompt_has_the_last_messages_role(served):
    """vLLM's get_chat_request_role: with add_generation_prompt false the reply continues the last
    message, and its message (or its stream's first delta) carries that message's role."""
    body = {"messages": CHAT, "add_generation_prompt": False, "max_tokens": 2}
    assert _post(served, "/v1/chat/completions", body).json()["choices"][0]["message"]["role"] == "user"
    with httpx.stream("POST", served["url"] + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=30) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
    assert json.loads(first[len("data: "):])["choices"][0]["delta"]["role"] == "user"

def test_add_special_tokens_as_vllm(served):
    """vLLM's add_special_tokens: a completion's text prompt already holding its BOS is tokenized
    without another with false (default true); a chat prompt gets one on top of the template's
    with true (default false)."""
    tokenizer = served["tokenizer"]
    ids = tokenizer(PROMPT).input_ids
    body = {"model": MODEL, "prompt": tokenizer.bos_token + PROMPT, "max_tokens": 1, "return_token_ids": True}
    bare = _post(served, "/v1/completions", {**body, "add_special_tokens": False}).json()["choices"][0]
    assert bare["prompt_token_ids"] == ids
    assert _post(served, "/v1/completions", body).json()["choices"][0]["prompt_token_ids"] == ids[:1] + ids
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    plain = _post(served, "/v1/chat/completions", chat).json()["usage"]["prompt_tokens"]
    special = _post(served, "/v1/chat/completions", {**chat, "add_special_tokens": True}).json()["usage"]
    assert special["prompt_tokens"] == plain + 1

def test_tokenize_messages_validates_return_token_strs(served):
    """/tokenize with messages takes return_token_strs as a strict boolean, as with a prompt: the
    token strings come back for true, and "false" (a string) is a 400 naming the field."""
    tokenizer = served["tokenizer"]
    r = _post(served, "/tokenize", {"messages": CHAT, "return_token_strs": True}).json()
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    err = _error(_post(served, "/tokenize", {"messages": CHAT, "return_token_strs": "false"}), 400)
    assert err["param"] == "return_token_strs" and "valid boolean" in err["message"]


def test_serve_limit_flags():
    from pagedlab.server.cli import add_serve_args, limits_from_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", "m", "--max-waiting-requests", "7",
                              "--max-request-body-bytes", "100"])
    assert limits_from_args(args) == ServerLimits(max_waiting_requests=7, max_request_body_bytes=100)
    with pytest.raises(ValueError, match="--max-tokens-per-request 0 is invalid"):
        limits_from_args(parser.parse_args(["--model", "m", "--max-tokens-per-request", "0"]))


# ---- metrics -----------------------------------------------------------------------------------------
def test_e2e_latency_runs_to_the_last_completion_of_a_request(served):
    """n=2 where the first completion stops at its first token and the second runs 200: the
    request's e2e latency runs to the end of the second, not of the first."""
    body = {"prompt": PROMPT, "n": 2, "temperature": 1.0, "seed": 1, "max_tokens": 200, "ignore_eos": True,
            "return_token_ids": True}
    first, second = (c["token_ids"] for c in _post(served, "/v1/completions", body).json()["choices"])
    assert first[0] not in second  # so the first token of the first completion stops it alone

    def e2e_seconds() -> float:
        text = served["app"].state.metrics.render()[0].decode()
        return parse_metrics(text)["pagedlab:e2e_request_latency_seconds_sum"]

    before, started = e2e_seconds(), time.monotonic()
    r = _post(served, "/v1/completions", {**body, "stop_token_ids": [first[0]]})
    wall = time.monotonic() - started
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["stop", "length"]
    assert e2e_seconds() - before > wall / 2


# ---- graceful shutdown -------------------------------------------------------------------------------
def test_sigterm_drains_then_aborts_with_an_error_event(served):
    engine, release = served["engine"], threading.Event()
    app = build_app(engine, served_model_names=[MODEL], enable_metrics=False)
    srv = ServerThread(app, shutdown_timeout_s=0.3).start()
    body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    try:
        with httpx.Client(timeout=30) as http, http.stream("POST", srv.url + "/v1/completions",
                                                           json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")  # running
            engine.call(lambda _: release.wait(30))  # hold the engine: the request cannot finish
            srv.server.handle_exit(signal.SIGTERM, None)
            refused = http.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
            err = _error(refused, 503)
            assert err["code"] == "shutting_down" and refused.headers["retry-after"] == "1"
            time.sleep(0.4)  # past the shutdown timeout: the drain has aborted the request
            release.set()
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "shutting_down"
        assert "shut down before this request finished" in error["message"]
        srv.thread.join(10)
        assert not srv.thread.is_alive()
    finally:
        release.set()
        srv.stop()
    deadline = time.monotonic() + 15
    while engine.get_stats().kv_blocks_used:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    _healthy(served)  # the engine serves on through the other server


# ---- fuzzing -----------------------------------------------------------------------------------------
FUZZ_EXAMPLES = int(os.environ.get("PAGEDLAB_FUZZ_EXAMPLES", "25"))  # CI's budget; e.g. 2000 by hand
FIELDS = ["prompt", "messages", "model", "n", "best_of", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "echo",
          "prompt_logprobs", "logit_bias", "allowed_token_ids", "stream", "stream_options", "min_tokens",
          "presence_penalty", "repetition_penalty", "response_format", "tools", "chat_template_kwargs",
          "return_token_ids", "ignore_eos", "add_special_tokens", "tokens", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "structured_outputs", "bad_words", "logprob_token_ids"]


def _fuzz_bodies():
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
               | st.integers(min_value=0, max_value=8))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
    role = st.sampled_from(["user", "system", "assistant"])
    content = st.text(max_size=20) | values
    messages = st.lists(st.fixed_dictionaries({"role": role}, optional={"content": content}), max_size=3)
    return st.dictionaries(st.sampled_from(FIELDS), values, max_size=6) | st.fixed_dictionaries(
        {"messages": messages}, optional={f: values for f in FIELDS[2:12]})


def test_fuzzed_bodies_never_500(served):
    """Random bodies on every POST endpoint: each answer is a 2xx or an OpenAI-shaped 4xx (never
    a 5xx), and the server is healthy afterwards."""
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(body=_fuzz_bodies(),
                      path=hypothesis.strategies.sampled_from(["/v1/completions", "/v1/chat/completions",
                                                               "/tokenize", "/detokenize"]))
    def check(body, path):
        with httpx.Client(timeout=60) as http:
            resp = http.post(served["url"] + path, json=body)
            assert resp.status_code < 500, (body, resp.text)
            if resp.status_code >= 400:
                _error(resp, resp.status_code)

    check()
    _healthy(served)


def test_vllm_error_wording(served):
    limit = served["engine"].max_model_len
    err = _error(_post(served, "/v1/completions", {"prompt": [5] * limit, "max_tokens": 1}), 400)
    assert err["message"].startswith(f"This model's maximum context length is {limit} tokens. However, your "
                                     f"request has {limit} input tokens")
    assert err["code"] == "context_length_exceeded"
    err = _error(_post(served, "/v1/completions", {"prompt": [5, 10 ** 6]}), 400)
    assert err["param"] == "prompt" and "Token id 1000000 is out of vocabulary" in err["message"]
