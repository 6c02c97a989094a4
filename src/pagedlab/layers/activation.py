"""MLP activations by transformers' name: act(gate) * up on the fused gate_up projection (SiLU;
Gemma's GELU-tanh), and the plain GELUs of GPT-2/GPT-NeoX MLPs.

A SiLU ``GatedActivation`` whose consumer is an FP8 linear with dynamic per-token activation
scales can be told so at load (``emit_fp8``): it then returns ``QuantizedActivations``, from one
Triton launch on CUDA (``kernels/fp8_linear.silu_and_mul_fp8_triton``) and as ``silu_and_mul``
then ``quantize_fp8_per_row`` elsewhere (the reference, and the CPU path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlab.layers.fusion import fused
from pagedlab.quantization.fp8 import QuantizedActivations


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_fp8(x: torch.Tensor) -> QuantizedActivations:
    """``silu_and_mul`` of the 2-D ``x`` quantized per token for an FP8 linear: one Triton
    launch on CUDA, ``quantize_fp8_per_row`` after the torch function elsewhere (its reference)."""
    if x.is_cuda:
        from pagedlab.kernels.fp8_linear import silu_and_mul_fp8_triton

        return silu_and_mul_fp8_triton(x)
    return QuantizedActivations.of(silu_and_mul(x))


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_GATED = {"silu": fused(silu_and_mul), "gelu_pytorch_tanh": fused(gelu_tanh_and_mul)}
# transformers' names: "gelu_new" (GPT-2), "gelu_fast" (GPT-NeoX-20B) and "gelu_pytorch_tanh" are all
# the tanh approximation, written out differently
_GELU_TANH = fused(gelu_tanh)
_GELUS = {"gelu": fused(gelu), **dict.fromkeys(("gelu_new", "gelu_fast", "gelu_pytorch_tanh"), _GELU_TANH)}


class _NamedActivation(nn.Module):
    """An activation chosen by transformers' name from the subclass's ``table``; ``setting`` is
    the config.json key that named it (an unsupported name is an error naming both)."""

    table: dict

    def __init__(self, name: str, setting: str):
        super().__init__()
        if name not in self.table:
            raise ValueError(f"{setting}={name!r} is not supported: supported: {sorted(self.table)}")
        self.fn = self.table[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class GatedActivation(_NamedActivation):
    """``act(gate) * up`` on the fused gate_up projection, ``act`` by transformers' name."""

    table = _GATED

    def __init__(self, name: str, setting: str = "hidden_act"):
        super().__init__(name, setting)
        self.name = name
        self.fp8_output = False

    def emit_fp8(self, wanted: bool) -> bool:
        """Load-time switch: whether ``forward`` returns ``QuantizedActivations`` (``wanted``: its
        consumer is an FP8 linear with dynamic per-token activation scales); only SiLU has the
        fused kernel. Returns the setting."""
        self.fp8_output = wanted and self.name == "silu"
        return self.fp8_output

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedActivations:
        return silu_and_mul_fp8(x) if self.fp8_output else self.fn(x)


class Gelu(_NamedActivation):
    """The GELU that transformers calls ``name`` (exact or tanh-approximated)."""

    table = _GELUS
