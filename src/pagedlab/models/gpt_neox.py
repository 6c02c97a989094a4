"""GPT-NeoX / Pythia (``GPTNeoXForCausalLM``): LayerNorm with biases, rotary embedding on the
leading ``partial_rotary_factor`` of each head, a GELU MLP, and (``use_parallel_residual``)
attention and MLP reading the same input: ``x + attn(ln1(x)) + mlp(ln2(x))``.

The checkpoint's ``query_key_value`` interleaves per head (``[heads, 3, head_dim]`` rows); it is
regrouped into q, k and v at load, which reads the whole tensor on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedlab.distributed.sharding import read_whole
from pagedlab.layers.attention import Attention
from pagedlab.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlab.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedlab.layers.norm import LayerNorm
from pagedlab.layers.rotary import RotaryEmbedding, rotary_dim_of
from pagedlab.models.checkpoint import check_fused, load_checkpoint, require_dense
from pagedlab.models.gpt2 import GeluMLP


class GPTNeoXAttention(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.head_dim = hidden // heads
        bias = getattr(hf_config, "attention_bias", True)
        self.query_key_value = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=bias)
        self.num_heads = self.query_key_value.num_heads
        self.dense = RowParallelLinear(hidden, hidden, bias=bias)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query_key_value(hidden).view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)
        out = self.attn(q, k, v, rope)
        return self.dense(out.reshape(-1, self.num_heads * self.head_dim))


class GPTNeoXLayer(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.layer_norm_eps
        self.use_parallel_residual = bool(getattr(hf_config, "use_parallel_residual", True))
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        self.attention = GPTNeoXAttention(hf_config)
        self.mlp = GeluMLP(hf_config, hf_config.intermediate_size, "hidden_act", "dense_h_to_4h",
                           "dense_4h_to_h")

    def forward(self, rope, hidden: torch.Tensor) -> torch.Tensor:
        attn_out = self.attention(rope, self.input_layernorm(hidden))
        if self.use_parallel_residual:
            return hidden + attn_out + self.mlp(self.post_attention_layernorm(hidden))
        normed, hidden = self.post_attention_layernorm(attn_out, hidden)
        return hidden + self.mlp(normed)


class GPTNeoXModel(nn.Module):
    def __init__(self, hf_config, max_position: int):
        super().__init__()
        self.embed_in = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        head_dim = hf_config.hidden_size // hf_config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(hf_config, rotary_dim_of(hf_config, head_dim), max_position)
        self.layers = nn.ModuleList(GPTNeoXLayer(hf_config) for _ in range(hf_config.num_hidden_layers))
        self.final_layer_norm = LayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_in(input_ids)
        rope = self.rotary_emb(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(rope, hidden)
        return self.final_layer_norm(hidden)


class GPTNeoXForCausalLM(nn.Module):
    """GPT-NeoX/Pythia causal LM over flat varlen batches (``input_ids``/``positions``: ``[num_tokens]``)."""

    def __init__(self, hf_config, max_position: int, quantization: str | None = None):
        super().__init__()
        self.config = hf_config
        require_dense(hf_config, quantization, "GPT-NeoX")
        self.gpt_neox = GPTNeoXModel(hf_config, max_position)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.embed_out = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                        tie_to=self.gpt_neox.embed_in if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.gpt_neox(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the full vocabulary (gathered from every rank)."""
        return self.embed_out(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.attention.attn for layer in self.gpt_neox.layers]

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Copy this rank's part of each checkpoint tensor into the parameters (names set)."""
        return load_checkpoint(self, weights, self.route)

    def route(self, name: str, tensor) -> Iterator[tuple[str, int | None, object]]:
        """Where checkpoint tensor ``name`` goes: ``query_key_value`` regrouped from per-head
        interleaved rows into q, k, v; stored masks and inverse frequencies skipped; ``lm_head``
        (transformers 5's in-memory name, ``model.state_dict()``) is the checkpoint's ``embed_out``."""
        if name == "lm_head.weight":
            name = "embed_out.weight"
        if name.endswith((".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")) or (
                self.tie_word_embeddings and name == "embed_out.weight"):
            return
        if ".query_key_value." not in name:
            yield name, None, tensor
            return
        heads = self.config.num_attention_heads
        full = read_whole(tensor)
        check_fused(full, [self.config.hidden_size] * 3)
        per_head = full.reshape(heads, 3, -1, *full.shape[1:])  # [heads, q/k/v, head_dim, (hidden)]
        for shard_id in range(3):
            yield name, shard_id, per_head[:, shard_id].reshape(-1, *full.shape[1:])
