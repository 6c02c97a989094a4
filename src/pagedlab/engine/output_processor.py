"""What users get back: text, logprob records and ``RequestOutput``s, built from what the
scheduler's requests hold and what each step read back.

Each user request (``n`` completions of one prompt) is a parent with ``n`` child requests. The
output processor keeps each child's text (detokenized incrementally), logprobs and prompt
logprobs, finds stop strings (the scheduler then finishes those requests), advances each
request's grammar by the tokens it keeps, and turns a parent's state into a ``RequestOutput``
(everything so far, only what is new, or only the final one, as its ``output_kind`` says).

A stream interval k (the engine's ``stream_interval``, raised by a request's own) batches tokens
as vLLM's output processor does, per completion: an unfinished parent's output goes out when one
of its completions has shown no token yet, has k tokens no output carried, or finished; so the
first token goes out at once, then every k-th, and the final output whatever it holds. Unlike
vLLM's, whose offset moves only in DELTA mode (a CUMULATIVE stream gets every step's output there),
it batches cumulative outputs too: the server streams those.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from pagedlab.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagedlab.engine.step_outputs import PromptLogprobsChunk, StepOutput
from pagedlab.engine.request import Request
from pagedlab.layers.sampler import TopLogprobs
from pagedlab.logprobs import FlatLogprobs, Logprob, PositionLogprobs, PromptLogprobs, SampleLogprobs
from pagedlab.outputs import CompletionOutput, RequestOutput
from pagedlab.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


@dataclass
class CompletionState:
    """The user-facing part of one child request."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: SampleLogprobs | None = None
    # a list of every prompt position (None until recorded), or a FlatLogprobs of those recorded
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_ready: int = 1  # leading prompt positions recorded (position 0 has none)
    token_id_logprobs: PromptTokenIdLogprobs | None = None  # with prompt_logprob_token_ids
    sent_tokens: int = 0  # output tokens the last output carried (DELTA outputs: what is not new)
    sent_text: int = 0
    sent_prompt_logprobs: int = 0
    sent_routed_experts: bool = False  # with RequestOutputKind.DELTA: an output carried them

    @property
    def unsent_tokens(self) -> int:
        """Output tokens no output carried yet."""
        return self.request.num_output_tokens - self.sent_tokens


