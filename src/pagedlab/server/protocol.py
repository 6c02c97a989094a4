"""The OpenAI API's bodies as pydantic models: requests, responses, stream chunks and errors.

Requests validate strictly, as the API is typed: ``"yes"`` is no boolean and ``"10"`` no integer,
but an integral float is an integer (``"n": 2.0``) and ``null`` means the field's default (a
completion's ``"max_tokens": null`` is 16, as vLLM's ``normalize_null_max_tokens`` makes it).
Unknown fields are ignored, as OpenAI's and vLLM's servers do. ``parse_request`` turns a
validation error into a 400 ``APIError`` whose ``param`` names the field and whose message says
what the field takes. Ranges that ``SamplingParams`` checks (temperature, top_p, penalties, ...)
are checked there once, by ``to_sampling_params``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      ValidationInfo, field_validator, model_serializer, model_validator)

from pagedlab import SamplingParams
from pagedlab.inputs import as_prompt_list
from pagedlab.server.errors import bad_request, param_of
from pagedlab.server.protocol_tools import DeltaToolCall, ToolCall, ToolFields
from pagedlab.server.protocol_vllm import VLLMOutputFields, expecting, refused, repetition_detection_params

MAX_LOGPROBS = 20  # logprobs / top_logprobs a request may ask for without --max-logprobs (OpenAI's, vLLM's)
MAX_N = 128  # OpenAI's limit for n (and best_of)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # what the engine's int64 tensors and seeds take
_MAX_QUOTED_VALUE = 80  # an error message quotes at most this much of the bad value (prompts can be long)


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(request_type: type[RequestT], body: dict, context: dict | None = None) -> RequestT:
    """``body`` validated as ``request_type`` (``context``: server settings, ``max_logprobs``); the
    first error is raised as a 400 naming its field."""
    try:
        return request_type.model_validate(body, context=context)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        param = _param(error["loc"]) or None
        raise bad_request(_error_message(error, param), param=param) from None


def _param(loc: tuple) -> str:
    """A validation error's location as OpenAI names params: ``messages[0].content``."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else part
    return name


def _error_message(error: dict, param: str | None) -> str:
    if error["type"] == "missing":
        return f"'{param}' is required"
    if error["type"] == "value_error":  # our own validators: their message is whole
        return str(error["ctx"]["error"])
    message = error["msg"]
    return f"{quoted(error['input'])} is not valid for '{param}': {message[0].lower()}{message[1:]}"


def quoted(value: Any) -> str:
    """``repr(value)``, cut short: an error message quotes prompts and huge numbers briefly."""
    text = repr(value)
    return text[:_MAX_QUOTED_VALUE] + "..." if len(text) > _MAX_QUOTED_VALUE else text


# ---- request field types ------------------------------------------------------------------------
def _integral_float(value: Any) -> Any:
    """JSON has one number type: 2.0 is the integer 2; 2.5 stays an error."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _int64(value: int, info: ValidationInfo) -> int:
    """Every integer field fits the engine's int64 tensors and seeds."""
    if not INT64_MIN <= value <= INT64_MAX:
        name = info.field_name
        raise ValueError(f"{name}={quoted(value)} is invalid: {name} must be an integer in "
                         f"[{INT64_MIN}, {INT64_MAX}]")
    return value


Integer = Annotated[int, BeforeValidator(_integral_float), AfterValidator(_int64)]
TokenId = Annotated[Integer, Field(ge=0)]


def _within_max_logprobs(value: int, info: ValidationInfo) -> int:
    """At most the server's cap (``parse_request``'s context, else MAX_LOGPROBS); -1 (vLLM's: the
    whole vocabulary) only where the cap is -1."""
    cap = (info.context or {}).get("max_logprobs", MAX_LOGPROBS)
    if 0 <= value <= cap or (cap == -1 and value >= -1):
        return value
    allowed = "-1 (the whole vocabulary) or >= 0" if cap == -1 else (
        f"in [0, {cap}] (the server's --max-logprobs, default 20; -1, the whole vocabulary, needs -1 there)")
    raise ValueError(f"{info.field_name}={quoted(value)} is invalid: it must be {allowed}")


