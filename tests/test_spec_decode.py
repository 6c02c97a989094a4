"""Speculative decoding by n-gram prompt lookup (vLLM's ``speculative_config={"method": "ngram"}``):
greedy tokens and logprobs equal HF transformers' float32 ones; seeded sampling, stops, penalties
and bad words reading the proposals before each row, logits processors beside them, preemption and
LongRoPE give plain decoding's tokens; the proposer equals a brute-force search."""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import pytest
import torch
from transformers import AutoTokenizer

from conftest import KV_BYTES, assert_hf_tokens_and_logprobs, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.config import EngineConfig
from pagedlab.speculative_config import resolve_speculative_config
from pagedlab.engine.ngram_proposer import propose_ngram_drafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_TOKENS = 40


def brute_force_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest n (max_n down to min_n) whose last-n tokens occur earlier, at the earliest
    occurrence, and the k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposal_equals_a_brute_force_search():
    rng = random.Random(0)
    found = 0
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        low = rng.randint(1, 4)
        high, k = rng.randint(low, 7), rng.randint(0, 6)
        want = brute_force_proposal(tokens, low, high, k)
        assert propose_ngram_drafts(tokens, low, high, k) == want, (tokens, low, high, k)
        found += bool(want)
    assert found > 1000  # most cases propose something
    assert propose_ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 1, 3, 2) == [9, 1]  # "2 3": the earliest
    assert propose_ngram_drafts([5, 6, 1, 2, 3, 9, 2, 3], 1, 3, 5) == [9, 2, 3]  # fewer where it ends


def test_speculative_config_defaults_and_errors():
    assert resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_min == 5
    only_max = resolve_speculative_config({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)  # vLLM's defaults
    bad = [({"method": "eagle", "num_speculative_tokens": 3}, r"\['method'\]='eagle' is invalid"),
           ({"method": "ngram"}, r"num_speculative_tokens.*an integer >= 1"),
           ({"num_speculative_tokens": 0}, r"num_speculative_tokens'\]=0 is invalid"),
           ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"prompt_lookup_min'\]=4 is invalid: prompt_lookup_min must be <= prompt_lookup_max \(2\)"),
           ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, r"prompt_lookup_min'\]=0 is invalid"),
           ({"num_speculative_tokens": 2, "draft_model": "d"}, r"unknown key 'draft_model'.*EAGLE and MTP")]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=value).validate()


def test_batch_size_schedule_is_vllms():
    """vLLM's num_speculative_tokens_per_batch_size (its dynamic speculative decoding test's
    table): a batch size in a gap or past the last range takes the K of the range before it, and
    no K exceeds num_speculative_tokens; malformed tables are errors naming the value."""
    key, table = "num_speculative_tokens_per_batch_size", [[32, 128, 2], [1, 16, 3], [256, 2048, 0]]
    config = resolve_speculative_config({"num_speculative_tokens": 3, key: table})
    assert config.num_speculative_tokens_per_batch_size == ((1, 16, 3), (32, 128, 2), (256, 2048, 0))
    sizes = [1, 16, 17, 31, 32, 128, 129, 255, 256, 5000]
    assert [config.tokens_for_batch(n) for n in sizes] == [3, 3, 3, 3, 2, 2, 2, 2, 0, 0]
    assert resolve_speculative_config(config.to_dict()) == config
    capped = {"model": "d", "num_speculative_tokens": 2, key: [[1, 9, 5]]}
    assert resolve_speculative_config(capped).tokens_for_batch(4) == 2
    assert resolve_speculative_config(NGRAM).tokens_for_batch(10 ** 6) == 4  # no table: always k
    for table, why in [([], "non-empty list"), ([[1, 2]], "non-empty list"), ([[1, 5, 1, 10, 2]], "5-item"),
                       ([[1, 2, True]], "non-empty list"), ([[0, 2, 1]], "1 <= first <= last"),
                       ([[1, 2, -1]], r"K >= 0 \(got \[1, 2, -1\]\)"), ([[2, 3, 1]], "starting at 1"),
                       ([[1, 2, 1], [2, 5, 0]], "2 falls in a range ending at 2"),
                       ([[1, 5, 1], [6, 5, 1]], r"got \[6, 5, 1\]"),
                       ([[1, 8, 4.0]], r"three integers each.*\(got \[1, 8, 4.0\]\)")]:
        with pytest.raises(ValueError, match=rf"{key}'\]=.* is invalid.*{why}"):
            EngineConfig(speculative_config={**NGRAM, key: table}).validate()


