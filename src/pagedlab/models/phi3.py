"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): the Llama decoder, with q/k/v and gate/up already
fused in the checkpoint (``qkv_proj``, ``gate_up_proj``) and, in Phi-4-mini, rotary embedding on
part of each head (``partial_rotary_factor``).

The fused checkpoint tensors are split row-wise into the parts of the fused parameters, so each
tensor-parallel rank reads only its own rows. LongRoPE ("su") scaling switches to its long
factors for sequences past ``original_max_position_embeddings`` (see ``layers.rotary``).
"""

from __future__ import annotations

from collections.abc import Iterator

from pagedlab.models.checkpoint import split_rows
from pagedlab.models.llama import LlamaForCausalLM, head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM over flat varlen batches (``input_ids``/``positions``: ``[num_tokens]``)."""

    def route(self, name: str, tensor) -> Iterator[tuple[str, int | None, object]]:
        """Where checkpoint tensor ``name`` goes: fused ``qkv_proj``/``gate_up_proj`` split in
        their parts, everything else as in Llama."""
        cfg = self.config
        if name.endswith(".qkv_proj.weight"):
            head_dim = head_dim_of(cfg)
            kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
            sizes = [cfg.num_attention_heads * head_dim, kv, kv]
        elif name.endswith(".gate_up_proj.weight"):
            sizes = [cfg.intermediate_size] * 2
        else:
            yield from super().route(name, tensor)
            return
        yield from ((name, shard_id, part) for shard_id, part in enumerate(split_rows(tensor, sizes)))
