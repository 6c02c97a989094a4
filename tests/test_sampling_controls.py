"""vLLM's logits controls (logit_bias, allowed_token_ids) against a plain-torch reference and HF's
greedy generate, and SamplingParams' checks of its own arguments."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import KV_BYTES, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.engine.step_inputs import HostToDevice, build_sampling_metadata
from pagedlab.kernels.sampling import sample_tokens_torch
from pagedlab.layers import sampler as sampler_module
from pagedlab.layers.sampler import Sampler
from pagedlab.sampling_params import StructuredOutputsParams
from pagedlab.sampling_params import UnknownArgumentError

VOCAB = 300


class _Row:
    """The parts of a scheduled request the sampler's metadata reads."""

    def __init__(self, params: SamplingParams):
        self.sampling_params, self.seed = params, None
        self.output_token_ids, self.prompt_token_ids, self.eos_token_ids = [], [1], []
        self.num_output_tokens = self.num_pending_tokens = 0
        self.bad_words_token_ids, self.grammar, self.thinking = [], None, None


def test_logits_controls_match_torch_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=g) * 3
    allowed = torch.randperm(VOCAB, generator=g)[:7].tolist()
    bias = {int(t): float(b) for t, b in zip(torch.randint(0, VOCAB, (6,), generator=g),
                                             torch.randn(6, generator=g) * 20)}
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=0, logit_bias=bias),
              SamplingParams(temperature=0, logit_bias=bias, allowed_token_ids=allowed[:3]),
              SamplingParams(temperature=0)]
    want = logits.clone()
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:
            masked = torch.full((VOCAB,), float("-inf"))
            masked[p.allowed_token_ids] = want[row, p.allowed_token_ids]
            want[row] = masked
        for token, b in (p.logit_bias or {}).items():
            want[row, token] += b
    meta = build_sampling_metadata([_Row(p) for p in params], HostToDevice(torch.device("cpu")), VOCAB,
                                   [0] * len(params), 0)
    tokens = Sampler()(logits.clone(), meta).token_ids
    assert tokens.tolist() == want.argmax(-1).tolist()
    assert tokens[1].item() in allowed and tokens[3].item() in allowed[:3]
    plain = build_sampling_metadata([_Row(SamplingParams())], HostToDevice(torch.device("cpu")), VOCAB,
                                    [0], 0)
    assert plain.logit_bias is None and plain.allowed_token_ids is None  # nothing to pay without them


def test_plain_rows_draw_from_the_logits_as_they_are_and_filters_touch_only_their_rows(monkeypatch):
    """Temperature and greedy rows hand the model's bf16 logits to the draw uncopied; a top-p row
    makes the sampler rewrite a float32 copy, in which only that row's dropped tokens change, so
    the other rows keep their tokens."""
    seen = []

    def spy(logits, temperature, seeds):
        seen.append(logits)
        return sample_tokens_torch(logits, temperature, seeds)

    monkeypatch.setattr(sampler_module, "sample_tokens", spy)
    logits = (torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    plain = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), SamplingParams(temperature=1.2)]
    cpu = HostToDevice(torch.device("cpu"))
    meta = build_sampling_metadata([_Row(p) for p in plain], cpu, VOCAB, [0] * 3, 5)
    tokens = Sampler()(logits, meta).token_ids
    assert seen[-1] is logits
    filtered = plain[:2] + [SamplingParams(temperature=1.2, top_p=0.5)]
    meta = build_sampling_metadata([_Row(p) for p in filtered], cpu, VOCAB, [0] * 3, 5)
    assert Sampler()(logits, meta).token_ids[:2].tolist() == tokens[:2].tolist()
    rewritten = seen[-1]
    assert rewritten.dtype == torch.float32 and torch.equal(rewritten[:2], logits[:2].float())
    kept = rewritten[2].isfinite()
    assert 0 < kept.sum() < VOCAB and torch.equal(rewritten[2, kept], logits[2, kept].float())