def record_launches(llm: LLM) -> list[tuple[bool, bool]]:
    """(whether the step proposes, whether it was launched while a step that proposed was in
    flight) of every step the engine launches ahead of reading the one before back."""
    engine, ahead = llm.llm_engine, []
    launch = engine._launch

    def recording(batch, previous):
        if previous is not None:
            ahead.append((any(batch.draft_token_ids), any(previous.batch.draft_token_ids)))
        return launch(batch, previous)

    engine._launch = recording
    return ahead


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_batch_size_schedule_bounds_each_steps_proposals(tiny_llama, async_scheduling):
    """Steps of 1-2 requests propose up to 3 tokens a request, of 3-4 one, of 5 or more none, as
    six requests of different lengths finish; the tokens stay plain decoding's. With asynchronous
    scheduling the steps of 5 or more requests run ahead of the one before, and no step runs ahead
    of one that proposed; without a K=0 range the engine never runs ahead."""
    config = {**NGRAM, "num_speculative_tokens": 3,
              "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 4, 1], [5, 64, 0]]}
    prompts = random_prompts(6, vocab=12, max_len=30, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=8 * (i + 1), ignore_eos=True) for i in range(6)]
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES,
             async_scheduling=async_scheduling) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
        llm.set_model_args(speculative_config=config)
        scheduler, steps, ahead = llm.llm_engine.scheduler, [], record_launches(llm)
        schedule = scheduler.schedule

        def recording():
            batch = schedule()
            steps.append((len(batch.requests), max(map(len, batch.draft_token_ids), default=0)))
            return batch

        scheduler.schedule = recording
        spec = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
        assert llm.llm_engine.async_scheduling is async_scheduling
        llm.set_model_args(speculative_config=NGRAM)  # proposes at every batch size: never runs ahead
        assert llm.llm_engine.async_scheduling is False
    assert _completions(spec) == _completions(plain)
    limit = {0: 0, 1: 3, 2: 3, 3: 1, 4: 1, 5: 0, 6: 0}  # (0: an asynchronous step waiting on the one before)
    assert all(longest <= limit[n] for n, longest in steps), steps
    assert {n for n, longest in steps if longest} == {1, 2, 3, 4}  # each range proposed, the last none
    assert stats.spec_decode_num_accepted_tokens > 0
    assert not any(after_proposals for _, after_proposals in ahead)
    assert len(ahead) >= (10 if async_scheduling else 0) and (async_scheduling or not ahead)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral_window"])
