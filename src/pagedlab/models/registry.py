"""Which model class (and which switches) serves a checkpoint, by ``architectures``/``model_type``."""

from __future__ import annotations

import json
from pathlib import Path

from pagedlab.models.gemma import GemmaForCausalLM
from pagedlab.models.gpt2 import GPT2LMHeadModel
from pagedlab.models.gpt_neox import GPTNeoXForCausalLM
from pagedlab.models.llama import LlamaForCausalLM
from pagedlab.models.mixtral import MixtralForCausalLM
from pagedlab.models.phi3 import Phi3ForCausalLM

# architecture -> (class, keyword switches)
MODEL_REGISTRY = {
    "LlamaForCausalLM": (LlamaForCausalLM, {}),
    "MistralForCausalLM": (LlamaForCausalLM, {}),
    "Qwen2ForCausalLM": (LlamaForCausalLM, {"qkv_bias": True}),
    "Qwen3ForCausalLM": (LlamaForCausalLM, {"qk_norm": True}),
    "GPT2LMHeadModel": (GPT2LMHeadModel, {}),
    "GPTNeoXForCausalLM": (GPTNeoXForCausalLM, {}),
    "Phi3ForCausalLM": (Phi3ForCausalLM, {}),
    "Gemma2ForCausalLM": (GemmaForCausalLM, {}),
    "Gemma3ForCausalLM": (GemmaForCausalLM, {"qk_norm": True}),
    "MixtralForCausalLM": (MixtralForCausalLM, {}),
    "Qwen3MoeForCausalLM": (MixtralForCausalLM, {"qk_norm": True}),
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM", "phi3": "Phi3ForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def resolve_architecture(hf_config) -> str:
    return architecture_of(getattr(hf_config, "architectures", None), getattr(hf_config, "model_type", None))


def architecture_of(architectures: list[str] | None, model_type: str | None) -> str:
    """The registered architecture that serves a config's ``architectures`` / ``model_type``, or a
    ValueError listing the supported ones."""
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return arch
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"architecture {architectures} (model_type={model_type!r}) is not supported; supported "
        f"architectures: {sorted(MODEL_REGISTRY)}. pagedlab runs its own implementation of each and never "
        "a model repository's code: trust_remote_code=True is accepted and adds no architecture")


def check_config_file(model_dir, overrides: dict | None = None) -> None:
    """Refuse an unsupported architecture from ``config.json`` itself, before transformers reads it
    (a model type transformers does not know would otherwise ask for the repository's code), with
    the ``architectures`` / ``model_type`` that ``overrides`` (``hf_overrides``) give it."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # a missing or malformed file gets the loader's own error
    if isinstance(config, dict):
        config.update({k: v for k, v in (overrides or {}).items() if k in ("architectures", "model_type")})
        architecture_of(config.get("architectures"), config.get("model_type"))


def build_model(hf_config, max_position: int, quantization: str | None = None):
    """An uninitialised model of the checkpoint's architecture (weights still to be loaded): this
    process's shard when it is a rank of a tensor-parallel group (``init_tensor_parallel``), its
    linears in the weight format ``quantization`` resolves to (None: the checkpoint's own)."""
    model_cls, switches = MODEL_REGISTRY[resolve_architecture(hf_config)]
    return model_cls(hf_config, max_position, quantization=quantization, **switches)
