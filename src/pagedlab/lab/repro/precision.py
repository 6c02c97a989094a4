"""Precision drift: the same model in float32, bfloat16, float16 and quantized variants (FP8 and
AWQ weights, the FP8 KV cache)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedlab.config import DTYPE_NAMES
from pagedlab.lab.manifest import engine_info
from pagedlab.lab.repro.common import (DEFAULT_PROMPTS, CheckResult, NoProgress, encode_all, greedy_params,
                                       verdict)
from pagedlab.lab.repro.compare import (check_limit, check_top_k, first_divergence, teacher_forced, top1,
                                        topk_kl)
from pagedlab.llm import LLM

# Variants besides the dtypes: name -> the engine arguments that make it. Quantized weights keep
# the dtype of their activations ("auto": the checkpoint's on a GPU, float32 on the CPU) unless
# a dtype is joined on, e.g. "bfloat16+fp8". On a dense checkpoint "fp8" quantizes at load
# (E4M3, per-channel weights, per-token activations) and "awq" rounds to nearest 4-bit (not
# activation-aware: a lower bound of a real AWQ checkpoint's quality); on a quantized checkpoint
# every variant loads it as stored. "kv-fp8" stores the KV cache in E4M3 (``kv_cache_dtype``).
PRECISION_VARIANTS: dict[str, dict] = {
    "fp8": {"quantization": "fp8"},
    "awq": {"quantization": "awq"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
}
# The settings the variants alone set (an engine argument for one would change the reference too),
# each variant recording them resolved.
_DESCRIPTIONS = ("quantization", "kv_cache_dtype", "dtype")


def variant_engine_args(variant: str) -> dict:
    """The engine arguments of one precision variant: a dtype (``float32``, ``bf16``, ...), a name
    of ``PRECISION_VARIANTS``, or several joined by "+" (``bfloat16+fp8``)."""
    args: dict = {}
    for part in (p.strip() for p in variant.split("+")):
        if part in DTYPE_NAMES:
            update = {"dtype": DTYPE_NAMES[part]}
        elif part in PRECISION_VARIANTS:
            update = PRECISION_VARIANTS[part]
        else:
            raise ValueError(f"precision variant {variant!r}: {part!r} is neither a dtype "
                             f"{sorted(DTYPE_NAMES)} nor a variant {sorted(PRECISION_VARIANTS)}")
        clash = sorted(set(args) & set(update))
        if clash:
            raise ValueError(f"precision variant {variant!r} sets {clash[0]} twice")
        args.update(update)
    return args


def precision_drift(model: str, prompts: Sequence = DEFAULT_PROMPTS,
                    dtypes: Sequence[str] = ("float32", "bfloat16", "float16"), max_tokens: int = 16,
                    k: int = 20, kl_threshold: float = 1e-3, engine_args: dict | None = None,
                    progress=None) -> CheckResult:
    """Load the same model as each of ``dtypes`` (precision variants, see ``variant_engine_args``;
    the first is the reference) and compare: greedy agreement (prompts whose outputs are
    identical), first divergence, teacher-forced top-1 agreement on the reference's greedy
    sequences, and mean KL(reference || variant) per position (``topk_kl`` over the reference's
    top-``k``; ``k`` >= the vocabulary gives the exact KL); each variant's weight bytes, resolved
    quantization and KV cache dtype are recorded. A variant differs when any greedy output differs
    or its mean KL exceeds ``kl_threshold``; fewer than two variants is a ValueError (one has
    nothing to be compared with). ``progress`` (see ``NoProgress``) counts the variants, each one
    model load and run."""
    dtypes = list(dtypes)
    if len(dtypes) < 2:
        raise ValueError(f"dtypes={dtypes!r}: give at least two precision variants (the first is the "
                         "reference)")
    variants = {name: variant_engine_args(name) for name in dtypes}  # bad names fail before loading
    check_top_k(k)
    check_limit("kl_threshold", kl_threshold)
    engine_args = {k_: v for k_, v in (engine_args or {}).items()
                   if k_ not in ("model", *_DESCRIPTIONS)}
    engine_args.setdefault("kv_cache_memory_bytes", 64 << 20)
    runs: list = []
    engines: list = []
    ref_seqs = None
    progress = progress if progress is not None else NoProgress()
    progress.reset(total=len(dtypes))
    for name in dtypes:
        with LLM(model, **{**engine_args, **variants[name]}) as llm:
            ids = encode_all(llm, prompts)
            outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy_params(max_tokens, None),
                                use_tqdm=False)
            tokens = [o.outputs[0].token_ids for o in outs]
            if ref_seqs is None:
                ref_seqs = [p + t for p, t in zip(ids, tokens)]
            tf = teacher_forced(llm, ref_seqs, k)
            engines.append(_engine_settings(llm))
        runs.append((tokens, tf))
        progress.update()
    return _result(dtypes, runs, engines, max_tokens, k, kl_threshold)


def _result(dtypes: list[str], runs: list, engines: list[dict], max_tokens: int, k: int,
            kl_threshold: float) -> CheckResult:
    ref_dtype = dtypes[0]
    details, differing = {}, []
    for i, dtype in enumerate(dtypes[1:], start=1):
        name = dtype if dtype not in details and dtype != ref_dtype else f"{dtype}#{i}"
        details[name] = _drift(runs[0], runs[i], k)
        details[name].update({key: engines[i].get(key) for key in ("weight_bytes", *_DESCRIPTIONS)})
        if details[name]["greedy_agreement"] < 1.0 or details[name]["mean_kl"] > kl_threshold:
            differing.append(name)
    metrics: dict = {"num_prompts": len(runs[0][0]), "dtypes_differing": len(differing),
                     "reference.weight_bytes": engines[0].get("weight_bytes")}
    for dtype, d in details.items():
        for key, v in d.items():
            if key not in _DESCRIPTIONS:  # metrics are numbers; the names stay in details
                metrics[f"{dtype}.{key}"] = v
    if differing:
        summary = "; ".join(f"{n} vs {ref_dtype}: greedy agreement {details[n]['greedy_agreement']:.0%} "
                            f"(first divergence at token {details[n]['first_divergence']}), teacher-forced "
                            f"top-1 {details[n]['top1_agreement']:.1%}, mean KL {details[n]['mean_kl']:.3g}"
                            for n in differing)
    else:
        summary = (f"{', '.join(dtypes[1:])} match {ref_dtype}: same greedy outputs, "
                   f"mean KL <= {kl_threshold:g}")
    details["engines"] = engines
    return CheckResult("precision", verdict(bool(differing)), summary, metrics, details,
                       {"dtypes": dtypes, "max_tokens": max_tokens, "k": k,
                        "kl_threshold": kl_threshold, "kl_method": "coarse top-k KL (see topk_kl)"})


def _drift(reference: tuple[list, list], other: tuple[list, list], k: int) -> dict:
    """How one dtype's (greedy tokens, teacher-forced top-``k``) differ from the reference dtype's."""
    ref_tokens, ref_tf = reference
    tokens, tf = other
    firsts = [first_divergence(a, b) for a, b in zip(ref_tokens, tokens)]
    n_same = sum(f is None for f in firsts)
    total = agree = 0
    kls = []
    for rp, qp in zip(ref_tf, tf):
        for p, q in zip(rp, qp):
            total += 1
            agree += top1(p) == top1(q)
            kls.append(topk_kl(p, q, k))
    return {"greedy_agreement": n_same / len(tokens),
            "first_divergence": min((f for f in firsts if f is not None), default=None),
            "top1_agreement": agree / total if total else 1.0,
            "mean_kl": sum(kls) / len(kls) if kls else 0.0, "max_kl": max(kls, default=0.0),
            "positions": total}


def _engine_settings(llm) -> dict:
    """The engine's resolved settings and weight bytes for the record (an error is recorded, not
    raised)."""
    try:
        info = llm.get_engine_info()
        return {**engine_info(info), "weight_bytes": info.weight_bytes}
    except Exception as e:  # provenance must not break a check
        return {"error": str(e)}
