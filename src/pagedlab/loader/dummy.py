"""Random weights from config.json alone: the way to benchmark real shapes without a checkpoint."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
        param.copy_(values)
