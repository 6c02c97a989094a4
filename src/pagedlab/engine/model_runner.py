"""Turns a ScheduledBatch into flat tensors, runs the model over the paged KV cache, samples.

Owns the weights, the KV cache tensors and the sampler. Logits are computed only for the
positions that sample, plus every prompt position of requests that asked for prompt logprobs.

``launch`` queues a step's work and returns without waiting for the GPU: the sampled ids stay on
the device (the next step may read its pending input ids from there) and are copied to pinned
host memory behind an event that ``LaunchedStep.result`` waits for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedlab.config import model_max_len
from pagedlab.engine.cuda_graph import CudaGraphRunner
from pagedlab.engine.request import Request
from pagedlab.engine.scheduler import ScheduledBatch
from pagedlab.kernels.paged_attention import CascadeBuffers, cascade_prefix_len
from pagedlab.layers.attention import AttentionBackend, AttentionMetadata, forward_context
from pagedlab.layers.sampler import Sampler, SamplingMetadata, TopLogprobs, gather_logprobs

logger = logging.getLogger(__name__)


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs for positions ``start..start+len`` of one request (of the token at each)."""

    start: int
    token_ids: list[int]
    logprobs: TopLogprobs  # CPU tensors


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

    def sample_rows(self) -> dict[Request, int]:
        return {request: row for row, request in enumerate(self.sampled_requests)}

    def result(self) -> StepOutput:
        if self.done is not None:
            self.done.synchronize()
        token_ids = self.host_token_ids.tolist() if self.host_token_ids is not None else []
        return StepOutput(self.sampled_requests, token_ids, self.logprobs, self.prompt_logprobs)


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