LogprobCount = Annotated[Integer, AfterValidator(_within_max_logprobs)]


class OpenAIRequest(BaseModel):
    """A request body: strict types, unknown fields ignored, ``null`` meaning the default."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None}


class StreamOptions(OpenAIRequest):
    """``stream_options``: ``include_usage`` adds a final chunk with the request's usage and no
    choices; with it, vLLM's ``continuous_usage_stats`` puts the usage so far on every chunk too."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(OpenAIRequest, VLLMOutputFields):
    """The fields both endpoints share: OpenAI's sampling parameters and vLLM's extensions
    (structured outputs, bad_words and logprob_token_ids in ``VLLMOutputFields``)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Integer = Field(1, ge=1, le=MAX_N)
    best_of: Integer | None = Field(None, ge=1, le=MAX_N)
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Integer | None = None
    stop: Annotated[str | list[str], expecting("a string or an array of strings")] = Field(
        default_factory=list)
    logit_bias: Annotated[dict[str, float], expecting("an object mapping token ids to biases")] | None = None
    # vLLM's extensions
    top_k: Integer = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: Integer = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], expecting("an array of token ids")] = Field(
        default_factory=list)
    allowed_token_ids: Annotated[list[TokenId], expecting("an array of token ids")] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # logprobs tokens as "token_id:{id}"; None: the server's
    truncate_prompt_tokens: Integer | None = Field(None, ge=-1)
    vllm_xargs: dict | None = None  # SamplingParams.extra_args
    repetition_detection: dict[str, Integer] | None = None  # RepetitionDetectionParams' fields
    thinking_token_budget: Integer | None = None  # -1 unlimited; needs the engine's reasoning_config
    stream_interval: Integer | None = Field(None, ge=1)  # tokens per streamed chunk, >= --stream-interval
    priority: Integer = 0  # the engine's scheduling_policy="priority": lower runs first
    use_beam_search: Annotated[bool, refused("use_beam_search is not supported by this server: leave it out "
                                             "or set it to false (sampled or greedy decoding)")] = False

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions, info: ValidationInfo) -> StreamOptions:
        if not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int, info: ValidationInfo) -> int:
        n = info.data.get("n", 1)
        if value != n:
            raise ValueError(f"best_of={value} is not supported: leave it out or set it equal to n ({n})")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float]) -> dict[int, float]:
        """OpenAI's logit_bias: JSON keys are token ids as strings."""
        bad = next((k for k in value if not (k.isascii() and k.isdigit() and len(k) < 19)), None)
        if bad is not None:
            raise ValueError(f"logit_bias key {quoted(bad)} is invalid: keys must be token ids (non-negative "
                             "integers written as strings)")
        out_of_range = next((b for b in value.values() if not -100 <= b <= 100), None)
        if out_of_range is not None:  # OpenAI's range; offline, SamplingParams takes any bias, as vLLM's
            raise ValueError(f"logit_bias bias {out_of_range!r} is invalid: biases in [-100, 100]")
        return {int(k): v for k, v in value.items()}

    @field_validator("prompt_logprobs", check_fields=False)
    @classmethod
    def _not_streamed(cls, value: int, info: ValidationInfo) -> int:
        if value and info.data.get("stream"):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether the client asked for a usage chunk at the end of the stream."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries the usage so far (vLLM: only together with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        if self.logprob_token_ids and logprobs is None:
            logprobs = 0  # the label ids' logprobs come back where the top logprobs do
        try:
            return SamplingParams(
                n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
                min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=self.logit_bias or None, allowed_token_ids=self.allowed_token_ids,
                extra_args=self.vllm_xargs, bad_words=self.bad_words,
                logprob_token_ids=self.logprob_token_ids, structured_outputs=self.structured_outputs_params(),
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                repetition_detection=repetition_detection_params(self.repetition_detection),
                thinking_token_budget=self.thinking_token_budget, stream_interval=self.stream_interval,
                routed_experts_prompt_start=self.routed_experts_prompt_start)
        except ValueError as e:
            raise bad_request(str(e), param=param_of(e)) from None


