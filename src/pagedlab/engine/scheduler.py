"""Which tokens of which requests run in the next step, and every change of a request's state.

The scheduler owns the request lifecycle: admission, preemption, the tokens computed when a step
is launched, the tokens appended when it is read back, the stop checks, finishing and freeing
(the KV cache manager owns the blocks; the output processor owns text and logprobs).

One step has one token budget (``max_num_batched_tokens``) shared by decodes and prefill
chunks. Running requests are served first, in arrival order; when the pool has no block for
one, the most recently arrived running request is preempted (its blocks freed, to be
recomputed later). Waiting requests are then admitted first-come first-served while budget,
sequence slots and blocks last; with chunked prefill a prompt may take several steps. With LoRA,
the running requests use at most ``max_loras`` distinct adapters (the GPU slots of one step): a
waiting request of another adapter waits until one of them is no longer running.

``policy="priority"`` (vLLM's ``scheduling_policy``) orders both queues by (``priority``, arrival
time) instead: the waiting request of the lowest priority value is admitted first, and the
running request of the highest is the one preempted.

LongRoPE models (``long_rope``: switch length, position offset) compute a sequence longer than
the switch with the long factors, at offset positions; a running request that grows past it is
sent back to the waiting queue as a preemption is, so that all of its tokens are recomputed in the
long regime, as transformers does. It is counted apart (``num_long_rope_recomputes``), not as a
preemption: ``num_preemptions`` counts only the requests the KV cache had no room for.

With speculative decoding (``speculative``: n-gram prompt lookup, or a draft model, whose proposals
the engine fills in after scheduling: ``engine/draft_model.py``), a decode runs its last token
and up to ``num_speculative_tokens`` proposed ones (fewer in a large batch, with a batch-size
schedule: ``SpeculativeConfig.tokens_for_batch``) in one step, out of the budget and blocks left
once every running request and admitted prompt has its tokens; the step samples at each of them,
and the sampled tokens are kept up to the first that differs from the proposal after it (which
is kept too). Each position samples as it would without the proposal: its noise is keyed by its
position, and penalties, bad words and a grammar's bitmask read the proposed tokens before it as
its history (``StepInputs.sample_proposed``), so the outputs are those of plain decoding.
Requests with logits processors get no proposals: a row after a proposal runs whatever the row
before allowed, and a user's processor must not see a history it banned. The
keys and values computed for rejected proposals are overwritten later: ``num_computed_tokens``
steps back over them. Proposals need every token on the host, so the step loop reads each step
back before scheduling the next, except where the next may not propose (``must_read_back``).

With asynchronous steps, a request whose last token is still pending on the device is
scheduled like any decode: the model runner takes that input id from the previous step's
device tensor. A request that has sampled all its ``max_tokens``, or up to ``max_model_len``, waits
for them to be read back (as vLLM, which never computes a position past ``max_model_len - 1``).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from pagedlab.speculative_config import SpeculativeConfig
from pagedlab.engine.kv_cache import KVCacheManager
from pagedlab.engine.ngram_proposer import propose_ngram_drafts
from pagedlab.engine.repetition import ends_in_repetition
from pagedlab.engine.request import Request, RequestStatus


@dataclass
class DraftProgress:
    """What a draft model holds of one request after its passes (``DraftModel.propose``): the keys
    and values of its first ``known_end`` tokens (to its last known one), then on to ``end`` (its
    proposals')."""

    known_end: int
    end: int


@dataclass
class ScheduledBatch:
    """The work of one step: ``num_new_tokens[i]`` tokens of ``requests[i]`` starting at its
    ``num_computed_tokens``, the last ``len(draft_token_ids[i])`` of them proposed (speculative
    decoding). A request samples when the step reaches its last token (known or still pending on
    the device), and at each proposed token after it."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    draft_token_ids: list[list[int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, request: Request, num_new_tokens: int, draft_token_ids: list[int] | None = None) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)
        self.draft_token_ids.append(draft_token_ids or [])

    def is_empty(self) -> bool:
        return not self.requests

    def drafts_by_request(self) -> dict[Request, list[int]]:
        """The proposed tokens of each request that has any."""
        return {r: d for r, d in zip(self.requests, self.draft_token_ids) if d}

    def samples(self, i: int) -> bool:
        request, known = self.requests[i], self.num_new_tokens[i] - len(self.draft_token_ids[i])
        return request.num_computed_tokens + known == request.num_tokens_with_pending

    def num_samples(self, i: int) -> int:
        """How many tokens ``requests[i]`` samples in this step: 0, 1, or 1 + its proposed ones."""
        return 1 + len(self.draft_token_ids[i]) if self.samples(i) else 0


@dataclass
class SchedulerStats:
    """Counters since the last reset: the KV block peak and the tokens run."""

    peak_blocks: int = 0
    tokens_at_peak: int = 0  # filled token slots when the block peak was reached (shared ones once)
    num_preemptions: int = 0  # running requests freed for want of KV blocks
    num_long_rope_recomputes: int = 0  # running requests freed on crossing LongRoPE's switch
    prompt_tokens: int = 0  # prompt and recomputed tokens run through the model
    generation_tokens: int = 0
    num_drafts: int = 0  # speculative decoding: proposals verified, their tokens, those accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_position: list[int] = field(default_factory=list)  # [j]: proposals' j-th tokens kept


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 long_rope: tuple[int, int] | None = None, max_loras: int | None = None,
                 policy: str = "fcfs", speculative: SpeculativeConfig | None = None, routes=None):
        self.kv_cache = kv_cache
        self.routes = routes  # enable_return_routed_experts: the engine's RoutedExperts, its store sized here
        if routes is not None:
            routes.allocate(kv_cache.num_blocks, kv_cache.block_size)
        self.speculative = speculative
        self.long_rope = long_rope
        self.max_loras = max_loras  # most distinct LoRA adapters among the running requests
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.by_priority = policy == "priority"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._num_needing_host_tokens = 0  # unfinished requests whose sampling reads earlier tokens

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def must_read_back(self, in_flight: ScheduledBatch) -> bool:
        """Whether the step in flight (``in_flight``) must be read back before the next is scheduled:
        some unfinished request samples with penalties or multi-token bad words (they read every
        earlier token on the host), or, with speculative decoding, the step verifies proposals (what
        it keeps moves ``num_computed_tokens``) or the next one may propose (proposals are made from
        host tokens: K is above 0 for as many requests as run now). Steps a batch-size schedule
        caps at K=0 run ahead as plain decoding's do."""
        if self._num_needing_host_tokens > 0:
            return True
        spec = self.speculative
        return spec is not None and (any(in_flight.draft_token_ids)
                                     or spec.tokens_for_batch(max(len(self.running), 1)) > 0)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if request.needs_host_tokens:
            self._num_needing_host_tokens += 1
        self._enqueue(self.waiting, request)

    def _enqueue(self, queue: deque[Request] | list[Request], request: Request, front: bool = False) -> None:
        """At the back (``front``: a preempted request, at the front), or by (priority, arrival)."""
        if self.by_priority:
            bisect.insort(queue, request, key=_priority_order)
        elif front:
            queue.insert(0, request)
        else:
            queue.append(request)

    # ---- scheduling -----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        if not batch.preempted:
            budget = self._schedule_waiting(batch, budget)
        if self.speculative is not None and not batch.preempted:
            self._add_drafts(batch, budget)
        now = time.time()
        for request in batch.requests:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        self._record_batch(batch)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.output_limit_reached or request.num_tokens_with_pending >= self.max_model_len:
                i += 1  # finishes once its pending tokens are read back
                continue
            if self._rope_position_offset(request) != request.rope_position_offset:
                self._recompute(self.running.pop(i))  # crossed LongRoPE's switch: recompute it all
                self.stats.num_long_rope_recomputes += 1
                batch.preempted.append(request)
                continue
            num_new = min(request.num_tokens_with_pending - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.add(request, num_new)
                budget -= num_new
                i += 1
        return budget

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Proposals for the batch's decodes (the last token of a sequence, sampling) out of the
        budget and free blocks left once every running request and admitted prompt has its
        tokens, in a step that preempted nothing (a victim's blocks go to the waiting queue first):
        a step's proposals never preempt a request nor keep a prompt waiting. Each proposes at most
        the K the step's number of requests gets (``SpeculativeConfig.tokens_for_batch``)."""
        most = self.speculative.tokens_for_batch(len(batch.requests))
        for i, request in enumerate(batch.requests):
            limit = min(budget, most)
            if limit <= 0:
                break
            if batch.num_new_tokens[i] != 1 or not batch.samples(i) or request.num_pending_tokens:
                continue  # not a decode, or its last token is still on the device
            drafts = self._propose_drafts(request, limit)
            if drafts and self.kv_cache.allocate_slots(request, 1 + len(drafts)):
                batch.num_new_tokens[i] += len(drafts)
                batch.draft_token_ids[i] = drafts
                budget -= len(drafts)
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += len(drafts)

    def _propose_drafts(self, request: Request, limit: int) -> list[int]:
        """The proposal for a decode of ``request`` (see the module's docstring): at most
        ``limit`` tokens, and no more than its ``max_tokens`` and ``max_model_len`` leave room for,
        nor past LongRoPE's switch (each sampled position must see its own regime, as without it)."""
        spec = self.speculative
        if request.sampling_params.logits_processors:
            return []  # a user's processor must not see a history plain decoding never produces
        room = min(spec.num_speculative_tokens, limit, self.max_model_len - request.num_tokens - 1)
        if self.long_rope is not None and request.num_tokens <= self.long_rope[0]:
            room = min(room, self.long_rope[0] - request.num_tokens)  # no row past LongRoPE's switch
        if request.sampling_params.max_tokens is not None:
            room = min(room, request.sampling_params.max_tokens - request.num_output_tokens - 1)
        if spec.method == "draft_model":
            return [0] * room  # placeholders: the draft model fills them in before the step runs
        return propose_ngram_drafts(request.all_token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max,
                                    room)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        adapters = {r.lora_int_id for r in self.running if r.lora_int_id}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self.max_loras and request.lora_int_id and request.lora_int_id not in adapters:
                if len(adapters) >= self.max_loras:
                    break  # waits, first come first served, until a running adapter's requests finish
                adapters.add(request.lora_int_id)
            request.rope_position_offset = self._rope_position_offset(request)
            hit = self.kv_cache.find_cached_prefix(request)
            num_cached = hit.num_tokens(self.kv_cache.block_size)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv_cache.allocate_slots(request, num_new, hit):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens += num_cached
            request.num_draft_computed_tokens = self.kv_cache.draft_ready_tokens(hit)
            if not request.num_preemptions:  # a recompute's hit on its own tokens is no prompt cache hit
                request.num_cached_prompt_tokens = request.metrics.num_cached_prompt_tokens = num_cached
            self._enqueue(self.running, request)
            batch.add(request, num_new)
            budget -= num_new
        return budget

    def _rope_position_offset(self, request: Request) -> int:
        """The position offset of the regime the request's tokens are computed in now."""
        if self.long_rope is None:
            return 0
        switch, offset = self.long_rope
        return offset if request.num_tokens_with_pending > switch else 0

    def _preempt(self, request: Request) -> None:
        """Free a running request the KV cache has no room for, to be recomputed later."""
        self._recompute(request)
        self.stats.num_preemptions += 1

    def _recompute(self, request: Request) -> None:
        """Free a running request's blocks and put it at the head of the waiting queue, to run all
        its tokens again (``Request.num_preemptions`` counts it either way: its blocks are new)."""
        if self.routes is not None:
            self.routes.preempted(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self._enqueue(self.waiting, request, front=True)

    def _record_batch(self, batch: ScheduledBatch) -> None:
        kv = self.kv_cache
        used = kv.num_blocks - kv.num_free_blocks
        if used > self.stats.peak_blocks:
            self.stats.peak_blocks = used
            # Empty slots sit only in each sequence's last block (shared prefix blocks are full),
            # so counting them per sequence stays right when blocks are shared.
            held = {r: r.num_computed_tokens for r in self.running}
            held.update((r, r.num_computed_tokens + n) for r, n in zip(batch.requests, batch.num_new_tokens))
            empty = sum(len(r.block_ids) * kv.block_size - tokens for r, tokens in held.items())
            self.stats.tokens_at_peak = used * kv.block_size - empty
        # A request's decode tokens are its proposed ones and the last known token it runs, where that
        # is an output token never run before: a recompute chunk that stops short of the end has none,
        # and a prompt's last token is a prompt token, proposals after it or not.
        decodes = sum(len(d) + (batch.samples(i) and r.num_computed_tokens + n - len(d) > r.num_prompt_tokens)
                      for i, (r, n, d) in enumerate(zip(batch.requests, batch.num_new_tokens,
                                                        batch.draft_token_ids)))
        self.stats.prompt_tokens += batch.total_tokens - decodes

    # ---- after a step ---------------------------------------------------------------------
    def update_after_launch(self, batch: ScheduledBatch) -> list[Request]:
        """The step's tokens are computing: count them, and the tokens each request samples (at
        its end, and at each proposed token) as pending. Returns the requests that sample, in
        batch order, a request once per token it samples."""
        sampled = []
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            sampled += [request] * batch.num_samples(i)
            request.num_computed_tokens += n
        for request in sampled:
            request.num_pending_tokens += 1
        return sampled

    def record_draft_pass(self, progress: dict[Request, DraftProgress]) -> None:
        """A launched step's draft-model passes (``DraftModel.propose``): the draft now holds each
        request's keys and values up to its proposals' end (stepped back with rejections), and
        the blocks its known tokens fill hold them for a prefix-cache hit."""
        for request, done in progress.items():
            request.num_draft_computed_tokens = done.end
            self.kv_cache.mark_draft_ready(request, done.known_end)

    def update_from_output(self, sampled_requests: list[Request], token_ids: list[int],
                           draft_token_ids: dict[Request, list[int]] | None = None) -> list[int]:
        """Append the tokens a step sampled (a row per sampled position, a request's rows in order)
        and finish the requests they stop (EOS, a stop token id, ``max_tokens``, ``max_model_len``).
        With ``draft_token_ids`` (each request's proposal), a request's rows are kept up to the first
        whose token differs from the proposed one after it. Returns the rows whose token was
        appended: a request that finished while the step was in flight gets none."""
        appended = []
        now = time.time()
        drafts, rejected = draft_token_ids or {}, set()
        for row, (request, token) in enumerate(zip(sampled_requests, token_ids)):
            request.num_pending_tokens -= 1
            if request.is_finished or request in rejected:
                continue
            draft = drafts.get(request)
            if draft:
                j = request.num_tokens - request.num_computed_tokens + len(draft)  # the request's row j
                if j < len(draft) and token == draft[j]:
                    self.stats.num_accepted_tokens += 1
                    per_position = self.stats.num_accepted_per_position
                    per_position += [0] * (j + 1 - len(per_position))
                    per_position[j] += 1
                elif j < len(draft):  # the rows after this one ran on a token the sequence does not have
                    request.num_computed_tokens -= len(draft) - j
                    request.num_draft_computed_tokens = min(request.num_draft_computed_tokens,
                                                            request.num_computed_tokens)
                    rejected.add(request)
            request.all_token_ids.append(token)
            self.stats.generation_tokens += 1
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_generated_tokens = request.num_output_tokens
            appended.append(row)
            self._check_stop(request, token)
        return appended

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return self.finish_request(request, "stop",
                                           stop_reason=None if token == request.model_eos_token_id else token)
            if token in params.stop_token_ids:
                return self.finish_request(request, "stop", stop_reason=token)
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return self.finish_request(request, "length")
        if request.num_tokens >= self.max_model_len:
            return self.finish_request(request, "length")
        # vLLM's order: EOS, stop ids and the length limits come first, and min_tokens holds this off too
        repetition = params.repetition_detection
        if (repetition is not None and request.num_output_tokens >= params.min_tokens
                and ends_in_repetition(request.all_token_ids, repetition, request.num_prompt_tokens)):
            return self.finish_request(request, "repetition", stop_reason="repetition_detected")
        return None

    def drop_last_tokens(self, request: Request, count: int) -> None:
        """Take back the last ``count`` appended tokens of ``request`` (a step's tokens after the one
        whose text completed a stop string), before it finishes."""
        if count:
            del request.all_token_ids[-count:]
            self.stats.generation_tokens -= count
            request.metrics.num_generated_tokens = request.num_output_tokens

    def finish_request(self, request: Request, reason: str, stop_reason: int | str | None = None,
                       replace: bool = False) -> None:
        """Finish a request (stopped, at its length limit, or aborted): take it out of the queues
        and free its blocks. A stop string found in its text overrides a "length" or "repetition"
        finish (as vLLM's), and any finish with ``replace`` (the token that finished it was dropped:
        ``drop_last_tokens``)."""
        if request.is_finished:
            if reason == "stop" and (request.finish_reason in ("length", "repetition") or replace):
                request.finish_reason, request.stop_reason = reason, stop_reason
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.metrics.finished_time = time.time()
        if request.needs_host_tokens:
            self._num_needing_host_tokens -= 1
        if self.routes is not None:
            self.routes.finish(request, reason)
        self.kv_cache.free(request)


def _priority_order(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
