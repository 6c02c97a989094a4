"""How a model's sizes split over the tensor-parallel ranks, as plain arithmetic (no torch): the
engine's layers and ``pagedlab plan`` apply the same rules."""

from __future__ import annotations

from dataclasses import dataclass


def divide_evenly(total: int, tp_size: int, what: str) -> int:
    """``total // tp_size``; a ValueError naming both numbers when it does not divide."""
    if total % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide {what}={total}")
    return total // tp_size


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one rank holds: ``num_heads`` query heads from ``first_head`` and
    ``num_kv_heads`` KV heads from ``first_kv_head``."""

    num_heads: int
    first_head: int
    num_kv_heads: int
    first_kv_head: int


def split_attention_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadSplit:
    """Query heads are split evenly. KV heads are split evenly when there are at least as many
    as ranks; with fewer, each rank holds one KV head, replicated: rank r holds head
    ``r * num_kv_heads // tp_size``, the one its query heads attend to."""
    heads = divide_evenly(num_heads, tp_size, "num_attention_heads")
    if num_kv_heads >= tp_size:
        kv_heads = divide_evenly(num_kv_heads, tp_size, "num_key_value_heads")
        return HeadSplit(heads, tp_rank * heads, kv_heads, tp_rank * kv_heads)
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} must be a multiple of "
                         f"num_key_value_heads={num_kv_heads} when it is larger")
    return HeadSplit(heads, tp_rank * heads, 1, tp_rank * num_kv_heads // tp_size)
