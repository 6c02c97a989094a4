"""The Triton attention backend: the GPU path (on the CPU its kernels run only under
``TRITON_INTERPRET=1``), and its planner.

The planner decides per batch whether a decode batch attends its shared prefix once (cascade
attention: ``cascade_prefix_len``), and which forms decode CUDA graphs are captured in: every
size in the plain form, sizes of ``CASCADE_MIN_SEQS`` and up in the cascade form too, whose
shared length lives in device memory (``CascadeBuffers``) and is set before each replay. The
split-KV layout of a launch is chosen from host ints alone (``choose_split_kv_size``), so a
graph and an eager step of the same shape run the same kernels. Prefill launches on a GPU take
the query tiles the backend's ``PrefillTileTuner`` times at each shape's first use and keeps in
the cache directory (``kernels/attention_tuning.py``); they never change a result. In
batch-invariant mode there is no cascade, every launch uses the same query tile, and a split is
only into the mode's fixed key segments, which unsplit launches fold in the same order
(``batch_invariant=True``).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedlab.cache import cache_root
from pagedlab.kernels import kv_write, paged_attention
from pagedlab.kernels.attention_tuning import CACHE_FILE, PrefillTileTuner
from pagedlab.kernels.paged_attention import TILE_N, CascadeBuffers
from pagedlab.layers.attention.base import AttentionBackend, AttentionMetadata, BatchLayout
from pagedlab.layers.batch_invariant import batch_invariant_enabled

# Cascade attention pays from 16 sequences sharing 2^17 (sequences x prefix keys) keys: below
# that the extra launch and reduce cost more than the prefix reads they save.
CASCADE_MIN_SEQS = 16
CASCADE_MIN_SHARED_KEYS = 1 << 17


def cascade_prefix_len(block_tables: np.ndarray, seq_lens: list[int], block_size: int) -> int:
    """Keys at the start of every sequence of a decode batch held in the same blocks, rounded down
    to whole key tiles; 0 where cascade attention would not pay (see ``CASCADE_MIN_*``)."""
    num_seqs = len(seq_lens)
    if num_seqs < CASCADE_MIN_SEQS:
        return 0
    limit = (min(seq_lens) - 1) // block_size  # each query keeps at least its own key
    same = (block_tables[:, :limit] == block_tables[0, :limit]).all(axis=0)
    common_blocks = limit if same.all() else int(same.argmin())
    prefix_len = common_blocks * block_size // TILE_N * TILE_N
    return prefix_len if prefix_len * num_seqs >= CASCADE_MIN_SHARED_KEYS else 0


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    shares_prefixes = True
    supports_cuda_graphs = True

    def __init__(self):
        # prefill launches on a GPU take the tiles tuned at their shape's first use (kept on disk)
        self.prefill_tuner = PrefillTileTuner(cache_root() / CACHE_FILE)

    def plan(self, metadata: AttentionMetadata, layout: BatchLayout) -> None:
        """An eager step: cascade buffers where the batch shares a prefix worth attending once."""
        shared = self._shared_prefix_len(layout)
        if shared:
            buffers = CascadeBuffers.allocate(len(layout.seq_lens), metadata.seq_lens.device)
            buffers.set_prefix_len(shared)
            metadata.plan = buffers

    def graph_forms(self, num_seqs: int, allow_cascade: bool) -> tuple[str, ...]:
        cascade = allow_cascade and num_seqs >= CASCADE_MIN_SEQS and not batch_invariant_enabled()
        return ("plain", "cascade") if cascade else ("plain",)

    def graph_plan(self, form: str, num_seqs: int, device: torch.device) -> CascadeBuffers | None:
        return CascadeBuffers.allocate(num_seqs, device) if form == "cascade" else None

    def select_graph_form(self, layout: BatchLayout, plans: dict[str, CascadeBuffers | None]) -> str:
        shared = self._shared_prefix_len(layout)
        if not shared or "cascade" not in plans:
            return "plain"
        plans["cascade"].set_prefix_len(shared)
        return "cascade"

    @staticmethod
    def _shared_prefix_len(layout: BatchLayout) -> int:
        if not layout.allow_cascade or not layout.decode_only or batch_invariant_enabled():
            return 0
        return cascade_prefix_len(layout.block_table, layout.seq_lens, layout.block_size)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        kv_write.write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def rotate_and_write_kv(self, q, k, v, rope, q_norm, k_norm, k_cache, v_cache, slot_mapping, k_scale=1.0,
                            v_scale=1.0):
        """One kernel (``kv_write.rotate_and_write_kv_triton``), in batch-invariant mode too: each
        program's numbers depend on its own token's rows alone."""
        norm = None
        if q_norm is not None:
            if (q_norm.eps, q_norm.unit_offset) != (k_norm.eps, k_norm.unit_offset):
                raise ValueError(f"q_norm (eps={q_norm.eps}, unit_offset={q_norm.unit_offset}) and k_norm "
                                 f"(eps={k_norm.eps}, unit_offset={k_norm.unit_offset}) must match")
            norm = kv_write.QKNorm(q_norm.weight, k_norm.weight, q_norm.eps, q_norm.unit_offset)
        return kv_write.rotate_and_write_kv_triton(q, k, v, *rope, k_cache, v_cache, slot_mapping, k_scale,
                                                   v_scale, norm)

    def attend(self, q, k_cache, v_cache, metadata, scale, k_scale=1.0, v_scale=1.0, sliding_window=None,
               softcap=None):
        if isinstance(metadata.plan, CascadeBuffers):
            if sliding_window is not None:  # the engine turns cascade off for windowed models
                raise ValueError("cascade attention cannot run a sliding-window layer")
            return paged_attention.cascade_attention_triton(
                q, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
                metadata.plan, scale, metadata.max_seq_len, k_scale, v_scale, softcap)
        invariant = batch_invariant_enabled()
        split_size = None  # the default mode's policy
        if invariant:  # the mode splits only into its key segments, which a windowed layer has not
            split_size = paged_attention.BATCH_INVARIANT_SPLIT_KV_SIZE if sliding_window is None else 0
        split_kv_size = max_kv_segments = None
        num_seqs, num_kv_heads = metadata.seq_lens.shape[0], k_cache.shape[2]
        if split_size != 0:
            split_kv_size = paged_attention.choose_split_kv_size(
                num_seqs, num_kv_heads, metadata.max_query_len, metadata.max_seq_len, split_size)
        if split_kv_size is not None and not invariant:
            max_kv_segments = paged_attention.SPLIT_KV_MAX_SEGMENTS
        return paged_attention.paged_attention_triton(
            q, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale,
            max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len,
            split_kv_size=split_kv_size, max_kv_segments=max_kv_segments, k_scale=k_scale, v_scale=v_scale,
            sliding_window=sliding_window, softcap=softcap, batch_invariant=invariant,
            prefill_tuner=self.prefill_tuner if q.is_cuda else None,
            seq_order=metadata.seq_order)
