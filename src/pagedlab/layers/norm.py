"""RMSNorm and LayerNorm, each optionally fused with the residual add that precedes it.

An ``RMSNorm`` whose one consumer is an FP8 linear with dynamic per-token activation scales can
be told so at load (``emit_fp8``): it then returns its output quantized, ``QuantizedActivations``
in place of the tensor, from one kernel on CUDA (``kernels/batch_invariant.py``'s per-row norm
with its FP8 epilogue) and as ``rms_norm`` then ``quantize_fp8_per_row`` elsewhere (the
reference, and the CPU path), so the linear skips its own quantization launch.

An ``RMSNorm`` told its consumer at load (``fold_into``: a linear or MoE block with a
``folds_norm`` method) returns, where that consumer says it folds the norm into its GEMV
(decode batches on CUDA, up to ``FOLD_MAX_ROWS`` rows), a ``FoldedRMSNorm`` in place of the
tensor and launches nothing: the consumer's kernel computes the norm (``kernels/norm_fold.py``)
and writes ``x + residual`` into the buffer this norm returned as the residual.

A norm parameter's ``dummy_value`` is what ``load_format="dummy"`` fills it with (1 for a
scale, 0 for a bias), so random-weight models keep unit-scale activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlab.kernels.norm_fold import FoldedRMSNorm, fold_rows
from pagedlab.layers.batch_invariant import invariant_norm, runs_invariant_kernels
from pagedlab.layers.fusion import fused
from pagedlab.quantization.fp8 import QuantizedActivations


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return rms_norm(x, weight, eps), x


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scaled by ``1 + weight``, the product taken in float32."""
    x_float = x.float()
    x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
    return (x_float * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_unit_offset(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return rms_norm_unit_offset(x, weight, eps), x


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``rms_norm`` of the 2-D ``x`` (``add_rms_norm`` with ``residual``: then returns
    ``(normed, x + residual)``) with the normed output quantized per token: ``QuantizedActivations``
    for an FP8 linear. One Triton program per token on CUDA; ``quantize_fp8_per_row`` after the
    torch norm elsewhere (the kernel's reference)."""
    if weight.dtype != x.dtype:
        raise ValueError(f"an RMSNorm weight of {weight.dtype} on {x.dtype} activations: the FP8 output "
                         "needs them in one dtype")
    if x.is_cuda:
        from pagedlab.kernels.batch_invariant import rows_norm_triton

        return rows_norm_triton(x, weight, eps, residual=residual, fp8=True)
    if residual is None:
        return QuantizedActivations.of(rms_norm(x, weight, eps))
    normed, summed = add_rms_norm(x, residual, weight, eps)
    return QuantizedActivations.of(normed), summed


_RMS_NORMS = {False: (fused(rms_norm), fused(add_rms_norm)),
              True: (fused(rms_norm_unit_offset), fused(add_rms_norm_unit_offset))}


class RMSNorm(nn.Module):
    """RMSNorm scaled by ``weight``, or with ``unit_offset`` (Gemma) by ``1 + weight``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = _norm_parameter(hidden_size, 0.0 if unit_offset else 1.0)
        self.unit_offset = unit_offset
        self._norm, self._add_norm = _RMS_NORMS[unit_offset]
        self.fp8_output = False
        self.consumer_folds = None  # the consumer's folds_norm (fold_into), held as a method, not a submodule
        self.consumer_takes_normed_copy = False

    def emit_fp8(self, wanted: bool) -> bool:
        """Load-time switch: whether ``forward`` returns its output as ``QuantizedActivations``
        (``wanted``: its one consumer is an FP8 linear with dynamic per-token activation scales);
        Gemma's ``unit_offset`` norms keep their tensor. Returns the setting."""
        self.fp8_output = wanted and not self.unit_offset
        return self.fp8_output

    def fold_into(self, consumer) -> bool:
        """Load-time switch: let ``consumer`` (the one module this norm's output goes to, with a
        ``folds_norm(x)`` method and a ``takes_normed_copy`` flag) compute the norm in its GEMV at
        the batches it says; not for Gemma's ``unit_offset`` norms or a norm that emits FP8.
        Returns whether it folds."""
        folds = not self.unit_offset and not self.fp8_output and hasattr(consumer, "folds_norm")
        self.consumer_folds = consumer.folds_norm if folds else None
        self.consumer_takes_normed_copy = folds and consumer.takes_normed_copy
        return folds

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual`` returns norm(x); with it returns (norm(x + residual), x + residual).
        After ``emit_fp8(True)`` the norm comes as ``QuantizedActivations`` (in batch-invariant
        mode, which runs dense weights only, as the tensor)."""
        if runs_invariant_kernels(x):
            return invariant_norm(x, self.weight, self.eps, unit_offset=self.unit_offset, residual=residual)
        if self.fp8_output:
            return rms_norm_fp8(x, self.weight, self.eps, residual)
        if self.consumer_folds is not None and fold_rows(x) and self.consumer_folds(x):
            return self._folded(x, residual)
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)

    def _folded(self, x: torch.Tensor, residual: torch.Tensor | None):
        """The norm as its consumer's ``FoldedRMSNorm`` (with the residual buffer it fills)."""
        summed = None if residual is None else torch.empty_like(x)
        normed = torch.empty_like(x) if self.consumer_takes_normed_copy else None
        folded = FoldedRMSNorm(x, residual, self.weight, self.eps, summed, normed)
        return folded if residual is None else (folded, summed)


def rms_norm_then_add_rms_norm_unit_offset(x: torch.Tensor, residual: torch.Tensor, first: torch.Tensor,
                                           second: torch.Tensor, eps: float):
    """Gemma's norm after a block, the residual add and the norm before the next:
    (second(first(x) + residual), first(x) + residual)."""
    return add_rms_norm_unit_offset(rms_norm_unit_offset(x, first, eps), residual, second, eps)


_norm_then_add_norm = fused(rms_norm_then_add_rms_norm_unit_offset)


def norm_then_add_norm(x: torch.Tensor, residual: torch.Tensor, first: RMSNorm, second: RMSNorm):
    """``second(first(x), residual)``: Gemma's post-attention norm, residual add and
    pre-feed-forward norm, one compiled kernel on the GPU instead of two launches a layer
    (batch-invariant mode, and norms other than Gemma's, run the two modules)."""
    if runs_invariant_kernels(x) or not (first.unit_offset and second.unit_offset) or first.eps != second.eps:
        return second(first(x), residual)
    return _norm_then_add_norm(x, residual, first.weight, second.weight, first.eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), weight.shape, weight.float(), bias.float(), eps).to(x.dtype)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float):
    x = x + residual
    return layer_norm(x, weight, bias, eps), x


_layer_norm = fused(layer_norm)
_add_layer_norm = fused(add_layer_norm)


class LayerNorm(nn.Module):
    """LayerNorm with a bias (GPT-2, GPT-NeoX), computed in float32; the same residual API as
    ``RMSNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = _norm_parameter(hidden_size, 1.0)
        self.bias = _norm_parameter(hidden_size, 0.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual`` returns norm(x); with it returns (norm(x + residual), x + residual)."""
        if runs_invariant_kernels(x):
            return invariant_norm(x, self.weight, self.eps, bias=self.bias, residual=residual)
        if residual is None:
            return _layer_norm(x, self.weight, self.bias, self.eps)
        return _add_layer_norm(x, residual, self.weight, self.bias, self.eps)


def _norm_parameter(size: int, value: float) -> nn.Parameter:
    param = nn.Parameter(torch.full((size,), value), requires_grad=False)
    param.dummy_value = value
    return param
