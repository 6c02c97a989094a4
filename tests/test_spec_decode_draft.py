"""Speculative decoding with a draft model (vLLM's ``speculative_config={"method": "draft_model",
"model": path}``): the target's greedy tokens and logprobs are HF transformers' float32 ones, and
every proposal is the draft model's own HF greedy continuation of the sequence it was made for
(so the draft's KV cache, caught up where a request proposes through prompt chunks, steps without
proposals, rejections, preemptions and prefix-cache hits, holds the right keys); seeded sampling
gives plain decoding's tokens; bad drafts are refused with clear errors."""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch

from conftest import KV_BYTES, assert_hf_tokens_and_logprobs, build_tiny_model, hf_greedy, random_prompts
from test_spec_decode import record_launches
from pagedlab import LLM, SamplingParams
from pagedlab.config import EngineConfig
from pagedlab.speculative_config import resolve_speculative_config
from pagedlab.engine.sleep_mode import SleepStateError

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory):
    """Draft models for the tiny Llama: itself, its first layer alone (agrees often, not always),
    and an unrelated Qwen3 (different heads and head_dim; rarely agrees)."""
    target = tiny_models("llama")
    return {"self": (target.path, target.hf_model),
            "one_layer": first_layer_draft(target, tmp_path_factory.mktemp("llama_1layer")),
            "qwen3": (tiny_models("qwen3").path, tiny_models("qwen3").hf_model)}


def first_layer_draft(target, directory) -> tuple[str, torch.nn.Module]:
    """``target``'s first layer alone (with its embeddings, final norm and head), saved in ``directory``."""
    config = copy.deepcopy(target.hf_model.config)
    config.num_hidden_layers = 1
    one_layer = type(target.hf_model)(config).float().eval()
    one_layer.load_state_dict(target.hf_model.state_dict(), strict=False)
    one_layer.save_pretrained(directory)
    return str(directory), one_layer


