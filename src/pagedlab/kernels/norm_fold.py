"""An RMSNorm folded into the linear after it: ``FoldedRMSNorm`` is a linear's input given as the
norm still to apply, and its ``materialize`` the plain-torch reference of what the folding GEMVs
(``kernels/gemv.py``, ``kernels/w4a16.py``) compute in their prologue.

At decode batches a decoder layer's add + RMSNorm is a kernel of its own that reads a few KB
and sits on the step's critical path between two weight-bound GEMVs (twice a layer). Folded,
each program of the next GEMV takes the 1/rms of its rows of ``x + residual`` (reading them
whole first, or summing their squares in its loop), multiplies its weight tile by
``(x + residual) * weight`` and scales its sums by the 1/rms at the end; the GEMV also writes
``x + residual`` (the next residual) and, when a second consumer needs it, the normalized input.
The products differ from the unfused path's only in rounding: the unfused norm rounds its output
to the activations' dtype before the linear, the folded one keeps float32 until the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The most rows (decode batch) at which a norm folds into the GEMV after it, and the gate_up GEMV
# takes the SiLU-and-mul into its epilogue (``fold_rows``). The GEMVs do both at any of their 1-16
# rows (the tests run them), but on the H200 only one row has won (BENCHMARKS.md): folding at 4
# and 16 rows, each program then reading its rows one after another, cost 0.5-3.1 ms a step.
FOLD_MAX_ROWS = 1


def fold_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` ``[..., K]`` is a batch of at most ``FOLD_MAX_ROWS`` rows (read at each call,
    so that one assignment turns both folds up or down for A/B timing)."""
    return x.numel() <= FOLD_MAX_ROWS * x.shape[-1]


@dataclass(frozen=True)
class FoldedRMSNorm:
    """``rms_norm(x + residual) * weight`` (``residual`` None: of ``x``), ``x`` ``[rows, K]``, as a
    linear's input. Its consumer writes ``summed`` (``x + residual``; given with ``residual``) and
    ``normed`` (when given) whole, buffers apart from ``x`` and ``residual``."""

    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    summed: torch.Tensor | None
    normed: torch.Tensor | None

    @property
    def is_cuda(self) -> bool:
        """As ``x``'s (the linears' device test)."""
        return self.x.is_cuda

    def materialize(self) -> torch.Tensor:
        """The normalized input, after writing ``summed`` and ``normed`` as a folding GEMV does:
        the reference (``layers.norm.add_rms_norm``'s arithmetic)."""
        summed = self.x if self.residual is None else self.x + self.residual
        values = summed.float()
        values = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * values.to(self.x.dtype)
        if self.residual is not None:
            self.summed.copy_(summed)
        if self.normed is not None:
            self.normed.copy_(normed)
        return normed

    def check(self) -> None:
        """Raise ValueError unless the kernels can fold this: 2-D ``x`` with a contiguous last
        dimension, and ``residual``, ``summed`` and ``normed`` of its shape, dtype and strides."""
        x = self.x
        if x.dim() != 2 or x.stride(1) != 1 or self.weight.shape != (x.shape[1],):
            raise ValueError(f"a folded RMSNorm needs a 2-D x with a contiguous last dimension and a "
                             f"weight of its {x.shape[-1]} features, not x {tuple(x.shape)} and weight "
                             f"{tuple(self.weight.shape)}")
        for name in ("residual", "summed", "normed"):
            other = getattr(self, name)
            if other is not None and (other.shape != x.shape or other.stride() != x.stride() or
                                      other.dtype != x.dtype):
                raise ValueError(f"a folded RMSNorm's {name} {tuple(other.shape)} {other.dtype} strides "
                                 f"{other.stride()} must match x's {tuple(x.shape)} {x.dtype} {x.stride()}")
        if self.residual is not None and self.summed is None:
            raise ValueError("a folded RMSNorm with a residual needs the summed buffer it writes")
