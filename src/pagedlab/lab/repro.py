"""Reproducibility checks: does a number move when it should not?

Each check runs one cause of "my result differs from the paper" and returns a ``CheckResult``
with a verdict (``"same"`` or ``"differs"``), the numbers behind it (``metrics``, flat scalars)
and details (per-variant numbers, examples):

- ``batch_consistency``: greedy at batch 1 vs one full batch, shuffled, prefix caching on/off,
  chunked prefill on/off: prompts that differ, first diverging position, max logprob difference.
- ``seed_sensitivity``: sampling params over N seeds: mean, std, 95% interval, min, max of each
  metric; metrics whose relative spread exceeds a threshold are flagged.
- ``precision_drift``: float32 vs bfloat16 vs float16 on the same weights: greedy agreement,
  first divergence, teacher-forced top-1 agreement and mean KL against float32.
- ``tokenizer_drift``: two tokenizers: fraction of prompts tokenized differently, examples side by
  side, and the effect on BLEU / exact match of running the model with each.
- ``padding_check``: HF transformers batched with left padding vs one prompt at a time (catches
  attention-mask mistakes in HF-based pipelines).
- ``hf_parity``: pagedlab vs HF transformers on the same weights: teacher-forced max |Δ logprob|,
  top-1 agreement, greedy match rate.

``store_result(result, url, llm=...)`` stores a result with the provenance manifest in the lab's
results database (experiment ``"repro"``). See docs/repro.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Explain why the sky is blue in one sentence.",
    "Write a short poem about the sea.",
    "Question: what is two plus two?\nAnswer:",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to French: good morning, my friend.",
    "def fibonacci(n):",
)
ALL_CHECKS = ("batch", "seeds", "precision", "tokenizer", "padding", "hf")


@dataclass
class CheckResult:
    """The outcome of one check: ``verdict`` is "same" or "differs"; ``metrics`` are flat numbers
    (stored as the run's metrics); ``details`` holds per-variant numbers and examples."""

    check: str
    verdict: str
    summary: str
    metrics: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        return self.verdict == "same"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def format(self) -> str:
        """A few human-readable lines: the verdict, the summary and the numbers."""
        lines = [f"[{self.check}] {self.verdict.upper()}: {self.summary}"]
        for k, v in self.metrics.items():
            lines.append(f"    {k:<40} {_fmt(v)}")
        return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _verdict(differs: bool) -> str:
    return "differs" if differs else "same"


# ---- prompts ---------------------------------------------------------------------------------------
def load_prompts(path: str | Path) -> tuple[list, list | None]:
    """Prompts (and references, when given) from a file: ``.jsonl`` lines with "prompt" (text) or
    "prompt_token_ids" and optional "reference"; ``.json`` a list of such objects or strings; any
    other file, one text prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--prompts {str(path)!r} is not a file")
    text = path.read_text()
    if path.suffix in (".jsonl", ".json"):
        try:
            items = json.loads(text) if path.suffix == ".json" else [json.loads(l) for l in text.splitlines()
                                                                    if l.strip()]
        except ValueError as e:
            raise ValueError(f"--prompts {str(path)!r} is not valid JSON: {e}") from None
        prompts, refs = [], []
        for i, item in enumerate(items):
            if isinstance(item, str):
                prompts.append(item)
                refs.append(None)
            elif isinstance(item, dict) and ("prompt" in item or "prompt_token_ids" in item):
                prompts.append(item["prompt"] if "prompt" in item else list(item["prompt_token_ids"]))
                refs.append(item.get("reference"))
            else:
                raise ValueError(f"--prompts {str(path)!r} item {i} has no 'prompt' or 'prompt_token_ids'")
        return prompts, (refs if any(r is not None for r in refs) else None)
    prompts = [l for l in text.splitlines() if l.strip()]
    if not prompts:
        raise ValueError(f"--prompts {str(path)!r} holds no prompts")
    return prompts, None


def _encode_all(llm, prompts: Sequence) -> list[list[int]]:
    """Token ids of each prompt (text through the engine's tokenizer; id lists as they are)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            tok = llm.get_tokenizer()
            if tok is None:
                raise ValueError("text prompts need a tokenizer, and this model has none: give token-id prompts")
            out.append(list(tok(p).input_ids))
        elif isinstance(p, dict):
            out.append(_encode_all(llm, [p.get("prompt_token_ids", p.get("prompt"))])[0])
        else:
            out.append([int(t) for t in p])
    return out


def _greedy(max_tokens: int, logprobs: int | None = 0, ignore_eos: bool = True):
    from pagedlab import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=ignore_eos)


def _chosen_logprobs(completion) -> list[float]:
    if not completion.logprobs:
        return []
    return [pos[t].logprob for t, pos in zip(completion.token_ids, completion.logprobs)]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where the two sequences differ (the shorter length when one is
    a prefix of the other), or None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _compare(ref_ids, ref_lps, ids, lps) -> dict:
    """How a run's outputs (token ids and chosen-token logprobs per prompt) differ from a reference."""
    firsts, max_dlp, n_diff = [], 0.0, 0
    for r, rl, o, ol in zip(ref_ids, ref_lps, ids, lps):
        d = first_divergence(r, o)
        if d is not None:
            n_diff += 1
            firsts.append(d)
        upto = len(r) if d is None else d
        for x, y in zip(rl[:upto], ol[:upto]):
            max_dlp = max(max_dlp, abs(x - y))
    return {"prompts_differing": n_diff, "first_divergence": min(firsts) if firsts else None,
            "max_logprob_diff": max_dlp}


# ---- 1. batch consistency ---------------------------------------------------------------------------
def batch_consistency(llm, prompts: Sequence = DEFAULT_PROMPTS, max_tokens: int = 16, seed: int = 0,
                      logprob_tolerance: float = 1e-3, chunk_tokens: int = 16,
                      variants: Sequence[str] | None = None) -> CheckResult:
    """Greedy outputs of ``prompts`` run one at a time (the reference) against: one full batch,
    the batch shuffled, prefix caching on (cache warmed by a first pass) and off, chunked prefill
    with a ``chunk_tokens`` budget, and chunked prefill off. A variant differs when any token differs
    or a chosen-token logprob moves by more than ``logprob_tolerance``. The engine's plan is
    restored afterwards."""
    ids = _encode_all(llm, prompts)
    params = _greedy(max_tokens)
    engine = llm.llm_engine
    original = {"enable_prefix_caching": engine.config.enable_prefix_caching,
                "enable_chunked_prefill": engine.config.enable_chunked_prefill,
                "max_num_batched_tokens": engine.config.max_num_batched_tokens}
    longest = max(len(p) for p in ids) + max_tokens

    def run(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [_chosen_logprobs(o.outputs[0]) for o in outs]

    all_variants = {
        "full_batch": dict(original, enable_prefix_caching=False),
        "shuffled": dict(original, enable_prefix_caching=False),
        "prefix_cache_on": dict(original, enable_prefix_caching=True),
        "prefix_cache_off": dict(original, enable_prefix_caching=False),
        "chunked_prefill": dict(original, enable_prefix_caching=False, enable_chunked_prefill=True,
                                max_num_batched_tokens=chunk_tokens),
        "no_chunked_prefill": dict(original, enable_prefix_caching=False, enable_chunked_prefill=False,
                                   max_num_batched_tokens=max(longest, engine.max_num_batched_tokens)),
    }
    names = list(variants) if variants is not None else list(all_variants)
    unknown = [n for n in names if n not in all_variants]
    if unknown:
        raise ValueError(f"unknown batch variant(s) {unknown}; choose from {list(all_variants)}")
    details: dict = {}
    try:
        llm.set_model_args(**dict(original, enable_prefix_caching=False))
        ref_ids, ref_lps = [], []
        for p in ids:  # batch 1: the reference
            t, lp = run([p])
            ref_ids += t
            ref_lps += lp
        for name in names:
            llm.set_model_args(**all_variants[name])
            llm.reset_prefix_cache()
            if name == "shuffled":
                order = list(range(len(ids)))
                random.Random(seed).shuffle(order)
                t, lp = run([ids[i] for i in order])
                back = {j: k for k, j in enumerate(order)}
                t, lp = [t[back[i]] for i in range(len(ids))], [lp[back[i]] for i in range(len(ids))]
            else:
                if name == "prefix_cache_on":
                    run(ids)  # warm the cache; the second pass reads prompts from it
                t, lp = run(ids)
            details[name] = _compare(ref_ids, ref_lps, t, lp)
    finally:
        llm.set_model_args(**original)
    worst = max(details.values(), key=lambda d: (d["prompts_differing"], d["max_logprob_diff"]))
    differing = {n: d for n, d in details.items()
                 if d["prompts_differing"] or d["max_logprob_diff"] > logprob_tolerance}
    metrics: dict = {"num_prompts": len(ids), "max_tokens": max_tokens,
                     "variants_differing": len(differing),
                     "max_prompts_differing": worst["prompts_differing"],
                     "max_logprob_diff": max(d["max_logprob_diff"] for d in details.values())}
    firsts = [d["first_divergence"] for d in details.values() if d["first_divergence"] is not None]
    metrics["first_divergence"] = min(firsts) if firsts else None
    for n, d in details.items():
        metrics[f"{n}.prompts_differing"] = d["prompts_differing"]
        metrics[f"{n}.max_logprob_diff"] = d["max_logprob_diff"]
    if differing:
        summary = "; ".join(f"{n}: {d['prompts_differing']}/{len(ids)} prompts differ (first at token "
                            f"{d['first_divergence']}), max |Δ logprob| {d['max_logprob_diff']:.3g}"
                            for n, d in differing.items())
    else:
        summary = (f"all {len(names)} variants give batch-1 tokens for {len(ids)} prompts; max |Δ logprob| "
                   f"{metrics['max_logprob_diff']:.3g} <= {logprob_tolerance:g}")
    return CheckResult("batch", _verdict(bool(differing)), summary, metrics, details,
                       {"max_tokens": max_tokens, "logprob_tolerance": logprob_tolerance, "variants": names,
                        "chunk_tokens": chunk_tokens})


# ---- 2. seed sensitivity -----------------------------------------------------------------------------
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 60: 2.000}


def _t975(df: int) -> float:
    """Student's t 97.5% quantile (two-sided 95% interval of the mean)."""
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, df))
    except ImportError:
        keys = [k for k in sorted(_T975) if k <= df]
        return _T975[keys[-1]] if df <= 60 else 1.96


