"""Which weight format a model loads: the checkpoint's ``quantization_config`` (config.json) and
the engine's ``quantization`` argument, resolved to one config (vLLM's rules).

=================  =========================  ===============================================
checkpoint         ``quantization``           loaded as
=================  =========================  ===============================================
16/32-bit          None                       dense
16/32-bit          "fp8"                      FP8, quantized at load (per-channel weights,
                                              dynamic per-token activations)
16/32-bit          "awq"                      AWQ 4-bit, round-to-nearest at load (not
                                              activation-aware: a lower bound on AWQ quality)
AutoAWQ GEMM       None or "awq"              AWQ, as stored
compressed-tensors None or "fp8"              FP8, as stored
                   (FP8 float-quantized)
=================  =========================  ===============================================

Any other combination, quant_method or variant is a ValueError naming it and what is supported.
"""

from __future__ import annotations

from typing import Any

from pagedlab.config import QUANTIZATIONS
from pagedlab.quantization.awq import SUPPORTED_GROUP_SIZES, AWQConfig
from pagedlab.quantization.fp8 import FP8Config

# config.json's quant_method -> the quantization it is
CHECKPOINT_METHODS = {"awq": "awq", "compressed-tensors": "fp8"}


def checkpoint_quantization_config(hf_config) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` as a dict, or None for a dense checkpoint."""
    quantization_config = getattr(hf_config, "quantization_config", None)
    if not quantization_config:
        return None
    if not isinstance(quantization_config, dict):
        quantization_config = quantization_config.to_dict()
    return quantization_config


def resolve_quant_config(requested: str | None, hf_config) -> AWQConfig | FP8Config | None:
    """The weight format to load (see the table above): None for dense weights."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"quantization={requested!r} is invalid: quantization must be one of "
                         f"{QUANTIZATIONS}")
    stored = checkpoint_quantization_config(hf_config)
    if stored is None:
        if requested == "fp8":
            return FP8Config(quantize_at_load=True)
        if requested == "awq":
            return AWQConfig(group_size=dense_awq_group_size(hf_config), quantize_at_load=True)
        return None
    method = str(stored.get("quant_method")).lower()
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"the checkpoint's quantization_config has quant_method={method!r}, which is not "
                         f"supported: supported checkpoint formats are {sorted(CHECKPOINT_METHODS)} "
                         "(AutoAWQ GEMM; compressed-tensors FP8)")
    found = CHECKPOINT_METHODS[method]
    if requested is not None and requested != found:
        raise ValueError(f"quantization={requested!r} does not match the checkpoint's quantization "
                         f"{found!r} (config.json's quantization_config has quant_method={method!r}); "
                         "leave quantization=None to use it")
    if found == "awq":
        return AWQConfig.from_hf_config(stored)
    return FP8Config.from_compressed_tensors(stored)


def dense_awq_group_size(hf_config) -> int:
    """The largest AWQ group size that divides the input features of every linear of the model
    (hidden size, attention width, MLP width): 128 for Llama-3-8B, 64 for SmolLM2-135M."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    widths = (hf_config.hidden_size, heads * head_dim, hf_config.intermediate_size)
    for group in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        if all(width % group == 0 for width in widths):
            return group
    raise ValueError(f"quantization='awq' on a dense checkpoint needs input widths {widths} divisible by "
                     f"one of the AWQ group sizes {SUPPORTED_GROUP_SIZES}")
