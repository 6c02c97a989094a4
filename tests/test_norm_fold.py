"""The RMSNorm folded into the GEMV after it (``pagedlab.kernels.norm_fold``): the reference
against the norm module's own arithmetic, and the folding GEMV kernels against the norm then the
GEMV's torch reference, on fresh random inputs (under the Triton interpreter without CUDA)."""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch

from pagedlab.kernels import norm_fold
from pagedlab.kernels.gemv_configs import TileConfig
from pagedlab.kernels.norm_fold import FoldedRMSNorm
from pagedlab.layers.norm import add_rms_norm, rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# the GEMV's products of float32 norm inputs against the reference's products of the rounded
# norm output: one rounding of the input apart in 16 bits
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=5e-3)}


@pytest.fixture(scope="module")
def gemv():
    pytest.importorskip("triton")
    return importlib.import_module("pagedlab.kernels.gemv")


def random_fold(rows: int, features: int, dtype: torch.dtype, residual: bool, normed: bool, key: str):
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    x = torch.randn(rows, features, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(rows, features, generator=gen).to(dtype).to(DEVICE) if residual else None
    weight = (1 + 0.5 * torch.randn(features, generator=gen)).to(dtype).to(DEVICE)
    return FoldedRMSNorm(x, res, weight, EPS, torch.empty_like(x) if residual else None,
                         torch.empty_like(x) if normed else None)


def fresh_buffers(fold: FoldedRMSNorm) -> FoldedRMSNorm:
    def empty(t):
        return None if t is None else torch.full_like(t, float("nan"))

    return FoldedRMSNorm(fold.x, fold.residual, fold.weight, fold.eps, empty(fold.summed), empty(fold.normed))


@pytest.mark.parametrize("residual", [False, True])
def test_materialize_is_the_norm_modules_arithmetic(residual):
    fold = random_fold(3, 96, torch.bfloat16, residual, True, f"materialize {residual}")
    normed = fold.materialize()
    if residual:
        expected, summed = add_rms_norm(fold.x, fold.residual, fold.weight, EPS)
        assert torch.equal(fold.summed, summed)
    else:
        expected = rms_norm(fold.x, fold.weight, EPS)
    assert torch.equal(normed, expected) and torch.equal(fold.normed, expected)


# (rows, config): one row on the CUDA cores (two K steps: the squares summed in the loop; four:
# the row read first; PREFETCH; K split), several rows on the CUDA cores, tl.dot tiles plain and
# swapped; K=200 is not a whole number of steps
FOLD_CASES = [
    (1, TileConfig(block_n=16, block_k=128)),
    (1, TileConfig(block_n=16, block_k=64)),
    (1, TileConfig(block_n=8, block_k=32, split_k=3)),
    (1, TileConfig(block_n=16, block_k=64, num_stages=4)),
    (1, TileConfig(block_n=1, block_k=256, num_stages=3)),
    (3, TileConfig(block_n=8, block_k=64, split_k=2)),
    (5, TileConfig(block_n=16, block_k=64, split_k=2, block_m=16)),
    (2, TileConfig(block_n=16, block_k=32, split_k=3, block_m=16, swap_ab=True)),
]


@pytest.mark.parametrize("residual,normed", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", FOLD_CASES, ids=lambda case: f"{case}")
def test_dense_gemv_folds_the_norm(gemv, case, dtype, residual, normed):
    rows, config = case
    fold = random_fold(rows, 200, dtype, residual, normed, f"{case} {dtype} {residual} {normed}")
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(50, 200, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(50, generator=gen).to(dtype).to(DEVICE)
    folded = fresh_buffers(fold)
    out = gemv.dense_gemv_triton(folded, weight, bias, config)
    reference = fresh_buffers(fold)
    expected = gemv.dense_gemv_torch(reference.materialize().float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    if residual:
        assert torch.equal(folded.summed, reference.summed)
    if normed:  # the 1/rms summed in another order: an ulp of the output at most
        torch.testing.assert_close(folded.normed, reference.normed, atol=0, rtol=2 ** -9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_column_tile_over_two_k_steps_writes_the_whole_residual(gemv, dtype):
    """A one-row fold whose weight is one column tile (a router of 8 experts) over two K steps:
    the kernel sums the squares in its loop only where a program stands for each step's write of
    ``x + residual``; here it reads the row first, and ``summed`` is the norm's in full."""
    fold = random_fold(1, 200, dtype, True, True, f"one tile {dtype}")
    weight = torch.randn(8, 200, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    folded, reference = fresh_buffers(fold), fresh_buffers(fold)
    out = gemv.dense_gemv_triton(folded, weight, None, TileConfig(block_n=16, block_k=128))
    expected = gemv.dense_gemv_torch(reference.materialize().float(), weight.float())
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    assert torch.equal(folded.summed, reference.summed)
    torch.testing.assert_close(folded.normed, reference.normed, atol=0, rtol=2 ** -9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [(3, TileConfig(block_n=8, block_k=256, split_k=2)),
                                  (16, TileConfig(block_n=16, block_k=128, block_m=16))],
                         ids=lambda case: f"{case}")
def test_several_rows_fold_k_in_chunks(gemv, case, dtype):
    """Several rows read K in chunks of ``FOLD_ROWS_CHUNK`` (K=1100: whole chunks and a ragged
    one), the summed and normalized inputs written by one program: as the norm then the GEMV."""
    from pagedlab.kernels.norm_fold_kernels import FOLD_ROWS_CHUNK

    rows, config = case
    chunk = FOLD_ROWS_CHUNK.value
    assert chunk * 2 < 1100 and 1100 % chunk
    fold = random_fold(rows, 1100, dtype, True, True, f"chunks {case} {dtype}")
    weight = torch.randn(40, 1100, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE) / 30
    folded, reference = fresh_buffers(fold), fresh_buffers(fold)
    out = gemv.dense_gemv_triton(folded, weight, None, config)
    expected = gemv.dense_gemv_torch(reference.materialize().float(), weight.float())
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    assert torch.equal(folded.summed, reference.summed)
    torch.testing.assert_close(folded.normed, reference.normed, atol=0, rtol=2 ** -9)


def test_fold_refuses_buffers_unlike_x(gemv):
    fold = random_fold(1, 64, torch.float32, True, False, "refuses")
    weight = torch.randn(16, 64, device=DEVICE)
    no_summed = FoldedRMSNorm(fold.x, fold.residual, fold.weight, EPS, None, None)
    with pytest.raises(ValueError, match="needs the summed buffer"):
        gemv.dense_gemv_triton(no_summed, weight, None, TileConfig(block_n=16, block_k=64))
    halves = FoldedRMSNorm(fold.x, fold.residual.half(), fold.weight, EPS, fold.summed, None)
    with pytest.raises(ValueError, match=r"residual .* must match x's"):
        gemv.dense_gemv_triton(halves, weight, None, TileConfig(block_n=16, block_k=64))


@pytest.fixture(scope="module")
def w4a16():
    pytest.importorskip("triton")
    return importlib.import_module("pagedlab.kernels.w4a16")


# (rows, config): one row with and without the next step's prefetch, K split; several rows on the
# CUDA cores; tl.dot; 20 rows, past the GEMV, multiply the materialized norm on the GEMM
AWQ_FOLD_CASES = [
    (1, TileConfig(block_n=8, block_k=64, split_k=3)),
    (1, TileConfig(block_n=16, block_k=128, num_stages=1)),
    (3, TileConfig(block_n=16, block_k=32, split_k=2)),
    (5, TileConfig(block_n=32, block_k=32, split_k=2, block_m=16)),
    (20, TileConfig(block_n=32, block_k=32, block_m=16)),
]


@pytest.mark.parametrize("residual,normed", [(True, False), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", AWQ_FOLD_CASES, ids=lambda case: f"{case}")
def test_awq_gemv_folds_the_norm(w4a16, case, dtype, residual, normed):
    from pagedlab.quantization.awq import quantize_awq, repack_awq, repacked_linear_torch

    rows, config = case
    fold = random_fold(rows, 256, dtype, residual, normed, f"awq {case} {dtype} {residual} {normed}")
    dense = torch.randn(256, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    awq = [t.to(DEVICE) for t in repack_awq(*quantize_awq(dense.to(dtype), 32), 32)]
    folded = fresh_buffers(fold)
    out = w4a16.awq_linear_triton(folded, *awq, 32, None, config)
    reference = fresh_buffers(fold)
    qweight, qzeros, scales = awq
    expected = repacked_linear_torch(reference.materialize().float(), qweight, qzeros, scales.float(), 32)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    if residual:
        assert torch.equal(folded.summed, reference.summed)
    if normed:
        torch.testing.assert_close(folded.normed, reference.normed, atol=0, rtol=2 ** -9)


GREEDY_TOKENS = 12


def any_gemv_shape(rows: int, out_features: int, in_features: int) -> TileConfig | None:
    """``dense_gemv_config`` for every shape up to ``GEMV_MAX_ROWS`` rows (the table lists real
    shapes only), an H200's SM count."""
    from pagedlab.kernels.gemv_configs import GEMV_MAX_ROWS, default_dense_gemv_config

    return default_dense_gemv_config(rows, out_features, in_features, 132) if rows <= GEMV_MAX_ROWS else None


def _greedy(path, prompts, **engine_args):
    from pagedlab import LLM, SamplingParams

    with LLM(path, dtype="float32", kv_cache_memory_bytes=32 << 20, **engine_args) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_folded_norms_hand_the_residual_on_through_the_model(tiny_models, monkeypatch, arch):
    """Every consumer told to fold at every decode batch (CPU: the linear materializes the norm, writing
    the residual buffer the norm returned, and the MoE block's normalized copy): HF's tokens."""
    from conftest import hf_greedy, random_prompts
    from pagedlab.layers.linear import OutputShardedLinear
    from pagedlab.models.mixtral import SparseMoeBlock

    materialized = []
    original = FoldedRMSNorm.materialize
    monkeypatch.setattr(FoldedRMSNorm, "materialize", lambda self: materialized.append(1) or original(self))
    monkeypatch.setattr(norm_fold, "FOLD_MAX_ROWS", 16)  # every decode batch of this test
    monkeypatch.setattr(OutputShardedLinear, "folds_norm", lambda self, x: True)
    monkeypatch.setattr(SparseMoeBlock, "folds_norm", lambda self, x: True)
    tiny = tiny_models(arch)
    prompts = random_prompts(6, max_len=40, seed=3)
    assert _greedy(tiny.path, prompts) == [hf_greedy(tiny.hf_model, p, GREEDY_TOKENS) for p in prompts]
    assert materialized


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_folding_gemvs_give_hf_tokens_on_gpu(tiny_models, monkeypatch, arch):
    """The tiny models' linears on the Triton GEMV at every decode batch (the table lists real
    shapes only), so that their norms fold: HF float32's tokens through CUDA graphs."""
    from conftest import hf_greedy, random_prompts
    from pagedlab.kernels import gemv
    from pagedlab.quantization import linear_method

    folded = []
    launch = gemv.dense_gemv_triton
    monkeypatch.setattr(linear_method, "dense_gemv_config", any_gemv_shape)
    monkeypatch.setattr(norm_fold, "FOLD_MAX_ROWS", 16)
    monkeypatch.setattr(gemv, "dense_gemv_triton",
                        lambda x, *args, **kwargs: folded.append(isinstance(x, FoldedRMSNorm))
                        or launch(x, *args, **kwargs))
    tiny = tiny_models(arch)
    prompts = random_prompts(8, max_len=60, seed=4)
    assert _greedy(tiny.path, prompts) == [hf_greedy(tiny.hf_model, p, GREEDY_TOKENS) for p in prompts]
    assert any(folded)


def test_fold_norms_leaves_the_module_tree_alone():
    """Every Llama-family norm folds into its consumer, and the model's parameters and modules
    stay as they were (the norm holds its consumer's method, not the module)."""
    from conftest import tiny_config
    from pagedlab.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config("llama"), max_position=64)
    keys, modules = list(model.state_dict()), [name for name, _ in model.named_modules()]
    assert model.fold_norms() == 2 * len(model.model.layers)
    assert list(model.state_dict()) == keys and [name for name, _ in model.named_modules()] == modules


def test_gated_gate_up_gemv_gives_hf_tokens_through_a_model(tiny_models, monkeypatch):
    """Every one-row gate_up projection on the gated GEMV (the interpreter on the CPU: the dense
    GEMV told to run every shape): HF float32's tokens."""
    from conftest import hf_greedy, random_prompts
    from pagedlab.kernels import gemv
    from pagedlab.quantization import linear_method

    gated = []
    launch = gemv.dense_gemv_triton
    monkeypatch.setattr(linear_method.DenseLinearMethod, "fuses_silu",
                        lambda self, layer, x: x.numel() == x.shape[-1])
    monkeypatch.setattr(linear_method, "dense_gemv_config", any_gemv_shape)
    monkeypatch.setattr(gemv, "dense_gemv_triton",
                        lambda *args, **kwargs: gated.append(kwargs.get("gated")) or launch(*args, **kwargs))
    tiny = tiny_models("llama")
    prompts = random_prompts(2, max_len=20, seed=5)
    outs = [_greedy(tiny.path, [p]) for p in prompts]  # one request at a time: one-row decode steps
    assert [o[0] for o in outs] == [hf_greedy(tiny.hf_model, p, GREEDY_TOKENS) for p in prompts]
    assert any(gated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", AWQ_FOLD_CASES[:4], ids=lambda case: f"{case}")
def test_gated_awq_gemv_writes_silu_and_mul_of_the_plain_gemv(w4a16, case, dtype):
    from conftest import gated_tolerance
    from pagedlab.layers.activation import silu_and_mul
    from pagedlab.quantization.awq import quantize_awq, repack_awq

    rows, config = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("gated awq", case, dtype)).encode()))
    x = torch.randn(rows, 256, generator=gen).to(dtype).to(DEVICE)
    dense = torch.randn(256, 2 * 64, generator=gen) * 0.05
    awq = [t.to(DEVICE) for t in repack_awq(*quantize_awq(dense.to(dtype), 32), 32)]
    out = w4a16.awq_linear_triton(x, *awq, 32, None, config, gated=True)
    expected = silu_and_mul(w4a16.awq_linear_triton(x, *awq, 32, None, config).float()).to(dtype)
    assert out.shape == (rows, 64)
    torch.testing.assert_close(out, expected, **gated_tolerance(dtype))
