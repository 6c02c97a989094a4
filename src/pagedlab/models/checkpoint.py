"""Filling a model's parameters from checkpoint tensors, shared by every model family.

A family says where each checkpoint tensor goes with a ``route(name, tensor)`` that yields
``(parameter name, shard id, tensor)`` triples: none to skip the tensor (a tied LM head, a
stored causal mask), several to split a fused tensor (GPT-NeoX's per-head q/k/v) into the parts
of a fused parameter. Each part goes through its parameter's ``weight_loader``, which keeps this
rank's share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from torch import nn

from pagedlab.distributed.sharding import load_replicated, read_part

Route = Callable[[str, object], Iterable[tuple[str, int | None, object]]]


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, object]], route: Route) -> set[str]:
    """Load ``weights`` (name, full tensor or lazy safetensors slice) through ``route``; returns
    the names of the parameters set."""
    params = dict(model.named_parameters())
    set_names: set[str] = set()
    for name, full_tensor in weights:
        for target, shard_id, tensor in route(name, full_tensor):
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
            loader = getattr(param, "weight_loader", load_replicated)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
            set_names.add(target)
    return set_names


def split_rows(loaded, sizes: list[int]) -> Iterator[object]:
    """Consecutive row ranges of ``sizes`` rows of a fused checkpoint tensor (each read alone)."""
    start = 0
    for size in sizes:
        yield read_part(loaded, 0, start, size)
        start += size
