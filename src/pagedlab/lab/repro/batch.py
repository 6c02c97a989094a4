"""Batch consistency: do greedy outputs depend on what else is in the batch?"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pagedlab.lab.repro.common import (DEFAULT_PROMPTS, CheckResult, NoProgress, encode_all, greedy_params,
                                       verdict)
from pagedlab.lab.repro.compare import check_limit, chosen_logprobs, compare_outputs


def batch_consistency(llm, prompts: Sequence = DEFAULT_PROMPTS, max_tokens: int = 16, seed: int = 0,
                      logprob_tolerance: float = 1e-3, chunk_tokens: int = 16,
                      variants: Sequence[str] | None = None, progress=None) -> CheckResult:
    """Greedy outputs of ``prompts`` run one at a time (the reference) against: one full batch,
    the batch shuffled, prefix caching on (cache warmed by a first pass; off is the full batch, see
    ``_variant_plans``), chunked prefill with a ``chunk_tokens`` budget, and chunked prefill off.
    A variant differs when any token differs
    or a chosen-token logprob moves by more than ``logprob_tolerance``; on an engine in
    batch-invariant mode (``batch_invariant=True``), which promises bitwise-equal logprobs, by any
    amount at all. The engine's plan is restored afterwards. ``progress`` (see ``NoProgress``)
    counts the batch-1 prompts and variants."""
    check_limit("logprob_tolerance", logprob_tolerance)
    ids = encode_all(llm, prompts)
    params = greedy_params(max_tokens)
    info = llm.get_engine_info()
    if info.config.batch_invariant:
        logprob_tolerance = 0.0
    original = {"enable_prefix_caching": info.config.enable_prefix_caching,
                "enable_chunked_prefill": info.config.enable_chunked_prefill,
                "max_num_batched_tokens": info.config.max_num_batched_tokens}
    longest = max(len(p) for p in ids) + max_tokens
    all_variants = _variant_plans(original, chunk_tokens, max(longest, info.max_num_batched_tokens))
    names = _chosen_variants(variants, all_variants)
    details: dict = {}
    progress = progress if progress is not None else NoProgress()
    progress.reset(total=len(ids) + len(names))
    try:
        llm.set_model_args(**dict(original, enable_prefix_caching=False))
        ref_ids, ref_lps = [], []
        for p in ids:  # batch 1: the reference
            t, lp, _ = _run(llm, [p], params)
            ref_ids += t
            ref_lps += lp
            progress.update()
        for name in names:
            llm.set_model_args(**all_variants[name])
            llm.reset_prefix_cache()
            t, lp, cached = _run_variant(llm, name, ids, params, seed)
            details[name] = dict(compare_outputs(ref_ids, ref_lps, t, lp), cached_prompt_tokens=cached)
            progress.update()
    finally:
        llm.set_model_args(**original)
    result = _result(details, len(ids), names, max_tokens, logprob_tolerance, chunk_tokens)
    result.params["batch_invariant"] = info.config.batch_invariant
    if details.get("prefix_cache_on", {}).get("cached_prompt_tokens") == 0:
        result.summary += (f" (prefix_cache_on read no prompt token from the cache, so it tested nothing: "
                           f"give prompts longer than a KV block, {info.config.block_size} tokens)")
    if len(ids) == 1 and {"full_batch", "shuffled"} & set(names):
        result.summary += " (one prompt: full_batch and shuffled ran it alone, so they tested nothing)"
    return result


def _chosen_variants(variants: Sequence[str] | None, all_variants: dict) -> list[str]:
    """The variants asked for (all by default), or a ValueError naming those that do not exist."""
    names = list(variants) if variants is not None else list(all_variants)
    if "prefix_cache_off" in names:
        raise ValueError("batch variant prefix_cache_off is full_batch: every variant but prefix_cache_on "
                         "runs with prefix caching off, as the reference does; ask for full_batch")
    unknown = [n for n in names if n not in all_variants]
    if unknown or not names:
        raise ValueError(f"unknown batch variant(s) {unknown or 'none given'}; choose from "
                         f"{list(all_variants)}")
    return names


def _variant_plans(original: dict, chunk_tokens: int, unchunked_budget: int) -> dict[str, dict]:
    """The plan-level settings of each variant (``set_model_args`` keyword arguments). Every
    variant but ``prefix_cache_on`` runs with prefix caching off, as the batch-1 reference does,
    so that each differs from the reference in one thing; prefix caching off is therefore
    ``full_batch`` itself, ``prefix_cache_on``'s counterpart (a ``prefix_cache_off`` variant ran
    that same plan the same way, and counted the full batch twice)."""
    return {
        "full_batch": dict(original, enable_prefix_caching=False),
        "shuffled": dict(original, enable_prefix_caching=False),
        "prefix_cache_on": dict(original, enable_prefix_caching=True),
        "chunked_prefill": dict(original, enable_prefix_caching=False, enable_chunked_prefill=True,
                                max_num_batched_tokens=chunk_tokens),
        "no_chunked_prefill": dict(original, enable_prefix_caching=False, enable_chunked_prefill=False,
                                   max_num_batched_tokens=unchunked_budget),
    }


def _run(llm, batch: list[list[int]], params) -> tuple[list, list, int]:
    """Greedy token ids and chosen-token logprobs of one batch of prompts, and how many prompt
    tokens the batch read from the prefix cache."""
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs], [chosen_logprobs(o.outputs[0]) for o in outs],
            sum(o.num_cached_tokens for o in outs))


def _run_variant(llm, name: str, ids: list[list[int]], params, seed: int) -> tuple[list, list, int]:
    """The outputs of every prompt under variant ``name``, in prompt order (see ``_run``)."""
    if name == "shuffled":
        order = list(range(len(ids)))
        random.Random(seed).shuffle(order)
        if order == sorted(order):  # e.g. two prompts at seed 0: that would rerun full_batch
            order.reverse()
        t, lp, cached = _run(llm, [ids[i] for i in order], params)
        back = {j: k for k, j in enumerate(order)}
        return [t[back[i]] for i in range(len(ids))], [lp[back[i]] for i in range(len(ids))], cached
    if name == "prefix_cache_on":
        _run(llm, ids, params)  # warm the cache; the second pass reads prompts from it
    return _run(llm, ids, params)


def _result(details: dict, num_prompts: int, names: list[str], max_tokens: int, logprob_tolerance: float,
            chunk_tokens: int) -> CheckResult:
    worst = max(details.values(), key=lambda d: (d["prompts_differing"], d["max_logprob_diff"]))
    differing = {n: d for n, d in details.items()
                 if d["prompts_differing"] or d["max_logprob_diff"] > logprob_tolerance}
    metrics: dict = {"num_prompts": num_prompts, "max_tokens": max_tokens,
                     "variants_differing": len(differing),
                     "max_prompts_differing": worst["prompts_differing"],
                     "max_logprob_diff": max(d["max_logprob_diff"] for d in details.values())}
    firsts = [d["first_divergence"] for d in details.values() if d["first_divergence"] is not None]
    metrics["first_divergence"] = min(firsts) if firsts else None
    for n, d in details.items():
        metrics[f"{n}.prompts_differing"] = d["prompts_differing"]
        metrics[f"{n}.max_logprob_diff"] = d["max_logprob_diff"]
    if "prefix_cache_on" in details:
        metrics["prefix_cache_on.cached_prompt_tokens"] = details["prefix_cache_on"]["cached_prompt_tokens"]
    if differing:
        summary = "; ".join(f"{n}: {d['prompts_differing']}/{num_prompts} prompts differ (first at token "
                            f"{d['first_divergence']}), max |Δ logprob| {d['max_logprob_diff']:.3g}"
                            for n, d in differing.items())
    else:
        summary = (f"all {len(names)} variants give batch-1 tokens for {num_prompts} prompts; "
                   f"max |Δ logprob| {metrics['max_logprob_diff']:.3g} <= {logprob_tolerance:g}")
    return CheckResult("batch", verdict(bool(differing)), summary, metrics, details,
                       {"max_tokens": max_tokens, "logprob_tolerance": logprob_tolerance, "variants": names,
                        "chunk_tokens": chunk_tokens})
