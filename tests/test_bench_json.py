"""``pagedlab bench throughput|latency --json``: each row keeps its own fields and carries vLLM's
``--output-json`` keys, checked against figures computed by hand."""

from __future__ import annotations

import json
import math

import pytest

from pagedlab import bench_json
from pagedlab.workloads import WorkloadResult


def _row(label: str, elapsed_s: float, backend: str = "pagedlab", requests: int = 4) -> WorkloadResult:
    return WorkloadResult("W-lat", backend, label, requests, 10 * requests, 5 * requests, elapsed_s,
                          None, None, None, None, None, None)


def test_rows_carry_vllms_throughput_and_latency_keys(tmp_path):
    """Three repeats of batch 4 (1, 2 and 4 s) are vLLM latency's three iterations of one batch;
    the single batch-16 row and the HF peer's repeats (whose label goes on after the repeat) are
    configurations of their own. vLLM's tokens_per_second counts prompt and output tokens."""
    rows = [_row("bs=4 #1", 1.0), _row("bs=4 #2", 2.0), _row("bs=4 #3", 4.0), _row("bs=16", 0.5, requests=16),
            _row("bs=4 #1 out=256", 3.0, backend="hf"), _row("bs=4 #2 out=256", 5.0, backend="hf")]
    out = tmp_path / "bench.json"
    bench_json.write_json(str(out), rows, "pagedlab bench latency")
    written = json.loads(out.read_text())["results"]

    second = written[1]
    assert (second["label"], second["elapsed_s"], second["output_tok_s"]) == ("bs=4 #2", 2.0, 10.0)
    assert (second["elapsed_time"], second["num_requests"], second["total_num_tokens"]) == (2.0, 4, 60)
    assert (second["requests_per_second"], second["tokens_per_second"]) == (2.0, 30.0)
    for row in written[:3]:
        assert row["latencies"] == [1.0, 2.0, 4.0]
        assert row["avg_latency"] == pytest.approx(7 / 3)
        assert row["std_latency"] == pytest.approx(math.sqrt(14 / 9))  # population, as numpy's std
        # linear between ranks, numpy's default: rank 0.2 of (1, 2, 4) is 1.2, rank 1.98 is 3.96
        assert row["percentiles"] == pytest.approx({"10": 1.2, "25": 1.5, "50": 2.0, "75": 3.0, "90": 3.6,
                                                    "99": 3.96})
    single = written[3]
    assert (single["latencies"], single["avg_latency"], single["std_latency"]) == ([0.5], 0.5, 0.0)
    assert set(single["percentiles"].values()) == {0.5} and single["tokens_per_second"] == 240 / 0.5
    assert [r["latencies"] for r in written[4:]] == [[3.0, 5.0]] * 2
