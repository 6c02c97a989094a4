"""pagedlab.stats against numpy.percentile and values worked out by hand."""

import math
import random

import numpy as np
import pytest

from pagedlab import stats


def test_percentile_interpolates_between_ranks_like_numpy():
    # ranks 0..3 hold 1, 2, 3, 4: P50 sits halfway between 2 and 3, P90 at rank 2.7, P99 at 2.97
    assert stats.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert stats.percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    assert stats.percentile([4.0, 1.0, 3.0, 2.0], 99) == pytest.approx(3.97)
    assert stats.percentile([7.0], 99) == 7.0
    assert stats.percentile([], 50) is None and stats.percentile([None, None], 50) is None
    rng = random.Random(0)
    for n in (1, 2, 5, 100, 1001):
        values = [rng.expovariate(20.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert stats.percentile(values, q) == np.percentile(values, q)


def test_percentile_ms_and_latency_stats_in_milliseconds():
    assert stats.percentile_ms([0.001, 0.003], 50) == pytest.approx(2.0)
    assert stats.percentile_ms([], 99) is None
    s = stats.latency_stats([0.001, 0.002, 0.003, 0.004, None], "ttft")
    assert list(s) == ["ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_mean_ms"]
    assert s["ttft_p50_ms"] == pytest.approx(2.5) and s["ttft_mean_ms"] == pytest.approx(2.5)
    assert s["ttft_p90_ms"] == pytest.approx(3.7) and s["ttft_p99_ms"] == pytest.approx(3.97)
    assert stats.latency_stats([], "e2e", percentiles=(50, 99.9)) == {
        "e2e_p50_ms": None, "e2e_p99.9_ms": None, "e2e_mean_ms": None}


def test_describe_gives_population_std_and_zeros_when_empty():
    d = stats.describe([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0], (50, 99.5))
    assert d["mean"] == 5.0 and d["std"] == 2.0  # the textbook example: population std 2
    assert d["median"] == 4.5 == d["50"]
    assert d["99.5"] == pytest.approx(np.percentile([2, 4, 4, 4, 5, 5, 7, 9], 99.5))
    assert stats.describe([], (50, 90)) == {"mean": 0.0, "median": 0.0, "std": 0.0, "50": 0.0, "90": 0.0}
    assert all(math.isfinite(v) for v in stats.describe([1e-3], (99,)).values())


def test_percentile_label():
    assert [stats.percentile_label(q) for q in (50, 99.0, 99.9)] == ["50", "99", "99.9"]
