"""Filling a model's parameters from checkpoint tensors, shared by every model family.

A family says where each checkpoint tensor goes with a ``route(name, tensor)`` that yields
``(parameter name, shard id, tensor)`` triples: none to skip the tensor (a tied LM head, a
stored causal mask), several to split a fused tensor (GPT-NeoX's per-head q/k/v) into the parts
of a fused parameter. Each part goes through its parameter's ``weight_loader``, which keeps this
rank's share. Two kinds of target are not parameters: the dense ``weight`` of a linear whose
format quantizes at load (FP8, AWQ from a dense checkpoint: the layer quantizes the full weight
and keeps its cut), and an attention layer's FP8 KV-cache ``k_scale``/``v_scale``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from pagedlab.distributed.sharding import check_shape, checkpoint_shape, load_replicated, read_part
from pagedlab.quantization.formats import resolve_quant_config

Route = Callable[[str, object], Iterable[tuple[str, int | None, object]]]


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, object]], route: Route,
                    every_part: bool = True) -> set[str]:
    """Load ``weights`` (name, full tensor or lazy safetensors slice) through ``route``; returns
    the names of the parameters set. ``every_part=False`` (an update of some weights) lets a fused
    parameter take some of its parts, the others keeping their values."""
    params, quantizing = _targets(model)
    set_names: set[str] = set()
    parts: dict[str, set[int]] = {}  # fused targets: the parts loaded so far
    for name, full_tensor in weights:
        try:  # the route's own errors too (a tensor it cannot split)
            for target, shard_id, tensor in route(name, full_tensor):
                set_names.update(_load_one(model, params, quantizing, target, shard_id, tensor))
                if shard_id is not None:
                    parts.setdefault(target, set()).add(shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
    if every_part:
        _check_every_part(model, params, quantizing, parts)
    return set_names


def check_checkpoint(model: nn.Module, weights: Iterable[tuple[str, object]], route: Route) -> None:
    """Raise the ValueError ``load_checkpoint`` would raise for an unknown name or a shape of
    ``weights``, naming the tensor, before anything is written: an update must not stop halfway
    (so a tensor the copy would fail on or mangle, meta or not floating point, is refused too).
    FP8 KV-cache scales are refused (read once, at load)."""
    params, quantizing = _targets(model)
    for name, full_tensor in weights:
        try:
            for target, shard_id, tensor in route(name, full_tensor):
                check_shape(tensor, _expected_shape(model, params, quantizing, target, shard_id))
                _check_values(tensor)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


def _check_values(tensor: torch.Tensor) -> None:
    """Values the copy can take: floating point (cast as a checkpoint's are), with data."""
    if tensor.is_meta:
        raise ValueError("it is on the meta device (a shape without data): give the tensor's values")
    if not tensor.is_floating_point():
        raise ValueError(f"dtype {tensor.dtype} is not a floating-point dtype: give the dense weights")


def _expected_shape(model: nn.Module, params: dict, quantizing: dict, target: str,
                    shard_id: int | None) -> tuple[int, ...]:
    """The full checkpoint shape of part ``shard_id`` of ``target``; a ValueError where
    ``load_checkpoint`` has no place for it."""
    layer_name, _, leaf = target.rpartition(".")
    if leaf in ("k_scale", "v_scale") and layer_name.endswith("self_attn"):
        raise ValueError("FP8 KV-cache scales are read once, when the engine is built: build a new LLM "
                         "to change them")
    layer = quantizing.get(layer_name) if leaf == "weight" else None
    param = params.get(target)
    if layer is None and param is None:
        raise ValueError(f"it has no place in {type(model).__name__}")
    shapes = layer.dense_checkpoint_shapes if layer is not None else getattr(param, "checkpoint_shapes", None)
    if shapes is None:  # held whole by every rank
        return tuple(param.shape)
    if shard_id is None and len(shapes) > 1:
        raise ValueError(f"{target} fuses {len(shapes)} checkpoint tensors: give its parts")
    if (shard_id or 0) >= len(shapes):
        raise ValueError(f"{target} has {len(shapes)} parts, not a part {shard_id}")
    return tuple(shapes[shard_id or 0])


def _targets(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, nn.Module]]:
    """The model's parameters and its linears that quantize dense weights at load, by checkpoint
    name: a LoRA wrapper's ``base`` layer (``LoRALinear``) is named as the layer it wraps."""
    wrappers = [name for name, module in model.named_modules() if getattr(module, "wraps_base_layer", False)]

    def unwrapped(name: str) -> str:
        for wrapper in wrappers:
            if name.startswith(f"{wrapper}.base.") or name == f"{wrapper}.base":
                return wrapper + name[len(wrapper) + len(".base"):]
        return name

    params = {unwrapped(name): param for name, param in model.named_parameters()}
    quantizing = {unwrapped(name): module for name, module in model.named_modules()
                  if getattr(getattr(module, "linear_method", None), "quantize_at_load", False)}
    return params, quantizing


