"""Sampling parameters, with vLLM's field names and defaults."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pagedlab.sampling_types import (STRUCTURED_KINDS, GuidedDecodingParams, RepetitionDetectionParams,
                                     RequestOutputKind, StructuredOutputsParams, UnknownArgumentError,
                                     _check, _python_values, _reject_unknown_arguments,
                                     check_trace_decode_token_ids, quoted_ids)
from pagedlab.scalars import python_scalar

__all__ = ["STRUCTURED_KINDS", "BeamSearchParams", "GuidedDecodingParams", "RepetitionDetectionParams",
           "RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "UnknownArgumentError",
           "check_sampling_params", "generation_config_cap", "generation_config_defaults", "quoted_ids"]

logger = logging.getLogger(__name__)

_GREEDY_EPS = 1e-5
_FLOAT32_MAX = 3.4028234663852886e38  # a larger logit bias is inf in the float32 logits
_MIN_TEMPERATURE = 0.01  # vLLM's floor for a sampled temperature
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1  # a seed is a 64-bit integer (the noise's Philox key)


# ids checked against the vocabulary (stop ids beyond it are dropped, not refused: ``for_vocabulary``)
_TOKEN_ID_FIELDS = ("allowed_token_ids", "logit_bias", "logprob_token_ids", "prompt_logprob_token_ids",
                    "trace_decode_token_ids")
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                 "min_p")
_NUMBER_FIELDS = _FLOAT_FIELDS + ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs",
                                  "prompt_logprobs", "truncate_prompt_tokens", "prompt_logprob_start",
                                  "thinking_token_budget", "stream_interval", "routed_experts_prompt_start")


@_reject_unknown_arguments
@dataclass
class SamplingParams:
    """How to sample one request's completion(s).

    ``temperature=0`` means greedy; one in (0, 0.01) is raised to 0.01 with a warning, as vLLM
    raises it (below it, logits / temperature risk inf and NaN), so it samples.
    ``seed`` gives the request its own sampling noise (completion ``i`` of ``n`` seeded by
    ``seed + i``, its k-th token by that and k), so the same seed gives the same tokens whether the
    request runs alone or among others, on any engine; -1 (OpenAI's and vLLM's "random") is no
    seed, as None.
    ``logprobs=N`` returns the top-N log-probabilities (plus the sampled token's) for each
    generated token; ``prompt_logprobs=N`` does the same for every prompt token but the first;
    -1 (vLLM's) returns the whole vocabulary's.
    Log-probabilities are those of the raw model distribution, before penalties and temperature.
    ``flat_logprobs=True`` (vLLM's) returns both as a ``FlatLogprobs`` (``pagedlab.logprobs``): the
    same positions in a few flat lists instead of a list of dicts, for long scoring runs.

    vLLM's logits controls: ``logit_bias`` ({token id: bias}, added to the logits: any finite bias,
    as vLLM's, and -inf bans the token; the server keeps OpenAI's [-100, 100]) and
    ``allowed_token_ids`` (only these may be sampled). ``extra_args`` carries whatever a caller
    wants to keep with the request; the engine ignores it. A misspelt keyword raises
    ``UnknownArgumentError`` naming the closest field.

    ``bad_words``: strings never generated (vLLM's rule: each word is tokenized with and without a
    leading space; the last token of such a sequence is banned wherever the output so far ends
    with the tokens before it). ``logprob_token_ids``: at every generated position, the logprobs
    of these token ids (the labels of a classification or multiple-choice evaluation) are
    returned beside the sampled token's in ``CompletionOutput.logprobs``. ``prompt_logprob_token_ids``
    (vLLM's fixed-token prompt scoring, e.g. a distillation teacher's): the logprobs of these
    distinct ids at every prompt row from ``prompt_logprob_start`` (default 0; row ``i`` predicts
    prompt token ``i + 1``), in ``RequestOutput.prompt_token_id_logprobs``: a float32
    ``[max(len(prompt) - 1 - start, 0), len(ids)]`` tensor once the prompt is computed (the start
    without the ids does nothing, as in vLLM). ``output_kind``: see
    ``RequestOutputKind``. ``structured_outputs`` (or its older name ``guided_decoding``)
    constrains the completion to a grammar: see ``StructuredOutputsParams``; it needs xgrammar.
    ``repetition_detection`` (a ``RepetitionDetectionParams`` or a dict of its fields) ends looping output.
    ``thinking_token_budget`` (vLLM's): at most this many tokens inside each thinking section of a
    reasoning model, after which the engine forces its end marker (``engine/thinking_budget.py``;
    the engine needs ``reasoning_config``); None or -1 is unlimited.
    ``stream_interval`` (vLLM's): new tokens batched into each streamed output, at least the engine's
    ``stream_interval``; the first and the final output go out at once. ``skip_reading_prefix_cache``
    (vLLM's): True computes the whole prompt, reading no cached prefix (its blocks still fill the cache);
    None is True where the prompt is scored (``prompt_logprobs``, ``prompt_logprob_token_ids``), else
    False; False with those is an error (rows read from the cache have no logits: vLLM's are unset memory).
    ``trace_decode_token_ids`` (vLLM's trace replay, for RL and numerics checks): the completion is these
    tokens, forced one a step through the decode path, with the logprobs, ranks and top-``logprobs``
    alternatives of the raw distribution at each; see ``engine/trace_replay.py``.
    ``routed_experts_prompt_start`` (vLLM's, with the engine's ``enable_return_routed_experts``): the
    final output's ``CompletionOutput.routed_experts`` leaves out the prompt positions before it (a
    multi-turn rollout asks only for what earlier turns did not return); at most the prompt's length.

    ``logits_processors`` (vLLM V0's, for decoding research: watermarks, contrastive or
    constrained decoding): callables ``fn(output_token_ids, logits)`` or ``fn(prompt_token_ids,
    output_token_ids, logits)`` returning the row's logits (a float32 [vocab] tensor on the
    model's device), applied in order before the other controls at every generated token. A
    request with them reads its tokens on the host each step, as penalties do (the step loop
    waits for each step). They run where rank 0 samples (tensor-parallel workers never see
    them); the server's JSON cannot carry them.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict | None = None
    bad_words: list[str] | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: list[Callable] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    skip_reading_prefix_cache: bool | None = None
    trace_decode_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    routed_experts_prompt_start: int = 0

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            _check(self.structured_outputs is None or self.structured_outputs is self.guided_decoding,
                   "guided_decoding", self.guided_decoding, "None when structured_outputs is set")
            self.structured_outputs = self.guided_decoding
        _python_values(self, _NUMBER_FIELDS, ("stop_token_ids", "allowed_token_ids", "logprob_token_ids",
                                              "prompt_logprob_token_ids", "trace_decode_token_ids"))
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {python_scalar(t): python_scalar(b) for t, b in self.logit_bias.items()}
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.seed == -1 and isinstance(self.seed, int):  # vLLM's (and OpenAI's) spelling of "no seed"
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's __post_init__: True asks for one
            if getattr(self, name) is True:
                setattr(self, name, 1)
        if type(self.thinking_token_budget) is int and self.thinking_token_budget == -1:  # vLLM's "unlimited"
            self.thinking_token_budget = None
        self._validate()
        self._resolve_prefix_cache_read()
        # vLLM's __post_init__ drops repeats: [5, 5] and [5] are one request (and one lab run key)
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.bad_words is not None:
            self.bad_words = list(dict.fromkeys(self.bad_words))
        if 0.0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature=%r is below %r, which risks inf and NaN in logits / temperature: "
                           "sampling at %r instead (as vLLM; 0 is greedy)", self.temperature,
                           _MIN_TEMPERATURE, _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE

    def _validate(self) -> None:
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(isinstance(value, (int, float)), name, value, "a number")
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty,
               "in [-2, 2]")
        # finite, as vLLM requires: inf would turn a 0 or -inf logit into NaN
        _check(0.0 < self.repetition_penalty < math.inf, "repetition_penalty", self.repetition_penalty,
               "a finite number > 0")
        _check(0.0 <= self.temperature < math.inf, "temperature", self.temperature,
               "a finite number >= 0 (0 means greedy)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "an integer >= 0 (0 or -1 means all tokens)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(self.seed is None or (isinstance(self.seed, int) and _INT64_MIN <= self.seed <= _INT64_MAX),
               "seed", self.seed, f"None or an integer in [{_INT64_MIN}, {_INT64_MAX}]")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an integer >= 1 or None")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # True was made 1 above (vLLM's); False is an int to Python but no count to torch's topk, and
            # vLLM would read it as 0 (the sampled token's logprob), seldom what False meant
            _check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= -1),
                   name, value, "None, True (as 1), an integer >= 0 or -1 (the whole vocabulary)")
        if isinstance(self.logits_processors, tuple):
            self.logits_processors = list(self.logits_processors)
        _check(self.logits_processors is None or (isinstance(self.logits_processors, list)
                                                  and all(callable(f) for f in self.logits_processors)),
               "logits_processors", self.logits_processors,
               "a list of callables fn(output_token_ids, logits) or "
               "fn(prompt_token_ids, output_token_ids, logits)")
        _check(self.truncate_prompt_tokens is None or (isinstance(self.truncate_prompt_tokens, int)
                                                       and (self.truncate_prompt_tokens >= 1
                                                            or self.truncate_prompt_tokens == -1)),
               "truncate_prompt_tokens", self.truncate_prompt_tokens,
               "None, an integer >= 1 (keep the prompt's last k tokens) or -1 (as many as max_model_len "
               "allows)")
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
               self.stop, "a non-empty string or a list of non-empty strings")
        _check(isinstance(self.stop_token_ids, list) and all(isinstance(t, int) and t >= 0
                                                             for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        self._validate_logits_controls()

    def _validate_logits_controls(self) -> None:
        if self.logit_bias is not None:
            # any bias, as vLLM's offline SamplingParams (only its server clamps to OpenAI's [-100, 100]):
            # -1e9 or -inf bans a token; NaN and +inf (a float32 inf) would make the softmax NaN
            _check(isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and t >= 0 and isinstance(b, (int, float))
                and (b == -math.inf or abs(b) <= _FLOAT32_MAX) for t, b in self.logit_bias.items()),
                "logit_bias", self.logit_bias,
                "a dict of non-negative token ids to biases (finite float32 numbers, or -inf to ban a token)")
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, (list, tuple)) and len(self.allowed_token_ids) > 0
                   and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", self.allowed_token_ids, "a non-empty list of non-negative token ids")
            self.allowed_token_ids = list(self.allowed_token_ids)
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", self.extra_args,
               "None or a dict")
        self._validate_output_controls()

    def _validate_output_controls(self) -> None:
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, (list, tuple)) and all(
                isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words", self.bad_words,
                "a list of non-blank strings")
            self.bad_words = list(self.bad_words)
        if self.logprob_token_ids is not None:
            _check(isinstance(self.logprob_token_ids, (list, tuple)) and len(self.logprob_token_ids) > 0
                   and all(isinstance(t, int) and t >= 0 for t in self.logprob_token_ids),
                   "logprob_token_ids", self.logprob_token_ids, "a non-empty list of non-negative token ids")
            self.logprob_token_ids = list(dict.fromkeys(self.logprob_token_ids))
        ids = self.prompt_logprob_token_ids
        if ids is not None:  # repeats are an error, as in vLLM: each id is a column of the result
            _check(isinstance(ids, (list, tuple)) and len(ids) > 0 and all(isinstance(t, int) and t >= 0
                                                                           for t in ids)
                   and len(set(ids)) == len(ids), "prompt_logprob_token_ids", ids,
                   "a non-empty list of distinct non-negative token ids (one set for every row)")
            self.prompt_logprob_token_ids = list(ids)
        start = self.prompt_logprob_start
        _check(start is None or (isinstance(start, int) and not isinstance(start, bool) and start >= 0),
               "prompt_logprob_start", start, "None or an integer >= 0 (the first prompt row to score)")
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind", self.output_kind,
               "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        structured = self.structured_outputs
        _check(structured is None or isinstance(structured, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")
        repetition = self.repetition_detection
        if isinstance(repetition, dict):
            self.repetition_detection = repetition = RepetitionDetectionParams(**repetition)
        _check(repetition is None or isinstance(repetition, RepetitionDetectionParams),
               "repetition_detection", repetition, "None or a RepetitionDetectionParams")
        _check(self.detokenize or not self.stop, "stop", self.stop,
               "empty with detokenize=False (stop strings are found in the text; use stop_token_ids)")
        budget = self.thinking_token_budget
        _check(budget is None or (type(budget) is int and budget >= 0), "thinking_token_budget", budget,
               "None, -1 (unlimited) or an integer >= 0")
        _check(budget is None or structured is None, "thinking_token_budget", budget,
               "None with structured_outputs (its grammar covers the whole output, thinking included)")
        _check(type(self.flat_logprobs) is bool, "flat_logprobs", self.flat_logprobs, "True or False")
        interval = self.stream_interval
        _check(interval is None or (type(interval) is int and interval >= 1), "stream_interval", interval,
               "None or an integer >= 1 (new tokens batched into each streamed output)")
        check_trace_decode_token_ids(self)
        start = self.routed_experts_prompt_start
        _check(type(start) is int and start >= 0, "routed_experts_prompt_start", start,
               "an integer >= 0 (the first prompt position whose routed experts are returned)")

    def _resolve_prefix_cache_read(self) -> None:
        """vLLM's default: None skips reading the prefix cache exactly when the prompt is scored."""
        skip, first = self.skip_reading_prefix_cache, self.first_scored_prompt_row
        _check(skip is None or type(skip) is bool, "skip_reading_prefix_cache", skip, "None, True or False")
        if skip is None:
            self.skip_reading_prefix_cache = first is not None
        scorer = "prompt_logprobs" if self.prompt_logprobs is not None else "prompt_logprob_token_ids"
        _check(skip is not False or first is None, "skip_reading_prefix_cache", skip,
               f"True or None with {scorer}={getattr(self, scorer)!r}: rows read from the prefix cache "
               "have no logits to score")

    def verify_vocabulary(self, vocab_size: int, max_logprobs: int | None = None) -> None:
        """ValueError naming the field when a token id the parameters name is out of vocabulary, or
        when they ask for more logprobs a position than the vocabulary has or ``max_logprobs``
        allows (the engine's cap, as vLLM's; -1 or None: none; -1 logprobs count the vocabulary)."""
        for name in _TOKEN_ID_FIELDS:
            ids = getattr(self, name) or ()
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}={quoted_ids(ids)} is invalid: token id {bad} is out of vocabulary "
                                 f"(ids must be in [0, {vocab_size}))")
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            _check(count is None or count <= vocab_size, name, count,
                   f"at most the vocabulary size ({vocab_size})")
            if count is not None and max_logprobs not in (None, -1):
                _check((vocab_size if count == -1 else count) <= max_logprobs, name, count,
                       f"at most the engine's max_logprobs ({max_logprobs}; -1 is the whole vocabulary)")
        ids = self.prompt_logprob_token_ids or ()
        _check(max_logprobs in (None, -1) or len(ids) <= max_logprobs, "prompt_logprob_token_ids", ids,
               f"at most the engine's max_logprobs ({max_logprobs}) ids")

    def for_vocabulary(self, vocab_size: int) -> SamplingParams:
        """These parameters for a vocabulary of ``vocab_size``: a ``logprobs`` or ``prompt_logprobs``
        of -1 (vLLM's: the whole vocabulary) as ``vocab_size``, and without the stop ids beyond the
        vocabulary, which no step can sample (older vLLM accepted them, and its multi-LoRA example
        stopped on an adapter's added token; vLLM main refuses them in ``_validate_stop_token_ids``,
        pagedlab keeps them harmless); themselves when nothing changes."""
        changes = {name: vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(self, name) == -1}
        if any(t >= vocab_size for t in self.stop_token_ids):
            changes["stop_token_ids"] = [t for t in self.stop_token_ids if t < vocab_size]
        return self.clone(**changes) if changes else self

    @property
    def greedy(self) -> bool:
        """Whether sampling is the argmax (temperature 0)."""
        return self.temperature < _GREEDY_EPS

    @property
    def has_logits_controls(self) -> bool:
        """Whether ``logit_bias`` or ``allowed_token_ids`` changes the logits before sampling."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def wants_logprobs(self) -> bool:
        """Whether each generated position gets a logprobs record (top-N or label ids)."""
        return self.logprobs is not None or self.logprob_token_ids is not None

    @property
    def first_scored_prompt_row(self) -> int | None:
        """The first prompt row whose logits are asked: 0 with ``prompt_logprobs``, else the
        ``prompt_logprob_start`` of ``prompt_logprob_token_ids``; None without either. Such a request
        reads no prefix cache (``skip_reading_prefix_cache``), so each row is computed."""
        if self.prompt_logprobs is not None:
            return 0
        return None if self.prompt_logprob_token_ids is None else self.prompt_logprob_start or 0

    @property
    def has_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty changes the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def truncate_prompt(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (-1: the most that leave room for
        one token in ``max_model_len``), or the prompt as it is."""
        keep = max_model_len - 1 if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return list(prompt_token_ids[-keep:]) if keep is not None and len(prompt_token_ids) > keep \
            else prompt_token_ids

    def clone(self, **changes) -> SamplingParams:
        """A copy with ``changes`` applied (validated as the constructor validates). ``guided_decoding``
        and ``structured_outputs`` name one field: a change to either is a change to both. A
        ``skip_reading_prefix_cache`` equal to what None gives is derived anew for the copy (which may
        score its prompt where this one did not, or not where it did); one set against it is kept."""
        if self.skip_reading_prefix_cache == (self.first_scored_prompt_row is not None):
            changes = {"skip_reading_prefix_cache": None, **changes}
        named = [n for n in ("structured_outputs", "guided_decoding") if n in changes]
        if len(named) == 1:
            changes = {**changes, "structured_outputs": changes[named[0]], "guided_decoding": None}
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The parameters as a dict (``dataclasses.asdict``)."""
        return dataclasses.asdict(self)


# generation_config.json's keys that recommend a SamplingParams default (vLLM's set)
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def generation_config_defaults(setting: str, model_path, override: dict | None = None) -> dict:
    """The SamplingParams fields a generation_config.json recommends: the model's (``setting``
    "auto"; none when it has no file), none ("vllm"), or a directory's; then ``override``'s
    (generation_config.json names). Values SamplingParams refuses are a ValueError naming them."""
    folder = Path(model_path if setting == "auto" else setting)
    args = {} if setting == "vllm" else _read_generation_config(folder, setting)
    if override:
        unknown = sorted(set(override) - set(GENERATION_CONFIG_FIELDS))
        if unknown:
            raise ValueError(f"override_generation_config={override!r} is invalid: {unknown[0]!r} is none of "
                             f"{sorted(GENERATION_CONFIG_FIELDS)}")
        args.update({GENERATION_CONFIG_FIELDS[key]: value for key, value in override.items()})
        _check_recommended(args, "override_generation_config")
    return args


def generation_config_cap(setting: str, defaults: dict, override: dict | None = None) -> int | None:
    """The output-token limit over every server request, its own max_tokens included, or None (vLLM's
    ``override_max_tokens``). With ``setting`` a directory, the max_tokens of ``defaults`` (what
    ``generation_config_defaults`` gave: that directory's max_new_tokens, or ``override``'s); with
    "auto" or "vllm", ``override``'s max_new_tokens alone: the model's own file only recommends."""
    if setting in ("auto", "vllm"):
        return (override or {}).get("max_new_tokens")
    return defaults.get("max_tokens")


def _read_generation_config(folder: Path, setting: str) -> dict:
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting == "auto":
            return {}
        raise ValueError(f"generation_config={setting!r} is invalid: give auto, vllm or a directory "
                         "holding a generation_config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} could not be read: {e}") from None
    args = {name: data[key] for key, name in GENERATION_CONFIG_FIELDS.items()
            if isinstance(data, dict) and data.get(key) is not None}
    _check_recommended(args, str(path))
    return args


def _check_recommended(args: dict, source: str) -> None:
    try:
        SamplingParams(**args)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source} recommends sampling settings pagedlab refuses: {e}") from None


def check_sampling_params(value, name: str) -> None:
    """ValueError naming ``name`` unless ``value`` is a ``SamplingParams`` (a dict of its fields is
    the usual slip)."""
    if not isinstance(value, SamplingParams):
        raise ValueError(f"{name}={value!r:.200} is invalid: give a SamplingParams (fields in a dict: "
                         "SamplingParams(**fields))")


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM's names): the score of a finished beam is
    ``cumulative_logprob / num_generated_tokens ** length_penalty``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _python_values(self, ("beam_width", "max_tokens", "temperature", "length_penalty"),
                       ("stop_token_ids",))
        _check(isinstance(self.beam_width, int) and self.beam_width >= 1, "beam_width", self.beam_width,
               "an integer >= 1")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "an integer >= 1")
        _check(self.temperature == 0.0, "temperature", self.temperature, "0 (beam search is deterministic)")
