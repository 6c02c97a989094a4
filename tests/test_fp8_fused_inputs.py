"""FP8 linears' inputs quantized by the layer that produces them (``QuantizedActivations``): the
RMSNorm + quantization and SiLU-and-mul + quantization kernels against their torch references
(the producer, then ``quantize_fp8_per_row``), the FP8 linears taking the quantized input, and
the engine: on a tiny Llama and Qwen3 with ``quantization="fp8"`` the greedy tokens and logprobs
are identical with the fusion on and off (``PAGEDLAB_FP8_FUSED_INPUTS=0``), the fused producers
are where the load-time step puts them (not with LoRA, not in Gemma), the gate/up projection's
gated FP8 GEMV is used exactly where the activation would emit FP8, and on a GPU at Llama-3-8B's
shape through CUDA graphs (batch 1 through the gated FP8 GEMV).

On a machine without CUDA the kernels run under the Triton interpreter (set here, before the
kernel modules are first imported; modules another test built without it are rebuilt).
"""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch


pytest.importorskip("triton")

from conftest import (KV_BYTES, assert_same_decode, random_prompts, shape_config_dir, tiny_config,
                      tokens_and_logprobs)
from pagedlab import LLM, SamplingParams
from pagedlab.layers.activation import silu_and_mul, silu_and_mul_fp8
from pagedlab.layers.norm import add_rms_norm, rms_norm, rms_norm_fp8
from pagedlab.models.registry import build_model
from pagedlab.quantization import linear_method
from pagedlab.quantization.fp8 import QuantizedActivations, fp8_linear_torch, quantize_fp8_per_row

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def kernels():
    return (importlib.import_module("pagedlab.kernels.batch_invariant"),
            importlib.import_module("pagedlab.kernels.fp8_linear"))


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.uint8).cpu()


def _assert_quantizes(quantized: QuantizedActivations, unquantized: torch.Tensor) -> None:
    """``quantized`` is bit for bit ``quantize_fp8_per_row`` of ``unquantized``."""
    values, scales = quantize_fp8_per_row(unquantized.cpu())
    assert quantized.dtype == unquantized.dtype and quantized.values.dtype == torch.float8_e4m3fn
    assert torch.equal(quantized.scales.cpu(), scales)
    assert torch.equal(_bits(quantized.values), _bits(values))


def _assert_same_values(a: QuantizedActivations, b: QuantizedActivations) -> None:
    assert torch.equal(_bits(a.values), _bits(b.values)) and torch.equal(a.scales, b.scales)


def _activations(rows: int, width: int, dtype: torch.dtype, *key) -> torch.Tensor:
    """Rows of mixed magnitudes with an all-zero row, an outlier and E4M3 subnormals."""
    gen = _generator(rows, width, dtype, *key)
    x = torch.randn(rows, width, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[1] = 0
    x[2, 5] = 300.0
    x[3, ::3] *= 1e-4
    return x.to(DEVICE, dtype)


# ---- kernels ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [96, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_quantization_equals_the_torch_norm_then_quantize_fp8_per_row(kernels, dtype, width,
                                                                           with_residual):
    """The norm within the norm tests' tolerance of ``rms_norm`` / ``add_rms_norm`` (the residual
    sum bitwise), and the FP8 values and scales bitwise those of ``quantize_fp8_per_row`` applied
    to the kernel's own norm; the same values when that norm is not written out."""
    batch_invariant, _ = kernels
    x = _activations(6, width, dtype, "norm", with_residual)
    residual = _activations(6, width, dtype, "residual") if with_residual else None
    weight = (torch.rand(width, generator=_generator("weight", width)) + 0.5).to(DEVICE, dtype)
    normed = torch.empty_like(x)
    out = batch_invariant.rows_norm_triton(x, weight, 1e-6, residual=residual, fp8=True, normed_out=normed)
    alone = batch_invariant.rows_norm_triton(x, weight, 1e-6, residual=residual, fp8=True)
    if with_residual:
        (quantized, summed), (alone, alone_summed) = out, alone
        expected, expected_sum = add_rms_norm(x, residual, weight, 1e-6)
        assert torch.equal(summed, expected_sum) and torch.equal(alone_summed, expected_sum)
    else:
        quantized, expected = out, rms_norm(x, weight, 1e-6)
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(normed, expected, **close)
    _assert_quantizes(quantized, normed)
    _assert_same_values(alone, quantized)
    assert quantized.values.shape == (6, width) and quantized.scales.shape == (6, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [200, 600])  # 600: more than one 256-column chunk in the interpreter
