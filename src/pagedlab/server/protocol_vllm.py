"""vLLM's request fields for structured outputs and output controls, shared by completions and chat
(``repetition_detection``'s object is read by ``repetition_detection_params``).

Structured outputs come in the three spellings vLLM's clients use: OpenAI's ``response_format``
(``json_object``, ``json_schema``), vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, and its newer ``structured_outputs`` object (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``). One request uses at most one of them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from pagedlab.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def expecting(what: str) -> WrapValidator:
    """One error saying what the field takes, instead of one per member of its union type (whose
    location would name the member: ``guided_json.str``)."""
    def validate(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", "expected {what}", {"what": what}) from None

    return WrapValidator(validate)


def refused(message: str) -> AfterValidator:
    """A field this server does not support: any value a request sets (other than null, false or
    empty) is an error saying ``message``, where silently dropping it would change the request."""
    def check(value: Any) -> Any:
        if value:
            raise ValueError(message)
        return value

    return AfterValidator(check)


class VLLMOutputFields(BaseModel):
    """``response_format``, ``guided_*``, ``structured_outputs``, ``bad_words``,
    ``logprob_token_ids`` (the logprobs of these label ids at every generated position, returned
    with the response's logprobs) and ``routed_experts_prompt_start`` (the first prompt position
    whose routed experts a choice returns, with ``--enable-return-routed-experts``)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    response_format: dict | None = None
    guided_json: Annotated[str | dict, expecting("a JSON schema (an object or a string)")] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    bad_words: list[str] | None = None
    logprob_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    routed_experts_prompt_start: Annotated[int, Field(ge=0)] = 0

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The grammar this request asks for, or None; a ValueError naming the field when it is
        malformed or several fields ask for one."""
        asked = [name for name in ("structured_outputs", *_GUIDED_FIELDS) if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            asked.append("response_format")
        if len(asked) > 1:
            raise ValueError(f"{asked[0]}=... is invalid: only one kind of structured output may be asked "
                             f"for, and this request sets {', '.join(asked)}")
        if not asked:
            self._response_format_kind()  # a bad type is an error even without a grammar
            return None
        name = asked[0]
        if name == "response_format":
            return self._from_response_format()
        if name == "structured_outputs":
            unknown = [k for k in self.structured_outputs if k not in _STRUCTURED_KEYS]
            if unknown:
                raise ValueError(f"structured_outputs={_short(self.structured_outputs)} is invalid: unknown "
                                 f"key {unknown[0]!r} (allowed: {', '.join(_STRUCTURED_KEYS)})")
            return _params(StructuredOutputsParams, name,
                           **{k: v for k, v in self.structured_outputs.items() if v is not None})
        return _params(StructuredOutputsParams, name, **{_GUIDED_FIELDS[name]: getattr(self, name)})

    def _response_format_kind(self) -> str:
        kind = (self.response_format or {}).get("type", "text")
        if kind not in _RESPONSE_FORMATS:
            raise ValueError(f"response_format={_short(self.response_format)} is invalid: type must be "
                             f"one of {', '.join(repr(k) for k in _RESPONSE_FORMATS)}")
        return kind

    def _from_response_format(self) -> StructuredOutputsParams:
        if self._response_format_kind() == "json_object":
            return _params(StructuredOutputsParams, "response_format", json_object=True)
        spec = self.response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError(f"response_format={_short(self.response_format)} is invalid: a 'json_schema' "
                             "response format needs json_schema.schema, a JSON schema object")
        return _params(StructuredOutputsParams, "response_format", json=schema)


def repetition_detection_params(fields: dict | None) -> RepetitionDetectionParams | None:
    """A request's ``repetition_detection`` object (vLLM's: ``max_pattern_size``,
    ``min_pattern_size``, ``min_count``) as ``RepetitionDetectionParams``, None when absent; an
    unknown key or a value vLLM refuses is a ValueError naming the field."""
    return None if fields is None else _params(RepetitionDetectionParams, "repetition_detection", **fields)


def _params(params_type: type, field: str, **kwargs: Any):
    """``params_type(**kwargs)``, its error a ValueError naming the request's ``field``."""
    try:
        return params_type(**kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{field}={_short(kwargs)} is invalid: {e}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."
