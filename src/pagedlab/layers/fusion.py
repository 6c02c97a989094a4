"""Fusing the small element-wise layers on the GPU.

``fused(fn)`` returns a callable that runs ``fn`` compiled by ``torch.compile`` (one Triton
kernel instead of several launches) for CUDA tensors, and ``fn`` itself elsewhere, so the CPU
path needs no compiler and both paths share one definition. ``PAGEDLAB_COMPILE=0`` turns
compilation off.
"""

from __future__ import annotations

import functools
import os

import torch


def fused(fn):
    if os.environ.get("PAGEDLAB_COMPILE", "1") == "0":
        return fn

    @functools.cache
    def compiled():  # built on first GPU use, so CPU-only runs never import the compiler
        return torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args):
        return compiled()(x, *args) if x.is_cuda else fn(x, *args)

    return dispatch
