"""Greedy output, logprobs and beam search against HF transformers in float32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from conftest import KV_BYTES, SMOLLM2_TEXTS, hf_greedy, random_prompts
from pagedlab import LLM, BeamSearchParams, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def hf_reference(model, prompts, max_new_tokens):
    return [hf_greedy(model, p, max_new_tokens) for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_hf_on_tiny_models(tiny_models, arch):
    tiny = tiny_models(arch)
    prompts = random_prompts(6, max_len=80, seed=1)
    expected = hf_reference(tiny.hf_model, prompts, GREEDY.max_tokens)
    with LLM(tiny.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    for o, p in zip(outs, prompts):
        assert o.prompt_token_ids == p
        assert o.outputs[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    """Prompts that share long prefixes (so prefix caching hits) plus unrelated ones."""
    base = random_prompts(1, min_len=70, max_len=70, seed=7)[0]
    others = random_prompts(4, max_len=90, seed=8)
    return [base[:n] + extra for n, extra in zip([70, 40, 65, 17], [[5, 6], [7], [8, 9, 10], []])] + others


@pytest.fixture(scope="module")
def hf_expected(tiny_llama, shared_prefix_prompts):
    return hf_reference(tiny_llama.hf_model, shared_prefix_prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("engine_args", [
    dict(enable_prefix_caching=False),
    dict(enable_prefix_caching=True),
    dict(max_num_batched_tokens=16),  # chunked prefill of every prompt, mixed with decodes
    dict(max_num_batched_tokens=7, block_size=32),
    dict(max_model_len=128, num_blocks=10),  # preemption
    dict(block_size=16),
    dict(block_size=32),
    dict(block_size=64),
    dict(max_num_seqs=3),
    dict(async_scheduling=True, enable_prefix_caching=True),
    dict(async_scheduling=True, max_num_batched_tokens=16),
    dict(async_scheduling=True, max_model_len=128, num_blocks=10),
    dict(async_scheduling=True, max_num_seqs=3, block_size=32),
], ids=["no-prefix-cache", "prefix-cache", "chunked-16", "chunked-7-bs32", "preemption", "bs16", "bs32",
        "bs64", "max-seqs-3", "async-prefix-cache", "async-chunked-16", "async-preemption",
        "async-max-seqs-3"])
def test_engine_variants_give_hf_tokens(tiny_llama, shared_prefix_prompts, hf_expected, engine_args):
    args = dict(engine_args)
    num_blocks = args.pop("num_blocks", None)
    # 10 blocks of 16 tokens are far fewer than the batch needs, so requests get preempted.
    kv_bytes = KV_BYTES if num_blocks is None else num_blocks * _bytes_per_block(tiny_llama)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=kv_bytes, **args) as llm:
        outs = llm.generate(shared_prefix_prompts, GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == hf_expected
    if engine_args.get("enable_prefix_caching"):
        assert stats.prefix_cache_hit_tokens > 0
        assert any(o.num_cached_tokens > 0 for o in outs)
    if engine_args.get("enable_prefix_caching") is False:
        assert stats.prefix_cache_hit_tokens == 0
    if num_blocks is not None:
        assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0  # nothing leaked


def _bytes_per_block(tiny, block_size=16):
    cfg = tiny.hf_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * 4


def test_logprobs_and_prompt_logprobs_match_hf(tiny_llama):
    prompts = random_prompts(3, min_len=5, max_len=30, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=9) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    model = tiny_llama.hf_model
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        assert completion.token_ids == gen.sequences[0, len(prompt):].tolist()
        total = 0.0
        for step, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
            ref = torch.log_softmax(gen.logits[step][0].float(), -1)
            assert abs(position[token].logprob - ref[token].item()) < 1e-4
            assert position[token].rank == int((ref >= ref[token]).sum())
            top = ref.topk(5)
            for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
                assert abs(position[tid].logprob - lp) < 1e-4
            total += ref[token].item()
        assert abs(completion.cumulative_logprob - total) < 1e-3
        # prompt logprobs: teacher-forced over the prompt
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
            top = ref[pos - 1].topk(3)
            assert set(top.indices.tolist()) <= set(entry)


def test_minus_one_logprobs_return_the_whole_vocabulary(tiny_llama):
    """vLLM's ``logprobs=-1`` / ``prompt_logprobs=-1``: every token of the vocabulary at each position,
    with HF's log_softmax and ranks 1..V."""
    prompt = random_prompts(1, min_len=6, max_len=6, seed=4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    vocab = tiny_llama.hf_model.config.vocab_size
    with torch.no_grad():
        ids = torch.tensor([prompt + out.outputs[0].token_ids])
        ref = torch.log_softmax(tiny_llama.hf_model(ids).logits[0].float(), -1)
    positions = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert out.prompt_logprobs[0] is None and len(positions) == len(prompt) + 1
    for pos, expected in zip(positions, ref):
        assert sorted(pos) == list(range(vocab))
        assert torch.tensor([pos[t].logprob for t in range(vocab)]) == pytest.approx(expected, abs=1e-4)
        assert sorted(lp.rank for lp in pos.values()) == list(range(1, vocab + 1))


def test_tied_logprobs_rank_as_vllm(tiny_llama, tmp_path):
    """vLLM's ranks under ties: the sampled token's is the count of tokens whose logprob is at least
    its own (every tie ranks at its end), and the top-k entries keep ranks 1..k. Zeroed LM-head rows
    give those tokens exactly equal logits; sampling only among them (allowed_token_ids leaves the
    raw logprobs alone) picks a tied token."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama.path, dtype=torch.float32).eval()
    tied = list(range(100, 140))
    with torch.no_grad():
        model.lm_head.weight[tied] = 0.0
    model.save_pretrained(tmp_path)
    prompt = random_prompts(1, min_len=6, max_len=6, seed=4)[0]
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=3, allowed_token_ids=tied, logprobs=2)
    with LLM(str(tmp_path), kv_cache_memory_bytes=KV_BYTES) as llm:
        outs = [llm.generate({"prompt_token_ids": prompt}, params.clone(logprobs=k), use_tqdm=False)[0]
                for k in (0, 2)]
    tokens = outs[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == tokens and set(tokens) <= set(tied)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1], -1)
    for step, token in enumerate(tokens):
        want = int((ref[step] >= ref[step, token]).sum())
        assert want > int((ref[step] > ref[step, token]).sum()) + 1  # a tie the rules tell apart
        assert outs[0].outputs[0].logprobs[step][token].rank == want
        position = outs[1].outputs[0].logprobs[step]
        assert position[token].rank == want
        assert sorted(lp.rank for t, lp in position.items() if t != token) == [1, 2]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_beam_search_matches_hf(tiny_models, async_scheduling):
    tiny = tiny_models("qwen2")
    prompts = random_prompts(2, min_len=4, max_len=12, seed=11)
    width, steps = 4, 8
    with LLM(tiny.path, kv_cache_memory_bytes=KV_BYTES, async_scheduling=async_scheduling) as llm:
        outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_hf_beams(tiny.hf_model, prompt, out, width, steps)


def assert_hf_beams(hf_model, prompt, out, width, steps):
    """``out``'s beams are HF's beam search of ``steps`` new tokens (no EOS), with HF's scores."""
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                early_stopping=False, length_penalty=1.0, output_scores=True,
                                return_dict_in_generate=True)
    ours = [seq.tokens[len(prompt):] for seq in out.sequences]
    theirs = [row[len(prompt):].tolist() for row in ref.sequences]
    assert ours == theirs
    for seq, score in zip(out.sequences, ref.sequences_scores.tolist()):
        assert abs(seq.score - score) < 1e-4


