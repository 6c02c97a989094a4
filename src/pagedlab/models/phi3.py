"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): the Llama decoder, with q/k/v and gate/up already
fused in the checkpoint (``qkv_proj``, ``gate_up_proj``) and, in Phi-4-mini, rotary embedding on
part of each head (``partial_rotary_factor``).

The fused checkpoint tensors are split along their output dimension into the parts of the fused
parameters, so each tensor-parallel rank reads only its own part: a dense or FP8 ``weight`` by
rows, AWQ's ``qweight``/``qzeros``/``scales`` by (packed) columns, per-channel FP8 scales by rows;
a per-tensor scale (one value) serves every part. LongRoPE ("su") scaling switches to its long
factors for sequences past ``original_max_position_embeddings`` (see ``layers.rotary``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from pagedlab.distributed.sharding import checkpoint_shape, read_shard
from pagedlab.models.checkpoint import check_fused
from pagedlab.models.llama import LlamaForCausalLM, head_dim_of

_FUSED = ("qkv_proj", "gate_up_proj")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM over flat varlen batches (``input_ids``/``positions``: ``[num_tokens]``)."""

    def route(self, name: str, tensor) -> Iterator[tuple[str, int | None, object]]:
        """Where checkpoint tensor ``name`` goes: fused ``qkv_proj``/``gate_up_proj`` tensors split
        in their parts, everything else as in Llama."""
        module, _, leaf = name.rpartition(".")
        if module.rpartition(".")[2] not in _FUSED:
            yield from super().route(name, tensor)
            return
        cfg = self.config
        if module.endswith("qkv_proj"):
            head_dim = head_dim_of(cfg)
            kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
            sizes = [cfg.num_attention_heads * head_dim, kv, kv]
        else:
            sizes = [cfg.intermediate_size] * 2
        parts = self._split(module, leaf, tensor, sizes)
        yield from ((name, shard_id, part) for shard_id, part in enumerate(parts))

    def _split(self, module: str, leaf: str, tensor, sizes: list[int]) -> Iterator[object]:
        """The parts of fused checkpoint tensor ``module.leaf`` of ``sizes`` output features each,
        along the dimension (and in the units) the layer's parameter runs along the outputs; a
        dense checkpoint ``weight`` (quantized at load) by rows."""
        try:
            layer = self.get_submodule(module)
        except AttributeError:  # no such layer: its parts have no place (``load_checkpoint`` says so)
            layer = None
        spec = getattr(getattr(layer, leaf, None), "spec", None)
        dim, unit = (0, 1) if leaf == "weight" or spec is None else (spec.out_dim, spec.out_unit)
        if dim is None or math.prod(checkpoint_shape(tensor)) == 1:
            yield from (tensor for _ in sizes)  # a per-tensor scale: each part's
            return
        check_fused(tensor, sizes, dim, unit)
        start = 0
        for size in sizes:
            yield read_shard(tensor, dim, unit, start, size, "output")
            start += size
