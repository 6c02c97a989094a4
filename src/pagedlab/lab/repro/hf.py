"""Checks against HF transformers: left padding in a batched ``generate`` and pagedlab's parity
with HF on the same weights."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from pagedlab.config import DTYPE_NAMES
from pagedlab.lab.repro.common import (DEFAULT_PROMPTS, CheckResult, NoProgress, encode_all, greedy_params,
                                       verdict)
from pagedlab.lab.repro.compare import (check_limit, check_top_k, compare_outputs, first_divergence,
                                        logprob_diff, teacher_forced, top1)
from pagedlab.loader import resolve_model_source
from pagedlab.loader.hf_config import load_hf_config


def hf_torch_dtype(dtype: str):
    """The torch dtype HF transformers loads in for ``dtype`` (float32, bfloat16, float16 or an
    alias such as bf16); any other name is a ValueError naming the choices."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"HF dtype {dtype!r} is invalid: give one of {sorted(DTYPE_NAMES)}")
    import torch

    return getattr(torch, DTYPE_NAMES[dtype])


def load_hf_model(model, dtype: str = "float32", device=None, hf_overrides=None):
    """A loaded HF model as it is, or one loaded from a pagedlab model name/path (GGUF/embedded
    models through their converted directory) in ``dtype`` (see ``hf_torch_dtype``), its config
    changed by ``hf_overrides`` as the engine's is (``EngineConfig.hf_overrides``)."""
    if not isinstance(model, (str, Path)):
        return model
    import torch
    import transformers

    torch_dtype = hf_torch_dtype(dtype)
    path = resolve_model_source(str(model)).path
    config = load_hf_config(path, hf_overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), config=config, dtype=torch_dtype, attn_implementation="sdpa").eval()
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return hf.to(device)


def hf_token_ids(model, prompts: Sequence) -> list[list[int]]:
    """Token ids of each prompt (text through the HF model's own tokenizer)."""
    if all(not isinstance(p, str) for p in prompts):
        return [list(p) for p in prompts]
    import transformers

    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return [list(p) if not isinstance(p, str) else list(tok(p).input_ids) for p in prompts]


def trim_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


@contextmanager
def plain_greedy(hf):
    """While inside, ``hf.generate`` decodes plain greedy: it would otherwise apply what the model's
    generation_config.json sets (repetition_penalty, no_repeat_ngram_size, suppressed tokens, ...),
    which the engine's greedy runs do not. Only the special token ids are kept."""
    import transformers

    saved = hf.generation_config
    hf.generation_config = transformers.GenerationConfig(
        bos_token_id=saved.bos_token_id, eos_token_id=saved.eos_token_id, pad_token_id=saved.pad_token_id,
        decoder_start_token_id=saved.decoder_start_token_id)
    try:
        yield hf
    finally:
        hf.generation_config = saved


def hf_greedy_tokens(hf, ids: list[list[int]], max_tokens: int, eos: set[int], progress) -> list[list[int]]:
    """HF's greedy continuation of each prompt alone (up to EOS), one ``progress`` update per
    prompt: ``generate``, or for LongRoPE models ``hf_greedy_whole_sequence``."""
    import torch

    dev = next(hf.parameters()).device
    tokens = []
    with torch.no_grad():
        for p in ids:
            if switches_long_rope(hf):
                tokens.append(hf_greedy_whole_sequence(hf, p, max_tokens, eos)[0])
            else:
                with plain_greedy(hf):
                    out = hf.generate(torch.tensor([p], device=dev),
                                      attention_mask=torch.ones(1, len(p), dtype=torch.long, device=dev),
                                      max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=hf.generation_config.pad_token_id or min(eos or {0}))
                tokens.append(trim_at_eos(out[0, len(p):].tolist(), eos))
            progress.update()
    return tokens