# ---- /v1/completions ----------------------------------------------------------------------------
PROMPT_FORMS = ("a string, an array of strings, an array of token ids or an array of token-id arrays, "
                "and not empty")


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: Annotated[str | list[int] | list[str | list[int]], expecting(PROMPT_FORMS)]
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: False tokenizes text prompts without BOS and the like
    # 0 with echo: score the prompt, generate nothing. Left out or null it is 16: vLLM's field is
    # Optional[int] = 16 and its normalize_null_max_tokens rewrites null to that default
    max_tokens: Integer = Field(16, ge=0)
    logprobs: LogprobCount | None = None
    prompt_logprobs: LogprobCount | None = None
    suffix: Annotated[str | None, refused("suffix is not supported by this server")] = None

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, value: int, info: ValidationInfo) -> int:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens=0 needs echo=true (the prompt echoed and scored, nothing "
                             "generated); otherwise give max_tokens >= 1")
        return value

    @property
    def scores_prompt_only(self) -> bool:
        """``echo`` with ``max_tokens=0`` (vLLM's scoring call): the response is the prompt alone."""
        return self.echo and self.max_tokens == 0

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list) -> str | list:
        if isinstance(prompt, list) and (not prompt or any(p == [] for p in prompt)):
            raise ValueError(f"'prompt' must be {PROMPT_FORMS}")
        return prompt

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, one per text or token-id list (a flat list of ids is one prompt)."""
        return as_prompt_list(self.prompt)

    def to_sampling_params(self) -> SamplingParams:
        """The request's SamplingParams; ``echo`` with ``logprobs`` asks for the prompt's logprobs too.
        A value SamplingParams rejects is a 400 naming the field."""
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        # one token is generated (the engine always samples) and left out of the response
        return self._sampling_params(max(self.max_tokens, 1), self.logprobs, prompt_logprobs)


# ---- /v1/chat/completions -----------------------------------------------------------------------
class TextContentPart(OpenAIRequest):
    """A text part of a message's content (the only kind this server takes)."""

    type: Literal["text"]
    text: str


