"""Linear layers that can hold several HF weights fused into one matrix (q/k/v, gate/up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x W^T + b``. With several ``output_sizes``, the weight is the row-wise concatenation
    of that many checkpoint tensors, each loaded with its index as ``shard_id``."""

    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool = False):
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            target = param.data
        else:
            offset = sum(self.output_sizes[:shard_id])
            target = param.data.narrow(0, offset, self.output_sizes[shard_id])
        if target.shape != loaded.shape:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not match the expected "
                             f"{tuple(target.shape)}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
