"""``benchmarks/batch_invariant_bench.py`` on the CPU: one small weight through the whole table
search under the interpreter (the GPU timing replaced by a fake clock that checks each timed call
is a linear of its own weight copy and still computes the product), so the GPU run only has the
timings left to go wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import test_kernels  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)
import torch

from pagedlab.kernels.gemv_configs import TileConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
binv_bench = pytest.importorskip("batch_invariant_bench")

N, K, ROWS = 64, 256, [1, 8]


def test_table_search_times_each_linear_on_its_weight_and_verifies_the_table(monkeypatch):
    monkeypatch.setattr(binv_bench, "DEVICE", "cpu")
    monkeypatch.setattr(binv_bench, "CANDIDATE_TILES", [(16, 32, 64, 4, 4), (16, 64, 64, 4, 4)])
    timed = []

    def fake_decode_seconds(fn, operands):
        x, weight = operands
        assert weight.shape == (N, K) and x.shape[0] in ROWS
        out = fn(x, weight).float()
        torch.testing.assert_close(out, x.float() @ weight.float().T, atol=0.05, rtol=0.02)
        timed.append(x.shape[0])
        return 1e-5 * (1 + len(timed) % 3)  # distinct times, so the choice is by the clock

    monkeypatch.setattr(binv_bench, "decode_seconds", fake_decode_seconds)
    result = binv_bench.bench_linear("o", N, K, ROWS, sms=4, gen=torch.Generator().manual_seed(0))
    assert sorted(set(timed)) == ROWS
    assert result["table_verified"]
    assert result["table_lines"] and all(f"{N}, {K})" in line for line in result["table_lines"])
    for bucket, config in result["chosen"].items():
        members = [r for r in result["candidates"] if r["class"] is not None and r["config"] == config]
        assert members, f"bucket {bucket}: the chosen config is not a verified candidate"
        TileConfig(**config).check(1, gemv=False)
