"""vLLM's development endpoints, served with ``VLLM_SERVER_DEV_MODE=1`` (as vLLM serves them): sleep
mode (``POST /sleep?level=1``, ``POST /wake_up?tags=weights``, ``GET /is_sleeping``) and
``POST /reset_prefix_cache``, for an RL loop that drives a server between its training steps.
They are not guarded beyond the API key: turn them on only where the clients are trusted."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from pagedlab.engine.async_engine import EngineDeadError
from pagedlab.engine.sleep_mode import SleepStateError
from pagedlab.server.errors import APIError, bad_request, engine_dead

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"

dev_router = APIRouter()


async def _in_engine(raw_request: Request, call) -> None:
    """``call`` on the AsyncEngine: a ValueError (a bad level or tag) is a 400, a refusal of the
    engine's state (requests unfinished, the weights asleep) a 409 saying what to do first, a
    stopped engine a 503; anything else (out of memory) the server's 500."""
    try:
        await call(raw_request.app.state.engine)
    except ValueError as e:
        raise bad_request(str(e)) from None
    except SleepStateError as e:
        raise APIError(409, str(e), "invalid_request_error") from None
    except EngineDeadError as e:
        raise engine_dead(str(e)) from None


@dev_router.post("/sleep")
async def sleep(raw_request: Request, level: str = "1") -> Response:
    """``LLM.sleep(level)``: the GPU memory of the KV cache and the weights back to the driver."""
    number = int(level) if level.isascii() and level.isdigit() else level  # anything else: the 400 names it
    await _in_engine(raw_request, lambda engine: engine.sleep(number))
    return Response(status_code=200)


@dev_router.post("/wake_up")
async def wake_up(raw_request: Request, tags: Annotated[list[str] | None, Query()] = None) -> Response:
    """``LLM.wake_up(tags)``; ``?tags=weights&tags=kv_cache`` (none given: both)."""
    await _in_engine(raw_request, lambda engine: engine.wake_up(tags))
    return Response(status_code=200)


@dev_router.get("/is_sleeping")
async def is_sleeping(raw_request: Request) -> dict:
    """``{"is_sleeping": bool}``: whether any part of the engine sleeps."""
    return {"is_sleeping": await raw_request.app.state.engine.is_sleeping()}


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw_request: Request) -> Response:
    """``LLM.reset_prefix_cache()``, between two steps."""
    await raw_request.app.state.engine.reset_prefix_cache()
    return Response(status_code=200)
