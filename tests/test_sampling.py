"""Sampling: processors against HF's logits processors, seeds, n > 1, stop conditions."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from conftest import KV_BYTES, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.engine.step_inputs import row_seeds
from pagedlab.kernels.sampling import sample_tokens_torch
from pagedlab.layers.sampler import SamplingMetadata, apply_min_p, apply_penalties, apply_top_k_top_p

VOCAB = 300


def _logits(rows=4, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _same_mask(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(ours)
    torch.testing.assert_close(ours[finite], theirs[finite])


@pytest.mark.parametrize("k", [1, 5, 50, VOCAB])
def test_top_k_matches_hf(k):
    logits = _logits(seed=k)
    ours = apply_top_k_top_p(logits, torch.full((4,), k), None)
    _same_mask(ours, TopKLogitsWarper(top_k=k)(None, logits.clone()))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_hf(p):
    logits = _logits(seed=int(p * 1000))
    ours = apply_top_k_top_p(logits, None, torch.full((4,), p))
    _same_mask(ours, TopPLogitsWarper(top_p=p)(None, logits.clone()))


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p_matches_hf(min_p):
    logits = _logits(seed=3)
    ours = apply_min_p(logits, torch.full((4,), min_p))
    _same_mask(ours, MinPLogitsWarper(min_p=min_p)(None, logits.clone()))


def test_per_row_settings_differ_per_row():
    logits = _logits(seed=5)
    ks = torch.tensor([1, 10, VOCAB, 3])
    ours = apply_top_k_top_p(logits, ks, None)
    for row, k in enumerate(ks.tolist()):
        _same_mask(ours[row:row + 1], TopKLogitsWarper(top_k=k)(None, logits[row:row + 1].clone()))


def _penalty_meta(prompt, output, presence=0.0, frequency=0.0, repetition=1.0):
    rows = len(prompt)
    pad = lambda seqs: torch.tensor([s + [VOCAB] * (max(map(len, seqs)) - len(s)) for s in seqs])  # noqa: E731
    return SamplingMetadata(
        temperature=torch.ones(rows), seeds=torch.zeros(rows, dtype=torch.int64),
        presence_penalty=torch.full((rows,), presence), frequency_penalty=torch.full((rows,), frequency),
        repetition_penalty=torch.full((rows,), repetition), output_token_ids=pad(output),
        prompt_token_ids=pad(prompt))


def test_repetition_penalty_matches_hf():
    logits = _logits(rows=2, seed=9)
    prompt, output = [[1, 2, 3, 3], [10, 11]], [[4, 5, 1], [11, 12, 12, 200]]
    ours = apply_penalties(logits.clone(), _penalty_meta(prompt, output, repetition=1.7))
    for row in range(2):
        seen = torch.tensor([prompt[row] + output[row]])
        theirs = RepetitionPenaltyLogitsProcessor(1.7)(seen, logits[row:row + 1].clone())
        torch.testing.assert_close(ours[row:row + 1], theirs)


def test_presence_and_frequency_penalties_follow_openai_definition():
    logits = _logits(rows=1, seed=4)
    output = [[7, 7, 7, 9]]
    ours = apply_penalties(logits.clone(), _penalty_meta([[1]], output, presence=0.5, frequency=0.25))
    expected = logits.clone()
    expected[0, 7] -= 3 * 0.25 + 0.5
    expected[0, 9] -= 1 * 0.25 + 0.5
    torch.testing.assert_close(ours, expected)


def test_temperature_then_top_p_distribution_matches_hf():
    logits = _logits(seed=6)
    ours = apply_top_k_top_p(logits / 0.7, None, torch.full((4,), 0.8))
    theirs = TopPLogitsWarper(0.8)(None, TemperatureLogitsWarper(0.7)(None, logits.clone()))
    _same_mask(ours, theirs)


def test_greedy_repetition_penalty_matches_hf_generate(tiny_llama):
    prompts = random_prompts(3, max_len=30, seed=21)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5),
                            use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_llama.hf_model, p, 16, repetition_penalty=1.5)


def test_sampled_distribution_follows_probabilities(tiny_llama):
    """Many draws from one position follow HF's softmax(logits / T): a chi-square over the five
    likeliest tokens and the rest (5 degrees of freedom) stays under its 1e-5 critical value, 28.7.
    At T=0.2 the top token has p=0.51, at T=0.3 p=0.22: a sampler that ignored the temperature
    or the logits would be hundreds off."""
    prompt = random_prompts(1, seed=2)[0]
    with torch.no_grad():
        logits = tiny_llama.hf_model(torch.tensor([prompt])).logits[0, -1]
    n = 1000
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, seed=5) as llm:
        for temperature in (0.2, 0.3):
            probs = torch.softmax(logits / temperature, -1)
            top = probs.topk(5).indices.tolist()
            expected = [n * float(probs[t]) for t in top] + [n * (1 - float(probs[top].sum()))]
            out = llm.generate([prompt], SamplingParams(temperature=temperature, max_tokens=1, n=n),
                               use_tqdm=False)[0]
            tokens = [c.token_ids[0] for c in out.outputs]
            counts = [tokens.count(t) for t in top] + [sum(t not in top for t in tokens)]
            chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected))
            assert chi2 < 28.7, (temperature, counts, [round(e) for e in expected])


def test_seeded_request_is_batch_invariant(tiny_llama):
    target = random_prompts(1, max_len=20, seed=30)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    others = random_prompts(32, max_len=50, seed=31)
    other_params = [SamplingParams(temperature=0.9, seed=None if i % 2 else i, max_tokens=8 + i % 20)
                    for i in range(32)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
        batch = llm.generate(others[:10] + [target] + others[10:],
                             other_params[:10] + [params] + other_params[10:],
                             use_tqdm=False)[10].outputs[0].token_ids
        reseeded = llm.generate([target], params.clone(seed=4321), use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batch
    assert alone != reseeded


def test_n_completions_are_distinct_and_reproducible(tiny_llama):
    prompt = random_prompts(1, seed=40)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    seqs = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(seqs)) == 4
    assert seqs == [tuple(c.token_ids) for c in second.outputs]
    assert all(len(s) == 12 for s in seqs)


def test_min_tokens_and_stop_token_ids(tiny_llama):
    prompt = random_prompts(1, seed=50)[0]
    greedy = hf_greedy(tiny_llama.hf_model, prompt, 12, eos_token_id=None)
    stop_token = greedy[2]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        stopped = llm.generate([prompt],
                               SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token],
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
        held = llm.generate([prompt],
                            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token],
                                           min_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == greedy[:3]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_token)
    assert len(held.token_ids) >= 6
    assert stop_token not in held.token_ids[:6]


def test_min_tokens_bans_eos_with_ignore_eos_too(tiny_llama):
    """As vLLM's min-tokens rule (every stop id, EOS included, whatever ignore_eos says): with EOS
    made the likeliest token, the first min_tokens tokens are the greedy choice without it, and the
    rest, which ignore_eos does not end, are EOS."""
    prompt = random_prompts(1, seed=51)[0]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        eos = llm.llm_engine.eos_token_ids
        params = SamplingParams(temperature=0, max_tokens=5, min_tokens=3, ignore_eos=True,
                                logit_bias={e: 100.0 for e in eos})
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    unbiased = hf_greedy(tiny_llama.hf_model, prompt, 3, eos_token_id=None)
    assert not set(unbiased) & set(eos)
    assert out.token_ids[:3] == unbiased and set(out.token_ids[3:]) <= set(eos) and len(out.token_ids) == 5


@pytest.mark.slow
def test_stop_strings_on_smollm2(smollm2_dir, smollm2_hf):
    _, tokenizer = smollm2_hf
    text = "Count from one to ten: one, two, three,"
    with LLM("smollm2-135m-instruct", kv_cache_memory_bytes=32 << 20, max_model_len=512) as llm:
        full = llm.generate(text, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
        stop = full.text.split(",")[2].strip() or full.text.strip()[:3]
        cut = llm.generate(text, SamplingParams(temperature=0, max_tokens=20, stop=[stop, "zzz-never"]),
                           use_tqdm=False)[0].outputs[0]
        kept = llm.generate(text, SamplingParams(temperature=0, max_tokens=20, stop=stop,
                                                 include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
        chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0]
    idx = full.text.index(stop)
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (full.text[:idx], "stop", stop)
    assert kept.text == full.text[:idx + len(stop)]
    assert full.text == tokenizer.decode(full.token_ids, skip_special_tokens=True)
    expected_ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                                           tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False).input_ids
    assert chat.prompt_token_ids == expected_ids
    assert chat.outputs[0].text


def _reference_draws(model, prompt: list[int], seed: int, temperature: float, count: int) -> list[int]:
    """What the sampler's torch reference draws from HF float32 logits, token after token, with
    the row seeds the engine gives a request seeded ``seed``: its k-th token keyed by (seed, k)."""
    tokens: list[int] = []
    for k in range(count):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[:, -1].float()
        seeds = torch.from_numpy(row_seeds([seed], [k], step_seed=0))
        tokens.append(int(sample_tokens_torch(logits, torch.tensor([temperature]), seeds)[0]))
    return tokens


def test_seeded_tokens_are_the_reference_draws_on_hf_logits(tiny_llama):
    """Completion i of a request seeded s samples its k-th token with the noise of (s + i, k): the
    engine's tokens are the reference sampler's on HF's logits, the GPU kernel's for those logits."""
    prompts = random_prompts(2, max_len=20, seed=70)
    params = SamplingParams(temperature=0.8, seed=99, n=2, max_tokens=8, ignore_eos=True)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            assert c.token_ids == _reference_draws(tiny_llama.hf_model, prompt, 99 + c.index, 0.8, 8)


def test_seeded_plain_request_ignores_its_batch_its_engine_and_preemption(tiny_llama):
    """A seeded request with plain temperature (the draw straight from the logits) gives the same
    tokens alone, beside rows that are unseeded, seeded, top-p or penalised (which rewrite their
    logits first), and on an engine that runs ahead asynchronously and preempts it."""
    target = random_prompts(1, max_len=20, seed=71)[0]
    params = SamplingParams(temperature=0.9, seed=2024, max_tokens=20, ignore_eos=True)
    others = random_prompts(24, max_len=60, seed=72)
    other_params = [SamplingParams(temperature=0.8, seed=None if i % 3 == 0 else i,
                                   top_p=0.9 if i % 2 else 1.0, presence_penalty=0.5 if i % 5 == 0 else 0.0,
                                   max_tokens=10 + i % 15, ignore_eos=True) for i in range(24)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
        mixed = llm.generate(others[:7] + [target] + others[7:],
                             other_params[:7] + [params] + other_params[7:], use_tqdm=False)
    batch = mixed[7].outputs[0].token_ids
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES // 64, max_model_len=128, max_num_seqs=12,
             max_num_batched_tokens=64, async_scheduling=True) as llm:
        squeezed = llm.generate(others + [target], other_params + [params], use_tqdm=False)[-1]
        preemptions = llm.get_stats().num_preemptions
    assert preemptions > 0
    assert alone == batch == squeezed.outputs[0].token_ids


def test_engine_seed_reproduces_unseeded_sampling(tiny_llama):
    """Requests without a seed draw from the engine's seed: the same seed and workload give the same
    tokens, another seed others, and rows of one step never share noise."""
    prompts = random_prompts(1, max_len=30, seed=73) * 4
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    runs = []
    for seed in (3, 3, 4):
        with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, seed=seed) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([tuple(o.outputs[0].token_ids) for o in outs])
    assert runs[0] == runs[1] != runs[2]
    assert len(set(runs[0])) == 4


def test_seed_minus_one_is_no_seed(tiny_llama):
    """vLLM's rule (OpenAI's "random"): seed=-1 is no seed, so two such requests in one batch draw
    different noise, as unseeded ones do, where a seed of -1 would give both the same tokens."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    prompt = random_prompts(1, max_len=20, seed=80)[0]
    params = SamplingParams(temperature=1.0, seed=-1, max_tokens=10, ignore_eos=True)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        outs = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