class PositionColumns(NamedTuple):
    """One position's logprob record as columns (``FlatLogprobs.append_fast``'s arguments)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    decoded_tokens: list[str | None]


@dataclass
class PromptTokenIdLogprobs:
    """A request's ``prompt_token_id_logprobs`` as its prompt's chunks fill them, rows in order. A
    prefill redone after a preemption rewrites the rows it has until the last row is in; from then
    on they are left as they are (as outputs carry them), whatever a later recompute gives."""

    scores: torch.Tensor  # [rows, len(prompt_logprob_token_ids)] float32
    ready: int = 0  # leading rows recorded
    sent: bool = False  # with RequestOutputKind.DELTA: an output carried them

    @classmethod
    def for_request(cls, request: Request) -> PromptTokenIdLogprobs:
        params = request.sampling_params
        rows = max(request.num_prompt_tokens - 1 - (params.prompt_logprob_start or 0), 0)
        return cls(torch.empty(rows, len(params.prompt_logprob_token_ids), dtype=torch.float32))

    @property
    def complete(self) -> bool:
        return self.ready >= len(self.scores)

    def record(self, chunk: PromptLogprobsChunk) -> None:
        if chunk.token_id_logprobs is not None and not self.complete:
            end = chunk.token_id_row + len(chunk.token_id_logprobs)
            self.scores[chunk.token_id_row:end] = chunk.token_id_logprobs
            self.ready = max(self.ready, end)

    def output(self, delta: bool) -> torch.Tensor | None:
        """The scores an output carries: all of them once complete (with ``delta``, only once)."""
        if not self.complete or (delta and self.sent):
            return None
        self.sent = self.sent or delta
        return self.scores


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    completions: list[CompletionState] = field(default_factory=list)
    shown: tuple[int, int] = (0, 0)  # the ``progress`` the last output showed
    stream_interval: int = 1  # new tokens a completion batches into one streamed output

    @property
    def progress(self) -> tuple[int, int]:
        """How far the parent has come: its completions' tokens, and its prompt positions with
        logprobs recorded."""
        first = self.completions[0]
        return (sum(c.request.num_output_tokens for c in self.completions),
                first.prompt_logprobs_ready if first.prompt_logprobs is not None else 0)

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.completions)

    @property
    def stream_due(self) -> bool:
        """Whether the stream interval lets an output go out now (vLLM's rule, per completion): one
        has shown no token yet, has ``stream_interval`` tokens no output carried, or finished with
        tokens none carried."""
        k = self.stream_interval
        return k == 1 or any(c.sent_tokens == 0 or c.unsent_tokens >= k
                             or (c.request.is_finished and c.unsent_tokens > 0) for c in self.completions)

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.completions[0].request.sampling_params.output_kind


@dataclass
class StopStringHit:
    """A stop string the text completed; ``num_after``: the tokens the same step appended after
    the one that completed it (speculative decoding), which the request must not keep."""

    request: Request
    stop: str
    num_after: int = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._parents: dict[str, ParentState] = {}
        self._completions: dict[str, CompletionState] = {}  # by child request id

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def children(self, request_id: str) -> list[Request]:
        parent = self._parents.get(request_id)
        return [c.request for c in parent.completions] if parent is not None else []

    def add_request(self, request_id: str, prompt: str | None, children: list[Request],
                    stream_interval: int = 1) -> None:
        """Track a parent's ``children``; ``stream_interval``: the engine's, which the request's own
        ``SamplingParams.stream_interval`` may raise (vLLM's clamp)."""
        own = children[0].sampling_params.stream_interval
        parent = ParentState(request_id, prompt, stream_interval=max(own or 1, stream_interval))
        for child in children:
            params = child.sampling_params
            detokenizer = None
            if params.detokenize and self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                     child.prompt_token_ids)
            state = CompletionState(child, detokenizer)
            if params.wants_logprobs:
                state.logprobs = FlatLogprobs() if params.flat_logprobs else []
            if params.prompt_logprobs is not None:
                state.prompt_logprobs = _prompt_records(params.flat_logprobs, child.num_prompt_tokens)
            if params.prompt_logprob_token_ids is not None:
                state.token_id_logprobs = PromptTokenIdLogprobs.for_request(child)
            parent.completions.append(state)
            self._completions[child.request_id] = state
        parent.shown = parent.progress
        self._parents[request_id] = parent

    # ---- after a step ---------------------------------------------------------------------
    def process(self, requests: list[Request], output: StepOutput, appended_rows: list[int],
                several_per_request: bool = False) -> list[StopStringHit]:
        """Record a read-back step: prompt logprobs of ``requests``' chunks, and for each row
        of ``output`` whose token the scheduler appended, its logprobs and text. Returns the stop
        strings the new text completed; the text is already cut there. ``several_per_request``: a
        request may have several rows (speculative decoding's kept proposals), in order."""
        self._record_prompt_logprobs(requests, output.prompt_logprobs)
        hits: dict[Request, StopStringHit] = {}
        # each request's rows still to come (none counted where a request has one row: all zero)
        later = Counter(output.sampled_requests[row] for row in appended_rows if several_per_request)
        for row in appended_rows:
            request, token = output.sampled_requests[row], output.sampled_token_ids[row]
            if several_per_request:
                later[request] -= 1
            if request in hits:  # its text already ended in this step
                hits[request].num_after += 1
                continue
            state = self._completions[request.request_id]
            if request.grammar is not None and not request.grammar.accept(token):
                logger.warning("request %s: token %d does not fit its grammar", request.request_id, token)
            if state.logprobs is not None:
                params = request.sampling_params
                _append_position(state.logprobs, self._position_columns(
                    output.logprobs, row, token, params.logprobs or 0, params.detokenize,
                    params.logprob_token_ids))
                state.cumulative_logprob += float(output.logprobs.token_logprob[row])
            if state.detokenizer is not None:
                stop = self._append_text(state, token, request.num_output_tokens - later[request],
                                         request.finish_reason == "stop" and not later[request])
                if stop is not None:
                    hits[request] = StopStringHit(request, stop)
        return list(hits.values())

    def _append_text(self, state: CompletionState, token: int, num_output: int, stopped: bool) -> str | None:
        """Detokenize one token, the ``num_output``-th of its request; the stop string it completes
        (cutting the text), if any. EOS and stop token ids, which the scheduler has already acted
        on (``stopped``: this token ended the request), take precedence: as in vLLM, the token that
        stopped the sequence stays out of the text (it is in ``token_ids``) unless
        ``include_stop_str_in_output``."""
        params = state.request.sampling_params
        if stopped and not params.include_stop_str_in_output:
            return None
        new_text = state.detokenizer.append(token)
        state.text = state.detokenizer.text
        if not params.stop or not new_text or num_output <= params.min_tokens or stopped:
            return None
        hit = find_stop_string(state.text, len(new_text), params.stop)
        if hit is None:
            return None
        stop, idx = hit
        state.text = state.text[:idx + (len(stop) if params.include_stop_str_in_output else 0)]
        return stop

    def _record_prompt_logprobs(self, requests: list[Request],
                                chunks: dict[str, PromptLogprobsChunk]) -> None:
        for request in requests:
            chunk, state = chunks.get(request.request_id), self._completions.get(request.request_id)
            if chunk is None or state is None or state.request is not request:
                continue  # aborted (its id perhaps reused) while the step that computed the chunk ran
            if state.token_id_logprobs is not None:
                state.token_id_logprobs.record(chunk)
            if chunk.logprobs is None:
                continue
            self._record_prompt_positions(state, chunk)

    def _record_prompt_positions(self, state: CompletionState, chunk: PromptLogprobsChunk) -> None:
        """Record a chunk's prompt positions: in a list each at its index (a prefill redone after a
        preemption writes them again), in a ``FlatLogprobs`` (which the rows, scored in order from
        the first, reach in order) those past the ones it holds: those stay as first recorded."""
        params, records = state.request.sampling_params, state.prompt_logprobs
        first = max(len(records) - chunk.start, 0) if isinstance(records, FlatLogprobs) else 0
        for j in range(first, len(chunk.token_ids)):
            columns = self._position_columns(chunk.logprobs, j, chunk.token_ids[j], params.prompt_logprobs,
                                             params.detokenize)
            if isinstance(records, FlatLogprobs):
                records.append_fast(*columns)
            else:
                records[chunk.start + j] = _position_dict(columns)
        state.prompt_logprobs_ready = max(state.prompt_logprobs_ready, chunk.start + len(chunk.token_ids))

    def _position_columns(self, top: TopLogprobs, row: int, token: int, num: int, decode: bool,
                          label_ids: list[int] | None = None) -> PositionColumns:
        """One position's record: the sampled token's logprob, then those of ``label_ids``
        (``logprob_token_ids``), then the top ``num``, ranked 1..num (as vLLM: a token among them
        takes its top-``num`` rank, which differs from its vocabulary rank only where it ties with
        others); each token id once."""
        entries = {token: (float(top.token_logprob[row]), int(top.token_rank[row]))}
        for j, tid in enumerate(label_ids or ()):
            entries.setdefault(tid, (float(top.label_logprobs[row, j]), int(top.label_ranks[row, j])))
        top_ids, top_logprobs = top.top_ids[row, :num].tolist(), top.top_logprobs[row, :num].tolist()
        for rank, (tid, lp) in enumerate(zip(top_ids, top_logprobs), 1):
            entries[tid] = (lp, rank)
        ids = list(entries)
        texts = [self.tokenizer.decode([tid]) for tid in ids] if decode and self.tokenizer is not None \
            else [None] * len(ids)
        values = entries.values()
        return PositionColumns(ids, [lp for lp, _ in values], [rank for _, rank in values], texts)

    # ---- outputs --------------------------------------------------------------------------
    def make_outputs(self, changed: list[Request], finished_only: bool = False) -> list[RequestOutput]:
        """The output of each parent of ``changed`` that finished or came further (new tokens, or
        new prompt logprobs) since its last output, as its stream interval allows (``stream_due``):
        as vLLM, a prefill chunk or a preemption that gave it nothing new makes no output. With
        ``finished_only``, or for a request whose ``output_kind`` is FINAL_ONLY, only those that
        finished. A finished parent is forgotten once its output is built."""
        outputs = []
        for parent_id in dict.fromkeys(r.parent_id for r in changed):
            parent = self._parents.get(parent_id)
            if parent is None:
                continue
            final_only = finished_only or parent.output_kind == RequestOutputKind.FINAL_ONLY
            if parent.finished or (not final_only and parent.progress != parent.shown and parent.stream_due):
                outputs.append(self.make_output(parent_id))
        return outputs

    def make_output(self, request_id: str) -> RequestOutput:
        """The parent's output now: cumulative, or with ``RequestOutputKind.DELTA`` only what no
        earlier output carried."""
        parent = self._parents[request_id]
        finished, parent.shown = parent.finished, parent.progress
        if finished:
            del self._parents[request_id]
            for state in parent.completions:
                self._completions.pop(state.request.request_id, None)
        first = parent.completions[0]
        delta = parent.output_kind == RequestOutputKind.DELTA
        return RequestOutput(
            request_id=request_id, prompt=parent.prompt, prompt_token_ids=first.request.prompt_token_ids,
            prompt_logprobs=_prompt_logprobs_output(first, delta),
            outputs=[_completion_output(state, delta) for state in parent.completions], finished=finished,
            metrics=first.request.metrics, num_cached_tokens=first.request.num_cached_prompt_tokens,
            prompt_token_id_logprobs=(first.token_id_logprobs.output(delta)
                                      if first.token_id_logprobs is not None else None))

    def clear(self) -> None:
        self._parents.clear()
        self._completions.clear()


def _prompt_records(flat: bool, num_prompt_tokens: int) -> PromptLogprobs:
    """A request's prompt logprobs before any is computed: every position None in a list, or
    position 0 alone (with none) in a ``FlatLogprobs``."""
    if not flat:
        return [None] * num_prompt_tokens
    records = FlatLogprobs()
    records.append(None)
    return records


def _append_position(records: SampleLogprobs, columns: PositionColumns) -> None:
    if isinstance(records, FlatLogprobs):
        records.append_fast(*columns)
    else:
        records.append(_position_dict(columns))


def _position_dict(columns: PositionColumns) -> PositionLogprobs:
    return {tid: Logprob(lp, rank, text) for tid, lp, rank, text in zip(*columns)}


def _prompt_logprobs_output(state: CompletionState, delta: bool) -> PromptLogprobs | None:
    """The prompt logprobs an output carries (a copy): all positions (in a list those not computed
    yet are None; a ``FlatLogprobs`` holds those recorded, as vLLM's), or with ``delta`` the
    positions recorded since the last output (as vLLM, none once all were sent), so that chunked
    prefill's pieces add up to the prompt's."""
    if state.prompt_logprobs is None:
        return None
    if not delta:
        return state.prompt_logprobs[:]
    ready = min(state.prompt_logprobs_ready, len(state.prompt_logprobs))
    new = state.prompt_logprobs[state.sent_prompt_logprobs:ready]
    state.sent_prompt_logprobs = max(state.sent_prompt_logprobs, ready)
    return new


def _completion_output(state: CompletionState, delta: bool = False) -> CompletionOutput:
    """The completion as an output carries it: until it finishes, the text's last (longest stop
    string - 1) characters are held back, as vLLM holds them, so no output shows part of a stop
    string that the next token completes (and cuts away); with ``delta`` only what is new."""
    request = state.request
    tokens, text, logprobs = request.output_token_ids, state.text, state.logprobs
    params = request.sampling_params
    if request.finish_reason is None and params.stop and not params.include_stop_str_in_output:
        text = text[:max(0, len(text) - max(map(len, params.stop)) + 1)]
    if delta:
        shown = len(text)
        tokens, text = tokens[state.sent_tokens:], text[state.sent_text:]
        logprobs = logprobs[state.sent_tokens:] if logprobs is not None else None
        state.sent_text = max(state.sent_text, shown)
    state.sent_tokens = request.num_output_tokens
    return CompletionOutput(
        index=request.index, text=text, token_ids=tokens,
        cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
        logprobs=logprobs[:] if logprobs is not None else None,
        finish_reason=request.finish_reason, stop_reason=request.stop_reason,
        routed_experts=_routed_experts_output(state, delta))


def _routed_experts_output(state: CompletionState, delta: bool) -> np.ndarray | None:
    """The completion's routed experts once it finished (taken at the finish, ``engine.routed_experts``),
    as vLLM's final output carries them; with ``delta`` in one output. Tokens dropped after the
    finish (those after a stop string that the same step appended) drop their rows."""
    request, rows = state.request, state.request.routed_experts
    if rows is None or (delta and state.sent_routed_experts):
        return None
    state.sent_routed_experts = delta
    return rows[:request.num_tokens - 1 - request.sampling_params.routed_experts_prompt_start]
