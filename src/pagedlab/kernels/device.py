"""Facts of a CUDA device that the kernels' launches depend on, asked once per device (a driver
call per launch would sit on the step's hot path). Imports torch only."""

from __future__ import annotations

from functools import cache

import torch


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def compute_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of the CUDA ``device`` (its index, else the current device)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())
