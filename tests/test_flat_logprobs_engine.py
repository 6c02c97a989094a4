"""``SamplingParams(flat_logprobs=True)`` through the engine: each request's sample and prompt
logprobs come back as a ``FlatLogprobs`` holding, position by position (token ids, logprobs,
ranks, decoded tokens), what the same request returns as a list of dicts with
``flat_logprobs=False``; greedy and seeded, with ``n > 1``, label ids, chunked prefill and each
streamed output kind. The list output itself is checked against HF elsewhere; here the flat one
is too, for one greedy run."""

from __future__ import annotations

import pytest

from conftest import KV_BYTES, assert_hf_tokens_and_logprobs, random_prompts
from pagedlab import LLM, FlatLogprobs, SamplingParams
from pagedlab.sampling_params import RequestOutputKind
from test_output_controls import _drive

TEXTS = ["The quick brown fox", "Why is the sky blue? Tell me in one line", "hello world"]


@pytest.fixture(scope="module")
def llm(chat_dir):
    """The tiny chat model (a real tokenizer: decoded tokens) in prefill chunks of 8 tokens."""
    with LLM(chat_dir, kv_cache_memory_bytes=KV_BYTES, device="cpu", max_num_batched_tokens=8) as llm:
        yield llm


def assert_flat_holds(flat, positions) -> None:
    """``flat`` is a ``FlatLogprobs`` whose columns are ``positions`` (a list of dicts, None read
    as no entries) flattened in order, and whose positions read back as those dicts."""
    assert isinstance(flat, FlatLogprobs)
    entries = [list((p or {}).items()) for p in positions]
    ends = [sum(map(len, entries[:i + 1])) for i in range(len(entries))]
    assert flat.start_indices == [e - len(p) for e, p in zip(ends, entries)] and flat.end_indices == ends
    assert flat.token_ids == [t for p in entries for t, _ in p]
    assert flat.logprobs == [lp.logprob for p in entries for _, lp in p]
    assert flat.ranks == [lp.rank for p in entries for _, lp in p]
    assert flat.decoded_tokens == [lp.decoded_token for p in entries for _, lp in p]
    assert list(flat) == [p or {} for p in positions]


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
    "seeded-n2": SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=6, logprobs=2, prompt_logprobs=1,
                                logprob_token_ids=[5, 9]),
    "sample-only": SamplingParams(temperature=0.7, seed=3, max_tokens=5, logprobs=0),
}


@pytest.mark.parametrize("name", PARAMS)
def test_final_outputs_hold_the_list_outputs_positions(llm, name):
    plain = PARAMS[name]
    flat = plain.clone(flat_logprobs=True)
    assert flat != plain and flat.clone() == flat
    lists, flats = (llm.generate(TEXTS, p, use_tqdm=False) for p in (plain, flat))
    for want, got in zip(lists, flats, strict=True):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        for mine, theirs in zip(got.outputs, want.outputs, strict=True):
            assert len(theirs.logprobs) == len(theirs.token_ids)
            assert_flat_holds(mine.logprobs, theirs.logprobs)
            assert mine.cumulative_logprob == theirs.cumulative_logprob
        if plain.prompt_logprobs is None:
            assert got.prompt_logprobs is None
        else:
            assert want.prompt_logprobs[0] is None and len(want.prompt_logprobs) == len(want.prompt_token_ids)
            assert_flat_holds(got.prompt_logprobs, want.prompt_logprobs)
    if name == "seeded-n2":  # the label ids ride along in every sampled position
        assert all({5, 9} <= set(pos) for c in flats[0].outputs for pos in c.logprobs)


def test_flat_logprobs_match_hf(tiny_llama):
    """Greedy over the tiny Llama: HF's tokens, and each chosen token's logprob in the flat record
    within 1e-4 of HF's float32 log-softmax."""
    prompts = random_prompts(3, seed=2)
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2, flat_logprobs=True)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, device="cpu") as tiny:
        outs = tiny.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(isinstance(o.outputs[0].logprobs, FlatLogprobs) for o in outs)
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, prompts, outs, 5)


def _streams(llm, params: SamplingParams, prompt: list[int]) -> dict[bool, list]:
    """Each streamed output of one request, driven step by step, with and without flat_logprobs."""
    return {flat: _drive(llm.llm_engine, f"stream-{flat}", params.clone(flat_logprobs=flat), prompt)
            for flat in (False, True)}


def test_delta_outputs_carry_each_position_once(llm):
    """DELTA through chunked prefill (a 26-token prompt in chunks of 8): each output's flat pieces
    hold the list output's pieces (prompt position 0 once, as no entries), and merged with
    ``RequestOutput.add`` they are the whole request's."""
    prompt = llm.get_tokenizer().encode(" ".join(TEXTS))
    assert len(prompt) > 16
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=5, logprobs=2, prompt_logprobs=2,
                            output_kind=RequestOutputKind.DELTA)
    runs = _streams(llm, params, prompt)
    assert len(runs[True]) == len(runs[False]) > 3
    for got, want in zip(runs[True], runs[False]):
        assert_flat_holds(got.prompt_logprobs, want.prompt_logprobs)
        assert_flat_holds(got.outputs[0].logprobs, want.outputs[0].logprobs)
        assert len(got.outputs[0].logprobs) == len(got.outputs[0].token_ids)
    assert [len(o.prompt_logprobs) for o in runs[True]][-1] == 0  # all were sent before the end
    merged = runs[True][0]
    for later in runs[True][1:]:
        merged = merged.add(later)
    whole = llm.generate({"prompt_token_ids": prompt}, params.clone(output_kind=RequestOutputKind.FINAL_ONLY,
                                                                    flat_logprobs=True), use_tqdm=False)[0]
    assert merged.prompt_logprobs == whole.prompt_logprobs and len(whole.prompt_logprobs) == len(prompt)
    assert merged.outputs[0].logprobs == whole.outputs[0].logprobs


def test_cumulative_outputs_hold_the_positions_recorded_so_far(llm):
    """CUMULATIVE through chunked prefill: each flat output holds the prompt positions recorded so
    far (as vLLM's container grows), where the list output holds every position, None until
    recorded; the positions both hold are the same. Sample logprobs: all so far, in both."""
    prompt = llm.get_tokenizer().encode(" ".join(TEXTS))
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1, prompt_logprobs=1)
    runs = _streams(llm, params, prompt)
    lengths = []
    for got, want in zip(runs[True], runs[False], strict=True):
        recorded = len(got.prompt_logprobs)
        lengths.append(recorded)
        assert len(want.prompt_logprobs) == len(prompt)
        assert all(p is None for p in want.prompt_logprobs[recorded:])
        assert_flat_holds(got.prompt_logprobs, want.prompt_logprobs[:recorded])
        assert_flat_holds(got.outputs[0].logprobs, want.outputs[0].logprobs)
    assert lengths[0] < len(prompt) and lengths[-1] == len(prompt) and lengths == sorted(lengths)
