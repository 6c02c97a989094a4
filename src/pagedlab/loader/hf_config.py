"""A model's Hugging Face config as pagedlab builds the model from it: config.json read by
transformers (never the repository's own code), with the engine's ``hf_overrides`` applied
(``pagedlab.hf_overrides``). The engine, every tensor-parallel rank (through rank 0's config) and
the HF references of the parity checks all read it here, so they build the same model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from pagedlab.hf_overrides import apply_hf_overrides
from pagedlab.models.registry import check_config_file

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def load_hf_config(model, hf_overrides=None):
    """The config of ``model`` (a directory holding config.json, or a hub model id) with
    ``hf_overrides`` applied; a ``model_type`` override picks transformers' config class, as in
    vLLM. An unsupported architecture (after the overrides) or an unreadable config is a ValueError."""
    from transformers import AutoConfig, PretrainedConfig

    overrides = hf_overrides if isinstance(hf_overrides, dict) else {}
    check_config_file(model, overrides)
    try:  # never the repository's own code, whatever trust_remote_code says
        if "model_type" in overrides:
            config_dict, _ = PretrainedConfig.get_config_dict(str(model))
            config_dict.pop("model_type", None)
            hf_config = AutoConfig.for_model(overrides["model_type"], **config_dict)
        else:
            hf_config = AutoConfig.from_pretrained(str(model), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"config.json in {model} could not be read: {e}") from None
    return apply_hf_overrides(hf_config, hf_overrides)


def layers_kept(hf_config, model_dir: Path) -> int | None:
    """The model's layer count where ``hf_config`` (``num_hidden_layers`` overridden) has fewer
    layers than the checkpoint's config.json in ``model_dir``, else None."""
    try:
        stored = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    # the name config.json stores it under (GPT-2's n_layer)
    key = getattr(hf_config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    stored_layers = stored.get(key, stored.get("num_hidden_layers"))
    layers = getattr(hf_config, "num_hidden_layers", None)
    if isinstance(stored_layers, int) and isinstance(layers, int) and layers < stored_layers:
        return layers
    return None


def without_layers_from(weights: Iterable[tuple[str, object]], first: int) -> Iterator[tuple[str, object]]:
    """Checkpoint tensors less those of decoder layers ``first`` and later (``layers.N.`` / GPT-2's
    ``h.N.``): a model cut to its first layers (``hf_overrides={"num_hidden_layers": n}``) reads
    only theirs, as transformers and vLLM do."""
    for name, tensor in weights:
        layer = _LAYER_INDEX.search(name)
        if layer is None or int(layer.group(1)) < first:
            yield name, tensor
