"""CUDA graphs of the model's forward at padded shapes, all in one memory pool.

Decode graphs: a decode step of B sequences replays the graph of the smallest captured size
>= B. Its inputs are copied into static buffers; padding rows write no KV (slot -1) and attend
over one key of block 0, and their outputs are ignored. Each size is captured in every form the
attention backend names for it (the Triton backend: a plain form and, from 16 sequences up, a
cascade form); before a replay the backend picks the form for the batch and updates that form's
persistent plan (e.g. the shared prefix's length).

Mixed graphs: a step with longer queries (prefill chunks, with or without decodes) of T tokens
replays the graph of the smallest token bucket >= T (``mixed_capture_sizes``). Attention is
inside the graph: the Triton kernel is one varlen launch whose grid depends only on the token
count, the sequence count and the query tile picked from ``max_query_len`` (an upper bound, no
host sync), so each bucket fixes all three: the sequences are padded to ``max_num_seqs + 1``
entries, ``max_query_len`` is the bucket, and there is no split-KV (a query longer than one
token never splits) nor cascade (the graphs capture no plan). vLLM cuts its graphs at attention
(piecewise graphs from torch.compile) because its FlashAttention varlen path cannot be captured
at a padded shape; ours can, so one graph covers the whole forward. The padding tokens T..bucket
form one extra sequence of their own (no context, keys of whatever blocks its stale table row
names, slot -1 so nothing is written): every padding row is computed from real numbers (an
uninitialised row could be NaN and reach, say, a MoE router), and its outputs are ignored. The
sequences after it have no tokens. All buckets write their hidden states into one static
buffer, so graphs do not each keep an output alive in the pool. The LM head and the sampler run
outside every graph, on the rows that sample.

``PAD_WITHOUT_CAPTURE`` (tests) builds the same static buffers and padded inputs but runs the
model eagerly on them instead of capturing: how the CPU checks the padding.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time

import torch

from pagedlab.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from pagedlab.layers.attention import AttentionBackend, AttentionMetadata, BatchLayout, forward_context

logger = logging.getLogger(__name__)

# Tests set this: graph runners skip capture and run each padded step eagerly (works on the CPU).
PAD_WITHOUT_CAPTURE = False
# Mixed graphs are captured up to this many tokens, the default step budget; larger steps run
# eagerly. Measured on the H200 (session 30, same call): W-nano (Qwen3-0.6B, 8,192-token steps)
# 24,726 / 24,651 -> 25,301 / 25,293 tok/s with graphs up to 8,192 instead of 2,048 (a small
# model's eager full-budget steps leave the GPU waiting on the host); W-seed batch 256 (Llama-3-8B,
# 188 ms steps that hide the host) 7,032 -> 7,012, within the noise between runs.
MAX_MIXED_GRAPH_TOKENS = DEFAULT_MAX_NUM_BATCHED_TOKENS


def capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    """1, 2, 4, 8, then steps of 16: every size below ``max_num_seqs`` (at most ``limit``) and the
    first one that covers it."""
    candidates = [1, 2, 4, 8] + list(range(16, limit + 1, 16))
    cap = min(max_num_seqs, limit)
    return [s for s in candidates if s < cap] + [next(s for s in candidates if s >= cap)]


def mixed_capture_sizes(max_num_batched_tokens: int, limit: int | None = None) -> list[int]:
    """Token buckets of mixed graphs: 16, 32, 48, then four per octave from 64 (64, 80, 96, 112,
    128, 160, ...: a step pads by less than a quarter), every one below the step budget (at most
    ``limit``, default ``MAX_MIXED_GRAPH_TOKENS`` as it is at the call) and the budget itself as
    the last. Few buckets keep capture to a few seconds; a full budget step, the common prefill
    step, pads by nothing."""
    cap = min(max_num_batched_tokens, MAX_MIXED_GRAPH_TOKENS if limit is None else limit)
    candidates = [16, 32, 48]
    octave = 64
    while octave < cap:
        candidates += [octave + k * octave // 4 for k in range(4)]
        octave *= 2
    return [s for s in candidates if s < cap] + [cap]


@contextlib.contextmanager
def blas_library(name: str):
    """Dense matmuls launched inside go to ``name`` (torch's ``preferred_blas_library``: "cublas"
    or "cublaslt"); a graph captured inside keeps those kernels. The process's choice comes back."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def _capture(graph_pool: dict, forward, *args) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run ``forward(*args)`` once (compiles kernels), then capture it into ``graph_pool["pool"]``."""
    forward(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=graph_pool.get("pool")):
        output = forward(*args)
    graph_pool.setdefault("pool", graph.pool())
    return graph, output


