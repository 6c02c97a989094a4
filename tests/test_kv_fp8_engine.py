"""kv_cache_dtype="fp8" through the whole engine: greedy tokens against HF transformers running
the same model with its keys and values rounded to E4M3 (an attention function registered with
transformers: HF's own model code, torch's own FP8 cast), checkpoint k_scale/v_scale, the KV
cache's block count, prefix caching, chunked prefill and preemption, and the setting's
validation in the API, the CLI and the lab's YAML.

Why the token tests cannot pass by accident: the tiny random model's float-KV tokens differ from
its FP8-KV tokens on most prompts (asserted), so matching HF's FP8 tokens means pagedlab rounds
the same values the same way; and the run with checkpoint scales must differ from the run at
scale 1.0 (asserted) while matching HF at those scales.
"""

from __future__ import annotations

import shutil

import pytest
import torch


from conftest import KV_BYTES, hf_greedy, random_prompts
from pagedlab import LLM, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
E4M3_MAX = 448.0


def _fake_quantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded to E4M3 at ``scale`` and back, written from the definition (not pagedlab's)."""
    rounded = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (rounded.float() * scale).to(x.dtype)


@pytest.fixture(scope="module")
def hf_fp8_greedy():
    """``greedy(model, prompt, n, scales)``: HF greedy tokens with every cached key and value
    rounded to E4M3 (``scales``: layer -> (k_scale, v_scale), default 1.0)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scales: dict[int, tuple[float, float]] = {}

    def fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        return sdpa_attention_forward(module, query, _fake_quantized(key, k_scale),
                                      _fake_quantized(value, v_scale), attention_mask, **kwargs)

    AttentionInterface.register("pagedlab_test_fp8_kv", fp8_kv_attention)

    def greedy(model, prompt, max_new_tokens, layer_scales=None):
        scales.clear()
        scales.update(layer_scales or {})
        model.set_attn_implementation("pagedlab_test_fp8_kv")
        try:
            return hf_greedy(model, prompt, max_new_tokens, eos_token_id=None)
        finally:
            model.set_attn_implementation("sdpa")

    return greedy


def _tokens(path, prompts, params=GREEDY, **engine_args):
    engine_args.setdefault("kv_cache_memory_bytes", KV_BYTES)
    with LLM(path, dtype="float32", **engine_args) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_fp8_kv_gives_hf_tokens_over_e4m3_keys_and_values(tiny_llama, hf_fp8_greedy, backend):
    """Prefill, chunked prefill (16-token steps) and decode over an FP8 cache give HF's tokens
    over E4M3-rounded keys and values; the float cache's tokens are a different answer."""
    prompts = random_prompts(6, max_len=40, seed=5)[:6 if backend == "torch" else 3]  # interpreted: fewer
    expected = [hf_fp8_greedy(tiny_llama.hf_model, p, GREEDY.max_tokens) for p in prompts]
    float_kv = [hf_greedy(tiny_llama.hf_model, p, GREEDY.max_tokens, eos_token_id=None) for p in prompts]
    assert sum(a != b for a, b in zip(expected, float_kv)) >= 2  # E4M3 changes this model's answers
    got = _tokens(tiny_llama.path, prompts, kv_cache_dtype="fp8", attention_backend=backend,
                  max_num_batched_tokens=16)
    assert got == expected


def test_checkpoint_kv_scales_are_loaded_and_used(tmp_path, tiny_llama, hf_fp8_greedy):
    """A checkpoint's ``self_attn.k_scale``/``v_scale`` (vLLM's names) set each layer's scales:
    the tokens are HF's at those scales, not at 1.0; a float cache ignores them."""
    from safetensors.torch import save_file

    model_dir = tmp_path / "with_scales"
    shutil.copytree(tiny_llama.path, model_dir)
    # |k|, |v| reach about 3.3 here: scales that map them to a few hundred, and one (layer 1's
    # values) that saturates the largest at +-448 * 0.004
    scales = {0: (0.011, 0.009), 1: (0.013, 0.004)}
    save_file({f"model.layers.{i}.self_attn.{name}": torch.tensor(value)
               for i, pair in scales.items() for name, value in zip(("k_scale", "v_scale"), pair)},
              str(model_dir / "kv_scales.safetensors"))
    prompts = random_prompts(5, max_len=40, seed=6)
    expected = [hf_fp8_greedy(tiny_llama.hf_model, p, GREEDY.max_tokens, scales) for p in prompts]
    at_one = [hf_fp8_greedy(tiny_llama.hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert expected != at_one
    assert _tokens(str(model_dir), prompts, kv_cache_dtype="fp8") == expected
    float_kv = [hf_greedy(tiny_llama.hf_model, p, GREEDY.max_tokens, eos_token_id=None) for p in prompts]
    assert _tokens(str(model_dir), prompts) == float_kv


def test_bad_checkpoint_scale_names_the_tensor(tmp_path, tiny_llama):
    from safetensors.torch import save_file

    model_dir = tmp_path / "bad_scale"
    shutil.copytree(tiny_llama.path, model_dir)
    save_file({"model.layers.1.self_attn.v_scale": torch.tensor([-2.0])},
              str(model_dir / "scales.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.v_scale.*positive finite number.*-2.0"):
        LLM(str(model_dir), kv_cache_dtype="fp8", kv_cache_memory_bytes=KV_BYTES)


def test_fp8_cache_holds_twice_the_bf16_tokens(tiny_llama):
    """At one memory budget: blocks = budget // (K and V x layers x block_size x KV heads x
    head_dim x bytes per element), 1 byte for FP8, 2 for bf16, 4 for float32; and
    set_model_args switches the cache's dtype without reloading the weights."""
    budget = 3 << 20
    per_block_elements = 2 * 2 * 16 * 2 * 16  # tiny llama: 2 layers, 2 KV heads, head_dim 16
    blocks = {}
    for dtype, kv in [("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "auto"),
                      ("float32", "fp8_e4m3")]:
        with LLM(tiny_llama.path, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=budget) as llm:
            info = llm.get_engine_info()
            blocks[dtype, kv] = info.num_kv_blocks
            assert info.kv_cache_dtype == (torch.float8_e4m3fn if kv != "auto" else getattr(torch, dtype))
            assert llm.get_stats().kv_cache_bytes <= budget
    assert blocks["bfloat16", "auto"] == budget // (per_block_elements * 2)
    assert blocks["bfloat16", "fp8"] == budget // per_block_elements == 2 * blocks["bfloat16", "auto"]
    assert blocks["float32", "fp8_e4m3"] == 4 * blocks["float32", "auto"]
    with LLM(tiny_llama.path, dtype="bfloat16", kv_cache_memory_bytes=budget) as llm:
        weights = llm.llm_engine.model.model.embed_tokens.weight
        llm.set_model_args(kv_cache_dtype="fp8")
        assert llm.get_engine_info().num_kv_blocks == blocks["bfloat16", "fp8"]
        assert llm.llm_engine.model.model.embed_tokens.weight is weights
        assert llm.get_engine_info().resolved_settings()["kv_cache_dtype"] == "float8_e4m3fn"


def test_fp8_survives_preemption_and_prefix_cache_hits(tiny_llama, hf_fp8_greedy):
    """Eight blocks for five sequences growing to ~70 tokens force preemption (recomputed KV is
    quantized again, to the same bytes); a second pass over shared prefixes hits the cache. The
    tokens stay HF's over E4M3 keys and values."""
    prefix = random_prompts(1, min_len=32, max_len=32, seed=7)[0]
    prompts = [prefix + p for p in random_prompts(5, min_len=5, max_len=25, seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = [hf_fp8_greedy(tiny_llama.hf_model, p, 20) for p in prompts]
    per_block = 2 * 2 * 16 * 2 * 16  # bytes of one FP8 block
    with LLM(tiny_llama.path, dtype="float32", kv_cache_dtype="fp8", kv_cache_memory_bytes=8 * per_block,
             max_model_len=128, max_num_batched_tokens=16) as llm:
        assert llm.get_engine_info().num_kv_blocks == 8
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.get_stats().num_preemptions > 0
        llm.reset_stats()
        second = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params, use_tqdm=False)]
        assert llm.get_stats().prefix_cache_hit_tokens > 0
    assert first == expected
    assert second == expected[:2]


@pytest.mark.slow
def test_two_ranks_each_hold_an_fp8_cache(tiny_llama, hf_fp8_greedy):
    """Tensor parallelism (two processes over gloo): each rank's cache holds its KV heads in
    FP8; the tokens are HF's over E4M3 keys and values."""
    prompts = random_prompts(3, max_len=30, seed=9)
    expected = [hf_fp8_greedy(tiny_llama.hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert _tokens(tiny_llama.path, prompts, kv_cache_dtype="fp8", tensor_parallel_size=2) == expected


def test_bad_kv_cache_dtype_is_a_clear_error(tiny_llama):
    for bad in ("fp16", "fp8_e5m2", "int8", None):
        allowed = "'auto', 'fp8', 'fp8_e4m3'"
        with pytest.raises(ValueError, match=rf"kv_cache_dtype={bad!r} is invalid.*{allowed}"):
            EngineConfig(kv_cache_dtype=bad).validate()
    with pytest.raises(ValueError, match="kv_cache_dtype='float16' is invalid"):
        LLM(tiny_llama.path, kv_cache_dtype="float16", kv_cache_memory_bytes=KV_BYTES)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES) as llm, \
            pytest.raises(ValueError, match="kv_cache_dtype='e4m3' is invalid"):
        llm.set_model_args(kv_cache_dtype="e4m3")


def test_cli_flag_and_lab_yaml_take_the_setting(tmp_path, tiny_llama):
    import argparse

    from pagedlab.cli.engine_args import add_engine_args, engine_config_from_args
    from pagedlab.lab.experiments import experiment_from_dict
    from pagedlab.lab.runs import expand_runs
    from pagedlab.lab.schema import ExperimentError

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8"
    assert engine_config_from_args(parser.parse_args([])).kv_cache_dtype == "auto"
    base = {"name": "kv", "model": tiny_llama.path, "dataset": {"prompts": [[1, 2, 3]]}}
    runs = expand_runs(experiment_from_dict({**base, "grid": {"engine.kv_cache_dtype": ["auto", "fp8"]}},
                                            tmp_path))
    assert [r.config["engine"]["kv_cache_dtype"] for r in runs] == ["auto", "fp8"]
    assert len({r.group_key for r in runs}) == 1  # a plan setting: one model load for both
    with pytest.raises(ExperimentError, match="kv_cache_dtype='fp4' is invalid"):
        expand_runs(experiment_from_dict({**base, "engine": {"kv_cache_dtype": "fp4"}}, tmp_path))


# ---------------------------------------------------------------- on the GPU (Triton, CUDA graphs)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_gpu_fp8_kv_through_graphs_and_cascade_gives_hf_tokens(tiny_llama, hf_fp8_greedy, monkeypatch):
    """Float32 on the GPU: 20 prompts sharing a 260-token prefix decode through CUDA graphs in
    the cascade form (its threshold lowered for a tiny model) and in eager mode over an FP8
    cache: HF's tokens over E4M3 keys and values in both."""
    from pagedlab.layers.attention import triton_backend

    monkeypatch.setattr(triton_backend, "CASCADE_MIN_SHARED_KEYS", 0)
    prefix = random_prompts(1, min_len=260, max_len=260, seed=10)[0]
    prompts = [prefix + tail for tail in random_prompts(20, min_len=1, max_len=30, seed=11)]
    expected = [hf_fp8_greedy(tiny_llama.hf_model, p, GREEDY.max_tokens) for p in prompts]
    for eager in (False, True):
        with LLM(tiny_llama.path, dtype="float32", device="cuda", kv_cache_dtype="fp8",
                 kv_cache_memory_bytes=64 << 20, enforce_eager=eager) as llm:
            assert llm.get_engine_info().cuda_graphs is not eager
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == expected, f"enforce_eager={eager}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_smollm2_fp8_kv_stays_close_to_the_model_dtype_cache(smollm2_hf, dtype):
    """SmolLM2 (a real model: |k| up to ~20, |v| up to ~10) at the default scale 1.0,
    teacher-forced over the float cache's own greedy continuations: the FP8 cache's top-1 token
    agrees at >= 90% of positions and its log-probabilities of the same tokens differ by
    < 0.1 nats on average. A wrong scale, a lost sign or a misread block would not stay this
    close (random attention outputs give agreement near 0)."""
    from conftest import SMOLLM2_TEXTS

    _, tokenizer = smollm2_hf
    args = dict(dtype=dtype, device="cuda", kv_cache_memory_bytes=256 << 20, max_model_len=1024)
    with LLM("smollm2-135m-instruct", **args) as llm:
        outs = llm.generate(SMOLLM2_TEXTS, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    sequences = [tokenizer(t).input_ids + o.outputs[0].token_ids for t, o in zip(SMOLLM2_TEXTS, outs)]
    forced = SamplingParams(max_tokens=1, prompt_logprobs=1)
    records = {}
    for kv in ("auto", "fp8"):
        with LLM("smollm2-135m-instruct", kv_cache_dtype=kv, **args) as llm:
            records[kv] = [o.prompt_logprobs[1:] for o in llm.generate(
                [{"prompt_token_ids": s} for s in sequences], forced, use_tqdm=False)]
    agree = total = 0
    differences = []
    for seq, ref, fp8 in zip(sequences, records["auto"], records["fp8"]):
        for position, (a, b) in enumerate(zip(ref, fp8)):
            top_a = next(t for t, lp in a.items() if lp.rank == 1)
            top_b = next(t for t, lp in b.items() if lp.rank == 1)
            agree += top_a == top_b
            total += 1
            token = seq[position + 1]
            differences.append(abs(a[token].logprob - b[token].logprob))
    mean_difference = sum(differences) / len(differences)
    print(f"SmolLM2 {dtype}: FP8 KV top-1 agreement {agree}/{total} = {agree / total:.3f}, "
          f"mean |dlogprob| {mean_difference:.4f}, max {max(differences):.3f}")
    assert agree / total >= 0.9
    assert mean_difference < 0.1
