"""Latency statistics: the one place percentiles, means and spreads of timings are computed.

``pagedlab bench`` (``pagedlab.workloads``), ``LLM.benchmark`` and the lab's metrics
(``pagedlab.lab``) and ``pagedlab bench serve`` (``pagedlab.server.bench_serve``) all report
through it, so a P99 means the same thing everywhere: numpy's default ("linear") percentile, the
value interpolated between the two nearest ranks. Only numpy is needed, so ``pagedlab bench``
runs without the lab's optional dependencies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def _finite_array(values: Iterable[float | None]) -> np.ndarray:
    return np.asarray([v for v in values if v is not None], dtype=float)


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The ``q``-th percentile (0 to 100) of ``values``, linearly interpolated between ranks
    (numpy's default); None values are left out, and no values give None."""
    array = _finite_array(values)
    return float(np.percentile(array, q)) if array.size else None


def percentile_ms(values_s: Iterable[float | None], q: float) -> float | None:
    """``percentile`` of timings given in seconds, in milliseconds."""
    return percentile((None if v is None else v * 1000.0 for v in values_s), q)


def latency_stats(values_s: Iterable[float | None], prefix: str,
                  percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """``{prefix}_p50_ms``, ``_p90_ms``, ``_p99_ms`` (one per ``percentiles``) and ``_mean_ms`` of
    timings in seconds; None when there are no values (e.g. TPOT of one-token outputs)."""
    ms = _finite_array(values_s) * 1000.0
    out: dict[str, float | None] = {}
    for q in percentiles:
        out[f"{prefix}_p{percentile_label(q)}_ms"] = float(np.percentile(ms, q)) if ms.size else None
    out[f"{prefix}_mean_ms"] = float(ms.mean()) if ms.size else None
    return out


def describe(values: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict:
    """``mean``, ``median``, ``std`` (population) and one entry per percentile, keyed by
    ``percentile_label(q)``, of ``values``; all 0.0 when there are none (vLLM's convention)."""
    array = _finite_array(values)
    if not array.size:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{percentile_label(q): 0.0 for q in percentiles}}
    out = {"mean": float(array.mean()), "median": float(np.percentile(array, 50)), "std": float(array.std())}
    out.update({percentile_label(q): float(np.percentile(array, q)) for q in percentiles})
    return out


def percentile_label(q: float) -> str:
    """How a percentile appears in a metric name: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(q)) if float(q).is_integer() else str(q)
