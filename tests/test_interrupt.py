"""SIGTERM as Ctrl-C (``pagedlab.interrupt``): real signals to this process."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from pagedlab.interrupt import (Terminated, interrupted_exit, run_until_sigterm, sigterm_as_interrupt,
                                stop_reason)


@pytest.fixture
def handler_before():
    """A SIGTERM handler that records each call, in place while the test runs."""
    calls = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGTERM, before)


def test_the_first_sigterm_stops_as_ctrl_c_and_a_second_goes_to_the_handler_before(handler_before):
    with sigterm_as_interrupt():
        with pytest.raises(KeyboardInterrupt) as stopped:
            signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # a second one: the caller's handler, no Terminated
        assert handler_before == [signal.SIGTERM]
    assert isinstance(stopped.value, Terminated)
    assert (stop_reason(stopped.value), interrupted_exit(stopped.value)) == ("SIGTERM", 143)
    assert (stop_reason(KeyboardInterrupt()), interrupted_exit(KeyboardInterrupt())) == ("Ctrl-C", 130)
    assert stop_reason(RuntimeError("CUDA out of memory")) == "RuntimeError: CUDA out of memory"
    signal.raise_signal(signal.SIGTERM)  # after the block: the caller's handler again
    assert handler_before == [signal.SIGTERM] * 2


def test_a_sigterm_ignored_before_stays_ignored():
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with sigterm_as_interrupt():
            signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


class _SigtermInAFinalizer:
    """Sends this process SIGTERM from its finalizer, where an exception raised is only printed
    ("Exception ignored in ..."): as an HTTP stream closed during a cancel met the signal."""

    def __del__(self):
        signal.raise_signal(signal.SIGTERM)


def test_a_sigterm_in_a_finalizer_still_stops_the_run_on_the_loop(handler_before):
    """Raised from the handler, Terminated died in the finalizer and the run slept on to its end
    (bench serve's stop test then saw exit 0 and all requests sent, about 1 run in 12)."""
    async def run() -> str:
        _SigtermInAFinalizer()  # dropped at once: its finalizer sends SIGTERM
        await asyncio.sleep(5)
        return "ran to the end"

    with sigterm_as_interrupt():
        started = time.perf_counter()
        assert asyncio.run(run_until_sigterm(run())) is True
        assert time.perf_counter() - started < 2
        signal.raise_signal(signal.SIGTERM)  # a second one: the caller's handler
        assert handler_before == [signal.SIGTERM]

    async def finishes() -> None:
        await asyncio.sleep(0)

    with sigterm_as_interrupt():
        assert asyncio.run(run_until_sigterm(finishes())) is False
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, handler_before)  # the block's again
