"""An OpenAI-compatible HTTP server over ``AsyncEngine`` (FastAPI + uvicorn).

Endpoints: ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``. Requests join the running batch as they
arrive (online continuous batching) and stream token by token with ``"stream": true``. Errors use
OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: 400 for bad parameters, malformed
JSON and prompts longer than the model allows, 401 for a missing or wrong API key, 404 for an
unknown model; a failed request fails alone and the server keeps serving. A client that goes
away mid-request has its request aborted and its KV blocks freed.

    app = build_app(AsyncEngine.from_engine_config(EngineConfig(model=DIR)))
    uvicorn.run(app, host="127.0.0.1", port=8000)

or ``pagedlab serve --model DIR`` / ``python -m pagedlab.server.openai_api --model DIR``.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoints' annotations at runtime.
import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pagedlab.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from pagedlab.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedlab.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # OpenAI's limit for logprobs / top_logprobs


# ---- errors ---------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _param_of(error: ValueError) -> str | None:
    """SamplingParams/engine errors start with "name=value is invalid"; that name is the param."""
    head = str(error).split("=", 1)[0]
    return head if head.isidentifier() else None


# ---- request parsing ------------------------------------------------------------------------
_NUMBER = (int, float)
_TYPE_NAMES = {bool: "a boolean", str: "a string", dict: "an object", list: "an array"}


class _Body:
    """Typed access to a JSON request body; a wrong type is a 400 naming the field."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name: str, type_: type, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, type_) or (isinstance(value, bool) and type_ is not bool):
            raise bad_request(f"{value!r} is not valid for '{name}': expected {_TYPE_NAMES[type_]}", param=name)
        return value

    def number(self, name: str, default: float | None) -> float | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, _NUMBER) or isinstance(value, bool):
            raise bad_request(f"{value!r} is not valid for '{name}': expected a number", param=name)
        return float(value)

    def integer(self, name: str, default: int | None = None, minimum: int | None = None,
                maximum: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, _NUMBER) or isinstance(value, bool):
            raise bad_request(f"{value!r} is not valid for '{name}': expected an integer", param=name)
        if isinstance(value, float):
            if not value.is_integer():
                raise bad_request(f"{value!r} is not valid for '{name}': expected an integer", param=name)
            value = int(value)
        if minimum is not None and value < minimum:
            raise bad_request(f"{value} is less than the minimum of {minimum} - '{name}'", param=name)
        if maximum is not None and value > maximum:
            raise bad_request(f"{value} is greater than the maximum of {maximum} - '{name}'", param=name)
        return value

    def stop(self) -> list[str]:
        stop = self.body.get("stop")
        if stop is None:
            return []
        if isinstance(stop, str):
            return [stop] if stop else []
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            return [s for s in stop if s]
        raise bad_request(f"{stop!r} is not valid for 'stop': expected a string or an array of strings", param="stop")

    def token_ids(self, name: str) -> list[int]:
        value = self.body.get(name)
        if value is None:
            return []
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        raise bad_request(f"{value!r} is not valid for '{name}': expected an array of token ids", param=name)


def _sampling_params(b: _Body, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
                     ) -> SamplingParams:
    """The sampling fields both endpoints share (OpenAI's plus vLLM's extensions)."""
    n = b.integer("n", 1, minimum=1)
    best_of = b.integer("best_of")
    if best_of is not None and best_of != n:
        raise bad_request(f"best_of={best_of} is not supported: leave it out or set it equal to n ({n})",
                          param="best_of")
    logit_bias = b.get("logit_bias", dict, {})
    if logit_bias:
        raise bad_request("logit_bias is not supported by this server", param="logit_bias")
    top_k = b.integer("top_k", 0)
    kwargs = dict(
        n=n,
        temperature=b.number("temperature", 1.0),
        top_p=b.number("top_p", 1.0),
        top_k=0 if top_k in (None, -1) else top_k,
        min_p=b.number("min_p", 0.0),
        presence_penalty=b.number("presence_penalty", 0.0),
        frequency_penalty=b.number("frequency_penalty", 0.0),
        repetition_penalty=b.number("repetition_penalty", 1.0),
        seed=b.integer("seed"),
        stop=b.stop(),
        stop_token_ids=b.token_ids("stop_token_ids"),
        ignore_eos=b.get("ignore_eos", bool, False),
        max_tokens=max_tokens,
        min_tokens=b.integer("min_tokens", 0),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=b.get("include_stop_str_in_output", bool, False),
        skip_special_tokens=b.get("skip_special_tokens", bool, True),
        spaces_between_special_tokens=b.get("spaces_between_special_tokens", bool, True),
    )
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param=_param_of(e)) from None


