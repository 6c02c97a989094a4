"""Attention over the paged KV cache: the ``Attention`` layer, the backends (``torch_backend``,
``triton_backend``: one module each, with its planner) and ``get_attention_backend``; see
``base`` for how the model runner, the backends and the layers meet."""

from __future__ import annotations

import importlib.util

import torch

from pagedlab.layers.attention.base import (Attention, AttentionBackend, AttentionMetadata, BatchLayout,
                                            forward_context, get_forward_context)
from pagedlab.layers.attention.torch_backend import TorchAttentionBackend
from pagedlab.layers.attention.triton_backend import TritonAttentionBackend

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "BatchLayout", "TorchAttentionBackend",
           "TritonAttentionBackend", "forward_context", "get_attention_backend", "get_forward_context"]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name``; "auto" is Triton on CUDA (when installed), torch elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_installed() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton" and _triton_installed():
        return TritonAttentionBackend()
    choices = ["torch", "triton"] if _triton_installed() else ["torch"]
    raise ValueError(f"attention_backend={name!r} is invalid: choose 'auto' or one of {choices}")


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
