"""Bad input gets a clear error naming the value, and the engine keeps serving."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from conftest import KV_BYTES, hf_greedy
from pagedlab import LLM, BeamSearchParams, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, max_model_len=64) as engine:
        yield engine


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=9, max_tokens=4), "min_tokens"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),  # 0 * inf: a NaN logit
    (dict(temperature=float("inf")), "temperature"),  # -inf / inf: a NaN logit
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(temperature="0.5"), "temperature"),
    (dict(top_p=None), "top_p"),
    (dict(stop=["."], detokenize=False), "stop"),  # vLLM's rule: stop strings are found in the text
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(seed=1 << 63), "seed"),  # the noise's Philox key is a 64-bit integer
    (dict(seed=-(1 << 63) - 1), "seed"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}=.* must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(presence_penalty=-2.0), dict(presence_penalty=2.0), dict(frequency_penalty=-2.0),
    dict(frequency_penalty=2.0), dict(min_p=0.0), dict(min_p=1.0), dict(top_p=1.0), dict(seed=-(1 << 63)),
    dict(seed=(1 << 63) - 1), dict(min_tokens=4, max_tokens=4), dict(logprobs=0), dict(prompt_logprobs=0),
    dict(logprobs=-1), dict(prompt_logprobs=-1),
    dict(logit_bias={5: -100.0, 6: 100.0}), dict(temperature=0.0)])
def test_the_ends_of_each_range_are_valid(kwargs):
    """vLLM's closed ranges: penalties in [-2, 2], min_p in [0, 1], min_tokens up to max_tokens,
    biases in [-100, 100], any 64-bit seed, 0 logprobs (the sampled token's alone) and -1 (the whole
    vocabulary)."""
    params = SamplingParams(**kwargs)
    assert {name: getattr(params, name) for name in kwargs} == kwargs


@pytest.mark.parametrize("temperature", [1e-6, 9.99e-6, 1e-3, 0.0099])
def test_a_tiny_temperature_is_raised_to_vllms_floor(temperature, caplog):
    """vLLM's SamplingParams raises a temperature in (0, 0.01) to 0.01 with a warning: the request
    samples at 0.01 (1e-6 was greedy here, under the 1e-5 greedy threshold)."""
    with caplog.at_level("WARNING", logger="pagedlab.sampling_params"):
        params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.01 and not params.greedy
    assert [r.getMessage() for r in caplog.records] == [
        f"temperature={temperature!r} is below 0.01, which risks inf and NaN in logits / temperature: "
        "sampling at 0.01 instead (as vLLM; 0 is greedy)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagedlab.sampling_params"):
        assert params.clone(max_tokens=3).temperature == 0.01
        assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.01).temperature == 0.01
    assert caplog.records == []


def test_spellings_vllm_takes():
    """top_k -1 or None means every token (stored as 0); one stop string is a list of one."""
    assert SamplingParams(top_k=-1).top_k == SamplingParams(top_k=None).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_beam_search_is_deterministic():
    assert BeamSearchParams(beam_width=2, max_tokens=4, temperature=0).temperature == 0
    with pytest.raises(ValueError, match=r"^temperature=0.5 is invalid: temperature must be 0"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)


def test_numpy_and_torch_values_act_as_python_ones(llm, tiny_llama):
    """A sweep over a pandas table or np.arange hands numpy numbers; token ids come as arrays or
    tensors. Each behaves as the Python value it holds, and what is stored is a Python number."""
    params = SamplingParams(temperature=torch.tensor(0.0), max_tokens=np.int64(5), seed=np.int64(7),
                            stop_token_ids=np.array([999]), logit_bias={np.int64(3): np.float64(0.0)})
    assert params.to_dict() == SamplingParams(temperature=0.0, max_tokens=5, seed=7, stop_token_ids=[999],
                                              logit_bias={3: 0.0}).to_dict()
    assert type(params.max_tokens) is int and type(params.stop_token_ids[0]) is int
    expected = hf_greedy(tiny_llama.hf_model, [5, 6, 7], 5)
    prompts = [np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), np.int32(6), 7],
               list(torch.tensor([5, 6, 7])), {"prompt_token_ids": np.array([5, 6, 7])}]
    for prompt in prompts:
        out = llm.generate(prompt, params, use_tqdm=False)
        assert len(out) == 1 and out[0].prompt_token_ids == [5, 6, 7]
        assert out[0].outputs[0].token_ids == expected
    llm.set_model_args(max_num_seqs=np.int64(8), enable_prefix_caching=np.bool_(True))
    assert llm.get_engine_info().config.max_num_seqs == 8
    assert type(llm.get_engine_info().config.max_num_seqs) is int
    with pytest.raises(ValueError, match=r"prompt_token_ids=5 is invalid: give a list of token ids"):
        llm.generate({"prompt_token_ids": 5}, params, use_tqdm=False)
    llm.set_model_args(max_num_seqs=256)


def test_too_long_prompt_is_rejected_and_engine_keeps_serving(llm, tiny_llama):
    with pytest.raises(ValueError, match=r"prompt has 64 tokens, but max_model_len is 64"):
        llm.generate([[5] * 10, [5] * 64], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama.hf_model, [5, 6, 7], 5)


def test_more_logprobs_than_the_vocabulary_fail_alone(llm, tiny_llama):
    """Refused when the request is added, naming the field, before it could fail a step."""
    vocab = tiny_llama.hf_model.config.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{name}={vocab + 1} is invalid: .* at most the vocabulary "
                                             rf"size \({vocab}\)"):
            llm.generate([[1, 2], [3, 4]], [GREEDY, GREEDY.clone(**{name: vocab + 1})], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], GREEDY.clone(logprobs=vocab), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(tiny_llama.hf_model, [5, 6, 7], 5) and len(out.logprobs[0]) == vocab


def test_out_of_vocab_and_empty_prompts(llm):
    with pytest.raises(ValueError, match=r"token id 5000 is out of range"):
        llm.generate([[1, 5000]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1, 2]], [GREEDY, GREEDY], use_tqdm=False)


def test_arguments_of_the_wrong_kind_name_what_goes_there(llm):
    with pytest.raises(ValueError, match=r"^prompts=None is invalid: give a prompt"):
        llm.generate(None, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^sampling_params=\{'temperature': 0\} is invalid: give a Sampl"):
        llm.generate([[1, 2]], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^sampling_params\[1\]=\{'temperature': 0\} is invalid"):
        llm.generate([[1, 2], [3]], [GREEDY, {"temperature": 0}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages='hi' is invalid: give a conversation"):
        llm.chat("hi", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^params=\{'beam_width': 2\} is invalid: beam_search takes a Beam"):
        llm.beam_search([[1, 2]], {"beam_width": 2})
    with pytest.raises(ValueError, match=r"prompt token id 2.5 is not an integer"):
        llm.generate([[1, 2.5]], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate("hello", GREEDY, use_tqdm=False)


def test_max_tokens_past_max_model_len_finishes_with_length(llm):
    out = llm.generate([[3] * 60], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_unknown_model_path():
    with pytest.raises(ValueError, match=r"model '/no/such/model' does not exist"):
        LLM("/no/such/model")


def test_unknown_architecture(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama.path, tmp_path / "m", dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["BertForMaskedLM"], "bert"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"\['BertForMaskedLM'\] \(model_type='bert'\) is not supported; "
                                         r"supported architectures: \[.*'LlamaForCausalLM'"):
        LLM(str(tmp_path / "m"), kv_cache_memory_bytes=KV_BYTES)


def test_truncated_safetensors_names_the_file(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama.path, tmp_path / "m", dirs_exist_ok=True)
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"weight file {weights} is corrupt or truncated"):
        LLM(str(tmp_path / "m"), kv_cache_memory_bytes=KV_BYTES)


@pytest.mark.parametrize("missing", ["model.layers.1.mlp.down_proj.weight",
                                     "model.layers.0.self_attn.k_proj.weight"], ids=["plain", "fused-part"])
def test_missing_weights_are_listed(tiny_llama, tmp_path, missing):
    """A checkpoint without a weight is refused naming it; also one part of a fused parameter (k_proj
    of qkv_proj, with q_proj and v_proj there), which counted as loaded once any part was, leaving
    k's rows uninitialised memory."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama.path, tmp_path / "m", dirs_exist_ok=True)
    weights = tmp_path / "m" / "model.safetensors"
    tensors = load_file(weights)
    del tensors[missing]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=rf"lacks weights for: {re.escape(missing)}$"):
        LLM(str(tmp_path / "m"), kv_cache_memory_bytes=KV_BYTES)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=24), "block_size=24 is invalid"),
    (dict(max_model_len=100000), "max_model_len=100000 is invalid: the model supports at most 512"),
    (dict(dtype="float8"), "dtype='float8' is invalid"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0 is invalid"),
    (dict(kv_cache_memory_bytes=1024), "cannot hold one sequence: max_model_len=512 needs"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization=0 is invalid: gpu_memory_utilization must be "
                                     r"in \(0, 1\]"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization=1.5 is invalid"),
    (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes=-1 is invalid: kv_cache_memory_bytes must be a "
                                     "positive"),
    # a string where a flag or number goes: "no" would have been true, "0.9" a TypeError
    (dict(enforce_eager="no"), r"^enforce_eager='no' is invalid: enforce_eager must be True or False$"),
    (dict(async_scheduling="on"), "async_scheduling must be True or False or None"),
    (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization must be a number$"),
    (dict(max_model_len="2k"), "max_model_len must be an integer or None$"),
    (dict(max_num_seqs=True), "max_num_seqs must be an integer$"),
    (dict(kv_cache_dtype=None), r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3'\)"),
])
def test_invalid_engine_args(tiny_llama, kwargs, message):
    args = dict(kv_cache_memory_bytes=KV_BYTES) | kwargs
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama.path, **args)


def test_set_model_args_keeps_weights_and_rejects_bad_keys(llm):
    weights = {n: p for n, p in llm.llm_engine.model.named_parameters()}
    before = llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.set_model_args(block_size=32, max_num_seqs=4)
    assert llm.get_stats().block_size == 32
    assert all(p is weights[n] for n, p in llm.llm_engine.model.named_parameters())
    assert llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
    with pytest.raises(ValueError, match="'dtype' changes the weights"):
        llm.set_model_args(dtype="float16")
    with pytest.raises(ValueError, match="unknown model arg 'blok_size'"):
        llm.set_model_args(blok_size=16)
    with pytest.raises(ValueError, match="block_size=20 is invalid"):
        llm.set_model_args(block_size=20)
    assert llm.get_stats().block_size == 32  # the failed change left the plan as it was
    llm.set_model_args(block_size=16, max_num_seqs=256)