def _stream_options(b: _Body, stream: bool) -> bool:
    """Whether the client asked for a usage chunk at the end of the stream."""
    options = b.get("stream_options", dict)
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options can only be set when stream is true", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("stream_options.include_usage must be a boolean", param="stream_options")
    return include


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None


# ---- streaming state --------------------------------------------------------------------------
class _ChoiceState:
    """What one choice has sent so far. Text is held back by (longest stop string - 1)
    characters until the choice finishes, so a stop string is never half-sent."""

    __slots__ = ("sent_text", "sent_tokens", "started", "done")

    def __init__(self):
        self.sent_text = 0
        self.sent_tokens = 0
        self.started = False
        self.done = False

    def take(self, c: CompletionOutput, holdback: int):
        """(text delta, new token ids, their logprobs, finish_reason) or None when nothing is new."""
        if self.done:
            return None
        finished = c.finish_reason is not None
        text = c.text
        end = len(text) if finished else max(self.sent_text, len(text) - holdback)
        delta = text[self.sent_text:end] if end > self.sent_text else ""
        self.sent_text = max(self.sent_text, end)
        new_ids = c.token_ids[self.sent_tokens:]
        new_lps = c.logprobs[self.sent_tokens:] if c.logprobs is not None else None
        self.sent_tokens = len(c.token_ids)
        if not delta and not new_ids and not finished:
            return None
        self.done = finished
        return delta, new_ids, new_lps, c.finish_reason


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several request streams as they come: (stream index, output)."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompts: Sequence[_Prompt], outputs: Sequence[RequestOutput | None], completion_tokens: int | None = None
           ) -> dict:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    if completion_tokens is None:
        completion_tokens = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


