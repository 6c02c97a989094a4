"""The dense 16-bit GEMV (``pagedlab.kernels.gemv``) against its torch reference, the launch
configs of the linear kernels (``gemv_configs``), and ``dense_linear``'s choice between cuBLAS
and the GEMV.

On a machine without CUDA the kernel runs under the Triton interpreter at small sizes;
TRITON_INTERPRET is set here, before the kernel modules are first imported.
"""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch
import torch.nn.functional as F


from pagedlab.kernels import gemv_configs
from pagedlab.kernels.gemv_configs import TileConfig, dense_gemv_config, row_bucket, splits_for
from pagedlab.quantization.linear_method import dense_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=2e-3),
             torch.bfloat16: dict(atol=1e-1, rtol=2e-2)}


@pytest.fixture(scope="module")
def gemv():
    pytest.importorskip("triton")
    return importlib.import_module("pagedlab.kernels.gemv")


def check_dense(gemv, rows, in_features, out_features, dtype, with_bias, config=None):
    key = repr((rows, in_features, out_features, dtype, config)).encode()
    gen = torch.Generator().manual_seed(zlib.crc32(key))
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    out = gemv.dense_gemv_triton(x.to(DEVICE), weight.to(DEVICE), None if bias is None else bias.to(DEVICE),
                                 config)
    expected = gemv.dense_gemv_torch(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.shape == (rows, out_features) and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, **TOLERANCE[dtype])
    return out


