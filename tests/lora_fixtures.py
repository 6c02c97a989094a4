"""PEFT adapters on the tiny random models of conftest, and HF+PEFT greedy references (float32, CPU)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from conftest import hf_greedy

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class TinyAdapter:
    path: str
    peft_model: torch.nn.Module  # the base model with this adapter applied (unmerged)


def make_adapter(base_model, directory: Path, seed: int, rank: int, alpha: int, targets: list[str],
                 use_rslora: bool = False, **lora_kwargs) -> TinyAdapter:
    """A PEFT LoRA adapter with random (non-zero) A and B, saved to ``directory``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora,
                        init_lora_weights=False, **lora_kwargs)
    model = get_peft_model(copy.deepcopy(base_model), config).eval()
    with torch.no_grad():  # PEFT's random init makes the product small: scale B so outputs change
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    model.save_pretrained(directory)
    return TinyAdapter(str(directory), model)


def peft_greedy(adapter: TinyAdapter | None, base_model, prompts, max_new_tokens: int) -> list[list[int]]:
    model = adapter.peft_model if adapter is not None else base_model
    return [hf_greedy(model, p, max_new_tokens) for p in prompts]
