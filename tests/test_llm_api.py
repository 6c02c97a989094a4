"""The LLM entry point: prompt forms, output order and metrics, stats, prefix-cache reset, close()."""

from __future__ import annotations

import gc
import logging
import weakref

import numpy as np
import pytest
import torch

from conftest import KV_BYTES, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams


def test_prompt_forms_order_and_metrics(tiny_llama):
    prompts = random_prompts(5, max_len=40, seed=70)
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(5)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        single = llm.generate(prompts[2], params[2], use_tqdm=False)
        as_dict = llm.generate({"prompt_token_ids": prompts[2]}, params[2], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 4, 5, 6, 7]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert single[0].outputs[0].token_ids == as_dict[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == hf_greedy(tiny_llama.hf_model, prompts[2], 5, eos_token_id=None)
    for o in outs:
        m = o.metrics
        assert (m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
                <= m.finished_time)
        assert m.num_generated_tokens == len(o.outputs[0].token_ids)
        assert o.finished and o.outputs[0].finish_reason == "length"


def test_reset_prefix_cache_forgets_prefixes(tiny_llama):
    prompt = random_prompts(1, min_len=50, max_len=50, seed=71)[0]
    params = SamplingParams(temperature=0, max_tokens=2)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        llm.generate([prompt], params, use_tqdm=False)
        hit = llm.generate([prompt], params, use_tqdm=False)[0]
        assert hit.num_cached_tokens == 48
        llm.reset_prefix_cache()
        miss = llm.generate([prompt], params, use_tqdm=False)[0]
    assert miss.num_cached_tokens == 0
    assert miss.outputs[0].token_ids == hit.outputs[0].token_ids


def test_close_releases_weights_and_cache(tiny_llama):
    llm = LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES)
    model_ref = weakref.ref(llm.llm_engine.model)
    cache_ref = llm.llm_engine.runner.kv_cache.untyped_storage()._weak_ref()  # the bytes, not a view
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()
    gc.collect()
    assert model_ref() is None and torch.UntypedStorage._expired(cache_ref)
    with pytest.raises(ValueError, match="this LLM was closed"):
        llm.generate([[1, 2, 3]], use_tqdm=False)
    llm.close()  # closing twice is harmless


def test_engine_heap_is_frozen_until_close(tiny_llama):
    """What the engine builds is moved out of the garbage collector's sight (full collections
    walked it and stalled steps) and given back on close(), so reference cycles are still freed."""
    llm = LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES)
    model = llm.llm_engine.model
    assert gc.get_freeze_count() > 0
    assert not any(o is model for o in gc.get_objects())
    llm.close()
    assert any(o is model for o in gc.get_objects())


def test_generate_as_completed_yields_each_prompt_as_it_finishes(tiny_llama):
    prompts = random_prompts(4, max_len=30, seed=72)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 6, 4)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        whole = llm.generate(prompts, params, use_tqdm=False)
        finished = list(llm.generate_as_completed(prompts, params, use_tqdm=False))
        assert [i for i, _ in finished] == [1, 3, 2, 0]  # shortest first: one batch, as it finishes
        assert [o.outputs[0].token_ids for _, o in sorted(finished, key=lambda f: f[0])] == \
            [o.outputs[0].token_ids for o in whole]
        first = llm.generate_as_completed(prompts, params, use_tqdm=False)
        assert next(first)[0] == 1
        assert llm.llm_engine.has_unfinished_requests()
        first.close()  # leaving early aborts the rest
        assert not llm.llm_engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="SamplingParams"):  # bad input fails before any step
            llm.generate_as_completed(prompts, [params[0]] * 3)