def draft_config(path: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(the sequence, the draft's proposal) of every proposal the engine's draft model makes."""
    draft, seen = llm.llm_engine.draft, []
    propose = draft.propose

    def recording(batch):
        progress = propose(batch)
        seen.extend((list(r.all_token_ids), list(d))
                    for r, d in zip(batch.requests, batch.draft_token_ids) if d)
        return progress

    draft.propose = recording
    return seen


def assert_proposals_are_the_drafts_greedy(draft_hf, proposals) -> None:
    assert proposals
    for tokens, proposal in proposals:
        assert proposal == hf_greedy(draft_hf, tokens, len(proposal), eos_token_id=None), tokens


def test_config_method_defaults_and_errors():
    spec = resolve_speculative_config({"model": "some/draft", "num_speculative_tokens": 3})
    assert (spec.method, spec.model, spec.prompt_lookup_max) == ("draft_model", "some/draft", None)
    assert spec.to_dict() == {"method": "draft_model", "model": "some/draft", "num_speculative_tokens": 3}
    assert resolve_speculative_config({"model": "d", "num_speculative_tokens": 1,
                                       "draft_tensor_parallel_size": None}).model == "d"  # vLLM's default
    bad = [({"method": "draft_model", "num_speculative_tokens": 3}, r"\['model'\]=None is invalid"),
           ({"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
            r"prompt_lookup_max'\]=2 is invalid: .* belongs to method 'ngram'"),
           ({"method": "ngram", "model": "d", "num_speculative_tokens": 3}, r"\['model'\]='d' is invalid"),
           ({"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
            r"draft_tensor_parallel_size'\]=2 is invalid: .* must be 1"),
           ({"method": "eagle", "num_speculative_tokens": 3}, r"one of \['ngram', 'draft_model'\]")]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=value).validate()
    with pytest.raises(ValueError, match="tensor_parallel_size=2: a draft model runs with a target of"):
        EngineConfig(speculative_config=draft_config("d"), tensor_parallel_size=2).validate()


@pytest.mark.parametrize("name", ["self", "one_layer", "qwen3"])
def test_greedy_tokens_are_hf_and_proposals_are_the_drafts_own(tiny_llama, drafts, name):
    path, draft_hf = drafts[name]
    prompts = random_prompts(6, vocab=40, max_len=40, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES,
             speculative_config=draft_config(path)) as llm:
        proposals = record_proposals(llm)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        stats = llm.get_stats()
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, prompts, outs, MAX_TOKENS)
    assert_proposals_are_the_drafts_greedy(draft_hf, proposals)
    assert stats.spec_decode_num_draft_tokens == sum(len(p) for _, p in proposals)
    accepted, proposed = stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens
    if name == "self":  # the target proposing for itself is right every time
        assert accepted == proposed
    elif name == "one_layer":
        assert 0 < accepted < proposed
    assert stats.generation_tokens == 6 * MAX_TOKENS


def record_draft_pass_tokens(llm: LLM) -> list[int]:
    """The tokens of every forward pass the engine's draft model runs, in order."""
    runner, tokens = llm.llm_engine.draft.runner, []
    forward = runner.forward_greedy

    def recording(inputs, *args, **kwargs):
        tokens.append(len(inputs.input_ids))
        return forward(inputs, *args, **kwargs)

    runner.forward_greedy = recording
    return tokens


def count_draft_passes(llm: LLM) -> list[tuple[int, bool, int]]:
    """(the batch's requests, whether it proposed, the draft's forward passes) of every step."""
    draft, steps, passes = llm.llm_engine.draft, [], record_draft_pass_tokens(llm)
    propose = draft.propose

    def counting_propose(batch):
        before = len(passes)
        progress = propose(batch)
        steps.append((len(batch.requests), any(batch.draft_token_ids), len(passes) - before))
        return progress

    draft.propose = counting_propose
    return steps


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_batch_size_schedule_runs_no_draft_without_proposals_and_the_draft_catches_up(tiny_llama, drafts,
                                                                                        async_scheduling):
    """num_speculative_tokens_per_batch_size: steps of 4 or more requests propose nothing and run
    no draft pass (with asynchronous scheduling they run ahead of the step before); once the batch
    shrinks the draft catches up on the tokens it missed, so its proposals are its own greedy
    continuations (passes of at most the 16-token budget where the gap is longer), and the tokens
    are HF's."""
    path, draft_hf = drafts["one_layer"]
    prompts = random_prompts(6, vocab=40, max_len=40, seed=5)
    lengths = [6, 9, 12, 24, 30, 36]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in lengths]
    config = {**draft_config(path, 3), "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 64, 0]]}
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=16,
             max_model_len=128, speculative_config=config, async_scheduling=async_scheduling) as llm:
        proposals, steps, ahead = record_proposals(llm), count_draft_passes(llm), record_launches(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, n in zip(prompts, outs, lengths):
        assert_hf_tokens_and_logprobs(tiny_llama.hf_model, [prompt], [out], n)
    assert_proposals_are_the_drafts_greedy(draft_hf, proposals)
    assert {n for n, proposed, _ in steps if proposed} == {1, 2, 3}
    assert all(passes == 0 for n, proposed, passes in steps if not proposed)
    assert any(n >= 4 for n, _, _ in steps)
    # the first step proposing again catches up over its requests' whole sequences, in several passes
    first = next(i for i, (_, proposed, _) in enumerate(steps) if proposed)
    assert steps[first][2] > 1 + 3 + 1
    assert not any(after_proposals for _, after_proposals in ahead)
    assert len(ahead) >= (10 if async_scheduling else 0) and (async_scheduling or not ahead)


def test_a_prefix_hit_takes_the_drafts_keys_only_from_blocks_the_draft_computed(tiny_llama, drafts):
    """A schedule that proposes for a request alone: two requests on a shared 32-token prefix run
    together, with no draft pass, so the next request on that prefix finds its blocks cached
    without the draft's keys and runs the draft over the whole sequence; the one after it finds
    the draft's keys too and runs the draft over its own tokens only. Every proposal is the draft's
    own greedy continuation, and the keys of accepted proposals are not computed again."""
    path, draft_hf = drafts["one_layer"]
    shared = random_prompts(1, vocab=30, min_len=32, max_len=32, seed=23)[0]
    tails = random_prompts(4, vocab=30, min_len=5, max_len=9, seed=29)
    config = {**draft_config(path, 3), "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 0]]}
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, max_model_len=64,
             speculative_config=config) as llm:
        proposals, passes = record_proposals(llm), record_draft_pass_tokens(llm)
        llm.generate([shared + tails[0], shared + tails[1]], greedy, use_tqdm=False)
        assert not passes and not proposals
        first_pass, later_passes = [], []
        for tail in tails[2:]:
            passes.clear()
            llm.generate([shared + tail], greedy, use_tqdm=False)
            first_pass.append(passes[0])
            later_passes += passes[1:]
        stats = llm.get_stats()
    assert stats.prefix_cache_hit_tokens == 3 * 32
    # the prompt and its first sampled token; then the draft's keys of the shared blocks are in place
    assert first_pass == [32 + len(tails[2]) + 1, len(tails[3]) + 1]
    # later pass 0s run the new token alone: the draft keeps the keys of the proposals the target accepted
    assert stats.spec_decode_num_accepted_tokens > 0 and set(later_passes) == {1}
    assert_proposals_are_the_drafts_greedy(draft_hf, proposals)


def test_a_follow_up_on_a_finished_sequence_finds_the_drafts_keys_of_its_accepted_proposals(tiny_llama):
    """The target as its own draft (every proposal accepted): a follow-up prompt extending a finished
    sequence hits its cached blocks, those filled by accepted proposals included, with the draft's
    keys in place, so the draft runs over the new tokens only."""
    prompt = random_prompts(1, vocab=40, min_len=20, max_len=20, seed=3)[0]
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, max_model_len=256,
             speculative_config=draft_config(tiny_llama.path, 4)) as llm:
        (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                              use_tqdm=False)
        follow_up = prompt + list(out.outputs[0].token_ids) + [5, 6, 7]
        passes = record_draft_pass_tokens(llm)
        llm.reset_stats()
        llm.generate([follow_up], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        hit = llm.get_stats().prefix_cache_hit_tokens
    assert hit == 64  # the finished sequence's full computed blocks (its last token was never run)
    assert passes[0] == len(follow_up) + 1 - hit


def test_blocks_of_rejected_proposals_never_count_as_the_drafts(tiny_llama, drafts):
    """A request proposes alone (rejections among its proposals), then two more arrive and every step
    is capped at K=0, so the target fills the blocks that held rejected proposals without the draft;
    a follow-up prompt on the finished sequence, proposing alone, must not take the draft's keys of
    those blocks from the prefix cache: its proposals are the draft's own greedy continuations."""
    path, draft_hf = drafts["one_layer"]
    prompts = random_prompts(4, vocab=40, min_len=20, max_len=30, seed=21)
    config = {**draft_config(path, 3), "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 0]]}
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for arrival in (3, 16, 17):
        with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, max_model_len=256,
                 speculative_config=config, async_scheduling=True) as llm:
            engine, finished = llm.llm_engine, {}
            engine.add_request("a", prompts[0], greedy)
            for step in range(10_000):
                if not engine.has_unfinished_requests():
                    break
                if step == arrival:
                    for rid, prompt in (("b", prompts[1]), ("c", prompts[2])):
                        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=80,
                                                                       ignore_eos=True))
                finished.update((o.request_id, o) for o in engine.step() if o.finished)
            stats = llm.get_stats()
            assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
            follow_up = prompts[0] + list(finished["a"].outputs[0].token_ids) + [3, 4]
            proposals = record_proposals(llm)
            llm.generate([follow_up], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)
        assert_proposals_are_the_drafts_greedy(draft_hf, proposals)


