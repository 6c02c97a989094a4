"""``LLM.load_weights``: an engine built from tiny model A, given model B's state dict (or part of
it), generates what HF transformers' float32 model B (or A with those tensors of B) generates,
and what an engine freshly built from B does; bad tensors leave the engine as it was; KV computed
with the old weights is never reused; unfinished requests, AWQ and prequantized FP8 refuse it;
online FP8 re-quantizes, LoRA adapters stay, tensor-parallel ranks each load their part."""

from __future__ import annotations

import asyncio
import copy
import re
import types

import pytest
import torch

from conftest import (KV_BYTES, assert_hf_tokens_and_logprobs, build_tiny_model, random_prompts,
                      run_on_async_engine, tokens_and_logprobs)
from pagedlab import LLM, SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def _engine(path, **engine_args) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory_bytes=KV_BYTES, **engine_args)


def _run(llm, prompts, **kwargs):
    return tokens_and_logprobs(llm.generate(prompts, GREEDY, use_tqdm=False, **kwargs))


def _pair(tmp_path, arch, **overrides):
    """Tiny models A and B of one architecture (other seeds: other weights)."""
    return (build_tiny_model(tmp_path / "a", arch, seed=1, **overrides),
            build_tiny_model(tmp_path / "b", arch, seed=2, **overrides))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma2", "gpt_neox", "mixtral", "qwen3_moe"])
def test_update_to_b_generates_as_hf_b_and_a_fresh_engine_of_b(tmp_path, arch):
    """Qwen3 and Gemma 2 tie the LM head, Phi-3's checkpoint fuses q/k/v and gate/up, the MoE
    models' state dicts hold transformers 5's 3-D expert tensors (their checkpoints per-expert
    ones) and GPT-NeoX's its ``lm_head`` (the checkpoint's ``embed_out``). The same prompts
    before and after: a prefix-cache hit would reuse A's KV."""
    a, b = _pair(tmp_path, arch)
    prompts = random_prompts(3, max_len=40, seed=3)
    with _engine(b.path) as fresh:
        expected = _run(fresh, prompts)
    with _engine(a.path) as llm:
        before = _run(llm, prompts)
        _run(llm, prompts)
        assert llm.get_stats().prefix_cache_hit_tokens > 0  # A's KV is cached and would be reused
        llm.load_weights(b.hf_model.state_dict())
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens_and_logprobs(outs) == expected != before
    assert_hf_tokens_and_logprobs(b.hf_model, prompts, outs, MAX_TOKENS)


def test_partial_update_changes_only_the_tensors_given(tmp_path):
    """q_proj alone (one part of the fused qkv_proj), an up_proj (part of gate_up_proj) and a
    norm: the reference is HF model A with just those tensors of B."""
    a, b = _pair(tmp_path, "llama")
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.1.input_layernorm.weight"]
    b_state = b.hf_model.state_dict()
    mixed = copy.deepcopy(a.hf_model)
    mixed.load_state_dict({name: b_state[name] for name in names}, strict=False)
    prompts = random_prompts(3, max_len=40, seed=4)
    with _engine(a.path) as llm:
        qkv = llm.llm_engine.model.model.layers[0].self_attn.qkv_proj.weight
        kv_rows = qkv[64:].clone()
        llm.load_weights((name, b_state[name]) for name in names)  # any iterable of pairs
        llm.load_weights(types.MappingProxyType({names[0]: b_state[names[0]]}))  # any Mapping, as documented
        assert torch.equal(qkv[64:], kv_rows) and torch.equal(qkv[:64], b_state[names[0]])
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_hf_tokens_and_logprobs(mixed, prompts, outs, MAX_TOKENS)


def test_other_dtypes_and_devices_are_cast_as_a_checkpoint_is(tmp_path):
    """bfloat16 tensors load as a bfloat16 checkpoint would into the float32 engine: the reference
    is HF model B rounded to bfloat16 and computed in float32."""
    a, b = _pair(tmp_path, "qwen3")
    rounded = copy.deepcopy(b.hf_model)
    with torch.no_grad():  # the weights only (its RoPE frequencies stay float32)
        for param in rounded.parameters():
            param.copy_(param.to(torch.bfloat16))
    prompts = random_prompts(2, max_len=30, seed=5)
    with _engine(a.path) as llm:
        llm.load_weights({name: t.to(torch.bfloat16) for name, t in b.hf_model.state_dict().items()})
        assert_hf_tokens_and_logprobs(rounded, prompts, llm.generate(prompts, GREEDY, use_tqdm=False),
                                      MAX_TOKENS)
        llm.load_weights(b.hf_model.named_parameters())  # Parameters that require grad: float32
        assert_hf_tokens_and_logprobs(b.hf_model, prompts, llm.generate(prompts, GREEDY, use_tqdm=False),
                                      MAX_TOKENS)


