"""Attention over the paged KV cache: the layer, the backends' common interface, and the one
forward context that feeds them (``pagedlab.layers.attention`` re-exports these).

The model runner describes a step's batch twice: as host values in a ``BatchLayout`` (what a
backend plans from: cascade attention, split-KV) and as device tensors in ``AttentionMetadata``.
It asks the backend to ``plan`` the step, then runs the model inside ``forward_context(...)``;
every ``Attention`` layer reads the metadata from there, writes the step's new keys and values
into its cache (a layer with rotary embedding rotates its queries and keys in the same call,
``rotate_and_write_kv``) and attends through the backend. CUDA graphs capture a backend's
``graph_forms`` once per batch size and let it ``select_graph_form`` before each replay.

Backends: ``torch_backend`` (plain PyTorch, the definition of correct, runs anywhere) and
``triton_backend`` (the GPU path), each beside its kernels' torch reference in ``kernels/``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedlab.layers.rotary import rotate_queries_and_keys


@dataclass
class BatchLayout:
    """A step's batch as host values: sequence ``i`` runs ``query_lens[i]`` new tokens and holds
    ``seq_lens[i]`` after the step, in the blocks of ``block_table[i]``."""

    query_lens: list[int]
    seq_lens: list[int]
    block_table: np.ndarray  # [num_seqs, max_blocks] int32
    block_size: int
    max_seq_len: int  # bound on every sequence (the model's max_model_len), the same for graphs
    allow_cascade: bool = True  # the engine's enable_cascade_attention

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


@dataclass
class AttentionMetadata:
    """A step's batch as flat varlen tensors (all on the model's device).

    ``slot_mapping[t]``: cache slot for token t (-1: skip); ``query_start_loc``: ``[num_seqs+1]``
    offsets of each sequence's tokens; ``seq_lens``: tokens each sequence has after the step;
    ``block_tables``: ``[num_seqs, max_blocks]`` physical block ids. ``plan`` holds what the
    backend decided for the step (its ``plan`` or ``graph_plan``), shared by all layers.
    ``seq_order`` (a decode step's, or None): int32, the sequences longest first
    (``kernels.paged_attention.decode_order``), the order a backend's decode launch may take them in.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    plan: object | None = None
    seq_order: torch.Tensor | None = None


class AttentionBackend:
    """How a step writes new keys/values and attends over the paged cache, and what it decides
    per batch."""

    name = "abstract"
    shares_prefixes = False  # can attend a decode batch's common prefix once (cascade attention)
    supports_cuda_graphs = False

    def plan(self, metadata: AttentionMetadata, layout: BatchLayout) -> None:
        """Decide the step's layout-dependent choices once for all layers (``metadata.plan``)."""

    def graph_forms(self, num_seqs: int, allow_cascade: bool) -> tuple[str, ...]:
        """The variants a decode CUDA graph of ``num_seqs`` sequences is captured in."""
        return ("plain",)

    def graph_plan(self, form: str, num_seqs: int, device: torch.device) -> object | None:
        """The persistent plan a graph of that form captures (device buffers it reads)."""
        return None

    def select_graph_form(self, layout: BatchLayout, plans: dict[str, object | None]) -> str:
        """Which captured form replays this decode batch; updates that form's plan for it."""
        return "plain"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        """Store the step's keys and values in their slots (quantized at the scales into an FP8
        cache; see ``kernels.kv_write``)."""
        raise NotImplementedError

    def rotate_and_write_kv(self, q, k, v, rope: tuple[torch.Tensor, torch.Tensor], q_norm: nn.Module | None,
                            k_norm: nn.Module | None, k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
        """``q``/``k`` normalized per head by the ``RMSNorm`` modules ``q_norm``/``k_norm`` where
        given and rotated by ``rope`` = (cos, sin), the keys and values stored as ``write_kv``
        stores them; returns the rotated queries. Here ``rotate_queries_and_keys`` then
        ``write_kv``; the Triton backend runs it as one kernel."""
        q, k = rotate_queries_and_keys(q, k, rope, q_norm, k_norm)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return q

    def attend(self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """Attention of ``q`` over the paged cache (an FP8 cache read at the scales), local to
        ``sliding_window`` keys and soft-capped at ``softcap`` where given (see
        ``kernels.paged_attention``)."""
        raise NotImplementedError


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
        raise RuntimeError("Attention layers run only inside forward_context(...), which the model runner "
                           "sets")
    return _FORWARD_CONTEXT


class Attention(nn.Module):
    """Paged attention for one layer; its ``k_cache``/``v_cache`` are views the runner assigns.

    ``k_scale``/``v_scale``: the per-tensor scales of an FP8 cache (vLLM's): 1.0, or the
    checkpoint's ``self_attn.k_scale``/``v_scale``; a cache in the model's dtype ignores them.
    ``sliding_window``: a local layer's window (HF's: a query sees itself and the W - 1 keys
    before it), None for full attention; ``softcap``: attention logit soft-capping (Gemma 2)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.sliding_window, self.softcap = sliding_window, softcap
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None) -> torch.Tensor:
        """``q``: ``[tokens, heads, head_dim]``; ``k``/``v``: ``[tokens, kv_heads, head_dim]``. With
        ``rope`` (``RotaryEmbedding``'s (cos, sin)) ``q`` and ``k`` are rotated first, after the
        per-head ``RMSNorm`` modules ``q_norm``/``k_norm`` where given (Qwen3, Gemma 3): the
        backend's ``rotate_and_write_kv``, one kernel with the KV write on the Triton backend."""
        ctx = get_forward_context()
        if rope is None:
            ctx.backend.write_kv(k, v, self.k_cache, self.v_cache, ctx.metadata.slot_mapping, self.k_scale,
                                 self.v_scale)
        else:
            q = ctx.backend.rotate_and_write_kv(q, k, v, rope, q_norm, k_norm, self.k_cache, self.v_cache,
                                                ctx.metadata.slot_mapping, self.k_scale, self.v_scale)
        return ctx.backend.attend(q, self.k_cache, self.v_cache, ctx.metadata, self.scale, self.k_scale,
                                  self.v_scale, self.sliding_window, self.softcap)

    def load_kv_scale(self, name: str, tensor) -> None:
        """Set ``k_scale`` or ``v_scale`` (``name``) from a checkpoint's one-element tensor."""
        values = tensor if isinstance(tensor, torch.Tensor) else tensor[...]  # a lazy safetensors slice
        value = float(values.float().reshape(-1)[0]) if values.numel() == 1 else None
        if value is None or not math.isfinite(value) or value <= 0:
            shown = f"shape {tuple(values.shape)}" if value is None else str(value)
            raise ValueError(f"{name} must be one positive finite number (a per-tensor FP8 KV scale), "
                             f"got {shown}")
        setattr(self, name, value)