def test_silu_mul_quantization_equals_silu_and_mul_then_quantize_fp8_per_row(kernels, dtype, width):
    _, fp8_linear = kernels
    gate_up = _activations(5, 2 * width, dtype, "gate_up")
    act = torch.empty(5, width, dtype=dtype, device=DEVICE)
    quantized = fp8_linear.silu_and_mul_fp8_triton(gate_up, act_out=act)
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(act, silu_and_mul(gate_up), **close)
    _assert_quantizes(quantized, act)
    alone = fp8_linear.silu_and_mul_fp8_triton(gate_up)
    _assert_same_values(alone, quantized)
    with pytest.raises(ValueError, match=r"x of shape \(5, 7\) must be 2-D \[rows, 2 \* K\]"):
        fp8_linear.silu_and_mul_fp8_triton(gate_up[:, :7])


@pytest.mark.parametrize("split_block", [64, 256])  # 600 / 64: 10 chunks, the last partial
def test_split_silu_mul_quantization_gives_the_one_program_values(kernels, split_block):
    """The split form (chunk maxima, then chunks quantized at their row's scale; what few rows run
    on a GPU) against the one-program-per-row launch and the torch reference, bit for bit."""
    _, fp8_linear = kernels
    gate_up = _activations(5, 2 * 600, torch.float16, "gate_up-split")
    act = torch.empty(5, 600, dtype=torch.float16, device=DEVICE)
    split = fp8_linear.silu_and_mul_fp8_triton(gate_up, act_out=act, split_block=split_block)
    whole = fp8_linear.silu_and_mul_fp8_triton(gate_up, split_block=0)
    torch.testing.assert_close(act, silu_and_mul(gate_up), atol=2e-3, rtol=2e-3)
    _assert_quantizes(split, act)
    _assert_same_values(split, whole)
    _assert_same_values(fp8_linear.silu_and_mul_fp8_triton(gate_up, split_block=split_block), whole)


