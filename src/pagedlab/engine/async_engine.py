"""``AsyncEngine``: online continuous batching over one ``LLMEngine``.

The engine core is not thread-safe, so one background thread owns it: it takes commands (add,
abort, call) from a thread-safe queue between steps, runs ``step()`` while any request is
unfinished, and hands each request's cumulative output to that request's asyncio queue. Requests
join the running batch at the next step; an abort frees the request's KV blocks at once.

    engine = AsyncEngine.from_engine_config(EngineConfig(model="smollm2-135m-instruct"))
    async for out in engine.generate("Why is the sky blue?", SamplingParams(max_tokens=64)):
        print(out.outputs[0].text)          # grows token by token
    engine.shutdown()

The offline ``LLM`` and the server share the engine core: ``AsyncEngine.from_llm(llm)`` wraps
``llm.llm_engine`` (while the AsyncEngine runs, drive that engine only through it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from pagedlab.config import EngineConfig, EngineInfo
from pagedlab.engine.engine import LLMEngine
from pagedlab.engine.thinking_budget import check_thinking_budget
from pagedlab.inputs import PromptType, encode_prompt
from pagedlab.lora.request import LoRARequest
from pagedlab.outputs import EngineStats, RequestOutput
from pagedlab.sampling_params import (RequestOutputKind, SamplingParams, check_sampling_params,
                                      generation_config_cap)

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long the idle loop blocks on the command queue before checking for shutdown
_STATS_INTERVAL_S = 0.05  # stats are refreshed at least this often while busy (and at every add/abort/finish)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or failed outside any one request)."""


class StatsListener(Protocol):
    """Receives engine figures from the engine thread (the server's Prometheus metrics do)."""

    def on_stats(self, stats: EngineStats) -> None:
        """After every step and command batch: the engine's current stats."""

    def on_request_finished(self, output: RequestOutput) -> None:
        """Once per request, with its final output (finish_reason stop, length, repetition or abort)."""


class _Stream:
    """The per-request channel from the engine thread to the asyncio task consuming it."""

    __slots__ = ("deltas", "ended", "loop", "queue", "request_id", "tokens")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, tokens: bool = True,
                 deltas: bool = False):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tokens = tokens  # wants every step's output, not just the final one
        self.deltas = deltas  # outputs are RequestOutputKind.DELTA: merged by appending
        self.ended = False  # the engine thread is done with it (its last output may still be unread)

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Thread-safe; False when the consumer's event loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # loop closed
            return False


