"""A benchmark's work in child Python processes, so that a kernel that kills its CUDA context (an
illegal memory access is sticky: every later CUDA call in that process fails) or hangs loses only
itself. The child prints protocol messages (``emit``: one JSON object a line after
``MESSAGE_PREFIX``) among its ordinary output; the parent (``child_messages``) yields them as
they come, echoes the other lines, and kills the child when it goes quiet too long.

``run_resumable`` runs a list of numbered items (a benchmark's candidates) that way: the child
emits ``begin`` (``record``: the item's record so far, with its ``index``) before an item,
``record`` for each finished record (an item's carries its ``index``), ``info`` once and
``done`` at the end; a child that ends without ``done`` is followed by another from the next
item on.
"""

from __future__ import annotations

import collections
import json
import queue
import subprocess
import threading
import time
from collections.abc import Iterator

MESSAGE_PREFIX = "@child-message "
# Lines of a child's other output kept to explain its end.
TAIL_LINES = 30
# A child printing nothing for this long hangs (a candidate compiles and runs in seconds).
LINE_TIMEOUT_S = 60.0


def emit(kind: str, **fields) -> None:
    """Print one protocol message (a ``kind`` and JSON-able fields) for the parent."""
    print(MESSAGE_PREFIX + json.dumps(dict(kind=kind, **fields)), flush=True)


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def child_messages(argv: list[str], line_timeout_s: float, end_time: float) -> Iterator[dict]:
    """Run ``argv`` (stderr merged into stdout); yield each message it emits, print its other lines,
    and last yield ``{"kind": "ended", "rc", "timed_out", "tail"}``: its exit status, whether it
    was killed for printing nothing for ``line_timeout_s`` seconds or past ``end_time`` (epoch
    seconds), and the last lines of its other output since its last message (a crash's
    traceback)."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    timed_out = False
    while True:
        try:
            line = lines.get(timeout=max(0.1, min(line_timeout_s, end_time - time.time())))
        except queue.Empty:
            timed_out = True
            process.kill()
            break
        if line is None:
            break
        if line.startswith(MESSAGE_PREFIX):
            tail.clear()  # what the child prints after its last message tells why it ended
            yield json.loads(line[len(MESSAGE_PREFIX):])
        else:
            print(line, end="", flush=True)
            tail.append(line.rstrip("\n"))
    yield dict(kind="ended", rc=process.wait(), timed_out=timed_out, tail=list(tail))


def run_resumable(base: dict, argv_for, count: int, end_time: float, on_error,
                  line_timeout_s: float = LINE_TIMEOUT_S) -> tuple[list[dict], dict]:
    """Items ``0..count-1`` in child processes (``argv_for(first, records)``: a child that runs
    from item ``first`` on, after ``records``): a child that dies or hangs in an item loses that
    item (its ``begin`` record with an ``error``) and a new child goes on from the next, as after
    one that stopped after an item; one that dies before any item loses all (``base`` with
    ``kernel`` "all" and the ``error``). ``on_error(record)`` reports each record made here. The
    records and the first ``info`` message."""
    records: list[dict] = []
    info: dict = {}
    first = 0
    while first < count:
        begun, last, done, ended = None, None, False, {}
        for message in child_messages(argv_for(first, records), line_timeout_s, end_time):
            if message["kind"] == "record":
                records.append(message["record"])
                if "index" in message["record"]:
                    last, begun = message["record"]["index"], None
            elif message["kind"] == "begin":
                begun = message["record"]
            elif message["kind"] == "info":
                info = info or message
            done = done or message["kind"] == "done"
            ended = message if message["kind"] == "ended" else ended
        if done:
            break
        why = (f"child killed: no output for {line_timeout_s:.0f} s, or past the end"
               if ended["timed_out"] else f"child exited with status {ended['rc']}")
        error = "\n".join([why, *ended["tail"][-12:]])
        if begun is None and last is None:
            records.append(dict(base, kernel="all", error=error))
            on_error(records[-1])
            break
        if begun is not None:
            records.append(dict(begun, error=error))
            on_error(records[-1])
            last = begun["index"]
        first = last + 1
    return records, info
