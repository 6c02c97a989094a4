"""The server's ``routed_experts`` (vLLM's, with ``--enable-return-routed-experts``): a non-streamed
completion or chat choice carries its ``CompletionOutput.routed_experts`` as the base64 of the array
in NumPy's .npy format (``np.save``), shape ``(num_tokens - 1 - routed_experts_prompt_start,
num_hidden_layers, num_experts_per_tok)``; ``decode_routed_experts`` reads it back. As in vLLM, a
stream's chunks carry none."""

from __future__ import annotations

import base64
import io

import numpy as np


def encode_routed_experts(rows: np.ndarray | None) -> str | None:
    """The choice's field: base64 of ``np.save(rows)``, None without rows."""
    if rows is None:
        return None
    buffer = io.BytesIO()
    np.save(buffer, rows, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_routed_experts(text: str) -> np.ndarray:
    """The array a choice's ``routed_experts`` holds (``np.load`` of the decoded bytes)."""
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)