def test_beam_search_ends_a_prompt_at_max_model_len(tiny_models):
    """A prompt whose beams fill the context (max_model_len) before max_tokens ends there: its
    beams are HF's search with only that room, finished by "length", while the call's other
    prompt goes on to max_tokens (the engine refused the full beams as prompts and the whole call
    failed). A prompt with no room at all is a ValueError before any step."""
    tiny = tiny_models("qwen2")
    short = random_prompts(1, min_len=5, max_len=5, seed=13)[0]
    long = random_prompts(1, min_len=29, max_len=29, seed=14)[0]
    width, steps = 2, 6
    with LLM(tiny.path, kv_cache_memory_bytes=KV_BYTES, max_model_len=32) as llm:
        outs = llm.beam_search([short, long], BeamSearchParams(beam_width=width, max_tokens=steps,
                                                               ignore_eos=True))
        with pytest.raises(ValueError, match="max_model_len is 32"):
            llm.beam_search([short, long + short], BeamSearchParams(beam_width=width, max_tokens=steps))
    assert_hf_beams(tiny.hf_model, short, outs[0], width, steps)
    assert_hf_beams(tiny.hf_model, long, outs[1], width, 32 - len(long))
    assert all(seq.finish_reason == "length" for out in outs for seq in out.sequences)


