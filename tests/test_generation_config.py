"""The model's generation_config.json as the default sampling settings (vLLM's
``generation_config="auto"``): LLM.generate without SamplingParams and a server request's unset
fields take its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens; "vllm"
ignores it. References: HF's greedy tokens and the file's own values."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from types import SimpleNamespace
from pathlib import Path

import pytest

from conftest import hf_greedy
from pagedlab import LLM, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine
from pagedlab.sampling_params import generation_config_cap, generation_config_defaults
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

PROMPT = "The quick brown fox"
RECOMMENDED = {"temperature": 0.0, "top_k": 20, "max_new_tokens": 3, "do_sample": True, "top_p": None}


MESSAGES = [{"role": "user", "content": "hi"}]


@contextlib.contextmanager
def capped_server(model_dir, cap: int, **engine_args):
    """A server over the tiny model whose override_generation_config's max_new_tokens is ``cap``;
    yields ``post(path, **body)`` (the body with model "m" and ignore_eos) and the token count of
    ``MESSAGES``' chat prompt (taken before the server runs)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from pagedlab.server.app import ServerThread, build_app

    llm = LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES,
              override_generation_config={"max_new_tokens": cap}, **engine_args)
    engine = AsyncEngine.from_llm(llm)
    chat_len = len(llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids)
    try:
        with ServerThread(build_app(engine, served_model_names=["m"])) as srv:
            def post(path, **body):
                return httpx.post(srv.url + path, json={"model": "m", "ignore_eos": True, **body}, timeout=60)

            yield post, chat_len
    finally:
        engine.shutdown()
        llm.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_chat_model(tmp_path_factory.mktemp("gen_config"))
    config_file = Path(path) / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **RECOMMENDED}))
    return path


def test_defaults_read_from_the_file(tmp_path, model_dir):
    assert generation_config_defaults("auto", model_dir) == {"temperature": 0.0, "top_k": 20, "max_tokens": 3}
    assert generation_config_defaults("vllm", model_dir) == {}
    assert generation_config_defaults("auto", tmp_path) == {}  # a model without the file
    with pytest.raises(ValueError, match=r"generation_config='.*' is invalid: give auto, vllm or a dir"):
        generation_config_defaults(str(tmp_path), model_dir)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5, "temperature": 0.7}))
    with pytest.raises(ValueError, match=r"generation_config.json recommends sampling settings .*top_p"):
        generation_config_defaults(str(tmp_path), model_dir)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert generation_config_defaults(str(tmp_path), model_dir) == {"temperature": 0.7}


def test_generate_without_params_uses_the_model_recommendation(model_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=20, max_tokens=3)
        ids = llm.get_tokenizer()(PROMPT).input_ids
        out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == hf_greedy(hf, ids, 3, eos_token_id=None)[:len(out.token_ids)]
        assert len(out.token_ids) == 3 or out.finish_reason == "stop"
        assert len(llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0].outputs[0].token_ids) <= 3
        explicit = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
        assert len(explicit.token_ids) == 5  # a given SamplingParams is used as it is
    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_server_fills_unset_fields_from_the_model(model_dir, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from pagedlab.server.app import ServerThread, build_app

    llm = LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES)
    engine = AsyncEngine.from_llm(llm)
    greedy5 = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    try:
        with ServerThread(build_app(engine, served_model_names=["m"])) as srv:
            def complete(**body):
                body = {"model": "m", "prompt": PROMPT, "ignore_eos": True, "return_token_ids": True, **body}
                r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]

            # unset: greedy (the file's temperature 0); the completions default of 16 tokens stays,
            # as in vLLM, whose get_max_tokens takes max_new_tokens only where a request has no limit
            unset = complete()
            assert len(unset) == 16 and unset[:5] == greedy5
            assert complete(max_tokens=5) == greedy5  # a set field wins
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
            r = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=60)
            assert r.json()["usage"]["completion_tokens"] == 3  # chat without a limit: max_new_tokens
            sampled = {tuple(complete(temperature=1.0, max_tokens=5, seed=s)) for s in range(6)}
            assert len(sampled) > 1  # a temperature the request sets is not the file's

        async def final_output():
            async for out in engine.generate(PROMPT):  # no SamplingParams: the model's
                last = out
            return last.outputs[0]

        out = asyncio.run(final_output())
        assert out.token_ids == greedy5[:len(out.token_ids)] and (len(out.token_ids) == 3
                                                                  or out.finish_reason == "stop")
    finally:
        engine.shutdown()
        llm.close()


