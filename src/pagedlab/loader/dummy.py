"""Random weights from config.json alone: the way to benchmark real shapes without a checkpoint.

The numbers do not depend on the tensor-parallel world size: every rank draws each sharded
parameter's FULL checkpoint tensors from the seeded generator, in the model's parameter order,
and keeps its own part through the parameter's weight loader, so a TP=N model holds exactly the
shards of the TP=1 model of the same seed. The cost: each rank draws the whole model's numbers,
N times the draws of its own shards (70e9 for Llama-3-70B; not measured, but a GPU's generator
writes at memory speed, so about a second), and holds one full tensor at a time besides its
shards (the largest: the embedding, 2.1 GB in bf16 for Llama-3-70B).

A quantized linear (AWQ) draws the same dense normal weight and holds its round-to-nearest
4-bit quantization (``quantize_awq``), so its format is real and the draws match the dense model.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlab.quantization.awq import quantize_awq


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) weights drawn on the parameters' own device (an 8B model in seconds on a
    GPU); norm parameters hold their ``dummy_value`` (scales 1, biases 0)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if getattr(param, "dummy_value", None) is not None:  # norm scales and biases
            param.fill_(param.dummy_value)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith((".qzeros", ".scales")):
            continue  # set with the layer's qweight
        if name.endswith(".qweight"):
            _init_dummy_awq(model.get_submodule(name.removesuffix(".qweight")), generators[param.device], std)
            continue
        shapes = getattr(param, "checkpoint_shapes", None)
        if shapes is None:  # every rank holds it whole
            param.normal_(0.0, std, generator=generators[param.device])
            continue
        # fused parts (q/k/v, gate/up) are drawn as one tensor, as the TP=1 parameter is
        rows = [shape[0] for shape in shapes]
        full = torch.empty((sum(rows), *shapes[0][1:]), dtype=param.dtype, device=param.device)
        full.normal_(0.0, std, generator=generators[param.device])
        for shard_id, part in enumerate(full.split(rows)):
            param.weight_loader(param, part, shard_id if len(shapes) > 1 else None)


def _init_dummy_awq(layer: nn.Module, generator: torch.Generator, std: float) -> None:
    """Draw the layer's full dense weight (parts fused as in the dense model), quantize each part
    and load this rank's share of its qweight, qzeros and scales."""
    shapes = layer.dense_checkpoint_shapes
    rows = [shape[0] for shape in shapes]
    full = torch.empty((sum(rows), shapes[0][1]), dtype=layer.scales.dtype, device=layer.scales.device)
    full.normal_(0.0, std, generator=generator)
    for shard_id, part in enumerate(full.split(rows)):
        packed = quantize_awq(part.t(), layer.linear_method.group_size)
        for param, tensor in zip((layer.qweight, layer.qzeros, layer.scales), packed):
            param.weight_loader(param, tensor, shard_id if len(shapes) > 1 else None)
