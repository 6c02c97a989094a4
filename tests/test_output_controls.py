"""vLLM's bad_words, logprob_token_ids and output_kind, offline and through the AsyncEngine,
against hand-computed expectations: HF's greedy generate with the same banned sequences, HF's
float32 logits for the label logprobs, and the cumulative output for the deltas."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from conftest import KV_BYTES, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine
from pagedlab.engine.bad_words import bad_word_bans, bad_words_token_ids
from pagedlab.sampling_params import RequestOutputKind
from test_server_support import TINY_KV_BYTES, build_tiny_chat_model

PROMPT = "Why is the sky blue? Because"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    import transformers

    path = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def test_bad_word_rule_by_hand():
    words = [[7], [3, 4], [1, 2, 5]]
    assert bad_word_bans(words, []) == [7]  # one-token words always; longer ones need their prefix
    assert bad_word_bans(words, [9, 3]) == [7, 4]
    assert bad_word_bans(words, [1, 2]) == [7, 5]
    assert bad_word_bans(words, [2]) == [7]  # [1, 2, 5] needs both earlier tokens


def vllm_bad_word_ids(tokenizer, word: str) -> list[list[int]]:
    """vLLM's rule, written out: the word as it starts a text, and after a space where that gives
    another first token and as many tokens."""
    bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    if not bare:  # a text of whitespace alone (which SamplingParams refuses)
        return []
    return [bare] + ([spaced] if spaced and spaced[0] != bare[0] and len(spaced) == len(bare) else [])


def _words_from(tokenizer, plain: list[int]) -> tuple[int, str, str]:
    """From the plain run: the first two-token span whose text tokenizes back to it (so banning
    it bans its second token right after its first, at ``plain[i + 1]``), and a later one-token
    word with a spaced form of its own (two bans) that does not occur before that point."""
    def forms(ids):
        return vllm_bad_word_ids(tokenizer, tokenizer.decode(ids))

    i = next(i for i in range(len(plain) - 1) if plain[i:i + 2] in forms(plain[i:i + 2]))
    j = next(j for j in range(i + 2, len(plain)) if [plain[j]] in forms(plain[j:j + 1])
             and len(forms(plain[j:j + 1])) == 2 and plain[j] not in plain[:i + 2])
    return i, tokenizer.decode(plain[i:i + 2]), tokenizer.decode(plain[j:j + 1])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_match_hf_bad_words_ids(chat_model, async_scheduling):
    path, hf = chat_model
    with LLM(path, kv_cache_memory_bytes=TINY_KV_BYTES, async_scheduling=async_scheduling) as llm:
        tokenizer = llm.get_tokenizer()
        prompt_ids = tokenizer.encode(PROMPT)
        plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
        i, word_two, word_one = _words_from(tokenizer, plain)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word_two, word_one])
        got = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
        banned = bad_words_token_ids(tokenizer, [word_two, word_one], llm.llm_engine.hf_config.vocab_size)
    expected = vllm_bad_word_ids(tokenizer, word_two) + vllm_bad_word_ids(tokenizer, word_one)
    assert banned == expected and len(banned) >= 3 and any(len(w) == 2 for w in banned)
    assert prompt_ids[-1] not in [w[0] for w in banned if len(w) > 1]  # HF also matches across the prompt
    assert got[:i + 1] == plain[:i + 1] and got[i + 1] != plain[i + 1]  # the two-token word's ban acts
    assert got == hf_greedy(hf, prompt_ids, 12, bad_words_ids=expected, min_new_tokens=12)


def test_the_token_that_stops_a_sequence_stays_out_of_its_text(chat_model):
    """vLLM's rule: a stop token id (or EOS) ends the sequence and is in token_ids, but its text
    is not in the output unless include_stop_str_in_output; a stop string is cut the same way."""
    path, _ = chat_model
    with LLM(path, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        tokenizer = llm.get_tokenizer()
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        plain = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
        k = next(j for j in range(2, len(plain)) if plain[j] not in plain[:j]
                 and "\ufffd" not in tokenizer.decode(plain[j - 1:j + 1]))
        for include in (False, True):
            params = greedy.clone(stop_token_ids=[plain[k]], include_stop_str_in_output=include)
            out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == plain[:k + 1]
            assert (out.finish_reason, out.stop_reason) == ("stop", plain[k])
            assert out.text == tokenizer.decode(plain[:k + 1 if include else k])


def test_stop_strings_wait_past_min_tokens(chat_model):
    """vLLM's rule: a stop string counts only once more than min_tokens tokens are out, so the
    min_tokens-th token never ends the text early."""
    path, _ = chat_model
    with LLM(path, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        tokenizer = llm.get_tokenizer()
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        plain = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
        full, piece = tokenizer.decode(plain), lambda j: tokenizer.decode(plain[j:j + 1])
        k = next(j for j in range(2, len(plain) - 1) if piece(j).strip() and "\ufffd" not in piece(j)
                 and full.count(piece(j)) == 1 and piece(j) not in tokenizer.decode(plain[:j]))
        stop = piece(k)
        stopped = llm.generate(PROMPT, greedy.clone(stop=[stop], min_tokens=k), use_tqdm=False)[0].outputs[0]
        assert stopped.token_ids == plain[:k + 1]
        assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
        held = llm.generate(PROMPT, greedy.clone(stop=[stop], min_tokens=k + 1), use_tqdm=False)[0].outputs[0]
        assert held.token_ids == plain and held.finish_reason == "length" and stop in held.text


def _hf_step_logprobs(hf, ids: list[int], num_new: int) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -num_new - 1:-1].float()
    return logits.log_softmax(-1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_logprob_token_ids_match_hf_logits(tiny_llama, async_scheduling):
    labels = [5, 17, 999, 42]
    prompts = random_prompts(3, max_len=20, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprob_token_ids=labels),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=6, ignore_eos=True, logprobs=2,
                             logprob_token_ids=labels[:2])]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, async_scheduling=async_scheduling) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].outputs[0].logprobs is None
    for out, p in ((outs[0], params[0]), (outs[2], params[2])):
        c = out.outputs[0]
        want = _hf_step_logprobs(tiny_llama.hf_model, out.prompt_token_ids + c.token_ids, len(c.token_ids))
        assert len(c.logprobs) == len(c.token_ids)
        for step, (token, position) in enumerate(zip(c.token_ids, c.logprobs)):
            expected_ids = {token, *p.logprob_token_ids}
            assert expected_ids <= set(position)
            assert len(position) <= len(expected_ids) + (p.logprobs or 0)
            for tid in expected_ids:
                assert position[tid].logprob == pytest.approx(want[step, tid].item(), abs=1e-4)
                assert position[tid].rank == int((want[step] > want[step, tid]).sum()) + 1


def _drive(engine, request_id: str, params: SamplingParams, prompt_ids: list[int]):
    engine.add_request(request_id, prompt_ids, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def _spanning_stop(texts: list[str]) -> tuple[int, str]:
    """(where, stop): in the texts of a run's first k tokens, the first boundary after a token of
    two or more characters where those two and the next token's first character form a string
    found nowhere earlier."""
    for k in range(1, len(texts) - 1):
        where, after = len(texts[k]), texts[k + 1]
        stop = after[where - 2:where + 1]
        if (after.startswith(texts[k]) and where - len(texts[k - 1]) >= 2 and len(stop) == 3
                and "\ufffd" not in stop and after.find(stop) == where - 2):
            return where, stop
    raise AssertionError(f"no stop string spans two tokens in {texts[-1]!r}")


def test_streams_never_show_part_of_a_stop_string(chat_model):
    """A stop string spanning two tokens: the engine's streamed outputs hold back two characters
    until the text settles, so the DELTA pieces add up to the final text and the cumulative texts
    only grow (vLLM's rule)."""
    path, _ = chat_model
    with LLM(path, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        tokenizer, engine = llm.get_tokenizer(), llm.llm_engine
        prompt = tokenizer.encode(PROMPT)
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        plain = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
        where, stop = _spanning_stop([tokenizer.decode(plain[:k]) for k in range(len(plain) + 1)])
        params = greedy.clone(stop=[stop])
        deltas = _drive(engine, "d", params.clone(output_kind=RequestOutputKind.DELTA), prompt)
        cumulative = [o.outputs[0].text for o in _drive(engine, "c", params, prompt)]
    assert cumulative[-1] == tokenizer.decode(plain)[:where - 2] and deltas[-1].outputs[0].stop_reason == stop
    assert "".join(o.outputs[0].text for o in deltas) == cumulative[-1]
    assert all(a == b[:len(a)] for a, b in itertools.pairwise(cumulative))


def test_output_kind_offline_engine(tiny_llama):
    prompt = random_prompts(1, max_len=12, seed=8)[0]
    base = dict(temperature=0, max_tokens=7, ignore_eos=True, logprobs=1)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        engine = llm.llm_engine
        cumulative = _drive(engine, "c", SamplingParams(**base), prompt)
        deltas = _drive(engine, "d", SamplingParams(**base, output_kind=RequestOutputKind.DELTA), prompt)
        final = _drive(engine, "f", SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY), prompt)
        offline = llm.generate({"prompt_token_ids": prompt},
                               SamplingParams(**base, output_kind=RequestOutputKind.DELTA), use_tqdm=False)[0]
    whole = cumulative[-1].outputs[0]
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 8))
    assert [len(o.outputs[0].token_ids) for o in deltas] == [1] * 7  # one new token per step
    assert [t for o in deltas for t in o.outputs[0].token_ids] == whole.token_ids
    assert [pos for o in deltas for pos in o.outputs[0].logprobs] == whole.logprobs
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == whole.token_ids
    assert offline.outputs[0].token_ids == whole.token_ids  # LLM.generate returns whole outputs, as vLLM


