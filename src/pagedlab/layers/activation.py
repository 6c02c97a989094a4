"""MLP activations by transformers' name: act(gate) * up on the fused gate_up projection (SiLU;
Gemma's GELU-tanh), and the plain GELUs of GPT-2/GPT-NeoX MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlab.layers.fusion import fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_GATED = {"silu": fused(silu_and_mul), "gelu_pytorch_tanh": fused(gelu_tanh_and_mul)}
# transformers' names: "gelu_new" (GPT-2) and "gelu_pytorch_tanh" are both the tanh approximation
_GELUS = {"gelu": fused(gelu), "gelu_new": fused(gelu_tanh), "gelu_pytorch_tanh": fused(gelu_tanh)}


class GatedActivation(nn.Module):
    """``act(gate) * up`` on the fused gate_up projection, ``act`` by transformers' name."""

    def __init__(self, name: str):
        super().__init__()
        if name not in _GATED:
            raise ValueError(f"hidden_act={name!r} is not supported: supported: {sorted(_GATED)}")
        self.fn = _GATED[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class Gelu(nn.Module):
    """The GELU that transformers calls ``name`` (exact or tanh-approximated)."""

    def __init__(self, name: str):
        super().__init__()
        if name not in _GELUS:
            raise ValueError(f"activation {name!r} is not supported here; supported: {sorted(_GELUS)}")
        self.fn = _GELUS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
