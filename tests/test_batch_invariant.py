"""Batch-invariant mode (``batch_invariant=True``): a prompt's logprobs are bitwise the same alone,
in batches of any size and order, with prefix caching and chunked prefill on or off; the default
mode is not (the control that lets these tests fail); the kernels against their torch references.

On a machine without CUDA the Triton kernels run under the interpreter (set here, before pagedlab
first imports them; modules another test built without it are rebuilt).
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F


pytest.importorskip("triton")

from conftest import KV_BYTES, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.config import EngineConfig
from pagedlab.kernels.device import tma_loads
from pagedlab.kernels.gemv_configs import (BATCH_INVARIANT_TILE, TileConfig,
                                           batch_invariant_persistent_config, batch_invariant_splits)
from pagedlab.layers import batch_invariant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles for the interpreter: 3 column tiles, K of 5 steps (the last one partial) cut in 3.
SMALL_TILE = TileConfig(block_n=32, block_k=16, block_m=16, num_warps=4, num_stages=2)
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
# Batches run against the prompts alone: all of them in order, reversed, the first two swapped, shuffled.
ORDERS = ("all", "reversed", "pair", "shuffled")


@pytest.fixture(scope="module")
def kernels():
    return importlib.import_module("pagedlab.kernels.batch_invariant")


# ---- kernels ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, in_features, with_bias",
                         [(torch.float32, 80, True), (torch.float32, 64, False), (torch.float16, 80, True)])
def test_fixed_tile_matmul_matches_torch(kernels, dtype, in_features, with_bias):
    g = torch.Generator().manual_seed(in_features)
    x = torch.randn(21, in_features, generator=g).to(DEVICE, dtype)
    weight = torch.randn(72, in_features, generator=g).to(DEVICE, dtype)
    bias = torch.randn(72, generator=g).to(DEVICE, dtype) if with_bias else None
    out = kernels.fixed_tile_matmul_triton(x, weight, bias, SMALL_TILE, num_segments=3)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-3)
    expected = kernels.fixed_tile_matmul_torch(x, weight, bias)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)


def test_fixed_tile_matmul_rows_do_not_depend_on_the_batch(kernels):
    """Every row alone, in batches of several sizes and permuted, and through either launch (K
    split across programs or looped in one), is bitwise the full batch's row; torch's own CPU
    matmul is not (a batch of one rounds differently), so the property is not free."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 80, generator=g).to(DEVICE)
    weight, bias = torch.randn(72, 80, generator=g).to(DEVICE), torch.randn(72, generator=g).to(DEVICE)

    def run(rows, split=None):
        return kernels.fixed_tile_matmul_triton(rows, weight, bias, SMALL_TILE, num_segments=3,
                                                split_across_programs=split)

    full = run(x, split=False)
    assert torch.equal(run(x, split=True), full)
    for size in (1, 3, 17):
        assert torch.equal(run(x[:size]), full[:size]), size
        assert torch.equal(run(x[-size:], split=True), full[-size:]), size
    order = torch.randperm(40, generator=g)
    assert torch.equal(run(x[order]), full[order])
    cpu_x, cpu_w = x.cpu(), weight.cpu()
    assert not torch.equal(F.linear(cpu_x[:1], cpu_w), F.linear(cpu_x, cpu_w)[:1])


@pytest.mark.parametrize("dtype, in_features, tma",
                         [(torch.float32, 112, True), (torch.float16, 112, True), (torch.float32, 100, True),
                          (torch.float16, 100, False)])
def test_persistent_launch_is_bitwise_the_in_program_launch(kernels, dtype, in_features, tma):
    """4 programs looping over 3 x 3 tiles (the last row and column tiles partial), operands
    through TMA descriptors (K steps past K zero-filled at 100 features) or, where a row is not a
    multiple of 16 bytes (float16, 100 features), through pointer loads: bitwise the in-program
    launch with 1 and 3 K segments, and a batch's first rows equal a run on those rows alone. In
    float32 the two segment counts differ (the control: the check tells sums apart)."""
    g = torch.Generator().manual_seed(in_features)
    x = torch.randn(40, in_features, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(72, in_features, generator=g) / 8).to(DEVICE, dtype)
    bias = torch.randn(72, generator=g).to(DEVICE, dtype)
    assert tma_loads(x, weight) == tma
    outputs = {}
    for segments in (1, 3):
        def run(rows, persistent=True, segments=segments):
            return kernels.fixed_tile_matmul_triton(rows, weight, bias, SMALL_TILE, num_segments=segments,
                                                    split_across_programs=False, persistent=persistent,
                                                    max_programs=4)
        outputs[segments] = run(x)
        assert torch.equal(outputs[segments], run(x, persistent=False)), segments
        for rows in (1, 8, 17):
            assert torch.equal(run(x[:rows]), outputs[segments][:rows]), (segments, rows)
    if dtype == torch.float32:  # float16 outputs may round the difference away
        assert not torch.equal(outputs[1], outputs[3])
        torch.testing.assert_close(outputs[1], outputs[3])


