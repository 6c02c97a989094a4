"""A command stopped part-way: SIGTERM (a job scheduler's time limit, ``timeout``, ``kill``)
stopping it as Ctrl-C does, a reader of its output that went away (``| head``), and the names and
exit codes of such stops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading

CTRL_C_EXIT = 128 + signal.SIGINT  # 130: the shell's status for a command a signal ended
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt (``sigterm_as_interrupt``). It is a
    KeyboardInterrupt so that asyncio and every ``except KeyboardInterrupt`` stop on it as on Ctrl-C."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within the block the first SIGTERM raises ``Terminated`` in the main thread; the handler
    from before the block takes any later one, and is back once the block ends. Outside the main
    thread (no handler can be set there), or where SIGTERM is ignored, nothing changes."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
        yield
        return
    previous = signal.SIG_DFL if previous is None else previous  # None: set outside Python

    def terminated(signum, frame):
        signal.signal(signal.SIGTERM, previous)
        raise Terminated("SIGTERM")

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


async def run_until_sigterm(awaitable) -> bool:
    """Await ``awaitable`` on the running loop; a SIGTERM cancels it, as ``asyncio.run`` cancels
    its task on Ctrl-C, and gives True (the caller raises ``Terminated`` once out of the loop).
    Within ``sigterm_as_interrupt`` the loop takes SIGTERM from its handler for the while: raised
    from the handler, ``Terminated`` could land in a finalizer (an HTTP client's stream closed
    during the cancel), which swallows it ("Exception ignored in ..."), and the run went on. The
    first SIGTERM gives the next back to the handler from before the block, as that handler does;
    without one set by Python (SIG_DFL, SIG_IGN) nothing changes."""
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler):
        await awaitable
        return False
    loop, task, hit = asyncio.get_running_loop(), asyncio.current_task(), []

    def on_sigterm() -> None:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, handler)
        with contextlib.suppress(KeyboardInterrupt):
            handler(signal.SIGTERM, None)  # sigterm_as_interrupt's: restores the handler from before
        hit.append(True)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        await awaitable
    except asyncio.CancelledError:
        if not hit:
            raise
    finally:
        if not hit:
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, handler)
    return bool(hit)


def stop_reason(error: BaseException) -> str:
    """Why a run stopped, as a partial ``--json``'s ``"interrupted"`` says it: "SIGTERM", "Ctrl-C",
    or the error's type and message."""
    if isinstance(error, Terminated):
        return "SIGTERM"
    if isinstance(error, KeyboardInterrupt):
        return "Ctrl-C"
    return f"{type(error).__name__}: {error}"


def interrupted_exit(error: KeyboardInterrupt) -> int:
    """The exit status of a command ``error`` stopped: 143 for SIGTERM, 130 for Ctrl-C."""
    return SIGTERM_EXIT if isinstance(error, Terminated) else CTRL_C_EXIT


def reader_gone_exit() -> int:
    """The exit status of a command whose output pipe's reader went away (``| head``): 1, quietly,
    as Unix tools stop. Standard output then points at the null device, so the interpreter's flush
    at exit raises no second BrokenPipeError."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