def summarize(values: Sequence[float]) -> dict:
    """mean, std (sample), the 95% interval of the mean (Student's t), min and max."""
    vals = [float(v) for v in values]
    n = len(vals)
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    half = _t975(n - 1) * std / math.sqrt(n) if n > 1 else 0.0
    return {"mean": mean, "std": std, "ci95_low": mean - half, "ci95_high": mean + half,
            "min": min(vals), "max": max(vals)}


def default_metrics(outputs, references: Sequence | None = None) -> dict[str, float]:
    """Metrics of one run: mean output length, mean per-token logprob, distinct-2 of the text,
    and (with references) exact match and BLEU."""
    comps = [o.outputs[0] for o in outputs]
    n_tok = [len(c.token_ids) for c in comps]
    m = {"mean_output_tokens": sum(n_tok) / len(n_tok)}
    lps = [c.cumulative_logprob / len(c.token_ids) for c in comps if c.cumulative_logprob is not None and c.token_ids]
    if lps:
        m["mean_token_logprob"] = sum(lps) / len(lps)
    grams = [tuple(c.token_ids[i:i + 2]) for c in comps for i in range(len(c.token_ids) - 1)]
    if grams:
        m["distinct_2"] = len(set(grams)) / len(grams)
    if references is not None:
        texts = [c.text for c in comps]
        refs = [r if isinstance(r, str) else (r[0] if r else "") for r in references]
        m["exact_match"] = sum(t.strip() == r.strip() for t, r in zip(texts, refs)) / len(refs)
        bleu = _bleu(texts, refs)
        if bleu is not None:
            m["bleu"] = bleu
    return m


