"""The helpers and helper records of ``SamplingParams`` (its checks, ``RequestOutputKind``,
``StructuredOutputsParams``, ``RepetitionDetectionParams``); ``pagedlab.sampling_params``
re-exports them."""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass

from pagedlab.names import did_you_mean
from pagedlab.scalars import is_value_list, python_numbers, python_scalar


def _check(cond: bool, name: str, value, allowed: str) -> None:
    if not cond:
        raise ValueError(f"{name}={value!r} is invalid: {name} must be {allowed}")


def _python_values(params, numbers: tuple[str, ...], id_lists: tuple[str, ...]) -> None:
    """numpy numbers among ``params``' fields (a sweep's table) as Python ones
    (``pagedlab.scalars``), so the checks and the JSON manifests see what Python values give."""
    for name in numbers:
        setattr(params, name, python_scalar(getattr(params, name)))
    for name in id_lists:
        ids = getattr(params, name)
        if is_value_list(ids):
            setattr(params, name, python_numbers(ids))


class RequestOutputKind(enum.IntEnum):
    """What each output of a running request holds (vLLM's names): everything so far
    (``CUMULATIVE``), only what is new since the last output (``DELTA``), or nothing until the
    request finishes (``FINAL_ONLY``). The offline ``LLM`` returns final outputs whatever it says.
    An int enum, so a manifest of the parameters stays plain JSON."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class UnknownArgumentError(TypeError, ValueError):
    """A keyword argument the parameters do not have (a TypeError as Python's own, and a ValueError
    like every other bad parameter)."""


def _reject_unknown_arguments(cls):
    """Wrap the dataclass ``__init__`` so a misspelt keyword names its closest field."""
    init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        for key in kwargs:
            if key not in names:
                suggestion = did_you_mean(key, names)
                raise UnknownArgumentError(f"{cls.__name__}: unknown argument {key!r}{suggestion}")
        init(self, *args, **kwargs)

    cls.__init__ = checked_init
    return cls


def quoted_ids(ids) -> str:
    """A list of ids for an error message, cut short."""
    ids = list(ids)
    return repr(ids) if len(ids) <= 8 else repr(ids[:8])[:-1] + ", ...]"


@_reject_unknown_arguments
@dataclass
class StructuredOutputsParams:
    """Constrain a completion to a grammar (vLLM's ``StructuredOutputsParams``; the older name
    ``GuidedDecodingParams`` is the same class). Exactly one of: ``json`` (a JSON schema, as a dict
    or a string), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings)
    or ``grammar`` (EBNF/GBNF, or Lark when no rule uses ``::=``, as in vLLM). ``disable_any_whitespace``
    makes JSON compact."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        _check(len(given) == 1, "structured_outputs", given or None,
               f"exactly one of {', '.join(STRUCTURED_KINDS)}")
        _check(self.json is None or isinstance(self.json, (str, dict)), "json", self.json,
               "a JSON schema (a dict or a JSON string)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value), name, value, "a non-empty string")
        _check(self.choice is None or (isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                                       and all(isinstance(c, str) and c for c in self.choice)),
               "choice", self.choice, "a non-empty list of non-empty strings")
        _check(self.json_object in (None, True, False), "json_object", self.json_object, "a boolean")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``STRUCTURED_KINDS``."""
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
GuidedDecodingParams = StructuredOutputsParams


@_reject_unknown_arguments
@dataclass
class RepetitionDetectionParams:
    """End a completion once its output tokens end in an n-gram of ``min_pattern_size`` (0 means 1) to
    ``max_pattern_size`` tokens (0: no detection) repeated ``min_count`` times in a row (vLLM's; the
    check: ``pagedlab.engine.repetition``); finish_reason "repetition", stop_reason "repetition_detected"."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        _python_values(self, ("max_pattern_size", "min_pattern_size", "min_count"), ())
        for name, value in dataclasses.asdict(self).items():
            _check(type(value) is int, name, value, "an integer")
        big = self.max_pattern_size
        _check(big >= 0, "max_pattern_size", big, ">= 0 (0 disables detection)")
        _check(0 <= self.min_pattern_size <= big, "min_pattern_size", self.min_pattern_size,
               f"in [0, max_pattern_size] = [0, {big}] (0 means 1)")
        _check(big == 0 or self.min_count >= 2, "min_count", self.min_count,
               ">= 2 when max_pattern_size > 0 (max_pattern_size=0 disables detection)")


# the fields a trace replay refuses (vLLM's ``_validate_trace_replay``): what each would do to a forced trace
_TRACE_CONFLICTS = (
    ("prompt_logprobs", "the replay scores the trace's decode steps, not the prompt"),
    ("structured_outputs", "a grammar would mask the tokens the trace forces"),
    ("repetition_detection", "it could end the replay before the trace does"),
    ("thinking_token_budget", "its end marker would compete with the trace for the same rows"),
    ("bad_words", "it would ban tokens the trace forces"),
)


def check_trace_decode_token_ids(params) -> None:
    """``SamplingParams.trace_decode_token_ids``: None, or a non-empty list of token ids (ints >= 0;
    ``verify_vocabulary`` bounds them) replayed by one completion (n=1), without the fields it
    conflicts with; normalized to a list."""
    ids = params.trace_decode_token_ids
    if ids is None:
        return
    _check(isinstance(ids, (list, tuple)) and len(ids) > 0
           and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids),
           "trace_decode_token_ids", quoted_ids(ids) if isinstance(ids, (list, tuple)) else ids,
           "None or a non-empty list of non-negative token ids (the decode tokens to replay)")
    params.trace_decode_token_ids = list(ids)
    _check(params.n == 1, "trace_decode_token_ids", quoted_ids(ids),
           f"None with n={params.n!r}: a trace replays one completion (n=1)")
    for name, why in _TRACE_CONFLICTS:
        value = getattr(params, name)
        _check(value is None or value == [], "trace_decode_token_ids", quoted_ids(ids),
               f"None with {name}={value!r}: {why}")
