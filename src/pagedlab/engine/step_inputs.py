"""Host data for one step on its way to the device, and the sampler's per-row settings built
from the scheduled requests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedlab.engine.bad_words import bad_word_bans
from pagedlab.engine.request import Request
from pagedlab.engine.scheduler import ScheduledBatch
from pagedlab.engine.structured_output import grammar_bitmask
from pagedlab.engine.trace_replay import trace_token
from pagedlab.kernels.paged_attention import decode_order
from pagedlab.layers.sampler import SamplingMetadata

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
                 torch.bool: np.bool_}


@dataclass
class StepInputs:
    """One step's inputs on the host, flat over its tokens."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    pending_rows: list[int] = field(default_factory=list)  # token index whose id the previous step sampled
    pending_sources: list[int] = field(default_factory=list)  # its row in that step's sampled ids
    sample_rows: list[int] = field(default_factory=list)  # token index of each sampling request's last token
    sampled: list[Request] = field(default_factory=list)
    sample_positions: list[int] = field(default_factory=list)  # output tokens before each sampled one
    sample_proposed: dict[int, list[int]] = field(default_factory=dict)  # sampled row -> proposals before it
    prompt_rows: list[int] = field(default_factory=list)  # token indices of the prompt rows scored
    # request id -> (its first row among prompt_rows, row count, prompt position of the first row)
    prompt_chunks: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def decode_only(self) -> bool:
        return len(self.input_ids) == len(self.seq_lens) and not self.prompt_rows

    @property
    def logit_rows(self) -> list[int]:
        """The token rows the LM head runs on: the sampled rows, then the prompt-logprob rows."""
        return self.sample_rows + self.prompt_rows


