"""Issue 15's benchmark shapes, mixtures of experts and Gemma 2 (``pagedlab.workloads.model_shape``
builds them by name): transformers configs for dummy weights."""

from __future__ import annotations


def _qwen3_30b_a3b():
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645, dtype="bfloat16", architectures=["Qwen3MoeForCausalLM"])


def _mixtral_8x7b():
    import transformers

    return transformers.MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, dtype="bfloat16", architectures=["MixtralForCausalLM"])


def _gemma2_9b():
    import transformers

    return transformers.Gemma2Config(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="bfloat16",
        architectures=["Gemma2ForCausalLM"])


FAMILY_SHAPES = {"qwen3-30b-a3b": _qwen3_30b_a3b, "mixtral-8x7b": _mixtral_8x7b, "gemma2-9b": _gemma2_9b}
