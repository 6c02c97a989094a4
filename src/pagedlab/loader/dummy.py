"""Random weights from config.json alone: the way to benchmark real shapes without a checkpoint."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) weights drawn on the parameters' own device (an 8B model in seconds on a
    GPU); norm weights are 1."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.normal_(0.0, std, generator=generators[param.device])