def test_other_directory_and_bad_files_fail_at_load(model_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2, "temperature": 0}))
    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, generation_config=str(other)) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=2)
        engine = AsyncEngine.from_llm(llm)
        try:
            assert engine.max_tokens_cap == 2  # a directory's max_new_tokens caps every server request
        finally:
            engine.shutdown()
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                               "top_k": -5}))
    with pytest.raises(ValueError, match="recommends sampling settings pagedlab refuses: top_k"):
        LLM(str(broken), kv_cache_memory_bytes=TINY_KV_BYTES)


def test_override_generation_config_over_the_file_or_alone(model_dir, capsys):
    assert generation_config_defaults("auto", model_dir, {"temperature": 0.5, "max_new_tokens": 9}) == \
        {"temperature": 0.5, "top_k": 20, "max_tokens": 9}
    assert generation_config_defaults("vllm", model_dir, {"top_p": 0.9}) == {"top_p": 0.9}
    with pytest.raises(ValueError, match=r"'temprature' is none of \['max_new_tokens', 'min_p'"):
        generation_config_defaults("auto", model_dir, {"temprature": 0.5})
    with pytest.raises(ValueError, match=r"override_generation_config recommends sampling settings .*top_p"):
        generation_config_defaults("auto", model_dir, {"top_p": 2.0})
    from pagedlab.cli.main import build_parser, main

    args = build_parser().parse_args(["generate", "--override-generation-config", '{"temperature": 0.5}'])
    assert args.override_generation_config == {"temperature": 0.5}
    with pytest.raises(SystemExit):
        main(["generate", "--override-generation-config", "temperature=0.5"])
    err = capsys.readouterr().err
    assert "argument --override-generation-config: 'temperature=0.5' is not a JSON object" in err
    override = {"max_new_tokens": 2}
    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES, override_generation_config=override) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=20, max_tokens=2)


def test_every_recommended_key_is_read(tmp_path, model_dir):
    """All six keys vLLM takes from generation_config.json, each under its SamplingParams name."""
    recommended = {"temperature": 0.6, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
                   "max_new_tokens": 7, "num_beams": 4}
    (tmp_path / "generation_config.json").write_text(json.dumps(recommended))
    assert generation_config_defaults(str(tmp_path), model_dir) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
        "max_tokens": 7}


def test_which_max_new_tokens_caps_every_request():
    """vLLM's override_max_tokens: with generation_config a directory, its max_new_tokens (or the
    override's over it); with auto or vllm, override_generation_config's alone."""
    assert generation_config_cap("auto", {"max_tokens": 3}) is None
    assert generation_config_cap("vllm", {}) is None
    assert generation_config_cap("auto", {"max_tokens": 9}, {"max_new_tokens": 9, "top_k": 5}) == 9
    assert generation_config_cap("vllm", {"max_tokens": 9}, {"max_new_tokens": 9}) == 9
    assert generation_config_cap("auto", {"max_tokens": 3, "top_k": 5}, {"top_k": 5}) is None
    assert generation_config_cap("/a/dir", {"max_tokens": 2}) == 2
    assert generation_config_cap("/a/dir", {"max_tokens": 7}, {"max_new_tokens": 7}) == 7
    assert generation_config_cap("/a/dir", {"temperature": 0.5}) is None


