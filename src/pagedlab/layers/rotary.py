"""Rotary position embedding (NeoX layout: the two halves of each head are rotated together).

Inverse frequencies come from transformers' own RoPE initialisers, so every scaling type the
model config names (llama3, linear, yarn, longrope, ...) matches the reference implementation.

LongRoPE ("su", Phi-3 long-context and Phi-4-mini) has two sets of frequencies: the short
factors while a sequence is at most ``original_max_position_embeddings`` long, the long ones
past it, for every token of the sequence (transformers recomputes the whole cache when a
sequence crosses that length). The table holds both, short rows first: position ``p`` of a
sequence in the long regime reads row ``max_position + p`` (``long_rope_switch``; the scheduler
sets each request's offset and recomputes a sequence that crosses).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlab.layers.batch_invariant import runs_invariant_kernels
from pagedlab.layers.fusion import fused
from pagedlab.layers.norm import rms_norm, rms_norm_unit_offset

_POSITION_DEPENDENT = ("dynamic",)
_LONG_ROPE = ("longrope", "su")


def _rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    return dict(params[layer_type]) if layer_type is not None else params


def long_rope_switch(hf_config) -> int | None:
    """The sequence length past which LongRoPE switches to its long factors (the config's
    ``original_max_position_embeddings``); None for every other RoPE."""
    params = _rope_parameters(hf_config)
    if params.get("rope_type") not in _LONG_ROPE:
        return None
    switch = (params.get("original_max_position_embeddings")
              or getattr(hf_config, "original_max_position_embeddings", None)
              or hf_config.max_position_embeddings)
    return int(switch)


def rope_inverse_frequencies(hf_config, head_dim: int, layer_type: str | None = None,
                             seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling; ``layer_type`` picks one set of per-layer-type
    ``rope_parameters`` (Gemma 3's local and global layers); ``seq_len`` past LongRoPE's switch
    picks its long factors."""
    params = _rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type in _POSITION_DEPENDENT:
        raise ValueError(f"rope_type={rope_type!r} is not supported: its frequencies depend on the "
                         "sequence length; supported: default, linear, llama3, yarn, longrope")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type in _LONG_ROPE and layer_type is not None:
        raise ValueError(f"rope_type={rope_type!r} per layer type ({layer_type}) is not supported: only "
                         "a model-wide LongRoPE switches between its short and long factors")
    rope_type = "longrope" if rope_type in _LONG_ROPE else rope_type
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type={rope_type!r} is unknown; supported: default, linear, llama3, yarn, "
                         "longrope")
    extra = {} if layer_type is None else {"layer_type": layer_type}
    if seq_len is not None:
        extra["seq_len"] = seq_len
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """One per model: cos/sin tables for every position, gathered once per step for all layers."""

    def __init__(self, hf_config, head_dim: int, max_position: int, layer_type: str | None = None):
        super().__init__()
        switch = long_rope_switch(hf_config) if layer_type is None else None
        lengths = [None] if switch is None else [None, switch + 1]  # LongRoPE: short, then long rows
        positions = torch.arange(max_position, dtype=torch.float)  # on the model's device
        cos, sin = [], []
        for seq_len in lengths:
            inv_freq, scaling = rope_inverse_frequencies(hf_config, head_dim, layer_type, seq_len)
            freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos.append(emb.cos() * scaling)
            sin.append(emb.sin() * scaling)
        self.register_buffer("cos_cache", torch.cat(cos), persistent=False)
        self.register_buffer("sin_cache", torch.cat(sin), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for ``positions``, shaped ``[num_tokens, 1, head_dim]`` to broadcast over heads."""
        return (self.cos_cache[positions].to(dtype).unsqueeze(1),
                self.sin_cache[positions].to(dtype).unsqueeze(1))


def rotary_dim_of(hf_config, head_dim: int) -> int:
    """The leading dimensions of each head that rotate: ``head_dim * partial_rotary_factor``
    (GPT-NeoX/Pythia, Phi-4-mini rotate a part; the rest passes through unchanged)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:  # partial rotary
        return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate ``q``/``k`` (``[num_tokens, heads, head_dim]``) by the positions' angles; with
    tables narrower than ``head_dim`` only the leading ``cos.shape[-1]`` dimensions rotate."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


_apply_rotary_fused = fused(apply_rotary)


def normalize_and_rotate(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float, unit_offset: bool, cos: torch.Tensor, sin: torch.Tensor):
    """Per-head RMSNorm of ``q`` and ``k`` (``unit_offset``: Gemma's ``1 + weight``), then
    ``apply_rotary``."""
    norm = rms_norm_unit_offset if unit_offset else rms_norm
    return apply_rotary(norm(q, q_weight, eps), norm(k, k_weight, eps), cos, sin)


_normalize_and_rotate_fused = fused(normalize_and_rotate)


def rotate_queries_and_keys(q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                            q_norm: nn.Module | None = None, k_norm: nn.Module | None = None):
    """``q``/``k`` normalized per head by the ``RMSNorm`` modules ``q_norm``/``k_norm`` when given
    (Qwen3, Gemma 3), then rotated by ``rope`` = (cos, sin): one compiled kernel on the GPU (four
    launches were a decode step's few microseconds each, per layer). Batch-invariant mode keeps
    its own norm kernel. Models hand ``rope`` and the norms to their ``Attention`` layer: the torch
    backend runs this before its KV write (``AttentionBackend.rotate_and_write_kv``), the Triton
    backend one kernel that also writes the cache (``kernels/kv_write.py``)."""
    if q_norm is None:
        return _apply_rotary_fused(q, k, *rope)
    if runs_invariant_kernels(q):
        return _apply_rotary_fused(q_norm(q), k_norm(k), *rope)
    return _normalize_and_rotate_fused(q, k, q_norm.weight, k_norm.weight, q_norm.eps, q_norm.unit_offset,
                                       *rope)