def add_positions(inputs: StepInputs, request: Request, start: int, count: int, block_size: int) -> None:
    """Append the positions, KV slots and sequence length of ``request``'s tokens [``start``,
    ``start + count``) to ``inputs``."""
    bs = block_size
    inputs.seq_lens.append(start + count)
    if count == 1:  # a decode: scalar arithmetic beats numpy's per-call cost
        inputs.positions.append(start + request.rope_position_offset)
        inputs.slots.append(request.block_ids[start // bs] * bs + start % bs)
    else:
        pos = np.arange(start, start + count)
        inputs.positions.extend((pos + request.rope_position_offset).tolist())
        inputs.slots.extend((np.asarray(request.block_ids)[pos // bs] * bs + pos % bs).tolist())


def prepare_step_inputs(batch: ScheduledBatch, previous_rows: dict[Request, int],
                        block_size: int) -> StepInputs:
    """The flat host inputs of ``batch``: ids, positions, KV slots, sequence lengths, the rows the
    LM head runs on (each sampled position, then the prompt-logprob positions). A request's input
    id still pending on the device (``previous_rows``: its row in the step before's sampled ids)
    is marked for the device to fill in; proposed tokens (speculative decoding) follow the last
    known one, and each of them samples too."""
    inputs = StepInputs()
    for i, (request, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        start, drafts = request.num_computed_tokens, batch.draft_token_ids[i]
        offset = len(inputs.input_ids)
        if n == 1 and start >= request.num_tokens:  # sampled by the step still in flight
            inputs.pending_rows.append(offset)
            inputs.pending_sources.append(previous_rows[request])
            inputs.input_ids.append(0)
        elif n == 1:
            inputs.input_ids.append(request.all_token_ids[start])
        else:
            inputs.input_ids.extend(request.all_token_ids[start:start + n - len(drafts)] + drafts)
        add_positions(inputs, request, start, n, block_size)
        add_prompt_rows(inputs, request, start, n, offset)
        first = n - batch.num_samples(i)
        for j in range(first, n):
            if j > first:  # a row after proposed tokens sees them in its history
                inputs.sample_proposed[len(inputs.sampled)] = drafts[:j - first]
            inputs.sampled.append(request)
            inputs.sample_rows.append(offset + j)
            inputs.sample_positions.append(start + j + 1 - request.num_prompt_tokens)
    return inputs


def add_prompt_rows(inputs: StepInputs, request: Request, start: int, count: int, offset: int) -> None:
    """Mark the prompt rows among ``request``'s tokens [``start``, ``start + count``) (from token
    index ``offset`` of the step) whose logits it asks for: each from its
    ``first_scored_prompt_row`` up to the last but one (the last predicts the first output token)."""
    first = request.sampling_params.first_scored_prompt_row
    if first is None:
        return
    first, end = max(start, first), min(start + count, request.num_prompt_tokens - 1)
    if first < end:
        inputs.prompt_chunks[request.request_id] = (len(inputs.prompt_rows), end - first, first)
        inputs.prompt_rows.extend(range(offset + first - start, offset + end - start))


@dataclass
class DeviceInputs:
    """A step's forward inputs on the device (``stage_forward_inputs``). ``input_ids`` is None
    where every token's id is the previous step's sampled id in its order (a decode batch that
    kept its requests, or the first of them): the step then reads that tensor's first
    ``num_tokens`` ids. ``logit_rows`` is None where the LM head's rows are the first ones in
    order (a slice, no gather)."""

    num_tokens: int
    input_ids: torch.Tensor | None
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    pending_rows: torch.Tensor | None
    pending_sources: torch.Tensor | None
    logit_rows: torch.Tensor | None
    seq_order: torch.Tensor | None = None  # a decode batch's sequences longest first (attention's order)


def stage_forward_inputs(inputs: StepInputs, table: np.ndarray, to_device: HostToDevice) -> DeviceInputs:
    """Every host input of a step's forward pass, staged in one ``to_device.deferred()`` block
    (one host-to-device copy on CUDA); use the tensors only after the block."""
    rows, n = inputs.logit_rows, len(inputs.input_ids)
    follows = bool(inputs.pending_rows) and inputs.pending_rows == list(range(n)) == inputs.pending_sources
    scatter = bool(inputs.pending_rows) and not follows  # some ids from the previous step, elsewhere
    seq_lens = np.asarray(inputs.seq_lens, dtype=np.int32)
    with to_device.deferred():
        return DeviceInputs(
            num_tokens=n, input_ids=None if follows else to_device(inputs.input_ids, torch.int64),
            positions=to_device(inputs.positions, torch.int64),
            slot_mapping=to_device(inputs.slots, torch.int64),
            seq_lens=to_device(seq_lens, torch.int32),
            block_tables=to_device(table, torch.int32),
            pending_rows=to_device(inputs.pending_rows, torch.int64) if scatter else None,
            pending_sources=to_device(inputs.pending_sources, torch.int64) if scatter else None,
            logit_rows=None if rows == list(range(len(rows))) else to_device(rows, torch.int64),
            seq_order=to_device(decode_order(seq_lens), torch.int32) if inputs.decode_only else None)


class PinnedStaging:
    """Host-to-device copies through two reused pinned buffers, used by alternate steps. Pinning
    a fresh tensor for every input cost ~0.1 ms each, over 1 ms per decode step. A buffer is
    written again only after the event of the step that last used it has passed.

    Inside ``deferred()`` each array gets a view of the buffer's device mirror at its own offset,
    and one copy at the block's end fills them all: a decode step's ten inputs were ten copies.
    A mirror region is overwritten by the copy of the step two later, queued on the same stream
    after everything this step queued, so its tensors are meant for this step's kernels only."""

    def __init__(self, device: torch.device, nbytes: int = 1 << 22):
        self.device = device
        self._pinned = device.type == "cuda"  # on the CPU (tests) plain buffers, the same offsets
        self._buffers = [self._host_buffer(nbytes) for _ in range(2)]
        self._mirrors = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self._released: list[torch.cuda.Event | None] = [None, None]
        self._current = 0
        self._offset = 0
        self._deferring = False
        self._pending_from: int | None = None  # where the deferred region not yet copied starts
        self._mirrored = True  # False once a step outgrew its mirror: later arrays copy at once

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned)

    def begin_step(self) -> None:
        self._current ^= 1
        event = self._released[self._current]
        if event is not None:
            event.synchronize()
        self._offset = 0
        self._mirrored = True

    def end_step(self, event: torch.cuda.Event) -> None:
        """``event`` is recorded after every copy queued since ``begin_step``."""
        self._released[self._current] = event

    @contextlib.contextmanager
    def deferred(self):
        self._deferring = True
        try:
            yield
        finally:
            self._flush()
            self._deferring = False

    def _flush(self) -> None:
        """Queue the one copy of the deferred region staged so far into the mirror."""
        start, self._pending_from = self._pending_from, None
        if start is not None and self._offset > start:
            mirror, buffer = self._mirrors[self._current], self._buffers[self._current]
            mirror[start:self._offset].copy_(buffer[start:self._offset], non_blocking=True)

    def to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        array = np.asarray(values, dtype=_NUMPY_DTYPES[dtype])
        start = -(-self._offset // 64) * 64
        buffer = self._buffers[self._current]
        if start + array.nbytes > buffer.numel():
            self._flush()
            if self._pinned:
                torch.cuda.current_stream(self.device).synchronize()  # copies queued from the old buffer
            buffer = self._host_buffer(max(2 * buffer.numel(), array.nbytes))
            self._buffers[self._current], start, self._mirrored = buffer, 0, False
        end = start + array.nbytes
        mirror = self._mirrors[self._current]
        if self._deferring and self._mirrored and end > mirror.numel():
            self._flush()
            self._mirrored = False
        self._offset = end
        host = buffer[start:end].view(dtype).view(array.shape)
        host.numpy()[...] = array
        if self._deferring and self._mirrored:
            self._pending_from = start if self._pending_from is None else self._pending_from
            return mirror[start:end].view(dtype).view(array.shape)
        return host.to(self.device, non_blocking=True, copy=True)


class HostToDevice:
    """Host lists and arrays to device tensors; on CUDA through ``PinnedStaging`` without waiting
    for the copy, on the CPU as plain tensors. ``deferred()`` stages several arrays for one copy;
    on the CPU its tensors hold a poison value until the block ends, as a CUDA kernel queued
    inside the block would read them before their copy, so the CPU tests catch such a use."""

    def __init__(self, device: torch.device):
        self.device = device
        self.staging = PinnedStaging(device) if device.type == "cuda" else None
        self._pending: list[tuple[torch.Tensor, np.ndarray]] | None = None

    def begin_step(self) -> None:
        if self.staging is not None:
            self.staging.begin_step()

    def end_step(self, event: torch.cuda.Event | None) -> None:
        if self.staging is not None:
            self.staging.end_step(event)

    @contextlib.contextmanager
    def deferred(self):
        """Inside: tensors for kernels queued after the block (one copy at its end on CUDA)."""
        if self.staging is not None:
            with self.staging.deferred():
                yield
            return
        self._pending = []
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            for tensor, array in pending:
                tensor.copy_(torch.from_numpy(array))

    def __call__(self, values, dtype: torch.dtype) -> torch.Tensor:
        if self.staging is not None:
            return self.staging.to_device(values, dtype)
        if self._pending is None:
            return torch.as_tensor(values, dtype=dtype)
        array = np.asarray(values, dtype=_NUMPY_DTYPES[dtype])
        poison = torch.full(array.shape, -(1 << 30) if dtype != torch.float32 else float("nan"), dtype=dtype)
        self._pending.append((poison, array))
        return poison


def build_sampling_metadata(requests: list[Request], to_device: HostToDevice, vocab_size: int,
                            positions: list[int], step_seed: int,
                            proposed: dict[int, list[int]] | None = None) -> SamplingMetadata:
    """The sampler's settings for one row per request (temperature, seeds, top-k/p, min-p,
    penalties with the token history, the ids that ``min_tokens`` and ``bad_words`` ban, the
    grammar bitmask of structured outputs, the label ids of ``logprob_token_ids``, the logits
    processors with each row's token ids, the tokens thinking budgets force). ``positions``:
    how many output tokens each request sampled before this one; ``step_seed``: see ``row_seeds``;
    ``proposed``: a row's proposed tokens before it (speculative decoding), part of its history
    for penalties, bad words, logits processors and thinking budgets."""
    params = [r.sampling_params for r in requests]

    def history(row: int) -> list[int]:  # the output tokens sampling at ``row`` reads
        before = proposed.get(row) if proposed else None
        return requests[row].output_token_ids + before if before else requests[row].output_token_ids

    temperatures = [0.0 if p.greedy else p.temperature for p in params]
    meta = SamplingMetadata(
        temperature=to_device(temperatures, torch.float32),
        seeds=to_device(row_seeds([r.seed for r in requests], positions, step_seed), torch.int64),
        tempered=any(t not in (0.0, 1.0) for t in temperatures))
    _filters(meta, params, to_device, vocab_size)
    if any(p.has_penalties for p in params):
        meta.presence_penalty = to_device([p.presence_penalty for p in params], torch.float32)
        meta.frequency_penalty = to_device([p.frequency_penalty for p in params], torch.float32)
        meta.repetition_penalty = to_device([p.repetition_penalty for p in params], torch.float32)
        meta.output_token_ids = _padded([history(row) for row in range(len(requests))], to_device, vocab_size)
        meta.prompt_token_ids = _padded([r.prompt_token_ids for r in requests], to_device, vocab_size)
    meta.banned_token_ids = _bans(requests, positions, history, to_device)
    if any(p.has_logits_controls for p in params):
        meta.logit_bias, meta.allowed_token_ids = _logits_controls(params, to_device)
    if any(r.grammar is not None for r in requests):
        meta.grammar_bitmask = _grammar_bitmask(requests, to_device, proposed or {})
    if any(p.logits_processors for p in params):
        meta.logits_processors = [(i, p.logits_processors, tuple(r.prompt_token_ids), history(i))
                                  for i, (r, p) in enumerate(zip(requests, params)) if p.logits_processors]
    if any(r.thinking is not None or p.trace_decode_token_ids is not None for r, p in zip(requests, params)):
        meta.forced_token_ids, meta.replayed_token_ids = _forced_tokens(requests, positions, to_device,
                                                                        proposed or {})
    wanted = [p.logprobs or 0 for p in params if p.wants_logprobs]
    meta.max_num_logprobs = max(wanted) if wanted else None
    if any(p.logprob_token_ids for p in params):
        width = max(len(p.logprob_token_ids or ()) for p in params)
        meta.label_token_ids = to_device([_repeat_to(p.logprob_token_ids or [0], width) for p in params],
                                         torch.int64)
    return meta


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1, _MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_UINT64 = (1 << 64) - 1


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (a bijection of uint64 that mixes every bit into every bit)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def mix_seeds(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Output ``counters`` of a SplitMix64 stream started at the mixed ``keys`` (uint64 arrays, in
    uint64 arithmetic modulo 2**64)."""
    return _splitmix64(_splitmix64(keys) + (counters + np.uint64(1)) * _GOLDEN)


def row_seeds(request_seeds: list[int | None], positions: list[int], step_seed: int) -> np.ndarray:
    """Each row's 64-bit noise seed (as int64): for a request with its own seed, that seed (any
    integer, taken modulo 2**64) mixed with the position of the token it samples, so its k-th token
    draws the same noise in any batch, run, preemption or schedule; for the others, ``step_seed``
    (drawn once a step from the engine's seed) mixed with the row."""
    seeded = np.array([s is not None for s in request_seeds], dtype=bool)
    keys = np.array([(step_seed if s is None else s) & _UINT64 for s in request_seeds], dtype=np.uint64)
    counters = np.where(seeded, np.asarray(positions, dtype=np.uint64),
                        np.arange(len(request_seeds), dtype=np.uint64))
    return mix_seeds(keys, counters).view(np.int64)


def _filters(meta: SamplingMetadata, params: list, to_device: HostToDevice, vocab_size: int) -> None:
    """Fill ``meta``'s top-k/top-p/min-p of the sampled rows that use any of them."""
    rows = [row for row, p in enumerate(params)
            if not p.greedy and (p.top_k or p.top_p < 1.0 or p.min_p > 0.0)]
    if not rows:
        return
    used = [params[row] for row in rows]
    meta.filtered_rows = to_device(rows, torch.int64)
    if any(p.top_k for p in used):
        meta.top_k = to_device([p.top_k or vocab_size for p in used], torch.int64)
    if any(p.top_p < 1.0 for p in used):
        meta.top_p = to_device([p.top_p for p in used], torch.float32)
    if any(p.min_p > 0.0 for p in used):
        meta.min_p = to_device([p.min_p for p in used], torch.float32)


def _repeat_to(ids: list[int], width: int) -> list[int]:
    return (ids * width)[:width]


def _grammar_bitmask(requests: list[Request], to_device: HostToDevice,
                     proposed: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, packed bitmask) of the rows whose grammar still runs, filled from each matcher's
    state: every token the request kept must have been accepted first, and a row after proposed
    tokens (``proposed``) reads them as accepted. A request that finished while this step was
    queued samples a token that is dropped, so its row stays unmasked."""
    rows = [row for row, r in enumerate(requests)
            if r.grammar is not None and not r.is_finished and not r.grammar.is_terminated]
    if not rows:
        return None
    bitmask = grammar_bitmask([requests[row].grammar for row in rows], [proposed.get(row) for row in rows])
    return to_device(rows, torch.int64), to_device(bitmask.numpy(), torch.int32)


def _bans(requests: list[Request], positions: list[int], history: Callable[[int], list[int]],
          to_device: HostToDevice) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) that rows may not sample: EOS (with ``ignore_eos`` too, as vLLM) and stop
    ids while fewer than ``min_tokens`` output tokens come before the sampled one (its position:
    the host's count of output and pending tokens already holds the sampled token itself where a
    grammar batch builds its inputs after launching), and the last token of each bad word whose
    other tokens end the output so far."""
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for row, (r, position) in enumerate(zip(requests, positions)):
        p = r.sampling_params
        ids = []
        if position < p.min_tokens:
            ids = list(p.stop_token_ids) + list(r.eos_token_ids)
        if r.bad_words_token_ids:
            ids += bad_word_bans(r.bad_words_token_ids, history(row))
        banned_rows.extend([row] * len(ids))
        banned_ids.extend(ids)
    if not banned_rows:
        return None
    # device index tensors: indexing with host lists would wait for the GPU
    return to_device(banned_rows, torch.int64), to_device(banned_ids, torch.int64)


def _forced_tokens(requests: list[Request], positions: list[int], to_device: HostToDevice,
                   proposed: dict[int, list[int]]) -> tuple[tuple | None, tuple | None]:
    """The (rows, token ids) a thinking budget forces, and those a trace replays (its token at the
    row's output position; a trace wins over a budget), each None without such rows; a row after
    proposed tokens counts them. A thinking budget's are built where each request's tokens are all
    on the host, or where none of those still pending could make its row forced
    (``Request.samples_after_read_back``); a trace's need only the position."""
    forced: tuple[list[int], list[int]] = ([], [])
    replayed: tuple[list[int], list[int]] = ([], [])
    for row, (r, position) in enumerate(zip(requests, positions)):
        token, into = trace_token(r.sampling_params, position), replayed
        if token is None and r.thinking is not None:
            token, into = r.thinking.forced_token(r.all_token_ids, proposed.get(row, ())), forced
        if token is not None:
            into[0].append(row)
            into[1].append(token)
    return tuple((to_device(rows, torch.int64), to_device(ids, torch.int64)) if rows else None
                 for rows, ids in (forced, replayed))


def _logits_controls(params: list, to_device: HostToDevice):
    """(rows, ids, biases) of the rows' logit_bias and (restricted rows, index into them, ids) of
    their allowed_token_ids, as device tensors (each None when no row has it)."""
    bias_rows, bias_ids, biases = [], [], []
    allowed_rows, allowed_index, allowed_ids = [], [], []
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            bias_rows.append(row)
            bias_ids.append(token)
            biases.append(bias)
        if p.allowed_token_ids is not None:
            allowed_index.extend([len(allowed_rows)] * len(p.allowed_token_ids))
            allowed_ids.extend(p.allowed_token_ids)
            allowed_rows.append(row)
    bias = ((to_device(bias_rows, torch.int64), to_device(bias_ids, torch.int64),
             to_device(biases, torch.float32)) if bias_rows else None)
    allowed = ((to_device(allowed_rows, torch.int64), to_device(allowed_index, torch.int64),
                to_device(allowed_ids, torch.int64)) if allowed_rows else None)
    return bias, allowed


def _padded(rows: list[list[int]], to_device: HostToDevice, vocab_size: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return to_device([r + [vocab_size] * (width - len(r)) for r in rows], torch.int64)
