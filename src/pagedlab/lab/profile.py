"""``--profile DIR`` of ``pagedlab bench`` and ``pagedlab run``: a stretch of an LLM's steps under
the torch profiler (``LLM.start_profile()`` / ``stop_profile()``), written to a directory as

- the Chrome/Perfetto trace (``pagedlab-trace-*.json``: open it in https://ui.perfetto.dev or
  chrome://tracing), with a ``pagedlab.step`` range per engine step and its phases;
- ``profile.json``: the ``ProfileSummary`` (kernels, time by kind, each step kind's count, wall
  and device time and host-gap share);
- ``kernels.txt``: the kernel table grouped by kind (attention, GEMM, element-wise,
  communication, sampling, other: copies and fills) and the host-gap share of each step kind.

``profiled(llm, directory)`` wraps the code to profile and yields the record a result keeps of
it (the files and the headline figures).
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

SUMMARY_FILE = "profile.json"
KERNEL_TABLE_FILE = "kernels.txt"


@contextlib.contextmanager
def profiled(llm, directory: str | Path):
    """Profile the steps ``llm`` runs inside the block into ``directory``; the yielded dict is
    filled, on leaving the block, with ``profile_record``'s fields."""
    directory = Path(directory)
    record: dict = {}
    llm.start_profile(str(directory))
    try:
        yield record
    finally:
        summary = llm.stop_profile()
        record.update(save_profile(summary, directory))


def profile_subdir(root: str | Path, label: str) -> Path:
    """``root/label`` with the label made a safe directory name (``bs=4 #2`` -> ``bs_4_2``)."""
    return Path(root) / (re.sub(r"[^\w.-]+", "_", label).strip("_") or "profile")


def save_profile(summary, directory: str | Path) -> dict:
    """Write ``profile.json`` and ``kernels.txt`` beside the trace; returns the record a stored
    result keeps: the three files, time per kernel kind and each step kind's count and host-gap
    share."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    summary_path = directory / SUMMARY_FILE
    summary_path.write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    table_path = directory / KERNEL_TABLE_FILE
    table_path.write_text(format_kernel_table(summary) + "\n")
    return {"dir": str(directory), "trace": summary.trace_path, "summary": str(summary_path),
            "kernel_table": str(table_path), "time_by_kind_us": dict(summary.time_by_kind_us),
            "steps": {kind: s["count"] for kind, s in summary.steps.items()},
            "host_gap_share": {kind: s["host_gap_share"] for kind, s in summary.steps.items()}}


def format_kernel_table(summary, per_kind: int = 10) -> str:
    """Each step kind's wall and device time and host-gap share, then each kernel kind's total and
    share followed by its ``per_kind`` longest kernels (on the CPU: aten operators)."""
    lines = [f"trace: {summary.trace_path}", "", "step kind   steps   wall ms/step  device ms/step  host gap"]
    for kind, s in summary.steps.items():
        count = max(s["count"], 1)
        gap = "n/a (no GPU)" if s["host_gap_share"] is None else f"{s['host_gap_share']:.1%}"
        lines.append(f"{kind:<10} {s['count']:6d}  {s['wall_us'] / count / 1e3:12.3f}  "
                     f"{s['device_us'] / count / 1e3:14.3f}  {gap}")
    total = sum(summary.time_by_kind_us.values()) or 1.0
    for kind, kind_us in sorted(summary.time_by_kind_us.items(), key=lambda kv: -kv[1]):
        lines += ["", f"{kind}: {kind_us / 1e3:.3f} ms ({kind_us / total:.1%})"]
        members = [k for k in summary.kernels if k["kind"] == kind][:per_kind]
        lines += [f"  {k['total_us'] / 1e3:10.3f} ms {k['calls']:7d} calls  {k['name'][:100]}"
                  for k in members]
    return "\n".join(lines)
