"""Reading a LoRA adapter saved by PEFT (``save_pretrained``): ``adapter_config.json`` and
``adapter_model.safetensors`` (or, without it, PEFT's older ``adapter_model.bin``, read as vLLM
reads it: ``torch.load`` with ``weights_only=True``), into per-module A and B matrices on the CPU.

Each targeted module ``m`` holds ``m.lora_A.weight`` ``[r, in]`` and ``m.lora_B.weight``
``[out, r]`` (for a projection the checkpoint holds fused, Phi-3's ``qkv_proj``, ``out`` is the
whole fused width); its output gains ``scaling * x @ A.T @ B.T`` with ``scaling = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern``/``alpha_pattern`` give some
modules their own r and alpha (r is read from the tensors). B is stored pre-multiplied by the
scaling. Features PEFT adds beyond plain LoRA (DoRA and the other variants, trained biases,
``modules_to_save``) are refused by name rather than silently dropped.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedlab.lora.request import LoRARequest

if TYPE_CHECKING:  # the lab reads adapter configs without loading torch
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BIN_WEIGHTS_FILE = "adapter_model.bin"  # PEFT's older format, read where there is no WEIGHTS_FILE
# Modules an adapter may target: the decoder's attention and MLP projections.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections some checkpoints (Phi-3) hold fused: one LoRA over the whole fused output.
FUSED_TARGETS = ("qkv_proj", "gate_up_proj")
_UNSUPPORTED_SETTINGS = {  # adapter_config.json key -> (value that is fine, what it would add)
    "use_dora": (False, "DoRA's magnitude vectors"),
    "bias": ("none", "trained biases"),
    "lora_bias": (False, "a bias on lora_B"),
    "modules_to_save": (None, "fully trained copies of modules"),
    "fan_in_fan_out": (False, "Conv1D (GPT-2 style) weights"),
    "layer_replication": (None, "replicated layers"),
    "trainable_token_indices": (None, "trained embedding rows"),
    "target_parameters": (None, "LoRA on weight parameters, such as MoE experts'"),
    # LoRA variants whose forward is not W x + scaling B A x:
    "alora_invocation_tokens": (None, "activated LoRA, which adapts only the tokens from its invocation on"),
    "use_bdlora": (None, "block-diagonal LoRA factors"),
    "kasa_config": (None, "KaSA's singular-value diagonal between A and B"),
    "arrow_config": (None, "Arrow routing between adapters"),
    "use_qalora": (False, "QA-LoRA's pooled inputs"),
}


@dataclass
class LoRAModuleWeights:
    """One targeted module's matrices (CPU): ``lora_a`` ``[r, in]``, ``lora_b`` ``[out, r]`` with
    the scaling folded in."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAAdapter:
    """An adapter read from its PEFT directory: its config, its modules by name (as in the base
    model's checkpoint, e.g. ``model.layers.0.self_attn.q_proj``) and a checksum of its weights."""

    request: LoRARequest
    config: dict
    modules: dict[str, LoRAModuleWeights]
    sha256: str

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def read_adapter_config(path: str | Path) -> dict:
    """``adapter_config.json`` of the adapter directory ``path``, checked for what pagedlab serves."""
    directory = Path(path).expanduser()
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        where = "does not exist" if not directory.exists() else f"has no {CONFIG_FILE}"
        raise ValueError(f"LoRA adapter directory {str(directory)!r} {where}: an adapter is a PEFT directory "
                         f"with {CONFIG_FILE} and {WEIGHTS_FILE} or {BIN_WEIGHTS_FILE} "
                         "(PeftModel.save_pretrained)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"adapter {str(directory)!r}: {str(config_path)!r} is not valid JSON ({e})"
                         ) from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter {str(directory)!r}: {str(config_path)!r} is not a JSON object, as PEFT's "
                         f"adapter configs are (it holds a {type(config).__name__})")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"adapter {str(directory)!r} has peft_type={peft_type!r}: only LORA adapters are "
                         "served")
    for key, (fine, feature) in _UNSUPPORTED_SETTINGS.items():
        value = config.get(key, fine)
        if value not in (fine, None, False, [], {}):
            raise ValueError(f"adapter {str(directory)!r} sets {key}={value!r} ({feature}), which pagedlab "
                             f"does not serve: only plain LoRA on {list(SUPPORTED_TARGETS)}")
    return config


