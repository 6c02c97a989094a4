"""The device side of programmatic dependent launch (``kernels/pdl.py`` holds the host side and
the rule of where a kernel may wait). Imports triton: import it from kernel modules only."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_wait_and_trigger(PDL: tl.constexpr):
    """With PDL: wait for the previous grid (its writes visible), then let the next kernel launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
