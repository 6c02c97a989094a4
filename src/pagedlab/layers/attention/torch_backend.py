"""The plain-PyTorch attention backend: runs anywhere, the definition of correct. Its plans (the
decode rows' slots and masks, each prefill's causal mask) are built once per step and sliding
window from the metadata and shared by every layer with that window. In batch-invariant mode
every query row attends alone (``paged_attention_rows_torch``), with no plan."""

from __future__ import annotations

from pagedlab.kernels.kv_write import write_kv_torch
from pagedlab.kernels.paged_attention import (paged_attention_rows_torch, paged_attention_torch,
                                              plan_torch_attention)
from pagedlab.layers.attention.base import AttentionBackend, AttentionMetadata, BatchLayout
from pagedlab.layers.batch_invariant import batch_invariant_enabled


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, metadata: AttentionMetadata, layout: BatchLayout) -> None:
        metadata.plan = {}  # sliding window (None: full attention) -> its plan, built on first use

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        write_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q, k_cache, v_cache, metadata, scale, k_scale=1.0, v_scale=1.0, sliding_window=None,
               softcap=None):
        if batch_invariant_enabled():
            return paged_attention_rows_torch(q, k_cache, v_cache, metadata.query_start_loc,
                                              metadata.seq_lens, metadata.block_tables, scale,
                                              k_scale, v_scale, sliding_window, softcap)
        if metadata.plan is None:  # metadata built without a planner (kernel tests)
            metadata.plan = {}
        plan = metadata.plan.get(sliding_window)
        if plan is None:
            plan = metadata.plan[sliding_window] = plan_torch_attention(
                metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, k_cache.shape[1],
                sliding_window)
        return paged_attention_torch(q, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens,
                                     metadata.block_tables, scale, plan=plan, k_scale=k_scale,
                                     v_scale=v_scale, softcap=softcap)
