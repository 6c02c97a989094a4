"""What one step gives back: the sampled tokens, their logprobs and prompt logprobs, on the host
(``StepOutput``), its routed experts (``StepRoutes``), and a step whose work is still queued on
the device (``LaunchedStep``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedlab.engine.request import Request
from pagedlab.engine.scheduler import ScheduledBatch
from pagedlab.layers.sampler import TopLogprobs


@dataclass
class PromptLogprobsChunk:
    """One step's scores of a request's prompt: ``prompt_logprobs`` for positions
    ``start..start+len(token_ids)`` (of the token at each), and the ``prompt_logprob_token_ids``
    rows of its ``prompt_token_id_logprobs`` from row ``token_id_row`` on."""

    start: int
    token_ids: list[int]
    logprobs: TopLogprobs | None  # CPU tensors; None without prompt_logprobs
    token_id_logprobs: torch.Tensor | None = None  # [rows, len(ids)] float32 on the CPU
    token_id_row: int = 0


@dataclass
class StepRoutes:
    """One step's routed experts (``enable_return_routed_experts``) on their way to the engine's
    store: ``rows[i]`` (``[layers, top_k]``) is the step's token ``i``'s, in KV slot ``slots[i]``.
    On CUDA, pinned memory an asynchronous copy fills: read it once the step's ``done`` event passed."""

    rows: torch.Tensor
    slots: list[int]


@dataclass
class StepOutput:
    """What one forward pass produced, on the host: one sampled token per sampling request."""

    sampled_requests: list[Request]
    sampled_token_ids: list[int]
    logprobs: TopLogprobs | None  # rows follow sampled_requests; CPU tensors
    prompt_logprobs: dict[str, PromptLogprobsChunk]


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; ``result()`` waits for it and reads it back."""

    batch: ScheduledBatch
    sampled_requests: list[Request]
    sampled_token_ids: torch.Tensor | None = None  # on the device, for the next step's pending inputs
    host_token_ids: torch.Tensor | None = None  # filled by an asynchronous copy on CUDA
    logprobs: TopLogprobs | None = None  # host tensors, likewise
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    done: torch.cuda.Event | None = None  # recorded after the copies; None where work is synchronous
    unsampled: tuple | None = None  # (inputs, logits) until ModelRunner.finish_sampling
    pending_sampler: Callable[[], None] | None = None  # queues the sampler (see finish_sampling)
    routes: StepRoutes | None = None  # enable_return_routed_experts: the forward's experts, host-bound

    def sample_rows(self) -> dict[Request, int]:
        return {request: row for row, request in enumerate(self.sampled_requests)}

    def queue_sampler(self) -> None:
        """Queue the sampler if ``finish_sampling`` left it pending; a no-op otherwise."""
        if self.pending_sampler is not None:
            queue, self.pending_sampler = self.pending_sampler, None
            queue()

    def result(self) -> StepOutput:
        self.queue_sampler()
        if self.done is not None:
            self.done.synchronize()
        token_ids = self.host_token_ids.tolist() if self.host_token_ids is not None else []
        return StepOutput(self.sampled_requests, token_ids, self.logprobs, self.prompt_logprobs)
