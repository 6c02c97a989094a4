"""GPT-2 (``GPT2LMHeadModel``): learned absolute positions, pre-LayerNorm with biases, a fused
q/k/v projection, a GELU MLP and an LM head tied to the token embedding.

The checkpoint stores its linears as ``Conv1D`` (weight ``[in, out]``), so each weight is
transposed at load; that reads the whole tensor on every tensor-parallel rank (GPT-2's largest
matrix is 1600 x 6400). ``c_attn`` holds q, k and v one after another and is split into the
three parts of a ``QKVParallelLinear``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedlab.distributed.sharding import read_whole
from pagedlab.layers.activation import Gelu
from pagedlab.layers.attention import Attention
from pagedlab.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlab.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedlab.layers.norm import LayerNorm
from pagedlab.models.checkpoint import load_checkpoint, require_dense, split_rows


class GeluMLP(nn.Module):
    """``proj(gelu(fc(x)))`` with biases: the MLP of GPT-2 and GPT-NeoX (``fc`` column-, ``proj``
    row-parallel); the GELU named by the config key ``act_setting``."""

    def __init__(self, hf_config, intermediate: int, act_setting: str, fc_name: str, proj_name: str):
        super().__init__()
        hidden = hf_config.hidden_size
        self.fc_name, self.proj_name = fc_name, proj_name
        self.add_module(fc_name, ColumnParallelLinear(hidden, intermediate, bias=True))
        self.add_module(proj_name, RowParallelLinear(intermediate, hidden, bias=True))
        self.act = Gelu(getattr(hf_config, act_setting), act_setting)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.proj_name)(self.act(getattr(self, self.fc_name)(x)))


class GPT2Attention(nn.Module):
    def __init__(self, hf_config, layer_idx: int):
        super().__init__()
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.head_dim = hidden // heads
        self.c_attn = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True)
        self.num_heads = self.c_attn.num_heads
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        scale = self.head_dim ** -0.5 if getattr(hf_config, "scale_attn_weights", True) else 1.0
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)
        out = self.attn(q, k, v)
        return self.c_proj(out.reshape(-1, self.num_heads * self.head_dim))


class GPT2Block(nn.Module):
    def __init__(self, hf_config, layer_idx: int):
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.layer_norm_epsilon
        self.ln_1 = LayerNorm(hidden, eps)
        self.attn = GPT2Attention(hf_config, layer_idx)
        self.ln_2 = LayerNorm(hidden, eps)
        inner = getattr(hf_config, "n_inner", None) or 4 * hidden
        self.mlp = GeluMLP(hf_config, inner, "activation_function", "c_fc", "c_proj")

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        """Takes and returns (this sublayer's output, the residual stream before it)."""
        hidden, residual = (self.ln_1(hidden), hidden) if residual is None else self.ln_1(hidden, residual)
        hidden, residual = self.ln_2(self.attn(hidden), residual)
        return self.mlp(hidden), residual


class GPT2Model(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        self.wte = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        positions, hidden = hf_config.max_position_embeddings, hf_config.hidden_size
        self.wpe = nn.Embedding(positions, hidden).requires_grad_(False)
        self.h = nn.ModuleList(GPT2Block(hf_config, i) for i in range(hf_config.num_hidden_layers))
        self.ln_f = LayerNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.wte(input_ids) + F.embedding(positions, self.wpe.weight)
        residual = None
        for block in self.h:
            hidden, residual = block(hidden, residual)
        hidden, _ = self.ln_f(hidden, residual)
        return hidden


class GPT2LMHeadModel(nn.Module):
    """GPT-2 causal LM over flat varlen batches (``input_ids``/``positions``: ``[num_tokens]``)."""

    conv1d_weights: ClassVar[tuple[str, ...]] = ("c_attn.weight", "c_proj.weight", "c_fc.weight")

    def __init__(self, hf_config, max_position: int, quantization: str | None = None):
        super().__init__()
        self.config = hf_config
        require_dense(hf_config, quantization, "GPT-2")
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True is not supported: only the decoder-only "
                             "model is")
        self.transformer = GPT2Model(hf_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                      tie_to=self.transformer.wte if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the full vocabulary (gathered from every rank)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [block.attn.attn for block in self.transformer.h]

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Copy this rank's part of each checkpoint tensor into the parameters (names set)."""
        return load_checkpoint(self, weights, self.route)

    def route(self, name: str, tensor) -> Iterator[tuple[str, int | None, object]]:
        """Where checkpoint tensor ``name`` goes: Conv1D weights transposed, ``c_attn`` split in
        q/k/v; the stored causal masks (``attn.bias``) skipped."""
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # the original checkpoints name GPT2Model's tensors bare
        if name.endswith((".attn.bias", ".attn.masked_bias")) or (
                self.tie_word_embeddings and name == "lm_head.weight"):
            return
        if name.endswith(self.conv1d_weights):
            tensor = read_whole(tensor).t()
        if ".c_attn." in name:
            parts = split_rows(tensor, [self.config.hidden_size] * 3)
            yield from ((name, shard_id, part) for shard_id, part in enumerate(parts))
            return
        yield name, None, tensor
