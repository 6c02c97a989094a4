"""Which tokens of which requests run in the next step.

With asynchronous steps, a request whose last token is still pending on the device is
scheduled like any decode: the model runner takes that input id from the previous step's
device tensor. A request that has sampled all its ``max_tokens`` waits for them to be read back.

One step has one token budget (``max_num_batched_tokens``) shared by decodes and prefill
chunks. Running requests are served first, in arrival order; when the pool has no block for
one, the most recently arrived running request is preempted (its blocks freed, to be
recomputed later). Waiting requests are then admitted first-come first-served while budget,
sequence slots and blocks last; with chunked prefill a prompt may take several steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagedlab.engine.kv_cache import KVCacheManager
from pagedlab.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """The work of one step: ``num_new_tokens[i]`` tokens of ``requests[i]`` starting at its
    ``num_computed_tokens``. A request samples when the step reaches its last token (known or
    still pending on the device)."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def is_empty(self) -> bool:
        return not self.requests

    def samples(self, i: int) -> bool:
        request = self.requests[i]
        return request.num_computed_tokens + self.num_new_tokens[i] == request.num_tokens_with_pending


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        now = time.time()
        for request in batch.requests:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.output_limit_reached:  # finishes once its pending tokens are read back
                i += 1
                continue
            num_new = min(request.num_tokens_with_pending - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv_cache.find_cached_prefix(request)
            num_new = request.num_tokens - len(cached) * self.kv_cache.block_size
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv_cache.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Take a finished (or aborted) request out and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv_cache.free(request)
