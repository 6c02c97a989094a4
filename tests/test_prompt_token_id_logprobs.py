"""vLLM's fixed-token prompt scoring: ``SamplingParams.prompt_logprob_token_ids`` from
``prompt_logprob_start`` fills ``RequestOutput.prompt_token_id_logprobs``, checked against the
log_softmax of HF's float32 logits at each scored prompt row (row ``i`` predicts prompt token
``i + 1``), through chunked prefill, prefix caching, beside ``prompt_logprobs``, in each output
kind, and its validation errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import KV_BYTES, random_prompts, run_on_async_engine
from pagedlab import LLM, SamplingParams
from pagedlab.engine import model_runner
from pagedlab.sampling_params import RequestOutputKind
from test_output_controls import _drive

IDS = [5, 17, 999, 42]


def hf_rows(tiny, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt), vocab]``: HF's float32 log-probabilities at each prompt row."""
    with torch.no_grad():
        return torch.log_softmax(tiny.hf_model(torch.tensor([prompt])).logits[0].float(), -1)


def assert_scores(out, tiny, start: int, ids=IDS) -> None:
    prompt = out.prompt_token_ids
    scores = out.prompt_token_id_logprobs
    assert scores.dtype == torch.float32 and scores.shape == (max(len(prompt) - 1 - start, 0), len(ids))
    want = hf_rows(tiny, prompt)[start:len(prompt) - 1][:, ids]
    torch.testing.assert_close(scores, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_batched_tokens=7),
                                         dict(max_num_batched_tokens=7, async_scheduling=True)],
                         ids=["whole", "chunked", "chunked-async"])
def test_scores_match_hf_at_every_row_from_the_start(tiny_llama, engine_args):
    """Starts at the first row, inside the prompt, at the last row (no row left: a [0, K] result)
    and past the prompt; the scores come alone (``prompt_logprobs`` stays None) or beside
    ``prompt_logprobs``, which keeps every row from the first (vLLM's two separate results)."""
    prompts = random_prompts(5, min_len=12, max_len=40, seed=5)
    starts = [0, 3, 11, len(prompts[3]) - 1, 100]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprob_token_ids=IDS,
                             prompt_logprob_start=s) for s in starts]
    params[0] = params[0].clone(prompt_logprob_start=None)  # the default: the first row
    both = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, prompt_logprob_token_ids=IDS[:2],
                          prompt_logprob_start=4)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, **engine_args) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts[:1]], params + [both],
                            use_tqdm=False)
    for out, start in zip(outs, starts):
        assert out.prompt_logprobs is None
        assert_scores(out, tiny_llama, start)
    out = outs[-1]
    assert_scores(out, tiny_llama, 4, IDS[:2])
    prompt, ref = out.prompt_token_ids, hf_rows(tiny_llama, out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert set(ref[pos - 1].topk(2).indices.tolist()) <= set(entry)
    assert outs[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids  # scoring leaves sampling alone


def test_chunked_prefill_runs_each_asked_row_once(tiny_llama, monkeypatch):
    """A 30-token prompt in chunks of 5: the LM head scores rows start..28, each once, none before
    the start, and the chunks' pieces add up to HF's rows."""
    seen = []
    score = model_runner.score_prompt_rows

    def spy(logits, requests, chunks, *args):
        seen.extend(range(position, position + count) for _, count, position in chunks.values())
        return score(logits, requests, chunks, *args)

    monkeypatch.setattr(model_runner, "score_prompt_rows", spy)
    prompt = random_prompts(1, min_len=30, max_len=30, seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprob_token_ids=IDS, prompt_logprob_start=8)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=5) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(seen) > 1 and [row for chunk in seen for row in chunk] == list(range(8, 29))
    assert_scores(out, tiny_llama, 8)


def test_a_request_sharing_a_cached_prefix_still_scores_every_row(tiny_llama):
    """The prefix cache holds the shared blocks (a plain request reads them), but a scoring request
    reads none, as vLLM's default skip_reading_prefix_cache: it computes every row it asks for."""
    shared = random_prompts(1, min_len=40, max_len=40, seed=8)[0]
    greedy = SamplingParams(temperature=0, max_tokens=2)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=True) as llm:
        llm.generate({"prompt_token_ids": shared + [7, 8, 9]}, greedy, use_tqdm=False)
        plain = llm.generate({"prompt_token_ids": shared + [10, 11]}, greedy, use_tqdm=False)[0]
        scored = llm.generate([{"prompt_token_ids": shared + [10, 11]}] * 2,
                              [greedy.clone(prompt_logprob_token_ids=IDS),
                               greedy.clone(prompt_logprob_token_ids=IDS, prompt_logprob_start=35)],
                              use_tqdm=False)
    assert plain.num_cached_tokens >= 32
    assert [out.num_cached_tokens for out in scored] == [0, 0]
    assert_scores(scored[0], tiny_llama, 0)
    assert_scores(scored[1], tiny_llama, 35)
    assert scored[0].outputs[0].token_ids == plain.outputs[0].token_ids