def test_min_tokens_bans_follow_the_sampled_position_not_the_host_token_count():
    """min_tokens bans EOS and stop ids by the sampled token's position. A grammar batch builds
    its sampling inputs after the launch has counted the token being sampled as pending, so the
    host's output + pending count (2 here, one output known) overstates position 1 by one; with
    the previous step in flight the same count goes with position 2, where the bans are lifted."""
    params = SamplingParams(min_tokens=2, stop_token_ids=[7])
    rows = [_Row(params), _Row(params)]
    for row in rows:
        row.output_token_ids, row.eos_token_ids = [3], [5]
        row.num_output_tokens, row.num_pending_tokens = 1, 1
    meta = build_sampling_metadata(rows, HostToDevice(torch.device("cpu")), VOCAB, [1, 2], 0)
    banned_rows, banned_ids = meta.banned_token_ids
    assert sorted(zip(banned_rows.tolist(), banned_ids.tolist())) == [(0, 5), (0, 7)]


def test_logprobs_are_those_of_the_raw_logits_when_the_sampler_rewrites_them():
    """vLLM's raw_logprobs: a row whose logit_bias and repetition penalty decide its token still
    reports the logprobs, rank and top alternatives of the logits as the model made them."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0, logprobs=2, logit_bias={3: 10.0}, repetition_penalty=2.0)
    row = _Row(params)
    row.prompt_token_ids = [0]
    meta = build_sampling_metadata([row], HostToDevice(torch.device("cpu")), 4, [0], 0)
    out = Sampler()(logits.clone(), meta)
    log_total = math.log(math.exp(2) + math.exp(1) + math.exp(0) + math.exp(-1))
    assert out.token_ids.tolist() == [3]
    assert out.logprobs.token_logprob.item() == pytest.approx(-1 - log_total)
    assert out.logprobs.token_rank.tolist() == [4]
    assert out.logprobs.top_ids.tolist() == [[0, 1]]
    assert out.logprobs.top_logprobs[0].tolist() == pytest.approx([2 - log_total, 1 - log_total])


def test_logit_bias_and_allowed_token_ids_match_hf_generate(tiny_llama):
    prompts = random_prompts(2, max_len=20, seed=5)
    bias = {17: 6.0, 250: 4.0, 301: -50.0}
    allowed = [3, 17, 40, 250, 301, 777]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        biased = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                      logit_bias=bias), use_tqdm=False)
        restricted = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                          allowed_token_ids=allowed), use_tqdm=False)
    hf = tiny_llama.hf_model
    for p, b, r in zip(prompts, biased, restricted):
        sequence_bias = {(t,): v for t, v in bias.items()}
        assert b.outputs[0].token_ids == hf_greedy(hf, p, 10, sequence_bias=sequence_bias)
        assert r.outputs[0].token_ids == hf_greedy(hf, p, 10, prefix_allowed_tokens_fn=lambda *_: allowed)


def test_logit_bias_takes_biases_beyond_openais_range_as_vllm_does(tiny_llama):
    """vLLM's offline SamplingParams adds any bias (only its server clamps to [-100, 100]): scripts
    ban a token with -1e9 or -inf and force one with a large bias. Each bans or forces as a bias of
    -100 or +100 does on this model's small logits, greedy and sampled, without a NaN."""
    prompts = random_prompts(2, max_len=20, seed=6)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        def run(bias, **kwargs):
            params = SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=bias, **kwargs)
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

        greedy = run(None, temperature=0)
        banned = sorted({t for ids in greedy for t in ids})
        for ban in (-1e9, float("-inf")):
            assert run(dict.fromkeys(banned, ban), temperature=0) == run(dict.fromkeys(banned, -100.0),
                                                                          temperature=0)
            sampled = run(dict.fromkeys(banned, ban), temperature=1.0, top_p=0.9, seed=3)
            assert not set(banned) & {t for ids in sampled for t in ids}
        assert run({42: 1e6}, temperature=0.7, seed=1) == [[42] * 8, [42] * 8]


def test_unknown_argument_names_the_closest_field():
    with pytest.raises(UnknownArgumentError,
                       match=r"unknown argument 'temprature'; did you mean 'temperature'\?"):
        SamplingParams(temprature=0.5)
    with pytest.raises(ValueError, match=r"unknown argument 'zzz'$"):  # nothing close: no suggestion
        SamplingParams(zzz=1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={5: float("inf")}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(logit_bias={5: 1e39}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(extra_args=[1]), "extra_args"),
])
def test_bad_logits_controls(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}=.* is invalid"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_boolean_logprobs_true_is_one_and_false_is_refused(field):
    """vLLM's ``SamplingParams.__post_init__`` makes ``logprobs=True`` (and ``prompt_logprobs=True``)
    1, so a vLLM script writing True runs; False is refused naming the field (vLLM would read it as
    0), not a TypeError from torch's topk in the engine step, which failed every request of the
    batch."""
    assert getattr(SamplingParams(**{field: True}), field) == 1
    with pytest.raises(ValueError, match=rf"^{field}=False is invalid: {field} must be None, True \(as 1\)"):
        SamplingParams(**{field: False})


