"""How a full checkpoint tensor splits over the tensor-parallel ranks, and how one rank reads its
part of it.

A ``weight_loader(param, loaded, shard_id)`` receives the FULL checkpoint tensor: a
``torch.Tensor`` or a lazy safetensors slice (``safe_open(...).get_slice(name)``). Both index
the same way (``loaded[a:b]``, ``loaded[:, a:b]``), and a slice reads only the indexed bytes
from the file, so a rank never reads a whole tensor it keeps a part of.
"""

from __future__ import annotations

import torch
from torch import nn


def checkpoint_shape(loaded) -> tuple[int, ...]:
    """The shape of a checkpoint tensor or lazy safetensors slice."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_part(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """Indices ``start..start+size`` of ``loaded`` along ``dim`` (0 or 1), read only they."""
    if dim == 0:
        return loaded[start:start + size]
    return loaded[:, start:start + size]


def read_shard(loaded, dim: int, unit: int, start: int, size: int, feature: str) -> torch.Tensor:
    """One rank's ``size`` features from feature ``start`` (its shard of the ``feature`` dimension,
    "output" or "input") of a tensor along whose ``dim`` each index covers ``unit`` features: 8
    for AWQ's packed int32 columns, ``group_size`` for its groups of rows, 1 for a plain weight.
    A shard must hold whole units: with N ranks, the feature count must be a multiple of
    ``unit * N``."""
    if start % unit or size % unit:
        raise ValueError(f"a tensor-parallel shard of {size} {feature} features from feature {start} "
                         f"does not hold whole units of {unit} features (int32 words of 8 columns, "
                         f"groups of group_size rows): the {feature} features must be a multiple of "
                         f"{unit} x tensor_parallel_size")
    return read_part(loaded, dim, start // unit, size // unit)


def read_whole(loaded) -> torch.Tensor:
    """The whole tensor (``[...]``: a lazy slice of a 0-d tensor takes no ``[:]``)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]


def check_shape(loaded, expected: tuple[int, ...]) -> None:
    if checkpoint_shape(loaded) != tuple(expected):
        raise ValueError(f"weight shape {checkpoint_shape(loaded)} does not match the expected "
                         f"{tuple(expected)}")


def load_replicated(param: nn.Parameter, loaded, shard_id: int | None = None) -> None:
    """The loader of a parameter every rank holds whole (norms, a row-parallel bias)."""
    check_shape(loaded, param.shape)
    param.data.copy_(read_whole(loaded))