def test_persistent_launch_runs_only_where_the_dispatch_measured_it(kernels):
    """Never on the CPU, nor for a config given, nor together with the split launch; its config
    keeps the table's block_k and split_k (the sum) with the persistent tile."""
    x, weight = torch.zeros(2048, 64), torch.zeros(96, 64)
    assert kernels.fixed_tile_matmul_launch(x, weight)[2] is False
    forced = kernels.fixed_tile_matmul_launch(x, weight, SMALL_TILE, persistent=True)
    assert forced == (SMALL_TILE, False, True)
    assert kernels.fixed_tile_matmul_launch(x, weight, SMALL_TILE)[2] is False
    with pytest.raises(ValueError, match="split_across_programs=True"):
        kernels.fixed_tile_matmul_launch(x, weight, split_across_programs=True, persistent=True)
    config = batch_invariant_persistent_config(TileConfig(block_n=32, block_k=32, split_k=5, block_m=16))
    assert config == TileConfig(block_n=256, block_k=32, split_k=5, block_m=128, num_warps=8, num_stages=4)


def test_norm_and_softmax_kernels_match_torch_per_row(kernels):
    g = torch.Generator().manual_seed(2)
    x, residual = torch.randn(2, 9, 96, generator=g).to(DEVICE), torch.randn(2, 9, 96, generator=g).to(DEVICE)
    weight, bias = torch.randn(96, generator=g).to(DEVICE), torch.randn(96, generator=g).to(DEVICE)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.rows_norm_triton(x, weight, 1e-6),
                               kernels.rows_norm_torch(x, weight, 1e-6), **close)
    torch.testing.assert_close(kernels.rows_norm_triton(x, weight, 1e-6, unit_offset=True),
                               kernels.rows_norm_torch(x, weight, 1e-6, unit_offset=True), **close)
    torch.testing.assert_close(kernels.rows_norm_triton(x, weight, 1e-5, bias=bias),
                               kernels.rows_norm_torch(x, weight, 1e-5, bias=bias), **close)
    normed, summed = kernels.rows_norm_triton(x, weight, 1e-6, residual=residual)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, kernels.rows_norm_torch(x + residual, weight, 1e-6), **close)
    assert torch.equal(kernels.rows_norm_triton(x[1, 3:4], weight, 1e-6, residual=residual[1, 3:4])[0],
                       normed[1, 3:4])
    logits = torch.randn(5, 9000, generator=g).to(DEVICE) * 4
    logits[2, :100] = float("-inf")
    for log in (True, False):
        full = kernels.softmax_triton(logits, log)
        torch.testing.assert_close(full, kernels.softmax_torch(logits, log), atol=1e-5, rtol=1e-5)
        assert torch.equal(kernels.softmax_triton(logits[3:4], log), full[3:4])


def test_matmul_segments_follow_the_weight_shape_alone():
    """Llama-3-8B's linears on 132 SMs: K cut so a row tile fills about one wave; the wide ones
    (gate_up, the LM head) need no cut. No row count enters."""
    assert BATCH_INVARIANT_TILE.block_m == 128 and BATCH_INVARIANT_TILE.split_k == 1
    shapes = {(6144, 4096): 3, (4096, 4096): 5, (28672, 4096): 1, (4096, 14336): 5, (128256, 4096): 1}
    for (n, k), splits in shapes.items():
        assert batch_invariant_splits(n, k, BATCH_INVARIANT_TILE, 132) == splits, (n, k)
    assert batch_invariant_splits(64, 64, BATCH_INVARIANT_TILE, 132) == 1


# ---- the engine -------------------------------------------------------------------------------------
def _outputs(llm, prompts, order):
    """{prompt index: (token ids, top-2 logprobs with the chosen one)} of the prompts run in ``order``."""
    outs = llm.generate([prompts[i] for i in order], PARAMS, use_tqdm=False)
    by_prompt = {}
    for i, out in zip(order, outs):
        c = out.outputs[0]
        by_prompt[i] = (c.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs])
    return by_prompt


def _differing_runs(llm, prompts, chunk_tokens: int, orders: tuple[str, ...] = ORDERS, hf_model=None):
    """Yield, as it runs them, the batch variants whose outputs are not bitwise the batch-1 ones:
    the batches of ``orders``, then the prefix cache (warm) and chunked prefill with a
    ``chunk_tokens`` budget (``list()`` runs them all; ``_any_differs`` stops at the first).
    With ``hf_model``, first "hf" where a batch-1 run's tokens are not HF's greedy ones."""
    llm.set_model_args(enable_prefix_caching=False, max_num_batched_tokens=None)
    alone = {i: _outputs(llm, [p], [0])[0] for i, p in enumerate(prompts)}
    if hf_model is not None and any(alone[i][0] != hf_greedy(hf_model, p, 4, eos_token_id=None)
                                    for i, p in enumerate(prompts)):  # PARAMS: 4 tokens, ignore_eos
        yield "hf"
    n = len(prompts)
    variants = {"all": list(range(n)), "reversed": list(range(n))[::-1], "pair": [1, 0],
                "shuffled": random.Random(0).sample(range(n), n)}
    for name in orders:
        order = variants[name]
        got = _outputs(llm, prompts, order)
        if any(got[i] != alone[i] for i in order):
            yield name
    llm.set_model_args(enable_prefix_caching=True)
    llm.reset_prefix_cache()
    _outputs(llm, prompts, list(range(n)))  # warms the cache: the second pass reads the prompts from it
    if _outputs(llm, prompts, list(range(n))[::-1]) != alone:
        yield "prefix_cache"
    llm.set_model_args(enable_prefix_caching=False, max_num_batched_tokens=chunk_tokens)
    if _outputs(llm, prompts, list(range(n))) != alone:
        yield "chunked_prefill"


