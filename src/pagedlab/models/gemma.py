"""Gemma 2 and Gemma 3 (text): the Llama decoder's projections with Gemma's own arrangement.

- embeddings scaled by sqrt(hidden); RMSNorm scaled by ``1 + weight``;
- a norm after attention and one before and after the MLP (``post_attention_layernorm``,
  ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``); a GELU-tanh gated MLP;
- attention scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 3 adds q/k RMSNorm and its own
  RoPE base per layer type (local ``sliding_attention`` layers 10k, global ones 1M);
- final logit soft-capping ``cap * tanh(logits / cap)`` where the config sets it.

The local layers attend within ``sliding_window`` keys (set by ``LlamaForCausalLM``); Gemma 2's
attention logit soft-capping (``attn_logit_softcapping``) runs inside the attention kernels
(Gemma 3 ignores the setting, as transformers does).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlab.layers.attention import Attention
from pagedlab.layers.embedding import VocabParallelEmbedding
from pagedlab.layers.fusion import fused
from pagedlab.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedlab.layers.norm import RMSNorm, norm_then_add_norm
from pagedlab.layers.rotary import RotaryEmbedding, rotary_dim_of
from pagedlab.models.llama import DecoderMLP, LlamaForCausalLM, head_dim_of
from pagedlab.quantization.formats import resolve_quant_config
from pagedlab.quantization.linear_method import linear_method_for


class GemmaAttention(nn.Module):
    def __init__(self, hf_config, qk_norm: bool, prefix: str, quant_config=None):
        super().__init__()
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.head_dim = head_dim_of(hf_config)
        bias = getattr(hf_config, "attention_bias", False)
        kv_heads = hf_config.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, kv_heads, bias=bias,
                                          linear_method=linear_method_for(quant_config, f"{prefix}.qkv_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=bias,
                                        linear_method=linear_method_for(quant_config, f"{prefix}.o_proj"))
        eps = hf_config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, unit_offset=True) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, unit_offset=True) if qk_norm else None
        scale = hf_config.query_pre_attn_scalar ** -0.5
        # Gemma 3 (the q/k-norm one) keeps attn_logit_softcapping in its config, but neither
        # transformers nor vLLM applies it there: only Gemma 2 caps attention logits
        softcap = None if qk_norm else getattr(hf_config, "attn_logit_softcapping", None)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, softcap=softcap)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), rope, self.q_norm, self.k_norm)
        return self.o_proj(out.reshape(-1, self.q_size))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, hf_config, qk_norm: bool, prefix: str, quant_config=None):
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = GemmaAttention(hf_config, qk_norm, f"{prefix}.self_attn", quant_config)
        self.mlp = DecoderMLP(hf_config, f"{prefix}.mlp", quant_config, act_setting="hidden_activation")
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            self.add_module(name, RMSNorm(hidden, eps, unit_offset=True))

    def forward(self, rope, hidden: torch.Tensor, residual: torch.Tensor):
        """Takes (this layer's normalized input, the residual stream before it); returns (the
        MLP's output before ``post_feedforward_layernorm``, the residual stream after attention):
        the model applies that norm together with the next residual add and norm."""
        hidden, residual = norm_then_add_norm(self.self_attn(rope, hidden), residual,
                                              self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return self.mlp(hidden), residual


class GemmaDecoderModel(nn.Module):
    def __init__(self, hf_config, qkv_bias: bool, qk_norm: bool, max_position: int,
                 quantization: str | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.embed_scale = hf_config.hidden_size ** 0.5
        num_layers = hf_config.num_hidden_layers
        self.layer_types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * num_layers)
        rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
        per_type = set(self.layer_types) <= set(rope_parameters)  # Gemma 3: one RoPE per layer type
        self.rope_keys = self.layer_types if per_type else ["default"] * num_layers
        head_dim = head_dim_of(hf_config)
        self.rotary_emb = nn.ModuleDict({
            key: RotaryEmbedding(hf_config, rotary_dim_of(hf_config, head_dim), max_position,
                                 key if per_type else None)
            for key in sorted(set(self.rope_keys))})
        quant_config = resolve_quant_config(quantization, hf_config)
        self.layers = nn.ModuleList(GemmaDecoderLayer(hf_config, qk_norm, f"model.layers.{i}", quant_config)
                                    for i in range(num_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, unit_offset=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)  # rounded as transformers does
        ropes = {key: emb(positions, hidden.dtype) for key, emb in self.rotary_emb.items()}
        hidden, residual = self.layers[0].input_layernorm(hidden), hidden
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, key, next_norm in zip(self.layers, self.rope_keys, next_norms):
            hidden, residual = layer(ropes[key], hidden, residual)
            hidden, residual = norm_then_add_norm(hidden, residual, layer.post_feedforward_layernorm,
                                                  next_norm)
        return hidden


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)``, as transformers computes it."""
    return torch.tanh(logits / cap) * cap


_soft_cap = fused(soft_cap)  # one kernel over the vocabulary instead of three


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 (text) causal LM over flat varlen batches; ``qk_norm`` switches Gemma 3's
    q/k norms on."""

    decoder_class = GemmaDecoderModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the full vocabulary, soft-capped where the config says
        (``final_logit_softcapping``)."""
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else _soft_cap(logits, cap)
