"""Speculative decoding's settings: ``SpeculativeConfig`` and ``resolve_speculative_config``, which
reads the engine's ``speculative_config`` dict (vLLM's keys) into it with an error naming any bad key."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's proposer. ``method="ngram"`` (vLLM's prompt lookup): before a decode
    step, the longest run of ``prompt_lookup_min``..``prompt_lookup_max`` tokens that ends the
    sequence and occurred earlier in it (prompt or output) proposes the (at most
    ``num_speculative_tokens``) tokens that followed it there. ``method="draft_model"``: the
    smaller model at ``model`` (same vocabulary) proposes that many tokens greedily
    (``engine/draft_model.py``). ``num_speculative_tokens_per_batch_size`` (either method; vLLM's
    dynamic speculative decoding) lowers that bound by the step's number of requests
    (``tokens_for_batch``), to none where verifying proposals costs more than it saves."""

    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    method: str = "ngram"
    model: str | None = None
    # vLLM's dynamic speculative decoding: (first, last, K) batch-size ranges, sorted, from 1
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def tokens_for_batch(self, batch_size: int) -> int:
        """The most tokens proposed per request in a step of ``batch_size`` requests (all the step
        schedules, prompt chunks included): the K of the range holding it, of the range before it
        where it falls in a gap or past the last, at most ``num_speculative_tokens`` (vLLM's lookup;
        vLLM reads it for the step that drafts, a step before the one that verifies, pagedlab for
        the step that verifies, where both happen); that everywhere without a schedule."""
        k = self.num_speculative_tokens
        for first, _, range_k in self.num_speculative_tokens_per_batch_size or ():
            if first > batch_size:
                break
            k = min(range_k, self.num_speculative_tokens)
        return k

    @property
    def has_steps_without_proposals(self) -> bool:
        """A batch-size schedule caps some batch sizes at K=0 (only those steps can run ahead of
        the one before: ``Scheduler.must_read_back``)."""
        return any(k == 0 for _, _, k in self.num_speculative_tokens_per_batch_size or ())


_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                     "draft_tensor_parallel_size", "num_speculative_tokens_per_batch_size")
SPECULATIVE_METHODS = ("ngram", "draft_model")


def resolve_speculative_config(value: dict | None) -> SpeculativeConfig | None:
    """``EngineConfig.speculative_config`` checked, with vLLM's defaults: the method is
    "draft_model" where a ``model`` is given, else "ngram", whose lookup bounds are both 5 when
    neither is given, else the missing one equal to the other; None where it is None."""
    if value is None:
        return None

    def bad(key, allowed):
        raise ValueError(f"speculative_config[{key!r}]={value.get(key)!r} is invalid: {key} must be "
                         f"{allowed}")

    unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown key {unknown[0]!r}: pagedlab takes "
                         f"{list(_SPECULATIVE_KEYS)} (EAGLE and MTP are not supported)")
    method = value.get("method", "draft_model" if value.get("model") is not None else "ngram")
    method = "ngram" if method == "[ngram]" else method
    if method not in SPECULATIVE_METHODS:
        bad("method", f"one of {list(SPECULATIVE_METHODS)} (EAGLE and MTP are not supported)")
    k = value.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        bad("num_speculative_tokens", "an integer >= 1 (the most tokens proposed a step)")
    schedule = _batch_size_schedule(value.get("num_speculative_tokens_per_batch_size"), bad)
    if method == "draft_model":
        return _draft_model_config(value, k, schedule, bad)
    if value.get("model") is not None:
        bad("model", "None with method 'ngram' (a draft model's path goes with method 'draft_model')")
    low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = 5
    low, high = (high if low is None else low), (low if high is None else high)
    for key, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            bad(key, "an integer >= 1")
    if low > high:
        bad("prompt_lookup_min", f"<= prompt_lookup_max ({high})")
    return SpeculativeConfig(k, prompt_lookup_max=high, prompt_lookup_min=low,
                             num_speculative_tokens_per_batch_size=schedule)


def _batch_size_schedule(value, bad) -> tuple[tuple[int, int, int], ...] | None:
    """``num_speculative_tokens_per_batch_size`` checked as vLLM checks it: [first, last, K]
    batch-size ranges that do not overlap, the first from 1, K >= 0; sorted by range."""
    if value is None:
        return None
    key = "num_speculative_tokens_per_batch_size"
    shape = ("a non-empty list of [first, last, K] entries, three integers each: a step of first..last "
             "requests proposes at most K tokens per request")
    if not isinstance(value, (list, tuple)) or not value:
        bad(key, shape)
    entries = []
    for entry in value:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            bad(key, f"{shape} (got {entry!r}; vLLM's 5-item entries with context ranges are not supported)")
        if any(isinstance(n, bool) or not isinstance(n, int) for n in entry):
            bad(key, f"{shape} (got {list(entry)})")
        first, last, k = entry
        if first < 1 or last < first or k < 0:
            bad(key, f"{shape}, with 1 <= first <= last and K >= 0 (got {list(entry)})")
        entries.append((first, last, k))
    entries.sort()
    if entries[0][0] != 1:
        bad(key, f"{shape}, the first range starting at 1 (so every batch size has a K)")
    for (_, last, _), (first, _, _) in itertools.pairwise(entries):
        if first <= last:
            bad(key, f"{shape}, the ranges not overlapping ({first} falls in a range ending at {last})")
    return tuple(entries)


def _draft_model_config(value: dict, k: int, schedule, bad) -> SpeculativeConfig:
    model = value.get("model")
    if not isinstance(model, (str, Path)) or not str(model):
        bad("model", "the draft model's path or name (method 'draft_model')")
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if value.get(key) is not None:
            bad(key, "None with method 'draft_model' (it belongs to method 'ngram')")
    if value.get("draft_tensor_parallel_size") not in (None, 1):
        bad("draft_tensor_parallel_size", "1 (the draft model runs unsharded on rank 0's GPU)")
    return SpeculativeConfig(k, method="draft_model", model=str(model),
                             num_speculative_tokens_per_batch_size=schedule)