def test_each_output_kind_carries_the_scores_once_complete(tiny_llama):
    """Cumulative outputs carry the whole matrix from the output after its last row on, DELTA
    outputs in exactly one output, FINAL_ONLY in the final one; merged deltas hold it too."""
    prompt = random_prompts(1, min_len=30, max_len=30, seed=9)[0]
    base = dict(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprob_token_ids=IDS,
                prompt_logprob_start=4)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=8) as llm:
        runs = {kind: _drive(llm.llm_engine, kind.name, SamplingParams(**base, output_kind=kind), prompt)
                for kind in RequestOutputKind}
        # with prompt_logprobs, each prefill chunk makes a DELTA output: the scores come in one of them
        mixed = _drive(llm.llm_engine, "m", SamplingParams(**base, prompt_logprobs=0,
                                                            output_kind=RequestOutputKind.DELTA), prompt)
    cumulative = runs[RequestOutputKind.CUMULATIVE]
    assert len(cumulative) == 3
    for out in cumulative:
        assert_scores(out, tiny_llama, 4)
    deltas = runs[RequestOutputKind.DELTA]
    assert [o.prompt_token_id_logprobs is not None for o in deltas] == [True, False, False]
    final, = runs[RequestOutputKind.FINAL_ONLY]
    assert_scores(final, tiny_llama, 4)
    carried = [o.prompt_token_id_logprobs is not None for o in mixed]
    assert len(mixed) > 4 and carried.count(True) == 1
    merged = mixed[0]
    for later in mixed[1:]:
        merged.add(later)
    assert merged.outputs[0].token_ids == final.outputs[0].token_ids
    assert_scores(merged, tiny_llama, 4)


def test_async_engine_streams_the_scores_once(tiny_llama):
    prompt = random_prompts(1, min_len=20, max_len=20, seed=10)[0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprob_token_ids=IDS,
                            output_kind=RequestOutputKind.DELTA)

    async def scenario(engine):
        return [out async for out in engine.generate({"prompt_token_ids": prompt}, params)]

    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=8) as llm:
        outs = run_on_async_engine(llm, scenario)
    carried = [out for out in outs if out.prompt_token_id_logprobs is not None]
    assert outs[-1].finished and len(carried) == 1
    assert_scores(carried[0], tiny_llama, 0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt_logprob_token_ids=[]), "prompt_logprob_token_ids"),
    (dict(prompt_logprob_token_ids=[5, 7, 5]), r"prompt_logprob_token_ids=\[5, 7, 5\]"),  # vLLM: no repeats
    (dict(prompt_logprob_token_ids=[-1]), "prompt_logprob_token_ids"),
    (dict(prompt_logprob_token_ids=[1.5]), "prompt_logprob_token_ids"),
    (dict(prompt_logprob_token_ids=[[5, 7]]), "prompt_logprob_token_ids"),  # vLLM's later per-row form
    (dict(prompt_logprob_token_ids=5), "prompt_logprob_token_ids"),
    (dict(prompt_logprob_token_ids=[5], prompt_logprob_start=-1), "prompt_logprob_start"),
    (dict(prompt_logprob_token_ids=[5], prompt_logprob_start=True), "prompt_logprob_start"),
    (dict(prompt_logprob_start=2.0), "prompt_logprob_start")])
def test_bad_values_are_named(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}.* is invalid: prompt_logprob_\w+ must be"):
        SamplingParams(**kwargs)


def test_numpy_ids_and_start_act_as_python_values():
    params = SamplingParams(prompt_logprob_token_ids=np.array([5, 17]), prompt_logprob_start=np.int64(3))
    assert params.prompt_logprob_token_ids == [5, 17] and type(params.prompt_logprob_token_ids[0]) is int
    assert params.prompt_logprob_start == 3 and type(params.prompt_logprob_start) is int


def test_ids_past_the_vocabulary_or_max_logprobs_fail_alone(tiny_llama):
    """Refused when the request is added (vLLM's checks: ids in the vocabulary, at most
    max_logprobs of them), naming the field; the engine keeps serving."""
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    ok = SamplingParams(temperature=0, max_tokens=1, prompt_logprob_token_ids=[5, 17])
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_logprobs=2) as llm:
        with pytest.raises(ValueError, match=r"^prompt_logprob_token_ids=\[5, 1000\] is invalid: token id "
                                             r"1000 is out of vocabulary \(ids must be in \[0, 1000\)\)"):
            llm.generate([prompt, prompt], [ok, ok.clone(prompt_logprob_token_ids=[5, 1000])], use_tqdm=False)
        with pytest.raises(ValueError, match=r"^prompt_logprob_token_ids=\[5, 17, 42\] is invalid: .* at "
                                             r"most the engine's max_logprobs \(2\) ids"):
            llm.generate(prompt, ok.clone(prompt_logprob_token_ids=[5, 17, 42]), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
        out = llm.generate(prompt, ok, use_tqdm=False)[0]
    assert_scores(out, tiny_llama, 0, [5, 17])