def test_the_layers_fp8_producers_are_their_references_off_cuda():
    """What the CPU engine runs: the torch producer, then ``quantize_fp8_per_row``."""
    x = _activations(4, 64, torch.float32, "cpu").cpu()
    residual = _activations(4, 64, torch.float32, "residual").cpu()
    weight = torch.rand(64, generator=_generator("cpu-weight")) + 0.5
    _assert_quantizes(rms_norm_fp8(x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    quantized, summed = rms_norm_fp8(x, weight, 1e-5, residual)
    assert torch.equal(summed, x + residual)
    _assert_quantizes(quantized, add_rms_norm(x, residual, weight, 1e-5)[0])
    _assert_quantizes(silu_and_mul_fp8(x), silu_and_mul(x))
    with pytest.raises(ValueError, match=r"RMSNorm weight of torch\.float16 on torch\.float32 activations"):
        rms_norm_fp8(x, weight.half(), 1e-5)


def test_fp8_linear_takes_quantized_activations_as_it_quantizes_the_tensor():
    gen = _generator("linear")
    x = torch.randn(3, 48, generator=gen) * 2
    values, scale = quantize_fp8_per_row(torch.randn(32, 48, generator=gen) * 0.05)
    bias = torch.randn(32, generator=gen)
    quantized = QuantizedActivations.of(x)
    expected = fp8_linear_torch(x, values, scale, bias=bias)
    assert torch.equal(fp8_linear_torch(quantized, values, scale, bias=bias), expected)
    with pytest.raises(ValueError, match="with a static input_scale: only dynamic per-token"):
        fp8_linear_torch(quantized, values, scale, input_scale=torch.tensor(0.01))


# ---- wiring -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("arch", "quantization", "expected"),
                         [("llama", "fp8", 6), ("qwen3", "fp8", 6), ("phi3", "fp8", 6), ("llama", None, 0),
                          ("llama", "awq", 0), ("gemma2", "fp8", 0)])
def test_load_step_fuses_only_dynamic_fp8_consumers_of_the_llama_decoder_layer(arch, quantization, expected):
    """Two layers, three producers each (the two norms and the SiLU-and-mul); none for dense or
    AWQ linears, nor in Gemma's own layers (their norms are ``1 + weight``: left unfused)."""
    model = build_model(tiny_config(arch), 64, quantization)
    assert model.emit_fp8_inputs() == expected
    assert model.model.layers[0].input_layernorm.fp8_output == (expected > 0)


def _generate(path: str, fused: bool, monkeypatch, **engine_args):
    """(token ids, logprobs) per prompt, and for each FP8 linear (by its leaf name) whether its
    inputs came quantized, from an engine built with the fusion on or off."""
    monkeypatch.setenv("PAGEDLAB_FP8_FUSED_INPUTS", "1" if fused else "0")
    seen: dict[torch.nn.Module, set[bool]] = {}
    real = linear_method.FP8LinearMethod.apply

    def spy(self, layer, x, bias):
        seen.setdefault(layer, set()).add(isinstance(x, QuantizedActivations))
        return real(self, layer, x, bias)

    monkeypatch.setattr(linear_method.FP8LinearMethod, "apply", spy)
    prompts = random_prompts(3, max_len=30, seed=21)
    # on the CPU even where CUDA is (the GPU's fused kernels round otherwise: the GPU tests below)
    with LLM(path, quantization="fp8", kv_cache_memory_bytes=KV_BYTES, device="cpu", **engine_args) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        names = {module: name.removesuffix(".base").rpartition(".")[2]  # LoRA's wrapped linears
                 for name, module in llm.llm_engine.model.named_modules()}
    by_name: dict[str, set[bool]] = {}
    for layer, kinds in seen.items():
        by_name.setdefault(names[layer], set()).update(kinds)
    return tokens_and_logprobs(outs), by_name


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_fp8_inputs_give_the_unfusedtokens_and_logprobs(tiny_models, monkeypatch, arch):
    """On the CPU the fused producers are the torch producer then ``quantize_fp8_per_row``, so the
    numbers are bitwise the unfused ones; qkv_proj, gate_up_proj and down_proj take quantized
    inputs only when fused, o_proj never."""
    tiny = tiny_models(arch)
    fused, seen_fused = _generate(tiny.path, True, monkeypatch)
    unfused, seen_unfused = _generate(tiny.path, False, monkeypatch)
    assert fused == unfused
    assert seen_fused == {"qkv_proj": {True}, "o_proj": {False}, "gate_up_proj": {True}, "down_proj": {True}}
    assert seen_unfused == {name: {False} for name in seen_fused}


def test_gate_up_emits_down_projs_fp8_input_only_where_the_activation_would(tiny_models, monkeypatch):
    """The MLP's use of the gated FP8 GEMV (GPU only: ``fp8_gemv_silu_and_mul_triton``), on the
    CPU with its reference standing in: taken when the SiLU-and-mul would hand down_proj
    ``QuantizedActivations`` (the fusion on), never when it hands a tensor (off); the same tokens
    and logprobs."""
    path = tiny_models("llama").path
    unfused_mlp, _ = _generate(path, True, monkeypatch)
    calls = []

    def reference(self, layer, x, bias):
        calls.append(layer)
        return QuantizedActivations.of(silu_and_mul(fp8_linear_torch(x, layer.weight, layer.weight_scale)))
    monkeypatch.setattr(linear_method.FP8LinearMethod, "fuses_silu", lambda self, layer, x: True)
    monkeypatch.setattr(linear_method.FP8LinearMethod, "apply_silu_and_mul", reference)
    fused_mlp, seen = _generate(path, True, monkeypatch)
    assert calls and fused_mlp == unfused_mlp and "gate_up_proj" not in seen
    calls.clear()
    _generate(path, False, monkeypatch)
    assert calls == []


def test_lora_keeps_fp8_inputs_unfused(tiny_models, monkeypatch):
    """A LoRA linear's shrink reads the unquantized input: with LoRA enabled no producer fuses."""
    results, seen = _generate(tiny_models("llama").path, True, monkeypatch, enable_lora=True, max_lora_rank=8)
    assert seen == {name: {False} for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert all(len(tokens) == GREEDY.max_tokens for tokens, _ in results)


# ---- GPU --------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_fused_kernels_at_llama_8b_sizes(kernels, rows):
    """bf16 at Llama-3-8B's widths (hidden 4096, intermediate 14336): the norms within one bf16
    step of the torch ones, and the FP8 values bitwise ``quantize_fp8_per_row`` of the kernels' own."""
    batch_invariant, fp8_linear = kernels
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(rows, 4096, device="cuda", generator=gen).bfloat16()
    weight = (torch.rand(4096, device="cuda", generator=gen) + 0.5).bfloat16()
    normed = torch.empty_like(x)
    quantized, summed = batch_invariant.rows_norm_triton(x, weight, 1e-5, residual=residual, fp8=True,
                                                         normed_out=normed)
    expected, expected_sum = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(normed, expected, atol=2e-2, rtol=1e-2)
    _assert_quantizes(quantized, normed)
    gate_up = torch.randn(rows, 2 * 14336, device="cuda", generator=gen).bfloat16() * 3
    act = torch.empty(rows, 14336, dtype=torch.bfloat16, device="cuda")
    quantized = fp8_linear.silu_and_mul_fp8_triton(gate_up, act_out=act)
    torch.testing.assert_close(act, silu_and_mul(gate_up), atol=2e-2, rtol=1e-2)
    _assert_quantizes(quantized, act)


@pytest.fixture(scope="module")
def llama8b_layers2(tmp_path_factory) -> str:
    return shape_config_dir(tmp_path_factory.mktemp("llama3_8b_2_layers"), "llama3-8b", 2)


@pytest.mark.gpu
@gpu
def test_fused_fp8_inputs_at_the_8b_shape_through_cuda_graphs(llama8b_layers2, monkeypatch):
    """Llama-3-8B's shape (2 layers, dummy bf16 weights quantized to FP8) decoding from CUDA
    graphs at batch 1 and 3: the FP8 GEMV and ``_scaled_mm`` fed by the fused norm and SiLU-and-mul
    kernels give the unfused engine's greedy tokens and logprobs (to the norm's rounding)."""
    prompts = random_prompts(3, vocab=128000, min_len=20, max_len=200, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    args = dict(load_format="dummy", dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.5,
                max_num_seqs=8, device="cuda")
    for batch in (prompts[:1], prompts):
        runs = {}
        for fused in (True, False):
            monkeypatch.setenv("PAGEDLAB_FP8_FUSED_INPUTS", "1" if fused else "0")
            with LLM(llama8b_layers2, quantization="fp8", **args) as llm:
                assert llm.get_engine_info().cuda_graphs
                mlp = llm.llm_engine.model.model.layers[0].mlp
                assert mlp.act.fp8_output == fused
                one_row = torch.zeros(1, 4096, dtype=torch.bfloat16, device="cuda")
                assert mlp.gate_up_proj.fuses_silu(one_row)  # the gated FP8 GEMV where fused
                outs = llm.generate(batch, params, use_tqdm=False)
            runs[fused] = tokens_and_logprobs(outs)
        assert_same_decode(runs[True], runs[False])
