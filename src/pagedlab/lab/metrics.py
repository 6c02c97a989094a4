"""The metric registry: what an experiment's ``metrics:`` list may name.

A metric is a function of a dataset run's ``RunResult`` returning flat ``{name: number}``
figures, registered under the name the YAML uses::

    @register_metric("mean_words", doc="mean words per output")
    def mean_words(result: RunResult) -> dict:
        return {"mean_words": sum(len(t.split()) for t in result.texts) / len(result.texts)}

The spec rejects a name that is not registered (listing those that are); a registered metric
is computed for every run and its figures are stored with the run's other metrics. The built-in
ones: exact_match, bleu, chrf, output_length, throughput, latency, memory. Benchmark workloads
measure throughput, latency and memory themselves (``pagedlab.lab.bench``).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedlab.lab.datasets import DatasetItem
from pagedlab.stats import latency_stats

DEFAULT_METRICS = {"dataset": ["output_length", "throughput", "latency", "memory"],
                   "benchmark": ["throughput", "latency", "memory"]}


@dataclass
class RunResult:
    """What a dataset run produced, for the metric functions."""

    outputs: list  # RequestOutput, in dataset order
    items: list[DatasetItem]
    elapsed_s: float
    stats: Any  # EngineStats
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None  # torch's allocator on a GPU; None on the CPU
    num_gpus: int = 1  # the tensor-parallel size

    @property
    def texts(self) -> list[str]:
        return [o.outputs[0].text for o in self.outputs]


MetricFn = Callable[[RunResult], dict]


@dataclass
class Metric:
    """A registered metric: its function, the workloads it applies to, whether it needs references."""

    fn: MetricFn
    workloads: tuple[str, ...] = ("dataset",)
    needs_references: bool = False
    doc: str = ""


METRICS: dict[str, Metric] = {}


def register_metric(name: str, *, workloads: tuple[str, ...] = ("dataset",), needs_references: bool = False,
                    doc: str = "") -> Callable[[MetricFn], MetricFn]:
    """Register the decorated function as metric ``name`` (a name registered twice is a ValueError).
    ``workloads``: where it may be asked for ("dataset", "benchmark"); ``needs_references``: the
    dataset must give references; ``doc``: one line for the docs (default: the function's)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"metric name {name!r} is invalid: give a non-empty string")

    def register(fn: MetricFn) -> MetricFn:
        if name in METRICS:
            raise ValueError(f"metric {name!r} is already registered ({METRICS[name].fn.__qualname__})")
        doc_lines = (fn.__doc__ or "").strip().splitlines()
        METRICS[name] = Metric(fn, tuple(workloads), needs_references,
                               doc or (doc_lines[0] if doc_lines else ""))
        return fn

    return register


def unregister_metric(name: str) -> None:
    """Remove metric ``name`` from the registry (a test's or a plug-in's own metric)."""
    METRICS.pop(name, None)


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalization, step by step as its official evaluation script: lower case,
    ASCII punctuation removed, then articles between word boundaries ("the" of "the—end", whose
    dash is not ASCII punctuation, too), then whitespace collapsed to single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _references(res: RunResult) -> tuple[list[str], list[list[str | None]]]:
    """The outputs that have references, and the references as sacrebleu's reference streams."""
    pairs = [(h, it.reference) for h, it in zip(res.texts, res.items) if it.reference]
    hyps = [h for h, _ in pairs]
    width = max(len(r) for _, r in pairs) if pairs else 0
    streams = [[r[k] if k < len(r) else None for _, r in pairs] for k in range(width)]
    return hyps, streams


def _squad_golds(references: list[str]) -> list[str]:
    """The normalized references an output is scored against, as SQuAD v2's official evaluation
    takes its gold answers: those that normalize to nothing ("the", ".") are left out, and if
    none is left the one gold is "" (SQuAD's unanswerable question), which only an output that
    normalizes to nothing matches. A list such as ``["the", "Paris"]`` is thus ``["paris"]``: an
    empty output does not match it."""
    return [n for n in map(normalize_answer, references) if n] or [""]


@register_metric("exact_match", needs_references=True,
                 doc="share of outputs equal to a reference after SQuAD normalization")
def exact_match(res: RunResult) -> dict:
    scored = [normalize_answer(h) in _squad_golds(it.reference)
              for h, it in zip(res.texts, res.items) if it.reference]
    return {"exact_match": sum(scored) / len(scored) if scored else None}


@register_metric("contains_answer", needs_references=True,
                 doc="share of outputs that contain a reference, both after SQuAD normalization")
def contains_answer(res: RunResult) -> dict:
    """Answer accuracy for a model that answers in sentences ("The capital of France is Paris.")
    where exact match scores 0: a reference's normalized words appear, whole, in the output's."""
    scored = [any(f" {gold} " in f" {normalize_answer(h)} " for gold in _squad_golds(it.reference))
              for h, it in zip(res.texts, res.items) if it.reference]
    return {"contains_answer": sum(scored) / len(scored) if scored else None}


@register_metric("bleu", needs_references=True, doc="corpus BLEU (sacrebleu)")
def bleu(res: RunResult) -> dict:
    import sacrebleu

    hyps, refs = _references(res)
    return {"bleu": sacrebleu.corpus_bleu(hyps, refs).score if hyps else None}


@register_metric("chrf", needs_references=True, doc="corpus chrF (sacrebleu)")
def chrf(res: RunResult) -> dict:
    import sacrebleu

    hyps, refs = _references(res)
    return {"chrf": sacrebleu.corpus_chrf(hyps, refs).score if hyps else None}


@register_metric("output_length", doc="output tokens: total, mean, min, max; share cut by max_tokens")
def output_length(res: RunResult) -> dict:
    lengths = [len(c.token_ids) for o in res.outputs for c in o.outputs]
    reasons = [c.finish_reason for o in res.outputs for c in o.outputs]
    return {"output_tokens": sum(lengths), "mean_output_tokens": sum(lengths) / len(lengths),
            "min_output_tokens": min(lengths), "max_output_tokens": max(lengths),
            "mean_output_chars": sum(len(c.text) for o in res.outputs for c in o.outputs) / len(lengths),
            "finished_by_length": reasons.count("length") / len(reasons)}


@register_metric("throughput", workloads=("dataset", "benchmark"), doc="output and total tokens/s, "
                                                                       "output tokens/s per GPU, requests/s")
def throughput(res: RunResult) -> dict:
    out_tokens = sum(len(c.token_ids) for o in res.outputs for c in o.outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in res.outputs)
    elapsed = max(res.elapsed_s, 1e-9)
    return {"elapsed_s": res.elapsed_s, "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
            "output_throughput": out_tokens / elapsed,
            "output_throughput_per_gpu": out_tokens / elapsed / max(1, res.num_gpus),
            "total_throughput": (prompt_tokens + out_tokens) / elapsed,
            "requests_per_s": len(res.outputs) / elapsed}


@register_metric("latency", workloads=("dataset", "benchmark"), doc="TTFT, TPOT, end-to-end P50/P90/P99 (ms)")
def latency(res: RunResult) -> dict:
    ttft, tpot, e2e = [], [], []
    for o in res.outputs:
        m = o.metrics
        if m is None:
            continue
        if m.first_token_time is not None:
            ttft.append(m.first_token_time - m.arrival_time)
        n = len(o.outputs[0].token_ids)
        if n > 1 and m.first_token_time is not None and m.last_token_time is not None:
            tpot.append((m.last_token_time - m.first_token_time) / (n - 1))
        if m.finished_time is not None:
            e2e.append(m.finished_time - m.arrival_time)
    return {**latency_stats(ttft, "ttft"), **latency_stats(tpot, "tpot"), **latency_stats(e2e, "e2e")}


def memory_efficiency(weight_bytes: int, kv_cache_bytes: int, kv_peak_used_bytes: int,
                      peak_reserved_bytes: int | None) -> dict:
    """The seed's memory efficiency: the bytes holding weights and live KV at the peak over the bytes
    reserved — torch's allocator at its peak on a GPU (weights, KV pool, activations, graphs), the
    weights and the KV pool on the CPU. ``memory_reserved_bytes`` and ``memory_efficiency``."""
    reserved = peak_reserved_bytes if peak_reserved_bytes else weight_bytes + kv_cache_bytes
    return {"memory_reserved_bytes": reserved,
            "memory_efficiency": (weight_bytes + kv_peak_used_bytes) / reserved if reserved else None}


@register_metric("memory", workloads=("dataset", "benchmark"),
                 doc="weights, KV cache allocated and used at peak, fragmentation, preemptions (and "
                     "LongRoPE's recomputes apart), memory efficiency")
def memory(res: RunResult) -> dict:
    s = res.stats
    per_block = s.kv_cache_bytes // s.num_kv_blocks if s.num_kv_blocks else 0
    return {**memory_efficiency(s.weight_bytes, s.kv_cache_bytes, s.peak_kv_blocks_used * per_block,
                                res.peak_reserved_bytes),
            "weight_bytes": s.weight_bytes, "kv_cache_bytes": s.kv_cache_bytes,
            "num_kv_blocks": s.num_kv_blocks,
            "kv_peak_blocks": s.peak_kv_blocks_used, "kv_peak_used_bytes": s.peak_kv_blocks_used * per_block,
            "kv_tokens_at_peak": s.kv_tokens_at_peak, "fragmentation_at_peak": s.fragmentation_at_peak,
            "num_preemptions": s.num_preemptions, "num_long_rope_recomputes": s.num_long_rope_recomputes,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "peak_allocated_bytes": res.peak_allocated_bytes}


@register_metric("speculation", workloads=("dataset", "benchmark"),
                 doc="speculative decoding: proposals verified, tokens proposed and accepted, the acceptance "
                     "rate and mean acceptance length (zeros without speculative_config)")
def speculation(res: RunResult) -> dict:
    s = res.stats
    return {"spec_num_drafts": s.spec_decode_num_drafts,
            "spec_num_draft_tokens": s.spec_decode_num_draft_tokens,
            "spec_num_accepted_tokens": s.spec_decode_num_accepted_tokens,
            "spec_acceptance_rate": s.spec_decode_acceptance_rate,
            "spec_mean_acceptance_length": s.spec_decode_mean_acceptance_length}


def compute_metrics(names: list[str], result: RunResult) -> dict:
    """The figures of every metric in ``names`` (registered names) on ``result``, merged."""
    figures: dict = {}
    for name in names:
        figures.update(METRICS[name].fn(result))
    return figures
