"""Attention over the paged KV cache, and the one forward context that feeds it.

The model runner describes a step's batch in ``AttentionMetadata`` and runs the model inside
``forward_context(...)``; every ``Attention`` layer reads it from there, writes the step's new
keys and values into its cache and attends over the cache through the chosen backend.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from pagedlab.kernels.kv_write import write_kv_torch
from pagedlab.kernels.paged_attention import CascadeBuffers, paged_attention_torch, plan_torch_attention


@dataclass
class AttentionMetadata:
    """A step's batch as flat varlen tensors (all on the model's device).

    ``slot_mapping[t]``: cache slot for token t (-1: skip); ``query_start_loc``: ``[num_seqs+1]``
    offsets of each sequence's tokens; ``seq_lens``: tokens each sequence has after the step;
    ``block_tables``: ``[num_seqs, max_blocks]`` physical block ids. ``cascade``: set for a
    decode batch whose sequences hold their first keys in the same blocks; a backend with
    ``shares_prefixes`` attends those once for all sequences (cascade attention).
    ``backend_plan`` holds what a backend derives from the layout once per step, for all layers.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    cascade: CascadeBuffers | None = None
    backend_plan: object | None = None


class AttentionBackend:
    """How a step writes new keys/values and attends over the paged cache."""

    name = "abstract"
    shares_prefixes = False  # attends a decode batch's common prefix once (AttentionMetadata.cascade)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        raise NotImplementedError

    def attend(self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """Plain PyTorch, runs anywhere: the definition of correct."""

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv_torch(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, metadata, scale):
        if metadata.backend_plan is None:
            metadata.backend_plan = plan_torch_attention(metadata.query_start_loc, metadata.seq_lens,
                                                         metadata.block_tables, k_cache.shape[1])
        return paged_attention_torch(q, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens,
                                     metadata.block_tables, scale, plan=metadata.backend_plan)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and "triton" in ATTENTION_BACKENDS else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is invalid: choose 'auto' or one of "
                         f"{sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]()


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    backend: AttentionBackend


_FORWARD_CONTEXT: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata, backend: AttentionBackend):
    global _FORWARD_CONTEXT
    previous, _FORWARD_CONTEXT = _FORWARD_CONTEXT, ForwardContext(metadata, backend)
    try:
        yield
    finally:
        _FORWARD_CONTEXT = previous


def get_forward_context() -> ForwardContext:
    if _FORWARD_CONTEXT is None:
        raise RuntimeError("Attention layers run only inside forward_context(...) set by the model runner")
    return _FORWARD_CONTEXT


class Attention(nn.Module):
    """Paged attention for one layer; its ``k_cache``/``v_cache`` are views the runner assigns."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q``: ``[tokens, heads, head_dim]``; ``k``/``v``: ``[tokens, kv_heads, head_dim]``."""
        ctx = get_forward_context()
        ctx.backend.write_kv(k, v, self.k_cache, self.v_cache, ctx.metadata.slot_mapping)
        return ctx.backend.attend(q, self.k_cache, self.v_cache, ctx.metadata, self.scale)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels: the GPU path (on CPU they run only under ``TRITON_INTERPRET=1``)."""

    name = "triton"
    shares_prefixes = True

    def __init__(self):
        from pagedlab.kernels import paged_attention, kv_write

        self._write_kv = kv_write.write_kv_triton
        self._kernels = paged_attention

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self._write_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, metadata, scale):
        kernels = self._kernels
        if metadata.cascade is not None:
            return kernels.cascade_attention_triton(q, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens,
                                                    metadata.block_tables, metadata.cascade, scale,
                                                    metadata.max_seq_len)
        split_kv_size = kernels.choose_split_kv_size(metadata.seq_lens.shape[0], k_cache.shape[2],
                                                     metadata.max_query_len, metadata.max_seq_len)
        return kernels.paged_attention_triton(q, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens,
                            metadata.block_tables, scale, max_query_len=metadata.max_query_len,
                            max_seq_len=metadata.max_seq_len, split_kv_size=split_kv_size)


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


if _triton_installed():
    ATTENTION_BACKENDS["triton"] = TritonAttentionBackend
