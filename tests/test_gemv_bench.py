"""``benchmarks/gemv_bench.py`` on the CPU: how many weight copies its decode-like timing
(``gpu_timing``) cycles through (over twice the L2, at least two, the byte cap), the calls in its
graph, the candidate sweeps with the one-row no-split tiles (each accepted by its kernel and run
under the interpreter against torch), the correctness gate of the sweep, one batch through the
whole measurement path (the GPU timing replaced by a fake clock), and the decode-step sums.
``-m gpu``: the timing itself (no faster than HBM) and one o projection through the whole path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import test_kernels  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)
import torch

from pagedlab.kernels import gemv_configs
from pagedlab.kernels.gemv_configs import TileConfig
from pagedlab.kernels.w4a16 import check_awq_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
gemv_bench = pytest.importorskip("gemv_bench")
gpu_timing = pytest.importorskip("gpu_timing")

H200_L2 = 50 << 20
H200_SMS = 132
MIB = 1 << 20
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K) of Llama-3-8B's linears on one GPU and one rank of two, and Gemma-2-9B's LM head.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (3072, 4096),
          (4096, 2048), (14336, 4096), (4096, 7168), (256000, 3584)]


@pytest.mark.parametrize(("copy_bytes", "expected"), [
    (6144 * 4096 * 2, 3),  # qkv bf16, 48 MiB
    (4096 * 4096 * 2, 4),  # o bf16, 32 MiB
    (4096 * 4096, 7),  # o FP8, 16 MiB
    (28672 * 4096 * 2, 2),  # gate_up bf16, 224 MiB: two copies at least
    (256000 * 3584 * 2, 2),  # Gemma-2-9B's LM head: two copies, 3.4 GiB, under the cap
])
def test_operand_copies_for_h200_shapes(copy_bytes, expected):
    assert gpu_timing.operand_copies(copy_bytes, H200_L2) == expected


@pytest.mark.parametrize("copy_bytes", [1, 1000, 3 * MIB, 33 * MIB, 50 * MIB, 51 * MIB, 99 * MIB, 100 * MIB,
                                        101 * MIB, 700 * MIB])
def test_operand_copies_stream_every_read_from_hbm_and_are_the_fewest(copy_bytes):
    copies = gpu_timing.operand_copies(copy_bytes, H200_L2)
    assert copies >= 2 and copies * copy_bytes > 2 * H200_L2
    # between two reads of one copy the others pass more bytes than the L2 holds
    assert (copies - 1) * copy_bytes > H200_L2
    assert copies == 2 or (copies - 1) * copy_bytes <= 2 * H200_L2


def test_operand_copies_keep_to_the_byte_cap():
    assert gpu_timing.COPY_CAP_BYTES == 4 << 30
    # two copies of 2.5 GiB pass the cap: one, as it alone is over twice the L2
    assert gpu_timing.operand_copies(5 << 29, H200_L2) == 1
    assert gpu_timing.operand_copies(10 * MIB, H200_L2, cap_bytes=200 * MIB) == 11
    with pytest.raises(ValueError, match="do not fit in the cap"):
        gpu_timing.operand_copies(10 * MIB, H200_L2, cap_bytes=100 * MIB)
    with pytest.raises(ValueError, match="do not fit in the cap"):
        gpu_timing.operand_copies(5 << 30, H200_L2)
    with pytest.raises(ValueError, match="copy_bytes=0"):
        gpu_timing.operand_copies(0, H200_L2)


@pytest.mark.parametrize(("copies", "calls"), [(1, 32), (2, 32), (3, 33), (7, 35), (40, 40)])
def test_graph_calls_are_whole_rounds_of_at_least_32(copies, calls):
    assert gpu_timing.graph_calls(copies) == calls
    with pytest.raises(ValueError, match="copies=0"):
        gpu_timing.graph_calls(0)


def test_operand_sets_are_equal_copies_in_their_own_memory():
    weight, scale = torch.randn(10, 25), torch.randn(10, 1)  # 1,040 bytes a set
    sets = gpu_timing.operand_sets((weight, scale), l2_bytes=1500)
    assert len(sets) == 3 and sets[0][0] is weight and sets[0][1] is scale
    pointers = {t.data_ptr() for s in sets for t in s}
    assert len(pointers) == 6
    for copy_weight, copy_scale in sets[1:]:
        assert torch.equal(copy_weight, weight) and torch.equal(copy_scale, scale)


def _one_row(configs):
    return [c for c in configs if c.block_m == 0 and c.split_k == 1 and c.num_stages == 3]


@pytest.mark.parametrize("fp8", [False, True])
def test_one_row_candidates_join_the_sweep_at_one_row_only(fp8):
    block_ks = {256, 512, 1024} | ({2048} if fp8 else set())
    for n, k in SHAPES:
        one = gemv_bench.dense_candidates(1, n, k, H200_SMS, fp8=fp8)
        four = gemv_bench.dense_candidates(4, n, k, H200_SMS, fp8=fp8)
        assert len(one) == len(set(one)) and len(four) == len(set(four))
        tiles = _one_row(one)
        assert {(c.block_n, c.block_k) for c in tiles} == {(n_, k_) for n_ in (4, 8, 16) for k_ in block_ks}
        assert all(c.num_warps == 4 for c in tiles) and not _one_row(four)
        # the earlier sweep is kept: at one row it is the four-row sweep plus one-row tiles
        assert set(four) - {four[0]} <= set(one)
        sixteen = gemv_bench.dense_candidates(16, n, k, H200_SMS, fp8=fp8)
        for rows, configs in ((1, one), (4, four), (16, sixteen)):
            for config in configs:
                config.check(rows, gemv=True)


@pytest.mark.parametrize("fp8", [False, True])
def test_one_row_sweep_adds_prefetch_to_the_tiles_of_at_most_64_bytes_a_thread(fp8):
    """The prefetching variants (one row only) are the plain one-row tiles of at most 64 weight
    bytes a thread a step (8 KB a program: 4096 bf16 or 8192 FP8 weights), with only num_stages
    changed."""
    from pagedlab.kernels.gemv import ONE_ROW_PREFETCH_STAGES

    for n, k in SHAPES:
        one = gemv_bench.dense_candidates(1, n, k, H200_SMS, fp8=fp8)
        prefetch = [c for c in one if c.num_stages == ONE_ROW_PREFETCH_STAGES]
        most = 8192 if fp8 else 4096
        expected = {(c.block_n, c.block_k) for c in _one_row(one) if c.block_n * c.block_k <= most}
        assert {(c.block_n, c.block_k) for c in prefetch} == expected
        assert {(4, 1024), (8, 512), (16, 256), (4, 512)} <= expected
        assert ((8, 1024) in expected) == fp8 and (16, 1024) not in expected
        assert all(c.block_m == 0 and c.split_k == 1 and c.num_warps == 4 for c in prefetch)
        for rows in (4, 16):
            assert all(c.num_stages < ONE_ROW_PREFETCH_STAGES
                       for c in gemv_bench.dense_candidates(rows, n, k, H200_SMS, fp8=fp8))


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (4096, 7168)])
@pytest.mark.parametrize("group_size", [32, 128])
def test_awq_cuda_core_tiles_hold_8_to_32_words_a_thread_and_split_where_tiles_are_few(n, k, group_size):
    one = gemv_bench.awq_candidates(1, n, k, group_size, H200_SMS)
    assert one[0] == gemv_configs.default_awq_config(1, n, k, group_size, H200_SMS)
    tiles = _one_row(one)
    shapes = {(c.block_n, c.block_k, c.num_warps) for c in tiles}
    assert shapes >= {(8, 1024, 4), (16, 1024, 4), (32, 512, 4)}
    assert ((8, 2048, 4) in shapes) == (k % 2048 == 0) and ((4, 4096, 8) in shapes) == (k % 4096 == 0)
    for config in tiles:
        words = config.block_n * config.block_k // 8 // (32 * config.num_warps)
        assert k % config.block_k == 0 and 8 <= words <= 32
    few = {c.block_n for c in tiles if -(-n // c.block_n) < 2 * H200_SMS}  # under two programs an SM
    assert {c.block_n for c in one if c.block_m == 0 and c.split_k > 1} == few
    assert few == ({16, 32} if n == 4096 else {32} if n == 6144 else set())
    for rows in (2, 8):  # the same CUDA-core tiles, beside the tl.dot ones
        found = gemv_bench.awq_candidates(rows, n, k, group_size, H200_SMS)
        assert set(_one_row(found)) == set(_one_row(one)) and any(c.block_m == 16 for c in found)
    assert not _one_row(gemv_bench.awq_candidates(16, n, k, group_size, H200_SMS))
    for rows in (1, 2, 8, 16, 64):
        for config in gemv_bench.awq_candidates(rows, n, k, group_size, H200_SMS):
            check_awq_config(config, rows, group_size)


@pytest.mark.parametrize("rows", [17, 64, 256])
def test_awq_gemm_candidates_sweep_both_forms_in_at_most_40(rows):
    """Over GEMV_MAX_ROWS rows: the plain and the swapped GEMM tiles (block_n 64 or 128, the
    rows' tiles no larger than max(64, rows)), each also split along K where its tiles make fewer
    than two programs per SM (down_proj's 4,096 columns), every one accepted by the kernel."""
    found = gemv_bench.awq_candidates(rows, 4096, 14336, 128, H200_SMS)
    swapped = [c for c in found if c.swap_ab]
    assert len(found) <= 40 and len(swapped) >= 4 and len(found) - len(swapped) >= 4
    assert {c.split_k > 1 for c in found} == {True, False}
    assert all(c.block_n in (64, 128) and c.block_k in (64, 128) for c in swapped)
    assert {c.block_m for c in swapped} == ({64, 128, 256} if rows == 256 else {64})
    for config in found:
        check_awq_config(config, rows, 128)
    assert {c.block_k for c in gemv_bench.awq_candidates(rows, 4096, 4096, 64, H200_SMS)} == {64}


def test_config_text_spells_swap_ab_only_where_set():
    swapped = TileConfig(128, 64, block_m=64, num_warps=8, num_stages=3, swap_ab=True)
    assert gemv_bench.config_text(swapped) == "TileConfig(128, 64, 1, 64, 8, 3, True)"
    assert gemv_bench.config_text(TileConfig(8, 512)) == "TileConfig(8, 512, 1, 0, 4, 2)"
    assert eval(gemv_bench.config_text(swapped)) == swapped


def test_format_record_names_the_fastest_correct_config_of_each_gemm_form():
    def result(us, ok, **config):
        return dict(us=us, gbps=1.0, peak_fraction=0.5, max_error=0.0, ok=ok,
                    config=vars(TileConfig(128, 64, block_m=64, **config)))
    candidates = [result(30.0, True), result(20.0, False, swap_ab=True), result(25.0, True, swap_ab=True),
                  result(28.0, True, num_warps=8)]
    forms = gemv_bench.gemm_forms(dict(candidates=candidates))
    assert forms["plain"]["us"] == 28.0 and forms["swap_ab"]["us"] == 25.0
    assert gemv_bench.gemm_forms(dict(candidates=candidates[:1])).keys() == {"plain"}
    record = dict(tp=1, layer="qkv", n=64, k=64, rows=64, cublas=dict(us=20.0, gbps=1.0, peak_fraction=0.5),
                  awq=dict(best=candidates[2], default=candidates[0], candidates=candidates),
                  awq_dequant=dict(us=27.0, gbps=1.0, peak_fraction=0.5))
    text = gemv_bench.format_record(record)
    assert "awq GEMM plain    28.0 us" in text and "swapped    25.0 us" in text
    assert "swap_ab=True" in text and "awq dequantize + cuBLAS    27.0 us" in text


def test_one_row_tiles_run_and_match_torch():
    """Every new dense and FP8 tile (K ragged against every block_k, N against block_n) and the
    AWQ ones, on the kernels the bench times."""
    from pagedlab.kernels.fp8_linear import fp8_gemv_triton, quantize_fp8_per_token_triton
    from pagedlab.kernels.gemv import dense_gemv_triton
    from pagedlab.kernels.w4a16 import awq_linear_triton
    from pagedlab.quantization.awq import awq_linear_torch, quantize_awq, repack_awq
    from pagedlab.quantization.fp8 import fp8_linear_torch, quantize_fp8_per_row

    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(36, 1100, generator=gen), torch.randn(1, 1100, generator=gen)
    for config in gemv_bench.one_row_tiles(gemv_bench.ONE_ROW_BLOCK_K):
        out = dense_gemv_triton(x.to(DEVICE), weight.to(DEVICE), None, config).cpu()
        torch.testing.assert_close(out, x @ weight.T, atol=1e-4, rtol=1e-4)
    values, scale = quantize_fp8_per_row(weight)
    q, q_scale = quantize_fp8_per_token_triton(x.to(DEVICE))
    reference = fp8_linear_torch(x, values, scale)
    for config in gemv_bench.one_row_tiles((*gemv_bench.ONE_ROW_BLOCK_K, 2048), fp8=True):
        out = fp8_gemv_triton(q, q_scale, values.to(DEVICE), scale.to(DEVICE), None, torch.float32, config)
        torch.testing.assert_close(out.cpu(), reference, atol=1e-4, rtol=1e-5)  # x quantized alike
    awq_weight, awq_x = torch.randn(1024, 64, generator=gen), torch.randn(1, 1024, generator=gen)
    packed = quantize_awq(awq_weight, 64)
    tiles = gemv_bench.awq_cuda_core_tiles(1024)
    assert len(tiles) == 16 and {c.num_stages for c in tiles} == {1, 3}  # the next step prefetched or not
    for config in tiles:
        out = awq_linear_triton(awq_x.to(DEVICE), *(t.to(DEVICE) for t in repack_awq(*packed, 64)), 64, None,
                                config)
        torch.testing.assert_close(out.cpu(), awq_linear_torch(awq_x, *packed, 64), atol=1e-3, rtol=1e-3)


def test_sweep_counts_only_correct_candidates(monkeypatch):
    """A faster wrong candidate and one that raises are recorded but never chosen."""
    times = {}
    monkeypatch.setattr(gemv_bench, "decode_seconds", lambda fn, operands: times[fn(*operands).sum().item()])
    weight, x = torch.randn(8, 16), torch.randn(1, 16)
    right, wrong, broken = TileConfig(16, 16), TileConfig(8, 16), TileConfig(4, 16)
    reference = x @ weight.T
    times.update({reference.sum().item(): 2e-6, (reference + 1).sum().item(): 1e-6})

    def run(config, w):
        if config == broken:
            raise RuntimeError("out of shared memory")
        return x @ w.T + (1 if config == wrong else 0)
    found = gemv_bench.sweep([right, wrong, broken], run, (weight,), reference, moved_bytes=1000)
    assert found["best"]["config"] == vars(right) and found["best"]["us"] == pytest.approx(2.0)
    assert [r["ok"] for r in found["candidates"]] == [True, False, False]
    assert "out of shared memory" in found["candidates"][2]["failed"]


def _cut(candidates):
    """``candidates`` cut to the first two and the first one-row tile."""
    def cut(*args, **kwargs):
        found = candidates(*args, **kwargs)
        return found[:2] + _one_row(found)[:1]
    return cut


def _cut_sweeps(monkeypatch, fake_seconds) -> None:
    monkeypatch.setattr(gemv_bench, "decode_seconds", fake_seconds)
    for name in ("dense_candidates", "awq_candidates"):
        monkeypatch.setattr(gemv_bench, name, _cut(getattr(gemv_bench, name)))


def _one_row_linear(seed: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One bf16 row, a random ``[n, k]`` weight and its AutoAWQ tensors (groups of 64)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 0.1).bfloat16().to(DEVICE)
    x = torch.randn(1, k, generator=gen).bfloat16().to(DEVICE)
    return x, weight, gemv_bench.quantize_awq(weight.T.contiguous(), 64)


def test_bench_rows_times_every_path_on_its_own_operands(monkeypatch):
    """One row through cuBLAS, the GEMV, FP8 and AWQ sweeps (cut to their first two candidates and
    one one-row tile), each timed on the tensors its copies are made of."""
    seen = []

    def fake_seconds(fn, operands):
        seen.append(tuple((tuple(t.shape), t.dtype) for t in operands))
        fn(*operands)
        return 1e-5
    _cut_sweeps(monkeypatch, fake_seconds)
    x, weight, awq = _one_row_linear(1, 256, 512)
    found = gemv_bench.bench_rows(x, weight, awq, True, 64, sms=2)
    for path in ("gemv", "fp8", "awq"):
        assert [r["ok"] for r in found[path]["candidates"]] == [True] * 3, path
    assert found["cublas"]["us"] == pytest.approx(10.0)
    # AWQ: timed on the repacked tensors, [N, K / 8] words, [N, 1] zero words (8 groups), [N, 8] scales
    assert set(seen) == {(((256, 512), torch.bfloat16),),
                         (((256, 512), torch.float8_e4m3fn), ((256, 1), torch.float32)),
                         (((256, 64), torch.int32), ((256, 1), torch.int32), ((256, 8), torch.bfloat16))}


def test_bench_rows_gated_checks_the_gemvs_against_silu_and_mul(monkeypatch):
    """A one-row gate_up as the engine runs it: the dense and AWQ GEMVs gated, every candidate
    correct against ``silu_and_mul`` of the reference (a plain GEMV's output has the wrong shape), the
    half-width output counted in the bytes moved."""
    def fake_seconds(fn, operands):
        assert fn(*operands).shape == (1, 64)
        return 1e-5
    _cut_sweeps(monkeypatch, fake_seconds)
    x, weight, awq = _one_row_linear(3, 128, 256)
    monkeypatch.setattr(gemv_bench, "measure", _only_gated(gemv_bench.measure))
    found = gemv_bench.bench_rows(x, weight, awq, True, 64, sms=2, paths=("gemv", "awq"), gated=True)
    for path in ("gemv", "awq"):
        assert [r["ok"] for r in found[path]["candidates"]] == [True] * len(found[path]["candidates"]), path
    assert found["gemv"]["best"]["gbps"] == pytest.approx((128 * 256 * 2 + 256 * 2 + 64 * 2) / 1e-5 / 1e9)


def _only_gated(measure):
    """``measure`` of everything but cuBLAS (the plain product, 128 columns) through ``fake_seconds``."""
    def gated(fn, operands, reference, moved_bytes):
        if reference.shape[-1] == 128:
            return dict(us=10.0, gbps=0.0, peak_fraction=0.0, max_error=0.0)
        return measure(fn, operands, reference, moved_bytes)
    return gated


def test_bench_rows_runs_only_the_paths_asked(monkeypatch):
    """``--paths awq``: cuBLAS (the reference time) and the AWQ sweep, no dense GEMV or FP8 sweep."""
    def fake_seconds(fn, operands):
        fn(*operands)
        return 1e-5
    _cut_sweeps(monkeypatch, fake_seconds)
    x, weight, awq = _one_row_linear(2, 128, 256)
    found = gemv_bench.bench_rows(x, weight, awq, True, 64, sms=2, paths=("awq",))
    assert set(found) == {"cublas", "awq"}
    assert [r["ok"] for r in found["awq"]["candidates"]] == [True] * 2


def _record(layer, cublas, gemv=None, fp8=None, awq=None, tp=1, rows=1):
    record = dict(tp=tp, layer=layer, n=64, k=64, rows=rows, cublas=dict(us=cublas))
    record["gemv"] = dict(best=dict(us=gemv) if gemv else None)
    if layer not in gemv_bench.DENSE_ONLY_LINEARS:
        record["fp8"] = dict(best=dict(us=fp8) if fp8 else None)
        record["awq"] = dict(best=dict(us=awq) if awq else None)
    return record


def test_model_linears_list_a_mixture_of_experts_router_per_layer_and_its_attention():
    """Qwen3-30B-A3B: attention, the router (128 experts, whole on every rank) and the LM head;
    the router counts once a layer in a decode step and runs bf16 in every model."""
    linears = dict((name, (n, k)) for name, n, k in gemv_bench.model_linears("qwen3-30b-a3b", 2))
    assert linears == {"qkv": ((32 + 2 * 4) * 128 // 2, 2048), "o": (2048, 32 * 128 // 2),
                       "router": (128, 2048), "lm_head": (151936 // 2, 2048)}
    records = [_record("qkv", 10.0, fp8=8.0, awq=6.0), _record("router", 5.0, gemv=2.0),
               _record("lm_head", 100.0)]
    estimate = gemv_bench.decode_estimates(records, num_layers=48)[1]
    assert estimate["awq_ms"] == pytest.approx((48 * (6.0 + 2.0) + 100.0) / 1e3)
    records[1]["gemv"]["best"].update(config=vars(TileConfig(4, 1024)), peak_fraction=0.5)
    assert gemv_bench.table_lines(records[1:], 128) == (
        [], ["    (1, 64, 64): TileConfig(4, 1024, 1, 0, 4, 2),  # 2.0 (cuBLAS 5.0), 50%"], [])


def test_decode_estimates_sum_the_paths_the_tables_pick():
    records = [_record("qkv", 16.0, gemv=13.9, fp8=12.0, awq=9.0),
               _record("o", 12.7, gemv=12.5, fp8=9.0, awq=7.0), _record("lm_head", 250.0, gemv=240.0),
               _record("qkv", 99.0, gemv=1.0, rows=4)]
    estimate = gemv_bench.decode_estimates(records, num_layers=2)[1]
    # o's GEMV beat cuBLAS by under 3%: cuBLAS; the LM head runs bf16 in the FP8 and AWQ models
    assert estimate["linears"]["o"]["bf16_path"] == "cublas"
    assert estimate["cublas_ms"] == pytest.approx((2 * (16.0 + 12.7) + 250.0) / 1e3)
    assert estimate["bf16_ms"] == pytest.approx((2 * (13.9 + 12.7) + 240.0) / 1e3)
    assert estimate["fp8_ms"] == pytest.approx((2 * (12.0 + 9.0) + 240.0) / 1e3)
    assert estimate["awq_ms"] == pytest.approx((2 * (9.0 + 7.0) + 240.0) / 1e3)
    lines = gemv_bench.step_summary({1: estimate}, 2, chain=True)
    assert any("qkv" in line and "gemv" in line for line in lines)
    assert "cuBLAS 0.31 ms, bf16 0.29 ms" in lines[-1]
    assert gemv_bench.step_summary({1: estimate}, 2, chain=False) == lines[-1:]


def test_decode_estimates_say_n_a_without_a_correct_config():
    records = [_record("qkv", 16.0, fp8=12.0), _record("o", 12.7, fp8=9.0, awq=7.0)]
    estimate = gemv_bench.decode_estimates(records, num_layers=2)[1]
    assert estimate["awq_ms"] is None and estimate["bf16_ms"] == estimate["cublas_ms"]
    assert "AWQ n/a" in gemv_bench.step_summary({1: estimate}, 2, chain=False)[0]


def test_table_lines_list_the_gemv_only_where_it_beat_cublas_by_3_percent():
    """bf16: the GEMV where it beat cuBLAS by 3%; FP8: where it beat torch._scaled_mm at all."""
    records = [_record("qkv", 16.0, gemv=13.9, fp8=12.0), _record("o", 12.7, gemv=12.5, fp8=9.0)]
    for record, scaled_mm in zip(records, (11.0, 9.1)):
        for path in ("gemv", "fp8"):
            record[path]["best"].update(config=vars(TileConfig(8, 512, num_stages=3)), peak_fraction=0.8)
        record["fp8"]["scaled_mm"] = dict(us=scaled_mm)
        record["n"] = 6144 if record["layer"] == "qkv" else 4096
    awq, dense, fp8 = gemv_bench.table_lines(records, 128)
    assert awq == []
    assert fp8 == ["    (1, 4096, 64): TileConfig(8, 512, 1, 0, 4, 3),  # 9.0 (_scaled_mm 9.1), 80%"]
    assert dense == ["    (1, 6144, 64): TileConfig(8, 512, 1, 0, 4, 3),  # 13.9 (cuBLAS 16.0), 80%"]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_gemv_sweep_holds_the_swapped_dot_tiles(fp8, rows):
    """Every swapped tile (SWAPPED_GEMV_TILES, and the FP8 ones for FP8) at 1, 2 and 4 programs an
    SM, runnable at the batch: 16 padded rows, K cut into at most its steps."""
    tiles = gemv_bench.SWAPPED_GEMV_TILES + (gemv_bench.SWAPPED_FP8_GEMV_TILES if fp8 else [])
    for n, k in [(6144, 4096), (4096, 14336)]:
        swapped = [c for c in gemv_bench.dense_candidates(rows, n, k, H200_SMS, fp8=fp8) if c.swap_ab]
        assert {(c.block_n, c.block_k, c.num_stages) for c in swapped} == set(tiles)
        assert len({c.split_k for c in swapped if (c.block_n, c.block_k) == (64, 128)}) > 1
        for config in swapped:
            config.check(rows, gemv=True)
            assert config.block_m == 16 and config.split_k <= -(-k // config.block_k)


def test_awq_lines_above_16_rows_only_where_the_gemm_beat_dequantize_then_cublas():
    records = [_record("qkv", 50.0, awq=40.0, rows=64), _record("o", 50.0, awq=60.0, rows=256),
               _record("qkv", 16.0, awq=9.0)]
    records[0]["awq_dequant"], records[1]["awq_dequant"] = dict(us=45.0), dict(us=55.0)
    for record in records:
        record["awq"]["best"].update(config=vars(TileConfig(128, 64, block_m=64)), peak_fraction=0.5)
    awq, _, _ = gemv_bench.table_lines(records, 128)
    assert [line.split(":")[0].strip() for line in awq] == ["(64, 64, 64, 128)", "(1, 64, 64, 128)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (28672, 4096)])
def test_decode_seconds_reads_the_weights_from_hbm(n, k):
    """cuBLAS at batch 1: no faster than the weight read at HBM's peak (an L2-resident weight
    would be), and over a third of it."""
    import torch.nn.functional as F

    weight = torch.randn(n, k, device="cuda").bfloat16()
    x = torch.randn(1, k, device="cuda").bfloat16()
    F.linear(x, weight)
    seconds = gpu_timing.decode_seconds(lambda w: F.linear(x, w), (weight,))
    bandwidth = weight.numel() * 2 / seconds
    assert gpu_timing.PEAK_BYTES_PER_S / 3 < bandwidth < gpu_timing.PEAK_BYTES_PER_S


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_rows_on_the_gpu(monkeypatch):
    """One row of an o projection through every path, the sweeps cut short: every candidate
    correct, each path's time no faster than its bytes at HBM's peak."""
    from pagedlab.kernels.gemv import num_sms

    for name in ("dense_candidates", "awq_candidates"):
        monkeypatch.setattr(gemv_bench, name, _cut(getattr(gemv_bench, name)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(4096, 4096, device="cuda", generator=gen) * 0.02).bfloat16()
    x = torch.randn(1, 4096, device="cuda", generator=gen).bfloat16()
    awq = gemv_bench.quantize_awq(weight.T.contiguous(), 128)
    found = gemv_bench.bench_rows(x, weight, awq, True, 128, num_sms(x.device))
    for path in ("gemv", "fp8", "awq"):
        assert all(r["ok"] for r in found[path]["candidates"]), found[path]
        assert 0 < found[path]["best"]["peak_fraction"] < 1
    assert 0.3 < found["cublas"]["peak_fraction"] < 1
