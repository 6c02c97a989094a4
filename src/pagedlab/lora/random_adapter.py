"""Random LoRA adapters in PEFT's format for any model config: what a benchmark runs when no
trained adapter of the model's shape is at hand (``pagedlab bench throughput --num-loras``).

``write_random_adapter`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` as
``PeftModel.save_pretrained`` does (tensors ``base_model.model.<module>.lora_A.weight`` ``[r, in]``
and ``lora_B.weight`` ``[out, r]``, ``task_type`` CAUSAL_LM), so PEFT and pagedlab read it
alike, and writing one needs no peft package. The targeted modules and their shapes come from
the transformers model of the config built on the meta device (no memory, no weights).

A is drawn as PEFT draws it (nn.Linear's default, uniform in +-1/sqrt(in)); B, which PEFT starts
at zero, uniform in +-B_SCALE/sqrt(r): non-zero, so the adapter really changes the outputs. With
the default ``lora_alpha = 2r`` each adapted projection gains about 0.2 times its input's RMS.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pagedlab.lora.adapter import CONFIG_FILE, SUPPORTED_TARGETS, WEIGHTS_FILE
from pagedlab.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

B_SCALE = 0.3
# Short names of the targets, as --lora-targets takes them: q -> q_proj, ...
TARGET_ALIASES = {name.removesuffix("_proj"): name for name in SUPPORTED_TARGETS}


def parse_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """Target module names from ``"q,k,v,o,gate,up,down"`` (short or full names, or a list)."""
    names = targets.split(",") if isinstance(targets, str) else list(targets)
    resolved = []
    for name in (n.strip() for n in names):
        full = TARGET_ALIASES.get(name, name)
        if full not in SUPPORTED_TARGETS:
            raise ValueError(f"LoRA target {name!r} is unknown: targets are among "
                             f"{','.join(TARGET_ALIASES)} (or {','.join(SUPPORTED_TARGETS)})")
        resolved.append(full)
    if not resolved:
        raise ValueError("no LoRA targets given: name at least one of " + ",".join(TARGET_ALIASES))
    return tuple(dict.fromkeys(resolved))


def target_shapes(hf_config, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of the linears named ``targets`` in the
    transformers model of ``hf_config`` (e.g. ``model.layers.0.self_attn.q_proj``)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    shapes = {name: (module.in_features, module.out_features) for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets}
    if not shapes:
        raise ValueError(f"the {type(model).__name__} model has no linear named {list(targets)}: random "
                         "LoRA adapters target the attention and MLP projections of Llama-family models")
    return shapes


def write_random_adapter(directory: str | Path, shapes: dict[str, tuple[int, int]], rank: int,
                         seed: int, dtype: torch.dtype, lora_alpha: int | None = None) -> Path:
    """A random rank-``rank`` adapter over ``shapes`` (``target_shapes``) in PEFT's format in
    ``directory``, its tensors in ``dtype``; ``lora_alpha`` defaults to ``2 * rank``."""
    import torch
    from safetensors.torch import save_file

    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank={rank!r} is invalid: it must be an integer >= 1")
    generator = torch.Generator().manual_seed(seed)

    def uniform(rows: int, cols: int, bound: float) -> torch.Tensor:
        return torch.empty(rows, cols, dtype=dtype).uniform_(-bound, bound, generator=generator)

    tensors = {}
    for name, (fan_in, fan_out) in shapes.items():
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = uniform(rank, fan_in, 1 / math.sqrt(fan_in))
        tensors[f"{prefix}.lora_B.weight"] = uniform(fan_out, rank, B_SCALE / math.sqrt(rank))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    targets = sorted({name.rsplit(".", 1)[-1] for name in shapes})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": rank,
              "lora_alpha": lora_alpha or 2 * rank, "lora_dropout": 0.0, "target_modules": targets,
              "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
              "revision": None}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def write_random_adapters(root: str | Path, hf_config, count: int, rank: int, targets: Sequence[str],
                          dtype: torch.dtype, seed: int = 0) -> list[LoRARequest]:
    """``count`` random adapters (seeds ``seed``, ``seed + 1``, ...) in ``root/lora-<i>``, as the
    requests naming them (ids 1..count)."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"number of LoRA adapters {count!r} is invalid: it must be an integer >= 1")
    shapes = target_shapes(hf_config, targets)
    requests = []
    for i in range(count):
        path = write_random_adapter(Path(root) / f"lora-{i}", shapes, rank, seed + i, dtype)
        requests.append(LoRARequest(f"lora-{i}", i + 1, str(path)))
    return requests