def test_greedy_tokens_and_logprobs_equal_hf(tiny_models, arch):
    """Prompts of a small vocabulary repeat themselves, so proposals come often; some are accepted
    and some rejected, and every kept token and logprob is HF's."""
    model = tiny_models(arch)
    prompts = random_prompts(8, vocab=40, max_len=40, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(model.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, speculative_config=NGRAM) as llm:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        stats = llm.get_stats()
    assert_hf_tokens_and_logprobs(model.hf_model, prompts, outs, MAX_TOKENS)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    drafts = stats.spec_decode_num_drafts
    assert drafts <= stats.spec_decode_num_draft_tokens <= 4 * drafts
    assert stats.generation_tokens == 8 * MAX_TOKENS
    assert 1 < stats.spec_decode_mean_acceptance_length < 5


def test_stats_line_reports_the_acceptance_since_the_line_before(tiny_llama, caplog):
    """vLLM's periodic stats line (disable_log_stats=False) carries the acceptance rate and mean
    acceptance length of the proposals verified since the line before."""
    from pagedlab.llm import StatsLog

    caplog.set_level(logging.INFO, logger="pagedlab.stats")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, speculative_config=NGRAM,
             disable_log_stats=False) as llm:
        llm.generate(random_prompts(4, vocab=40, max_len=40, seed=3), greedy, use_tqdm=False)
        stats = llm.get_stats()
    line = [r.getMessage() for r in caplog.records if r.name == "pagedlab.stats"][-1]
    assert stats.spec_decode_num_accepted_tokens > 0 and "speculative acceptance rate" in line
    more = {"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 10,
            "spec_decode_num_accepted_tokens": 6}  # since the last line: 60% accepted, 2.5 tokens a step
    later = dataclasses.replace(stats, **{k: getattr(stats, k) + v for k, v in more.items()})
    snapshots = iter([stats, later])
    StatsLog(lambda: next(snapshots)).log()
    assert "speculative acceptance rate 60.0%, mean acceptance length 2.50" in caplog.records[-1].getMessage()


def _both(path, prompts, params, **engine_args):
    """(plain decoding's outputs, speculative decoding's, its stats) of one engine, re-planned
    between them (``speculative_config`` is a plan field: the weights stay)."""
    with LLM(path, device="cpu", kv_cache_memory_bytes=KV_BYTES, **engine_args) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
        llm.set_model_args(speculative_config=NGRAM)
        spec = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
    return plain, spec, stats


def _completions(outs):
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for o in outs for c in o.outputs]