def test_generate_inside_a_generate_as_completed_loop_loses_no_output(tiny_llama):
    """A loop over generate_as_completed that calls generate on each output (a judge, a check)
    gets every prompt's output: the inner call's steps finish the outer prompts too, which wait
    for the outer loop instead of being dropped."""
    prompts = random_prompts(4, max_len=30, seed=73)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 12, 6, 20)]
    judge = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        whole = llm.generate(prompts, params, use_tqdm=False)
        finished, judged = {}, []
        for i, out in llm.generate_as_completed(prompts, params, use_tqdm=False):
            finished[i] = out.outputs[0].token_ids
            judged.append(llm.generate([out.outputs[0].token_ids], judge, use_tqdm=False)[0])
        assert not llm.llm_engine.has_unfinished_requests()
    assert finished == {i: o.outputs[0].token_ids for i, o in enumerate(whole)}
    assert [len(o.outputs[0].token_ids) for o in judged] == [3] * 4


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_llama):
    prompt = random_prompts(1, min_len=90, max_len=90, seed=73)[0]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_model_len=64) as llm:
        with pytest.raises(ValueError, match="the prompt has 90 tokens, but max_model_len is 64"):
            llm.generate(prompt, greedy, use_tqdm=False)
        out = llm.generate(prompt, greedy.clone(truncate_prompt_tokens=20), use_tqdm=False)[0]
        assert out.prompt_token_ids == prompt[-20:]
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama.hf_model, prompt[-20:], 3, eos_token_id=None)
        longest = llm.generate(prompt, greedy.clone(max_tokens=1, truncate_prompt_tokens=-1),
                               use_tqdm=False)[0]
        assert longest.prompt_token_ids == prompt[-63:]
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match=r"truncate_prompt_tokens=.* is invalid: .* an integer >= 1"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_llm_engine_loop_of_vllm_scripts(chat_dir, chat_llm):
    """vLLM's ``LLMEngine.from_engine_args(EngineArgs(...))``, then ``add_request(request_id, prompt,
    params)`` with a text or dict prompt and ``step()`` until ``has_unfinished_requests()`` is
    False: each output as ``LLM.generate`` gives it for the same prompt."""
    from pagedlab import EngineArgs, LLMEngine, TokensPrompt

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text = "hello world, how are you today?"
    ids = chat_llm.get_tokenizer()("the quick brown fox").input_ids
    engine = LLMEngine.from_engine_args(EngineArgs(model=chat_dir, kv_cache_memory_bytes=KV_BYTES))
    try:
        engine.add_request("text", text, greedy)
        engine.add_request("tokens", TokensPrompt(prompt_token_ids=ids), greedy)
        engine.add_request("array", np.array(ids), greedy)  # a sweep's ids, as LLM.generate takes them
        for request_id in ("a", "b"):
            engine.add_request(request_id, text, greedy)
        aborted = engine.abort_request(["a", "b", "unknown"])  # vLLM's form: a list of ids
        finished = {}
        while engine.has_unfinished_requests():
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
    finally:
        engine.close()
    assert [(out.request_id, out.outputs[0].finish_reason) for out in aborted] == [("a", "abort"),
                                                                                  ("b", "abort")]
    expected = chat_llm.generate([text, ids], greedy, use_tqdm=False)
    assert finished["array"].outputs[0].token_ids == finished["tokens"].outputs[0].token_ids
    for got, want in zip((finished["text"], finished["tokens"]), expected, strict=True):
        assert (got.prompt, got.prompt_token_ids) == (want.prompt, want.prompt_token_ids)
        assert (got.outputs[0].token_ids, got.outputs[0].text) == (want.outputs[0].token_ids,
                                                                   want.outputs[0].text)


