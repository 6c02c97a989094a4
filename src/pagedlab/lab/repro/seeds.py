"""Seed sensitivity: how much do a run's metrics move from one sampling seed to the next?"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from pagedlab.lab.repro.common import (DEFAULT_PROMPTS, CheckResult, NoProgress, encode_all,
                                       reference_scores, verdict)
from pagedlab.lab.repro.compare import check_limit
from pagedlab.sampling_params import SamplingParams

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
    """mean, std (sample), the 95% interval of the mean (Student's t), min and max. Equal values
    have that mean and std 0 exactly (sum / n rounds: three 0.1s gave a mean above their max and
    a std of 2e-17, which a threshold of 0 flagged)."""
    vals = [float(v) for v in values]
    n = len(vals)
    if all(v == vals[0] for v in vals):
        mean, std = vals[0], 0.0
    else:
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    half = _t975(n - 1) * std / math.sqrt(n) if n > 1 else 0.0
    return {"mean": mean, "std": std, "ci95_low": mean - half, "ci95_high": mean + half,
            "min": min(vals), "max": max(vals)}


def default_metrics(outputs, references: Sequence | None = None) -> dict[str, float]:
    """Metrics of one run: mean output length, mean per-token logprob, distinct-2 of the text,
    and (with references) exact match and BLEU over the prompts that have one."""
    comps = [o.outputs[0] for o in outputs]
    n_tok = [len(c.token_ids) for c in comps]
    m = {"mean_output_tokens": sum(n_tok) / len(n_tok)}
    lps = [c.cumulative_logprob / len(c.token_ids) for c in comps
           if c.cumulative_logprob is not None and c.token_ids]
    if lps:
        m["mean_token_logprob"] = sum(lps) / len(lps)
    grams = [tuple(c.token_ids[i:i + 2]) for c in comps for i in range(len(c.token_ids) - 1)]
    if grams:
        m["distinct_2"] = len(set(grams)) / len(grams)
    if references is not None:
        m.update(reference_scores([c.text for c in comps], references))
    return m


def seed_sensitivity(llm, prompts: Sequence = DEFAULT_PROMPTS, params=None, seeds: Sequence[int] = range(5),
                     metrics_fn: Callable | None = None, references: Sequence | None = None,
                     threshold: float | dict = 0.05, progress=None) -> CheckResult:
    """Run ``params`` (default: temperature 0.8, top_p 0.95, 32 tokens) once per seed and summarize
    each metric over seeds. ``metrics_fn(outputs, references) -> {name: value}`` (default
    ``default_metrics``). A metric is flagged when its relative spread std/|mean| (absolute std when
    the mean is 0) exceeds ``threshold`` (a number, or a dict metric -> threshold), or is NaN
    (the metric was NaN or infinite on some seed). ``seeds``: at least two, each once (a repeated
    seed reruns the same run, which would understate the spread). ``progress`` (see
    ``NoProgress``) counts the seeds."""
    if params is None:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, logprobs=0)
    for name, limit in (threshold.items() if isinstance(threshold, dict) else [("threshold", threshold)]):
        check_limit(name if name == "threshold" else f"threshold[{name!r}]", limit)
    seeds = list(seeds)
    if len(seeds) < 2:
        raise ValueError(f"seeds={seeds} is too few: give at least 2 seeds")
    if len(set(seeds)) < len(seeds):  # a repeated seed reruns a run: the spread would shrink
        raise ValueError(f"seeds={seeds} repeats a seed: give each seed once")
    fn = metrics_fn or default_metrics
    ids = encode_all(llm, prompts)
    per_seed: list[dict] = []
    progress = progress if progress is not None else NoProgress()
    progress.reset(total=len(seeds))
    for s in seeds:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], dataclasses.replace(params, seed=s),
                            use_tqdm=False)
        per_seed.append(fn(outs, references))
        progress.update()
    names = [k for k in per_seed[0] if all(k in d for d in per_seed)]
    if not names:
        raise ValueError(f"the metrics {[sorted(d) for d in per_seed[:2]]} share no metric over every seed, "
                         "so nothing can be compared: metrics_fn must return the same names each run")
    stats, flagged, metrics = {}, [], {"num_seeds": len(seeds), "num_prompts": len(ids)}
    for name in names:
        st = summarize([d[name] for d in per_seed])
        limit = threshold.get(name, 0.05) if isinstance(threshold, dict) else threshold
        spread = st["std"] / abs(st["mean"]) if st["mean"] != 0 else st["std"]
        st["relative_spread"] = spread
        st["flagged"] = not spread <= limit  # a NaN spread (a NaN or inf metric) is flagged
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
    return CheckResult("seeds", verdict(bool(flagged)), summary, metrics,
                       {"stats": stats, "per_seed": per_seed, "flagged": flagged},
                       {"seeds": seeds, "threshold": threshold, "sampling": dataclasses.asdict(params)})


