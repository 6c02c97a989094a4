"""Reproducibility checks: does a number move when it should not?

Each check runs one cause of "my result differs from the paper" and returns a ``CheckResult``
with a verdict (``"same"`` or ``"differs"``), the numbers behind it (``metrics``, flat scalars)
and details (per-variant numbers, examples):

- ``batch_consistency``: greedy at batch 1 vs one full batch (prefix caching off), shuffled,
  prefix caching on, chunked prefill on/off: prompts that differ, first diverging position, max
  logprob difference.
- ``seed_sensitivity``: sampling params over N seeds: mean, std, 95% interval, min, max of each
  metric; metrics whose relative spread exceeds a threshold are flagged.
- ``precision_drift``: float32 vs bfloat16, float16, FP8 and AWQ weights: greedy agreement,
  first divergence, teacher-forced top-1 agreement and mean KL against float32.
- ``tokenizer_drift``: two tokenizers: fraction of prompts tokenized differently, examples side by
  side, and the effect on BLEU / exact match of running the model with each.
- ``padding_check``: HF transformers batched with left padding vs one prompt at a time (catches
  attention-mask mistakes in HF-based pipelines).
- ``hf_parity``: pagedlab vs HF transformers on the same weights: teacher-forced max |Δ logprob|,
  top-1 agreement, greedy match rate.
- ``lora_parity``: pagedlab with a LoRA adapter vs PEFT in HF transformers (float32, CPU): greedy
  match rate, first divergence, and how many prompts the adapter changes.
- ``speculation_parity``: the same engine with and without speculative decoding: greedy and seeded
  sampled tokens must be equal; the proposals' acceptance.

``store_result(result, url, llm=...)`` stores a result with the provenance manifest in the lab's
results database (experiment ``"repro"``). See docs/repro.md. One module per check; this package
gathers their public names, loaded on first use (the command line's ``--help`` needs none).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "batch_consistency": "batch", "ALL_CHECKS": "common", "DEFAULT_PROMPTS": "common",
    "CheckResult": "common", "load_prompts": "common", "first_divergence": "compare",
    "teacher_forced": "compare", "topk_kl": "compare", "hf_parity": "hf", "padding_check": "hf",
    "precision_drift": "precision", "default_metrics": "seeds", "seed_sensitivity": "seeds",
    "summarize": "seeds", "store_result": "storing", "tokenizer_drift": "tokenizer", "lora_parity": "lora",
    "speculation_parity": "speculation",
}

__all__ = ["ALL_CHECKS", "DEFAULT_PROMPTS", "CheckResult", "batch_consistency", "default_metrics",
           "first_divergence", "hf_parity", "load_prompts", "lora_parity", "padding_check", "precision_drift",
           "seed_sensitivity", "speculation_parity", "store_result", "summarize", "teacher_forced",
           "tokenizer_drift", "topk_kl"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedlab.lab.repro' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pagedlab.lab.repro.{module}"), name)


def __dir__():
    return __all__