@pytest.fixture(scope="module")
def windowed_draft(tmp_path_factory):
    """A tiny Mistral whose every layer attends within a window (the KV manager frees blocks behind
    it) and its first layer alone as a draft."""
    target = build_tiny_model(tmp_path_factory.mktemp("windowed"), "mistral_window")
    return (target, *first_layer_draft(target, tmp_path_factory.mktemp("windowed_1layer")))


@pytest.mark.parametrize("num_blocks", [10, 40])
def test_both_models_windowed_run_the_draft_in_lockstep(windowed_draft, num_blocks):
    """Blocks behind the window go back to the pool as the target goes, so the draft runs over every
    request of every step, synchronously, and never reads or writes a block given back; a K=0
    schedule for big batches and a small pool (blocks handed out again) change nothing: the tokens
    are HF's and the proposals the draft's own greedy continuations."""
    target, path, draft_hf = windowed_draft
    prompts = random_prompts(5, vocab=30, min_len=20, max_len=50, seed=5)
    lengths = [8, 16, 30, 60, 80]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    config = {**draft_config(path, 3), "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 0]]}
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 slots, 2 KV heads, dim 16, float32
    with LLM(target.path, device="cpu", kv_cache_memory_bytes=num_blocks * (block_bytes + block_bytes // 2),
             max_model_len=128, max_num_batched_tokens=24, speculative_config=config,
             async_scheduling=True) as llm:
        draft, released = llm.llm_engine.draft, []
        assert draft.lockstep and not llm.llm_engine.async_scheduling
        proposals, steps, catch_up = record_proposals(llm), count_draft_passes(llm), draft._catch_up

        def checking(requests, starts, ends, proposing):
            released.extend(r.request_id for r, start in zip(requests, starts)
                            if start // 16 < r.num_released_blocks)
            return catch_up(requests, starts, ends, proposing)

        draft._catch_up = checking
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, n in zip(prompts, outs, lengths):
        assert out.outputs[0].token_ids == hf_greedy(target.hf_model, prompt, n, eos_token_id=None)
    assert_proposals_are_the_drafts_greedy(draft_hf, proposals)
    assert not released
    assert all(passes > 0 for _, _, passes in steps)


def test_chunked_prompts_preemption_and_prefix_cache_keep_the_draft_in_step(tiny_llama, drafts):
    """Prompts in 24-token chunks, a KV cache of 12 blocks (preemptions and recomputes), prompts
    that share a cached 32-token prefix: the draft's proposals stay its own greedy continuations."""
    path, draft_hf = drafts["one_layer"]
    shared = random_prompts(1, vocab=30, min_len=32, max_len=32, seed=17)[0]
    prompts = [shared + p for p in random_prompts(6, vocab=30, max_len=20, seed=19)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 slots, 2 KV heads, dim 16, float32
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=12 * (block_bytes + block_bytes // 2),
             max_model_len=128, max_num_batched_tokens=24, speculative_config=draft_config(path)) as llm:
        assert llm.get_stats().num_kv_blocks == 12  # the draft's one layer shares the budget
        proposals = record_proposals(llm)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        stats = llm.get_stats()
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, prompts, outs, MAX_TOKENS)
    assert_proposals_are_the_drafts_greedy(draft_hf, proposals)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_seeded_sampling_gives_plain_decodings_tokens_and_replans_keep_the_target(tiny_llama, drafts):
    """One engine: plain decoding, then a draft model, then n-gram proposals, then none (plan
    switches; the target's weights stay): seeded sampled tokens and logprobs equal plain decoding's."""
    prompts = random_prompts(5, vocab=30, max_len=30, seed=7)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=MAX_TOKENS, logprobs=2, **extra)
              for t, s, extra in [(0.2, 1, {}), (1.0, 2, {"top_k": 5}), (0.3, 3, {"top_p": 0.8}),
                                  (0.3, 4, {"min_p": 0.1, "n": 2}), (0.5, 6, {"min_tokens": 20})]]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES) as llm:
        target = llm.llm_engine.model
        runs = {}
        for name, spec in [("plain", None), ("draft", draft_config(drafts["self"][0], 3)), ("ngram", ngram),
                           ("none", None)]:
            llm.set_model_args(speculative_config=spec)
            llm.reset_stats()
            runs[name] = llm.generate(prompts, params, use_tqdm=False)
            if name == "draft":
                assert llm.get_stats().spec_decode_num_accepted_tokens > 0
        assert llm.llm_engine.draft is None and llm.llm_engine.model is target
    def completions(outs):
        return [(c.token_ids, [sorted(lp.items()) for lp in c.logprobs]) for o in outs for c in o.outputs]

    want = completions(runs["plain"])
    for name in ("draft", "ngram", "none"):
        for (tokens, logprobs), (plain_tokens, plain_logprobs) in zip(completions(runs[name]), want):
            assert tokens == plain_tokens, name
            for a, b in zip(logprobs, plain_logprobs, strict=True):
                assert [t for t, _ in a] == [t for t, _ in b]
                assert all(abs(x.logprob - y.logprob) < 1e-4 for (_, x), (_, y) in zip(a, b))


