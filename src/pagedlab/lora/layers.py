"""LoRA around the model's linears: ``LoRALinear`` adds each token's adapter to a base linear's
output, with every GPU slot's weights in preallocated stacked buffers (the layout
``pagedlab.kernels.lora`` describes), so a CUDA graph captured once serves any adapters.

A fused linear (q/k/v, gate/up) gets one slice per checkpoint part, each with its own A and B,
added to that part's columns. An adapter of a checkpoint that holds the projection fused (Phi-3's
``qkv_proj``: one A, one B over the whole fused width) gives every slice that A and its rows of B,
which adds the same ``B A x``. ``wrap_lora_linears`` swaps them into a model and returns where
each checkpoint module name (``model.layers.0.self_attn.q_proj``) lands: a wrapper and a slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedlab.layers.linear import OutputShardedLinear, RowParallelLinear
from pagedlab.lora.adapter import FUSED_TARGETS, SUPPORTED_TARGETS, LoRAModuleWeights
from pagedlab.lora.ops import LoRAMapping, add_lora_torch


class LoRABatch:
    """What every ``LoRALinear`` of a model reads in a forward: the step's token-to-slot mapping
    and the shrink's fp32 workspace (static buffers, from ``allocate``), and whether any token has
    an adapter (eager steps without one skip LoRA; a captured graph always runs the kernels, which
    return at once when the mapping has no tiles)."""

    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.device = device
        self.mapping = LoRAMapping.empty(1, num_slots, device)
        self.workspace: torch.Tensor | None = None
        self.active = False
        # The LoRA shrinks' branch of captured graphs (``linear_with_lora`` where the base does not
        # run the dense GEMV, which adds the deltas itself after the shrink), at high priority: a
        # batch-1 base GEMV holds every SM with hundreds of programs, and torch replays graphs
        # with the priorities captured, so the shrink's few programs take SMs as they free up
        # rather than after the base's last program.
        self.side_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None

    def linear(self, base: nn.Module, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               slice_sizes: list[int]) -> torch.Tensor:
        """``base(x)`` plus each token's adapter delta: the Triton kernels on CUDA, the torch
        references elsewhere."""
        if self.device.type == "cuda":
            from pagedlab.kernels.lora import linear_with_lora

            return linear_with_lora(base, x, lora_a, lora_b, self.mapping, slice_sizes, self.workspace,
                                    self.side_stream)
        y = base(x)
        add_lora_torch(x, y, lora_a, lora_b, self.mapping, slice_sizes)
        return y

    def allocate(self, max_tokens: int, max_slices: int, max_rank: int) -> None:
        """Static buffers for steps of up to ``max_tokens`` tokens (before graph capture)."""
        self.mapping = LoRAMapping.empty(max_tokens, self.num_slots, self.device)
        self.workspace = None
        if self.device.type == "cuda":
            from pagedlab.kernels.lora import workspace_numel

            numel = workspace_numel(max_tokens, max_slices, max_rank)
            self.workspace = torch.empty(numel, dtype=torch.float32, device=self.device)
        self.active = False


@dataclass(frozen=True)
class LoRATarget:
    """Where one checkpoint module's adapter goes: ``slice`` of ``layer``, or every slice
    (``None``: the fused module itself)."""

    layer: LoRALinear
    slice: int | None


class LoRALinear(nn.Module):
    """``base(x)`` plus ``x @ A.T @ B.T`` of each token's adapter slot, per output slice."""

    wraps_base_layer = True  # checkpoint names skip it: ``base``'s weights are named as the layer it wraps

    def __init__(self, base: nn.Module, in_features: int, slice_sizes: list[int], batch: LoRABatch,
                 max_rank: int, dtype: torch.dtype):
        super().__init__()
        self.base = base
        self.batch = batch
        self.in_features = in_features
        self.slice_sizes = list(slice_sizes)
        device, slots, slices = batch.device, batch.num_slots, len(slice_sizes)
        self.register_buffer("lora_a", torch.zeros(slots, slices, max_rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots, slices, max(slice_sizes), max_rank, dtype=dtype,
                                                   device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.batch.active:
            return self.base(x)
        return self.batch.linear(self.base, x, self.lora_a, self.lora_b, self.slice_sizes)

    def check_fits(self, part: int | None, weights: LoRAModuleWeights) -> None:
        """Raise ValueError unless ``weights`` fit slice ``part`` (its inputs and outputs; ``None``:
        all slices, the fused output)."""
        size = sum(self.slice_sizes) if part is None else self.slice_sizes[part]
        if weights.lora_a.shape[1] != self.in_features or weights.lora_b.shape[0] != size:
            raise ValueError(f"LoRA weights of shape A {tuple(weights.lora_a.shape)}, B "
                             f"{tuple(weights.lora_b.shape)} do not fit a linear of {self.in_features} "
                             f"inputs and {size} outputs: the adapter was trained for another model")

    def set_slice(self, slot: int, part: int | None, weights: LoRAModuleWeights) -> None:
        """Put an adapter module's A and B in slice ``part`` of ``slot`` (the slot was cleared);
        ``part=None``: A in every slice and each slice its rows of B, in the fused order."""
        self.check_fits(part, weights)
        parts = range(len(self.slice_sizes)) if part is None else [part]
        rows = weights.lora_b.split([self.slice_sizes[p] for p in parts])
        for index, lora_b in zip(parts, rows, strict=True):
            self.lora_a[slot, index, :weights.rank].copy_(weights.lora_a)
            self.lora_b[slot, index, :lora_b.shape[0], :weights.rank].copy_(lora_b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()


def _linear_shape(module: nn.Module) -> tuple[int, list[int]] | None:
    """(input features, output size of each part) of a LoRA-capable linear, else None."""
    if isinstance(module, OutputShardedLinear):
        return module.dense_checkpoint_shapes[0][1], [s.size for s in module.shards]
    if isinstance(module, RowParallelLinear):
        return module.input_size_per_rank, [module.dense_checkpoint_shapes[0][0]]
    return None


def wrap_lora_linears(model: nn.Module, batch: LoRABatch, max_rank: int,
                      dtype: torch.dtype) -> dict[str, LoRATarget]:
    """Wrap every attention/MLP projection of ``model`` in a ``LoRALinear``; returns the target of
    each checkpoint module name (the fused ones through ``model.packed_modules``)."""
    parts_of: dict[str, list[tuple[str, int]]] = {}
    for checkpoint_name, (fused, index) in getattr(model, "packed_modules", {}).items():
        parts_of.setdefault(fused, []).append((checkpoint_name, index))
    for name in SUPPORTED_TARGETS:
        parts_of.setdefault(name, [(name, 0)])
    targets: dict[str, LoRATarget] = {}
    for path, module in list(model.named_modules()):
        parent_path, _, leaf = path.rpartition(".")
        shape = _linear_shape(module)
        if leaf not in parts_of or shape is None or parts_of[leaf][0][0] not in SUPPORTED_TARGETS:
            continue
        wrapper = LoRALinear(module, shape[0], shape[1], batch, max_rank, dtype)
        setattr(model.get_submodule(parent_path), leaf, wrapper)
        for checkpoint_name, index in parts_of[leaf]:
            targets[f"{parent_path}.{checkpoint_name}"] = LoRATarget(wrapper, index)
        if leaf in FUSED_TARGETS:
            targets[f"{parent_path}.{leaf}"] = LoRATarget(wrapper, None)
    if not targets:
        raise ValueError(f"enable_lora=True: {type(model).__name__} has no linear pagedlab can put LoRA on "
                         f"(supported: the Llama-style projections {list(SUPPORTED_TARGETS)}, and "
                         f"{list(FUSED_TARGETS)} where the checkpoint fuses them, as Phi-3's)")
    return targets
