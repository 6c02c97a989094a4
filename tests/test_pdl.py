"""Programmatic dependent launch across a whole decode step (``kernels/pdl.py``).

On the CPU: the torch.compile options that switch Inductor's kernels to PDL. On a Hopper GPU
(``pytest -m gpu``): the race check. With ``PAGEDLAB_PDL=1`` every kernel of a step may start
before the previous one ends and waits for it in-kernel; a kernel that read or wrote too early
would change the numbers. Each engine decodes greedily from CUDA graphs with PDL on and off (one
process: the switch is read per launch, and PDL kernels compile as their own variants) and must
give the same tokens and bitwise the same logprobs, and in float32 HF's tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import hf_greedy, random_prompts, shape_config_dir
from pagedlab import LLM, SamplingParams
from pagedlab.kernels.pdl import pdl_enabled
from pagedlab.layers.fusion import inductor_options

KV = 256 << 20


def test_inductor_options_deterministic_always_pdl_only_where_asked_and_known(monkeypatch):
    import torch._inductor
    from torch._inductor import config

    assert hasattr(config, "deterministic") and hasattr(config.triton, "enable_pdl")  # torch 2.13 here
    assert inductor_options(False) == {"deterministic": True}
    assert inductor_options(True) == {"deterministic": True, "triton.enable_pdl": True}
    torch.compile(lambda x: x + 1, options=inductor_options(True))  # raises on an option Inductor lacks
    monkeypatch.setattr(torch._inductor, "config", SimpleNamespace(triton=SimpleNamespace()))
    assert inductor_options(True) == {}


def test_fused_layers_raise_dynamo_recompile_limits_and_never_lower_them(monkeypatch):
    """A process that loads several models compiles each fused layer per shape, dtype and PDL
    setting; at dynamo's default limit of 8 the rest ran eagerly (other roundings: on the H200 the
    8B PDL test below then failed)."""
    import torch._dynamo

    from pagedlab.layers import fusion

    config = torch._dynamo.config
    monkeypatch.setattr(config, "recompile_limit", 8)
    monkeypatch.setattr(config, "accumulated_recompile_limit", 256)
    fusion._allow_recompiles()
    assert (config.recompile_limit, config.accumulated_recompile_limit) == (64, 1024)
    monkeypatch.setattr(config, "recompile_limit", 500)
    fusion._allow_recompiles()
    assert config.recompile_limit == 500


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _decode(monkeypatch, pdl: bool, path: str, prompts, params, **engine_args):
    """(token ids, logprobs) per prompt of an engine built and run with PAGEDLAB_PDL on or off."""
    monkeypatch.setenv("PAGEDLAB_PDL", "1" if pdl else "0")
    with LLM(path, device="cuda", **engine_args) as llm:
        assert llm.get_engine_info().cuda_graphs
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert pdl_enabled(torch.device("cuda")) == pdl
    completions = [o.outputs[0] for o in outs]
    return [(c.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs])
            for c in completions]


gpu = pytest.mark.skipif(not _hopper(), reason="PDL needs a Hopper (sm_90 or later) GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_pdl_decode_of_tiny_models_gives_the_tokens_without_pdl_and_hf(tiny_models, monkeypatch, arch):
    """float32: paged attention with split-KV (max_model_len 512 over 256-key segments), its
    reduce, the fused q/k norm + rotary + KV write, the Inductor norms and activations, the fused
    MoE kernels."""
    tiny = tiny_models(arch)
    prompts = random_prompts(5, max_len=80, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)
    args = dict(dtype="float32", kv_cache_memory_bytes=KV, max_num_seqs=8)
    with_pdl = _decode(monkeypatch, True, tiny.path, prompts, params, **args)
    without = _decode(monkeypatch, False, tiny.path, prompts, params, **args)
    assert with_pdl == without
    assert [tokens for tokens, _ in with_pdl] == [hf_greedy(tiny.hf_model, p, 24) for p in prompts]


@pytest.fixture(scope="module")
def llama8b_layers2(tmp_path_factory) -> str:
    return shape_config_dir(tmp_path_factory.mktemp("llama3_8b_2_layers"), "llama3-8b", 2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_pdl_decode_at_the_8b_shape_gives_the_logprobs_without_pdl(llama8b_layers2, monkeypatch,
                                                                    batch_invariant):
    """Llama-3-8B's shape (2 layers, dummy bf16 weights) at batch 1 and 3: the tabled batch-1 GEMVs
    (PDL-prefetching their first weight tile) or, batch-invariant, the fixed-tile matmul, norm and
    softmax kernels; bitwise the same logprobs with PDL on and off."""
    prompts = random_prompts(3, vocab=128000, min_len=20, max_len=200, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    args = dict(load_format="dummy", dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.5,
                max_num_seqs=8, batch_invariant=batch_invariant)
    for batch in (prompts[:1], prompts):
        with_pdl = _decode(monkeypatch, True, llama8b_layers2, batch, params, **args)
        assert with_pdl == _decode(monkeypatch, False, llama8b_layers2, batch, params, **args), len(batch)