class RequestStream:
    """Async iterator over one request's outputs: each the cumulative ``RequestOutput``, or what
    is new since the last one (``SamplingParams.output_kind``: DELTA), or only the final one
    (FINAL_ONLY).

    Outputs the consumer has not yet read are merged (the latest cumulative one is kept; deltas
    are appended), so a slow consumer gets bigger steps rather than a growing backlog. Leaving the
    iteration early (``break``, a cancelled task, a closed HTTP connection) aborts the request and
    frees its blocks.
    """

    def __init__(self, engine: AsyncEngine, stream: _Stream):
        self._engine = engine
        self._stream = stream
        self._done = False

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def engine_finished(self) -> bool:
        """The engine has finished (or aborted) the request, though its consumer may not yet have
        read the final output: a slow streaming client may hold it for long."""
        return self._stream.ended

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        q = self._stream.queue
        try:
            item = await q.get()
            while not isinstance(item, BaseException) and not item.finished and not q.empty():
                later = q.get_nowait()
                merge = self._stream.deltas and isinstance(later, RequestOutput)
                item = item.add(later) if merge else later
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    async def result(self) -> RequestOutput:
        """Wait for the final output."""
        final = None
        async for out in self:
            final = out
        return final

    def abort(self) -> None:
        """Stop the request now (no-op once it finished)."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id, self._stream)

    async def aclose(self) -> None:
        self.abort()

    def __del__(self):
        if not self._done:
            with contextlib.suppress(Exception):
                self.abort()


class AsyncEngine:
    """Serve many concurrent requests from one engine core, streaming their outputs.

    Build it with ``AsyncEngine.from_engine_config(config)`` or ``AsyncEngine.from_llm(llm)``
    (or ``AsyncEngine(llm_engine)``). The engine thread starts at once; ``shutdown()`` stops
    it and fails every unfinished request with ``EngineDeadError``.
    """

    def __init__(self, engine: LLMEngine, *, listeners: list[StatsListener] | None = None,
                 thread_name: str = "pagedlab-engine"):
        self.engine = engine
        self.listeners: list[StatsListener] = list(listeners or [])
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # owned by the engine thread
        self._num_token_streams = 0  # of them, those that want every step's output
        self._ids = itertools.count()
        self._stats: EngineStats = engine.get_stats()
        self._running = True
        self._error: BaseException | None = None
        self._num_steps = 0
        self._stats_dirty = False
        self._stats_time = 0.0
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_engine_config(cls, config: EngineConfig, **kwargs) -> AsyncEngine:
        """Load a model (as ``LLM`` would) and serve it."""
        return cls(LLMEngine(config), **kwargs)

    @classmethod
    def from_llm(cls, llm, **kwargs) -> AsyncEngine:
        """Serve an already loaded offline ``LLM``: both share ``llm.llm_engine``. Don't call the
        ``LLM``'s own methods until ``shutdown()``: the engine core is not thread-safe."""
        return cls(llm.llm_engine, **kwargs)

    # ---- properties -----------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The model's transformers tokenizer, or None for a model without one."""
        return self.engine.tokenizer

    @property
    def grammar_compiler(self):
        """The engine's ``GrammarCompiler`` (thread-safe): compiling a request's grammar before
        ``add_request`` keeps that work off the engine thread, which then finds it cached."""
        return self.engine.grammar_compiler

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_sampling_args(self) -> dict:
        """The SamplingParams fields of a request that sets none (``EngineConfig.generation_config``)."""
        return self.engine.default_sampling_args

    @property
    def max_tokens_cap(self) -> int | None:
        """The output-token limit over every server request, its own max_tokens included: a
        generation_config directory's max_new_tokens, or override_generation_config's; None where
        max_new_tokens only stands in for a limit the request leaves out (``generation_config_cap``)."""
        config = self.engine.config
        return generation_config_cap(config.generation_config, self.default_sampling_args,
                                     config.override_generation_config)

    @property
    def model_name(self) -> str:
        """The model as it was asked for (``EngineConfig.model``)."""
        return self.engine.config.model

    @property
    def info(self) -> EngineInfo:
        """What the engine resolved its settings to and the model's identity (``LLMEngine.info``)."""
        return self.engine.info

    @property
    def is_running(self) -> bool:
        return self._running and self._thread.is_alive()

    @property
    def num_steps(self) -> int:
        return self._num_steps

    def get_stats(self) -> EngineStats:
        """The engine's stats as of its last step or command (read without blocking the engine)."""
        return self._stats

    # ---- requests -------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """ValueError unless the model can take this prompt (not empty, shorter than
        max_model_len, ids in the vocabulary). Safe from any thread: it reads only model limits."""
        self.engine.validate_prompt(prompt_token_ids)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    stream: bool = True, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> RequestStream:
        """Queue a request and return its stream. Call from a running event loop.

        Bad input (prompt too long, out-of-vocab ids, parameters the model cannot serve) raises
        ValueError here, before anything is queued; an engine asleep, ``EngineAsleepError``.
        ``stream=False`` says only the final output is wanted: while no request wants more, the
        engine skips building per-step outputs.
        ``lora_request`` runs it with that LoRA adapter (a bad adapter fails the stream);
        ``priority`` places it under ``scheduling_policy="priority"`` (lower first).
        """
        if not self.is_running:
            raise EngineDeadError(self._dead_message())
        params = SamplingParams(**self.default_sampling_args) if params is None else params
        check_sampling_params(params, "params")
        check_thinking_budget(params, self.engine.thinking_markers)
        self.engine.validate_priority(priority)
        self.engine.check_awake()  # the engine thread checks again: a sleep may come between
        encoded = encode_prompt(prompt, self.tokenizer, self.model_name)
        self.validate_prompt(params.truncate_prompt(encoded.token_ids, self.max_model_len))
        if params.detokenize and self.tokenizer is None and (params.stop or params.wants_logprobs):
            raise ValueError("stop strings and decoded logprobs need a tokenizer, and this model has none; "
                             "use stop_token_ids")
        if request_id is None:
            request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        channel = _Stream(request_id, asyncio.get_running_loop(),
                          tokens=stream and params.output_kind != RequestOutputKind.FINAL_ONLY,
                          deltas=params.output_kind == RequestOutputKind.DELTA)
        self._commands.put(("add", channel, encoded.token_ids, params, encoded.text,
                            arrival_time or time.time(), lora_request, priority))
        return RequestStream(self, channel)

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, arrival_time: float | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's output (cumulative, or as ``params.output_kind`` says) after every
        step that changed it, or with a stream interval k (the engine's ``stream_interval``, raised by
        ``params.stream_interval``) after its first token, then every k tokens; the last one has
        ``finished=True``. Closing the generator early aborts the request. A structured-output
        grammar is compiled in a worker thread first."""
        if params is not None and params.structured_outputs is not None:
            await asyncio.to_thread(self.grammar_compiler.compile, params.structured_outputs)
        stream = self.add_request(prompt, params, request_id, arrival_time, priority=priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str, stream: _Stream | None = None) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored). From ``stream`` (a
        RequestStream's own abort): only while the id is that stream's, so a stream refused for
        reusing a running request's id does not abort that request."""
        if self._running:
            self._commands.put(("abort", request_id, stream))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(llm_engine)`` in the engine thread between two steps; returns its Future.
        The way to touch the engine core safely (e.g. ``reset_prefix_cache``)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.is_running:
            future.set_exception(EngineDeadError(self._dead_message()))
        else:
            self._commands.put(("call", fn, future))
        return future

    async def run_in_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    async def reset_prefix_cache(self) -> None:
        await self.run_in_engine(lambda e: e.reset_prefix_cache())

    async def load_weights(self, weights) -> None:
        """``LLM.load_weights`` in the engine thread, between two steps (the prefix cache reset with
        it); a RuntimeError while any request is unfinished: abort them or let them finish first."""
        await self.run_in_engine(lambda e: e.load_weights(weights))

    async def sleep(self, level: int = 1) -> None:
        """``LLM.sleep`` in the engine thread (vLLM's ``AsyncLLM.sleep``): a RuntimeError while any
        request is unfinished; requests are refused until ``wake_up``."""
        await self.run_in_engine(lambda e: e.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """``LLM.wake_up`` in the engine thread."""
        await self.run_in_engine(lambda e: e.wake_up(tags))

    async def is_sleeping(self) -> bool:
        """``LLMEngine.is_sleeping()``, read in the engine thread."""
        return await self.run_in_engine(lambda e: e.is_sleeping())

    def add_listener(self, listener: StatsListener) -> None:
        self.listeners.append(listener)

    # ---- lifecycle ------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; unfinished requests are aborted and their streams fail."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)
        self._running = False

    def close(self) -> None:
        """Shut down and free the engine's weights and KV cache."""
        self.shutdown()
        self.engine.close()

    def __enter__(self) -> AsyncEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _dead_message(self) -> str:
        if self._error is not None:
            return f"the engine thread stopped after an error: {self._error!r}"
        return "the engine has been shut down"

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                if not self._drain_commands(block=not self.engine.has_unfinished_requests()):
                    break
                busy = self.engine.has_unfinished_requests()
                if busy:
                    self._step()
                if (self._stats_dirty or not busy
                        or time.monotonic() - self._stats_time >= _STATS_INTERVAL_S):
                    self._publish_stats()
        except BaseException as e:  # a bug outside any request: fail everything, loudly
            logger.exception("the engine thread failed")
            self._error = e
        finally:
            self._running = False
            self._fail_all(EngineDeadError(self._dead_message()))
            self._drain_after_stop()

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        self._stats_dirty = True
        while True:
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._do_add(*cmd[1:])
            elif kind == "abort":
                self._do_abort(cmd[1], cmd[2])
            elif kind == "call":
                fn, future = cmd[1], cmd[2]
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except BaseException as e:
                        future.set_exception(e)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _do_add(self, stream: _Stream, token_ids, params, text, arrival_time, lora_request, priority) -> None:
        if stream.request_id in self._streams:
            stream.put(ValueError(f"request_id {stream.request_id!r} is already in use"))
            return
        try:
            self.engine.add_request(stream.request_id, token_ids, params, prompt=text,
                                    arrival_time=arrival_time, lora_request=lora_request, priority=priority)
        except Exception as e:  # ValueError for bad input; the engine is unchanged
            stream.put(e)
            return
        self._streams[stream.request_id] = stream
        self._num_token_streams += stream.tokens

    def _remove(self, request_id: str) -> _Stream | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._num_token_streams -= stream.tokens
            stream.ended = True
        return stream

    def _do_abort(self, request_id: str, owner: _Stream | None = None) -> None:
        if owner is not None and self._streams.get(request_id) is not owner:
            return
        stream = self._remove(request_id)
        if stream is None:
            return
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._publish_stats()
            self._notify_finished(out)
            stream.put(out)

    def _step(self) -> None:
        try:
            outputs = self.engine.step(stream=self._num_token_streams > 0)
        except Exception as e:
            # A failure inside the forward pass cannot be pinned on one request: fail the ones in
            # flight (freeing their blocks) and keep serving the next ones.
            logger.exception("engine step failed; aborting the %d requests in flight", len(self._streams))
            error = RuntimeError(f"the engine step failed: {e!r}")
            for request_id in list(self._streams):
                stream = self._remove(request_id)
                try:
                    out = self.engine.abort_request(request_id)
                except Exception:
                    logger.exception("could not abort %s", request_id)
                else:
                    if out is not None:  # listeners count it once, as aborted
                        self._notify_finished(out)
                stream.put(error)
            return
        self._num_steps += 1
        streams = [self._streams.get(out.request_id) for out in outputs]
        if any(out.finished for out in outputs):
            for out in outputs:  # ended before the stats stop counting them as running
                if out.finished:
                    self._remove(out.request_id)
            self._publish_stats()  # so a caller who sees its request finish also sees its blocks freed
        for out, stream in zip(outputs, streams):
            if stream is None:  # a request someone else added to the shared engine
                continue
            if out.finished:
                self._notify_finished(out)
            if not stream.put(out) and not out.finished:  # its event loop is gone
                self._do_abort(out.request_id)

    def _publish_stats(self) -> None:
        if self.engine.scheduler is None:  # closed
            return
        self._stats = stats = self.engine.get_stats()
        self._stats_dirty, self._stats_time = False, time.monotonic()
        self._call_listeners("on_stats", stats)

    def _notify_finished(self, out: RequestOutput) -> None:
        self._call_listeners("on_request_finished", out)

    def _call_listeners(self, method: str, value) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, method)(value)
            except Exception:
                logger.exception("stats listener %r failed", listener)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
            stream.put(error)
        self._streams.clear()
        self._num_token_streams = 0
        with contextlib.suppress(Exception):
            self._publish_stats()

    def _drain_after_stop(self) -> None:
        """Answer commands that raced with the stop."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                cmd[1].put(EngineDeadError(self._dead_message()))
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(EngineDeadError(self._dead_message()))