def switches_long_rope(hf) -> bool:
    """Whether ``hf`` is a LongRoPE model (Phi-3 long context, Phi-4-mini): past its original
    context length it computes the whole sequence with its long factors."""
    params = getattr(hf.config, "rope_parameters", None) or getattr(hf.config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type")) in ("longrope", "su")


def hf_greedy_whole_sequence(hf, prompt: list[int], max_tokens: int, eos: set[int]) -> tuple[list[int], list]:
    """Greedy tokens (up to EOS) and each step's logits from one forward of the whole sequence per
    token: HF's reference for LongRoPE models, which recompute every token with the long factors
    once the sequence passes the switch. ``generate`` does that in some transformers releases
    only: 5.17 drops the cache at the switch but then feeds the new token alone."""
    import torch

    dev = next(hf.parameters()).device
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits.append(hf(torch.tensor([ids], device=dev)).logits[0, -1])
            ids.append(int(logits[-1].argmax()))
            if ids[-1] in eos:
                break
    return ids[len(prompt):], logits


def hf_eos_ids(model) -> set[int]:
    """The EOS ids of an HF model (its generation config's, else its config's)."""
    eos = getattr(model.generation_config, "eos_token_id", None) or getattr(model.config, "eos_token_id",
                                                                            None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def padding_check(model, prompts: Sequence = DEFAULT_PROMPTS, max_tokens: int = 16,
                  attention_mask: str = "correct", logprob_tolerance: float = 1e-3, dtype: str = "float32",
                  pad_token_id: int | None = None, progress=None, hf_overrides=None) -> CheckResult:
    """HF transformers ``generate`` (plain greedy, as ``plain_greedy``) on all prompts in one
    left-padded batch vs one prompt at a time. ``attention_mask``: "correct" (zeros on padding)
    or "ones" (the common mistake: padding attended to). Compares greedy tokens (up to EOS) and
    the log-softmax of each step's scores (``max |Δ logprob|`` of the chosen tokens while the
    outputs agree). ``progress`` (see ``NoProgress``) counts the one-at-a-time prompts and the
    batch. ``hf_overrides`` changes the model's config first (``EngineConfig.hf_overrides``)."""
    if attention_mask not in ("correct", "ones"):
        raise ValueError(f"attention_mask={attention_mask!r} is invalid: 'correct' or 'ones'")
    check_limit("logprob_tolerance", logprob_tolerance)
    hf = load_hf_model(model, dtype, hf_overrides=hf_overrides)
    ids = hf_token_ids(hf, prompts)
    if pad_token_id is None:
        pad_token_id = hf.generation_config.pad_token_id
        if pad_token_id is None:
            pad_token_id = hf.config.pad_token_id
        if pad_token_id is None:
            pad_token_id = min(hf_eos_ids(hf) or {0})
    gen = {"max_new_tokens": max_tokens, "do_sample": False, "output_scores": True,
           "return_dict_in_generate": True, "pad_token_id": pad_token_id}
    progress = progress if progress is not None else NoProgress()
    progress.reset(total=len(ids) + 1)
    with plain_greedy(hf):  # a generation config's no_repeat_ngram_size would count the padding
        single_tokens, single_lps = _generate_one_at_a_time(hf, ids, gen, progress)
        batch_tokens, batch_lps = _generate_left_padded(hf, ids, gen, attention_mask == "ones")
    progress.update()
    cmp = compare_outputs(single_tokens, single_lps, batch_tokens, batch_lps)
    padded = sum(len(p) < max(map(len, ids)) for p in ids)
    differs = cmp["prompts_differing"] > 0 or cmp["max_logprob_diff"] > logprob_tolerance
    metrics = {"num_prompts": len(ids), "padded_prompts": padded,
               "prompts_differing": cmp["prompts_differing"],
               "greedy_match_rate": 1 - cmp["prompts_differing"] / len(ids),
               "first_divergence": cmp["first_divergence"], "max_logprob_diff": cmp["max_logprob_diff"]}
    if differs:
        summary = (f"left-padded batch differs from one-at-a-time: {cmp['prompts_differing']}/{len(ids)} "
                   f"prompts (first at token {cmp['first_divergence']}), max |Δ logprob| "
                   f"{cmp['max_logprob_diff']:.3g} (attention_mask={attention_mask})")
    else:
        summary = (f"left-padded batch ({padded} of {len(ids)} prompts padded) gives the one-at-a-time "
                   f"tokens; max |Δ logprob| {cmp['max_logprob_diff']:.3g} <= {logprob_tolerance:g}")
        if not padded:
            summary += " (no prompt needed padding, so nothing was tested: give prompts of different lengths)"
    return CheckResult("padding", verdict(differs), summary, metrics,
                       {"single": single_tokens, "batched": batch_tokens},
                       {"attention_mask": attention_mask, "max_tokens": max_tokens, "dtype": dtype,
                        "pad_token_id": pad_token_id, "logprob_tolerance": logprob_tolerance})


def _chosen_step_logprobs(scores, tokens: list[int], row: int) -> list[float]:
    """The log-softmax of each generate step's scores at the token chosen there."""
    import torch

    return [torch.log_softmax(s[row].float(), -1)[t].item() for s, t in zip(scores, tokens)]


def _generate_one_at_a_time(hf, ids: list[list[int]], gen: dict, progress) -> tuple[list, list]:
    import torch

    dev = next(hf.parameters()).device
    eos = hf_eos_ids(hf)
    tokens, lps = [], []
    with torch.no_grad():
        for p in ids:
            out = hf.generate(torch.tensor([p], device=dev),
                              attention_mask=torch.ones(1, len(p), dtype=torch.long, device=dev), **gen)
            toks = out.sequences[0, len(p):].tolist()
            tokens.append(trim_at_eos(toks, eos))
            lps.append(_chosen_step_logprobs(out.scores, toks, 0))
            progress.update()
    return tokens, lps


def _generate_left_padded(hf, ids: list[list[int]], gen: dict, mask_all_ones: bool) -> tuple[list, list]:
    import torch

    dev = next(hf.parameters()).device
    eos = hf_eos_ids(hf)
    width = max(len(p) for p in ids)
    input_ids = torch.tensor([[gen["pad_token_id"]] * (width - len(p)) + p for p in ids], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=dev)
    if mask_all_ones:
        mask = torch.ones_like(mask)
    with torch.no_grad():
        out = hf.generate(input_ids, attention_mask=mask, **gen)
    tokens, lps = [], []
    for row in range(len(ids)):
        toks = out.sequences[row, width:].tolist()
        tokens.append(trim_at_eos(toks, eos))
        lps.append(_chosen_step_logprobs(out.scores, toks, row))
    return tokens, lps


def hf_parity(llm, prompts: Sequence = DEFAULT_PROMPTS, hf_model=None, max_tokens: int = 16, k: int = 5,
              hf_dtype: str = "float32", logprob_tolerance: float = 1e-3, progress=None) -> CheckResult:
    """pagedlab (``llm``) vs HF transformers on the same weights (``hf_model``: a loaded model, or
    None to load the llm's model in ``hf_dtype``). Greedy match rate: prompts whose greedy outputs
    (up to EOS) are identical. Teacher-forced on prompt + HF's greedy output: max |Δ logprob| over
    each position's actual next token and pagedlab's top-``k``, and top-1 agreement. ``progress``
    (see ``NoProgress``) counts HF's prompts, pagedlab's run and the teacher-forced comparison."""
    check_top_k(k)
    check_limit("logprob_tolerance", logprob_tolerance)
    info = llm.get_engine_info()
    hf = load_hf_model(hf_model if hf_model is not None else info.model_path, hf_dtype, device=info.device,
                       hf_overrides=info.config.hf_overrides)  # the engine's model: its config as changed
    ids = encode_all(llm, prompts)
    eos = hf_eos_ids(hf)
    progress = progress if progress is not None else NoProgress()
    progress.reset(total=len(ids) + 2)
    hf_tokens = hf_greedy_tokens(hf, ids, max_tokens, eos, progress)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        greedy_params(max_tokens, None, ignore_eos=False), use_tqdm=False)
    pl_tokens = [trim_at_eos(o.outputs[0].token_ids, eos) for o in outs]
    progress.update()
    firsts = [first_divergence(a, b) for a, b in zip(hf_tokens, pl_tokens)]
    seqs = [p + t for p, t in zip(ids, hf_tokens)]
    tf = teacher_forced(llm, seqs, k)
    max_d, agree, total = _teacher_forced_parity(hf, seqs, tf)
    progress.update()
    n_same = sum(f is None for f in firsts)
    metrics = {"num_prompts": len(ids), "greedy_match_rate": n_same / len(ids),
               "first_divergence": min((f for f in firsts if f is not None), default=None),
               "top1_agreement": agree / total if total else 1.0, "max_abs_logprob_diff": max_d,
               "positions": total}
    differs = n_same < len(ids) or agree < total or max_d > logprob_tolerance
    summary = (f"greedy match {metrics['greedy_match_rate']:.0%} of {len(ids)} prompts, teacher-forced top-1 "
               f"agreement {metrics['top1_agreement']:.2%} over {total} positions, max |Δ logprob| "
               f"{max_d:.3g} "
               f"({'>' if max_d > logprob_tolerance else '<='} {logprob_tolerance:g})")
    return CheckResult("hf", verdict(differs), summary, metrics, {"hf": hf_tokens, "pagedlab": pl_tokens},
                       {"max_tokens": max_tokens, "k": k, "hf_dtype": hf_dtype,
                        "pagedlab_dtype": str(info.dtype).removeprefix("torch."),
                        "logprob_tolerance": logprob_tolerance})


def _teacher_forced_parity(hf, seqs: list[list[int]], tf: list[list[dict[int, float]]]) -> tuple[float, int,
                                                                                                 int]:
    """Max |Δ logprob| between HF and pagedlab's teacher-forced top-k, top-1 agreements, positions."""
    import torch

    dev = next(hf.parameters()).device
    max_d, agree, total = 0.0, 0, 0
    with torch.no_grad():
        for seq, positions in zip(seqs, tf):
            logits = hf(torch.tensor([seq], device=dev)).logits[0].float()
            lsm = torch.log_softmax(logits, -1)
            for i, d in enumerate(positions):  # position i predicts seq[i + 1]
                row = lsm[i]
                total += 1
                agree += int(row.argmax().item()) == top1(d)
                for t, lp in d.items():
                    max_d = max(max_d, logprob_diff(row[t].item(), lp))
    return max_d, agree, total
