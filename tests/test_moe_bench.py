"""``benchmarks/moe_bench.py`` on the CPU: the GEMV candidates, a decode batch and a larger one
through the whole measurement path at a tiny shape under the Triton interpreter (float32, the
GPU timing replaced by a fake clock): every GEMV candidate checked against ``moe_torch``, the
GEMV layer timed beside the grouped one at decode batches only; and which batches the
``MOE_GEMV_CONFIGS`` lines take.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import test_fused_moe  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)
import torch

from pagedlab.kernels.fused_moe_configs import MOE_GEMV_MAX_TOKENS, MoeGemvConfig, MoeGemvLaunch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
moe_bench = pytest.importorskip("moe_bench")

# experts, hidden, inter (not a multiple of block_n), top_k, renormalize, layers
TINY = (8, 64, 48, 2, True, 3)


@pytest.mark.parametrize("k, row_sets, block_ks", [(2048, 2, [128, 256, 512, 1024]),
                                                   (768, 1, [128, 256, 512, 1024]), (300, 2, [128, 256, 512]),
                                                   (64, 1, [64])])
def test_gemv_candidates_sweep_tiles_a_thread_can_hold_with_block_k_capped_at_k(k, row_sets, block_ks):
    """Every block_n x block_k (capped at K's power of two) x warps x plain/prefetch whose weight
    values a thread a step lie in GEMV_THREAD_VALUES, and no other."""
    candidates = moe_bench.gemv_candidates(k, row_sets)
    low, high = moe_bench.GEMV_THREAD_VALUES
    expected = {(bn, bk, w, s) for bn, bk, w, s in itertools.product((8, 16, 32, 64), block_ks, (2, 4, 8),
                                                                      (1, 2))
                if low <= row_sets * bn * bk // (32 * w) <= high}
    assert len(candidates) == len(set(candidates)) and expected
    assert {(c.block_n, c.block_k, c.num_warps, c.num_stages) for c in candidates} == expected
    assert {c.prefetch for c in candidates} == {False, True}
    assert not any(c.all_pairs for c in candidates)
    for candidate in candidates:
        candidate.check("gate_up")


def test_down_candidates_add_tiles_by_token_that_hold_the_tokens_pairs():
    """With top_k the down sweep adds the form by token: BY_TOKEN tiles whose top_k pairs' weight
    values a thread a step lie in BY_TOKEN_THREAD_VALUES, each plain and prefetching (GEMV_STAGES)."""
    per_pair = moe_bench.gemv_candidates(768, 1)
    both = moe_bench.gemv_candidates(768, 1, top_k=8)
    by_token = [c for c in both if c.all_pairs]
    assert both[:len(per_pair)] == per_pair and len(both) == len(per_pair) + len(by_token)
    low, high = moe_bench.BY_TOKEN_THREAD_VALUES
    expected = {(bn, bk, w) for bn, bk, w in itertools.product(moe_bench.BY_TOKEN_BLOCK_N,
                                                               moe_bench.BY_TOKEN_BLOCK_K, (2, 4, 8))
                if low <= 8 * bn * bk // (32 * w) <= high}
    assert {(c.block_n, c.block_k, c.num_warps) for c in by_token} == expected and expected
    assert {(c.block_n, c.block_k, c.num_warps, c.num_stages) for c in by_token} == {
        (*tile, stages) for tile in expected for stages in moe_bench.GEMV_STAGES}
    for candidate in by_token:
        candidate.check("down")


@pytest.fixture
def tiny_bench(monkeypatch):
    """moe_bench at the TINY shape on the CPU in float32, one grouped candidate per launch, the GEMV
    candidates at 4 warps (plain and prefetching), and a fake clock under which every timing is
    faster than the one before (so the last candidate of a sweep wins, and the GEMV layer, timed
    last, beats the grouped one)."""
    monkeypatch.setattr(moe_bench, "SHAPES", {"tiny": TINY})
    monkeypatch.setattr(moe_bench, "DEVICE", "cpu")
    monkeypatch.setattr(moe_bench, "DTYPE", torch.float32)
    first_round = moe_bench.first_round
    monkeypatch.setattr(moe_bench, "first_round", lambda *args: first_round(*args)[:1])
    monkeypatch.setattr(moe_bench, "second_round", lambda best: [])
    monkeypatch.setattr(moe_bench, "GEMV_WARPS", (4,))
    clock = itertools.count(1)

    def fake_seconds(fn):
        fn()
        return 1e-3 / next(clock)
    monkeypatch.setattr(moe_bench, "graph_seconds", fake_seconds)
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = TINY[:3]
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    return lambda num_tokens: moe_bench.bench_tokens("tiny", num_tokens, w13, w2, w13, w2, 132, gen)


def test_bench_tokens_sweeps_the_gemv_path_at_a_decode_batch(tiny_bench):
    record = tiny_bench(2)
    sweeps = record["gemv_launches"]
    expected = {}
    for launch, k, row_sets, top_k in (("gate_up", TINY[1], 2, 0), ("down", TINY[2], 1, TINY[3])):
        results = sweeps[launch]["candidates"]
        swept = [MoeGemvLaunch(**r["config"]) for r in results]
        assert swept == moe_bench.gemv_candidates(k, row_sets, top_k)
        assert {c.all_pairs for c in swept} == ({False, True} if top_k else {False})
        assert all(r["ok"] and r["max_error"] < 1e-4 for r in results), results
        expected[launch] = MoeGemvLaunch(**results[-1]["config"])
    gemv = MoeGemvConfig(**expected)
    assert record["gemv"]["config"] == moe_bench.asdict(gemv)
    assert record["gemv"]["max_error"] < 1e-4 and record["gemv"]["us"] < record["best"]["us"]
    text = moe_bench.format_record(record)
    assert "GEMV" in text and "fused layer    gemv" in text
    lines = moe_bench.gemv_table_lines([record])
    assert lines[0].startswith(f"    {TINY[:4] + (2,)}:  # tiny:")
    assert eval(lines[1].strip().rstrip(","), vars(moe_bench)) == gemv


def test_bench_tokens_leaves_the_gemv_path_out_above_its_batches(tiny_bench):
    record = tiny_bench(MOE_GEMV_MAX_TOKENS + 1)
    assert "gemv_launches" not in record and "gemv" not in record
    assert "best" in record and moe_bench.gemv_table_lines([record]) == []


def _record(tokens: int, default_us: float, best_us: float, gemv_us: float | None) -> dict:
    layer = dict(gbps=1.0, config={})
    record = dict(shape="tiny", tokens=tokens, default=dict(layer, us=default_us),
                  best=dict(layer, us=best_us))
    if gemv_us is not None:
        launch = dict(block_n=8, block_k=256, num_warps=4, num_stages=2)
        down = dict(launch, block_n=16, all_pairs=True)
        record["gemv"] = dict(layer, us=gemv_us, config=dict(gate_up=launch, down=down))
    return record


def test_gemv_table_lines_only_where_the_gemv_layer_beat_the_best_grouped_one(monkeypatch):
    monkeypatch.setattr(moe_bench, "SHAPES", {"tiny": TINY})
    records = [_record(1, 30.0, 20.0, 10.0),  # beats both
               _record(2, 30.0, 20.0, 25.0),  # beats the default only
               _record(4, 20.0, 30.0, 25.0),  # beats the swept best only, not the default
               _record(8, 30.0, 20.0, None)]  # not measured
    lines = moe_bench.gemv_table_lines(records)
    assert lines == ["    (8, 64, 48, 2, 1):  # tiny: 10.0 us, 1 GB/s (grouped 20.0 us)",
                     "        MoeGemvConfig(MoeGemvLaunch(8, 256, 4, 2), "
                     "MoeGemvLaunch(16, 256, 4, 2, True)),"]


def test_bench_tokens_sweeps_the_route_warps_and_keeps_only_correct_ones(tiny_bench, monkeypatch):
    """Every warp count of ROUTE_WARPS timed and checked against the torch ops (one made to sort
    wrongly here is left out), the fastest correct one taken (the fake clock: the last timed) and
    written as a ROUTE_NUM_WARPS line."""
    route = moe_bench.route_and_align_triton

    def wrong_at_8_warps(*args):
        routing = route(*args)
        if args[-1] == 8:
            routing.sorted_pairs[0] += 1
        return routing
    monkeypatch.setattr(moe_bench, "route_and_align_triton", wrong_at_8_warps)
    record = tiny_bench(2)
    sweep = record["route"]["warps"]
    assert list(sweep) == [str(w) for w in moe_bench.ROUTE_WARPS]
    assert [r["ok"] for r in sweep.values()] == [True, True, True, False]
    assert record["route"]["best_warps"] == 4 and record["route"]["default_warps"] == 1
    text = moe_bench.format_record(record)
    assert "route+align by warps 1: " in text and " WRONG us; best 4" in text
    lines = moe_bench.route_table_lines([record])
    assert len(lines) == 1 and lines[0].startswith(f"    {(TINY[0], TINY[3], 2)}: 4,  # tiny: ")
    assert eval("{" + lines[0].split("#")[0] + "}") == {(TINY[0], TINY[3], 2): 4}


def test_route_only_sweeps_the_routing_alone(tiny_bench, capsys):
    """``--route-only``: the route sweep per token count (a decode batch and several token blocks
    of the align kernel), no GEMM sweeps, and its ROUTE_NUM_WARPS lines."""
    records = moe_bench.route_records(["tiny"], [1, 600], 132, torch.Generator().manual_seed(0))
    assert [(r["shape"], r["tokens"], set(r)) for r in records] == [
        ("tiny", 1, {"shape", "tokens", "route"}), ("tiny", 600, {"shape", "tokens", "route"})]
    for record in records:
        assert all(r["ok"] for r in record["route"]["warps"].values()) and record["route"]["best_warps"] == 8
    assert [r["route"]["default_warps"] for r in records] == [1, 8]  # 600 tokens: 512-token programs
    assert "tiny     1 tokens:\n    route+align Triton" in capsys.readouterr().out
    assert [line.split("#")[0] for line in moe_bench.route_table_lines(records)] == [
        f"    {(TINY[0], TINY[3], 1)}: 8,  ", f"    {(TINY[0], TINY[3], 600)}: 8,  "]
