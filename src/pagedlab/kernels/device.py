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


def tma_loads(*operands: torch.Tensor) -> bool:
    """Whether a kernel may read these 2-D operands through TMA tensor descriptors: on Hopper or
    later (and in the interpreter, which runs them on the CPU), where each starts on 16 bytes and
    its rows lie a multiple of 16 bytes apart, as TMA requires."""
    device = operands[0].device
    if device.type == "cuda" and compute_capability(device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in operands)
