"""The adapters of one engine: an LRU of ``max_loras`` GPU slots in the model's LoRA layers,
with an LRU CPU cache of ``max_cpu_loras`` read adapters behind it.

An adapter is read from disk on first use (``get_adapter``: the engine calls it when a request
arrives, so a bad adapter fails there, by name); a step puts the adapters of its requests into
slots (``prepare_step``), evicting the least recently used slot no request of the step needs,
and writes each token's slot into the static mapping every ``LoRALinear`` reads.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pagedlab.lora.adapter import LoRAAdapter, load_adapter
from pagedlab.lora.layers import LoRABatch, wrap_lora_linears
from pagedlab.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    """Owns the LoRA layers of ``model`` (wrapped at construction) and which adapter sits where."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch(max_loras, device)
        self.targets = wrap_lora_linears(model, self.batch, max_lora_rank, dtype)
        self.layers = list(dict.fromkeys(t.layer for t in self.targets.values()))
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recent first
        self.num_loads = 0  # adapters read from disk (for tests and stats)

    # ---- adapters -------------------------------------------------------------------------
    def get_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of ``request`` from the CPU cache, else read from disk and checked against
        the model's modules and their shapes (evicting the least recently used beyond
        ``max_cpu_loras``)."""
        adapter = self.cpu_cache.get(request.lora_int_id)
        if adapter is not None:
            self.cpu_cache.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.max_lora_rank, self.dtype)
        unknown = sorted(set(adapter.modules) - set(self.targets))
        if unknown:
            raise ValueError(f"LoRA adapter {request.lora_name!r} targets {unknown[0]!r}, which this model "
                             f"does not have (its LoRA targets look like {next(iter(self.targets))!r}): the "
                             "adapter was trained for another model")
        for name, weights in adapter.modules.items():  # here, not when a step puts it in a slot
            target = self.targets[name]
            try:
                target.layer.check_fits(target.slice, weights)
            except ValueError as e:
                raise ValueError(f"LoRA adapter {request.lora_name!r}, module {name!r}: {e}") from None
        self.num_loads += 1
        self.cpu_cache[request.lora_int_id] = adapter
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
        return adapter

    def list_loras(self) -> list[LoRARequest]:
        """The adapters in the CPU cache, least recently used first."""
        return [adapter.request for adapter in self.cpu_cache.values()]

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot and its CPU copy); False if it was not loaded."""
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            for layer in self.layers:
                layer.clear_slot(slot)
        return self.cpu_cache.pop(lora_int_id, None) is not None or slot is not None

    def _activate(self, requests: Sequence[LoRARequest]) -> dict[int, int]:
        """Slots for the adapters of one step (at most ``max_loras``: the scheduler sees to it)."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters, more than max_loras={self.max_loras}")
        for lora_id in wanted:
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
        for lora_id, request in wanted.items():
            if lora_id not in self.slots:
                self._load_slot(request, wanted)
        return {lora_id: self.slots[lora_id] for lora_id in wanted}

    def _load_slot(self, request: LoRARequest, keep) -> None:
        used = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(lora_id for lora_id in self.slots if lora_id not in keep)
            slot = self.slots.pop(victim)
        adapter = self.get_adapter(request)
        for layer in self.layers:
            layer.clear_slot(slot)
        for name, weights in adapter.modules.items():
            target = self.targets[name]
            target.layer.set_slice(slot, target.slice, weights)
        self.slots[request.lora_int_id] = slot
        logger.debug("LoRA adapter %s (id %d) in slot %d", request.lora_name, request.lora_int_id, slot)

    # ---- steps ----------------------------------------------------------------------------
    def allocate_mapping(self, max_tokens: int) -> None:
        """Static mapping and workspace buffers for steps of up to ``max_tokens`` tokens (before
        graph capture)."""
        max_slices = max(len(layer.slice_sizes) for layer in self.layers)
        self.batch.allocate(max_tokens, max_slices, self.max_lora_rank)

    def prepare_capture(self) -> None:
        """No token has a slot, yet the LoRA kernels run: what a graph captures."""
        self.batch.mapping.clear()
        self.batch.active = True

    def prepare_step(self, lora_requests: Sequence[LoRARequest | None], num_tokens: Sequence[int],
                     to_device) -> None:
        """Slots for the step's adapters and the mapping of its tokens (``num_tokens[i]`` tokens of
        the request with ``lora_requests[i]``, in order); ``to_device(values, dtype)`` copies host
        data to the device."""
        present = [r for r in lora_requests if r is not None]
        slot_of = self._activate(present) if present else {}
        per_request = [slot_of[r.lora_int_id] if r is not None else -1 for r in lora_requests]
        token_slots = np.repeat(np.asarray(per_request, dtype=np.int32), num_tokens)
        self.batch.active = bool(present)
        if present:
            self.batch.mapping.fill(token_slots, to_device)
        else:
            self.batch.mapping.clear()
