"""vLLM's trace replay: ``SamplingParams.trace_decode_token_ids`` forces a completion's tokens one
decode step at a time. Checked against HF transformers' float32 log_softmax of the teacher-forced
sequence (each forced token's logprob and rank, and the top alternatives), the whole trace replayed
whatever max_tokens, EOS, stop ids and min_tokens say (vLLM's ``apply_trace_replay``), the same
tokens and logprobs in the asynchronous step loop and beside free requests, and the refusals."""

from __future__ import annotations

import pytest
import torch

from conftest import KV_BYTES, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

EOS = 2  # the tiny models' eos_token_id
TOP = 3


def traces() -> list[list[int]]:
    """Random traces, one holding EOS and a stop id mid-way."""
    g = torch.Generator().manual_seed(7)
    out = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 3, 9)]
    out[0][2], out[0][4] = EOS, 77
    return out


def traced_params() -> list[SamplingParams]:
    """A sampled row with EOS, a stop id and min_tokens in its way; a greedy one whose max_tokens is
    below its trace's length; a seeded one whose max_tokens is above it."""
    return [SamplingParams(temperature=0.8, max_tokens=16, min_tokens=8, stop_token_ids=[77], logprobs=TOP),
            SamplingParams(temperature=0, max_tokens=1, logprobs=TOP),
            SamplingParams(temperature=1.0, seed=3, max_tokens=32, logprobs=TOP)]


def hf_logprobs(tiny, prompt: list[int], trace: list[int]) -> torch.Tensor:
    """``[len(trace), vocab]``: HF's float32 log-probabilities where each trace token is predicted."""
    with torch.no_grad():
        logits = tiny.hf_model(torch.tensor([prompt + trace])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(trace)]


def assert_replayed(out, tiny, trace: list[int]) -> None:
    completion = out.outputs[0]
    assert list(completion.token_ids) == trace
    assert completion.finish_reason == "length"
    ref = hf_logprobs(tiny, out.prompt_token_ids, trace)
    assert len(completion.logprobs) == len(trace)
    for token, row, record in zip(trace, ref, completion.logprobs):
        got, want = record[token], row[token].item()
        assert got.logprob == pytest.approx(want, abs=1e-4)
        # vLLM's rank (tokens at least as likely), up to float noise between the two models
        assert int((row > want + 1e-4).sum()) < got.rank <= int((row >= want - 1e-4).sum())
        top = row.topk(TOP).indices.tolist()
        assert set(record) == set(top) | {token}
        for t in top:
            assert record[t].logprob == pytest.approx(row[t].item(), abs=1e-4)


def run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("engine_args", [dict(), dict(async_scheduling=True)], ids=["sync", "async"])
def test_trace_replays_with_hf_logprobs_alone_and_among_free_requests(tiny_llama, engine_args):
    """Each trace comes back whole (finish_reason "length" at its end, past EOS, a stop id,
    min_tokens and a smaller or larger max_tokens), with HF's logprobs and ranks; a batch mixing
    traced and free requests gives what each gives alone."""
    prompts = random_prompts(5, min_len=4, max_len=30, seed=11)
    free = [SamplingParams(temperature=0, max_tokens=7, logprobs=TOP),
            SamplingParams(temperature=0.9, seed=5, max_tokens=5, logprobs=TOP)]
    params = [p.clone(trace_decode_token_ids=t) for p, t in zip(traced_params(), traces())]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_trace_replay=True, **engine_args) as llm:
        alone = [run(llm, [p], [sp])[0] for p, sp in zip(prompts, params + free)]
        mixed = run(llm, prompts, params + free)
    for out, trace in zip(alone, traces()):
        assert_replayed(out, tiny_llama, trace)
    for one, batched in zip(alone, mixed):
        assert batched.outputs[0].token_ids == one.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, batched.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) and a[t].rank == b[t].rank


@pytest.mark.parametrize("changes, field", [
    (dict(trace_decode_token_ids=[]), "non-empty list"),
    (dict(trace_decode_token_ids=[4, -1]), "non-negative token ids"),
    (dict(trace_decode_token_ids=[4, True]), "non-negative token ids"),
    (dict(n=2), "None with n=2"),
    (dict(prompt_logprobs=1), "None with prompt_logprobs=1"),
    (dict(structured_outputs=StructuredOutputsParams(regex="a+")), "None with structured_outputs="),
    (dict(repetition_detection=RepetitionDetectionParams(max_pattern_size=2, min_count=2)),
     "None with repetition_detection="),
    (dict(thinking_token_budget=4), "None with thinking_token_budget=4"),
    (dict(bad_words=["x"]), "None with bad_words=\\['x'\\]"),
])
def test_conflicting_fields_are_refused_naming_both(changes, field):
    with pytest.raises(ValueError, match=rf"trace_decode_token_ids=.* is invalid: .*{field}"):
        SamplingParams(**{"trace_decode_token_ids": [4, 5], **changes})


def test_engine_refuses_out_of_vocabulary_ids_speculative_decoding_and_no_gate(tiny_llama):
    """As vLLM: a trace needs enable_trace_replay=True (the refusal names the flag, and the engine
    then serves other requests), ids within the vocabulary, and no speculative decoding."""
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm:
        with pytest.raises(ValueError, match=r"trace_decode_token_ids=\[4, 5\] is invalid here: .*"
                                             r"enable_trace_replay=True \(--enable-trace-replay\)"):
            llm.generate(prompt, SamplingParams(trace_decode_token_ids=[4, 5]), use_tqdm=False)
        served = run(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0]
        assert len(served.outputs[0].token_ids) == 3
    with (LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_trace_replay=True) as llm,
          pytest.raises(ValueError, match=r"trace_decode_token_ids=\[4, 1000\] is invalid: token id 1000")):
        llm.generate(prompt, SamplingParams(trace_decode_token_ids=[4, 1000]), use_tqdm=False)
    with (LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_trace_replay=True,
              speculative_config=spec) as llm,
          pytest.raises(ValueError, match=r"trace_decode_token_ids=.* is invalid: .*speculative_config")):
        llm.generate(prompt, SamplingParams(trace_decode_token_ids=[4, 5]), use_tqdm=False)
