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

``--ramp-up-strategy linear`` or ``exponential`` (``RampUp``) moves the rate from
``--ramp-up-start-rps`` to ``--ramp-up-end-rps`` over the requests instead, as vLLM's
``_get_current_request_rate``: request ``i`` of ``n`` draws its gap at
``start + (end - start) * i / (n - 1)``, or ``start * (end / start) ** (i / (n - 1))``, with no
scaling of the sum; the run records when each whole rate is reached (``RpsChanges``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np


def check_arrivals(request_rate: float, burstiness: float) -> None:
    """A ValueError naming ``--request-rate`` or ``--burstiness`` unless it is above 0."""
    if not burstiness > 0:  # NaN too
        raise ValueError(f"--burstiness={burstiness} is invalid: it must be > 0")
    if not request_rate > 0:
        raise ValueError(f"--request-rate={request_rate} is invalid: it must be > 0 (or inf)")


RAMP_UP_STRATEGIES = ("linear", "exponential")


@dataclass(frozen=True)
class RampUp:
    """``--ramp-up-strategy`` from ``--ramp-up-start-rps`` to ``--ramp-up-end-rps`` (vLLM's
    flags, whole requests per second)."""

    strategy: str
    start_rps: int
    end_rps: int

    def rate(self, index: int, count: int) -> float:
        """The rate request ``index`` of ``count`` is sent at."""
        progress = index / max(count - 1, 1)
        if self.strategy == "linear":
            return self.start_rps + (self.end_rps - self.start_rps) * progress
        return self.start_rps * (self.end_rps / self.start_rps) ** progress


def ramp_up_from_flags(strategy: str | None, start_rps: int | None, end_rps: int | None,
                       request_rate: float) -> RampUp | None:
    """The ``RampUp`` the flags ask for (None without ``--ramp-up-strategy``); a ValueError naming
    the flag where vLLM refuses them. A start of 0 is refused for both strategies: vLLM takes it
    for ``linear`` and then stops on its first request ("Obtained non-positive request rate")."""
    if strategy is None:
        return None
    if strategy not in RAMP_UP_STRATEGIES:
        raise ValueError(f"--ramp-up-strategy {strategy!r} is invalid: {' or '.join(RAMP_UP_STRATEGIES)}")
    if not math.isinf(request_rate):
        raise ValueError("--ramp-up-strategy sets the request rate: leave out --request-rate")
    if start_rps is None or end_rps is None:
        raise ValueError("--ramp-up-strategy needs both --ramp-up-start-rps and --ramp-up-end-rps")
    if start_rps <= 0 or start_rps > end_rps:
        raise ValueError(f"--ramp-up-start-rps {start_rps} is invalid: it must be above 0 and at most "
                         f"--ramp-up-end-rps ({end_rps})")
    return RampUp(strategy, start_rps, end_rps)


def request_rates(count: int, request_rate: float, ramp_up: RampUp | None = None) -> list[float]:
    """The rate each of ``count`` requests is sent at: ``request_rate``, or the ramp's."""
    return [ramp_up.rate(i, count) if ramp_up else request_rate for i in range(count)]


def arrival_times(count: int, request_rate: float, burstiness: float = 1.0, seed: int = 0,
                  ramp_up: RampUp | None = None) -> list[float]:
    """Seconds from the start of the run at which each of ``count`` requests is sent."""
    check_arrivals(request_rate, burstiness)
    rng = np.random.RandomState(seed)
    gaps = []
    for rate in request_rates(count, request_rate, ramp_up):
        if math.isinf(rate):
            gaps.append(0.0)
        elif math.isinf(burstiness):
            gaps.append(1.0 / rate)
        else:
            gaps.append(float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))))
    times = list(itertools.accumulate(gaps))
    if ramp_up is None and times and times[-1] != 0:
        scale = count / request_rate / times[-1]
        times = [t * scale for t in times]
    return times


@dataclass
class RpsChanges:
    """vLLM's ``rps_change_events`` of a ramp: ``{"rps": r, "timestamp": ISO time}`` for the
    start rate when the run starts, then for each whole rate the first time a request is sent at
    or above it."""

    events: list[dict] = field(default_factory=list)
    last: int = -1

    def start(self, ramp_up: RampUp | None) -> None:
        if ramp_up is not None:
            self.last = ramp_up.start_rps
            self.events.append({"rps": self.last, "timestamp": datetime.now().isoformat()})

    def sent(self, rate: float) -> None:
        if self.events and int(rate) > self.last:
            now = datetime.now().isoformat()
            self.events += [{"rps": r, "timestamp": now} for r in range(self.last + 1, int(rate) + 1)]
            self.last = int(rate)


async def send_times(times: Sequence[float]) -> AsyncIterator[int]:
    """Yield each request's index once its time (seconds from the first call) has come."""
    start = time.perf_counter()
    for i, at in enumerate(times):
        wait = start + at - time.perf_counter()
        if at > 0 and wait > 0:
            await asyncio.sleep(wait)
        yield i