class PinnedStaging:
    """Host-to-device copies through two reused pinned buffers, used by alternate steps. Pinning
    a fresh tensor for every input cost ~0.1 ms each, over 1 ms per decode step. A buffer is
    written again only after the event of the step that last used it has passed."""

    def __init__(self, device: torch.device, nbytes: int = 1 << 22):
        self.device = device
        self._buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._released: list[torch.cuda.Event | None] = [None, None]
        self._current = 0
        self._offset = 0

    def begin_step(self) -> None:
        self._current ^= 1
        event = self._released[self._current]
        if event is not None:
            event.synchronize()
        self._offset = 0

    def end_step(self, event: torch.cuda.Event) -> None:
        """``event`` is recorded after every copy queued since ``begin_step``."""
        self._released[self._current] = event

    def to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        array = np.asarray(values, dtype=_NUMPY_DTYPES[dtype])
        start = -(-self._offset // 64) * 64
        buffer = self._buffers[self._current]
        if start + array.nbytes > buffer.numel():
            torch.cuda.current_stream(self.device).synchronize()  # copies queued from the old buffer
            buffer = torch.empty(max(2 * buffer.numel(), array.nbytes), dtype=torch.uint8, pin_memory=True)
            self._buffers[self._current], start = buffer, 0
        self._offset = start + array.nbytes
        host = buffer[start:self._offset].view(dtype).view(array.shape)
        host.numpy()[...] = array
        return host.to(self.device, non_blocking=True)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, hf_config, device: torch.device, dtype: torch.dtype,
                 block_size: int, backend: AttentionBackend, seed: int = 0):
        self.model = model
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.backend = backend
        self.vocab_size = hf_config.vocab_size
        attn = model.attention_layers()[0]
        self.num_layers = len(model.attention_layers())
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.kv_cache: torch.Tensor | None = None
        # Upper bound on sequence length the attention kernels are told, for eager steps and
        # captured graphs alike, so both choose the same split-KV layout.
        self.max_model_len = model_max_len(hf_config)
        self.cascade_attention = True  # decode batches attend a shared prefix once (if the backend can)
        self.cuda_graphs: CudaGraphRunner | None = None
        self._profiled_peaks: dict[tuple[int, int], int] = {}
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.staging = PinnedStaging(device) if device.type == "cuda" else None
        # the last step's block table and each request's (row, block count) in it
        self._block_table = np.zeros((0, 0), dtype=np.int32)
        self._block_table_rows: dict[Request, tuple[int, int]] = {}

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        """Host data to the device; on CUDA through pinned memory, without waiting for the copy."""
        if self.staging is None:
            return torch.as_tensor(values, dtype=dtype)
        return self.staging.to_device(values, dtype)

    def _build_block_table(self, requests: list[Request]) -> np.ndarray:
        """``[num_seqs, max_blocks]`` block ids. A request's ids only grow while it stays scheduled
        (a preempted one misses at least one step first), so a row whose request and block count
        match the last step's is copied from it: refilling every row from Python lists cost
        ~0.7 ms per step at 256 sequences of 2k tokens."""
        counts = [len(r.block_ids) for r in requests]
        table = np.zeros((len(requests), max(counts)), dtype=np.int32)
        previous, previous_rows = self._block_table, self._block_table_rows
        kept_rows, kept_sources = [], []
        for row, (request, count) in enumerate(zip(requests, counts)):
            source = previous_rows.get(request)
            if source is not None and source[1] == count:
                kept_rows.append(row)
                kept_sources.append(source[0])
            else:
                table[row, :count] = request.block_ids
        width = min(table.shape[1], previous.shape[1])
        table[kept_rows, :width] = previous[kept_sources, :width]
        self._block_table = table
        self._block_table_rows = {request: (row, count) for row, (request, count) in enumerate(zip(requests, counts))}
        return table

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        """Capture decode graphs over the current KV cache (call again after re-allocating it)."""
        self.release_cuda_graphs()
        self.cuda_graphs = CudaGraphRunner(self.model, self.backend, self.device, max_num_seqs, self.max_model_len,
                                           self.block_size, self.cascade_attention and self.backend.shares_prefixes)
        self.cuda_graphs.capture()

    def release_cuda_graphs(self) -> None:
        if self.cuda_graphs is not None:
            self.cuda_graphs.close()
            self.cuda_graphs = None

    # ---- KV cache -------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor ``[2, layers, blocks, block_size, kv_heads, head_dim]``; each layer gets views."""
        self.free_kv_cache()
        self.kv_cache = torch.zeros(2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads,
                                    self.head_dim, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def free_kv_cache(self) -> None:
        self.release_cuda_graphs()
        self._block_table_rows.clear()
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def profile_gpu_kv_blocks(self, num_tokens: int, max_model_len: int, gpu_memory_utilization: float) -> int:
        """Blocks that fit in ``gpu_memory_utilization`` of the GPU next to the weights and the
        activations' peak of the largest step (``num_tokens`` tokens)."""
        key = (num_tokens, min(num_tokens, max_model_len))
        if key not in self._profiled_peaks:  # re-planning with the same step size reuses it
            self._profiled_peaks[key] = self._profile_peak_memory(*key)
        peak = self._profiled_peaks[key]
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        available = total * gpu_memory_utilization - used_by_others - peak
        logger.info("KV cache: %.2f GiB available (weights + activation peak %.2f GiB for %d tokens)",
                    available / 2**30, peak / 2**30, num_tokens)
        return int(available // self.bytes_per_block)

    def _profile_peak_memory(self, num_tokens: int, seq_len: int) -> int:
        """Bytes allocated at the peak of a forward over ``num_tokens`` tokens, KV cache excluded."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_seqs = -(-num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        self.allocate_kv_cache(num_seqs * blocks_per_seq)
        block_tables = torch.arange(num_seqs * blocks_per_seq, device=self.device,
                                    dtype=torch.int32).view(num_seqs, blocks_per_seq)
        lens = [seq_len] * num_seqs
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        slot_mapping = (block_tables[:, :, None] * self.block_size
                        + torch.arange(self.block_size, device=self.device, dtype=torch.int32)).flatten(1)
        slot_mapping = slot_mapping[:, :seq_len].flatten().long()
        metadata = self._metadata(slot_mapping, lens, lens, block_tables)
        with torch.inference_mode(), forward_context(metadata, self.backend):
            hidden = self.model(torch.zeros_like(positions), positions)
            self.model.compute_logits(hidden[-min(num_seqs * 256, len(hidden)):])
        torch.cuda.synchronize(self.device)
        kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        peak = torch.cuda.max_memory_allocated(self.device) - kv_bytes
        self.free_kv_cache()
        return peak

    # ---- one step -------------------------------------------------------------------------
    def _metadata(self, slot_mapping, query_lens: list[int], seq_lens: list[int], block_tables,
                  cascade_prefix: int = 0) -> AttentionMetadata:
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=self._to_device(starts, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_tables=block_tables,
            max_query_len=max(query_lens),
            max_seq_len=self.max_model_len,
            cascade=self._cascade_buffers(len(seq_lens), cascade_prefix) if cascade_prefix else None,
        )

    def _cascade_buffers(self, num_rows: int, prefix_len: int) -> CascadeBuffers:
        buffers = CascadeBuffers.allocate(num_rows, self.device)
        buffers.set_prefix_len(prefix_len)
        return buffers

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Device data to the host; on CUDA an asynchronous copy into pinned memory, valid once the
        step's ``done`` event has passed."""
        if self.device.type != "cuda":
            return tensor.cpu()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def _top_to_host(self, top: TopLogprobs) -> TopLogprobs:
        return TopLogprobs(*(self._to_host(t) for t in (top.token_logprob, top.token_rank, top.top_ids,
                                                         top.top_logprobs)))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's forward pass and sampling. A request whose input token is still pending
        takes it from ``previous``'s sampled ids on the device, without a round trip to the host."""
        if self.staging is not None:
            self.staging.begin_step()
        input_ids: list[int] = []
        pending_rows: list[int] = []  # flat token index whose id comes from ``previous``
        pending_sources: list[int] = []  # its row in ``previous``'s sampled ids
        previous_rows = previous.sample_rows() if previous is not None else None
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []  # flat token index of each sampling request's last token
        prompt_rows: list[int] = []  # flat token indices whose prompt logprobs are wanted
        prompt_chunks: dict[str, tuple[int, int, int]] = {}  # request -> (first prompt row, count, start)
        sampled: list[Request] = []
        bs = self.block_size
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = request.num_computed_tokens
            offset = len(input_ids)
            seq_lens.append(start + n)
            if n == 1:  # decode: scalar arithmetic beats numpy's per-call cost
                if start < request.num_tokens:
                    input_ids.append(request.all_token_ids[start])
                else:  # sampled by the step still in flight
                    pending_rows.append(offset)
                    pending_sources.append(previous_rows[request])
                    input_ids.append(0)
                positions.append(start)
                slots.append(request.block_ids[start // bs] * bs + start % bs)
            else:
                input_ids.extend(request.all_token_ids[start:start + n])
                pos = np.arange(start, start + n)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(request.block_ids)[pos // bs] * bs + pos % bs).tolist())
            if request.wants_prompt_logprobs and start < request.num_prompt_tokens - 1:
                count = min(start + n, request.num_prompt_tokens - 1) - start
                prompt_chunks[request.request_id] = (len(prompt_rows), count, start)
                prompt_rows.extend(range(offset, offset + count))
            if batch.samples(i):
                sampled.append(request)
                sample_rows.append(offset + n - 1)
        table = self._build_block_table(batch.requests)
        ids = self._to_device(input_ids, torch.int64)
        if pending_rows:
            ids[self._to_device(pending_rows, torch.int64)] = \
                previous.sampled_token_ids[self._to_device(pending_sources, torch.int64)]
        pos = self._to_device(positions, torch.int64)
        slot_mapping = self._to_device(slots, torch.int64)
        block_tables = self._to_device(table, torch.int32)
        decode_only = len(input_ids) == len(batch.requests) and not prompt_rows
        shared = 0  # keys all sequences hold in the same blocks, for cascade attention
        if decode_only and self.cascade_attention and self.backend.shares_prefixes:
            shared = cascade_prefix_len(table, seq_lens, bs)
        if decode_only and self.cuda_graphs is not None and self.cuda_graphs.can_run(len(input_ids)):
            hidden = self.cuda_graphs.run(ids, pos, slot_mapping, self._to_device(seq_lens, torch.int32),
                                          block_tables, shared)
        else:
            metadata = self._metadata(slot_mapping, batch.num_new_tokens, seq_lens, block_tables, shared)
            with forward_context(metadata, self.backend):
                hidden = self.model(ids, pos)
        step = LaunchedStep(batch, sampled)
        rows = sample_rows + prompt_rows
        if rows:
            logits = self.model.compute_logits(hidden[self._to_device(rows, torch.int64)]).float()
            step.prompt_logprobs = self._prompt_logprobs(logits[len(sample_rows):], batch, prompt_chunks)
        if sampled:
            out = self.sampler(logits[:len(sample_rows)], self._sampling_metadata(sampled))
            step.sampled_token_ids = out.token_ids
            step.host_token_ids = self._to_host(out.token_ids)
            step.logprobs = self._top_to_host(out.logprobs) if out.logprobs is not None else None
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()
            self.staging.end_step(step.done)
        return step

    def _prompt_logprobs(self, logits, batch, prompt_rows) -> dict[str, PromptLogprobsChunk]:
        result = {}
        by_id = {r.request_id: r for r in batch.requests}
        for request_id, (first, count, start) in prompt_rows.items():
            request = by_id[request_id]
            targets = request.prompt_token_ids[start + 1:start + 1 + count]
            logprobs = logits[first:first + count].log_softmax(-1)
            top = gather_logprobs(logprobs, self._to_device(targets, torch.int64),
                                  request.sampling_params.prompt_logprobs)
            result[request_id] = PromptLogprobsChunk(start + 1, targets, self._top_to_host(top))
        return result

    def _sampling_metadata(self, requests: list[Request]) -> SamplingMetadata:
        params = [r.sampling_params for r in requests]

        def column(values, dtype=torch.float32):
            return self._to_device(values, dtype)

        greedy = [p.greedy for p in params]
        meta = SamplingMetadata(
            temperature=column([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            greedy=column(greedy, torch.bool),
            top_k=column([p.top_k or self.vocab_size for p in params], torch.int64)
            if any(p.top_k for p in params) else None,
            top_p=column([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None,
            min_p=column([p.min_p for p in params]) if any(p.min_p > 0.0 for p in params) else None,
            generators=[r.generator for r in requests],
            all_greedy=all(greedy),
        )
        if any(p.has_penalties for p in params):
            meta.presence_penalty = column([p.presence_penalty for p in params])
            meta.frequency_penalty = column([p.frequency_penalty for p in params])
            meta.repetition_penalty = column([p.repetition_penalty for p in params])
            meta.output_token_ids = self._padded([r.output_token_ids for r in requests])
            meta.prompt_token_ids = self._padded([r.prompt_token_ids for r in requests])
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens + r.num_pending_tokens < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                if ids:
                    banned_rows.extend([row] * len(ids))
                    banned_ids.extend(ids)
        if banned_rows:  # device index tensors: indexing with host lists would wait for the GPU
            meta.banned_token_ids = (self._to_device(banned_rows, torch.int64),
                                     self._to_device(banned_ids, torch.int64))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(wanted) if wanted else None
        return meta

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(r) for r in rows))
        return self._to_device([r + [self.vocab_size] * (width - len(r)) for r in rows], torch.int64)