# ---- the server -----------------------------------------------------------------------------
class OpenAIServer:
    """Request handling, independent of the web framework (``build_app`` wires it to FastAPI)."""

    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str] | None = None,
                 api_key: str | None = None, chat_template: str | None = None, metrics=None,
                 max_logprobs: int = MAX_LOGPROBS):
        self.engine = engine
        self.served_model_names = list(served_model_names or [engine.model_name])
        self.api_key = api_key
        self.chat_template = chat_template
        self.metrics = metrics
        self.max_logprobs = max_logprobs
        self.created = int(time.time())
        if metrics is not None:
            engine.add_listener(metrics)

    # ---- shared checks --------------------------------------------------------------------
    def check_api_key(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                           "invalid_request_error", None, "invalid_api_key")

    def check_model(self, b: _Body) -> str:
        model = b.get("model", str)
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                                f"{', '.join(repr(n) for n in self.served_model_names)}.",
                           "invalid_request_error", "model", "model_not_found")
        return model

    def check_engine(self) -> None:
        if not self.engine.is_running:
            raise APIError(503, "the engine is not running", "server_error", None, "engine_dead")

    def _validate_prompt(self, prompt: _Prompt, max_tokens: int | None, param: str = "prompt") -> None:
        try:
            self.engine.engine.validate_prompt(prompt.token_ids)
        except ValueError as e:
            raise bad_request(str(e), param=param,
                              code="context_length_exceeded" if "max_model_len" in str(e) else None) from None
        limit = self.engine.max_model_len
        if max_tokens is not None and len(prompt.token_ids) + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt.token_ids) + max_tokens} tokens ({len(prompt.token_ids)} in the prompt, {max_tokens} "
                "for the completion). Please reduce the prompt or max_tokens.", param=param,
                code="context_length_exceeded")

    def _require_tokenizer(self, what: str):
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise bad_request(f"{what} need a tokenizer, and the model {self.served_model_names[0]!r} has none: "
                              "send prompts as token ids")
        return tokenizer

    def _add(self, prompts: Sequence[_Prompt], params: SamplingParams, request_id: str, stream: bool
             ) -> list[RequestStream]:
        arrival = time.time()
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.engine.add_request({"prompt_token_ids": p.token_ids, "prompt": p.text}, params,
                                                       request_id=rid, arrival_time=arrival, stream=stream))
        except ValueError as e:
            for s in streams:
                s.abort()
            raise bad_request(str(e), param=_param_of(e)) from None
        except EngineDeadError as e:
            for s in streams:
                s.abort()
            raise APIError(503, str(e), "server_error", None, "engine_dead") from None
        return streams

    # ---- /v1/models -----------------------------------------------------------------------
    def models(self) -> dict:
        engine = self.engine.engine
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "pagedlab",
             "root": str(engine.source.path), "parent": None, "max_model_len": engine.max_model_len,
             "vocab_size": int(engine.hf_config.vocab_size)}
            for name in self.served_model_names]}

    # ---- /v1/completions ------------------------------------------------------------------
    def _completion_prompts(self, b: _Body) -> list[_Prompt]:
        raw = b.body.get("prompt")
        if raw is None:
            raise bad_request("'prompt' is required", param="prompt")

        def is_ids(x):
            return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(raw, str):
            items = [raw]
        elif is_ids(raw):
            items = [raw]
        elif isinstance(raw, list) and raw and all(isinstance(x, str) or is_ids(x) for x in raw):
            items = raw
        else:
            raise bad_request("'prompt' must be a string, an array of strings, an array of token ids or an array of "
                              "token-id arrays, and not empty", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                tokenizer = self._require_tokenizer("text prompts")
                prompts.append(_Prompt(tokenizer(item, add_special_tokens=True).input_ids, item))
            else:
                prompts.append(_Prompt(list(item), None))
        return prompts

    async def completions(self, body: dict, disconnected: "asyncio.Future | None" = None):
        self.check_engine()
        b = _Body(body)
        model = self.check_model(b)
        if b.body.get("suffix") is not None:
            raise bad_request("suffix is not supported by this server", param="suffix")
        stream = b.get("stream", bool, False)
        include_usage = _stream_options(b, stream)
        echo = b.get("echo", bool, False)
        return_token_ids = b.get("return_token_ids", bool, False)
        logprobs = b.integer("logprobs", None, minimum=0, maximum=self.max_logprobs)
        max_tokens = b.integer("max_tokens", 16, minimum=1)
        prompt_logprobs = b.integer("prompt_logprobs", None, minimum=0, maximum=self.max_logprobs)
        if echo and logprobs is not None:
            prompt_logprobs = logprobs if prompt_logprobs is None else max(prompt_logprobs, logprobs)
        params = _sampling_params(b, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if params.logprobs is not None or params.stop:
            self._require_tokenizer("logprobs and stop strings")
        prompts = self._completion_prompts(b)
        for p in prompts:
            self._validate_prompt(p, max_tokens)
        if echo:
            tokenizer = self.engine.tokenizer
            for p in prompts:
                if p.text is None:
                    p.text = tokenizer.decode(p.token_ids) if tokenizer is not None else ""
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = self._add(prompts, params, request_id, stream)
        ctx = _CompletionContext(self, request_id, created, model, prompts, params, echo, return_token_ids)
        if stream:
            return self._stream_events(ctx.stream(streams, include_usage))
        outputs = await self._collect(streams, disconnected)
        return ctx.response(outputs)

    # ---- /v1/chat/completions -------------------------------------------------------------
    def _chat_prompt(self, b: _Body) -> _Prompt:
        messages = b.body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array of messages", param="messages")
        conversation = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise bad_request(f"messages[{i}].content: only text parts are supported "
                                          "(type 'text')", param=f"messages[{i}].content")
                    texts.append(part["text"])
                content = "\n".join(texts)
            elif content is not None and not isinstance(content, str):
                raise bad_request(f"messages[{i}].content must be a string or an array of text parts",
                                  param=f"messages[{i}].content")
            conversation.append({**{k: v for k, v in m.items() if k != "content"}, "content": content or ""})
        tokenizer = self._require_tokenizer("chat completions")
        template_kwargs = b.get("chat_template_kwargs", dict, {})
        add_generation_prompt = b.get("add_generation_prompt", bool, True)
        template = b.get("chat_template", str, self.chat_template)
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template: start the server with --chat-template, "
                              "or use /v1/completions", param="messages")
        try:
            text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **template_kwargs)
        except Exception as e:  # jinja errors, raise_exception() in templates, bad kwargs
            raise bad_request(f"the chat template could not be applied: {e}", param="messages") from None
        return _Prompt(tokenizer(text, add_special_tokens=False).input_ids, text)

    async def chat_completions(self, body: dict, disconnected: "asyncio.Future | None" = None):
        self.check_engine()
        b = _Body(body)
        model = self.check_model(b)
        stream = b.get("stream", bool, False)
        include_usage = _stream_options(b, stream)
        for unsupported in ("tools", "functions"):
            if b.body.get(unsupported):
                raise bad_request(f"{unsupported} are not supported by this server", param=unsupported)
        response_format = b.get("response_format", dict)
        if response_format is not None and response_format.get("type", "text") != "text":
            raise bad_request(f"response_format type {response_format.get('type')!r} is not supported: only 'text'",
                              param="response_format")
        want_logprobs = b.get("logprobs", bool, False)
        top_logprobs = b.integer("top_logprobs", None, minimum=0, maximum=self.max_logprobs)
        if top_logprobs is not None and not want_logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        max_tokens = b.integer("max_completion_tokens", None, minimum=1)
        if max_tokens is None:
            max_tokens = b.integer("max_tokens", None, minimum=1)
        params = _sampling_params(b, max_tokens=max_tokens, logprobs=(top_logprobs or 0) if want_logprobs else None)
        prompt = self._chat_prompt(b)
        self._validate_prompt(prompt, max_tokens, param="messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = self._add([prompt], params, request_id, stream)
        ctx = _ChatContext(self, request_id, created, model, prompt, params, top_logprobs or 0,
                           b.get("return_token_ids", bool, False))
        if stream:
            return self._stream_events(ctx.stream(streams[0], include_usage))
        outputs = await self._collect(streams, disconnected)
        return ctx.response(outputs[0])

    # ---- plumbing -------------------------------------------------------------------------
    async def _collect(self, streams: list[RequestStream], disconnected: "asyncio.Future | None"
                       ) -> list[RequestOutput]:
        """Final outputs of all streams; aborts them all if the client goes away or one fails."""
        task = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
        try:
            if disconnected is not None:
                await asyncio.wait([task, disconnected], return_when=asyncio.FIRST_COMPLETED)
                if not task.done():
                    raise ClientGone()
            return await task
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error", None, "engine_dead") from None
        except (APIError, ClientGone, asyncio.CancelledError):
            raise
        except Exception as e:
            logger.exception("request failed")
            raise APIError(500, f"the request failed: {e}", "server_error") from None
        finally:
            if not task.done():
                task.cancel()
            for s in streams:
                s.abort()

    @staticmethod
    def _stream_events(events: AsyncIterator[str]) -> "_EventStream":
        return _EventStream(events)


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


class _EventStream:
    """A server-sent-event body, handed to the web framework."""

    def __init__(self, events: AsyncIterator[str]):
        self.events = events


def _stream_error_event(e: BaseException) -> str:
    if isinstance(e, APIError):
        return _sse(e.body())
    kind = "server_error"
    return _sse(error_body(f"the request failed: {e}", kind, None, "engine_dead" if isinstance(e, EngineDeadError)
                           else None))


# ---- response builders ------------------------------------------------------------------------
class _CompletionContext:
    def __init__(self, server: OpenAIServer, request_id: str, created: int, model: str, prompts: list[_Prompt],
                 params: SamplingParams, echo: bool, return_token_ids: bool):
        self.server, self.request_id, self.created, self.model = server, request_id, created, model
        self.prompts, self.params, self.echo, self.return_token_ids = prompts, params, echo, return_token_ids
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    def _logprobs(self, positions: Sequence[PositionLogprobs | None], token_ids: Sequence[int], offset: int,
                  first_token_text: str | None = None) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for j, (token, pos) in enumerate(zip(token_ids, positions)):
            if pos is None:  # the first prompt token has no logprob
                text = first_token_text if first_token_text is not None else ""
                tokens.append(text)
                token_logprobs.append(None)
                top.append(None)
            else:
                chosen = pos[token]
                text = chosen.decoded_token or ""
                tokens.append(text)
                token_logprobs.append(chosen.logprob)
                entries: dict[str, float] = {}
                for _, lp in sorted(pos.items(), key=lambda kv: kv[1].rank):
                    entries.setdefault(lp.decoded_token or "", lp.logprob)  # tokens that decode alike: the best
                top.append(entries)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _echo_logprobs(self, out: RequestOutput) -> dict:
        tokenizer = self.server.engine.tokenizer
        first = tokenizer.decode([out.prompt_token_ids[0]]) if tokenizer is not None else ""
        return self._logprobs(out.prompt_logprobs or [None] * len(out.prompt_token_ids), out.prompt_token_ids, 0,
                              first)

    def _choice(self, index: int, text: str, logprobs, finish_reason, c: CompletionOutput | None, prompt: _Prompt,
                token_ids=None) -> dict:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": c.stop_reason if c is not None and finish_reason else None}
        if self.return_token_ids:
            choice["token_ids"] = token_ids if token_ids is not None else (c.token_ids if c is not None else [])
            choice["prompt_token_ids"] = prompt.token_ids
        return choice

    def response(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for i, (prompt, out) in enumerate(zip(self.prompts, outputs)):
            for c in out.outputs:
                text = c.text
                logprobs = None
                if self.params.logprobs is not None:
                    offset = len(prompt.text or "") if self.echo else 0
                    logprobs = self._logprobs(c.logprobs or [], c.token_ids, offset)
                    if self.echo:
                        echoed = self._echo_logprobs(out)
                        logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
                if self.echo:
                    text = (prompt.text or "") + text
                choices.append(self._choice(i * self.params.n + c.index, text, logprobs, c.finish_reason, c, prompt))
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": _usage(self.prompts, outputs)}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        return _stream_chunk(self, "text_completion", choices, usage)

    def _chunks(self, i: int, out: RequestOutput, states: list[_ChoiceState]) -> list[dict]:
        prompt, n = self.prompts[i], self.params.n
        chunks = []
        for c in out.outputs:
            state = states[c.index]
            taken = state.take(c, self.holdback)
            if taken is None:
                continue
            delta, new_ids, new_lps, finish = taken
            logprobs = None
            if self.params.logprobs is not None:
                offset = (len(prompt.text or "") if self.echo else 0) + state.sent_text - len(delta)
                logprobs = self._logprobs(new_lps or [], new_ids, offset)
            if not state.started:
                state.started = True
                if self.echo:
                    delta = (prompt.text or "") + delta
                    if logprobs is not None:
                        echoed = self._echo_logprobs(out)
                        logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
            chunks.append(self._chunk([self._choice(i * n + c.index, delta, logprobs, finish, c, prompt, new_ids)]))
        return chunks

    def stream(self, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
        return _sse_events(self._stream_chunks(streams, include_usage), f"streamed completion {self.request_id}")

    async def _stream_chunks(self, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[list[dict]]:
        states = [[_ChoiceState() for _ in range(self.params.n)] for _ in streams]
        finals: list[RequestOutput | None] = [None] * len(streams)
        async with contextlib.aclosing(_merge(streams)) as merged:
            async for i, out in merged:
                if out.finished:
                    finals[i] = out
                chunks = self._chunks(i, out, states[i])
                if all(f is not None for f in finals):  # the last output: usage goes with it
                    _attach_usage(chunks, _usage(self.prompts, finals), include_usage, self._chunk)
                yield chunks


class _ChatContext:
    def __init__(self, server: OpenAIServer, request_id: str, created: int, model: str, prompt: _Prompt,
                 params: SamplingParams, top_logprobs: int, return_token_ids: bool):
        self.server, self.request_id, self.created, self.model = server, request_id, created, model
        self.prompt, self.params, self.top_logprobs = prompt, params, top_logprobs
        self.return_token_ids = return_token_ids
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    def _logprobs(self, positions: Sequence[PositionLogprobs], token_ids: Sequence[int]) -> dict:
        content = []
        for token, pos in zip(token_ids, positions):
            chosen = pos[token]
            ranked = sorted(pos.items(), key=lambda kv: kv[1].rank)[:self.top_logprobs]
            content.append({
                "token": chosen.decoded_token or "", "logprob": chosen.logprob,
                "bytes": list((chosen.decoded_token or "").encode("utf-8")),
                "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                                  "bytes": list((lp.decoded_token or "").encode("utf-8"))} for _, lp in ranked]})
        return {"content": content}

    def response(self, out: RequestOutput) -> dict:
        choices = []
        for c in out.outputs:
            choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                      "logprobs": self._logprobs(c.logprobs or [], c.token_ids) if self.params.logprobs is not None
                      else None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if self.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": _usage([self.prompt], [out])}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        return _stream_chunk(self, "chat.completion.chunk", choices, usage)

    def _chunks(self, out: RequestOutput, states: list[_ChoiceState]) -> list[dict]:
        chunks = []
        for c in out.outputs:
            state = states[c.index]
            taken = state.take(c, self.holdback)
            if taken is None:
                continue
            text, new_ids, new_lps, finish = taken
            delta: dict = {}
            if not state.started:
                state.started = True
                delta["role"] = "assistant"
            delta["content"] = text
            choice = {"index": c.index, "delta": delta,
                      "logprobs": self._logprobs(new_lps or [], new_ids) if self.params.logprobs is not None else None,
                      "finish_reason": finish, "stop_reason": c.stop_reason if finish else None}
            if self.return_token_ids:
                choice["token_ids"] = new_ids
            chunks.append(self._chunk([choice]))
        return chunks

    def stream(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[str]:
        return _sse_events(self._stream_chunks(stream, include_usage), f"streamed chat completion {self.request_id}")

    async def _stream_chunks(self, stream: RequestStream, include_usage: bool) -> AsyncIterator[list[dict]]:
        states = [_ChoiceState() for _ in range(self.params.n)]
        async with contextlib.aclosing(_merge([stream])) as merged:
            async for _, out in merged:
                chunks = self._chunks(out, states)
                if out.finished:
                    _attach_usage(chunks, _usage([self.prompt], [out]), include_usage, self._chunk)
                yield chunks


def _stream_chunk(ctx, object_name: str, choices: list[dict], usage: dict | None) -> dict:
    chunk = {"id": ctx.request_id, "object": object_name, "created": ctx.created, "model": ctx.model,
             "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def _attach_usage(chunks: list[dict], usage: dict, include_usage: bool, make_chunk) -> None:
    """OpenAI's rule: with ``stream_options.include_usage`` a final chunk with no choices carries
    the usage; otherwise the last chunk does."""
    if include_usage:
        chunks.append(make_chunk([], usage))
    elif chunks:
        chunks[-1]["usage"] = usage


async def _sse_events(chunk_lists: AsyncIterator[list[dict]], description: str) -> AsyncIterator[str]:
    """Server-sent events of each chunk; a failure becomes an error event; always ends with [DONE]."""
    try:
        async with contextlib.aclosing(chunk_lists) as chunk_lists:
            async for chunks in chunk_lists:
                for chunk in chunks:
                    yield _sse(chunk)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        logger.warning("%s failed: %r", description, e)
        yield _stream_error_event(e)
    yield "data: [DONE]\n\n"


# ---- FastAPI wiring ---------------------------------------------------------------------------
def build_app(engine: AsyncEngine, served_model_names: Sequence[str] | None = None, api_key: str | None = None,
              chat_template: str | None = None, metrics=None, enable_metrics: bool = True,
              shutdown_engine: bool = False):
    """The FastAPI app serving ``engine``. ``metrics`` is a ``ServerMetrics`` (made here when
    ``enable_metrics``); ``shutdown_engine`` stops the engine thread when the app shuts down."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    if metrics is None and enable_metrics:
        from pagedlab.server.metrics import ServerMetrics

        metrics = ServerMetrics(model_name=(list(served_model_names or []) or [engine.model_name])[0])
    server = OpenAIServer(engine, served_model_names, api_key, chat_template, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if shutdown_engine:
            engine.shutdown()

    from pagedlab import __version__

    app = FastAPI(title="pagedlab OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.server = server
    app.state.engine = engine
    app.state.metrics = metrics

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind, None, e.status_code), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(error_body(str(e), "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal server error: {e!r}", "server_error"), status_code=500)

    async def json_body(request: Request) -> dict:
        server.check_api_key(request.headers.get("authorization"))
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"We could not parse the JSON body of your request ({e}). The body must be a JSON "
                              "object.", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad_request("The body of your request must be a JSON object.", code="invalid_json")
        return body

    async def watch_disconnect(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def respond(request: Request, handler) -> Response:
        body = await json_body(request)
        disconnected = asyncio.ensure_future(watch_disconnect(request))
        try:
            result = await handler(body, disconnected)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        except BaseException:
            disconnected.cancel()
            raise
        if isinstance(result, _EventStream):  # the stream owns the disconnect watch from here
            return StreamingResponse(_watched(result.events, disconnected), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        disconnected.cancel()
        return JSONResponse(result)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return JSONResponse(error_body("the engine is not running", "server_error", None, "engine_dead"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            raise APIError(404, "metrics are disabled on this server", code="not_found")
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    @app.get("/v1/models")
    async def list_models(request: Request):
        server.check_api_key(request.headers.get("authorization"))
        return server.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, server.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, server.chat_completions)

    return app


async def _watched(events: AsyncIterator[str], disconnected: asyncio.Future) -> AsyncIterator[str]:
    """Pass ``events`` through; stop (aborting the request) as soon as the client disconnects,
    even while the request is still waiting for its first token."""
    iterator = events.__aiter__()
    step = None
    try:
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            await asyncio.wait([step, disconnected], return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        disconnected.cancel()
        if step is not None and not step.done():
            step.cancel()  # the event generator sees the cancellation and aborts its requests
        else:
            await iterator.aclose()


# ---- running ------------------------------------------------------------------------------------
class ServerThread:
    """Run an app under uvicorn in a background thread (tests, notebooks, benchmarks).

        with ServerThread(app) as srv:      # port 0: a free port on 127.0.0.1
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="pagedlab-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8000, *,
               served_model_names: Sequence[str] | None = None, api_key: str | None = None,
               chat_template: str | None = None, log_level: str = "info", enable_metrics: bool = True) -> None:
    """Serve until interrupted (Ctrl-C); the engine thread stops with the server."""
    import uvicorn

    app = build_app(engine, served_model_names, api_key, chat_template, enable_metrics=enable_metrics,
                    shutdown_engine=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedlab.server.openai_api --model DIR [engine args]`` (= ``pagedlab serve``)."""
    import argparse

    from pagedlab.server.cli import add_serve_args, serve_command

    parser = argparse.ArgumentParser(prog="python -m pagedlab.server.openai_api",
                                     description="OpenAI-compatible server (same as `pagedlab serve`)")
    add_serve_args(parser)
    return serve_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