def load_adapter(request: LoRARequest, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check the adapter of ``request`` (rank at most ``max_rank``, known targets only)
    into CPU tensors of ``dtype``."""
    config = read_adapter_config(request.lora_path)
    tensors, sha256 = _read_weights(request)
    modules = {}
    for name in sorted({_module_name(key, request) for key in tensors}):
        lora_a = tensors.get(f"{name}.lora_A.weight")
        lora_b = tensors.get(f"{name}.lora_B.weight")
        if lora_a is None or lora_b is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: module {name!r} lacks its lora_A or "
                             "lora_B weight")
        rank = lora_a.shape[0]
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {request.lora_name!r} has rank {rank} (module {name!r}), above "
                             f"max_lora_rank={max_rank}: raise max_lora_rank to at least {rank}")
        scaling = _scaling(config, name, rank)
        modules[_strip_prefix(name)] = LoRAModuleWeights(
            lora_a.to(dtype).contiguous(), (lora_b.double() * scaling).to(dtype).contiguous())
    if not modules:
        raise ValueError(f"LoRA adapter {request.lora_name!r} in {request.lora_path!r} holds no LoRA weights")
    return LoRAAdapter(request, config, modules, sha256)


def adapter_weights_file(directory: str | Path) -> Path | None:
    """The file an adapter's weights are read from: ``WEIGHTS_FILE``, else ``BIN_WEIGHTS_FILE``;
    None when the directory holds neither."""
    candidates = (Path(directory) / WEIGHTS_FILE, Path(directory) / BIN_WEIGHTS_FILE)
    return next((candidate for candidate in candidates if candidate.is_file()), None)


def _read_weights(request: LoRARequest) -> tuple[dict[str, torch.Tensor], str]:
    """The adapter's tensors by name and the sha256 of their file: ``adapter_model.safetensors``,
    else ``adapter_model.bin`` loaded with ``weights_only=True`` (tensors only, no code runs)."""
    import torch
    from safetensors.torch import load

    directory = Path(request.lora_path).expanduser()
    path = adapter_weights_file(directory)
    if path is None:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {str(directory)!r} has neither {WEIGHTS_FILE} "
                         f"nor {BIN_WEIGHTS_FILE} (PEFT's save_pretrained writes one of them)")
    data = path.read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    if path.name == WEIGHTS_FILE:
        try:
            return load(data), sha256
        except Exception as e:  # safetensors' own error type, for a cut or corrupt file
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {str(path)!r} could not be read as "
                             f"safetensors ({e})") from None
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # pickle's errors for what weights_only refuses, and for a corrupt file
        lines = str(e).splitlines() or [""]  # torch's advice to load untrusted files without it: left out
        reason = next((line.strip() for line in lines if "WeightsUnpickler error" in line), lines[0])
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {str(path)!r} could not be read with "
                         f"torch.load(weights_only=True), which loads tensors only ({reason})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {str(path)!r} holds a "
                         f"{type(tensors).__name__}, not a dict of tensors as PEFT saves")
    return tensors, sha256


def _module_name(key: str, request: LoRARequest) -> str:
    """The module a tensor of the adapter belongs to, checked to be a LoRA-capable target."""
    name = re.sub(r"\.(lora_\w+(\.weight)?|base_layer\.\w+|weight|bias)$", "", key)
    target = name.rsplit(".", 1)[-1]
    if target not in SUPPORTED_TARGETS + FUSED_TARGETS:
        raise ValueError(f"LoRA adapter {request.lora_name!r} targets module {target!r} ({name}), which is "
                         f"not supported: target modules must be among {list(SUPPORTED_TARGETS)} (or, "
                         f"fused in the checkpoint as in Phi-3, {list(FUSED_TARGETS)})")
    if not re.fullmatch(r".+\.lora_[AB]\.weight", key):
        raise ValueError(f"LoRA adapter {request.lora_name!r} holds tensor {key!r}, which is not a "
                         "lora_A/lora_B weight: only plain LoRA is served")
    return name


def _strip_prefix(name: str) -> str:
    """PEFT saves ``base_model.model.<checkpoint name>``."""
    return name.removeprefix("base_model.model.")


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: a key matches a module name's suffix."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _scaling(config: dict, name: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern"), _strip_prefix(name), config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
