"""``benchmarks/prefill_attention_bench.py`` on the CPU (the Triton interpreter, timing stubbed):
every candidate of the rule's class is timed on the batch, the tuner's pick comes from its own
tuning batch, and the report names the rule, the best and the pick."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import test_kernels  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)

from pagedlab.kernels import attention_tuning

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench = pytest.importorskip("prefill_attention_bench")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bench_batch_times_every_candidate_and_the_tuners_pick(monkeypatch, capsys):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setitem(bench.MODELS, "tiny", (4, 2, 64, None))
    monkeypatch.setitem(bench.BATCHES, "tiny", [(0, 40)] * 2 + [(30, 1)])
    monkeypatch.setattr(attention_tuning, "TUNING_BATCH_TOKENS", 128)
    timed, tuned = [], []
    candidates = attention_tuning.prefill_candidates  # the tuner's list (the bench imported its own name)
    monkeypatch.setattr(attention_tuning, "prefill_candidates",
                        lambda shape: tuned.extend(candidates(shape)) or tuned)

    def timer(run, rep_ms=10.0):  # the tuner's fifth candidate (the 13th launch timed) is the fastest
        run()
        timed.append(run)
        return 0.5 if len(timed) == 13 else 1.0
    monkeypatch.setattr(attention_tuning, "time_launch_on_gpu", timer)
    record = bench.bench_batch("tiny", "tiny")
    assert len(record["results"]) == 8 == len(timed) - 8 == len(tuned)  # the batch's 8, then the tuner's 8
    assert {r["launch"]["block_m"] for r in record["results"]} == {64, 128}
    assert record["rule"]["block_m"] == 64 and record["picked"] == asdict(tuned[4]) != record["rule"]
    bench.report(record)
    printed = capsys.readouterr().out
    assert printed.startswith("tiny           tiny           rule 64/4/3") and "bitwise" in printed