def _any_differs(llm, prompts, chunk_tokens: int, orders: tuple[str, ...] = ORDERS) -> bool:
    """Whether some variant of ``_differing_runs`` differs, running only up to the first that does."""
    return next(_differing_runs(llm, prompts, chunk_tokens, orders), None) is not None


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    prefix = random_prompts(1, min_len=20, max_len=20, seed=7)[0]
    return [prefix + tail for tail in random_prompts(2, min_len=2, max_len=9, seed=8)] + random_prompts(
        3, min_len=4, max_len=30, seed=9)


def test_torch_backend_logprobs_are_bitwise_batch_invariant(tiny_llama, shared_prefix_prompts):
    """The torch backend on the CPU: every variant bitwise equal under the mode, and not without it."""
    with LLM(tiny_llama.path, attention_backend="torch", kv_cache_memory_bytes=KV_BYTES,
             batch_invariant=True) as llm:
        runs = _differing_runs(llm, shared_prefix_prompts, chunk_tokens=16, hf_model=tiny_llama.hf_model)
        assert list(runs) == []
        llm.set_model_args(batch_invariant=False)
        assert _any_differs(llm, shared_prefix_prompts, chunk_tokens=16)


def test_triton_backend_logprobs_are_bitwise_batch_invariant(tiny_llama, shared_prefix_prompts):
    """The Triton attention backend (interpreted): bitwise equal under the mode, and not without it."""
    prompts = shared_prefix_prompts[:3]
    with LLM(tiny_llama.path, attention_backend="triton", kv_cache_memory_bytes=KV_BYTES,
             batch_invariant=True, max_model_len=128) as llm:
        assert list(_differing_runs(llm, prompts, chunk_tokens=16, orders=("reversed",),
                                    hf_model=tiny_llama.hf_model)) == []
        llm.set_model_args(batch_invariant=False)
        assert _any_differs(llm, prompts, chunk_tokens=16, orders=("reversed",))


@pytest.mark.slow
def test_triton_kernels_logprobs_are_bitwise_batch_invariant(tiny_llama, shared_prefix_prompts, monkeypatch):
    """Every Triton kernel of the mode (attention, matmul, norms, log-softmax), interpreted on the
    CPU: bitwise equal alone, reversed, from the prefix cache and in chunks."""
    monkeypatch.setattr(batch_invariant, "TRITON_ON_CPU", True)
    with LLM(tiny_llama.path, attention_backend="triton", kv_cache_memory_bytes=KV_BYTES,
             batch_invariant=True, max_model_len=128) as llm:
        differing = _differing_runs(llm, shared_prefix_prompts[:3], chunk_tokens=16, orders=("reversed",),
                                    hf_model=tiny_llama.hf_model)
        assert list(differing) == []


# ---- settings, the repro check ------------------------------------------------------------------------
def test_batch_invariant_setting_flag_yaml_and_limits(tiny_llama, tmp_path):
    from pagedlab.cli.engine_args import CommandParser, add_engine_args, engine_kwargs
    from pagedlab.lab.spec import experiment_from_dict

    parser = CommandParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert engine_kwargs(parser.parse_args([]))["batch_invariant"] is False
    (tmp_path / "model").mkdir()
    spec = experiment_from_dict({"name": "x", "model": "model", "dataset": {"prompts": ["a"]},
                                 "engine": {"batch_invariant": True}}, tmp_path)
    assert spec.base["engine"] == {"batch_invariant": True}
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2).validate()
    with pytest.raises(ValueError, match="quantization='fp8'"):
        LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, quantization="fp8", batch_invariant=True)
    with LLM(tiny_llama.path, attention_backend="triton", kv_cache_memory_bytes=KV_BYTES,
             batch_invariant=True) as llm:
        info = llm.get_engine_info()
        assert info.resolved_settings()["batch_invariant"] is True
        assert not info.cascade_attention


def test_repro_batch_check_reports_same_with_zero_difference(tiny_llama):
    from pagedlab.lab import repro

    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, min_len=5, max_len=25, seed=11)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, batch_invariant=True) as llm:
        result = repro.batch_consistency(llm, prompts, max_tokens=4, chunk_tokens=8)
    assert result.verdict == "same", result.format()
    assert result.metrics["max_logprob_diff"] == 0.0
    assert result.params["batch_invariant"] is True and result.params["logprob_tolerance"] == 0.0