class ChatCompletionMessageParam(BaseModel):
    """One message of a conversation; fields besides ``role`` and ``content`` go to the template
    as they are."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: Annotated[str | list[TextContentPart] | None,
                       expecting("a string or an array of text parts: only text parts (type 'text') are "
                                 "supported")] = None

    @model_validator(mode="before")
    @classmethod
    def _has_role(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("role"), str):
            raise ValueError("a message must be an object with a 'role' string")
        return data

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(ToolFields, SamplingRequest):
    """``POST /v1/chat/completions`` (its tool fields in ``ToolFields``)."""

    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    max_tokens: Integer | None = Field(None, ge=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    prompt_logprobs: LogprobCount | None = None
    # vLLM's extensions
    chat_template: str | None = None
    chat_template_kwargs: dict = Field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open: a prefill
    add_special_tokens: bool = False  # vLLM's: True adds BOS and the like on top of the template's
    include_reasoning: bool = True  # with --reasoning-parser: False leaves the reasoning out
    echo: Annotated[bool, refused("echo is not supported on chat completions by this server: leave it out "
                                  "or set it to false")] = False
    documents: Annotated[list | None, refused("documents is not supported by this server: give the "
                                              "documents in the messages")] = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int, info: ValidationInfo) -> int:
        if value and not info.data.get("logprobs"):  # as vLLM, 0 (no alternatives) needs no flag
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def reply_role(self, response_role: str) -> str:
        """The role of the reply (vLLM's ``get_chat_request_role``): the server's
        ``response_role`` (``--response-role``), or without ``add_generation_prompt`` the last
        message's, which the reply continues."""
        return response_role if self.add_generation_prompt else self.messages[-1].role

    @property
    def completion_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else None (up to max_model_len)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them, content as one string."""
        return [{**message.model_dump(exclude={"content"}), "content": message.text()}
                for message in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        """The request's SamplingParams (``logprobs: true`` is ``top_logprobs`` alternatives, default 0).
        A value SamplingParams rejects is a 400 naming the field."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.completion_limit, logprobs, self.prompt_logprobs)


# ---- responses ----------------------------------------------------------------------------------
class OpenAIResponse(BaseModel):
    """A response body. The fields in ``omitted_when_none`` are left out while None: OpenAI's
    bodies lack them then (``usage`` on all but the last chunk, vLLM's ``token_ids`` unless asked)."""

    omitted_when_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict:
        data = handler(self)
        for name in self.omitted_when_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens the prefix cache already held."""

    cached_tokens: int


class UsageInfo(OpenAIResponse):
    """Token counts of a request: its prompts and everything it generated."""

    omitted_when_none = frozenset({"prompt_tokens_details"})

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: per token its text, logprob, top alternatives and text offset."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def __add__(self, later: CompletionLogprobs) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=self.tokens + later.tokens, token_logprobs=self.token_logprobs + later.token_logprobs,
            top_logprobs=self.top_logprobs + later.top_logprobs,
            text_offset=self.text_offset + later.text_offset)


class LogprobEntry(BaseModel):
    """vLLM's ``Logprob`` record: a token's log-probability (-9999.0 for minus infinity, which JSON
    cannot carry), its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: per prompt position, token id -> LogprobEntry; None at position 0.
PromptLogprobs = list[dict[int, LogprobEntry] | None]


class CompletionResponseChoice(OpenAIResponse):
    """A choice of a completion, or its new part in a stream chunk."""

    omitted_when_none = frozenset({"token_ids", "prompt_token_ids", "prompt_logprobs", "routed_experts"})

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    routed_experts: str | None = None  # --enable-return-routed-experts, not streamed (server.routed_experts)


class CompletionResponse(BaseModel):
    """The body of a non-streamed ``/v1/completions`` response."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIResponse):
    """A chunk of a streamed completion; the usage rides on the last one."""

    omitted_when_none = frozenset({"usage"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatCompletionTopLogprob(BaseModel):
    """One alternative token at a position, with its UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


class ChatCompletionLogprob(ChatCompletionTopLogprob):
    """The chosen token at a position and the most likely alternatives."""

    top_logprobs: list[ChatCompletionTopLogprob]


class ChatCompletionLogprobs(BaseModel):
    """A chat choice's logprobs, one entry per generated token."""

    content: list[ChatCompletionLogprob]


class ChatMessage(OpenAIResponse):
    """The reply of a chat choice, in the request's ``reply_role``: its text and tool calls
    (vLLM's content is "" when a named or "required" tool_choice made the calls, null when "auto"
    found no text), and with ``--reasoning-parser`` its reasoning (left out where there is none)."""

    omitted_when_none = frozenset({"reasoning", "reasoning_content"})

    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # --reasoning-parser: the reasoning before the content (vLLM's field, and its older name)
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionResponseChoice(OpenAIResponse):
    """A choice of a chat completion."""

    omitted_when_none = frozenset({"token_ids", "routed_experts"})

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None  # as CompletionResponseChoice's


class ChatCompletionResponse(OpenAIResponse):
    """The body of a non-streamed ``/v1/chat/completions`` response (vLLM's ``prompt_logprobs``
    when asked for)."""

    omitted_when_none = frozenset({"prompt_logprobs"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(OpenAIResponse):
    """A chat choice's new text or tool-call parts; ``role`` only on its first chunk."""

    omitted_when_none = frozenset({"role", "content", "tool_calls", "reasoning", "reasoning_content"})

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIResponse):
    """A chat choice's new part in a stream chunk."""

    omitted_when_none = frozenset({"token_ids"})

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIResponse):
    """A chunk of a streamed chat completion; the usage rides on the last one."""

    omitted_when_none = frozenset({"usage"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/models ---------------------------------------------------------------------------------
class ModelCard(BaseModel):
    """One served model name in ``/v1/models``, with vLLM's extra fields."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedlab"
    root: str
    parent: str | None = None
    max_model_len: int
    vocab_size: int


class ModelList(BaseModel):
    """The body of ``/v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
