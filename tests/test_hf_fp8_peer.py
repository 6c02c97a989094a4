"""The HF transformers FP8 peer of ``pagedlab bench`` (``--backend hf --quantization fp8``):
transformers' FineGrainedFP8Config applied to random weights through ``from_pretrained``, with
no checkpoint on disk. FineGrainedFP8 needs a CUDA GPU (transformers raises without one), so on
the CPU: the command line's errors, the reload through ``from_pretrained`` and transformers' own
refusal of the FP8 config; on the GPU: FP8 weights against the bfloat16 ones, and the FP8 peer's
logits and greedy tokens against the bfloat16 peer's where transformers' FP8 kernel loads.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from pagedlab import hf_peer
from pagedlab.cli import main

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's behaviour")


def fp8_config():
    """A tiny Llama whose linear shapes are multiples of FineGrainedFP8's 128x128 blocks (a
    weight that is not stays 16-bit); initializer 0.02, as transformers' default."""
    import transformers

    return transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=512, initializer_range=0.02)


def bench_hf(model_path: str, out, quantization: str, *extra: str) -> int:
    return main(["bench", "throughput", "--model", model_path, "--workload", "custom", "--batch-size", "2",
                 "--input-len", "8", "--output-len", "4", "--backend", *extra, "hf",
                 "--quantization", quantization, "--json", str(out)])


