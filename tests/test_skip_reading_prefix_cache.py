"""vLLM's ``SamplingParams.skip_reading_prefix_cache``: True computes a request's whole prompt,
reading no cached prefix, while its blocks still fill the cache for others; None resolves to True
exactly where the prompt is scored; False with prompt scoring is refused. Checked on a tiny float32
model against the same request served from the cache, and in ``num_cached_tokens`` and the
engine's prefix-cache counters (a request that looks nothing up is no query, as in vLLM)."""

from __future__ import annotations

import pytest
import torch

from conftest import KV_BYTES, random_prompts
from pagedlab import LLM, SamplingParams

SHARED = random_prompts(1, min_len=48, max_len=48, seed=31)[0]  # three full 16-token blocks
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def test_none_is_true_exactly_where_the_prompt_is_scored():
    assert SamplingParams().skip_reading_prefix_cache is False
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache is True
    assert SamplingParams(prompt_logprob_token_ids=[3]).skip_reading_prefix_cache is True
    assert SamplingParams(skip_reading_prefix_cache=True).skip_reading_prefix_cache is True
    # a copy derives anew a value equal to the default's: one that starts scoring skips the cache, one
    # that stops scoring reads it; a True set against the default (no scoring) stays
    assert SamplingParams().clone(prompt_logprobs=2).skip_reading_prefix_cache is True
    assert SamplingParams(prompt_logprobs=1).clone(prompt_logprobs=None).skip_reading_prefix_cache is False
    cold = SamplingParams(skip_reading_prefix_cache=True)
    assert cold.clone(max_tokens=3).skip_reading_prefix_cache is True
    assert cold.clone(prompt_logprobs=1).clone(max_tokens=3).skip_reading_prefix_cache is True


@pytest.mark.parametrize("fields, says", [
    (dict(skip_reading_prefix_cache="yes"), "skip_reading_prefix_cache='yes' is invalid: "
                                            "skip_reading_prefix_cache must be None, True or False"),
    (dict(skip_reading_prefix_cache=1), "skip_reading_prefix_cache=1 is invalid"),
    (dict(skip_reading_prefix_cache=False, prompt_logprobs=1),
     "skip_reading_prefix_cache=False is invalid: skip_reading_prefix_cache must be True or None with "
     "prompt_logprobs=1: rows read from the prefix cache have no logits to score"),
    (dict(skip_reading_prefix_cache=False, prompt_logprob_token_ids=[4, 5]),
     "skip_reading_prefix_cache=False is invalid: .* with prompt_logprob_token_ids=\\[4, 5\\]"),
])
def test_bad_values_name_the_field(fields, says):
    with pytest.raises(ValueError, match=says.replace("(", "\\(").replace(")", "\\)")):
        SamplingParams(**fields)


def _run(llm, tail, params):
    stats = llm.get_stats()
    out = llm.generate({"prompt_token_ids": SHARED + tail}, params, use_tqdm=False)[0]
    after = llm.get_stats()
    counted = (after.prefix_cache_queried_tokens - stats.prefix_cache_queried_tokens,
               after.prefix_cache_hit_tokens - stats.prefix_cache_hit_tokens)
    return out, counted, after.prompt_tokens_computed - stats.prompt_tokens_computed


def _logprobs(out) -> torch.Tensor:
    completion = out.outputs[0]
    return torch.tensor([[lp.logprob for lp in step.values()] for step in completion.logprobs])


def test_skipping_computes_the_whole_prompt_and_gives_the_cached_run_s_tokens(tiny_llama):
    tail = [7, 8, 9, 10, 11]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=True) as llm:
        _run(llm, [3, 4], GREEDY)  # fills the cache with the shared blocks
        cached, cached_counts, cached_computed = _run(llm, tail, GREEDY)
        cold, cold_counts, cold_computed = _run(llm, tail, GREEDY.clone(skip_reading_prefix_cache=True))
    prompt_len = len(SHARED) + len(tail)
    assert cached.num_cached_tokens == 48 and cached_counts == (prompt_len, 48)
    assert cached_computed == prompt_len - 48
    # no lookup: no cached token, no query or hit counted, every prompt token computed
    assert cold.num_cached_tokens == 0 and cold_counts == (0, 0) and cold_computed == prompt_len
    assert cold.outputs[0].token_ids == cached.outputs[0].token_ids
    ranked = [[list(step) for step in out.outputs[0].logprobs] for out in (cold, cached)]
    assert ranked[0] == ranked[1]
    torch.testing.assert_close(_logprobs(cold), _logprobs(cached), atol=1e-5, rtol=0)


def test_a_skipping_request_still_fills_the_cache_for_others(tiny_llama):
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=True) as llm:
        first, counts, _ = _run(llm, [3, 4], GREEDY.clone(skip_reading_prefix_cache=True))
        follower, follower_counts, _ = _run(llm, [5, 6], GREEDY)
        again, _, _ = _run(llm, [5, 6], GREEDY.clone(skip_reading_prefix_cache=True))
    assert first.num_cached_tokens == 0 and counts == (0, 0)
    assert follower.num_cached_tokens == 48 and follower_counts == (50, 48)
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == follower.outputs[0].token_ids


def test_prompt_scoring_skips_by_default_and_counts_no_query(tiny_llama):
    """The default for prompt_logprobs: with the shared blocks cached, every prompt row is still
    computed (none read from the cache) and its logprob is HF's float32 one."""
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=True) as llm:
        _run(llm, [3, 4], GREEDY)
        scored, counts, computed = _run(llm, [3, 4], GREEDY.clone(prompt_logprobs=2))
    assert scored.num_cached_tokens == 0 and counts == (0, 0) and computed == 50
    prompt = scored.prompt_token_ids
    with torch.no_grad():
        hf = torch.log_softmax(tiny_llama.hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(prompt)
    got = torch.tensor([scored.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    want = torch.stack([hf[i - 1, prompt[i]] for i in range(1, len(prompt))])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
