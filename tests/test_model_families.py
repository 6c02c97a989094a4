"""The model families beyond Llama (GPT-2, GPT-NeoX/Pythia, Phi-3, Gemma 2/3, Mixtral, Qwen3-MoE)
against HF transformers in float32 on the CPU: greedy tokens and logprobs through chunked
prefill, prefix caching and preemption at once; random ("dummy") weights; tensor parallelism at
two ranks; the unsupported features refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_hf_tokens_and_logprobs, build_tiny_model, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.loader import load_model, resolve_model_source

MAX_TOKENS = 12


def _prompts():
    """Five prompts, three sharing a 36-token prefix (prefix-cache hits)."""
    prefix = random_prompts(1, min_len=36, max_len=36, seed=7)[0]
    return [prefix + p for p in random_prompts(3, min_len=2, max_len=16, seed=8)] + random_prompts(
        2, min_len=30, max_len=50, seed=9)


def _check_engine_matches_hf(tiny, kv_heads: int, **engine_args):
    """16-token steps (chunked prefill), prefix caching and a KV cache of 8 blocks for five
    sequences of about 50 tokens (preemption): HF's greedy tokens, and logprobs within 1e-4 of HF's."""
    prompts = _prompts()
    cfg = tiny.hf_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_hidden_layers * 16 * kv_heads * head_dim * 4
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    with LLM(tiny.path, dtype="float32", kv_cache_memory_bytes=8 * block_bytes, max_model_len=128,
             max_num_batched_tokens=16, enable_prefix_caching=True, **engine_args) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.num_preemptions > 0
    assert_hf_tokens_and_logprobs(tiny.hf_model, prompts, outs, MAX_TOKENS)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1  # not one degenerate output


FAMILIES = pytest.mark.parametrize("arch, kv_heads", [
    ("gpt2", 4), ("gpt_neox", 4), ("phi3", 2), ("gemma2", 2), ("gemma3", 2), ("mixtral", 2),
    ("qwen3_moe", 2), ("mistral_window", 2), ("phi3_longrope", 2),
], ids=["gpt2", "pythia", "phi3-partial-rotary", "gemma2-softcaps-local-global-window-16",
        "gemma3-local-global-rope-window-16", "mixtral-8-experts-top-2", "qwen3-moe-unnormalized-top-2",
        "mistral-window-16", "phi3-longrope-switch-at-32"])


@FAMILIES
def test_family_matches_hf_through_chunking_prefix_cache_and_preemption(tiny_models, arch, kv_heads):
    _check_engine_matches_hf(tiny_models(arch), kv_heads)


@FAMILIES
def test_dummy_weights_fill_every_parameter(tiny_models, arch, kv_heads):
    """``load_format="dummy"``: every parameter drawn, or set to its norm value (scales 1, Gemma's
    offset scales and biases 0)."""
    tiny = tiny_models(arch)
    source = resolve_model_source(tiny.path, "dummy")
    model = load_model(source, tiny.hf_model.config, torch.float32, torch.device("cpu"), 64)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if getattr(param, "dummy_value", None) is not None:
            assert (param == param.dummy_value).all(), name
        else:
            assert param.std() > 0.01, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@FAMILIES
def test_family_matches_hf_on_gpu_with_cuda_graphs(tiny_models, arch, kv_heads):
    """The same parity through the Triton kernels, with decode steps replayed from CUDA graphs."""
    _check_engine_matches_hf(tiny_models(arch), kv_heads, device="cuda", attention_backend="triton",
                             enforce_eager=False)


def test_sliding_window_generation_holds_bounded_blocks(tiny_models):
    """Mistral with a 16-token window, one sequence generating 100 tokens past its 40-token
    prompt: HF's tokens, in at most 4 blocks of 16 (a full cache would take 9); then a request
    repeating the prompt takes the released-but-intact prompt blocks as a cached prefix and
    still matches HF."""
    tiny = tiny_models("mistral_window")
    prompt = random_prompts(1, min_len=40, max_len=40, seed=11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    with LLM(tiny.path, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=16,
             enable_prefix_caching=True) as llm:
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        peak = llm.get_stats().peak_kv_blocks_used
        again = llm.generate([prompt + [5]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
        hits = llm.get_stats().prefix_cache_hit_tokens
    assert got == hf_greedy(tiny.hf_model, prompt, 100, eos_token_id=None)
    assert peak <= 4
    assert hits >= 32
    assert again == hf_greedy(tiny.hf_model, prompt + [5], 20, eos_token_id=None)


def test_longrope_sequence_crossing_the_switch_is_recomputed_with_long_factors(tiny_models):
    """Phi-3 LongRoPE switching at 32 tokens: prompts of 20-30 tokens generate past it (the
    whole sequence is recomputed with the long factors, as transformers does); then the same
    prompt again (short regime: it takes the blocks computed before the switch) and extended to
    40 tokens (long regime: the blocks recomputed after it), all HF's greedy tokens."""
    tiny = tiny_models("phi3_longrope")
    prompts = random_prompts(3, min_len=20, max_len=30, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(tiny.path, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64) as llm:
        crossed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [prompts[0], prompts[0] + crossed[0][:-2]]
        again_params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        repeated = [o.outputs[0].token_ids for o in llm.generate(again, again_params, use_tqdm=False)]
        assert llm.get_stats().prefix_cache_hit_tokens >= 16
    assert crossed == [hf_greedy(tiny.hf_model, p, 16, eos_token_id=None) for p in prompts]
    assert repeated == [hf_greedy(tiny.hf_model, p, 2, eos_token_id=None) for p in again]


def test_longrope_recompute_in_a_chunk_as_long_as_the_last_step_reads_its_new_blocks(tiny_models):
    """A lone 32-token prompt crosses the switch with its first token: the step that preempts it
    runs nothing, and its recompute's first chunk (32 tokens, the step budget) holds as many
    blocks as its last step did. Its block-table row must be its new blocks, not the last
    step's (freed) ones, whose short-regime keys would feed the long-regime recompute."""
    tiny = tiny_models("phi3_longrope")
    prompt = random_prompts(1, min_len=32, max_len=32, seed=16)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(tiny.path, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32,
             enable_prefix_caching=False) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        stats = llm.get_stats()
    assert stats.num_long_rope_recomputes == 1 and stats.num_preemptions == 0
    assert out == hf_greedy(tiny.hf_model, prompt, 12, eos_token_id=None)


def test_longrope_switch_is_counted_apart_from_preemptions(tiny_models):
    """Three sequences growing from 20-30 tokens past the switch at 32: with a KV cache that holds
    them all, each one's recompute with the long factors counts in ``num_long_rope_recomputes``,
    and ``num_preemptions`` (memory pressure) stays 0; in a KV cache of 5 blocks (3 per sequence)
    the same batch is preempted, and counted so, with the same tokens."""
    tiny = tiny_models("phi3_longrope")
    prompts = random_prompts(3, min_len=20, max_len=30, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 slots, 2 KV heads of 16, float32
    runs = {}
    for name, kv_blocks in (("ample", 256), ("tight", 5)):
        with LLM(tiny.path, dtype="float32", kv_cache_memory_bytes=kv_blocks * block_bytes, max_model_len=64,
                 max_num_batched_tokens=16) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[name] = ([o.outputs[0].token_ids for o in outs], llm.get_stats())
    ample, tight = runs["ample"][1], runs["tight"][1]
    assert ample.num_preemptions == 0 and ample.num_long_rope_recomputes == 3
    assert tight.num_preemptions > 0 and 1 <= tight.num_long_rope_recomputes <= 3
    assert runs["tight"][0] == runs["ample"][0]


@pytest.mark.parametrize("arch", ["gpt_neox_sequential", "mixtral"])
def test_two_ranks_give_hf_tokens(tiny_models, arch):
    """At tensor_parallel_size=2 over gloo: GPT-NeoX (sequential residual) with its per-head fused
    q/k/v regrouped and split by heads and its GELU MLP split by columns; Mixtral with every
    expert's intermediate dimension split."""
    tiny = tiny_models(arch)
    prompts = _prompts()[2:]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(tiny.path, dtype="float32", device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20,
             max_num_batched_tokens=16) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(tiny.hf_model, p, 6, eos_token_id=None) for p in prompts]


@pytest.mark.parametrize("arch, overrides, seed", [
    # GPT-NeoX-20B's "gelu_fast" (transformers' FastGELU: the tanh approximation written out)
    ("gpt_neox", {"hidden_act": "gelu_fast"}, 16),
    # Gemma 3 keeps attn_logit_softcapping in its config, but transformers' (and vLLM's) Gemma 3
    # attention never caps its logits (only Gemma 2's does): set, it changes nothing
    ("gemma3", {"attn_logit_softcapping": 1.0}, 17),
])
def test_config_settings_read_as_transformers_reads_them(tmp_path, arch, overrides, seed):
    """Greedy tokens and logprobs equal HF's on a config setting transformers reads its own way."""
    tiny = build_tiny_model(tmp_path, arch, **overrides)
    prompts = random_prompts(2, min_len=10, max_len=30, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    with LLM(tiny.path, dtype="float32", kv_cache_memory_bytes=16 << 20) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert_hf_tokens_and_logprobs(tiny.hf_model, prompts, outs, 6)


def test_unsupported_gpt2_variant_is_named(tmp_path):
    tiny = build_tiny_model(tmp_path / "gpt2", "gpt2")
    cfg = tiny.hf_model.config
    cfg.add_cross_attention = True
    from pagedlab.models.registry import build_model

    with pytest.raises(ValueError, match="add_cross_attention=True is not supported"):
        build_model(cfg, 64)


@pytest.mark.parametrize("arch, setting, value", [
    ("gpt2", "activation_function", "relu"), ("gpt_neox", "hidden_act", "quick_gelu"),
    ("gemma2", "hidden_activation", "gelu"), ("llama", "hidden_act", "relu"),
])
def test_unsupported_activation_is_refused_by_its_config_key(tiny_models, arch, setting, value):
    """The error names the config.json key the activation came from, as transformers reads it."""
    from pagedlab.models.registry import build_model

    cfg = copy.deepcopy(tiny_models(arch).hf_model.config)
    setattr(cfg, setting, value)
    with pytest.raises(ValueError, match=f"^{setting}='{value}' is not supported"):
        build_model(cfg, 64)


def test_per_layer_type_longrope_is_refused_by_name(tiny_models):
    from pagedlab.models.registry import build_model

    cfg = copy.deepcopy(tiny_models("gemma3").hf_model.config)
    cfg.rope_parameters["full_attention"] = {"rope_type": "longrope", "rope_theta": 10000.0,
                                             "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                             "original_max_position_embeddings": 32}
    with pytest.raises(ValueError, match=r"rope_type='longrope' per layer type \(full_attention\)"):
        build_model(cfg, 64)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_bidirectional_gemma_is_refused_by_name(tiny_models, arch):
    """transformers' Gemma with ``use_bidirectional_attention`` (EmbeddingGemma) lets every token
    see later ones (within half the window on Gemma 3's local layers): no causal decoder computes that."""
    from pagedlab.models.registry import build_model

    cfg = copy.deepcopy(tiny_models(arch).hf_model.config)
    cfg.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention=True is not supported"):
        build_model(cfg, 64)


def test_dense_layers_between_moe_layers_are_refused_by_name(tiny_models):
    from pagedlab.models.registry import build_model

    cfg = copy.deepcopy(tiny_models("qwen3_moe").hf_model.config)
    cfg.mlp_only_layers = [0]
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[0\]: dense layers between MoE layers"):
        build_model(cfg, 64)



def test_sliding_window_block_is_reused_the_step_it_is_released(tiny_models):
    """Mistral, 16-token window, blocks of 16, a pool of 2 blocks, 17 tokens a step, sequences of
    at most 32 tokens. A (20-token prompt) takes both blocks and B (20 tokens) waits for one. The
    last position A computes, 30, still sees token 15, so block 0 stays A's until A finishes. Were
    it released there, one token early, B's first 16-token chunk would overwrite it in that same
    step and A would read B's keys: HF's tokens and logprobs catch it. Nothing stays held."""
    tiny = tiny_models("mistral_window")
    prompts = random_prompts(2, min_len=20, max_len=20, seed=15)
    cfg = tiny.hf_model.config
    block_bytes = 2 * cfg.num_hidden_layers * 16 * 2 * 16 * 4  # 16 slots x 2 KV heads x head_dim 16
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    with LLM(tiny.path, dtype="float32", kv_cache_memory_bytes=2 * block_bytes, max_model_len=32,
             max_num_batched_tokens=17, block_size=16) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
    assert stats.num_kv_blocks == 2 and stats.kv_blocks_used == 0
    assert_hf_tokens_and_logprobs(tiny.hf_model, prompts, outs, 12)