@pytest.mark.parametrize(("bad", "message"), [
    (("model.layers.0.mlp.gate_proj.bias", torch.zeros(128)), "it has no place in LlamaForCausalLM"),
    (("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64)), r"weight shape \(64, 64\)"),
    (("model.layers.0.self_attn.k_scale", torch.ones(())), "KV-cache scales"),
    (("model.norm.weight", torch.empty(64, device="meta")), "meta"),  # no data: copying it fails
    (("model.norm.weight", torch.ones(64, dtype=torch.complex64)), "complex64"),  # a cast drops the imag part
    (("model.norm.weight", [1.0] * 64), "give a dict of name -> torch.Tensor"),
])
def test_bad_tensors_are_errors_naming_them_and_change_nothing(tmp_path, bad, message):
    a, b = _pair(tmp_path, "llama")
    prompts = random_prompts(2, max_len=30, seed=6)
    with _engine(a.path) as llm:
        before = _run(llm, prompts)
        good = list(b.hf_model.state_dict().items())
        with pytest.raises(ValueError, match=message) as error:
            llm.load_weights(good[:5] + [bad] + good[5:])  # valid tensors before the bad one are not written
        if isinstance(bad[1], torch.Tensor):
            assert repr(bad[0]) in str(error.value)
        assert _run(llm, prompts) == before


@pytest.mark.parametrize(("arch", "name", "shape", "message"), [
    ("phi3", "model.layers.0.self_attn.qkv_proj.weight", (260, 64), "(260, 64)"),  # q/k/v: 128 rows
    ("phi3", "model.layers.0.mlp.gate_up_proj.weight", (300, 64), "(300, 64)"),  # gate/up: 256 rows
    ("phi3", "model.layers.7.self_attn.qkv_proj.weight", (128, 64), "no place"),  # 2 layers
    ("gpt2", "transformer.h.0.attn.c_attn.weight", (64, 200), "(200, 64)"),  # Conv1D [in, 3 * 64], transposed
    ("gpt2", "transformer.h.0.attn.c_attn.bias", (200,), "(200,)"),
    ("gpt_neox", "gpt_neox.layers.0.attention.query_key_value.weight", (200, 64), "(200, 64)"),  # 192 rows
])
def test_a_fused_checkpoint_tensor_of_another_size_is_an_error_naming_it(tiny_models, arch, name, shape,
                                                                         message):
    """HF's ``load_state_dict`` refuses the size mismatch; cut into parts, the rows past the
    parts' must not be dropped unseen."""
    refused = pytest.raises(ValueError, match=re.escape(f"{name!r}: ") + ".*" + re.escape(message))
    with _engine(tiny_models(arch).path) as llm, refused:
        llm.load_weights({name: torch.zeros(shape)})


def test_a_3d_experts_tensor_of_too_few_experts_is_an_error_naming_it(tmp_path):
    """transformers 5's ``experts.gate_up_proj`` of 4 experts for a model of 8: HF's
    ``load_state_dict`` refuses the size mismatch; it must not update half the experts."""
    model = build_tiny_model(tmp_path / "a", "qwen3_moe", seed=1)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    prompts = random_prompts(2, max_len=30, seed=6)
    with _engine(model.path) as llm:
        before = _run(llm, prompts)
        with pytest.raises(ValueError, match=rf"{name!r}: .*4 experts.*8"):
            llm.load_weights({name: torch.zeros(4, 64, 64)})
        llm.reset_prefix_cache()  # the same batches as before: MoE sums depend on the tokens batched
        assert _run(llm, prompts) == before


def test_an_unfinished_request_refuses_the_update_and_a_finished_run_takes_it(tmp_path):
    a, b = _pair(tmp_path, "llama")
    prompts = random_prompts(3, max_len=30, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 12, 12)]
    with _engine(a.path) as llm:
        running = llm.generate_as_completed(prompts, params, use_tqdm=False)
        next(running)  # the short one is done; two are mid-generation
        with pytest.raises(RuntimeError, match="2 requests are unfinished"):
            llm.load_weights(b.hf_model.state_dict())
        rest = list(running)
        assert len(rest) == 2 and all(len(out.outputs[0].token_ids) == 12 for _, out in rest)
        llm.load_weights(b.hf_model.state_dict())
        assert_hf_tokens_and_logprobs(b.hf_model, prompts, llm.generate(prompts, GREEDY, use_tqdm=False),
                                      MAX_TOKENS)


def test_async_engine_updates_between_steps_and_refuses_while_requests_run(tmp_path):
    a, b = _pair(tmp_path, "llama")
    prompts = random_prompts(2, max_len=30, seed=8)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def scenario(engine):
        stream = engine.add_request(prompts[0], long)
        await stream.__anext__()  # running
        with pytest.raises(RuntimeError, match="unfinished"):
            await engine.load_weights(b.hf_model.state_dict())
        await stream.aclose()  # aborted
        await asyncio.sleep(0.05)
        await engine.load_weights(b.hf_model.state_dict())
        greedy = GREEDY.clone(detokenize=False)  # no tokenizer in the tiny model
        return await asyncio.gather(*(engine.add_request(p, greedy).result() for p in prompts))

    with _engine(a.path, max_model_len=512) as llm:
        outs = run_on_async_engine(llm, scenario)
    assert_hf_tokens_and_logprobs(b.hf_model, prompts, outs, MAX_TOKENS)


def test_online_fp8_requantizes_as_a_fresh_load(tmp_path):
    a, b = _pair(tmp_path, "llama")
    prompts = random_prompts(3, max_len=40, seed=9)
    with _engine(b.path, quantization="fp8") as fresh:
        expected = _run(fresh, prompts)
        fresh_layer = fresh.llm_engine.model.model.layers[1].mlp.gate_up_proj
        fresh_weight, fresh_scale = fresh_layer.weight.clone(), fresh_layer.weight_scale.clone()
    with _engine(a.path, quantization="fp8") as llm:
        llm.load_weights(b.hf_model.state_dict())
        layer = llm.llm_engine.model.model.layers[1].mlp.gate_up_proj
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(layer.weight.float(), fresh_weight.float())
        assert torch.equal(layer.weight_scale, fresh_scale)
        assert _run(llm, prompts) == expected


def test_awq_refuses_the_update_by_name(tmp_path):
    a, b = _pair(tmp_path, "llama")
    refused = pytest.raises(ValueError, match=r"quantization='awq'.*repacked")
    with _engine(a.path, quantization="awq") as llm, refused:
        llm.load_weights(b.hf_model.state_dict())


def test_lora_engine_updates_the_base_and_keeps_its_adapters(tmp_path):
    from lora_fixtures import ALL_TARGETS, make_adapter
    from pagedlab import LoRARequest

    a, b = _pair(tmp_path, "llama")
    adapter = make_adapter(a.hf_model, tmp_path / "adapter", seed=3, rank=4, alpha=8, targets=ALL_TARGETS)
    lora = LoRARequest("adapter", 1, adapter.path)
    prompts = random_prompts(2, max_len=30, seed=10)
    with _engine(b.path, enable_lora=True, max_lora_rank=8) as fresh:
        expected = _run(fresh, prompts), _run(fresh, prompts, lora_request=lora)
    with _engine(a.path, enable_lora=True, max_lora_rank=8) as llm:
        _run(llm, prompts, lora_request=lora)  # the adapter is loaded and in a slot
        llm.load_weights(b.hf_model.state_dict())
        got = _run(llm, prompts), _run(llm, prompts, lora_request=lora)
        assert llm.llm_engine.runner.lora.num_loads == 1  # kept, not read again
    assert got == expected and got[0] != got[1]


def test_two_tensor_parallel_ranks_each_load_their_part(tmp_path):
    a, b = _pair(tmp_path, "llama")
    prompts = random_prompts(2, max_len=30, seed=11)
    with _engine(a.path, tensor_parallel_size=2, device="cpu") as llm:
        llm.load_weights(b.hf_model.state_dict())
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_hf_tokens_and_logprobs(b.hf_model, prompts, outs, MAX_TOKENS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("arch", "engine_args"), [
    ("llama", {"dtype": "bfloat16"}), ("qwen3", {"dtype": "float32"}), ("mixtral", {"dtype": "bfloat16"}),
    ("llama", {"dtype": "bfloat16", "quantization": "fp8"})], ids=["llama-bf16", "qwen3-fp32", "mixtral-bf16",
                                                                    "llama-fp8"])
def test_cuda_graphs_replay_the_updated_weights(tmp_path, arch, engine_args):
    """The captured decode and mixed-step graphs read the parameters' storage, which the update
    copies into: the tokens and logprobs of an engine freshly built from B (float32 CPU tensors
    cast and moved as the loader does)."""
    a, b = _pair(tmp_path, arch)
    prompts = random_prompts(4, max_len=40, seed=12)
    with LLM(b.path, kv_cache_memory_bytes=KV_BYTES, **engine_args) as fresh:
        expected = _run(fresh, prompts)
    with LLM(a.path, kv_cache_memory_bytes=KV_BYTES, **engine_args) as llm:
        assert llm.get_engine_info().cuda_graphs
        before = _run(llm, prompts)
        llm.load_weights(b.hf_model.state_dict())
        got = _run(llm, prompts)
    assert got == expected != before