def test_request_limits_against_the_model_limit_and_the_cap():
    """vLLM's get_max_tokens: max_new_tokens where the request has no limit (chat without one);
    a completion's default of 16 and any limit the request sets, under either chat name, stay,
    unless the engine's max_tokens_cap is lower. A limit the request lacks fits the prompt's room."""
    pytest.importorskip("pydantic")
    from pagedlab.inputs import EncodedPrompt
    from pagedlab.server.protocol import ChatCompletionRequest, CompletionRequest
    from pagedlab.server.serving_engine import OpenAIServing

    def limit(model_limit, request, cap=None, prompt_len=2):
        engine = SimpleNamespace(default_sampling_args={"max_tokens": model_limit, "top_k": 20},
                                 max_model_len=4096, max_tokens_cap=cap)
        params = OpenAIServing(engine, ["m"], admission=object()).with_model_defaults(
            request, request.to_sampling_params(), EncodedPrompt([5] * prompt_len))
        assert params.top_k == 20
        return params.max_tokens

    messages = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest(model="m", messages=messages)
    assert limit(20, CompletionRequest(model="m", prompt="hi")) == 16
    assert limit(3, CompletionRequest(model="m", prompt="hi")) == 16
    assert limit(3, CompletionRequest(model="m", prompt="hi", max_tokens=5)) == 5
    assert limit(20, chat) == 20
    assert limit(20, chat, prompt_len=4090) == 6
    assert limit(3, ChatCompletionRequest(model="m", messages=messages, max_completion_tokens=5)) == 5
    assert limit(3, ChatCompletionRequest(model="m", messages=messages, max_tokens=5)) == 5
    assert limit(None, chat) is None  # no limit at all: the engine runs to max_model_len
    assert limit(3, CompletionRequest(model="m", prompt="hi"), cap=3) == 3
    assert limit(3, CompletionRequest(model="m", prompt="hi", max_tokens=5), cap=3) == 3
    assert limit(3, CompletionRequest(model="m", prompt="hi", max_tokens=2), cap=3) == 2
    assert limit(None, ChatCompletionRequest(model="m", messages=messages, max_tokens=5), cap=3) == 3
    assert limit(20, chat, cap=8) == 8
    assert limit(20, chat, cap=8, prompt_len=4090) == 6


def test_the_generation_configs_other_eos_ids_stop_with_their_id(model_dir, tmp_path):
    """As vLLM, which adds a generation config's EOS ids other than the tokenizer's to the stop
    token ids: ending on one gives it as stop_reason (the tokenizer's EOS gives None), and
    ignore_eos runs through it. The extra id is the second token greedy decoding picks."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with LLM(model_dir, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        tokenizer = llm.get_tokenizer()
    ids = tokenizer(PROMPT).input_ids
    greedy = hf_greedy(hf, ids, 6, eos_token_id=None)
    extra = greedy[1]
    assert tokenizer.eos_token_id not in greedy[:2] and extra != greedy[0]
    two_eos = tmp_path / "two_eos"
    shutil.copytree(model_dir, two_eos)
    config_file = two_eos / "generation_config.json"
    config = {**json.loads(config_file.read_text()), "eos_token_id": [tokenizer.eos_token_id, extra]}
    config_file.write_text(json.dumps(config))
    with LLM(str(two_eos), kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6),
                               use_tqdm=False)[0].outputs[0]
        ran_on = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
        own_eos = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6,
                                                      logit_bias={tokenizer.eos_token_id: 100.0}),
                               use_tqdm=False)[0].outputs[0]
    assert (stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == (greedy[:2], "stop", extra)
    assert ran_on.token_ids == greedy
    assert (own_eos.token_ids, own_eos.finish_reason, own_eos.stop_reason) == (
        [tokenizer.eos_token_id], "stop", None)


def test_no_limit_fits_the_models_max_new_tokens_to_the_prompt(model_dir):
    """vLLM's get_max_tokens: a chat without max_tokens or max_completion_tokens (left out or null:
    vLLM's chat fields default to None) runs to the model's max_new_tokens or to max_model_len,
    whichever comes first; it is no 400 when prompt + max_new_tokens is too long. A limit the
    request sets is still checked against max_model_len."""
    with capped_server(model_dir, 60, max_model_len=64) as (post, chat_len):
        room = 64 - chat_len
        assert room < 60
        for nulls in ({}, {"max_tokens": None, "max_completion_tokens": None}):
            r = post("/v1/chat/completions", messages=MESSAGES, **nulls)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == room
            assert r.json()["choices"][0]["finish_reason"] == "length"
        r = post("/v1/chat/completions", messages=MESSAGES, max_tokens=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_completion_null_max_tokens_is_the_default_16(model_dir):
    """vLLM's CompletionRequest.normalize_null_max_tokens rewrites "max_tokens": null to the
    field's default, 16: each prompt of a completion gets 16 tokens, as if max_tokens were left
    out, not the room under max_model_len or the model's max_new_tokens; and a prompt with no room
    for 16 is the same 400 as with max_tokens left out."""
    with capped_server(model_dir, 60, max_model_len=64) as (post, _):
        for limit in ({"max_tokens": None}, {}):
            r = post("/v1/completions", prompt=[[5] * 10, [5] * 40], return_token_ids=True, **limit)
            assert r.status_code == 200, r.text
            assert [len(c["token_ids"]) for c in r.json()["choices"]] == [16, 16]
            assert r.json()["usage"]["completion_tokens"] == 32
            r = post("/v1/completions", prompt=[5] * 50, **limit)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert "you requested 16 output tokens" in r.json()["error"]["message"]


def test_override_max_new_tokens_caps_what_requests_ask_for(model_dir):
    """vLLM's override_max_tokens: override_generation_config's max_new_tokens caps a limit a
    request sets (either chat name, a completion's default of 16) as well as one it leaves out;
    a lower limit of the request's own stays."""
    with capped_server(model_dir, 4) as (post, _):
        def completion_tokens(path, **body):
            r = post(path, **body)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]

        assert completion_tokens("/v1/completions", prompt=PROMPT, max_tokens=10) == 4
        assert completion_tokens("/v1/completions", prompt=PROMPT) == 4
        assert completion_tokens("/v1/completions", prompt=PROMPT, max_tokens=2) == 2
        assert completion_tokens("/v1/chat/completions", messages=MESSAGES, max_completion_tokens=10) == 4
        assert completion_tokens("/v1/chat/completions", messages=MESSAGES, max_tokens=10) == 4
        assert completion_tokens("/v1/chat/completions", messages=MESSAGES) == 4


