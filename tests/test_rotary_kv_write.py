"""The fused per-head q/k RMSNorm + rotary embedding + KV write (``rotate_and_write_kv_triton``, one
launch per attention layer) against its torch reference on fresh random inputs: with and without
the norms (Qwen3's, Gemma's ``1 + weight``), full and partial rotary, GQA, negative slots, FP8
caches, strided q/k/v views of a fused QKV output; then through the engine on the Triton backend
(interpreted here) against HF transformers. The ``gpu`` tests run bf16 at real attention shapes,
eagerly and replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import DEVICE, TOLERANCE, _generator, gpu  # sets TRITON_INTERPRET before the kernels load

from conftest import KV_BYTES, assert_hf_tokens_and_logprobs, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.kernels import kv_write
from pagedlab.kernels.kv_write import (FP8_KV_DTYPE, QKNorm, quantize_kv_torch,
                                       rotate_and_write_kv_torch, rotate_and_write_kv_triton)
from pagedlab.layers.attention import get_attention_backend
from pagedlab.layers.norm import RMSNorm

NUM_BLOCKS, BLOCK_SIZE = 6, 16


def make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, gen, norm=None,
                device=DEVICE, block_size=BLOCK_SIZE, cache_dtype=None):
    """q, k, v as views of one fused QKV output, RotaryEmbedding-style (cos, sin) for random
    positions, the norm weights (``norm``: None, "rms" or "unit_offset"), a slot mapping with every
    fourth token padding (-1), and caches of random values."""
    fused = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 2).to(device,
                                                                                                    dtype)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = (part.view(num_tokens, -1, head_dim) for part in fused.split(sizes, dim=-1))
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).float()
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(device, dtype).unsqueeze(1), emb.sin().to(device, dtype).unsqueeze(1)
    qk_norm = None
    if norm is not None:
        offset = 0.0 if norm == "unit_offset" else 1.0
        q_weight, k_weight = ((torch.randn(head_dim, generator=gen) * 0.5 + offset).to(device, dtype)
                              for _ in range(2))
        qk_norm = QKNorm(q_weight, k_weight, 1e-6, norm == "unit_offset")
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, head_dim, generator=gen)
    cache = cache.to(device, dtype) if cache_dtype is None else quantize_kv_torch(cache, 1.0).to(device)
    return dict(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=cache, v_cache=-cache if cache_dtype is None
                else cache.clone(), slot_mapping=slots.to(device), norm=qk_norm)


def run(fn, inputs, **kwargs):
    """``fn`` on fresh copies of the inputs' caches: (rotated q, k cache, v cache)."""
    args = {**inputs, "k_cache": inputs["k_cache"].clone(), "v_cache": inputs["v_cache"].clone(), **kwargs}
    return fn(**args), args["k_cache"], args["v_cache"]


def written_and_kept(slot_mapping):
    written = slot_mapping[slot_mapping >= 0].cpu()
    kept = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    kept[written] = False
    return written, kept