def test_beam_search_where_every_candidate_stops(tiny_models):
    """Every one of the 2 x beam_width candidates of the first step is a stop token: the search
    ends there with the best of them (the HF argmax), finished by "stop"."""
    tiny = tiny_models("qwen2")
    prompt = random_prompts(1, min_len=4, max_len=12, seed=12)[0]
    with torch.no_grad():
        first = torch.log_softmax(tiny.hf_model(torch.tensor([prompt])).logits[0, -1], -1)
    top2 = first.topk(2).indices.tolist()
    with LLM(tiny.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=4, stop_token_ids=top2))
    (seq,) = out.sequences
    assert seq.tokens[len(prompt):] == top2[:1] and seq.finish_reason == "stop"
    assert abs(seq.score - first[top2[0]].item()) < 1e-4


@pytest.mark.slow
def test_smollm2_greedy_mixed_batch_matches_hf(smollm2_dir, smollm2_hf):
    model, tokenizer = smollm2_hf
    texts = SMOLLM2_TEXTS
    prompts = [tokenizer(t).input_ids for t in texts]
    max_tokens = 20
    expected = [hf_greedy(model, p, max_tokens) for p in prompts]
    with LLM("smollm2-135m-instruct", kv_cache_memory_bytes=64 << 20, max_model_len=1024,
             max_num_batched_tokens=64) as llm:
        outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == expected
    for o, ids in zip(outs, expected):
        assert o.outputs[0].text == tokenizer.decode(ids, skip_special_tokens=True)


def test_block_table_rows_kept_between_steps_equal_a_fresh_build(tiny_llama, shared_prefix_prompts):
    """The model runner keeps block-table rows from the step before; through preemption, prefix
    hits, chunked prefill and finishing requests (asynchronous loop), every table it hands the
    kernels equals one built afresh from the requests' block lists."""
    import numpy as np

    with LLM(tiny_llama.path, kv_cache_memory_bytes=10 * _bytes_per_block(tiny_llama), max_model_len=128,
             max_num_batched_tokens=16, async_scheduling=True) as llm:
        runner = llm.llm_engine.runner
        build = runner._build_block_table
        kept_rows = []

        def checked_build(requests):
            kept_rows.append(sum(runner._block_table_rows.get(r, (0, -1))[1] == len(r.block_ids)
                                 for r in requests))
            table = build(requests)
            fresh = np.zeros((len(requests), max(len(r.block_ids) for r in requests)), dtype=np.int32)
            for row, r in enumerate(requests):
                fresh[row, :len(r.block_ids)] = r.block_ids
            np.testing.assert_array_equal(table, fresh)
            return table

        runner._build_block_table = checked_build
        llm.generate(shared_prefix_prompts, GREEDY, use_tqdm=False)
        assert llm.get_stats().num_preemptions > 0
    assert sum(kept_rows) > 0  # rows were reused, so the comparison covered reuse
