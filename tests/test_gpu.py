"""GPU checks (``pytest -m gpu`` on a CUDA machine): Triton backend + CUDA graphs against HF."""

from __future__ import annotations

import pytest
import torch

from conftest import SMOLLM2_TEXTS, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
KV = 256 << 20


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2", "gpt_neox",
                                  "mixtral", "qwen3_moe", "mistral_window", "phi3_longrope"])
def test_float32_greedy_on_gpu_matches_hf(tiny_models, arch):
    tiny = tiny_models(arch)
    prompts = random_prompts(8, max_len=80, seed=1)
    expected = [hf_greedy(tiny.hf_model, p, GREEDY.max_tokens) for p in prompts]
    with LLM(tiny.path, dtype="float32", device="cuda", kv_cache_memory_bytes=KV) as llm:
        assert llm.get_engine_info().attention_backend == "triton"
        assert llm.get_engine_info().cuda_graphs
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


# float32: 37 requests pad up to the 48 graph. bf16: 32, a captured size, so eager and graph run
# the same matmul shapes (cuBLAS picks kernels by shape, and bf16 greedy on a random model has
# near-ties that any reordering flips); for the same reason its prefill runs eagerly (mixed-step
# graphs pad it to a token bucket; test_mixed_graphs_gpu.py checks them in float32).
@pytest.mark.parametrize("dtype, num_prompts", [("float32", 37), ("bfloat16", 32)])
def test_cuda_graphs_give_the_eager_tokens(tiny_models, dtype, num_prompts):
    tiny = tiny_models("qwen3")
    prompts = random_prompts(num_prompts, max_len=60, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(tiny.path, dtype=dtype, device="cuda", kv_cache_memory_bytes=KV, enforce_eager=True) as llm:
        eager = _tokens(llm.generate(prompts, params, use_tqdm=False))
    with LLM(tiny.path, dtype=dtype, device="cuda", kv_cache_memory_bytes=KV,
             cuda_graph_mixed_steps=dtype == "float32") as llm:
        graphed = _tokens(llm.generate(prompts, params, use_tqdm=False))
        sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=16) for i in range(num_prompts)]
        twice = []
        for _ in range(2):  # a prefix-cache hit would change the prefill's shapes, hence bf16 rounding
            llm.reset_prefix_cache()
            twice.append(_tokens(llm.generate(prompts, sampled, use_tqdm=False)))
    assert graphed == eager, "CUDA-graph decode differs from eager decode"
    assert twice[0] == twice[1], "seeded sampling is not reproducible"


def test_triton_backend_matches_torch_backend_on_gpu(tiny_llama):
    prompts = random_prompts(12, max_len=120, seed=3)
    args = dict(dtype="float32", device="cuda", kv_cache_memory_bytes=KV, max_num_batched_tokens=64)
    with LLM(tiny_llama.path, attention_backend="torch", **args) as llm:
        reference = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    with LLM(tiny_llama.path, attention_backend="triton", **args) as llm:
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference


def test_bfloat16_teacher_forced_agreement_with_hf_float32(tiny_llama, capsys):
    """bf16 drifts from float32: report top-1 agreement and the largest logprob gap."""
    prompts = random_prompts(6, min_len=30, max_len=60, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    with LLM(tiny_llama.path, dtype="bfloat16", device="cuda", kv_cache_memory_bytes=KV) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    agree = total = 0
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(tiny_llama.hf_model(torch.tensor([prompt])).logits[0].float(), -1)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            worst = max(worst, abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()))
            ours_top = next(t for t, lp in entry.items() if lp.rank == 1)
            agree += ours_top == int(ref[pos - 1].argmax())
            total += 1
    with capsys.disabled():
        print(f"\nbf16 vs HF fp32 teacher-forced: top-1 agreement {agree / total:.4f}, "
              f"max |dlogprob| {worst:.4f}")
    assert agree / total > 0.9
    assert worst < 0.5


def test_cascade_graphs_give_hf_tokens(tiny_models, monkeypatch):
    """20 prompts share a cached 200-token prefix: decode replays the cascade graphs (threshold
    lowered for a tiny model) and greedy float32 tokens stay HF's."""
    from pagedlab.layers.attention import triton_backend

    monkeypatch.setattr(triton_backend, "CASCADE_MIN_SHARED_KEYS", 0)
    tiny = tiny_models("qwen3")
    prefix = random_prompts(1, min_len=200, max_len=200, seed=5)[0]
    prompts = [prefix + tail for tail in random_prompts(20, min_len=1, max_len=8, seed=6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [hf_greedy(tiny.hf_model, p, 16, eos_token_id=None) for p in prompts]
    with LLM(tiny.path, dtype="float32", device="cuda", kv_cache_memory_bytes=KV) as llm:
        backend = llm.llm_engine.runner.backend
        shared, select = [], backend.select_graph_form

        def recording_select(layout, plans):
            form = select(layout, plans)
            shared.append(int(plans[form].prefix_len) if form == "cascade" else 0)
            return form

        backend.select_graph_form = recording_select
        got = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert 192 in shared, f"no decode step replayed a cascade graph over the shared tiles: {set(shared)}"
    assert got == expected


def test_pinned_staging_copies_every_value_across_steps_and_growth():
    """Inputs staged by alternate steps through reused pinned buffers arrive intact, also when a
    step outgrows its buffer, and the staged host tensors are pinned (else the copy would block)."""
    from pagedlab.engine.step_inputs import PinnedStaging

    staging = PinnedStaging(torch.device("cuda"), nbytes=256)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        staging.begin_step()
        values = [(torch.randint(0, 1 << 40, (16 + 40 * step,), generator=gen).tolist(), torch.int64),
                  (torch.randint(0, 1000, (3, 5), generator=gen).tolist(), torch.int32),
                  (torch.rand(7, generator=gen).tolist(), torch.float32),
                  ((torch.rand(9, generator=gen) > 0.5).tolist(), torch.bool)]
        staged = [staging.to_device(v, dtype) for v, dtype in values]
        done = torch.cuda.Event()
        done.record()
        staging.end_step(done)
        for (v, dtype), got in zip(values, staged):
            assert got.device.type == "cuda"
            assert torch.equal(got.cpu(), torch.tensor(v, dtype=dtype))
    buffer = staging._buffers[0]
    assert buffer.numel() > 256 and buffer[64:128].view(torch.int64).is_pinned()


def test_smollm2_float32_greedy_on_gpu_matches_hf(smollm2_dir, smollm2_hf):
    """The embedded SmolLM2-135M-Instruct (a GGUF dequantized to float32) through the Triton
    kernels and CUDA graphs, mixed batch: HF transformers float32 greedy tokens and text."""
    model, tokenizer = smollm2_hf
    prompts = [tokenizer(t).input_ids for t in SMOLLM2_TEXTS]
    expected = [hf_greedy(model, p, 20) for p in prompts]
    with LLM("smollm2-135m-instruct", dtype="float32", device="cuda", kv_cache_memory_bytes=KV,
             max_model_len=1024) as llm:
        assert llm.get_engine_info().attention_backend == "triton" and llm.get_engine_info().cuda_graphs
        outs = llm.generate(SMOLLM2_TEXTS, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.outputs[0].text for o in outs] == [tokenizer.decode(ids, skip_special_tokens=True)
                                                 for ids in expected]