def test_seeded_sampling_gives_plain_decodings_tokens(tiny_llama):
    """Each position draws the noise of its own position, proposal or not: seeded sampled tokens
    (with top-k, top-p, min-p, logit bias, min_tokens and n=2) are plain decoding's, their logprobs too."""
    prompts = random_prompts(6, vocab=30, max_len=30, seed=7)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=MAX_TOKENS, logprobs=2, **extra)
              for t, s, extra in [(0.2, 1, {}), (1.0, 2, {"top_k": 5}), (0.3, 3, {"top_p": 0.8}),
                                  (0.3, 4, {"min_p": 0.1, "n": 2}), (0.2, 5, {"logit_bias": {7: 2.0}}),
                                  (0.5, 6, {"min_tokens": 30})]]
    plain, spec, stats = _both(tiny_llama.path, prompts, params)
    assert _completions(spec) == _completions(plain)
    for p, s in zip(plain, spec):
        for cp, cs in zip(p.outputs, s.outputs):
            for a, b in zip(cp.logprobs, cs.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_stops_inside_a_proposal_end_where_plain_decoding_does(tiny_llama):
    """A stop token or EOS among accepted tokens ends the output there (the tokens sampled after it
    in the same step are dropped); proposals end one short of max_tokens."""
    prompts = random_prompts(8, vocab=30, max_len=30, seed=11)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES) as llm:
        free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    stops = [o.outputs[0].token_ids[len(o.outputs[0].token_ids) // 2] for o in free]
    params = [SamplingParams(temperature=0, max_tokens=[MAX_TOKENS, 7, 13][i % 3], stop_token_ids=[stop],
                             ignore_eos=i % 2 == 0) for i, stop in enumerate(stops)]
    plain, spec, stats = _both(tiny_llama.path, prompts, params)
    assert _completions(spec) == _completions(plain)
    assert {c.finish_reason for o in spec for c in o.outputs} == {"stop", "length"}
    assert stats.spec_decode_num_accepted_tokens > 0


def test_stop_strings_cut_the_text_where_plain_decoding_does(smollm2_dir):
    """SmolLM2 copies repeated text, so most proposals are accepted: a stop string completed by an
    accepted token ends the text, and the later tokens of that step are not kept (token ids, text,
    finish and stop reasons equal plain decoding's)."""
    prompt = ("Copy this line three times.\nthe cat sat on the mat, the dog sat on the log.\n"
              "the cat sat on the mat, the dog sat on the log.\n")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    dog, on = (tokenizer.encode(word, add_special_tokens=False)[0] for word in (" dog", " on"))
    params = [greedy.clone(stop=["dog sat"]),
              greedy.clone(stop=["log.\nThe"], include_stop_str_in_output=True),
              greedy.clone(stop=["mat, the"], min_tokens=10), greedy.clone(stop_token_ids=[dog]),
              greedy.clone(stop=["sat"], stop_token_ids=[on]), greedy,  # "sat" ends it, not the " on" after
              greedy.clone(bad_words=["sat on the"])]  # " the" banned after " sat on", proposed or not
    plain, spec, stats = _both(smollm2_dir, [prompt] * 7, params, max_model_len=256)
    assert _completions(spec) == _completions(plain)
    assert [c.finish_reason for o in spec for c in o.outputs] == ["stop"] * 5 + ["length"] * 2
    assert "sat on the" not in spec[6].outputs[0].text and "sat on" in spec[6].outputs[0].text
    assert spec[4].outputs[0].stop_reason == "sat"
    assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens / 2


def test_penalties_see_the_proposals_before_each_row_and_logits_processors_decode_plainly(tiny_llama):
    """Rows whose penalties read their history get proposals: each sampled row sees the proposed
    tokens before it as its history, so greedy and seeded tokens are plain decoding's. Requests
    with logits processors decode plainly beside them: a processor (here one that allows even
    tokens only, and one that bans repeating the last token) never sees a history it banned."""
    prompts = random_prompts(9, vocab=30, max_len=30, seed=13)

    def no_repeat(output_ids, logits):
        if output_ids:
            logits[output_ids[-1]] = float("-inf")
        return logits

    def even_only(output_ids, logits):
        assert all(t % 2 == 0 for t in output_ids), f"history {output_ids} holds a token it banned"
        logits[1::2] = float("-inf")
        return logits

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    penalties = [greedy.clone(repetition_penalty=1.3),
                 greedy.clone(presence_penalty=0.5, frequency_penalty=0.3),
                 greedy.clone(temperature=0.7, seed=3, repetition_penalty=1.2),
                 greedy.clone(frequency_penalty=-0.5)]  # rewards repeats: long accepted runs
    processors = [greedy.clone(logits_processors=[no_repeat]),
                  *[greedy.clone(logits_processors=[even_only])] * 3,
                  greedy.clone(temperature=0.7, seed=4, logits_processors=[no_repeat], top_k=5)]
    plain, spec, stats = _both(tiny_llama.path, prompts, penalties + processors)
    assert _completions(spec) == _completions(plain)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_preemption_prefix_cache_and_long_rope_keep_hf_tokens(tiny_models):
    """A KV cache too small for the batch (preemptions, recomputes), prompts sharing cached prefixes,
    and LongRoPE's switch past 32 tokens (no proposal crosses it): HF's greedy tokens throughout."""
    llama = tiny_models("llama")
    shared = random_prompts(1, vocab=30, min_len=32, max_len=32, seed=17)[0]
    prompts = [shared + p for p in random_prompts(6, vocab=30, max_len=20, seed=19)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(llama.path, device="cpu", kv_cache_memory_bytes=96 << 10, max_model_len=128,
             speculative_config=NGRAM) as llm:  # 12 blocks: two or three sequences at a time
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        stats = llm.get_stats()
    assert_hf_tokens_and_logprobs(llama.hf_model, prompts, outs, MAX_TOKENS)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    longrope = tiny_models("phi3_longrope")
    prompts = random_prompts(6, vocab=5, min_len=24, max_len=31, seed=3)  # proposed across 32 tokens
    with LLM(longrope.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, speculative_config=NGRAM) as llm:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert llm.get_stats().spec_decode_num_accepted_tokens > 0
    assert_hf_tokens_and_logprobs(longrope.hf_model, prompts, outs, MAX_TOKENS)


def test_tensor_parallel_ranks_verify_proposals(tiny_llama):
    """Under tensor parallelism (gloo, two ranks) every rank runs the verification steps rank 0
    builds: HF's greedy tokens and logprobs."""
    prompts = random_prompts(6, vocab=40, max_len=40, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2,
             speculative_config=NGRAM) as llm:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert llm.get_stats().spec_decode_num_accepted_tokens > 0
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, prompts, outs, 30)


def test_server_flag_and_metrics(tiny_llama):
    """``--speculative-config`` takes vLLM's JSON; a served completion has HF's greedy tokens and the
    Prometheus spec-decode counters equal the engine's."""
    import argparse

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from conftest import hf_greedy
    from pagedlab.cli.engine_args import EngineArgs
    from pagedlab.engine.async_engine import AsyncEngine
    from pagedlab.server.app import ServerThread, build_app
    from pagedlab.server.metrics import parse_metrics

    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'])
    assert EngineArgs.from_cli_args(args).speculative_config == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    prompt = [5, 6, 7, 8] * 6
    want = hf_greedy(tiny_llama.hf_model, prompt, MAX_TOKENS, eos_token_id=None)
    llm = LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, speculative_config=NGRAM)
    engine = AsyncEngine.from_llm(llm)
    try:
        with ServerThread(build_app(engine, served_model_names=["tiny"])) as srv:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
            for _ in range(500):  # the finished request's counters come a moment after its response
                metrics = parse_metrics(httpx.get(srv.url + "/metrics", timeout=60).text)
                if metrics["pagedlab:generation_tokens_total"] == MAX_TOKENS:
                    break
                time.sleep(0.02)
    finally:
        engine.shutdown()
        stats = llm.get_stats()
        llm.close()
    assert got["choices"][0]["token_ids"] == want
    assert stats.spec_decode_num_accepted_tokens > 0
    assert metrics["pagedlab:spec_decode_num_drafts_total"] == stats.spec_decode_num_drafts
    assert metrics["pagedlab:spec_decode_num_accepted_tokens_total"] == stats.spec_decode_num_accepted_tokens
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos  # a proposal's later tokens are kept less often
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert list(per_pos) == sorted(per_pos, reverse=True)
    name = "pagedlab:spec_decode_num_accepted_tokens_per_pos_total"
    served = [metrics[f'{name}{{model_name="tiny",position="{j}"}}'] for j in range(len(per_pos))]
    assert served == list(per_pos)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mixed_graphs", [True, False], ids=["mixed-graphs", "eager-mixed"])
def test_on_the_gpu_verification_steps_give_hf_tokens(tiny_models, mixed_graphs):
    """Float32 on the GPU, Triton attention: verification steps replay mixed-step CUDA graphs (or
    run eagerly) beside plain decodes in decode graphs; tokens and logprobs are HF's."""
    model = tiny_models("llama")
    prompts = random_prompts(12, vocab=40, max_len=60, seed=29)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(model.path, device="cuda", dtype="float32", kv_cache_memory_bytes=256 << 20,
             cuda_graph_mixed_steps=mixed_graphs, speculative_config=NGRAM) as llm:
        assert llm.get_engine_info().mixed_cuda_graphs == mixed_graphs
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        stats = llm.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_hf_tokens_and_logprobs(model.hf_model, prompts, outs, MAX_TOKENS)


def test_proposals_take_only_what_plain_decoding_leaves():
    """Scheduler alone: proposals come after every running decode and admitted prompt, from the
    budget and blocks left: they never preempt a request, nor keep a prompt waiting."""
    from pagedlab.speculative_config import SpeculativeConfig
    from pagedlab.engine.kv_cache import KVCacheManager
    from pagedlab.engine.request import Request
    from pagedlab.engine.scheduler import Scheduler

    def request(rid, prompt):
        return Request(rid, prompt, SamplingParams(max_tokens=50, ignore_eos=True))

    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1)

    def two_decodes(num_blocks: int, budget: int = 32):
        """a (whose end, "3 1", came before: it proposes [2, 3, 1]) and b, both decoding."""
        s = Scheduler(KVCacheManager(num_blocks, 4, enable_prefix_caching=False), 8, budget, 256,
                      speculative=spec)
        a, b = request("a", [1, 2, 3, 1, 2, 3]), request("b", [9, 8, 7, 6, 5, 4, 3, 2])
        for r in (a, b):
            s.add_request(r)
        s.update_from_output(s.update_after_launch(s.schedule()), [1, 77])  # 2 blocks each
        return s, a, b

    s, a, b = two_decodes(num_blocks=64, budget=32)
    batch = s.schedule()
    assert batch.draft_token_ids == [[2, 3, 1], []] and batch.num_new_tokens == [4, 1]
    s, a, b = two_decodes(num_blocks=5, budget=32)  # one block free: b's next token needs it
    batch = s.schedule()
    assert batch.requests == [a, b] and batch.num_new_tokens == [1, 1] and not batch.preempted
    assert batch.draft_token_ids == [[], []]  # a's proposal would have taken b's block
    s, a, b = two_decodes(num_blocks=64, budget=32)
    s.max_num_batched_tokens = 9
    c = request("c", [40, 41, 42, 43, 44, 45, 46])
    s.add_request(c)
    batch = s.schedule()  # two decodes and c's 7 tokens fill the budget: no proposal
    assert batch.requests == [a, b, c] and batch.num_new_tokens == [1, 1, 7]
    # a batch-size schedule counts every request of the step, an admitted prompt's chunk too
    s, a, b = two_decodes(num_blocks=64, budget=32)
    s.speculative = dataclasses.replace(spec, num_speculative_tokens_per_batch_size=((1, 2, 2), (3, 64, 0)))
    assert s.schedule().draft_token_ids == [[2, 3], []]  # two requests: at most 2 tokens each
    s, a, b = two_decodes(num_blocks=64, budget=32)
    s.speculative = dataclasses.replace(spec, num_speculative_tokens_per_batch_size=((1, 2, 2), (3, 64, 0)))
    s.add_request(request("c", [40, 41, 42]))
    batch = s.schedule()
    assert len(batch.requests) == 3 and batch.draft_token_ids == [[], [], []]


