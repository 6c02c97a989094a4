"""Programmatic dependent launch (PDL, Hopper and later) for the step's kernels.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it on the stream
drains: its programs run until ``tl.extra.cuda.gdc_wait()``, which returns once the previous grid
has finished and its writes are visible. A kernel that reads only constant data before the wait
(a linear layer's weights) overlaps that read with the previous kernel's tail and its own launch;
``tl.extra.cuda.gdc_launch_dependents()`` then lets the next PDL kernel launch early in turn. A
CUDA graph keeps the launch attribute as a programmatic edge. ``benchmarks/pdl_probe.py`` measured
it on an H200: 1.4 us less per kernel boundary in a chain of batch-1 GEMVs.

A kernel opts in with a ``PDL: tl.constexpr`` parameter (no default: a launch that forgets
``**pdl_launch(device)`` fails instead of running without PDL) and calls
``pdl_wait_and_trigger(PDL)`` (``kernels/pdl_jit.py``; this module stays importable without
triton). ``pdl_launch`` sets the flag and the launch option from one place, so a kernel never runs
early without waiting. The rule: before the wait a program reads only data that no kernel of the
step writes (weights, scales) and writes nothing (not even scratch: the caching allocator may hand
the previous kernel's buffers to this one); the trigger right after the wait is safe, since the
next kernel still waits for this whole grid. Every pagedlab Triton kernel of a step takes part:

- waiting after a constant read: the one-row dense/FP8 GEMV (its first weight tile; with the
  LoRA epilogue also the step's token slots, written before the step, and the LoRA shrink's sums
  after the wait; the dot and multi-row paths wait first), the AWQ GEMV (its first K step's
  words, zero points and scales), the AWQ dequantize kernel (its whole tile, stored after the
  wait), the per-row norm (its weight row; batch-invariant, or
  with the FP8 epilogue before an FP8 linear);
- waiting after reading step inputs: paged attention in decode and the split-KV reduces (their
  sequences' query starts and lengths: on an H200, Qwen3-30B-A3B W-seed batch 1 2.467 -> 2.411
  ms a step; BENCHMARKS.md, session 33). A split decode attention launch also reads each
  program's first key tile's block ids and asks L2 for that tile's K and V rows
  (``prefetch.global.L2``: a hint whose value is never used, so a slot the step's KV write fills
  meanwhile is read again after the wait; 2.407 -> 2.386 ms, session 34);
- waiting first: paged attention outside decode, the KV write (plain, and fused with the
  q/k norms and rotary embedding), the AWQ GEMM, FP8 per-token quantization (alone or
  reading the SiLU-and-mul), the LoRA expand, the batch-invariant matmul and softmax, the MoE
  route, align, gate-up, down and reduce kernels and the MoE GEMVs (their weights hang on the
  step's routing).

Two kernels stay out. The one-shot all-reduce runs only with tensor parallelism, its programs spin
on flags that other GPUs raise, and no multi-GPU race test covers an early start. The LoRA shrink
measured slower with PDL (on an H200, W-seed batch 1 with 8 adapters: 5.08 ms a step with it,
4.79 without, every other kernel PDL-launched; BENCHMARKS.md, 2026-12-02). The torch.compile
kernels (norms, SiLU-mul, the torch backend's rotary) follow the same switch through Inductor's
own PDL code (``layers/fusion.py``). On by default on Hopper and later; ``PAGEDLAB_PDL=0`` turns
it off. On an H200 (BENCHMARKS.md, 2026-12-01 and 2026-12-02) W-seed batch 1 ran faster with PDL
in every row: bf16 4.18-4.23 against 4.43 ms, FP8 weights 3.02 against 3.34, AWQ 2.53 against
2.71, Gemma-2-9B 5.73 against 5.84, Qwen3-30B-A3B 2.83-2.85 against 3.08, batch-invariant 4.56
against 4.78, eight LoRA adapters 4.79 against 4.96.
``tests/test_kernels_hopper_compile.py`` checks every kernel's PDL code on the CPU,
``tests/test_pdl.py`` the engine's tokens and logprobs bitwise against PDL off.
"""

from __future__ import annotations

import os

import torch

from pagedlab.kernels.device import compute_capability


def _device_supports_pdl(index: int) -> bool:
    return compute_capability(torch.device("cuda", index))[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: on a CUDA device of compute capability 9 or
    more (never the CPU interpreter, which has no ``gdc_*``) unless ``PAGEDLAB_PDL=0``."""
    if device.type != "cuda" or os.environ.get("PAGEDLAB_PDL", "1") == "0":
        return False
    return _device_supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> dict:
    """The keyword arguments of a PDL-aware kernel's launch on ``device``: its ``PDL`` flag and,
    where on, Triton's ``launch_pdl`` option."""
    return dict(PDL=True, launch_pdl=True) if pdl_enabled(device) else dict(PDL=False)