# (heads, kv_heads, head_dim, rotary_dim): full rotary; partial 64 of 128 and 16 of 32; GQA groups of
# 1, 2, 3 (padded) and 4; head_dim 96 (padded, Phi-3-mini); Phi-4-mini-like 12 of 16 (half of 6, padded).
SHAPES = [(8, 2, 64, 64), (4, 2, 128, 64), (2, 2, 32, 16), (6, 2, 96, 96), (4, 1, 16, 12)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("norm", [None, "rms", "unit_offset"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}-rot{s[3]}")
def test_rotate_and_write_kv_matches_reference(shape, norm, dtype):
    inputs = make_inputs(11, *shape, dtype, _generator("rope-kv", shape, norm, dtype), norm=norm)
    q_ref, k_ref, v_ref = run(rotate_and_write_kv_torch, inputs)
    q_got, k_got, v_got = run(rotate_and_write_kv_triton, inputs)
    assert q_got.shape == inputs["q"].shape and q_got.is_contiguous() and q_got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q_got, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k_got, k_ref, atol=tol, rtol=tol)
    assert torch.equal(v_got, v_ref)
    if norm is None and DEVICE == "cpu":  # float32 products and one rounding, as the reference does
        assert torch.equal(q_got, q_ref) and torch.equal(k_got, k_ref)
    written, kept = written_and_kept(inputs["slot_mapping"])
    assert torch.equal(k_got.flatten(0, 1)[kept.to(DEVICE)], inputs["k_cache"].flatten(0, 1)[kept.to(DEVICE)])
    # the reference is what it says: values stored unchanged; without norms only the rotary dims move
    tokens = (inputs["slot_mapping"] >= 0).nonzero().flatten()
    assert torch.equal(v_ref.flatten(0, 1)[written.to(DEVICE)], inputs["v"][tokens])
    if norm is None:
        rotary_dim = shape[3]
        assert torch.equal(q_ref[..., rotary_dim:], inputs["q"][..., rotary_dim:])
        assert (q_ref[..., :rotary_dim] != inputs["q"][..., :rotary_dim]).float().mean() > 0.9


@pytest.mark.parametrize("norm", [None, "rms"])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.037, 2.5)])
def test_fp8_cache_holds_the_rotated_keys_quantized_as_write_kv_does(k_scale, v_scale, norm):
    """Into an E4M3 cache the kernel stores its own rotated keys (those it stores into a cache of
    the model's dtype) quantized bit for bit as ``write_kv_torch`` quantizes them, and within one
    E4M3 step of the reference's."""
    gen = _generator("rope-kv-fp8", k_scale, norm)
    inputs = make_inputs(13, 4, 2, 64, 32, torch.float32, gen, norm=norm, cache_dtype=FP8_KV_DTYPE)
    plain = {**inputs, "k_cache": torch.zeros(inputs["k_cache"].shape, device=DEVICE),
             "v_cache": torch.zeros(inputs["v_cache"].shape, device=DEVICE)}
    _, k_plain, v_plain = run(rotate_and_write_kv_triton, plain)
    _, k_got, v_got = run(rotate_and_write_kv_triton, inputs, k_scale=k_scale, v_scale=v_scale)
    _, k_ref, v_ref = run(rotate_and_write_kv_torch, inputs, k_scale=k_scale, v_scale=v_scale)
    written, kept = written_and_kept(inputs["slot_mapping"])
    initial = inputs["k_cache"].flatten(0, 1).cpu().view(torch.uint8)  # the v cache starts the same
    for got, plain_cache, scale in ((k_got, k_plain, k_scale), (v_got, v_plain, v_scale)):
        rows = got.flatten(0, 1).cpu().view(torch.uint8)
        expected = quantize_kv_torch(plain_cache.flatten(0, 1).cpu()[written], scale)
        assert torch.equal(rows[written], expected.view(torch.uint8))
        assert torch.equal(rows[kept], initial[kept])
    assert torch.equal(v_got.view(torch.uint8), v_ref.view(torch.uint8))
    ref = k_ref.flatten(0, 1).cpu()[written].float()
    error = (k_got.flatten(0, 1).cpu()[written].float() - ref).abs()
    assert (error <= ref.abs() * 2.0 ** -3 + 2.0 ** -9).all()  # at most one E4M3 step apart
    if k_scale < 1:
        assert ref.abs().max() > 50  # spread over E4M3's range: a scale left out would be seen


def test_a_tokens_numbers_do_not_depend_on_the_batch():
    """Batch-invariant mode runs the same kernel: a token alone, or in a smaller launch, gets the
    bits it gets in a larger one."""
    inputs = make_inputs(9, 8, 2, 64, 64, torch.float32, _generator("rope-kv-invariant"), norm="rms")
    q_all, k_all, v_all = run(rotate_and_write_kv_triton, inputs)
    for part in (slice(3, 4), slice(5, 9)):
        sliced = {name: inputs[name][part] for name in ("q", "k", "v", "cos", "sin", "slot_mapping")}
        q_part, k_part, v_part = run(rotate_and_write_kv_triton, {**inputs, **sliced})
        assert torch.equal(q_part, q_all[part])
        slots = sliced["slot_mapping"][sliced["slot_mapping"] >= 0]
        for got, full in ((k_part, k_all), (v_part, v_all)):
            assert torch.equal(got.flatten(0, 1)[slots], full.flatten(0, 1)[slots])