def test_drafts_that_cannot_propose_are_refused(tiny_models, tiny_llama, tmp_path):
    wide = build_tiny_model(tmp_path / "wide", "llama", vocab_size=2000)
    short = build_tiny_model(tmp_path / "short", "llama", max_position_embeddings=64)
    cases = [(tiny_llama.path, wide.path, "vocabulary of 2000 tokens, more than the target's 1000"),
             (tiny_llama.path, short.path, "supports at most 64 positions, fewer than max_model_len=512"),
             (tiny_models("phi3_longrope").path, tiny_llama.path, "the target model uses LongRoPE")]
    for target, draft, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(target, device="cpu", kv_cache_memory_bytes=KV_BYTES, speculative_config=draft_config(draft))
    with (LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES, max_model_len=64,
              speculative_config=draft_config(short.path)) as llm,  # fits the draft: runs
          pytest.raises(SleepStateError, match="sleep\\(\\) with a draft model")):
        llm.sleep()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_tokens_are_hf_and_proposals_the_drafts_own(tiny_llama, drafts):
    """Float32 on the GPU, Triton attention, the draft's passes in its own decode and mixed-step
    CUDA graphs beside the target's."""
    path, draft_hf = drafts["one_layer"]
    prompts = random_prompts(12, vocab=40, max_len=60, seed=29)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(tiny_llama.path, device="cuda", dtype="float32", kv_cache_memory_bytes=256 << 20,
             speculative_config=draft_config(path)) as llm:
        assert llm.llm_engine.draft.runner.uses_mixed_cuda_graphs
        proposals = record_proposals(llm)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        stats = llm.get_stats()
    assert_hf_tokens_and_logprobs(tiny_llama.hf_model, prompts, outs, MAX_TOKENS)
    assert_proposals_are_the_drafts_greedy(draft_hf.cpu(), proposals)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_a_smaller_padded_draft_vocabulary(tiny_llama, tmp_path):
    """A draft of 900 tokens beside the target's 1,000 (a prompt id the draft lacks reaches it as
    0): plain decoding's tokens."""
    small = build_tiny_model(tmp_path / "small", "llama", seed=1, vocab_size=900)
    prompts = random_prompts(3, vocab=40, max_len=20, seed=2) + [[5, 17, 950, 33]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        llm.set_model_args(speculative_config=draft_config(small.path, 2))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == plain


def test_a_windowed_draft_beside_a_target_attending_its_shared_prefix_as_a_cascade(tiny_llama, tmp_path,
                                                                                     monkeypatch):
    """The target's decode batches attend their shared prefix as a cascade; the sliding-window
    draft's layers cannot, and run without: plain decoding's tokens (Triton under the interpreter)."""
    import pagedlab.layers.attention.triton_backend as triton_backend

    monkeypatch.setattr(triton_backend, "CASCADE_MIN_SEQS", 2)  # GPU-scale thresholds, lowered
    monkeypatch.setattr(triton_backend, "CASCADE_MIN_SHARED_KEYS", 1)
    windowed = build_tiny_model(tmp_path / "windowed", "mistral_window", seed=1)
    shared = random_prompts(1, min_len=64, max_len=64, seed=1)[0]
    prompts = [shared + p for p in random_prompts(3, max_len=4, seed=2)]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES,
             attention_backend="triton") as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        llm.set_model_args(speculative_config=draft_config(windowed.path, 1))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == plain


