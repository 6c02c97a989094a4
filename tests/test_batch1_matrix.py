"""``benchmarks/batch1_matrix.py`` on the CPU with a stand-in for ``run_bench``: each row is built
with its own PDL setting and engine arguments, and the ratios come from rows of one setting."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pagedlab.workloads import WorkloadResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
batch1_matrix = pytest.importorskip("batch1_matrix")

TPOT = {("bf16", "0"): 4.5, ("bf16", "1"): 4.0, ("lora", "0"): 5.4, ("lora", "1"): 4.4,
        ("batch_invariant", "1"): 4.6}


def test_rows_run_with_their_pdl_setting_and_ratios_use_the_same_setting(monkeypatch):
    calls = []

    def run_bench(workload, sizes, input_len, output_len, num_prompts, backends, *, shape, engine_args, lora,
                  progress):
        name = next(n for n, (s, a, adapters) in batch1_matrix.ROWS.items()
                    if (s, a, adapters) == (shape, engine_args, lora))
        pdl = os.environ["PAGEDLAB_PDL"]
        calls.append((name, pdl, workload, sizes, input_len, output_len, backends))
        return [WorkloadResult("W-seed", "pagedlab", "bs=1", 1, 512, 128, 0.6, 10.0, 10.0, TPOT[name, pdl],
                               TPOT[name, pdl], 30.0, 0.4)]

    monkeypatch.setenv("PAGEDLAB_PDL", "0")
    records = [batch1_matrix.measure(name, pdl, run_bench) for name, pdl in TPOT]
    assert [(c[0], c[1]) for c in calls] == list(TPOT)
    assert all(c[2:] == ("W-seed", [1], 512, 128, ["pagedlab"]) for c in calls)
    assert [r["tpot_p50_ms"] for r in records] == list(TPOT.values())
    assert records[0]["over_floor"] == pytest.approx(0.6 / 0.4)
    found = {(r["row"], r["pdl"]): (r["ratio"], r["target"]) for r in batch1_matrix.ratios(records)}
    assert found == {("lora", "0"): (pytest.approx(1.2), 1.15), ("lora", "1"): (pytest.approx(1.1), 1.15),
                     ("batch_invariant", "1"): (pytest.approx(1.15), 1.10)}
    table = "\n".join(batch1_matrix.format_table(records))
    assert "1.100x bf16 (target at most 1.15x)" in table and "1.150x bf16 (target at most 1.10x)" in table