def _bleu(hyps: list[str], refs: list[str]) -> float | None:
    try:
        import sacrebleu
    except ImportError:
        return None
    return float(sacrebleu.corpus_bleu(hyps, [refs]).score)


def seed_sensitivity(llm, prompts: Sequence = DEFAULT_PROMPTS, params=None, seeds: Sequence[int] = range(5),
                     metrics_fn: Callable | None = None, references: Sequence | None = None,
                     threshold: float | dict = 0.05) -> CheckResult:
    """Run ``params`` (default: temperature 0.8, top_p 0.95, 32 tokens) once per seed and summarize
    each metric over seeds. ``metrics_fn(outputs, references) -> {name: value}`` (default
    ``default_metrics``). A metric is flagged when its relative spread std/|mean| (absolute std when
    the mean is 0) exceeds ``threshold`` (a number, or a dict metric -> threshold)."""
    from pagedlab import SamplingParams

    if params is None:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, logprobs=0)
    seeds = list(seeds)
    if len(seeds) < 2:
        raise ValueError(f"seeds={seeds} is too few: give at least 2 seeds")
    fn = metrics_fn or default_metrics
    ids = _encode_all(llm, prompts)
    per_seed: list[dict] = []
    for s in seeds:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], dataclasses.replace(params, seed=s),
                            use_tqdm=False)
        per_seed.append(fn(outs, references))
    names = [k for k in per_seed[0] if all(k in d for d in per_seed)]
    stats, flagged, metrics = {}, [], {"num_seeds": len(seeds), "num_prompts": len(ids)}
    for name in names:
        st = summarize([d[name] for d in per_seed])
        limit = threshold.get(name, 0.05) if isinstance(threshold, dict) else threshold
        spread = st["std"] / abs(st["mean"]) if st["mean"] != 0 else st["std"]
        st["relative_spread"] = spread
        st["flagged"] = spread > limit
        stats[name] = st
        if st["flagged"]:
            flagged.append(name)
        for k, v in st.items():
            metrics[f"{name}.{k}"] = float(v) if not isinstance(v, bool) else int(v)
    metrics["metrics_flagged"] = len(flagged)
    if flagged:
        summary = "; ".join(f"{n} = {stats[n]['mean']:.4g} ± {stats[n]['std']:.3g} (95% CI "
                            f"[{stats[n]['ci95_low']:.4g}, {stats[n]['ci95_high']:.4g}], spread "
                            f"{stats[n]['relative_spread']:.2%})" for n in flagged)
        summary = f"{len(flagged)} of {len(names)} metrics vary over {len(seeds)} seeds: {summary}"
    else:
        summary = f"no metric varies more than the threshold over {len(seeds)} seeds"
    return CheckResult("seeds", _verdict(bool(flagged)), summary, metrics,
                       {"stats": stats, "per_seed": per_seed, "flagged": flagged},
                       {"seeds": seeds, "threshold": threshold, "sampling": dataclasses.asdict(params)})