def test_dropping_a_draft_frees_it_and_stats_count_its_memory(tiny_llama):
    """get_stats() counts both models' memory; the physical floor stays the target's."""
    from pagedlab.workloads import engine_floor_args

    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES) as llm:
        plain, plain_floor = llm.get_stats(), engine_floor_args(llm, "W-lat")
        refs = []
        for _ in range(2):
            llm.set_model_args(speculative_config=draft_config(tiny_llama.path))
            with_draft = llm.get_stats()
            assert engine_floor_args(llm, "W-lat") == plain_floor
            refs += [weakref.ref(p) for p in llm.llm_engine.draft.runner.model.parameters()]
            llm.set_model_args(speculative_config=None)
        gc.collect()
    assert not [r for r in refs if r() is not None]  # no draft weights outlive its plan
    assert with_draft.weight_bytes == 2 * plain.weight_bytes  # the target as its own draft
    assert with_draft.num_kv_blocks * 2 == plain.num_kv_blocks  # the same budget for two caches
    assert with_draft.kv_cache_bytes == plain.kv_cache_bytes


def test_the_target_cache_is_freed_before_a_draft_comes_or_goes(tiny_llama, monkeypatch):
    """A draft loads, and a dropped one closes, after the target's KV cache is freed: on a GPU a
    cache freed after a draft loaded stayed reserved by torch's allocator, so the larger cache of
    both models ran out of memory beside it (the GPU test below)."""
    from pagedlab.engine.draft_model import DraftModel

    seen = []
    load, close = DraftModel.load.__func__, DraftModel.close

    def loading(cls, *args, **kwargs):
        seen.append(("load", llm.llm_engine.runner.kv_cache))
        return load(cls, *args, **kwargs)

    def closing(self):
        seen.append(("close", llm.llm_engine.runner.kv_cache))
        close(self)

    monkeypatch.setattr(DraftModel, "load", classmethod(loading))
    monkeypatch.setattr(DraftModel, "close", closing)
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES) as llm:
        llm.set_model_args(speculative_config=draft_config(tiny_llama.path))
        llm.set_model_args(speculative_config=None)
    assert seen == [("load", None), ("close", None)]


