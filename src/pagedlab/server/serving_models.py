"""The models a server serves (vLLM's ``OpenAIServingModels``): the base model under its served
names, and LoRA adapters under theirs, from ``--lora-modules`` and, where runtime LoRA updating
is allowed, loaded and unloaded while it runs.

Runtime updating is vLLM's: with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set to ``1``/``true``,
``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` reads an adapter and serves it under
its name, and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` stops serving it; without it the
routes do not exist (404). Their answers are vLLM's: 200 with a ``Success: ...`` text, else its
error body with vLLM's types and messages (a name already loaded: 400; an unknown name or an
adapter directory that does not exist: 404; an adapter pagedlab cannot serve: 400).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from pagedlab.engine.async_engine import AsyncEngine
from pagedlab.lora.request import LoRARequest
from pagedlab.server.errors import APIError
from pagedlab.server.protocol import OpenAIRequest

logger = logging.getLogger(__name__)

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def env_flag(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the switch ``name`` is on, read as vLLM reads its own (``1`` or ``true``)."""
    return environ.get(name, "0").strip().lower() in ("1", "true")


def runtime_lora_updating_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is on."""
    return env_flag(RUNTIME_LORA_ENV, environ)


class LoadLoRAAdapterRequest(OpenAIRequest):
    """``/v1/load_lora_adapter``: serve the PEFT adapter in ``lora_path`` under ``lora_name``."""

    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(OpenAIRequest):
    """``/v1/unload_lora_adapter``: stop serving the adapter ``lora_name``."""

    lora_name: str = ""


def _error(status: int, message: str, kind: str) -> APIError:
    """vLLM's error body for these routes: its error type, and the status as the code."""
    return APIError(status, message, kind, None, status)


class OpenAIServingModels:
    """The base model's ``served_model_names`` and the LoRA adapters served by name, shared by
    every endpoint of one app; ``lora_modules`` are the adapters served from the start."""

    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str],
                 lora_modules: Sequence[LoRARequest] = ()):
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.lora_requests: dict[str, LoRARequest] = {lora.lora_name: lora for lora in lora_modules}
        # ids are never reused: the engine keys cached weights and KV blocks by them
        self._next_id = max((lora.lora_int_id for lora in lora_modules), default=0) + 1
        self._lock = asyncio.Lock()  # a check and the change it guards, with awaits between

    def check_model(self, model: str | None) -> str:
        """The served name the response carries; 404 for a model this server does not serve."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names and model not in self.lora_requests:
            served = [*self.served_model_names, *self.lora_requests]
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                                f"{', '.join(repr(n) for n in served)}.",
                           "invalid_request_error", "model", "model_not_found")
        return model

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None for the base model); 404 if it is served no more."""
        return self.lora_requests.get(self.check_model(model)) if model is not None else None

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        """Read the adapter (on the engine thread, into its CPU cache) and serve it."""
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        async with self._lock:
            if name in self.lora_requests:
                raise _error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
            if name in self.served_model_names:
                raise _error(400, f"The lora adapter '{name}' cannot be loaded: it is the name of the base "
                                  "model.", "InvalidUserInput")
            if not Path(path).expanduser().exists():
                raise _error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
            lora = LoRARequest(name, self._next_id, path)
            try:
                await self.engine.run_in_engine(lambda llm_engine: llm_engine.validate_lora_request(lora))
            except ValueError as e:
                raise _error(400, str(e), "BadRequestError") from None
            self._next_id += 1
            self.lora_requests[name] = lora
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """Stop serving the adapter and drop the engine's copies of it. Requests already running
        on it finish with it: the engine reads it again from its directory where they need it."""
        name = request.lora_name
        if not name:
            raise _error(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                         "InvalidUserInput")
        async with self._lock:
            lora = self.lora_requests.pop(name, None)
            if lora is None:
                raise _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            await self.engine.run_in_engine(lambda llm_engine: llm_engine.remove_lora(lora.lora_int_id))
        logger.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
