"""Random weights from config.json alone: the way to benchmark real shapes without a checkpoint.

The numbers do not depend on the tensor-parallel world size: every rank draws each sharded
parameter's FULL checkpoint tensors from the seeded generator, in the model's parameter order,
and keeps its own part through the parameter's weight loader, so a TP=N model holds exactly the
shards of the TP=1 model of the same seed. The cost: each rank draws the whole model's numbers,
N times the draws of its own shards (70e9 for Llama-3-70B; not measured, but a GPU's generator
writes at memory speed, so about a second), and holds one full tensor at a time besides its
shards (the largest: the embedding, 2.1 GB in bf16 for Llama-3-70B).

Every linear layer draws its dense weight (fused parts as one tensor, as the dense model does)
and loads it through ``load_dense_weight``, which quantizes it in the layer's format (AWQ
round-to-nearest 4-bit, FP8 per channel) before cutting: a quantized model's format is real and
its draws are the dense model's.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02,
                       dtype: torch.dtype | None = None) -> None:
    """Normal(0, std) weights drawn on the parameters' own device (an 8B model in seconds on a
    GPU); norm parameters hold their ``dummy_value`` (scales 1, biases 0). Dense weights of
    quantized linears are drawn in ``dtype`` (default: torch's default dtype), the model's."""
    dtype = dtype or torch.get_default_dtype()
    linears = {name: module for name, module in model.named_modules()
               if hasattr(module, "dense_checkpoint_shapes")}
    generators: dict[torch.device, torch.Generator] = {}
    drawn: set[str] = set()
    for name, param in model.named_parameters():
        if getattr(param, "dummy_value", None) is not None:  # norm scales and biases
            param.fill_(param.dummy_value)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        generator = generators[param.device]
        layer_name, _, leaf = name.rpartition(".")
        if layer_name in linears and leaf != "bias":
            if layer_name not in drawn:  # its other parameters are set with it
                drawn.add(layer_name)
                layer = linears[layer_name]
                _load_parts(layer.load_dense_weight, layer.dense_checkpoint_shapes, dtype, param.device,
                            generator, std)
            continue
        shapes = getattr(param, "checkpoint_shapes", None)
        if shapes is None:  # every rank holds it whole
            param.normal_(0.0, std, generator=generator)
            continue
        _load_parts(lambda part, shard_id, p=param: p.weight_loader(p, part, shard_id), shapes, param.dtype,
                    param.device, generator, std)


def _load_parts(load, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                generator: torch.Generator, std: float) -> None:
    """Draw the full tensor of every part as one (fused q/k/v and gate/up as the TP=1 parameter
    is) and hand each part to ``load(part, shard_id)``."""
    rows = [shape[0] for shape in shapes]
    full = torch.empty((sum(rows), *shapes[0][1:]), dtype=dtype, device=device)
    full.normal_(0.0, std, generator=generator)
    for shard_id, part in enumerate(full.split(rows)):
        load(part, shard_id if len(shapes) > 1 else None)