def test_the_draft_graph_pool_reaches_the_target_profile(tiny_llama, monkeypatch):
    """Where the target profiles the GPU (no kv_cache_memory_bytes) and the draft's steps replay
    mixed-step graphs, the draft's forward activations at the largest step (its graph pool,
    profiled on the draft's runner) are kept free in the target's profile. Both profiles are
    stubbed, so this runs on the CPU; the GPU test below runs them."""
    from pagedlab.engine.model_runner import ModelRunner

    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES,
             speculative_config=draft_config(tiny_llama.path)) as llm:
        engine = llm.llm_engine
        plan = dataclasses.replace(engine.runner.plan, kv_cache_memory_bytes=None, extra_bytes_per_block=0,
                                   cuda_graphs=True, mixed_cuda_graphs=True, max_num_batched_tokens=512)
        assert engine.draft.share_of_target_plan(plan).extra_memory_bytes == 0  # no graphs on this backend
        monkeypatch.setattr(ModelRunner, "uses_mixed_cuda_graphs",
                            property(lambda self: self.plan.mixed_cuda_graphs))
        profiled = []
        monkeypatch.setattr(engine.draft.runner, "_profile_peak_memory",
                            lambda tokens, seq_len: profiled.append((tokens, seq_len)) or (7 << 20, 9 << 20))
        shared = engine.draft.share_of_target_plan(plan)
        assert profiled == [(512, min(512, plan.max_model_len))]
        assert shared.extra_bytes_per_block == engine.runner.bytes_per_block  # the target as its own draft
        assert shared.extra_memory_bytes == 7 << 20
        engine.draft.share_of_target_plan(plan)  # the same step and numerics: measured once
        engine.draft.share_of_target_plan(dataclasses.replace(plan, batch_invariant=True))
        assert len(profiled) == 2
        asked = []
        monkeypatch.setattr(engine.runner, "profile_gpu_kv_blocks", lambda *args: asked.append(args) or 100)
        assert ModelRunner._num_kv_blocks(engine.runner, shared) == 100
    assert asked == [(512, plan.max_model_len, plan.gpu_memory_utilization, shared.extra_bytes_per_block,
                      7 << 20)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_draft_whose_caches_outgrow_the_old_one_fits(tmp_path):
    """SmolLM2-135M's shape with random weights, its plain cache held at the ceiling of every
    sequence at full length (about half of the 0.9 share), then itself as draft: both caches take
    the whole share, which fits only if the plain cache's memory went back to the GPU (it ran out
    of memory before the target's cache was freed ahead of the draft's load), the draft's
    mixed-step graph pool counted in the share; and back."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                      max_position_embeddings=8192, tie_word_embeddings=True,
                                      architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path)
    token_bytes = 2 * 30 * 3 * 64 * 2
    max_num_seqs = int(0.45 * torch.cuda.mem_get_info()[1] / (8192 * token_bytes))
    prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 49000 for j in range(30)]} for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", max_num_seqs=max_num_seqs) as llm:
        plain = llm.get_stats()
        assert plain.num_kv_blocks == max_num_seqs * 512 + 1  # the ceiling, not the share
        for spec in (draft_config(str(tmp_path)), None):
            llm.set_model_args(speculative_config=spec)
            assert len(llm.generate(prompts, greedy, use_tqdm=False)) == 4
            stats = llm.get_stats()
            if spec is not None:
                assert stats.kv_cache_bytes > 1.5 * plain.kv_cache_bytes
                assert llm.llm_engine.runner.plan.extra_memory_bytes > 0  # the draft's graph pool
    assert stats.kv_cache_bytes == plain.kv_cache_bytes


def test_the_manifest_identifies_the_draft_model(tiny_llama, drafts):
    """The lab's provenance names the draft as it names the model: path, config hash, weight checksum."""
    from pagedlab.lab.manifest import collect_manifest, config_hash, files_checksum, weight_files

    path = drafts["one_layer"][0]
    with LLM(tiny_llama.path, device="cpu", kv_cache_memory_bytes=KV_BYTES) as llm:
        assert "draft_model" not in collect_manifest(llm)
        target_bytes = llm.get_engine_info().weight_bytes
        llm.set_model_args(speculative_config=draft_config(path))
        manifest = collect_manifest(llm)
    draft = manifest["draft_model"]
    assert draft["name"] == path and draft["architecture"] == "LlamaForCausalLM"
    assert draft["config_hash"] == config_hash(path) != manifest["model"]["config_hash"]
    assert manifest["model"]["weight_bytes"] == target_bytes > draft["weight_bytes"]  # each its own
    assert draft["weight_checksum"] == files_checksum(weight_files(path)) is not None
    assert manifest["engine"]["speculative_config"]["model"] == path