def test_no_tokens_and_bad_shapes_are_named():
    inputs = make_inputs(4, 4, 2, 32, 16, torch.float32, _generator("rope-kv-bad"))
    empty = {name: inputs[name][:0] for name in ("q", "k", "v", "cos", "sin", "slot_mapping")}
    assert run(rotate_and_write_kv_triton, {**inputs, **empty})[0].shape == (0, 4, 32)
    with pytest.raises(ValueError, match=r"rotary_dim even and at most head_dim=32"):
        rotate_and_write_kv_triton(**{**inputs, "cos": inputs["cos"][..., :15],
                                      "sin": inputs["sin"][..., :15]})
    with pytest.raises(ValueError, match="heads a multiple of kv_heads"):
        rotate_and_write_kv_triton(**{**inputs, "q": inputs["q"][:, :3]})
    with pytest.raises(ValueError, match=r"must be \[head_dim=32\]"):
        rotate_and_write_kv_triton(**{**inputs, "norm": QKNorm(torch.ones(16), torch.ones(16), 1e-6)})
    with pytest.raises(ValueError, match="does not fit caches"):
        rotate_and_write_kv_triton(**{**inputs, "k_cache": inputs["k_cache"][..., :16],
                                      "v_cache": inputs["v_cache"][..., :16]})


@pytest.mark.parametrize("unit_offset", [False, True])
def test_backends_rotate_and_write_alike_from_norm_modules(unit_offset):
    """The torch backend's unfused path (``rotate_queries_and_keys`` then ``write_kv``) and the Triton
    backend's kernel, from the models' ``RMSNorm`` modules."""
    inputs = make_inputs(7, 4, 2, 32, 32, torch.float32, _generator("rope-kv-backends", unit_offset))
    norms = [RMSNorm(32, 1e-6, unit_offset=unit_offset).to(DEVICE) for _ in range(2)]
    for module, weight in zip(norms, (torch.randn(32, generator=_generator("w", i)) for i in range(2))):
        module.weight.data.copy_(weight)
    results = []
    for name in ("torch", "triton"):
        backend = get_attention_backend(name, torch.device(DEVICE))
        k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
        q = backend.rotate_and_write_kv(inputs["q"], inputs["k"], inputs["v"], (inputs["cos"], inputs["sin"]),
                                        *norms, k_cache, v_cache, inputs["slot_mapping"])
        results.append((q, k_cache, v_cache))
    for torch_result, triton_result in zip(*results):
        torch.testing.assert_close(triton_result, torch_result, atol=1e-5, rtol=1e-5)
    norms[1].eps = 1e-5
    with pytest.raises(ValueError, match="must match"):
        get_attention_backend("triton", torch.device(DEVICE)).rotate_and_write_kv(
            inputs["q"], inputs["k"], inputs["v"], (inputs["cos"], inputs["sin"]), *norms, inputs["k_cache"],
            inputs["v_cache"], inputs["slot_mapping"])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "phi3", "gpt_neox", "qwen3_moe"])
