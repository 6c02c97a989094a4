"""The Llama decoder family: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

Layers with a sliding window (``config.attention_windows``: Mistral's ``sliding_window``, the
local layers of Gemma and Qwen) attend only within it; every family built on this class gets it.

They differ only in two switches, so one implementation serves them all. Built as one rank of
a tensor-parallel group (``pagedlab.distributed.parallel_state``), each layer holds its shard:
``num_heads / N`` query heads and their KV heads, ``intermediate_size / N`` of the MLP, ``1 / N``
of the vocabulary; its attention layers (and so its KV cache) have the rank's head counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from pagedlab.config import attention_windows
from pagedlab.distributed.parallel_state import get_tp_world_size
from pagedlab.distributed.head_split import divide_evenly
from pagedlab.layers.activation import GatedActivation
from pagedlab.layers.attention import Attention
from pagedlab.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlab.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedlab.layers.norm import RMSNorm
from pagedlab.layers.rotary import RotaryEmbedding, rotary_dim_of
from pagedlab.models.checkpoint import load_checkpoint
from pagedlab.quantization.formats import resolve_quant_config
from pagedlab.quantization.linear_method import linear_method_for, takes_quantized_activations


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, hf_config, qkv_bias: bool, qk_norm: bool, prefix: str, quant_config=None):
        super().__init__()
        hidden = hf_config.hidden_size
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(hf_config)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias,
                                          linear_method=linear_method_for(quant_config, f"{prefix}.qkv_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden,
                                        bias=getattr(hf_config, "attention_bias", False),
                                        linear_method=linear_method_for(quant_config, f"{prefix}.o_proj"))
        eps = hf_config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, rope, self.q_norm, self.k_norm)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderMLP(nn.Module):
    """The gated MLP: ``down(act(gate(x)) * up(x))`` (``act`` by its transformers name, from the
    config key ``act_setting``: Gemma's is ``hidden_activation``)."""

    def __init__(self, hf_config, prefix: str, quant_config=None, act_setting: str = "hidden_act"):
        super().__init__()
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        bias = getattr(hf_config, "mlp_bias", False)
        divide_evenly(inter, get_tp_world_size(), "intermediate_size")  # the config's name in the error
        self.gate_up_proj = ColumnParallelLinear(
            hidden, [inter, inter], bias=bias,
            linear_method=linear_method_for(quant_config, f"{prefix}.gate_up_proj"))
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=bias, linear_method=linear_method_for(quant_config, f"{prefix}.down_proj"))
        self.act = GatedActivation(getattr(hf_config, act_setting, "silu"), act_setting)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fuses = getattr(self.gate_up_proj, "fuses_silu", None)  # not a LoRA wrapper
        # fused where the projection's SiLU-and-mul is what the activation would hand down_proj
        if (self.act.name == "silu" and fuses is not None and fuses(x)
                and self.gate_up_proj.silu_emits_fp8 == self.act.fp8_output):
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, hf_config, qkv_bias: bool, qk_norm: bool, prefix: str, quant_config=None,
                 mlp_class: type[nn.Module] = DecoderMLP):
        super().__init__()
        self.self_attn = DecoderAttention(hf_config, qkv_bias, qk_norm, f"{prefix}.self_attn", quant_config)
        self.mlp = mlp_class(hf_config, f"{prefix}.mlp", quant_config)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def emit_fp8_inputs(self) -> int:
        """Load-time step: each producer whose one consumer is an FP8 linear with dynamic
        per-token activation scales (``takes_quantized_activations``: not a LoRA wrapper) emits
        that linear's quantized input itself: the RMSNorm before qkv_proj, the one before
        gate_up_proj and the SiLU-and-mul before down_proj (o_proj's input comes from attention
        and is quantized by the linear). Returns how many producers do."""
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, DecoderMLP):
            pairs += [(self.post_attention_layernorm, self.mlp.gate_up_proj),
                      (self.mlp.act, self.mlp.down_proj)]
        return sum(producer.emit_fp8(takes_quantized_activations(consumer)) for producer, consumer in pairs)

    def fold_norms(self) -> int:
        """Load-time step (after ``emit_fp8_inputs``): each RMSNorm hands its computation to the
        module its output goes to, where that module folds it into its GEMV (``RMSNorm.fold_into``):
        qkv_proj, and the MLP's gate_up_proj or the MoE block. Returns how many norms fold."""
        mlp = self.mlp.gate_up_proj if isinstance(self.mlp, DecoderMLP) else self.mlp
        attention = self.input_layernorm.fold_into(self.self_attn.qkv_proj)
        return attention + self.post_attention_layernorm.fold_into(mlp)

    def forward(self, rope, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    mlp_class: ClassVar[type[nn.Module]] = DecoderMLP  # built as mlp_class(hf_config, prefix, quant_config)

    def __init__(self, hf_config, qkv_bias: bool, qk_norm: bool, max_position: int,
                 quantization: str | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        head_dim = head_dim_of(hf_config)
        self.rotary_emb = RotaryEmbedding(hf_config, rotary_dim_of(hf_config, head_dim), max_position)
        quant_config = resolve_quant_config(quantization, hf_config)  # None: dense linears
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, qkv_bias, qk_norm, f"model.layers.{i}", quant_config, self.mlp_class)
            for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over flat varlen batches (``input_ids``/``positions``: ``[num_tokens]``)."""

    # checkpoint name -> (our fused parameter, shard index)
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    # built as decoder_class(hf_config, qkv_bias, qk_norm, max_position, quantization); Gemma brings its own
    decoder_class: ClassVar[type[nn.Module]] = DecoderModel

    def __init__(self, hf_config, max_position: int, qkv_bias: bool = False, qk_norm: bool = False,
                 quantization: str | None = None):
        super().__init__()
        self.config = hf_config
        qkv_bias = qkv_bias or getattr(hf_config, "attention_bias", False)
        self.model = self.decoder_class(hf_config, qkv_bias, qk_norm, max_position, quantization)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                      tie_to=self.model.embed_tokens if self.tie_word_embeddings else None)
        for attn, window in zip(self.attention_layers(), attention_windows(hf_config)):
            attn.sliding_window = window

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the full vocabulary (gathered from every rank)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def emit_fp8_inputs(self) -> int:
        """Fuse the FP8 activation quantization into its producers in every ``DecoderLayer``
        (``DecoderLayer.emit_fp8_inputs``; families with their own layers, Gemma's, keep theirs
        unfused). Run once after load and after LoRA wraps its linears; returns the producers."""
        return sum(layer.emit_fp8_inputs() for layer in self.model.layers if isinstance(layer, DecoderLayer))

    def fold_norms(self) -> int:
        """Fold the RMSNorms of every ``DecoderLayer`` into their consumers' GEMVs where they can
        (``DecoderLayer.fold_norms``); run once after ``emit_fp8_inputs``. Returns the norms."""
        return sum(layer.fold_norms() for layer in self.model.layers if isinstance(layer, DecoderLayer))

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Copy this rank's part of each full checkpoint tensor (a ``torch.Tensor`` or a lazy
        safetensors slice) into the parameters; returns the names of the parameters set."""
        return load_checkpoint(self, weights, self.route)

    def route(self, name: str, tensor) -> Iterator[tuple[str, int | None, object]]:
        """Where checkpoint tensor ``name`` goes (see ``pagedlab.models.checkpoint``)."""
        if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
            return
        shard_id = None
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.packed_modules:
            fused, shard_id = self.packed_modules[parts[-2]]
            parts[-2] = fused
        yield ".".join(parts), shard_id, tensor
