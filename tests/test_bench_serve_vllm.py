"""``pagedlab bench serve`` against ``vllm bench serve`` (``vllm/benchmarks/serve.py`` and
``lib/endpoint_request_func.py``): the same traffic gives the same figures. Each test checks
one definition on synthetic timings against values worked out by hand."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedlab.server.bench_traffic import arrival_times, send_times


def test_arrival_times_are_vllms_seeded_gamma_schedule_scaled_to_n_over_rate():
    """vLLM's get_request: gaps drawn by np.random.gamma(shape=burstiness, scale=1/(rate *
    burstiness)) after np.random.seed(seed), summed from the start (the first request waits for
    its gap too), then scaled so the last lands at num_prompts / rate. Seed 0's first three
    gamma(1, 0.5) draws are 0.397937, 0.627965, 0.461612; summed 0.397937, 1.025903, 1.487514;
    times 1.5 / 1.487514: 0.401277, 1.034514, 1.5. pagedlab sent the first request at 0 and slept
    unscaled gaps from Python's random, so its run at the same seed offered other traffic."""
    assert arrival_times(3, 2.0, 1.0, seed=0) == pytest.approx([0.401277, 1.034514, 1.5], abs=1e-6)
    assert arrival_times(40, 8.0, 0.25, seed=3)[-1] == pytest.approx(5.0)  # burstier, same span


def test_burstiness_inf_is_a_constant_gap_and_rate_inf_sends_everything_at_once():
    """vLLM: 'when burstiness tends to infinity, the delay time becomes constant' (1 / rate);
    pagedlab's gamma draw raised ValueError on the second request."""
    assert arrival_times(3, 4.0, float("inf")) == pytest.approx([0.25, 0.5, 0.75])
    assert arrival_times(3, float("inf"), 0.5) == [0.0, 0.0, 0.0]


def test_requests_go_at_their_times_from_the_start_however_slow_the_loop():
    """vLLM sleeps until start + delay_ts[i]; sleeping each gap after the last send pushed every
    later request back by the time spent between sends (here 40 ms a request)."""
    async def sent_at() -> list[float]:
        start, out = time.perf_counter(), []
        async for _ in send_times([0.05, 0.10, 0.15, 0.20]):
            out.append(time.perf_counter() - start)
            time.sleep(0.04)  # a busy loop between sends
        return out

    times = asyncio.run(sent_at())
    assert times == pytest.approx([0.05, 0.10, 0.15, 0.20], abs=0.025)
