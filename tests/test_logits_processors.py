"""``SamplingParams.logits_processors`` (vLLM V0's per-request callables): the tokens are HF
transformers' float32 greedy tokens under the same processor written as an HF
``LogitsProcessor``, in both call forms, with the synchronous and the asynchronous step loop,
beside requests without processors in one batch; a bad processor or return value is an error
naming it."""

from __future__ import annotations

import pytest
import torch

from conftest import KV_BYTES, random_prompts
from pagedlab import LLM, SamplingParams

MAX_TOKENS = 8
BANNED_AFTER = 7  # a token banned after it was generated, and ids divisible by BANNED_AFTER favoured


def no_repeat_and_sevens(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """A processor that reads the history: never a token again, ids divisible by 7 favoured."""
    logits = logits.clone()
    logits[::BANNED_AFTER] += 0.5
    if output_ids:
        logits[torch.tensor(output_ids)] = float("-inf")
    return logits


def not_the_prompt_tokens(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    logits[torch.tensor(prompt_ids)] -= 3.0
    return logits


class _AsHF:
    """The same processors as an HF ``LogitsProcessor`` over one unpadded sequence."""

    def __init__(self, prompt_len: int, with_prompt: bool):
        self.prompt_len, self.with_prompt = prompt_len, with_prompt

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids[0].tolist()
        prompt, output = ids[:self.prompt_len], ids[self.prompt_len:]
        row = scores[0].float()
        if self.with_prompt:
            row = not_the_prompt_tokens(prompt, output, row.clone())
        return no_repeat_and_sevens(output, row).unsqueeze(0)


def _hf_tokens(hf_model, prompt: list[int], with_prompt: bool) -> list[int]:
    from transformers import LogitsProcessorList

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                eos_token_id=None, logits_processor=LogitsProcessorList([_AsHF(len(prompt),
                                                                                                with_prompt)]))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-steps", "async-steps"])
def test_processors_give_hf_tokens_under_the_same_processor(tiny_llama, async_scheduling):
    prompts = random_prompts(4, max_len=30, seed=41)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [plain.clone(logits_processors=[no_repeat_and_sevens]),
              plain.clone(logits_processors=[not_the_prompt_tokens, no_repeat_and_sevens]),
              plain, plain.clone(logits_processors=(no_repeat_and_sevens,))]
    with LLM(tiny_llama.path, dtype="float32", kv_cache_memory_bytes=KV_BYTES,
             async_scheduling=async_scheduling) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = llm.generate(prompts[2], plain, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[0] == _hf_tokens(tiny_llama.hf_model, prompts[0], with_prompt=False)
    assert outs[1] == _hf_tokens(tiny_llama.hf_model, prompts[1], with_prompt=True)
    assert outs[3] == _hf_tokens(tiny_llama.hf_model, prompts[3], with_prompt=False)
    assert outs[2] == alone  # a row without processors is untouched by its neighbours'
    assert len(set(outs[0])) == MAX_TOKENS and len(set(outs[3])) == MAX_TOKENS  # no token repeated


def test_a_tensor_parallel_engine_applies_them_on_rank_0(tiny_llama):
    """A lambda, which no pipe to a worker process could carry: rank 0 alone samples."""
    prompt = [3, 4, 5, 6, 7]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logits_processors=[lambda output_ids, row: no_repeat_and_sevens(output_ids, row)])
    with LLM(tiny_llama.path, dtype="float32", kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2,
             device="cpu") as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == _hf_tokens(tiny_llama.hf_model, prompt, with_prompt=False)


def test_bad_processors_are_errors_naming_them(tiny_llama):
    with pytest.raises(ValueError, match=r"logits_processors=\[3\] is invalid: .*list of callables"):
        SamplingParams(logits_processors=[3])
    with LLM(tiny_llama.path, dtype="float32", kv_cache_memory_bytes=KV_BYTES) as llm:
        def wrong(output_ids, logits):
            return logits[:5]

        wrong_params = SamplingParams(temperature=0.0, max_tokens=2, logits_processors=[wrong])
        with pytest.raises(ValueError, match=r"logits processor .*wrong.* returned Tensor .*must return"):
            llm.generate([[1, 2, 3]], wrong_params, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()  # the failed request is gone, the engine serves
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
