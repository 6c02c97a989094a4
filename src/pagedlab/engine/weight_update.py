"""Updating a loaded model's weights in place (``LLM.load_weights``): an RL loop's rollout engine
takes the trainer's current policy without being rebuilt.

The new tensors go through the loader's own path (``models.checkpoint.load_checkpoint`` and the
family's ``route``: fused q/k/v and gate/up parts, Phi-3's fused tensors split, GPT-2's Conv1D
weights transposed, the padded vocabulary's zero rows, FP8 re-quantized from the dense weights
as a fresh load quantizes them), so the model ends as a fresh load of those tensors would leave
it. Every value is copied into the parameters' existing storage (never a new Parameter): the
captured CUDA graphs and the LoRA wrappers keep reading the same memory. Names and shapes are
checked before anything is written, so a bad tensor leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from pagedlab.models.checkpoint import check_checkpoint, load_checkpoint
from pagedlab.quantization.linear_method import AWQLinearMethod, FP8LinearMethod

WeightPairs = list[tuple[str, torch.Tensor]]


def weight_pairs(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> WeightPairs:
    """``weights`` (a state dict, or (name, tensor) pairs such as ``named_parameters()``) as a
    list of (name, tensor); anything else is a ValueError naming the entry."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    pairs = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"weights entry {item!r:.120} is invalid: give a dict of name -> torch.Tensor "
                             "(a state_dict) or (name, torch.Tensor) pairs, with the checkpoint's names")
        pairs.append(item)
    return pairs


def check_updatable(model: nn.Module, quantization: str | None) -> None:
    """Refuse formats whose loaded weights are no longer the checkpoint's tensors: AWQ (repacked at
    load) and FP8 checkpoints quantized beforehand (the update takes dense weights; online FP8,
    quantized at load, re-quantizes them)."""
    for name, module in model.named_modules():
        method = getattr(module, "linear_method", None)
        if isinstance(method, AWQLinearMethod):
            reason = "AWQ weights are repacked into the kernels' layout at load"
        elif isinstance(method, FP8LinearMethod) and not method.quantize_at_load:
            reason = ("the checkpoint's FP8 weights were quantized beforehand (only quantization='fp8' on a "
                      "dense checkpoint, quantized at load, re-quantizes updated dense weights)")
        else:
            continue
        raise ValueError(f"load_weights is not supported with quantization={quantization!r}: {reason} "
                         f"({name}); build a new LLM from the new checkpoint")


@torch.no_grad()
def update_weights(model: nn.Module, pairs: WeightPairs) -> set[str]:
    """Check every name and shape of ``pairs``, then copy them in (fused parameters keep the
    parts not given); returns the names of the parameters set."""
    check_checkpoint(model, pairs, model.route)
    return load_checkpoint(model, pairs, model.route, every_part=False)
