"""Gated activation of the MLP: silu(gate) * up on the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlab.layers.fusion import fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


_silu_and_mul = fused(silu_and_mul)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _silu_and_mul(x)
