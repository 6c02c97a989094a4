"""Sleep mode (vLLM's ``LLM.sleep`` / ``wake_up``): give the GPU memory of an idle engine back, for
a trainer in the same process or another one (RLHF loops), without rebuilding the engine.

The engine frees its KV cache and CUDA graphs (``ModelRunner.free_kv_cache``) and puts its weights'
device storages here: each storage is emptied in place (``UntypedStorage.resize_(0)``), so every
parameter, buffer and view keeps its tensor object, and waking refills the same storages (at new
addresses, which is why the graphs are captured again when the KV cache wakes). Level 1 keeps each
storage's bytes in host memory (pageable: pinning them first would cost about what it saves on one
copy each way); level 2 drops them, and the weights must be loaded again (``LLM.load_weights``)
after they wake.
"""

from __future__ import annotations

import torch

SLEEP_LEVELS = (1, 2)
WAKE_UP_TAGS = ("weights", "kv_cache")


class EngineAsleepError(RuntimeError):
    """A request for an engine that is asleep, or whose weights ``sleep(level=2)`` dropped and no
    ``load_weights`` has filled yet (the server answers it with a 503)."""


class SleepStateError(RuntimeError):
    """A sleep-mode call the engine's state refuses (requests unfinished, the weights asleep): the
    caller must do something first, which the message names (the server answers it with a 409)."""


def model_storages(model: torch.nn.Module, device: torch.device) -> list[tuple[torch.UntypedStorage, bool]]:
    """Every distinct, non-empty storage on ``device`` behind the model's parameters, buffers and
    tensor attributes (weights prepared at load, such as repacked or folded ones, are attributes),
    each with whether a parameter lies in it."""
    storages: dict[int, torch.UntypedStorage] = {}
    of_parameters: set[int] = set()
    for module in model.modules():
        others = (*module._buffers.values(), *vars(module).values())
        for tensor, is_parameter in [*((t, True) for t in module._parameters.values()),
                                     *((t, False) for t in others if isinstance(t, torch.Tensor))]:
            if tensor is None or tensor.device != device or not tensor.untyped_storage().nbytes():
                continue
            storage = tensor.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
            if is_parameter:
                of_parameters.add(storage.data_ptr())
    return [(storage, address in of_parameters) for address, storage in storages.items()]


class SleepingWeights:
    """A model's device storages while the engine sleeps: emptied on the device, their bytes kept
    on the host, the parameters' too with ``keep_parameters`` (level 1); level 2 drops the
    parameters' and keeps the rest (rotary tables and other buffers no checkpoint holds, as vLLM)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, keep_parameters: bool):
        self.device = device
        self.kept = keep_parameters
        found = model_storages(model, device)
        fixed = next((storage for storage, _ in found if not storage.resizable()), None)
        if fixed is not None:  # checked before anything is copied or freed, so a refusal changes nothing
            raise ValueError(f"a weight storage of {fixed.nbytes()} bytes cannot be freed in place (it is "
                             "not resizable: memory-mapped or borrowed), so this engine cannot sleep")
        self.storages = [(storage, storage.nbytes()) for storage, _ in found]
        # a CPU storage's .cpu() is itself: a CPU engine (the tests) keeps a clone
        self.host = [None if is_parameter and not keep_parameters
                     else storage.clone() if device.type == "cpu" else storage.cpu()
                     for storage, is_parameter in found]
        for storage, _ in self.storages:
            storage.resize_(0)
        _return_freed_memory(device)

    def wake_up(self) -> None:
        """Every storage back on the device at its size, with its bytes where they were kept."""
        for (storage, nbytes), host in zip(self.storages, self.host, strict=True):
            storage.resize_(nbytes)
            if host is not None:
                storage.copy_(host)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.host = []


class RankSleep:
    """One rank's part of sleep mode: its KV cache and graphs freed, its weights asleep."""

    def __init__(self):
        self.weights: SleepingWeights | None = None

    def sleep(self, runner, level: int) -> None:
        """Free ``runner``'s KV cache and graphs, then put its weights to sleep unless they are."""
        runner.free_kv_cache()
        if self.weights is None:
            self.weights = SleepingWeights(runner.model, runner.device, keep_parameters=level == 1)

    def wake_weights(self) -> None:
        """The weights back on the device; an error (out of memory) leaves them asleep, to retry."""
        if self.weights is not None:
            self.weights.wake_up()
            self.weights = None


def _return_freed_memory(device: torch.device) -> None:
    """Hand the freed blocks back to the driver, where other processes see them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def check_sleep_level(level) -> int:
    """``level`` if it is a sleep level, else a ValueError saying what each level does."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"level={level!r} is invalid: sleep levels are 1 (weights kept in host memory, "
                         "KV cache dropped) and 2 (weights and KV cache dropped; load_weights after waking)")
    return level


def check_wake_up_tags(tags) -> tuple[str, ...]:
    """The parts to wake, weights first (the KV cache's memory profile and graphs run the model)."""
    if tags is None:
        return WAKE_UP_TAGS
    if isinstance(tags, str):
        tags = [tags]
    tags = list(tags)
    if not tags:
        raise ValueError(f"tags=[] is invalid: it wakes nothing; give some of {list(WAKE_UP_TAGS)}, or None "
                         "for both")
    unknown = [t for t in tags if t not in WAKE_UP_TAGS]
    if unknown:
        raise ValueError(f"tags={list(tags)!r} is invalid: {unknown[0]!r} is no part of the engine; tags are "
                         f"{list(WAKE_UP_TAGS)} (None: both)")
    return tuple(t for t in WAKE_UP_TAGS if t in tags)
