"""Fusing the small element-wise layers on the GPU.

``fused(fn)`` returns a callable that runs ``fn`` compiled by ``torch.compile`` (one Triton
kernel instead of several launches) for CUDA tensors, and ``fn`` itself elsewhere, so the CPU
path needs no compiler and both paths share one definition. ``PAGEDLAB_COMPILE=0`` turns
compilation off.

Shapes are left to dynamo's automatic dynamism: the first token count compiles a static kernel
and the second a kernel dynamic in the token dimension only. Hidden and head sizes stay static,
which on an H200 made these kernels 1.4-3.9x faster than ``dynamic=True`` (silu-mul over
8,192 x 28,672: 165 us against 419 us; RoPE over 8,192 tokens: 90 us against 350 us), since
indexing by a symbolic head size costs integer divisions per element.

Where pagedlab's kernels launch with programmatic dependent launch (``kernels/pdl.py``: on
Hopper unless ``PAGEDLAB_PDL=0``), these kernels do too, through Inductor's ``triton.enable_pdl``
(compiled separately from the PDL-off version, so the switch may change between calls). A torch
whose Inductor lacks the option compiles them without it. Inductor runs in its deterministic mode:
the PDL-on and PDL-off kernels, and every process, sum a norm in the same order (the race test in
``tests/test_pdl.py`` compares them bitwise; with Inductor's timed choice of reduction configs a
batch-3 step on the H200 differed by one bfloat16 step in a logprob).
"""

from __future__ import annotations

import functools
import os

import torch

from pagedlab.kernels.pdl import pdl_enabled


def inductor_options(pdl: bool) -> dict:
    """The ``torch.compile`` options of a fused layer, each where this torch's Inductor has it:
    ``deterministic`` always (no on-device benchmarking of configs that change the numbers: a
    reduction's config otherwise depends on timings taken at compile time, so two processes, or
    the PDL and PDL-off compilations of one norm, could sum in different orders), and Inductor's
    PDL code (``triton.enable_pdl``) where ``pdl``."""
    from torch._inductor import config

    options = {"deterministic": True} if hasattr(config, "deterministic") else {}
    if pdl and hasattr(config.triton, "enable_pdl"):
        options["triton.enable_pdl"] = True
    return options


def fused(fn):
    if os.environ.get("PAGEDLAB_COMPILE", "1") == "0":
        return fn

    @functools.cache
    def compiled(pdl: bool):  # built on first GPU use, so CPU-only runs never import the compiler
        _allow_recompiles()
        return torch.compile(fn, options=inductor_options(pdl) or None)

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args):
        return compiled(pdl_enabled(x.device))(x, *args) if x.is_cuda else fn(x, *args)

    return dispatch


def _allow_recompiles(per_function: int = 64, in_all: int = 1024) -> None:
    """Raise dynamo's recompile limits (8 per function, 256 in all by default). Each model shape,
    dtype and PDL setting compiles a fused layer anew, and all share one cache per function: a
    process that loads a few models (a lab sweep, the GPU tests) would otherwise run the rest
    eagerly, slower and with other roundings than a fresh process (on the H200 the PDL race test
    of the 8B shape hit the limit and its PDL-on and PDL-off logprobs differed)."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, per_function)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, in_all)