def test_chat_joins_openai_content_parts_as_vllm(chat_llm):
    """OpenAI-style messages (content as a list of text parts) render as their text joined by
    newlines, as vLLM's LLM.chat gives them to a string-content template: never the list's repr."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text_parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    parts = [{"role": "user", "content": text_parts}]
    plain = [{"role": "user", "content": "hello\nworld"}]
    got, want = chat_llm.chat([parts, plain], greedy, use_tqdm=False)
    assert got.prompt == want.prompt == "<|user|>\nhello\nworld</s>\n<|assistant|>\n"
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]
    with pytest.raises(ValueError, match=r"content part .* is not supported: pagedlab serves text-only"):
        chat_llm.chat(image, greedy, use_tqdm=False)


def test_tokenization_kwargs_truncate_and_tokenize_as_vllm(chat_llm, caplog):
    """vLLM's ``tokenization_kwargs`` of generate, generate_as_completed and chat, its route to
    truncate a prompt since vLLM 0.17 dropped ``SamplingParams.truncate_prompt_tokens``: the
    prompt's last k tokens are kept (text or ids), ``max_length`` alone refuses a longer prompt,
    ``add_special_tokens`` is honoured; a request's own truncate_prompt_tokens wins, padding is
    refused, and a key vLLM ignores is ignored with a warning."""
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    text = "hello world, how are you today? the quick brown fox"
    ids = chat_llm.get_tokenizer()(text).input_ids

    def run(prompt, kwargs, params=greedy):
        return chat_llm.generate(prompt, params, use_tqdm=False, tokenization_kwargs=kwargs)[0]

    assert run(text, None).prompt_token_ids == ids and ids[0] == 1  # the tokenizer's BOS
    direct = run(ids[-5:], None).outputs[0].token_ids
    for kwargs in ({"truncate_prompt_tokens": 5}, {"truncation": True, "max_length": 5}):
        for prompt in (text, {"prompt_token_ids": ids}):
            out = run(prompt, kwargs)
            assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids[-5:], direct)
    _, out = next(chat_llm.generate_as_completed(text, greedy, use_tqdm=False,
                                                 tokenization_kwargs={"truncate_prompt_tokens": 5}))
    assert out.prompt_token_ids == ids[-5:]
    assert run(text, {"add_special_tokens": False}).prompt_token_ids == ids[1:]
    assert run(text, {"truncate_prompt_tokens": 4}, greedy.clone(truncate_prompt_tokens=6)).prompt_token_ids \
        == ids[-6:]
    too_long = f"has {len(ids)} tokens, more than tokenization_kwargs' max_length=5"
    for kwargs, says in (({"max_length": 5}, too_long),
                         ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens=0 is invalid"),
                         ({"truncate_prompt_tokens": 600}, r"at most max_model_len \(512\)"),
                         ({"padding": "max_length"}, "does not pad")):
        with pytest.raises(ValueError, match=says):
            run(text, kwargs)
    with caplog.at_level(logging.WARNING, logger="pagedlab.inputs"):
        assert run(text, {"return_tensors": "pt"}).prompt_token_ids == ids
    assert "['return_tensors'] are not supported and are ignored" in caplog.text
    chat = [{"role": "user", "content": "hi there"}]
    rendered = chat_llm.chat(chat, greedy, use_tqdm=False)[0].prompt_token_ids
    assert rendered[0] != 1  # the template's text, no BOS added
    for kwargs, want in (({"truncate_prompt_tokens": 4}, rendered[-4:]),
                         ({"add_special_tokens": True}, [1] + rendered)):
        out = chat_llm.chat(chat, greedy, use_tqdm=False, tokenization_kwargs=kwargs)[0]
        assert out.prompt_token_ids == want


def test_chat_template_content_format_as_vllm(chat_llm):
    """vLLM's ``chat_template_content_format`` of LLM.chat: "openai" hands the template each
    message's content as a list of text parts (a string as one part), for templates that iterate
    over them; "string" (and "auto", pagedlab's reading of it) the parts joined by newlines."""
    template = ("{% for m in messages %}[{{ m['role'] }}]{% if m['content'] is string %}S:{{ m['content'] }}"
                "{% else %}{% for p in m['content'] %}P:{{ p['text'] }};{% endfor %}{% endif %}{% endfor %}")
    greedy = SamplingParams(temperature=0, max_tokens=2)
    chat = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, "world"]}]

    def prompt(content_format):
        return chat_llm.chat(chat, greedy, use_tqdm=False, chat_template=template,
                             chat_template_content_format=content_format)[0].prompt

    assert prompt("openai") == "[system]P:be brief;[user]P:hello;P:world;"
    assert prompt("string") == prompt("auto") == "[system]S:be brief[user]S:hello\nworld"
    with pytest.raises(ValueError, match=r"chat_template_content_format='jinja' is invalid: give one"):
        prompt("jinja")