class CudaGraphRunner:
    """The decode graphs of one plan (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 max_num_seqs: int, max_model_len: int, block_size: int, allow_cascade: bool = True):
        self.model = model
        self.backend = backend
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        top = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.seq_order = torch.arange(top, dtype=torch.int32, device=device)
        self.identity_order = self.seq_order.clone()  # what padding rows take
        # size -> form -> the backend's persistent plan; (size, form) -> graph and its output
        self.plans = {size: {form: backend.graph_plan(form, size, device)
                             for form in backend.graph_forms(size, allow_cascade)} for size in self.sizes}
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}

    def _metadata(self, size: int, form: str) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            max_query_len=1, max_seq_len=self.max_model_len, plan=self.plans[size][form],
            seq_order=self.seq_order[:size])

    def _forward(self, size: int, form: str) -> torch.Tensor:
        with forward_context(self._metadata(size, form), self.backend):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self, graph_pool: dict) -> None:
        """Capture every size in each of its forms, largest first, into the shared pool."""
        for size in reversed(self.sizes):
            for form in self.plans[size]:
                self.graphs[size, form], self.outputs[size, form] = _capture(
                    graph_pool, self._forward, size, form)
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor, layout: BatchLayout,
            seq_order: torch.Tensor) -> torch.Tensor:
        """Replay the graph for this decode batch (``layout`` is its host description, from which
        the backend picks the form; ``seq_order`` its sequences longest first, the padding rows
        after them); returns hidden states ``[num_seqs, hidden]``."""
        n = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.block_tables[n:size].zero_()
        self.seq_order[:n].copy_(seq_order, non_blocking=True)
        self.seq_order[n:size].copy_(self.identity_order[n:size])
        form = self.backend.select_graph_form(layout, self.plans[size])
        if not self.graphs:  # PAD_WITHOUT_CAPTURE
            return self._forward(size, form)[:n]
        self.graphs[size, form].replay()
        return self.outputs[size, form][:n]

    def close(self) -> None:
        self.graphs.clear()
        self.outputs.clear()


def padded_sequences(query_lens: list[int], seq_lens: list[int], size: int,
                     num_entries: int) -> tuple[list[int], list[int]]:
    """``(query_start_loc, seq_lens)`` of a step padded to ``size`` tokens and ``num_entries``
    sequences: the step's sequences, one padding sequence of the tokens up to ``size`` (no
    context: its length is its query's), then sequences of no tokens."""
    if len(query_lens) >= num_entries:
        raise ValueError(f"a step of {len(query_lens)} sequences needs at most {num_entries - 1}")
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    if starts[-1] > size:
        raise ValueError(f"a step of {starts[-1]} tokens does not fit a graph of {size}")
    empty = num_entries - len(query_lens) - 1
    return starts + [size] * (empty + 1), list(seq_lens) + [size - starts[-1]] + [0] * empty


class MixedGraphs:
    """The graphs of steps with queries longer than one token, one per token bucket (see the
    module docstring)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 max_num_seqs: int, max_model_len: int, block_size: int, max_num_batched_tokens: int):
        self.model = model
        self.backend = backend
        self.max_model_len = max_model_len
        self.sizes = mixed_capture_sizes(max_num_batched_tokens)
        self.num_entries = max_num_seqs + 1  # the step's sequences, the padding one, empty ones
        top = self.sizes[-1]
        # the padding sequence may be longer than max_model_len: its table row must cover it
        width = max(-(-max_model_len // block_size), -(-top // block_size))
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(self.num_entries + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(self.num_entries, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.num_entries, width, dtype=torch.int32, device=device)
        self.hidden: torch.Tensor | None = None  # [top, hidden]: every graph's output
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _forward(self, size: int) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, block_tables=self.block_tables, max_query_len=size,
            max_seq_len=self.max_model_len)
        with forward_context(metadata, self.backend):
            return self.model(self.input_ids[:size], self.positions[:size])

    def _captured_forward(self, size: int) -> torch.Tensor:
        hidden = self._forward(size)
        if self.hidden is None:  # the largest bucket, captured first
            self.hidden = torch.empty((self.sizes[-1], *hidden.shape[1:]), dtype=hidden.dtype,
                                      device=hidden.device)
        return self.hidden[:size].copy_(hidden)

    @torch.inference_mode()
    def capture(self, graph_pool: dict) -> None:
        """Capture every bucket, largest first, into the shared pool; the capture batch is one
        padding sequence of the bucket's tokens."""
        for size in reversed(self.sizes):
            starts, lens = padded_sequences([], [], size, self.num_entries)
            self.query_start_loc.copy_(torch.tensor(starts, dtype=torch.int32))
            self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
            self.graphs[size], _ = _capture(graph_pool, self._captured_forward, size)
        torch.cuda.synchronize()

    def can_run(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.sizes[-1] and num_seqs < self.num_entries

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
            to_device) -> torch.Tensor:
        """Replay the bucket's graph for this step (``query_lens``/``seq_lens`` per sequence, on
        the host; ``to_device(values, dtype)`` stages host lists); returns hidden states
        ``[num_tokens, hidden]``."""
        n = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        starts, lens = padded_sequences(query_lens, seq_lens, size, self.num_entries)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.query_start_loc.copy_(to_device(starts, torch.int32), non_blocking=True)
        self.seq_lens.copy_(to_device(lens, torch.int32), non_blocking=True)
        num_seqs, width = block_tables.shape
        self.block_tables[:num_seqs, :width].copy_(block_tables, non_blocking=True)
        if size not in self.graphs:  # PAD_WITHOUT_CAPTURE
            return self._forward(size)[:n]
        self.graphs[size].replay()
        return self.hidden[:n]

    def close(self) -> None:
        self.graphs.clear()
        self.hidden = None


def capture_all(decode: CudaGraphRunner | None, mixed: MixedGraphs | None, device: torch.device) -> None:
    """Capture the mixed graphs (the largest activations first) and the decode graphs into one
    pool, and log what it took."""
    start = time.perf_counter()
    reserved = torch.cuda.memory_reserved(device)
    graph_pool: dict = {}
    # W-seed batch 64 +1.2%, the other workloads even (BENCHMARKS.md); a CPU build has no cuBLASLt
    blas = blas_library("cublaslt") if device.type == "cuda" else contextlib.nullcontext()
    with blas:
        for graphs in (mixed, decode):
            if graphs is not None:
                graphs.capture(graph_pool)
    logger.info("CUDA graphs: %d decode, %d mixed-step buckets captured in %.1f s (%.2f GiB more reserved)",
                len(decode.graphs) if decode else 0, len(mixed.graphs) if mixed else 0,
                time.perf_counter() - start, (torch.cuda.memory_reserved(device) - reserved) / 2**30)
