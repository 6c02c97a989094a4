"""``LLM(model, quantization="awq")`` end to end on the CPU: tiny Llama and Qwen3 models quantized
with ``quantize_awq`` into AutoAWQ-style checkpoints, against HF transformers (float32) on the same
weights dequantized into a plain checkpoint (the independent reference) and against pagedlab's own
dense run on that checkpoint; the W4A16 Triton kernel in a layer under the interpreter; dummy AWQ
weights; the config errors at construction. TRITON_INTERPRET is set at import, as in
``tests/test_awq.py``: Triton decides at decoration time whether a kernel is interpreted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file


from conftest import KV_BYTES, build_tiny_model, hf_greedy, random_prompts, tiny_config
from pagedlab import LLM, SamplingParams
from pagedlab.distributed import parallel_state
from pagedlab.layers.linear import ColumnParallelLinear
from pagedlab.loader import process_weights_after_loading
from pagedlab.loader.dummy import init_dummy_weights
from pagedlab.models.registry import build_model
from pagedlab.quantization.awq import (AWQConfig, awq_linear_torch, dequantize_awq, dequantize_repacked,
                                       quantize_awq)
from pagedlab.quantization.linear_method import AWQLinearMethod

# (Phi-3's checkpoints hold q/k/v and gate/up fused)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
           "gate_up_proj")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)


def awq_quantization_config(group_size: int, **overrides) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", **overrides}


def write_awq_checkpoints(tiny, root: Path, group_size: int) -> tuple[Path, Path]:
    """An AutoAWQ-style directory of ``tiny``'s quantized linears (float16 scales; embeddings,
    norms and LM head dense) and a plain float32 directory of the same weights dequantized."""
    awq_dir, dense_dir = root / "awq", root / "dequantized"
    state = {name: t.detach().clone() for name, t in tiny.hf_model.state_dict().items()}
    if tiny.hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    awq_tensors, dequantized = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] not in LINEARS:
            awq_tensors[name] = tensor.contiguous()
            continue
        qweight, qzeros, scales = quantize_awq(tensor.t().contiguous(), group_size)
        scales = scales.half()
        awq_tensors.update({f"{module}.qweight": qweight, f"{module}.qzeros": qzeros,
                            f"{module}.scales": scales})
        dequantized[name] = dequantize_awq(qweight, qzeros, scales.float(), group_size).t().contiguous()
    tiny.hf_model.load_state_dict(dequantized, strict=False)
    tiny.hf_model.save_pretrained(dense_dir)
    tiny.hf_model.save_pretrained(awq_dir)
    for stale in awq_dir.glob("*.safetensors"):
        stale.unlink()
    save_file(awq_tensors, str(awq_dir / "model.safetensors"))
    set_quantization_config(awq_dir, awq_quantization_config(group_size))
    return awq_dir, dense_dir


def set_quantization_config(model_dir: Path, quantization_config: dict) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("arch", "group_size"), [("llama", 32), ("qwen3", 64), ("phi3", 32)])
def test_awq_greedy_equals_hf_on_the_dequantized_weights(tmp_path, arch, group_size):
    tiny = build_tiny_model(tmp_path / "hf", arch, seed=3)
    awq_dir, dense_dir = write_awq_checkpoints(tiny, tmp_path, group_size)
    prompts = random_prompts(3, max_len=40, seed=5)
    expected = [hf_greedy(tiny.hf_model, p, GREEDY.max_tokens) for p in prompts]
    with LLM(str(awq_dir), quantization="awq", kv_cache_memory_bytes=KV_BYTES) as llm:
        quantized = llm.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(str(dense_dir), kv_cache_memory_bytes=KV_BYTES) as llm:
        dense = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in quantized] == expected
    for q, d in zip(quantized, dense):
        assert q.outputs[0].token_ids == d.outputs[0].token_ids
        for q_step, d_step in zip(q.outputs[0].logprobs, d.outputs[0].logprobs):
            for token, entry in d_step.items():
                assert abs(q_step[token].logprob - entry.logprob) < 1e-4


def test_quantization_none_reads_the_checkpoint_config(tmp_path):
    tiny = build_tiny_model(tmp_path / "hf", "llama", seed=4)
    awq_dir, _ = write_awq_checkpoints(tiny, tmp_path, 32)
    with LLM(str(awq_dir), kv_cache_memory_bytes=KV_BYTES) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny.hf_model, [5, 6, 7], 4)


def test_awq_layer_triton_kernel_equals_torch_under_the_interpreter():
    from pagedlab.kernels.w4a16 import awq_linear_triton

    gen = torch.Generator().manual_seed(0)
    layer = ColumnParallelLinear(64, [32, 32], linear_method=AWQLinearMethod(AWQConfig(group_size=32)))
    for shard_id in range(2):
        packed = quantize_awq(torch.randn(64, 32, generator=gen), 32)
        for param, tensor in zip((layer.qweight, layer.qzeros, layer.scales), packed):
            param.weight_loader(param, tensor, shard_id)
    x = torch.randn(3, 64, generator=gen)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        layer(x)
    gemm_format = [param.detach().clone() for param in (layer.qweight, layer.qzeros, layer.scales)]
    layer.linear_method.process_weights_after_loading(layer)
    assert (layer.qweight.shape, layer.qzeros.shape, layer.scales.shape) == ((64, 8), (64, 1), (64, 2))
    expected = awq_linear_torch(x, *gemm_format, 32)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    got = awq_linear_triton(x, layer.qweight, layer.qzeros, layer.scales, 32)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="already repacked"):
        layer.linear_method.process_weights_after_loading(layer)


def test_dummy_awq_weights_load_and_generate(tmp_path):
    tiny = build_tiny_model(tmp_path / "hf", "qwen3", seed=1)
    set_quantization_config(Path(tiny.path), awq_quantization_config(32))
    with LLM(tiny.path, load_format="dummy", kv_cache_memory_bytes=KV_BYTES) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
        assert llm.get_engine_info().quantization == "awq"  # read from config.json, not asked for
        layer = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj
        # group 32 from the config: [64 out, 128 in / 8] words, [64 out, 128 / 32] scales, repacked
        assert layer.awq_repacked and layer.qweight.dtype == torch.int32
        assert layer.qweight.shape == (64, 128 // 8) and layer.scales.shape == (64, 128 // 32)
    assert len(out[0].outputs[0].token_ids) == 5


@pytest.mark.parametrize(("overrides", "message"), [
    ({"version": "gemv"}, "version='gemv' is not supported"),
    ({"bits": 8}, "bits=8 is not supported"),
    ({"desc_act": True}, "desc_act=True is not supported"),
])
def test_unsupported_awq_variants_fail_at_construction(tmp_path, overrides, message):
    tiny = build_tiny_model(tmp_path / "hf", "llama", seed=2)
    set_quantization_config(Path(tiny.path), awq_quantization_config(32, **overrides))
    with pytest.raises(ValueError, match=message):
        LLM(tiny.path, load_format="dummy", kv_cache_memory_bytes=KV_BYTES)


def test_dummy_awq_weights_of_a_dense_config_take_autoawq_defaults(tmp_path):
    """The seed's line on a config.json alone: 4-bit, group 128, zero point, GEMM packing."""
    tiny = build_tiny_model(tmp_path / "hf", "llama", seed=2, hidden_size=128, head_dim=32,
                            intermediate_size=256)
    with LLM(tiny.path, quantization="awq", load_format="dummy", kv_cache_memory_bytes=KV_BYTES) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        layer = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj
        # repacked at load: [out_features, in_features / 8] words, [out_features, groups] scales
        assert layer.awq_repacked and layer.qweight.shape == (128, 256 // 8)
        assert layer.scales.shape == (128, 256 // 128)
    assert len(out[0].outputs[0].token_ids) == 3


def test_explicit_quantization_must_match_the_checkpoint(tmp_path):
    tiny = build_tiny_model(tmp_path / "hf", "llama", seed=2)
    awq_dir, _ = write_awq_checkpoints(tiny, tmp_path, 32)
    with pytest.raises(ValueError, match="quantization='fp8' does not match the checkpoint's "
                                         "quantization 'awq'"):
        LLM(str(awq_dir), quantization="fp8", load_format="dummy", kv_cache_memory_bytes=KV_BYTES)
    set_quantization_config(Path(tiny.path), {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method='gptq', which is not supported"):
        LLM(tiny.path, quantization="awq", load_format="dummy", kv_cache_memory_bytes=KV_BYTES)
    with pytest.raises(ValueError, match=r"quantization='gguf' is invalid: quantization must be one of "
                                         r"\(None, 'awq', 'fp8'\)"):
        LLM(tiny.path, quantization="gguf", kv_cache_memory_bytes=KV_BYTES)


def _dummy_awq_model(hf_config, world_size: int, rank: int, monkeypatch):
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(world_size, rank))
    model = build_model(hf_config, 64)
    init_dummy_weights(model, seed=7)
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState())
    return model


def test_dummy_awq_weights_are_the_same_at_tp1_and_tp2(monkeypatch):
    """Each TP=2 rank's packed tensors (built without a process group: no forward runs) are its cut
    of the TP=1 model's, fused q/k/v and gate/up parts included; modules_to_not_convert stay dense."""
    hf_config = tiny_config("llama")
    hf_config.quantization_config = awq_quantization_config(32, modules_to_not_convert=["layers.1.mlp"])
    whole = dict(_dummy_awq_model(hf_config, 1, 0, monkeypatch).named_modules())
    assert hasattr(whole["model.layers.1.mlp.down_proj"], "weight")
    assert hasattr(whole["model.layers.0.mlp.down_proj"], "qweight")
    for rank in range(2):
        for name, layer in _dummy_awq_model(hf_config, 2, rank, monkeypatch).named_modules():
            if not hasattr(layer, "qweight"):
                continue
            for param_name in ("qweight", "qzeros", "scales"):
                part, full = getattr(layer, param_name), getattr(whole[name], param_name)
                spec = part.spec
                if hasattr(layer, "shards"):  # column-parallel: this rank's columns of each part
                    for shard, full_shard in zip(layer.shards, whole[name].shards):
                        unit = spec.out_unit
                        expected = full.narrow(spec.out_dim, (full_shard.offset + shard.start) // unit,
                                               shard.size // unit)
                        got = part.narrow(spec.out_dim, shard.offset // unit, shard.size // unit)
                        assert torch.equal(got, expected), (name, param_name, rank)
                else:  # row-parallel: this rank's rows (whole groups)
                    rows = part.shape[spec.in_dim]
                    assert torch.equal(part, full.narrow(spec.in_dim, rank * rows, rows)), (name, param_name)


def test_repacked_dummy_weights_of_each_rank_are_its_cut_of_the_tp1_weight(monkeypatch):
    """The loader repacks after the tensor-parallel cut: each TP=2 rank's repacked tensors
    dequantize to its columns (column-parallel: of each fused part) or rows (row-parallel) of the
    TP=1 model's dequantized weight."""
    hf_config = tiny_config("llama")
    hf_config.quantization_config = awq_quantization_config(32)
    whole = _dummy_awq_model(hf_config, 1, 0, monkeypatch)
    process_weights_after_loading(whole)
    whole = dict(whole.named_modules())
    checked = 0
    for rank in range(2):
        model = _dummy_awq_model(hf_config, 2, rank, monkeypatch)
        process_weights_after_loading(model)
        for name, layer in model.named_modules():
            if not getattr(layer, "awq_repacked", False):
                continue
            part, full = (dequantize_repacked(m.qweight, m.qzeros, m.scales, 32)
                          for m in (layer, whole[name]))
            if hasattr(layer, "shards"):  # [out, in]: this rank's rows of each fused part
                expected = torch.cat([full[f.offset + s.start:f.offset + s.start + s.size]
                                      for s, f in zip(layer.shards, whole[name].shards)])
            else:
                expected = full[:, rank * part.shape[1]:(rank + 1) * part.shape[1]]
            assert torch.equal(part, expected), (name, rank)
            checked += 1
    assert checked == 2 * 2 * 4  # two ranks, two layers, four linears each


def test_missing_awq_tensor_is_named(tmp_path):
    tiny = build_tiny_model(tmp_path / "hf", "llama", seed=6)
    awq_dir, _ = write_awq_checkpoints(tiny, tmp_path, 32)
    tensors = load_file(str(awq_dir / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.scales"]
    save_file(tensors, str(awq_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.0\.mlp\.down_proj\.scales"):
        LLM(str(awq_dir), kv_cache_memory_bytes=KV_BYTES)


def test_awq_at_two_tensor_parallel_ranks_equals_hf_on_the_dequantized_weights(tmp_path):
    """Each rank holds its cut of the packed words and groups (q/k/v and gate/up each cut apart);
    two ranks over gloo give HF's greedy tokens on the dequantized weights."""
    tiny = build_tiny_model(tmp_path / "hf", "llama", seed=3)
    awq_dir, _ = write_awq_checkpoints(tiny, tmp_path, 32)
    prompts = random_prompts(3, max_len=40, seed=5)
    expected = [hf_greedy(tiny.hf_model, p, GREEDY.max_tokens) for p in prompts]
    # the seed's line: LLM(model=..., tensor_parallel_size=2, quantization="awq", enforce_eager=True)
    with LLM(str(awq_dir), tensor_parallel_size=2, quantization="awq", enforce_eager=True,
             kv_cache_memory_bytes=KV_BYTES) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