def test_hf_peer_refuses_awq_naming_what_it_runs(tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_hf(tiny_llama.path, out, "awq", "pagedlab") == 2
    err = capsys.readouterr().err
    assert "--backend hf with --quantization awq is not supported" in err
    assert "bfloat16" in err and "fp8" in err and "FineGrainedFP8Config" in err
    assert not out.exists()


@on_cpu
def test_hf_fp8_on_the_cpu_is_a_clear_error_before_anything_runs(tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_hf(tiny_llama.path, out, "fp8", "pagedlab") == 2
    err = capsys.readouterr().err
    assert "--backend hf --quantization fp8 (transformers' FineGrainedFP8Config) cannot run here" in err
    assert "needs a CUDA GPU" in err
    assert not out.exists()


def test_quantized_hf_peer_takes_no_lora_and_load_refuses_unknown_formats():
    with pytest.raises(ValueError, match="bfloat16 weights only, not with --quantization fp8"):
        hf_peer.check_hf_quantization("fp8", with_lora=True)
    with pytest.raises(ValueError, match="--quantization gptq is not supported"):
        hf_peer.load_hf_peer(fp8_config(), quantization="gptq")


@pytest.mark.skipif(importlib.util.find_spec("kernels") is not None, reason="`kernels` is installed")
def test_kernel_probe_reports_transformers_missing_fp8_kernel():
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    reason = hf_peer.fp8_kernel_unavailable()
    assert reason is not None and "ImportError" in reason and "kernels" in reason


def test_reload_through_from_pretrained_keeps_weights_and_outputs(tiny_llama):
    model = tiny_llama.hf_model
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        reloaded = hf_peer.reload_with(model, None)
        got = reloaded(ids).logits
    assert type(reloaded) is type(model) and reloaded.dtype == model.dtype
    assert torch.equal(got, expected)


@on_cpu
def test_fp8_config_reaches_transformers_which_needs_a_gpu(tiny_llama):
    import transformers

    with pytest.raises(RuntimeError, match="No GPU or XPU found"):
        hf_peer.reload_with(tiny_llama.hf_model, transformers.FineGrainedFP8Config())


def test_weight_bytes_count_every_parameter_once(tiny_llama):
    model = tiny_llama.hf_model  # float32, LM head not tied
    params = model.num_parameters()
    assert hf_peer.weight_bytes(model) == 4 * params
    embedding = model.config.vocab_size * model.config.hidden_size
    assert hf_peer.decode_weight_bytes(model) == 4 * (params - embedding)
    assert hf_peer.row_record(model, None) == {"quantization": None, "weight_gib": 4 * params / 2**30}


def dequantized(layer) -> torch.Tensor:
    """An FP8Linear's weight times its per-128x128-block scales (transformers' weight_scale_inv)."""
    n, k = layer.weight.shape
    scales = layer.weight_scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return layer.weight.float() * scales


def bf16_and_fp8_peers():
    torch.manual_seed(0)
    bf16 = hf_peer.load_hf_peer(fp8_config())
    torch.manual_seed(0)
    return bf16, hf_peer.load_hf_peer(fp8_config(), quantization="fp8")


@pytest.mark.gpu
@on_gpu
def test_hf_fp8_peer_holds_e4m3_weights_of_the_bf16_ones():
    from transformers.integrations.finegrained_fp8 import FP8Linear

    bf16, fp8 = bf16_and_fp8_peers()
    assert hf_peer.check_fp8_linears(fp8) == 7 * 2  # q, k, v, o, gate, up, down per layer
    reference = dict(bf16.named_modules())
    fp8_bytes = 0
    for name, layer in fp8.named_modules():
        if isinstance(layer, FP8Linear):
            assert layer.weight.dtype == torch.float8_e4m3fn
            ref = reference[name].weight.float()
            # E4M3 keeps 3 mantissa bits: about 2.6% relative error on Gaussian weights
            assert (dequantized(layer) - ref).norm() / ref.norm() < 0.05, name
            fp8_bytes += layer.weight.numel() + 4 * layer.weight_scale_inv.numel()  # float32 scales
    assert fp8.lm_head.weight.dtype == torch.bfloat16  # transformers keeps the LM head in 16 bits
    linear = sum(m.weight.numel() for m in fp8.modules() if isinstance(m, FP8Linear))
    assert hf_peer.weight_bytes(bf16) - hf_peer.weight_bytes(fp8) == 2 * linear - fp8_bytes
    record = hf_peer.row_record(fp8, "fp8")
    assert record["quantization"] == "fp8"
    assert record["quantization_config"]["weight_block_size"] == [128, 128]
    assert record["weight_gib"] == hf_peer.weight_bytes(fp8) / 2**30


@pytest.mark.gpu
@on_gpu
def test_hf_fp8_peer_agrees_with_the_bf16_peer():
    reason = hf_peer.fp8_unavailable()
    if reason is not None:
        pytest.skip(reason)
    bf16, fp8 = bf16_and_fp8_peers()
    ids = torch.randint(3, 2048, (8, 64), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.inference_mode():
        ref, got = bf16(ids).logits.float(), fp8(ids).logits.float()
        greedy = [m.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), max_new_tokens=4,
                             do_sample=False, pad_token_id=0)[:, 16:] for m in (bf16, fp8)]
    # measured on an FP8 emulation of this model on the CPU: top-1 0.89, relative error 0.07,
    # greedy agreement over the first 4 tokens 0.81; random weights give flat logits
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    relative = ((got - ref).norm() / ref.norm()).item()
    agree = (greedy[0] == greedy[1]).float().mean().item()
    print(f"hf fp8 vs bf16: teacher-forced top-1 {top1:.3f}, logits relative error {relative:.3f}, "
          f"greedy agreement (first 4 tokens) {agree:.3f}")
    assert top1 >= 0.8 and 0 < relative < 0.15 and agree >= 0.5


@pytest.mark.gpu
@on_gpu
def test_hf_fp8_bench_row_or_the_reason_it_cannot_run(tmp_path, capsys):
    import transformers

    model_dir = tmp_path / "model"
    model = transformers.AutoModelForCausalLM.from_config(fp8_config(), dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    out = tmp_path / "bench.json"
    reason = hf_peer.fp8_unavailable()
    rc = bench_hf(str(model_dir), out, "fp8")
    if reason is not None:
        assert rc == 2 and reason in capsys.readouterr().err and not out.exists()
        return
    assert rc == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["backend"] == "hf" and row["label"] == "bs=2 fp8"
    assert row["extra"]["quantization"] == "fp8"
    assert row["extra"]["quantization_config"]["quant_method"] == "fp8"
    assert row["extra"]["weight_gib"] > 0 and row["output_tokens"] == 8
