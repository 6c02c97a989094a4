"""Programmatic dependent launch (PDL, Hopper and later) for the decode-step kernels.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it on the stream
drains: its programs run until ``tl.extra.cuda.gdc_wait()``, which returns once the previous grid
has finished and its writes are visible. A kernel that reads only constant data before the wait
(a linear layer's weights) overlaps that read with the previous kernel's tail and its own launch;
``tl.extra.cuda.gdc_launch_dependents()`` then lets the next PDL kernel launch early in turn. A
CUDA graph keeps the launch attribute as a programmatic edge. ``benchmarks/pdl_probe.py`` measured
it on an H200: 1.4 us less per kernel boundary in a chain of batch-1 GEMVs.

A kernel opts in with a ``PDL: tl.constexpr`` flag that guards its wait and trigger, and is
launched with ``**pdl_launch(device)``: the flag and the launch option come from one place, so a
kernel never runs early without waiting. It is off unless ``PAGEDLAB_PDL=1``: in the engine the
GEMVs sit between kernels that do not take part (norms, attention), and W-seed batch-1 TPOT was
0.06 ms worse with it on (BENCHMARKS.md, 2026-12-01); it pays once the whole step's chain does.
"""

from __future__ import annotations

import os
from functools import cache

import torch


@cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: with ``PAGEDLAB_PDL=1``, on a CUDA device of
    compute capability 9 or more (never the CPU interpreter, which has no ``gdc_*``)."""
    if device.type != "cuda" or os.environ.get("PAGEDLAB_PDL", "0") != "1":
        return False
    return _device_supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> dict:
    """The keyword arguments of a PDL-aware kernel's launch on ``device``: its ``PDL`` flag and,
    where on, Triton's ``launch_pdl`` option."""
    return dict(PDL=True, launch_pdl=True) if pdl_enabled(device) else dict(PDL=False)