def test_a_step_runs_ahead_only_between_steps_that_propose_nothing():
    """``must_read_back`` with speculation: a step in flight that verifies proposals, or a next step
    that may propose (K above 0 for the running requests), is read back first; otherwise the next
    step runs ahead, and a request whose last token is still on the device gets no proposal even
    where the batch it lands in allows one."""
    from pagedlab.speculative_config import SpeculativeConfig
    from pagedlab.engine.kv_cache import KVCacheManager
    from pagedlab.engine.request import Request
    from pagedlab.engine.scheduler import ScheduledBatch, Scheduler

    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1,
                             num_speculative_tokens_per_batch_size=((1, 1, 0), (2, 64, 2)))
    s = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=False), 8, 32, 256, speculative=spec)
    a = Request("a", [1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    s.add_request(a)
    in_flight = s.schedule()
    s.update_after_launch(in_flight)  # a's first token is pending
    assert not s.must_read_back(in_flight)  # one request: K=0
    s.add_request(Request("b", [4, 5, 1, 2, 3, 1, 2], SamplingParams(max_tokens=50, ignore_eos=True)))
    batch = s.schedule()  # two requests, K=2, but a's last token is on the device
    assert batch.requests[0] is a and batch.draft_token_ids == [[], []]
    assert s.must_read_back(batch)  # two running: the next step may propose
    proposing = ScheduledBatch([a], [3], [[2, 3]])
    s.speculative = dataclasses.replace(spec, num_speculative_tokens_per_batch_size=((1, 64, 0),))
    assert s.must_read_back(proposing) and not s.must_read_back(batch)


def test_counters_count_a_prompts_last_token_as_prompt(tiny_llama):
    """A chunked prompt whose last chunk is one token, with a proposal after it: the engine's
    prompt and generation token counters equal plain decoding's."""
    prompts = [[5, 6, 7, 8] * 4 + [5], [9, 10, 11] * 5 + [9, 10]]  # 17 tokens: chunks of 16 and 1
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    stats = {}
    for spec in (None, NGRAM):
        with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=16,
                 enable_prefix_caching=False, speculative_config=spec) as llm:
            llm.generate(prompts, greedy, use_tqdm=False)
            stats[spec is None] = llm.get_stats()
    assert stats[False].spec_decode_num_drafts > 0
    assert stats[False].prompt_tokens_computed == stats[True].prompt_tokens_computed == 34
    assert stats[False].generation_tokens == stats[True].generation_tokens == 16


def test_delta_outputs_carry_every_accepted_token(tiny_llama):
    """RequestOutputKind.DELTA through the step loop: a step that keeps several tokens hands them
    over in one delta, and the deltas add up to plain decoding's tokens and logprobs."""
    from pagedlab.sampling_params import RequestOutputKind

    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1,
                            output_kind=RequestOutputKind.DELTA)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES) as llm:
        whole = params.clone(output_kind=RequestOutputKind.CUMULATIVE)
        plain = llm.generate({"prompt_token_ids": prompt}, whole, use_tqdm=False)[0].outputs[0]
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, speculative_config=NGRAM) as llm:
        engine = llm.llm_engine
        engine.add_request("d", prompt, params)
        deltas = []
        while engine.has_unfinished_requests():
            deltas += [o.outputs[0] for o in engine.step() if o.request_id == "d"]
    assert max(len(d.token_ids) for d in deltas) > 1  # some step kept proposed tokens
    assert [t for d in deltas for t in d.token_ids] == plain.token_ids
    got = [p for d in deltas for p in d.logprobs]
    assert len(got) == len(plain.logprobs)
    for mine, want in zip(got, plain.logprobs):
        assert mine.keys() == want.keys() and all(abs(mine[t].logprob - want[t].logprob) < 1e-5 for t in mine)