def test_logprobs_true_returns_the_top_one_and_the_sampled_token(tiny_llama):
    prompt = random_prompts(1, seed=5)[0]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=True,
                                                    prompt_logprobs=True), use_tqdm=False)[0]
    assert [len(position) for position in out.outputs[0].logprobs] == [1, 1, 1]  # greedy: the top one
    assert out.prompt_logprobs[0] is None and all(1 <= len(p) <= 2 for p in out.prompt_logprobs[1:])


def test_out_of_vocabulary_ids_are_refused_before_queueing(tiny_llama):
    vocab = tiny_llama.hf_model.config.vocab_size
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        for kwargs in (dict(logit_bias={vocab: 1.0}), dict(allowed_token_ids=[1, vocab + 3]),
                       dict(logprob_token_ids=[5, vocab])):
            with pytest.raises(ValueError, match=rf"^{next(iter(kwargs))}=.* is out of vocabulary"):
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()


def test_max_logprobs_caps_what_a_request_may_ask(tiny_llama):
    """vLLM's engine argument ``max_logprobs``: a request asking for more logprobs or prompt
    logprobs (-1: the whole vocabulary) is refused naming the field; -1 lifts the cap; pagedlab's
    default (None) has none, as ``max_logprobs=-1``."""
    prompt = random_prompts(1, seed=3)[0]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_logprobs=3) as llm:
        params = SamplingParams(max_tokens=2, logprobs=3, prompt_logprobs=3)
        out = llm.generate([prompt], params, use_tqdm=False)
        assert len(out[0].outputs[0].logprobs[0]) >= 3
        for kwargs in (dict(logprobs=4), dict(prompt_logprobs=-1)):
            with pytest.raises(ValueError, match=rf"^{next(iter(kwargs))}=.* max_logprobs \(3"):
                llm.generate([prompt], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_logprobs=-2)


def test_stop_ids_beyond_the_vocabulary_are_accepted_and_never_stop(tiny_llama):
    """Allowed ids, biases and logprob ids are checked against the vocabulary, stop ids not (older
    vLLM's rule: its multi-LoRA example stopped on an adapter's added token, 32003, past Llama-2's
    32,000; vLLM main refuses them): such an id can never be sampled, so the tokens are HF's greedy
    ones, with min_tokens banning the others."""
    vocab = tiny_llama.hf_model.config.vocab_size
    prompt = random_prompts(1, seed=3)[0]
    want = hf_greedy(tiny_llama.hf_model, prompt, 6, eos_token_id=None)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        outs = llm.generate([prompt] * 2, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                          stop_token_ids=[vocab, vocab + 3], **extra)
                                           for extra in ({}, {"min_tokens": 3})], use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == want and out.outputs[0].finish_reason == "length"


def test_clone_changes_structured_outputs_under_either_name():
    old, new = StructuredOutputsParams(regex="a+"), StructuredOutputsParams(choice=["x", "y"])
    params = SamplingParams(guided_decoding=old)
    assert params.structured_outputs is old
    assert params.clone(guided_decoding=None).structured_outputs is None
    assert params.clone(structured_outputs=new).structured_outputs is new
    assert params.clone(guided_decoding=new).structured_outputs is new
    assert params.clone(temperature=0.5).structured_outputs is old
    with pytest.raises(ValueError, match="guided_decoding"):
        params.clone(structured_outputs=new, guided_decoding=old)


def test_repeated_stop_ids_and_bad_words_are_one_as_in_vllm():
    """vLLM's __post_init__ keeps the first of each repeated stop id and bad word, in order: the
    parameters (and what the lab keys a run by) are those of the list without repeats."""
    params = SamplingParams(stop_token_ids=[5, 3, 5, 7, 3], bad_words=["ab", "cd", "ab"])
    assert params.stop_token_ids == [5, 3, 7] and params.bad_words == ["ab", "cd"]
    assert params.to_dict() == SamplingParams(stop_token_ids=[5, 3, 7], bad_words=["ab", "cd"]).to_dict()
