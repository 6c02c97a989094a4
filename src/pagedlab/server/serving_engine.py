"""What the completions and chat endpoints share: the checks every request passes, prompt
encoding and validation, the limits on what one request may ask for and on the waiting queue
(``ServerLimits``, ``Admission``), adding requests to the ``AsyncEngine``, collecting their final
outputs, and the server-sent-event plumbing of streamed responses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

from pydantic import BaseModel

from pagedlab import RequestOutput, SamplingParams
from pagedlab.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from pagedlab.engine.sleep_mode import EngineAsleepError
from pagedlab.inputs import EncodedPrompt, PromptType, encode_prompt, require_tokenizer
from pagedlab.outputs import CompletionOutput, PositionLogprobs
from pagedlab.server.limits import ServerLimits
from pagedlab.server.errors import (APIError, ErrorInfo, ErrorResponse, bad_request, engine_dead, param_of,
                                    unavailable)
from pagedlab.server.protocol import LogprobEntry, PromptLogprobs, PromptTokensDetails, UsageInfo, quoted
from pagedlab.server.serving_models import OpenAIServingModels

logger = logging.getLogger(__name__)


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


class EventStream:
    """A streamed response: its server-sent events, handed to the web framework."""

    def __init__(self, events: AsyncIterator[str]):
        self.events = events


class Admission:
    """The requests the server has handed to the engine and not yet seen finish, shared by every
    endpoint: it bounds the waiting queue, and a graceful shutdown (``drain``) stops admitting,
    lets the running requests finish and aborts the rest."""

    def __init__(self, engine: AsyncEngine, limits: ServerLimits):
        self.engine, self.limits = engine, limits
        self.live: dict[RequestStream, int] = {}  # stream -> its sequences (n)
        self.draining = False
        self.cut_by_shutdown = False

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting (503), wait up to ``timeout_s`` for the live requests, abort the rest
        (each is answered with a ``shutting_down`` error)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.num_live_sequences() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.live:
            logger.warning("shutdown: aborting %d requests still running after %.1f s", len(self.live),
                           timeout_s)
            self.cut_by_shutdown = True
            for stream in list(self.live):  # the engine's abort: each consumer still gets its final output
                self.engine.abort(stream.request_id)

    def check_not_cut(self, out: RequestOutput) -> None:
        """A 503 ``shutting_down`` for an output that a graceful shutdown aborted."""
        if self.cut_by_shutdown and out.finished and any(c.finish_reason == "abort" for c in out.outputs):
            raise unavailable("The server shut down before this request finished; retry it.", "shutting_down")

    def _unfinished(self) -> dict[RequestStream, int]:
        """``live``, less the requests whose consumers saw them finish (forgotten here)."""
        for stream in [s for s in self.live if s.finished]:
            del self.live[stream]
        return self.live

    def num_live_sequences(self) -> int:
        """Sequences of requests whose consumers have not yet seen them finish."""
        return sum(self._unfinished().values())

    def num_waiting_sequences(self) -> int:
        """Sequences the engine has but does not run: a request counts while it is in the engine,
        not once the engine finished it, though a slow client may not yet have read its end."""
        in_engine = sum(n for s, n in self._unfinished().items() if not s.engine_finished)
        return max(0, in_engine - self.engine.get_stats().num_running)

    def check(self, num_sequences: int) -> None:
        """A 503 while shutting down, or when ``num_sequences`` more would overfill the waiting queue."""
        if self.draining:
            raise unavailable("The server is shutting down and takes no new requests.", "shutting_down")
        limit = self.limits.max_waiting_requests
        if limit is None:
            return
        waiting = self.num_waiting_sequences()
        if waiting + num_sequences > limit:
            raise unavailable(f"The server is busy: {waiting} sequences are waiting (at most {limit}). "
                              "Retry later.", "server_busy")

    def track(self, streams: Sequence[RequestStream], n: int) -> None:
        for stream in streams:
            self.live[stream] = n


class OpenAIServing:
    """The base of the endpoint handlers: one engine, served under ``served_model_names`` (and the
    LoRA adapters of ``models`` under theirs: shared by all endpoints, as the limits of
    ``admission`` are; defaults: no adapters, ``ServerLimits()``). ``return_tokens_as_token_ids``
    is the server's default for the request field of that name (vLLM's
    ``--return-tokens-as-token-ids``)."""

    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str],
                 admission: Admission | None = None, models: OpenAIServingModels | None = None, *,
                 return_tokens_as_token_ids: bool = False):
        self.engine = engine
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.served_model_names = list(served_model_names)
        self.models = models if models is not None else OpenAIServingModels(engine, served_model_names)
        self.admission = admission if admission is not None else Admission(engine, ServerLimits())

    def tokens_as_ids(self, request) -> bool:
        """Whether ``request``'s logprobs name tokens as "token_id:{id}": its own
        ``return_tokens_as_token_ids`` when it sets one, else the server's."""
        asked = request.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if asked is None else asked

    # ---- checks ---------------------------------------------------------------------------
    def check_engine(self) -> None:
        """A 503 unless the engine thread runs."""
        if not self.engine.is_running:
            raise engine_dead("the engine is not running")

    def check_request(self, prompts: Sequence[EncodedPrompt], params: Sequence[SamplingParams]) -> None:
        """A 400 for a request asking for more sequences or tokens than one request may, or naming
        token ids out of vocabulary (the waiting queue is checked by ``add_requests``). ``params``
        holds each prompt's (``with_model_defaults``): they differ only in max_tokens."""
        limits, n = self.admission.limits, params[0].n
        sequences = len(prompts) * n
        if sequences > limits.max_sequences_per_request:
            raise bad_request(f"This request asks for {sequences} sequences ({len(prompts)} prompts x "
                              f"n={n}), more than the {limits.max_sequences_per_request} one request may.",
                              param="n")
        limit = self.engine.max_model_len
        tokens = n * sum(len(p.token_ids) + (sp.max_tokens or limit - len(p.token_ids))
                         for p, sp in zip(prompts, params))
        if tokens > limits.max_tokens_per_request:
            raise bad_request(f"This request may occupy {tokens} tokens (prompts and max_tokens over all "
                              f"{sequences} sequences), more than the {limits.max_tokens_per_request} one "
                              "request may. Lower n, max_tokens or the number of prompts.",
                              param="max_tokens")
        try:
            params[0].verify_vocabulary(self.engine.info.hf_config.vocab_size)
        except ValueError as e:
            raise bad_request(str(e), param=param_of(e)) from None

    def with_model_defaults(self, request, params: SamplingParams, prompt: EncodedPrompt) -> SamplingParams:
        """``params`` for ``prompt``, as vLLM's server builds them: the fields the request left unset
        taken from the model's generation config (``EngineConfig.generation_config``: its
        recommended temperature, top_p, ...), and the token limit of vLLM's ``get_max_tokens``: the
        request's own (a completion's is 16 when left out or null), or where it has none (a chat
        request without one: only chat can) the model's max_new_tokens, capped by the room
        ``prompt`` leaves under max_model_len (each prompt of a request its own) and by the
        engine's ``max_tokens_cap``, which caps a limit the request sets as well. So a limit the
        model recommends never makes a request too long; only one the request sets can (a 400 from
        ``validate_prompt``)."""
        given = request.model_fields_set
        defaults = dict(self.engine.default_sampling_args)
        model_limit = defaults.pop("max_tokens", None)
        changes = {k: v for k, v in defaults.items() if k not in given}
        fallback = params.max_tokens if params.max_tokens is not None else model_limit
        limits = [v for v in (fallback, self.engine.max_tokens_cap) if v is not None]
        if limits:
            changes["max_tokens"] = min(self.engine.max_model_len - len(prompt.token_ids), *limits)
        try:
            return params.clone(**changes) if changes else params
        except ValueError as e:
            raise bad_request(str(e), param=param_of(e)) from None

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's structured-output grammar in a worker thread, so neither the event
        loop nor the engine thread waits for it (the engine then finds it in xgrammar's cache); a
        400 for a bad schema, regex or grammar, or when xgrammar is not installed."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.engine.grammar_compiler.compile, params.structured_outputs)
        except ValueError as e:
            raise bad_request(str(e), param=param_of(e)) from None

    def check_model(self, model: str | None) -> str:
        """The served name the response carries; 404 for a model this server does not serve."""
        return self.models.check_model(model)

    def require_tokenizer(self, what: str):
        """The tokenizer, or a 400 saying that ``what`` needs one."""
        try:
            return require_tokenizer(self.engine.tokenizer, what, self.served_model_names[0])
        except ValueError as e:
            raise bad_request(str(e)) from None

    # ---- prompts --------------------------------------------------------------------------
    def encode(self, prompt: PromptType, param: str) -> EncodedPrompt:
        """``prompt``'s token ids and text (``pagedlab.inputs``); a 400 naming ``param`` if it cannot be."""
        try:
            return encode_prompt(prompt, self.engine.tokenizer, self.served_model_names[0])
        except (ValueError, TypeError, UnicodeError, OverflowError) as e:  # tokenizers raise all of these
            raise bad_request(f"The {param} could not be tokenized: {e}", param=param) from None

    def validate_prompt(self, prompt: EncodedPrompt, params: SamplingParams, param: str,
                        limit_param: str = "max_tokens") -> None:
        """Cut ``prompt`` to ``params.truncate_prompt_tokens``; then a 400 for a prompt the model
        cannot take, or one that leaves no room for ``params.max_tokens``, worded as vLLM's
        (clients match on "Prompt cannot be empty", "maximum context length", "out of vocabulary").
        ``params.max_tokens`` is the request's own limit (``limit_param`` names its field), checked
        before any cap lowers it (``with_model_defaults``), as vLLM's renderer checks it before
        ``get_max_tokens``: a limit that does not fit is a 400 even where the cap would fit."""
        limit, max_tokens = self.engine.max_model_len, params.max_tokens
        if max_tokens is not None and max_tokens > limit:  # vLLM's TokenizeParams.__post_init__
            raise bad_request(f"{limit_param}={max_tokens} cannot be greater than max_model_len={limit}. "
                              "Please request fewer output tokens.", param=limit_param,
                              code="context_length_exceeded")
        prompt.token_ids = params.truncate_prompt(prompt.token_ids, limit)
        length = len(prompt.token_ids)
        if not length:
            raise bad_request("Prompt cannot be empty.", param=param)
        if length >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your "
                              f"request has {length} input tokens (prompts must be shorter than "
                              "max_model_len). Please reduce the length of the input.", param=param,
                              code="context_length_exceeded")
        vocab = self.engine.info.hf_config.vocab_size
        bad = next((t for t in prompt.token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise bad_request(f"Token id {quoted(bad)} is out of vocabulary (ids must be in [0, {vocab})).",
                              param=param)
        if max_tokens is not None and length + max_tokens > limit:  # vLLM's TokenizeParams._token_len_check
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {length} input tokens, for a total "
                f"of {length + max_tokens} tokens. Please reduce the length of the input prompt or the "
                "number of requested output tokens.", param=param, code="context_length_exceeded")

    # ---- running requests -----------------------------------------------------------------
    def add_requests(self, prompts: Sequence[EncodedPrompt], params: Sequence[SamplingParams],
                     request_id: str, stream: bool, model: str | None = None,
                     priority: int = 0) -> list[RequestStream]:
        """One engine request per prompt, with that prompt's ``params`` (ids ``request_id-i`` when
        there are several), under the LoRA adapter ``model`` names, if it names one (a 404 if it was
        unloaded since the request's checks), at ``priority``; a 503 when the waiting queue cannot
        take them. The queue is checked here, with no await before the requests are tracked, so
        requests that passed their checks together (a grammar compiling) cannot all take its last
        place."""
        n = params[0].n  # the prompts' params differ only in max_tokens
        self.admission.check(len(prompts) * n)
        lora_request = self.models.lora_request(model)
        arrival = time.time()
        streams: list[RequestStream] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                prompt = {"prompt_token_ids": p.token_ids, "prompt": p.text}
                streams.append(self.engine.add_request(prompt, sp, request_id=rid, arrival_time=arrival,
                                                       stream=stream, lora_request=lora_request,
                                                       priority=priority))
        except (ValueError, EngineDeadError, EngineAsleepError) as e:
            for s in streams:
                s.abort()
            if isinstance(e, EngineDeadError):
                raise engine_dead(str(e)) from None
            if isinstance(e, EngineAsleepError):  # sleep mode: the client may retry once it is woken
                raise unavailable(str(e), "engine_asleep") from None
            raise bad_request(str(e), param=param_of(e)) from None
        self.admission.track(streams, n)
        return streams

    async def collect(self, streams: list[RequestStream], disconnected: asyncio.Future | None
                      ) -> list[RequestOutput]:
        """Final outputs of all streams; aborts them all if the client goes away or one fails."""
        task = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
        try:
            if disconnected is not None:
                await asyncio.wait([task, disconnected], return_when=asyncio.FIRST_COMPLETED)
                if not task.done():
                    raise ClientGone()
            outputs = await task
            for out in outputs:
                self.admission.check_not_cut(out)
            return outputs
        except EngineDeadError as e:
            raise engine_dead(str(e)) from None
        except EngineAsleepError as e:  # sleep mode: the client may retry once it is woken
            raise unavailable(str(e), "engine_asleep") from None
        except ValueError as e:  # bad input the engine thread found
            raise bad_request(str(e), param=param_of(e)) from None
        except (APIError, ClientGone, asyncio.CancelledError):
            raise
        except Exception as e:
            logger.exception("request failed")
            raise APIError(500, f"the request failed: {e}", "server_error") from None
        finally:
            if not task.done():
                task.cancel()  # the gather then ends with a CancelledError nobody awaits: retrieve it
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            for s in streams:
                s.abort()


def token_string(token_id: int, decoded: str | None, as_ids: bool) -> str:
    """A logprobs entry's token: its text, or with vLLM's ``return_tokens_as_token_ids``
    ``token_id:{id}`` (so tokens that decode alike, or to no whole character, stay apart)."""
    return f"token_id:{token_id}" if as_ids else decoded or ""


def json_logprob(value: float) -> float:
    """A logprob as vLLM's server writes it: minus infinity (a token top-k, top-p or min-p dropped,
    under ``logprobs_mode="processed_logprobs"``) as -9999.0, which JSON can hold."""
    return max(value, -9999.0)


def prompt_logprobs_body(positions: Sequence[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    """An engine output's prompt logprobs as vLLM returns them (minus infinity as -9999.0)."""
    if positions is None:
        return None
    return [None if pos is None else
            {tid: LogprobEntry(logprob=json_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for tid, lp in pos.items()}
            for pos in positions]


def usage_info(prompts: Sequence[EncodedPrompt], outputs: Sequence[RequestOutput | None]) -> UsageInfo:
    """Token counts of a request's prompts and the completions generated so far."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cached else None)


# ---- streaming ----------------------------------------------------------------------------------
class StreamedChoice:
    """What one choice has sent so far (the engine's outputs hold back the text a stop string may
    still claim, so what they show is final)."""

    __slots__ = ("done", "sent_text", "sent_tokens", "started")

    def __init__(self):
        self.sent_text = 0
        self.sent_tokens = 0
        self.started = False
        self.done = False

    def take(self, c: CompletionOutput):
        """(text delta, new token ids, their logprobs, finish_reason), or None when nothing is new."""
        if self.done:
            return None
        finished = c.finish_reason is not None
        delta = c.text[self.sent_text:]
        self.sent_text = max(self.sent_text, len(c.text))
        new_ids = c.token_ids[self.sent_tokens:]
        new_lps = c.logprobs[self.sent_tokens:] if c.logprobs is not None else None
        self.sent_tokens = len(c.token_ids)
        if not delta and not new_ids and not finished:
            return None
        self.done = finished
        return delta, new_ids, new_lps, c.finish_reason


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several request streams as they come: (stream index, output). Leaving early
    aborts them all."""
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


def choice_usage(prompt: EncodedPrompt, state: StreamedChoice) -> UsageInfo:
    """vLLM's continuous usage on a chunk: the choice's prompt and the tokens it has sent so far."""
    prompt_tokens = len(prompt.token_ids)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=state.sent_tokens,
                     total_tokens=prompt_tokens + state.sent_tokens)


def _sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def sse_events(chunk_lists: AsyncIterator[list[BaseModel]], description: str) -> AsyncIterator[str]:
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
        yield _sse(_error_event(e))
    yield "data: [DONE]\n\n"


def _error_event(e: Exception) -> ErrorResponse:
    if isinstance(e, APIError):
        return e.response()
    if isinstance(e, ValueError):
        return bad_request(str(e), param=param_of(e)).response()
    return ErrorResponse(error=ErrorInfo(message=f"the request failed: {e}", type="server_error",
                                         code="engine_dead" if isinstance(e, EngineDeadError) else None))
