"""The ``--json`` (``--output-json``) file of ``pagedlab bench throughput|latency``: every row
(``pagedlab.workloads.WorkloadResult``), the environment and the command as typed.

Each row also carries the keys ``vllm bench throughput --output-json`` and ``vllm bench latency
--output-json`` write, with vLLM's meaning and units (seconds), so a script reading vLLM's files
reads a row the same way: ``vllm_throughput_keys`` of the row's one run, ``vllm_latency_keys``
over every timed run of the row's configuration (its repeats, as vLLM's iterations).

A run stopped part-way writes the rows that finished, marked as ``pagedlab bench serve`` marks
its partial file: ``"partial": true`` and ``"interrupted"`` ("Ctrl-C", "SIGTERM" or the error).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

import pagedlab
from pagedlab.interrupt import stop_reason
from pagedlab.stats import describe
from pagedlab.workloads import WorkloadResult, configuration_label

# the percentiles ``vllm bench latency --output-json`` writes
VLLM_LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def environment() -> dict:
    """The versions and the GPU a benchmark ran on."""
    import transformers

    info = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__, "gpu": None, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info["pagedlab"] = pagedlab.__version__
    return info


def write_json(path: str, results: list[WorkloadResult], command: str,
               stopped: BaseException | None = None) -> None:
    """Every row with the environment and the command; ``stopped``: what stopped the run before
    its last row (the rows are those that finished), written as ``"partial": true``,
    ``"interrupted"`` (``stop_reason``, bench serve's) and ``"error"`` (its type and message)."""
    body = {"environment": environment(), "command": command, "results": rows_with_vllm_keys(results)}
    if stopped is not None:
        body.update(partial=True, interrupted=stop_reason(stopped),
                    error=f"{type(stopped).__name__}: {stopped}")
    Path(path).write_text(json.dumps(body, indent=2))


def rows_with_vllm_keys(results: list[WorkloadResult]) -> list[dict]:
    """Each row's ``to_dict()`` with ``vllm_throughput_keys`` of its run and ``vllm_latency_keys``
    of its configuration's runs (the rows of ``results`` that differ from it only in the repeat)."""
    runs: dict[tuple, list[float]] = {}
    for r in results:
        runs.setdefault(configuration(r), []).append(r.elapsed_s)
    return [{**r.to_dict(), **vllm_throughput_keys(r), **vllm_latency_keys(runs[configuration(r)])}
            for r in results]


def configuration(row: WorkloadResult) -> tuple[str, str, str]:
    """What the repeats of a run share: its workload, backend and label less the repeat number
    (" #N", which ``--repeats`` above 1 puts in a label)."""
    return row.workload, row.backend, configuration_label(row.label)


def vllm_throughput_keys(row: WorkloadResult) -> dict:
    """``vllm bench throughput --output-json``'s keys for one run: ``elapsed_time`` (s),
    ``num_requests``, ``total_num_tokens`` (prompt + output) and ``requests_per_second`` and
    ``tokens_per_second``, the latter of prompt + output tokens, as vLLM's (not output tokens)."""
    total = row.input_tokens + row.output_tokens
    return {"elapsed_time": row.elapsed_s, "num_requests": row.num_requests, "total_num_tokens": total,
            "requests_per_second": row.num_requests / row.elapsed_s,
            "tokens_per_second": total / row.elapsed_s}


def vllm_latency_keys(elapsed_s: list[float]) -> dict:
    """``vllm bench latency --output-json``'s keys over the timed runs of one batch, each a run
    of every request to its end (vLLM's iterations): ``avg_latency``, ``std_latency``
    (population), ``latencies`` and ``percentiles`` (10, 25, 50, 75, 90, 99; linear, numpy's),
    all in seconds."""
    described = describe(elapsed_s, VLLM_LATENCY_PERCENTILES)
    return {"avg_latency": described["mean"], "std_latency": described["std"], "latencies": list(elapsed_s),
            "percentiles": {q: described[str(q)] for q in VLLM_LATENCY_PERCENTILES}}