def _check_every_part(model: nn.Module, params: dict, quantizing: dict, parts: dict[str, set[int]]) -> None:
    """A fused parameter counts as loaded once any part is; a checkpoint lacking another part
    (a q_proj without its k_proj) would leave those rows uninitialised: name the missing parts."""
    missing = []
    for target, loaded in parts.items():
        layer_name, _, leaf = target.rpartition(".")
        layer = quantizing.get(layer_name) if leaf == "weight" else None
        shapes = layer.dense_checkpoint_shapes if layer is not None else getattr(params.get(target),
                                                                                 "checkpoint_shapes", ())
        missing += [_part_name(model, target, shard_id) for shard_id in range(len(shapes))
                    if shard_id not in loaded]
    if missing:
        raise ValueError(f"the checkpoint lacks weights for: {some_names(missing)}")


def some_names(names: list[str], shown: int = 5) -> str:
    """The first ``shown`` of ``names`` and how many more, for an error message."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _part_name(model: nn.Module, target: str, shard_id: int) -> str:
    """The checkpoint name of part ``shard_id`` of fused ``target`` (``model.packed_modules``)."""
    prefix, fused, leaf = target.rsplit(".", 2)
    for checkpoint_name, packed in getattr(model, "packed_modules", {}).items():
        if packed == (fused, shard_id):
            return f"{prefix}.{checkpoint_name}.{leaf}"
    return f"{target} (part {shard_id})"


def _load_one(model: nn.Module, params: dict, quantizing: dict, target: str, shard_id: int | None,
              tensor) -> list[str]:
    layer_name, _, leaf = target.rpartition(".")
    if leaf in ("k_scale", "v_scale") and layer_name.endswith("self_attn"):  # FP8 KV cache scales
        model.get_submodule(layer_name).attn.load_kv_scale(leaf, tensor)
        return []
    layer = quantizing.get(layer_name) if leaf == "weight" else None
    if layer is not None:
        return [f"{layer_name}.{n}" for n in layer.load_dense_weight(tensor, shard_id)]
    param = params.get(target)
    if param is None:
        raise ValueError(f"it has no place in {type(model).__name__}")
    getattr(param, "weight_loader", load_replicated)(param, tensor, shard_id)
    return [target]


def check_fused(loaded, sizes: list[int], dim: int = 0, unit: int = 1) -> None:
    """A fused checkpoint tensor must hold exactly its parts' ``sizes`` features along ``dim``
    (``unit`` features an index, as ``read_shard``'s): cut into its parts, a larger one would have
    its extra rows dropped unseen and a shape no other loader checks."""
    shape = checkpoint_shape(loaded)
    if len(shape) <= dim or shape[dim] * unit != sum(sizes):
        raise ValueError(f"weight shape {shape} does not fuse parts of {sizes} features along "
                         f"dimension {dim}")


def split_rows(loaded, sizes: list[int]) -> Iterator[object]:
    """Consecutive row ranges of ``sizes`` rows of a fused checkpoint tensor (each read alone)."""
    check_fused(loaded, sizes)
    start = 0
    for size in sizes:
        yield read_part(loaded, 0, start, size)
        start += size


def require_dense(hf_config, quantization: str | None, family: str) -> None:
    """Refuse a quantized weight format for a family whose linears take dense weights only."""
    if resolve_quant_config(quantization, hf_config) is not None:
        raise ValueError(f"{family} models load dense weights only: quantization={quantization!r} (or the "
                         "checkpoint's quantization_config) is not supported for them")