# (rows, config): block_m=0 multiplies on the CUDA cores, 16 through tl.dot; split_k > 1 cuts K
# into segments summed in-kernel. K=200 is not a multiple of block_k, N=50 leaves a partial tile.
DENSE_CASES = [
    (1, TileConfig(block_n=16, block_k=64, split_k=1)),
    (1, TileConfig(block_n=16, block_k=32, split_k=3)),
    (3, TileConfig(block_n=8, block_k=64, split_k=2)),
    (5, TileConfig(block_n=16, block_k=64, split_k=2, block_m=16)),
    (16, TileConfig(block_n=32, block_k=32, split_k=1, block_m=16)),
    # one row reading each next K step during this one's products (ONE_ROW_PREFETCH_STAGES)
    (1, TileConfig(block_n=16, block_k=64, split_k=1, num_stages=4)),
    (1, TileConfig(block_n=16, block_k=32, split_k=3, num_stages=4)),
    # a weight row a program, all of K in one masked step (Qwen3-30B-A3B's router line)
    (1, TileConfig(block_n=1, block_k=256, num_stages=3)),
    # tl.dot with the weight tile as A and the rows as B (swap_ab): a partial column tile of 64
    (1, TileConfig(block_n=16, block_k=32, split_k=3, block_m=16, swap_ab=True)),
    (5, TileConfig(block_n=32, block_k=64, block_m=16, swap_ab=True)),
    (16, TileConfig(block_n=64, block_k=32, split_k=2, block_m=16, swap_ab=True)),
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: f"M{c[0]}-{'dot' if c[1].block_m else 'cores'}"
                         f"{'-swap' if c[1].swap_ab else ''}-split{c[1].split_k}-stages{c[1].num_stages}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_dense_gemv_matches_torch(gemv, case, dtype):
    rows, config = case
    check_dense(gemv, rows, 200, 50, dtype, rows % 2 == 1, config)


@pytest.mark.parametrize("rows", [1, 8])
def test_dense_gemv_bfloat16_and_default_config(gemv, rows):
    check_dense(gemv, rows, 256, 48, torch.bfloat16, True)


def test_dense_gemv_is_deterministic(gemv):
    config = TileConfig(block_n=16, block_k=32, split_k=4)
    first = check_dense(gemv, 2, 256, 40, torch.float32, False, config)
    assert torch.equal(first, check_dense(gemv, 2, 256, 40, torch.float32, False, config))
    assert not gemv._counters[first.device].any()


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("fp8", [False, True])
def test_one_row_prefetch_gives_the_plain_loops_result(gemv, fp8, split_k):
    """Prefetching moves the loads only: the same products in the same order, so in the
    interpreter the same bits (FP8 reads pairs of bytes, each lane's sum in the same order, the
    lanes summed in another: fp32 rounding apart; so may a GPU's layouts); K=1100 is ragged
    against block_k=128 (and the segments' ends), N=37 against block_n=8."""
    from pagedlab.kernels.fp8_linear import fp8_gemv_triton, quantize_fp8_per_token_triton
    from pagedlab.quantization.fp8 import fp8_linear_torch, quantize_fp8_per_row

    gen = torch.Generator().manual_seed(1100 + split_k + fp8)
    weight, x = torch.randn(37, 1100, generator=gen), torch.randn(1, 1100, generator=gen)
    plain = TileConfig(block_n=8, block_k=128, split_k=split_k, num_stages=3)
    prefetch = TileConfig(block_n=8, block_k=128, split_k=split_k, num_stages=gemv.ONE_ROW_PREFETCH_STAGES)
    if fp8:
        values, scale = quantize_fp8_per_row(weight)
        q, q_scale = quantize_fp8_per_token_triton(x.to(DEVICE))
        outs = [fp8_gemv_triton(q, q_scale, values.to(DEVICE), scale.to(DEVICE), None, torch.float32, c).cpu()
                for c in (plain, prefetch)]
        # both quantize x alike (test_fp8_kernels), and E4M3 products are exact in float32: only
        # the order of the sums differs
        torch.testing.assert_close(outs[1], fp8_linear_torch(x, values, scale), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-5)
    else:
        outs = [gemv.dense_gemv_triton(x.to(DEVICE), weight.to(DEVICE), None, c).cpu()
                for c in (plain, prefetch)]
        torch.testing.assert_close(outs[1], x @ weight.T, **TOLERANCE[torch.float32])
        if DEVICE == "cpu":
            assert torch.equal(outs[0], outs[1])


def test_dense_gemv_rejects_what_it_cannot_run(gemv):
    weight = torch.zeros(8, 32)
    with pytest.raises(ValueError, match="x has 16 features, the weight 32 inputs"):
        gemv.dense_gemv_triton(torch.zeros(1, 16), weight)
    with pytest.raises(ValueError, match=r"x dtype torch\.float16 with weight dtype torch\.float32"):
        gemv.dense_gemv_triton(torch.zeros(1, 32, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match="17 rows is over the GEMV's 16"):
        gemv.dense_gemv_triton(torch.zeros(17, 32), weight)
    prefetch = TileConfig(block_n=8, block_k=32, num_stages=gemv.ONE_ROW_PREFETCH_STAGES)
    fp8 = torch.zeros(8, 34).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="K=33 and the weight's row stride 34 must be even"):
        gemv.launch_dense_gemv(fp8[:1, :33], fp8[:, :33], None, torch.empty(1, 8), prefetch,
                               torch.ones(1), torch.ones(8))
    with pytest.raises(ValueError, match="split_k=0"):
        gemv.dense_gemv_triton(torch.zeros(1, 32), weight, None, TileConfig(block_n=8, block_k=32, split_k=0))


def test_k_segments_cover_k_in_whole_steps_without_empty_segments(gemv):
    for in_features, block_k, split_k in [(4096, 128, 16), (4096, 128, 5), (200, 64, 8), (14336, 128, 200)]:
        per_split, segments = gemv.k_segments(in_features, block_k, split_k)
        assert per_split % block_k == 0 and segments <= split_k
        assert (segments - 1) * per_split < in_features <= segments * per_split


# --- the configs --------------------------------------------------------------------------------------


def test_row_buckets_and_splits():
    assert [row_bucket(r) for r in (1, 2, 3, 5, 16, 17, 200, 5000)] == [1, 2, 4, 8, 16, 32, 256, 256]
    # 16 column tiles on 132 SMs: two waves need 17 segments; never more than the K steps
    assert splits_for(16, 32, 132) == 17 and splits_for(16, 8, 132) == 8 and splits_for(1000, 32, 132) == 1


def test_dense_gemv_table_decides(monkeypatch):
    assert dense_gemv_config(1, 4096, 4096) == gemv_configs.DENSE_GEMV_CONFIGS[(1, 4096, 4096)]
    monkeypatch.setattr(gemv_configs, "DENSE_GEMV_CONFIGS", {})
    assert dense_gemv_config(1, 4096, 4096) is None  # nothing listed: cuBLAS
    config = TileConfig(block_n=16, block_k=256, split_k=8)
    monkeypatch.setitem(gemv_configs.DENSE_GEMV_CONFIGS, (4, 4096, 4096), config)
    assert dense_gemv_config(3, 4096, 4096) == config and dense_gemv_config(4, 4096, 4096) == config
    assert dense_gemv_config(2, 4096, 4096) is None and dense_gemv_config(3, 4096, 2048) is None
    assert dense_gemv_config(17, 4096, 4096) is None


def test_awq_table_entry_wins_over_the_default(monkeypatch):
    monkeypatch.setattr(gemv_configs, "AWQ_CONFIGS", {})
    config = TileConfig(block_n=128, block_k=64, split_k=4, block_m=16)
    monkeypatch.setitem(gemv_configs.AWQ_CONFIGS, (16, 6144, 4096, 128), config)
    assert gemv_configs.awq_config(9, 6144, 4096, 128, 132) == config
    assert gemv_configs.awq_config(8, 6144, 4096, 128, 132) == gemv_configs.default_awq_config(8, 6144, 4096,
                                                                                               128, 132)
    # more rows: the GEMM only where listed, else None (dequantize, then cuBLAS)
    gemm = TileConfig(block_n=128, block_k=64, block_m=64, num_stages=3)
    monkeypatch.setitem(gemv_configs.AWQ_CONFIGS, (64, 6144, 4096, 128), gemm)
    assert gemv_configs.awq_config(40, 6144, 4096, 128, 132) == gemm
    assert gemv_configs.awq_config(65, 6144, 4096, 128, 132) is None


def test_fp8_gemv_runs_only_listed_shapes(monkeypatch):
    monkeypatch.setattr(gemv_configs, "FP8_GEMV_CONFIGS", {})
    assert gemv_configs.fp8_gemv_config(1, 6144, 4096) is None
    config = TileConfig(block_n=8, block_k=1024)
    monkeypatch.setitem(gemv_configs.FP8_GEMV_CONFIGS, (1, 6144, 4096), config)
    assert gemv_configs.fp8_gemv_config(1, 6144, 4096) == config
    assert gemv_configs.fp8_gemv_config(2, 6144, 4096) is None  # another row bucket: _scaled_mm
    assert gemv_configs.fp8_gemv_config(17, 6144, 4096) is None


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64, 256])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_default_configs_are_runnable(rows, group_size):
    for out_features, in_features in [(6144, 4096), (4096, 14336), (2048, 2048), (128256, 4096)]:
        config = gemv_configs.default_awq_config(rows, out_features, in_features, group_size, 132)
        config.check(rows, gemv=rows <= gemv_configs.GEMV_MAX_ROWS)
        if config.block_m:  # tl.dot: a K step within one group
            assert group_size % config.block_k == 0
        else:  # CUDA cores, up to 4 rows: whole K steps, K split only where the column tiles are few
            assert rows <= gemv_configs.AWQ_CUDA_CORE_DEFAULT_ROWS and in_features % config.block_k == 0
            assert config.split_k == gemv_configs.splits_for(-(-out_features // config.block_n),
                                                             in_features // config.block_k, 132)
        if rows <= 16:
            dense = gemv_configs.default_dense_gemv_config(rows, out_features, in_features, 132)
            dense.check(rows, gemv=True)


def test_dense_linear_is_f_linear_off_cuda(monkeypatch):
    monkeypatch.setitem(gemv_configs.DENSE_GEMV_CONFIGS, (1, 8, 16), TileConfig(block_n=8, block_k=16))
    x, weight, bias = torch.randn(1, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(dense_linear(x, weight, bias), F.linear(x, weight, bias))


# --- real sizes on the GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("out_features, in_features", [(6144, 4096), (4096, 14336), (128256, 4096)])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["default", "swapped"])
def test_dense_linear_takes_the_tabled_gemv_on_gpu(gemv, monkeypatch, rows, out_features, in_features,
                                                   swap_ab):
    """With a table entry (the default tile, or a swapped tl.dot tile: the weight tile as wgmma's
    A), dense_linear runs the Triton GEMV (eagerly and from a CUDA graph, replayed twice) and
    matches F.linear at Llama-3-8B sizes in bf16."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    weight = (torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02).bfloat16()
    x = torch.randn(rows, in_features, device="cuda", generator=gen).bfloat16()
    config = gemv_configs.default_dense_gemv_config(rows, out_features, in_features, gemv.num_sms(x.device))
    if swap_ab:
        config = TileConfig(block_n=64, block_k=256, split_k=3, block_m=16, num_stages=3, swap_ab=True)
    key = (row_bucket(rows), out_features, in_features)
    monkeypatch.setitem(gemv_configs.DENSE_GEMV_CONFIGS, key, config)
    calls, kernel = [], gemv.dense_gemv_triton
    monkeypatch.setattr(gemv, "dense_gemv_triton", lambda *args: calls.append(args) or kernel(*args))
    out = dense_linear(x, weight)
    assert calls and calls[0][3] == config, "dense_linear did not take the tabled GEMV"
    for _ in range(20):  # the split-K sum: same bits whichever segment finishes last
        assert torch.equal(dense_linear(x, weight), out)
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), **TOLERANCE[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dense_linear(x, weight)
    for _ in range(2):
        captured.zero_()
        graph.replay()
        torch.testing.assert_close(captured, out, atol=0, rtol=0)


def test_pdl_launch_on_hopper_by_default_and_off_when_switched_off(monkeypatch):
    from pagedlab.kernels import pdl
    monkeypatch.setattr(pdl, "_device_supports_pdl", lambda index: index == 0)
    monkeypatch.delenv("PAGEDLAB_PDL", raising=False)
    assert pdl.pdl_launch(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}
    assert pdl.pdl_launch(torch.device("cuda", 1)) == {"PDL": False}
    monkeypatch.setenv("PAGEDLAB_PDL", "1")
    assert pdl.pdl_launch(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("PAGEDLAB_PDL", "0")
    assert pdl.pdl_launch(torch.device("cuda", 0)) == {"PDL": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_gemv_chain_in_a_cuda_graph_reads_each_input_after_it_is_written(gemv, monkeypatch):
    """Eight layers of Llama-3-8B's batch-1 linears (tabled GEMVs, PDL-launched on Hopper), each fed
    the previous output, captured in one graph: every output, poisoned before the replay, equals
    the float32 product of the input it should have read (an early read would give NaN or stale
    values)."""
    from pagedlab.kernels.pdl import pdl_enabled
    monkeypatch.setenv("PAGEDLAB_PDL", "1")
    if torch.cuda.get_device_capability()[0] >= 9:
        assert pdl_enabled(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
               for _ in range(8) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))]
    assert all(dense_gemv_config(1, *w.shape) for w in weights), "the chain must run the tabled GEMVs"
    x0 = torch.randn(1, 4096, device="cuda", generator=gen).bfloat16()

    def chain():
        outputs, x = [], x0
        for weight in weights:
            x = dense_linear(x[:, :weight.shape[1]], weight)
            outputs.append(x)
        return outputs
    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = chain()
    for out in outputs:
        out.fill_(float("nan"))
    graph.replay()
    for x, weight, out in zip([x0, *outputs[:-1]], weights, outputs, strict=True):
        expected = x[:, :weight.shape[1]].float() @ weight.float().T
        torch.testing.assert_close(out.float(), expected, **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", DENSE_CASES[:6], ids=lambda case: f"{case}")
def test_gated_gemv_writes_silu_and_mul_of_the_plain_gemv(gemv, case, dtype):
    """``gated``: the GEMV writes ``silu(gate) * up`` of its two output halves, from the gate and
    up it would write (``gated_tolerance``: within the GEMV's own tolerance and one rounding)."""
    from conftest import gated_tolerance
    from pagedlab.layers.activation import silu_and_mul

    rows, config = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, dtype)).encode()))
    x = torch.randn(rows, 200, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(100, 200, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(100, generator=gen).to(dtype).to(DEVICE)
    out = gemv.dense_gemv_triton(x, weight, bias, config, gated=True)
    expected = silu_and_mul(gemv.dense_gemv_triton(x, weight, bias, config).float()).to(dtype)
    assert out.shape == (rows, 50)
    torch.testing.assert_close(out, expected, **gated_tolerance(dtype))
