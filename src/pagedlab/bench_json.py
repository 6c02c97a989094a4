"""The ``--json`` file of ``pagedlab bench throughput|latency``: every row
(``pagedlab.workloads.WorkloadResult``), the environment and the command as typed."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

import pagedlab
from pagedlab.workloads import WorkloadResult


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


def write_json(path: str, results: list[WorkloadResult], command: str, error: str | None = None) -> None:
    """Every row with the environment and the command; ``error``: why the run stopped before its
    last row (the rows are those that finished)."""
    body = {"environment": environment(), "command": command, "results": [r.to_dict() for r in results]}
    if error is not None:
        body["error"] = error
    Path(path).write_text(json.dumps(body, indent=2))