def test_no_output_for_a_prefill_chunk_without_tokens(tiny_llama):
    """As vLLM's engine, which makes an output only for a step that gave the request tokens (or
    finished it): chunked prefill of a long prompt yields no empty outputs, cumulative or delta;
    with DELTA prompt logprobs each chunk's positions still come as they are computed."""
    prompt = random_prompts(1, min_len=40, max_len=40, seed=9)[0]
    base = dict(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=8) as llm:
        engine = llm.llm_engine
        cumulative = _drive(engine, "c", SamplingParams(**base), prompt)
        deltas = _drive(engine, "d", SamplingParams(**base, output_kind=RequestOutputKind.DELTA), prompt)
        scored = _drive(engine, "p", SamplingParams(**base, prompt_logprobs=1,
                                                     output_kind=RequestOutputKind.DELTA), prompt)
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3]
    assert [len(o.outputs[0].token_ids) for o in deltas] == [1, 1, 1]
    positions = [p for o in scored for p in o.prompt_logprobs]
    assert len(scored) > 3 and len(positions) == len(prompt) and positions[0] is None
    assert [t for o in scored for t in o.outputs[0].token_ids] == cumulative[-1].outputs[0].token_ids


def test_output_kind_async_engine(chat_model):
    path, _ = chat_model

    async def collect(engine, kind):
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=kind)
        return [out async for out in engine.generate(PROMPT, params)]

    with LLM(path, kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        engine = AsyncEngine.from_llm(llm)
        try:
            deltas = asyncio.run(collect(engine, RequestOutputKind.DELTA))
            final = asyncio.run(collect(engine, RequestOutputKind.FINAL_ONLY))
        finally:
            engine.shutdown()
    assert "".join(o.outputs[0].text for o in deltas) == want.text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == want.token_ids
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
    assert len(final) == 1 and final[0].outputs[0].text == want.text


@pytest.mark.parametrize("kwargs, field", [
    (dict(bad_words=["ok", "  "]), "bad_words"), (dict(bad_words="word"), "bad_words"),
    (dict(logprob_token_ids=[]), "logprob_token_ids"), (dict(logprob_token_ids=[-1]), "logprob_token_ids"),
    (dict(output_kind="delta"), "output_kind")])
def test_bad_output_controls(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_output_controls_on_gpu_with_async_steps_and_graphs(chat_model, tiny_llama):
    """The CUDA path: asynchronous steps, CUDA graphs, label logprobs copied back behind the
    step's event, a multi-token bad word making the loop read each step back."""
    path, hf = chat_model
    labels = [5, 17, 42]
    prompts = random_prompts(4, max_len=20, seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprob_token_ids=labels)
    with LLM(tiny_llama.path, dtype="float32", device="cuda", kv_cache_memory_bytes=KV_BYTES) as llm:
        assert llm.get_engine_info().async_scheduling
        outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.token_ids == hf_greedy(tiny_llama.hf_model, out.prompt_token_ids, 8)
        want = _hf_step_logprobs(tiny_llama.hf_model, out.prompt_token_ids + c.token_ids, len(c.token_ids))
        for step, position in enumerate(c.logprobs):
            for tid in labels:
                assert position[tid].logprob == pytest.approx(want[step, tid].item(), abs=1e-3)
    with LLM(path, dtype="float32", device="cuda", kv_cache_memory_bytes=TINY_KV_BYTES) as llm:
        tokenizer = llm.get_tokenizer()
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        plain = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
        i, word, _ = _words_from(tokenizer, plain)
        got = llm.generate(PROMPT, greedy.clone(bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
    banned = vllm_bad_word_ids(tokenizer, word)
    assert got[:i + 1] == plain[:i + 1] and got[i + 1] != plain[i + 1]  # banned after its first token
    assert got == hf_greedy(hf, tokenizer.encode(PROMPT), 12, bad_words_ids=banned, min_new_tokens=12)