def test_repro_check_speculation_parity(tiny_llama, tmp_path):
    """``pagedlab repro check --checks spec``: the same engine with and without speculation gives
    the same greedy and seeded sampled tokens (float32, CPU), the proposals' acceptance is reported,
    and the engine's plan comes back; a result compared by hand is "differs"."""
    from pagedlab.cli.main import main
    from pagedlab.lab import repro
    from pagedlab.lab.repro.speculation import _result

    prompts = random_prompts(4, vocab=40, max_len=30, seed=3)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES) as llm:
        result = repro.speculation_parity(llm, NGRAM, prompts, max_tokens=24, seeds=(0, 1))
        assert llm.get_engine_info().config.speculative_config is None
        stats = llm.get_stats()
    assert result.same and result.metrics["greedy_match_rate"] == result.metrics["sampled_match_rate"] == 1.0
    assert 0 < result.metrics["acceptance_rate"] < 1
    tokens = result.details["tokens"]
    tokens["speculative"]["seed 1"][2] = tokens["speculative"]["seed 1"][2][:5] + [-1]
    worse = _result(tokens, stats, NGRAM, 24, 0.8, [0, 1])
    assert not worse.same and worse.metrics["first_divergence"] == 5
    assert worse.metrics["sampled_match_rate"] == 0.875  # one of four prompts under one of two seeds
    out = tmp_path / "report.json"
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("\n".join(f'{{"prompt_token_ids": {p}}}' for p in prompts))
    spec = '{"num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}'
    assert main(["repro", "check", "--model", tiny_llama.path, "--device", "cpu", "--kv-cache-memory-bytes",
                 "16MiB", "--prompts", str(prompt_file), "--checks", "spec", "--max-tokens", "8",
                 "--num-seeds", "2", "--speculative-config", spec, "--out", str(out)]) == 0
    assert '"verdict": "same"' in out.read_text() and '"num_speculative_tokens": 3' in out.read_text()