# ---- teacher forcing ---------------------------------------------------------------------------------
def teacher_forced(llm, sequences: Sequence[Sequence[int]], k: int = 20) -> list[list[dict[int, float]]]:
    """For each sequence, for each position 1..n-1: {token id: logprob} of the top-``k`` next tokens
    plus the actual token (pagedlab's ``prompt_logprobs`` with ``max_tokens=1``)."""
    from pagedlab import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
    outs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
    return [[{t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs[1:]] for o in outs]


def _top1(d: dict[int, float]) -> int:
    return max(d, key=d.get)


def topk_kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(P || Q) on the coarse distribution {P's listed tokens, everything else}, from two partial
    logprob dicts. A token of P missing from Q's dict gets Q's smallest listed logprob (an upper
    bound on its probability). The coarse KL is a lower bound of the full-vocabulary KL and equals
    it when the dicts cover the vocabulary."""
    floor = min(q.values())
    kl, p_seen, q_seen = 0.0, 0.0, 0.0
    for t, lp in p.items():
        lq = q.get(t, floor)
        pp = math.exp(lp)
        kl += pp * (lp - lq)
        p_seen += pp
        q_seen += math.exp(lq)
    p_rest, q_rest = max(1.0 - p_seen, 0.0), max(1.0 - q_seen, 1e-12)
    if p_rest > 1e-12:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


# ---- 3. precision drift ------------------------------------------------------------------------------
def precision_drift(model: str, prompts: Sequence = DEFAULT_PROMPTS,
                    dtypes: Sequence[str] = ("float32", "bfloat16", "float16"), max_tokens: int = 16, k: int = 20,
                    kl_threshold: float = 1e-3, engine_args: dict | None = None) -> CheckResult:
    """Load the same weights in each of ``dtypes`` (the first is the reference) and compare:
    greedy agreement (prompts whose outputs are identical), first divergence, teacher-forced top-1
    agreement on the reference's greedy sequences, and mean KL(reference || dtype) per position
    (``topk_kl`` over the reference's top-``k``; ``k`` >= the vocabulary gives the exact KL).
    A dtype differs when any greedy output differs or its mean KL exceeds ``kl_threshold``."""
    from pagedlab import LLM

    engine_args = {k_: v for k_, v in (engine_args or {}).items() if k_ not in ("model", "dtype")}
    engine_args.setdefault("kv_cache_memory_bytes", 64 << 20)
    runs: list = []
    engines: list = []
    ref_seqs = None
    for dtype in dtypes:
        with LLM(model, dtype=dtype, **engine_args) as llm:
            ids = _encode_all(llm, prompts)
            outs = llm.generate([{"prompt_token_ids": p} for p in ids], _greedy(max_tokens, None), use_tqdm=False)
            tokens = [o.outputs[0].token_ids for o in outs]
            if ref_seqs is None:
                ref_seqs = [p + t for p, t in zip(ids, tokens)]
            tf = teacher_forced(llm, ref_seqs, k)
            engines.append(_engine_info(llm))
        runs.append((tokens, tf))
    ref_dtype = dtypes[0]
    ref_tokens, ref_tf = runs[0]
    details, differing = {}, []
    for i, dtype in enumerate(dtypes[1:], start=1):
        tokens, tf = runs[i]
        name = dtype if dtype not in details and dtype != ref_dtype else f"{dtype}#{i}"
        firsts = [first_divergence(a, b) for a, b in zip(ref_tokens, tokens)]
        n_same = sum(f is None for f in firsts)
        total = agree = 0
        kls = []
        for rp, qp in zip(ref_tf, tf):
            for p, q in zip(rp, qp):
                total += 1
                agree += _top1(p) == _top1(q)
                kls.append(topk_kl(p, q))
        d = {"greedy_agreement": n_same / len(tokens),
             "first_divergence": min((f for f in firsts if f is not None), default=None),
             "top1_agreement": agree / total if total else 1.0,
             "mean_kl": sum(kls) / len(kls) if kls else 0.0, "max_kl": max(kls, default=0.0),
             "positions": total}
        details[name] = d
        if n_same < len(tokens) or d["mean_kl"] > kl_threshold:
            differing.append(name)
    metrics: dict = {"num_prompts": len(ref_tokens), "dtypes_differing": len(differing)}
    for dtype, d in details.items():
        for key, v in d.items():
            metrics[f"{dtype}.{key}"] = v
    if differing:
        summary = "; ".join(f"{n} vs {ref_dtype}: greedy agreement {details[n]['greedy_agreement']:.0%} "
                            f"(first divergence at token {details[n]['first_divergence']}), teacher-forced "
                            f"top-1 {details[n]['top1_agreement']:.1%}, mean KL {details[n]['mean_kl']:.3g}"
                            for n in differing)
    else:
        summary = f"{', '.join(dtypes[1:])} match {ref_dtype}: same greedy outputs, mean KL <= {kl_threshold:g}"
    details["engines"] = engines
    return CheckResult("precision", _verdict(bool(differing)), summary, metrics, details,
                       {"dtypes": list(dtypes), "max_tokens": max_tokens, "k": k, "kl_threshold": kl_threshold,
                        "kl_method": "coarse top-k KL (see topk_kl)"})


def _engine_info(llm) -> dict:
    try:
        from pagedlab.lab.manifest import engine_info

        return engine_info(llm.llm_engine)
    except Exception as e:  # noqa: BLE001  (provenance must not break a check)
        return {"error": str(e)}


# ---- 4. tokenizer drift ------------------------------------------------------------------------------
def _load_tokenizer(tok):
    if isinstance(tok, (str, Path)):
        import transformers

        return transformers.AutoTokenizer.from_pretrained(str(tok))
    return tok


def tokenizer_drift(tokenizer_a, tokenizer_b, prompts: Sequence[str] = DEFAULT_PROMPTS, llm=None,
                    references: Sequence | None = None, max_tokens: int = 16, num_examples: int = 3) -> CheckResult:
    """Tokenize ``prompts`` (text) with two tokenizers (paths or loaded tokenizers): the fraction of
    prompts tokenized differently, up to ``num_examples`` examples side by side, and, with ``llm``
    (a pagedlab LLM whose vocabulary both tokenizers share), greedy outputs from each tokenization
    decoded by its own tokenizer: exact match between the two and BLEU (against ``references``
    when given, else B's outputs against A's)."""
    tok_a, tok_b = _load_tokenizer(tokenizer_a), _load_tokenizer(tokenizer_b)
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        raise ValueError("the tokenizer check needs text prompts")
    ids_a = [list(tok_a(t).input_ids) for t in texts]
    ids_b = [list(tok_b(t).input_ids) for t in texts]
    diff = [i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b]
    examples = [{"prompt": texts[i], "a_ids": ids_a[i], "b_ids": ids_b[i],
                 "a_tokens": tok_a.convert_ids_to_tokens(ids_a[i]),
                 "b_tokens": tok_b.convert_ids_to_tokens(ids_b[i]),
                 "first_divergence": first_divergence(ids_a[i], ids_b[i])} for i in diff[:num_examples]]
    metrics: dict = {"num_prompts": len(texts), "fraction_tokenized_differently": len(diff) / len(texts),
                     "mean_tokens_a": sum(map(len, ids_a)) / len(texts),
                     "mean_tokens_b": sum(map(len, ids_b)) / len(texts)}
    differs = bool(diff)
    if llm is not None:
        params = _greedy(max_tokens, None, ignore_eos=False)
        outs_a = llm.generate([{"prompt_token_ids": p} for p in ids_a], params, use_tqdm=False)
        outs_b = llm.generate([{"prompt_token_ids": p} for p in ids_b], params, use_tqdm=False)
        gen_a = [tok_a.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs_a]
        gen_b = [tok_b.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs_b]
        metrics["output_exact_match"] = sum(a == b for a, b in zip(gen_a, gen_b)) / len(texts)
        if references is not None:
            refs = [r if isinstance(r, str) else (r[0] if r else "") for r in references]
            ba, bb = _bleu(gen_a, refs), _bleu(gen_b, refs)
            if ba is not None:
                metrics.update({"bleu_a": ba, "bleu_b": bb, "bleu_delta": bb - ba})
            metrics["exact_match_a"] = sum(a.strip() == r.strip() for a, r in zip(gen_a, refs)) / len(refs)
            metrics["exact_match_b"] = sum(b.strip() == r.strip() for b, r in zip(gen_b, refs)) / len(refs)
        else:
            b = _bleu(gen_b, gen_a)
            if b is not None:
                metrics["bleu_b_vs_a"] = b
        for ex in examples:
            i = texts.index(ex["prompt"])
            ex["a_output"], ex["b_output"] = gen_a[i], gen_b[i]
        differs = differs or metrics["output_exact_match"] < 1.0
    if differs:
        summary = f"{len(diff)}/{len(texts)} prompts tokenized differently"
        if "output_exact_match" in metrics:
            summary += f"; outputs identical for {metrics['output_exact_match']:.0%}"
        for key in ("bleu_delta", "bleu_b_vs_a"):
            if key in metrics:
                summary += f"; {key} {metrics[key]:.3g}"
        if examples:
            ex = examples[0]
            summary += f"\n    e.g. {ex['prompt']!r}:\n      A {ex['a_tokens']}\n      B {ex['b_tokens']}"
    else:
        summary = f"both tokenizers give the same ids for all {len(texts)} prompts"
    return CheckResult("tokenizer", _verdict(differs), summary, metrics, {"examples": examples},
                       {"tokenizer_a": str(tokenizer_a) if isinstance(tokenizer_a, (str, Path)) else None,
                        "tokenizer_b": str(tokenizer_b) if isinstance(tokenizer_b, (str, Path)) else None,
                        "max_tokens": max_tokens})


# ---- HF helpers --------------------------------------------------------------------------------------
def _hf_model(model, dtype: str = "float32", device=None):
    """A loaded HF model as it is, or one loaded from a pagedlab model name/path (GGUF/embedded
    models through their converted directory)."""
    if not isinstance(model, (str, Path)):
        return model
    import torch
    import transformers

    from pagedlab.loader import resolve_model_source

    path = resolve_model_source(str(model)).path
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return hf.to(device)


def _hf_tokenize(model, prompts: Sequence) -> list[list[int]]:
    if all(not isinstance(p, str) for p in prompts):
        return [list(p) for p in prompts]
    import transformers

    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return [list(p) if not isinstance(p, str) else list(tok(p).input_ids) for p in prompts]


def _trim_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def _eos_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


# ---- 5. padding -------------------------------------------------------------------------------------
def padding_check(model, prompts: Sequence = DEFAULT_PROMPTS, max_tokens: int = 16, attention_mask: str = "correct",
                  logprob_tolerance: float = 1e-3, dtype: str = "float32", pad_token_id: int | None = None
                  ) -> CheckResult:
    """HF transformers ``generate`` on all prompts in one left-padded batch vs one prompt at a time.
    ``attention_mask``: "correct" (zeros on padding) or "ones" (the common mistake: padding
    attended to). Compares greedy tokens (up to EOS) and the log-softmax of each step's scores
    (``max |Δ logprob|`` of the chosen tokens while the outputs agree)."""
    import torch

    if attention_mask not in ("correct", "ones"):
        raise ValueError(f"attention_mask={attention_mask!r} is invalid: 'correct' or 'ones'")
    hf = _hf_model(model, dtype)
    dev = next(hf.parameters()).device
    ids = _hf_tokenize(hf, prompts)
    if pad_token_id is None:
        pad_token_id = hf.generation_config.pad_token_id
        if pad_token_id is None:
            pad_token_id = hf.config.pad_token_id
        if pad_token_id is None:
            pad_token_id = min(_eos_ids(hf) or {0})
    eos = _eos_ids(hf)
    gen = {"max_new_tokens": max_tokens, "do_sample": False, "output_scores": True,
           "return_dict_in_generate": True, "pad_token_id": pad_token_id}

    def chosen(scores, seqs, row):
        return [torch.log_softmax(s[row].float(), -1)[t].item() for s, t in zip(scores, seqs)]

    single_tokens, single_lps = [], []
    with torch.no_grad():
        for p in ids:
            out = hf.generate(torch.tensor([p], device=dev),
                              attention_mask=torch.ones(1, len(p), dtype=torch.long, device=dev), **gen)
            toks = out.sequences[0, len(p):].tolist()
            single_tokens.append(_trim_eos(toks, eos))
            single_lps.append(chosen(out.scores, toks, 0))
        width = max(len(p) for p in ids)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in ids], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=dev)
        if attention_mask == "ones":
            mask = torch.ones_like(mask)
        out = hf.generate(input_ids, attention_mask=mask, **gen)
    batch_tokens, batch_lps = [], []
    for row in range(len(ids)):
        toks = out.sequences[row, width:].tolist()
        batch_tokens.append(_trim_eos(toks, eos))
        batch_lps.append(chosen(out.scores, toks, row))
    cmp = _compare(single_tokens, single_lps, batch_tokens, batch_lps)
    padded = sum(len(p) < width for p in ids)
    differs = cmp["prompts_differing"] > 0 or cmp["max_logprob_diff"] > logprob_tolerance
    metrics = {"num_prompts": len(ids), "padded_prompts": padded, "prompts_differing": cmp["prompts_differing"],
               "greedy_match_rate": 1 - cmp["prompts_differing"] / len(ids),
               "first_divergence": cmp["first_divergence"], "max_logprob_diff": cmp["max_logprob_diff"]}
    if differs:
        summary = (f"left-padded batch differs from one-at-a-time: {cmp['prompts_differing']}/{len(ids)} prompts "
                   f"(first at token {cmp['first_divergence']}), max |Δ logprob| {cmp['max_logprob_diff']:.3g}"
                   f" (attention_mask={attention_mask})")
    else:
        summary = (f"left-padded batch ({padded} of {len(ids)} prompts padded) gives the one-at-a-time tokens; "
                   f"max |Δ logprob| {cmp['max_logprob_diff']:.3g} <= {logprob_tolerance:g}")
        if not padded:
            summary += " (no prompt needed padding, so nothing was tested: give prompts of different lengths)"
    return CheckResult("padding", _verdict(differs), summary, metrics,
                       {"single": single_tokens, "batched": batch_tokens},
                       {"attention_mask": attention_mask, "max_tokens": max_tokens, "dtype": dtype,
                        "pad_token_id": pad_token_id, "logprob_tolerance": logprob_tolerance})


# ---- 6. HF parity -----------------------------------------------------------------------------------
def hf_parity(llm, prompts: Sequence = DEFAULT_PROMPTS, hf_model=None, max_tokens: int = 16, k: int = 5,
              hf_dtype: str = "float32", logprob_tolerance: float = 1e-3) -> CheckResult:
    """pagedlab (``llm``) vs HF transformers on the same weights (``hf_model``: a loaded model, or
    None to load the llm's model in ``hf_dtype``). Greedy match rate: prompts whose greedy outputs
    (up to EOS) are identical. Teacher-forced on prompt + HF's greedy output: max |Δ logprob| over
    each position's actual next token and pagedlab's top-``k``, and top-1 agreement."""
    import torch

    hf = _hf_model(hf_model if hf_model is not None else llm.llm_engine.source.path, hf_dtype,
                   device=llm.llm_engine.device)
    dev = next(hf.parameters()).device
    ids = _encode_all(llm, prompts)
    eos = _eos_ids(hf)
    hf_tokens = []
    with torch.no_grad():
        for p in ids:
            out = hf.generate(torch.tensor([p], device=dev),
                              attention_mask=torch.ones(1, len(p), dtype=torch.long, device=dev),
                              max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=hf.generation_config.pad_token_id or min(eos or {0}))
            hf_tokens.append(_trim_eos(out[0, len(p):].tolist(), eos))
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], _greedy(max_tokens, None, ignore_eos=False),
                        use_tqdm=False)
    pl_tokens = [_trim_eos(o.outputs[0].token_ids, eos) for o in outs]
    firsts = [first_divergence(a, b) for a, b in zip(hf_tokens, pl_tokens)]
    seqs = [p + t for p, t in zip(ids, hf_tokens)]
    tf = teacher_forced(llm, seqs, k)
    max_d, agree, total = 0.0, 0, 0
    with torch.no_grad():
        for seq, positions in zip(seqs, tf):
            logits = hf(torch.tensor([seq], device=dev)).logits[0].float()
            lsm = torch.log_softmax(logits, -1)
            for i, d in enumerate(positions):  # position i predicts seq[i + 1]
                row = lsm[i]
                total += 1
                agree += int(row.argmax().item()) == _top1(d)
                for t, lp in d.items():
                    max_d = max(max_d, abs(row[t].item() - lp))
    n_same = sum(f is None for f in firsts)
    metrics = {"num_prompts": len(ids), "greedy_match_rate": n_same / len(ids),
               "first_divergence": min((f for f in firsts if f is not None), default=None),
               "top1_agreement": agree / total if total else 1.0, "max_abs_logprob_diff": max_d,
               "positions": total}
    differs = n_same < len(ids) or agree < total or max_d > logprob_tolerance
    summary = (f"greedy match {metrics['greedy_match_rate']:.0%} of {len(ids)} prompts, teacher-forced top-1 "
               f"agreement {metrics['top1_agreement']:.2%} over {total} positions, max |Δ logprob| {max_d:.3g} "
               f"({'>' if max_d > logprob_tolerance else '<='} {logprob_tolerance:g})")
    return CheckResult("hf", _verdict(differs), summary, metrics, {"hf": hf_tokens, "pagedlab": pl_tokens},
                       {"max_tokens": max_tokens, "k": k, "hf_dtype": hf_dtype,
                        "pagedlab_dtype": str(llm.llm_engine.dtype).removeprefix("torch."),
                        "logprob_tolerance": logprob_tolerance})


def _model_manifest(model: str) -> dict:
    """Model path, config hash and weight checksum without loading the model (for the checks that
    load it themselves: precision, padding)."""
    from pagedlab.lab.manifest import _WEIGHT_SUFFIXES, config_hash, files_checksum
    from pagedlab.loader import resolve_model_source

    try:
        source = resolve_model_source(str(model))
    except Exception as e:  # noqa: BLE001  (recorded, not raised)
        return {"name": str(model), "error": str(e)}
    path = Path(source.path)
    original = getattr(source, "original_file", None)
    weights = [Path(original)] if original else sorted(
        p for p in path.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES) if path.is_dir() else []
    return {"name": str(model), "path": str(path.resolve()), "config_hash": config_hash(path),
            "original_file": str(original) if original else None,
            "weight_checksum": files_checksum(weights) if weights else None}


# ---- storing ----------------------------------------------------------------------------------------
def store_result(result: CheckResult, url, llm=None, model: str | None = None, store=None,
                 experiment: str = "repro") -> int:
    """Store ``result`` in the results database at ``url`` (experiment "repro", one run per check,
    with the provenance manifest of ``llm`` when given); returns the run id. Metrics are the
    result's numbers plus ``differs`` (0/1); the verdict, summary and details go into
    ``params["repro.*"]`` and the manifest's ``repro`` section."""
    from pagedlab.lab.manifest import collect_manifest
    from pagedlab.lab.store import ResultStore, RunRecord

    manifest = collect_manifest(llm, seeds={"repro": result.params.get("seeds")} if "seeds" in result.params else None,
                                extra={"repro": {"check": result.check, "verdict": result.verdict,
                                                 "summary": result.summary, "details": result.details}},
                                hash_weights=True)
    if model is None and llm is not None:
        model = str(llm.llm_engine.config.model)
    if llm is None and model is not None:
        manifest["model"] = _model_manifest(model)
    params = {"repro.check": result.check, "repro.verdict": result.verdict}
    params.update({f"repro.{k}": v for k, v in result.params.items()})
    metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float)) or v is None}
    metrics["differs"] = int(not result.same)
    rec = RunRecord(experiment=experiment, run_key=f"{experiment}:{result.check}:{uuid.uuid4().hex}",
                    params=params, metrics=metrics, manifest=manifest, model=model)
    own = store is None
    store = store or ResultStore(url)
    try:
        return store.record_run(rec)
    finally:
        if own:
            store.close()