def test_triton_backend_gives_hf_tokens_and_logprobs_through_the_fused_kernel(tiny_models, monkeypatch, arch):
    """The rotary families on the Triton backend, interpreted: Llama, Qwen3 and Qwen3-MoE (q/k
    norms), Gemma 3 (q/k norms by ``1 + weight``, local and global RoPE), Phi-3 and GPT-NeoX
    (partial rotary: 12 and 4 of 16 dims). Chunked prefill, a prefix-cache hit and decodes, every
    layer's rotation and KV write in the fused kernel (the plain KV write never runs); HF's greedy
    tokens, logprobs within 1e-4."""
    norms, real = [], kv_write.rotate_and_write_kv_triton
    monkeypatch.setattr(kv_write, "rotate_and_write_kv_triton",
                        lambda *args, **kwargs: norms.append(args[-1]) or real(*args, **kwargs))
    monkeypatch.setattr(kv_write, "write_kv_triton", None)
    tiny = tiny_models(arch)
    prefix = random_prompts(1, min_len=20, max_len=20, seed=30)[0]
    prompts = [prefix + tail for tail in random_prompts(2, min_len=2, max_len=9, seed=31)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    with LLM(tiny.path, dtype="float32", attention_backend="triton", kv_cache_memory_bytes=KV_BYTES,
             max_num_batched_tokens=16, enable_prefix_caching=True) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.get_stats().prefix_cache_hit_tokens > 0
    assert norms and all((norm is not None) == (arch in ("qwen3", "gemma3", "qwen3_moe")) for norm in norms)
    assert all(norm.unit_offset == (arch == "gemma3") for norm in norms if norm is not None)
    assert_hf_tokens_and_logprobs(tiny.hf_model, prompts, outs, 6)


# ---------------------------------------------------------------- real shapes on the GPU (bf16)

# (heads, kv_heads, head_dim, rotary_dim, norm): Llama-3-8B, Qwen3-8B, Qwen3-30B-A3B (issue 15's MoE)
GPU_SHAPES = {"llama3-8b": (32, 8, 128, 128, None), "qwen3-8b": (32, 8, 128, 128, "rms"),
              "qwen3-30b-a3b": (32, 4, 128, 128, "rms")}


def _check_gpu(got, expected):
    """bf16 within 2e-2; an FP8 cache within one E4M3 step (a key one bf16 step off the
    reference's may round to the neighbouring E4M3 value)."""
    for a, b in zip(got, expected):
        if b.dtype == FP8_KV_DTYPE:
            a, b = a.float(), b.float()
            assert ((a - b).abs() <= b.abs() * 2.0 ** -3 + 2.0 ** -9).all()
        else:
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def _graph_run(inputs):
    """The kernel captured in a CUDA graph over ``inputs`` (compiled eagerly first); returns
    (graph, its output)."""
    rotate_and_write_kv_triton(**inputs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rotate_and_write_kv_triton(**inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rotate_and_write_kv_triton(**inputs)
    return graph, out


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("num_tokens", [1, 64])
@pytest.mark.parametrize("model", list(GPU_SHAPES))
def test_gpu_rotate_and_write_kv_eager_and_in_a_cuda_graph(model, num_tokens, fp8):
    """bf16 at the real attention shape: eager against the reference; then a CUDA graph captured on
    one set of inputs, replayed on another copied into its buffers, gives the eager bits."""
    heads, kv_heads, head_dim, rotary_dim, norm = GPU_SHAPES[model]
    scales = dict(k_scale=0.05, v_scale=0.02) if fp8 else {}
    make = [make_inputs(num_tokens, heads, kv_heads, head_dim, rotary_dim, torch.bfloat16,
                        _generator("gpu-rope-kv", model, num_tokens, i), norm=norm, device="cuda",
                        cache_dtype=FP8_KV_DTYPE if fp8 else None) for i in range(2)]
    for inputs in make:
        if num_tokens == 1:
            inputs["slot_mapping"].fill_(37)  # a decode token always has its slot
        _check_gpu(run(rotate_and_write_kv_triton, inputs, **scales),
                   run(rotate_and_write_kv_torch, inputs, **scales))
    first, second = make
    static = {**first, **scales, "k_cache": first["k_cache"].clone(), "v_cache": first["v_cache"].clone()}
    graph, out = _graph_run(static)
    for name in ("q", "k", "v", "cos", "sin", "slot_mapping", "k_cache", "v_cache"):
        static[name].copy_(second[name])
    if norm is not None:
        static["norm"].q_weight.copy_(second["norm"].q_weight)
        static["norm"].k_weight.copy_(second["norm"].k_weight)
    graph.replay()
    eager = run(rotate_and_write_kv_triton, second, **scales)
    for a, b in zip((out, static["k_cache"], static["v_cache"]), eager):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
