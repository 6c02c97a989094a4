"""``benchmarks/attention_bench.py`` on the CPU: its sweep, split modes and table choice, and one
small batch through the whole measurement path under the interpreter (the GPU timing replaced by
a fake clock), so the GPU run only has the timings left to go wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import test_kernels  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)

from pagedlab.kernels import attention_configs
from pagedlab.kernels.attention_configs import DecodeConfig
from pagedlab.kernels.paged_attention import SPLIT_KV_MIN_PROGRAMS, SPLIT_KV_SIZE, decode_order

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
attention_bench = pytest.importorskip("attention_bench")

KEY = (128, 2, 16)


def test_candidates_cover_the_sweep_current_first(monkeypatch):
    monkeypatch.setattr(attention_configs, "DECODE_ATTENTION_CONFIGS", {})  # KEY untuned: the default
    current = DecodeConfig()
    found = attention_bench.candidates(attention_bench.SWEEP, KEY, current)
    assert found[0] == current and len(found) == len(set(found)) == 18
    assert DecodeConfig(128, 2, 4) in found
    assert attention_bench.current_config(KEY, None) == current


def test_split_modes_follow_the_policy():
    assert attention_bench.split_modes(16, 8, 8192) == [SPLIT_KV_SIZE, 128, 64, None]
    assert attention_bench.split_modes(1, 8, 640) == [64, SPLIT_KV_SIZE, 128, None]  # 80 programs
    assert attention_bench.split_modes(SPLIT_KV_MIN_PROGRAMS // 8, 8, 8192) == [None]
    # --all-splits: an unsplit batch (W-seed batch 64's 512 programs) also times each split size
    assert attention_bench.split_modes(64, 8, 640, all_splits=True) == [None, SPLIT_KV_SIZE, 128, 64]
    assert attention_bench.split_modes(64, 8, 200, all_splits=True) == [None, 128, 64]


def _record(times: dict[DecodeConfig, float], wrong=()) -> dict:
    results = [dict(config=vars(config).copy(), split=None, policy_split=True, us=us,
                    correct=config not in wrong) for config, us in times.items()]
    results.append(dict(config=vars(DecodeConfig(128, 8, 2)).copy(), split=None, policy_split=True,
                        failed="OutOfResources"))
    return dict(key=list(KEY), current=vars(DecodeConfig()).copy(), results=results)


def test_table_entry_takes_the_lowest_mean_ratio_of_correct_configs():
    fast, faster_but_wrong, mixed = DecodeConfig(128, 4, 2), DecodeConfig(128, 2, 2), DecodeConfig(64, 8, 2)
    records = [_record({DecodeConfig(): 100.0, fast: 90.0, faster_but_wrong: 50.0, mixed: 70.0},
                       wrong={faster_but_wrong}),
               _record({DecodeConfig(): 10.0, fast: 9.0, faster_but_wrong: 5.0, mixed: 13.0})]
    key, config, ratio = attention_bench.table_entry(records)
    assert (key, config) == (KEY, fast) and ratio == pytest.approx(0.9)
    assert attention_bench.table_entry([_record({DecodeConfig(): 100.0, fast: 99.5})]) is None  # < 1%


def test_table_line_keeps_the_current_line_when_nothing_beats_it(monkeypatch):
    fast = DecodeConfig(128, 4, 2)
    close = [_record({DecodeConfig(): 100.0, fast: 99.5})]
    monkeypatch.setattr(attention_bench, "DECODE_ATTENTION_CONFIGS", {})  # the table the bench read
    line = attention_bench.table_line("s", close, ("b",))
    assert line.startswith("    # s: the default launch is within 1%")
    monkeypatch.setitem(attention_bench.DECODE_ATTENTION_CONFIGS, KEY, DecodeConfig())
    line = attention_bench.table_line("s", close, ("b",))
    assert line.startswith(f"    {KEY}: {DecodeConfig()},  # s: the current")
    line = attention_bench.table_line("s", [_record({DecodeConfig(): 100.0, fast: 80.0})], ("b",))
    assert line.startswith(f"    {KEY}: {fast},  # s: 20.0% less")


# the warm-up pass runs the split-KV reduce over scratch no attention launch wrote
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bench_batch_runs_and_checks_every_candidate_on_the_cpu(monkeypatch, capsys):
    monkeypatch.setattr(attention_bench, "DEVICE", "cpu")
    monkeypatch.setattr(attention_bench, "graph_seconds", lambda call: 1e-3)
    monkeypatch.setitem(attention_bench.SHAPES, "tiny", (4, 2, 64))
    monkeypatch.setitem(attention_bench.BATCHES, "tiny", (3, 70, 300))
    sweep = dict(tile_n=(64, 128), num_warps=(4,), num_stages=(2,))
    record = attention_bench.bench_batch("tiny", "tiny", sweep)
    assert record["policy_split"] == 64  # 3 x 2 programs over up to 369 keys: the smallest segments
    results = record["results"]
    # current + 2 swept configs at the policy's split, its half and quarter, and unsplit
    assert len(results) == 3 * 4 and {r["split"] for r in results} == {256, 128, 64, None}
    assert all(r["correct"] and r["max_error"] < 0.02 for r in results)
    assert record["kv_bytes"] == record["keys"] * 2 * 64 * 4
    attention_bench.report(record)
    printed = capsys.readouterr().out
    assert "current  64-key 4w 3s split 64" in printed
    assert all(f"  split {split}: best" in printed for split in (256, 128, 64, None))
    assert record["key"] == [64, 2, 16]


def test_the_decode_call_launches_as_the_engine_does_longest_first(monkeypatch):
    """``decode_call`` passes ``decode_order`` of the batch's lengths, the order the engine's
    decode steps stage."""
    monkeypatch.setattr(attention_bench, "DEVICE", "cpu")
    batch = attention_bench.make_batch(5, 17, 70, 4, 2, 16)
    orders = []

    def launch(*args, **kwargs):
        orders.append(kwargs["seq_order"].tolist())
    monkeypatch.setattr(attention_bench, "paged_attention_triton", launch)
    attention_bench.decode_call(batch, 70, None)()
    assert orders == [decode_order(batch["seq_lens"].tolist()).tolist()]
    assert orders[0] != sorted(orders[0])  # the fixed seed's lengths are not already in order
