"""``pagedlab bench serve``'s arrival process: when each request is sent, as ``vllm bench serve``
schedules it (``get_request`` in ``vllm/benchmarks/serve.py``).

The gaps between requests are gamma draws, shape ``burstiness`` and scale
``1 / (rate * burstiness)`` (exponential, so Poisson arrivals, at burstiness 1; a constant
``1 / rate`` at burstiness ``inf``), from numpy's legacy generator seeded with ``--seed``: the
stream vLLM draws after ``np.random.seed(args.seed)``. They are summed into send times from the
start, the first request waiting for the first gap too, and those times scaled so that the last
falls at exactly ``num_prompts / rate`` (vLLM's normalization, which keeps the offered load
from varying by a few per cent between seeds). Requests are then sent at those times from the
start, so a slow event loop does not push every later request back. ``--request-rate inf`` sends
them all at once.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np


def check_arrivals(request_rate: float, burstiness: float) -> None:
    """A ValueError naming ``--request-rate`` or ``--burstiness`` unless it is above 0."""
    if not burstiness > 0:  # NaN too
        raise ValueError(f"--burstiness={burstiness} is invalid: it must be > 0")
    if not request_rate > 0:
        raise ValueError(f"--request-rate={request_rate} is invalid: it must be > 0 (or inf)")


def arrival_times(count: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start of the run at which each of ``count`` requests is sent."""
    check_arrivals(request_rate, burstiness)
    rng = np.random.RandomState(seed)
    gaps = []
    for _ in range(count):
        if math.isinf(request_rate):
            gaps.append(0.0)
        elif math.isinf(burstiness):
            gaps.append(1.0 / request_rate)
        else:
            gaps.append(float(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness))))
    times = list(itertools.accumulate(gaps))
    if times and times[-1] != 0:
        scale = count / request_rate / times[-1]
        times = [t * scale for t in times]
    return times


async def send_times(times: Sequence[float]) -> AsyncIterator[int]:
    """Yield each request's index once its time (seconds from the first call) has come."""
    start = time.perf_counter()
    for i, at in enumerate(times):
        wait = start + at - time.perf_counter()
        if at > 0 and wait > 0:
            await asyncio.sleep(wait)
        yield i
