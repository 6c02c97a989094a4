"""A LoRA adapter's outputs in pagedlab against PEFT in HF transformers (float32, CPU)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedlab.lab.lora import lora_request
from pagedlab.lab.repro.common import (DEFAULT_PROMPTS, CheckResult, NoProgress, encode_all, greedy_params,
                                       verdict)
from pagedlab.lab.repro.compare import first_divergence
from pagedlab.lab.repro.hf import hf_eos_ids, hf_greedy_tokens, load_hf_model, trim_at_eos


def lora_parity(llm, adapter: str, prompts: Sequence = DEFAULT_PROMPTS, max_tokens: int = 16,
                progress=None) -> CheckResult:
    """pagedlab (``llm``, built with ``enable_lora=True``) with the PEFT adapter directory
    ``adapter`` vs HF transformers with the same adapter applied by PEFT (unmerged), float32 on
    the CPU: greedy match rate and first divergence; also how many prompts the adapter changes
    (pagedlab with vs without it), so an adapter that does nothing is seen. ``progress`` counts
    HF's prompts and pagedlab's two runs."""
    from peft import PeftModel

    path = str(Path(adapter).expanduser().resolve())
    request = lora_request(path)
    info = llm.get_engine_info()
    hf = PeftModel.from_pretrained(load_hf_model(info.model_path, "float32", device="cpu",
                                                 hf_overrides=info.config.hf_overrides), path).eval()
    ids = encode_all(llm, prompts)
    eos = hf_eos_ids(hf)
    progress = progress if progress is not None else NoProgress()
    progress.reset(total=len(ids) + 2)
    hf_tokens = hf_greedy_tokens(hf, ids, max_tokens, eos, progress)
    params = greedy_params(max_tokens, None, ignore_eos=False)
    token_prompts = [{"prompt_token_ids": p} for p in ids]
    runs = {}
    for name, lora in (("pagedlab", request), ("pagedlab_base", None)):
        outs = llm.generate(token_prompts, params, use_tqdm=False, lora_request=lora)
        runs[name] = [trim_at_eos(o.outputs[0].token_ids, eos) for o in outs]
        progress.update()
    firsts = [first_divergence(a, b) for a, b in zip(hf_tokens, runs["pagedlab"])]
    n_same = sum(f is None for f in firsts)
    changed = sum(a != b for a, b in zip(runs["pagedlab"], runs["pagedlab_base"]))
    metrics = {"num_prompts": len(ids), "greedy_match_rate": n_same / len(ids),
               "first_divergence": min((f for f in firsts if f is not None), default=None),
               "adapter_changes_rate": changed / len(ids)}
    summary = (f"greedy match with PEFT {metrics['greedy_match_rate']:.0%} of {len(ids)} prompts; the "
               f"adapter changes the output of {changed} of them")
    return CheckResult("lora", verdict(n_same < len(ids)), summary, metrics, {"hf_peft": hf_tokens, **runs},
                       {"adapter": path, "adapter_name": request.lora_name, "max_tokens": max_tokens,
                        "hf_dtype": "float32"})