def test_a_request_limit_that_does_not_fit_is_400_though_the_cap_would_fit(model_dir):
    """vLLM's renderer checks the request's own limit (build_tok_params: max_completion_tokens,
    else max_tokens) against max_model_len before get_max_tokens applies override_max_tokens: a
    limit that does not fit beside the prompt is a 400, in vLLM's words, even where the cap (4
    here) would fit; one that fits is then cut to the cap. A limit over max_model_len itself is
    TokenizeParams' own 400, naming the field."""
    def too_long(length, asked):
        return (f"This model's maximum context length is 64 tokens. However, you requested {asked} output "
                f"tokens and your prompt contains {length} input tokens, for a total of {length + asked} "
                "tokens. Please reduce the length of the input prompt or the number of requested output "
                "tokens.")

    def error(r):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        return err["message"], err["param"], err["code"]

    code = "context_length_exceeded"
    with capped_server(model_dir, 4, max_model_len=64) as (post, chat_len):
        r = post("/v1/completions", prompt=[5] * 10, max_tokens=60)
        assert error(r) == (too_long(10, 60), "prompt", code)
        r = post("/v1/chat/completions", messages=MESSAGES, max_tokens=64 - chat_len + 1)
        assert error(r) == (too_long(chat_len, 64 - chat_len + 1), "messages", code)
        r = post("/v1/chat/completions", messages=MESSAGES, max_completion_tokens=60, max_tokens=1)
        assert error(r) == (too_long(chat_len, 60), "messages", code)
        over = "{}=100 cannot be greater than max_model_len=64. Please request fewer output tokens."
        chat = ("/v1/chat/completions", {"messages": MESSAGES})
        for (path, body), field in [(("/v1/completions", {"prompt": [5] * 10}), "max_tokens"),
                                    (chat, "max_tokens"), (chat, "max_completion_tokens")]:
            assert error(post(path, **body, **{field: 100})) == (over.format(field), field, code)
        r = post("/v1/completions", prompt=[5] * 10, max_tokens=54)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        r = post("/v1/chat/completions", messages=MESSAGES, max_tokens=64 - chat_len)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
