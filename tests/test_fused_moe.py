"""The fused MoE Triton kernel against its plain-torch reference (``moe_torch``), under the
Triton interpreter on the CPU (float32, small) and at real model sizes on a GPU."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "pagedlab.kernels.fused_moe_kernels" in sys.modules:
        importlib.reload(sys.modules["pagedlab.kernels.fused_moe_kernels"])

pytest.importorskip("triton")

from pagedlab.kernels.fused_moe import align_by_expert, fused_moe_triton, moe_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _moe_inputs(num_tokens, hidden, inter, num_experts, dtype=torch.float32, seed=0, skew=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, 0] += skew  # skew > 0 crowds expert 0 (several row blocks), leaving others empty
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5
    return [t.to(DEVICE, dtype) for t in (x, logits, w13, w2)]


def test_align_by_expert_sorts_pairs_into_padded_runs():
    experts = torch.tensor([[3, 0], [0, 1], [3, 0]])
    sorted_pairs, block_experts = align_by_expert(experts, 4, 4)
    pad = 6
    assert sorted_pairs.tolist()[:12] == [1, 2, 5, pad, 3, pad, pad, pad, 0, 4, pad, pad]
    assert block_experts.tolist()[:3] == [0, 1, 3]
    assert (block_experts[3:] == -1).all() and (sorted_pairs[12:] == pad).all()


@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k, renormalize, skew", [
    (1, 64, 48, 8, 2, True, 0.0),  # decode: one pair per expert block
    (37, 64, 48, 8, 2, True, 0.0),  # Mixtral-like routing, ragged intermediate size
    (70, 96, 80, 8, 2, False, 3.0),  # Qwen3-MoE-like unnormalized weights, crowded and empty experts
    (9, 32, 16, 16, 4, True, 0.0),  # hidden and intermediate below one tile
])
def test_fused_moe_matches_reference(num_tokens, hidden, inter, num_experts, top_k, renormalize, skew):
    x, logits, w13, w2 = _moe_inputs(num_tokens, hidden, inter, num_experts, skew=skew)
    expected = moe_torch(x, logits, w13, w2, top_k, renormalize)
    got = fused_moe_triton(x, logits, w13, w2, top_k, renormalize)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_fused_moe_rejects_mismatched_weights():
    x, logits, w13, w2 = _moe_inputs(4, 32, 16, 8)
    with pytest.raises(ValueError, match="must be \\[experts, 2 \\* inter"):
        fused_moe_triton(x, logits, w13, w2[:, :, :8], 2, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(2048, 768, 128, 8, True), (4096, 14336, 8, 2, True)],
                         ids=["qwen3-30b-a3b", "mixtral-8x7b"])
@pytest.mark.parametrize("num_tokens", [1, 64, 512])
def test_fused_moe_at_model_sizes_on_gpu(shape, num_tokens):
    """Real expert shapes in bf16 (two layers' worth of weights): the fused kernel within bf16
    rounding of the reference."""
    hidden, inter, num_experts, top_k, renormalize = shape
    for layer in range(2):
        x, logits, w13, w2 = _moe_inputs(num_tokens, hidden, inter, num_experts, torch.bfloat16, seed=layer)
        expected = moe_torch(x.float(), logits.float(), w13.float(), w2.float(), top_k, renormalize)
        got = fused_moe_triton(x, logits, w13, w2, top_k, renormalize).float()
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("arch", [pytest.param("mixtral", marks=pytest.mark.slow), "qwen3_moe"])
def test_triton_backend_runs_the_fused_kernel_with_hf_tokens(tiny_models, arch, monkeypatch):
    """The Triton backend sends the experts through the fused kernel (counted here) and gives
    HF's greedy tokens, at two tensor-parallel ranks for Mixtral (each rank's intermediate slice)."""
    from conftest import hf_greedy, random_prompts
    from pagedlab import LLM, SamplingParams
    from pagedlab.kernels import fused_moe

    calls = []
    monkeypatch.setattr(fused_moe, "align_by_expert",
                        lambda *args: calls.append(1) or align_by_expert(*args))
    tiny = tiny_models(arch)
    prompts = random_prompts(2, min_len=5, max_len=20, seed=13)
    tp = 2 if arch == "mixtral" else 1
    with LLM(tiny.path, dtype="float32", attention_backend="triton", tensor_parallel_size=tp,
             kv_cache_memory_bytes=4 << 20) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)]
    assert got == [hf_greedy(tiny.hf_model, p, 4, eos_token_id=None) for p in prompts]
    assert calls  # rank 0 runs in this process
