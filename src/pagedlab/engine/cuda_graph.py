"""CUDA graphs for decode steps: one captured forward per padded batch size and attention form.

A decode step of B sequences replays the graph of the smallest captured size >= B. Its inputs
are copied into static buffers; padding rows write no KV (slot -1) and attend over one key of
block 0, and their outputs are ignored. The LM head and the sampler run outside the graph.

Each size is captured in every form the attention backend names for it (the Triton backend: a
plain form and, from 16 sequences up, a cascade form); before a replay the backend picks the
form for the batch and updates that form's persistent plan (e.g. the shared prefix's length).
"""

from __future__ import annotations

import bisect

import torch

from pagedlab.layers.attention import AttentionBackend, AttentionMetadata, BatchLayout, forward_context


def capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    """1, 2, 4, 8, then steps of 16: every size below ``max_num_seqs`` (at most ``limit``) and the
    first one that covers it."""
    candidates = [1, 2, 4, 8] + list(range(16, limit + 1, 16))
    cap = min(max_num_seqs, limit)
    return [s for s in candidates if s < cap] + [next(s for s in candidates if s >= cap)]


class CudaGraphRunner:
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
        # size -> form -> the backend's persistent plan; (size, form) -> graph and its output
        self.plans = {size: {form: backend.graph_plan(form, size, device)
                             for form in backend.graph_forms(size, allow_cascade)} for size in self.sizes}
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}

    def _metadata(self, size: int, form: str) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            max_query_len=1, max_seq_len=self.max_model_len, plan=self.plans[size][form])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size in each of its forms, largest first, into one shared memory pool."""
        pool = None
        for size in reversed(self.sizes):
            for form in self.plans[size]:
                graph = torch.cuda.CUDAGraph()
                with forward_context(self._metadata(size, form), self.backend):
                    self.model(self.input_ids[:size], self.positions[:size])  # warm-up: compiles kernels
                    torch.cuda.synchronize()
                    with torch.cuda.graph(graph, pool=pool):
                        self.outputs[size, form] = self.model(self.input_ids[:size], self.positions[:size])
                if pool is None:
                    pool = graph.pool()
                self.graphs[size, form] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """Replay the graph for this decode batch (``layout`` is its host description, from which
        the backend picks the form); returns hidden states ``[num_seqs, hidden]``."""
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
        form = self.backend.select_graph_form(layout, self.plans[size])
        self.graphs[size, form].replay()
        return self.outputs[size, form][:n]

    def close(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
