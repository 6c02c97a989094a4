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


class _NamedActivation(nn.Module):
    """An activation chosen by transformers' name from the subclass's ``table``."""

    table: dict
    setting: str  # the config.json key that names it

    def __init__(self, name: str):
        super().__init__()
        if name not in self.table:
            raise ValueError(f"{self.setting}={name!r} is not supported: supported: {sorted(self.table)}")
        self.fn = self.table[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class GatedActivation(_NamedActivation):
    """``act(gate) * up`` on the fused gate_up projection, ``act`` by transformers' name."""

    table, setting = _GATED, "hidden_act"


class Gelu(_NamedActivation):
    """The GELU that transformers calls ``name`` (exact or tanh-approximated)."""

    table, setting = _GELUS, "activation"  # GPT-2's activation_function, GPT-NeoX's hidden_act
