"""An OpenAI-compatible HTTP server over ``AsyncEngine`` (FastAPI + uvicorn).

Endpoints: ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /version``, ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /tokenize``, ``POST /detokenize``;
with runtime LoRA updating (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, see ``serving_models``) also
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.
Requests join the running batch as they arrive (online continuous batching) and stream token by
token with ``"stream": true``. Errors use OpenAI's body, ``{"error": {"message", "type", "param",
"code"}}``: 400 for bad parameters, malformed JSON and prompts longer than the model allows, 401
for a missing or wrong API key, 404 for an unknown model, 413 for a body over the limit, 503 (with
``Retry-After``) while the waiting queue is full; any other failure is a 500 with the same body,
and the keep-alive connection stays usable. A failed request fails alone and the server keeps
serving. A client that goes
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
import math
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedlab import __version__
from pagedlab.engine.async_engine import AsyncEngine
from pagedlab.lora.request import LoRARequest
from pagedlab.server.dev_routes import DEV_MODE_ENV, dev_router
from pagedlab.server.errors import APIError, ErrorInfo, ErrorResponse, bad_request
from pagedlab.server.metrics import ServerMetrics
from pagedlab.server.protocol import (MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest, ModelCard,
                                      ModelList, parse_request)
from pagedlab.server.serving_chat import OpenAIServingChat
from pagedlab.server.serving_completion import OpenAIServingCompletion
from pagedlab.server.serving_engine import Admission, ClientGone, EventStream, ServerLimits
from pagedlab.server.serving_models import (RUNTIME_LORA_ENV, LoadLoRAAdapterRequest, OpenAIServingModels,
                                            UnloadLoRAAdapterRequest, env_flag, runtime_lora_updating_allowed)
from pagedlab.server.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

router = APIRouter()


def build_app(engine: AsyncEngine, served_model_names: Sequence[str] | None = None,
              api_key: str | None = None, chat_template: str | None = None,
              metrics: ServerMetrics | None = None, enable_metrics: bool = True,
              shutdown_engine: bool = False, limits: ServerLimits | None = None,
              lora_modules: Sequence[LoRARequest] = (),
              allow_runtime_lora_updating: bool | None = None, tool_calling: dict | None = None,
              dev_mode: bool | None = None, return_tokens_as_token_ids: bool = False,
              response_role: str = "assistant") -> FastAPI:
    """The FastAPI app serving ``engine`` under ``served_model_names`` (default: the model as it
    was asked for), and each LoRA adapter of ``lora_modules`` under its own name. ``api_key``
    guards ``/v1``; ``metrics`` is a ``ServerMetrics`` (made here when ``enable_metrics``);
    ``shutdown_engine`` stops the engine thread when the app shuts down;
    ``limits`` bound requests, the waiting queue and bodies (default ``ServerLimits()``);
    ``allow_runtime_lora_updating`` adds the routes loading and unloading adapters (default:
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, as vLLM); ``tool_calling`` holds ``OpenAIServingChat``'s
    tool and reasoning keywords (``tool_call_parser``, ``enable_auto_tool_choice``,
    ``exclude_tools_when_tool_choice_none``, ``reasoning_parser``); ``dev_mode`` adds vLLM's dev
    routes, sleep mode and ``/reset_prefix_cache`` (default: ``VLLM_SERVER_DEV_MODE``);
    ``return_tokens_as_token_ids`` names logprobs tokens "token_id:{id}" for every request that
    leaves the field of that name unset (vLLM's ``--return-tokens-as-token-ids``);
    ``response_role`` is the role of a chat reply to a request with ``add_generation_prompt``
    (vLLM's ``--response-role``)."""
    names = list(served_model_names or [engine.model_name])
    if metrics is None and enable_metrics:
        metrics = ServerMetrics(model_name=names[0])
    if metrics is not None:
        metrics.count_from(engine.get_stats())
        engine.add_listener(metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="pagedlab OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.models = models = OpenAIServingModels(engine, names, lora_modules)
    app.state.created = int(time.time())
    max_logprobs = engine.info.config.max_logprobs  # the engine's cap; vLLM's default where none is set
    app.state.request_context = {"max_logprobs": MAX_LOGPROBS if max_logprobs is None else max_logprobs}
    app.state.admission = admission = Admission(engine, limits or ServerLimits())
    as_ids = return_tokens_as_token_ids
    app.state.serving_completion = OpenAIServingCompletion(engine, names, admission, models,
                                                           return_tokens_as_token_ids=as_ids)
    app.state.serving_chat = OpenAIServingChat(engine, names, chat_template, admission, models,
                                               return_tokens_as_token_ids=as_ids, response_role=response_role,
                                               **(tool_calling or {}))
    app.state.serving_tokenization = OpenAIServingTokenization(engine, names, chat_template, admission,
                                                               models)
    app.add_middleware(CatchAllMiddleware)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(router)
    _include_optional_routes(app, allow_runtime_lora_updating, dev_mode)
    return app


def _include_optional_routes(app: FastAPI, allow_runtime_lora_updating: bool | None,
                             dev_mode: bool | None) -> None:
    """The adapter-loading routes and vLLM's dev routes, each when asked for (``None``: as its
    environment variable says)."""
    if allow_runtime_lora_updating is None:
        allow_runtime_lora_updating = runtime_lora_updating_allowed()
    if allow_runtime_lora_updating:
        logger.warning("LoRA adapters can be loaded and unloaded at runtime (%s): only for local development",
                       RUNTIME_LORA_ENV)
        app.include_router(lora_router)
    if dev_mode if dev_mode is not None else env_flag(DEV_MODE_ENV):
        logger.warning("development routes on (%s): /sleep, /wake_up, /is_sleeping, /reset_prefix_cache",
                       DEV_MODE_ENV)
        app.include_router(dev_router)


# ---- errors -------------------------------------------------------------------------------------
def json_response(body: BaseModel, status_code: int = 200) -> Response:
    """``body`` serialized by pydantic (one pass, no intermediate dict)."""
    return Response(body.model_dump_json(), status_code=status_code, media_type="application/json")


async def _api_error(request: Request, e: APIError) -> Response:
    response = json_response(e.response(), e.status)
    response.headers.update(e.headers)
    return response


async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    error = ErrorInfo(message=str(e.detail), type=kind, code=e.status_code)
    return json_response(ErrorResponse(error=error), e.status_code)


class CatchAllMiddleware:
    """Every failure ends in a complete response: an exception no handler took becomes OpenAI's
    500 body (or, if the response had started, its clean end), and is not raised on to the
    server, which would drop the keep-alive connection under the client's next request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as e:
            logger.exception("unhandled error on %s", scope.get("path"))
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            error = ErrorInfo(message=f"internal server error: {type(e).__name__}: {e}", type="server_error",
                              code="internal_error")
            await json_response(ErrorResponse(error=error), 500)(scope, receive, send)


class APIKeyMiddleware:
    """Answers 401 to a ``/v1`` request without ``Authorization: Bearer <api_key>``; health,
    metrics and version stay open. Checked before the body is read."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            error = APIError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                             "invalid_request_error", None, "invalid_api_key")
            await json_response(error.response(), error.status)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        scheme, _, token = (Headers(scope=scope).get("authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)


# ---- endpoints ----------------------------------------------------------------------------------
@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 while the engine thread runs, else 503."""
    if not raw_request.app.state.engine.is_running:
        error = ErrorInfo(message="the engine is not running", type="server_error", code="engine_dead")
        return json_response(ErrorResponse(error=error), 503)
    return Response(status_code=200)


@router.get("/ping")
async def ping(raw_request: Request) -> Response:
    """The same as ``/health``."""
    return await health(raw_request)


@router.get("/version")
async def version() -> dict:
    """pagedlab's version."""
    return {"version": __version__}


@router.get("/metrics")
async def prometheus_metrics(raw_request: Request) -> Response:
    """The Prometheus text exposition of the server's metrics."""
    metrics = raw_request.app.state.metrics
    if metrics is None:
        raise APIError(404, "metrics are disabled on this server", code="not_found")
    data, content_type = metrics.render()
    return Response(data, media_type=content_type)


@router.get("/v1/models")
async def list_models(raw_request: Request) -> Response:
    """The served model names, each with the model's root, max_model_len and vocabulary size,
    then the LoRA adapters (root: the adapter's directory, parent: its ``base_model_name``, else
    the base model's name)."""
    state = raw_request.app.state
    info = state.engine.info
    common = dict(created=state.created, max_model_len=info.max_model_len,
                  vocab_size=int(info.hf_config.vocab_size))
    names = state.models.served_model_names
    base = [ModelCard(id=name, root=str(info.model_path), **common) for name in names]
    adapters = [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or names[0],
                          **common)
                for lora in state.models.lora_requests.values()]
    return json_response(ModelList(data=base + adapters))


@router.post("/v1/completions")
async def create_completion(raw_request: Request) -> Response:
    """OpenAI's text completions (``CompletionRequest``)."""
    serving: OpenAIServingCompletion = raw_request.app.state.serving_completion
    request = parse_request(CompletionRequest, await _json_body(raw_request),
                            raw_request.app.state.request_context)
    return await _respond(raw_request, lambda disconnected: serving.create_completion(request, disconnected))


@router.post("/v1/chat/completions")
async def create_chat_completion(raw_request: Request) -> Response:
    """OpenAI's chat completions (``ChatCompletionRequest``)."""
    serving: OpenAIServingChat = raw_request.app.state.serving_chat
    request = parse_request(ChatCompletionRequest, await _json_body(raw_request),
                            raw_request.app.state.request_context)
    return await _respond(raw_request,
                          lambda disconnected: serving.create_chat_completion(request, disconnected))


lora_router = APIRouter()  # included only with runtime LoRA updating


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(raw_request: Request) -> Response:
    """vLLM's runtime adapter loading: ``{"lora_name", "lora_path"}``."""
    request = parse_request(LoadLoRAAdapterRequest, await _json_body(raw_request))
    return Response(await raw_request.app.state.models.load_lora_adapter(request), media_type="text/plain")


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(raw_request: Request) -> Response:
    """vLLM's runtime adapter unloading: ``{"lora_name"}``."""
    request = parse_request(UnloadLoRAAdapterRequest, await _json_body(raw_request))
    return Response(await raw_request.app.state.models.unload_lora_adapter(request), media_type="text/plain")


# a \uD800-\uDFFF escape, or its UTF-8 form (which json.loads lets through too)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


@router.post("/tokenize")
async def tokenize(raw_request: Request) -> Response:
    """vLLM's tokenizer endpoint: ``prompt`` or ``messages`` to the token ids the model would see."""
    return json_response(raw_request.app.state.serving_tokenization.tokenize(await _json_body(raw_request)))


@router.post("/detokenize")
async def detokenize(raw_request: Request) -> Response:
    """vLLM's detokenizer endpoint: ``tokens`` to text."""
    return json_response(raw_request.app.state.serving_tokenization.detokenize(await _json_body(raw_request)))


async def _json_body(raw_request: Request) -> dict:
    """The body as a JSON object, whatever the content type says: 413 beyond the size limit, 400
    for anything that is not plain JSON (NaN, numbers beyond floats, nesting too deep for the
    parser, strings with lone UTF-16 surrogates that no tokenizer can take)."""
    raw = await _read_body(raw_request, raw_request.app.state.admission.limits.max_request_body_bytes)
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, huge ints, ours
        reason = "it nests too deeply" if isinstance(e, RecursionError) else str(e)
        raise bad_request(f"We could not parse the JSON body of your request ({reason}). The body must be a "
                          "JSON object.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The body of your request must be a JSON object.", code="invalid_json")
    if _SURROGATE.search(raw):  # a valid pair decodes to one character; a lone half stays
        where = _lone_surrogate(body)
        if where is not None:
            raise bad_request(f"'{where}' holds a lone UTF-16 surrogate, which is not valid Unicode text.",
                              param=where, code="invalid_unicode")
    return body


async def _read_body(raw_request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it (or its Content-Length) passes ``limit`` bytes."""
    too_large = APIError(413, f"The request body is larger than the {limit} bytes this server takes.",
                         code="request_too_large")
    declared = raw_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in raw_request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _lone_surrogate(body: dict) -> str | None:
    """The param name of the first string (key or value) holding a lone surrogate, if any."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if any(0xD800 <= ord(ch) <= 0xDFFF for ch in value):
                return path or "body"
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else k, v) for k, v in value.items())
            stack.extend((path or "body", k) for k in value)
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


async def _respond(raw_request: Request,
                   handle: Callable[[asyncio.Future], Awaitable[BaseModel | EventStream]]) -> Response:
    """Run ``handle`` while watching for the client going away; a stream owns the watch from there."""
    disconnected = asyncio.ensure_future(_disconnect(raw_request))
    try:
        result = await handle(disconnected)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    except BaseException:
        disconnected.cancel()
        raise
    if isinstance(result, EventStream):
        return StreamingResponse(_until_disconnect(result.events, disconnected),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    disconnected.cancel()
    return json_response(result)


async def _disconnect(raw_request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so nothing else arrives)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(events: AsyncIterator[str], disconnected: asyncio.Future) -> AsyncIterator[str]:
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
            if step is not None and not step.cancelled():
                step.exception()  # it ended as the client left: its outcome is seen, not logged as lost
            await iterator.aclose()


# ---- running ------------------------------------------------------------------------------------
class GracefulServer(uvicorn.Server):
    """uvicorn's server with a graceful first SIGTERM/SIGINT: the app stops admitting (503), its
    running requests get ``shutdown_timeout_s`` to finish, the rest are aborted with a
    ``shutting_down`` error, then the server exits. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float = 30.0):
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """Begin the drain (thread-safe: tests call it from another thread)."""
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.config.app.state.admission.drain(self.shutdown_timeout_s)
            await asyncio.sleep(0.05)  # the aborted requests' error events go out
        finally:
            self.should_exit = True


class ServerThread:
    """Run an app under uvicorn in a background thread (tests, notebooks, benchmarks).

        with ServerThread(app) as srv:      # port 0: a free port on 127.0.0.1
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 shutdown_timeout_s: float = 30.0):
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
        self.server = GracefulServer(config, shutdown_timeout_s)
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
               chat_template: str | None = None, log_level: str = "info",
               enable_metrics: bool = True, limits: ServerLimits | None = None,
               shutdown_timeout_s: float = 30.0, lora_modules: Sequence[LoRARequest] = (),
               tool_calling: dict | None = None, return_tokens_as_token_ids: bool = False,
               response_role: str = "assistant") -> None:
    """Serve until SIGTERM or Ctrl-C (``GracefulServer``); the engine thread stops with the server."""
    app = build_app(engine, served_model_names, api_key, chat_template, enable_metrics=enable_metrics,
                    shutdown_engine=True, limits=limits, lora_modules=lora_modules, tool_calling=tool_calling,
                    return_tokens_as_token_ids=return_tokens_as_token_ids, response_role=response_role)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    GracefulServer(config, shutdown_timeout_s).run()
