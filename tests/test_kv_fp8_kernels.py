"""The FP8 KV cache's kernels (kv_cache_dtype="fp8"): the KV write and every attention path
(varlen prefill/decode, split-KV, cascade) reading E4M3 caches with per-layer scales, against
torch references that quantize and dequantize the same way, on fresh random inputs.

On the CPU the Triton kernels run under the interpreter, which loads, stores and converts
float8e4nv. Its own float32 -> E4M3 cast is wrong (no carry into the exponent, ties away from
zero), so the KV-write kernel rounds in float32 itself and casts exact values: the interpreter
and the GPU run the same numbers, checked here against torch's cast bit for bit.
"""

from __future__ import annotations


import pytest
import torch


pytest.importorskip("triton")

from pagedlab.kernels.kv_write import (FP8_E4M3_MAX, FP8_KV_DTYPE, dequantize_kv_torch, quantize_kv_torch,
                                       write_kv_torch, write_kv_triton)
from pagedlab.kernels.paged_attention import (CascadeBuffers, cascade_attention_triton, choose_split_kv_size,
                                              paged_attention_torch, paged_attention_triton)
from pagedlab.layers.attention import AttentionMetadata, get_attention_backend
from test_kernels import SCENARIOS, _generator, make_batch, share_prefix

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The caches hold keys at a calibrated scale (|k| / K_SCALE up to a few hundred, E4M3's range)
# and values at the default scale 1.0. A kernel that ignored a scale would be off by ~100x.
K_SCALE, V_SCALE = 0.0123, 1.0
# E4M3 keeps 3 mantissa bits: steps of at most 1/8 of a value, so rounding errs by at most 1/16.
E4M3_RELATIVE_ERROR = 2.0 ** -4


def test_quantize_rounds_to_e4m3_and_saturates():
    gen = _generator("quantize")
    x = torch.randn(4096, generator=gen) * 100
    x[:4] = torch.tensor([1e6, -1e6, 449.0 * 0.5, -500.0 * 0.5])
    stored = quantize_kv_torch(x, 0.5)
    assert stored.dtype == FP8_KV_DTYPE
    back = dequantize_kv_torch(stored, 0.5)
    assert torch.isfinite(back).all()
    assert back[:4].tolist() == [FP8_E4M3_MAX * 0.5, -FP8_E4M3_MAX * 0.5] * 2  # saturated, not inf/NaN
    normal = x.abs() / 0.5 >= 2.0 ** -6  # E4M3's smallest normal
    rest = normal & (x.abs() <= FP8_E4M3_MAX * 0.5)
    error = (back - x).abs()
    assert (error[rest] <= x.abs()[rest] * E4M3_RELATIVE_ERROR + 1e-6).all()
    assert (error[~normal] <= 0.5 * 2.0 ** -9 * 0.5 + 1e-9).all()  # half a subnormal step, scaled
    # every stored value is exactly the nearest of its neighbours: re-quantizing changes nothing
    assert torch.equal(quantize_kv_torch(back, 0.5).view(torch.uint8), stored.view(torch.uint8))


def test_triton_rounding_to_e4m3_is_torchs_cast():
    """Every E4M3 value, every midpoint between neighbours (ties: to even), the floats just
    beside them, random values over 22 binades (subnormals too), out-of-range values: the
    kernel's rounding stores what torch's cast does, bit for bit, signed zeros included."""
    gen = _generator("round")
    every = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    values = every[every.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    binades = torch.exp2(torch.randint(-14, 9, (6000,), generator=gen).float())
    spread = torch.randn(6000, generator=gen) * binades
    beside = [mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))]
    edges = torch.tensor([1e6, -1e6, 449.0, -449.0, 464.0, -0.0, -1e-9])
    x = torch.cat([values, mids, *beside, spread, edges])
    # through the KV write: one token, one head, the values as its head_dim
    width = 1 << (len(x) - 1).bit_length()
    source = torch.zeros(1, 1, width)
    source[0, 0, :len(x)] = x
    got = torch.zeros(1, 16, 1, width, dtype=FP8_KV_DTYPE, device=DEVICE)
    write_kv_triton(source.to(DEVICE), source.to(DEVICE), got, got.clone(), torch.zeros(1, dtype=torch.long,
                                                                                         device=DEVICE))
    expected = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)
    assert torch.equal(got[0, 0, 0, :len(x)].cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.5)])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 64), (32, 3, 96)])
def test_write_kv_fp8_matches_reference(block_size, num_kv_heads, head_dim, k_scale, v_scale):
    gen = _generator("kv-fp8", block_size, num_kv_heads, head_dim, k_scale)
    num_blocks, num_tokens = 5, 23
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen) * 40  # some past +-448
    key, value = fused[:, :num_kv_heads].to(DEVICE), fused[:, 2 * num_kv_heads:].to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 22]] = -1
    initial = quantize_kv_torch(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen),
                                1.0).to(DEVICE)
    k_ref, v_ref, k_got, v_got = (initial.clone() for _ in range(4))
    write_kv_torch(key, value, k_ref, v_ref, slots.to(DEVICE), k_scale, v_scale)
    write_kv_triton(key, value, k_got, v_got, slots.to(DEVICE), k_scale, v_scale)
    assert torch.equal(k_got.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_got.view(torch.uint8), v_ref.view(torch.uint8))
    # the reference is what it says: written slots hold the quantized inputs, the others are kept
    kept = torch.ones(num_blocks * block_size, dtype=torch.bool)
    kept[slots[slots >= 0]] = False
    flat = k_ref.flatten(0, 1).cpu()
    assert torch.equal(flat[kept].view(torch.uint8), initial.flatten(0, 1).cpu()[kept].view(torch.uint8))
    written = slots >= 0
    target = (key.cpu()[written] / k_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    error = (flat[slots[written]].float() - target).abs()
    assert (error <= target.abs() * E4M3_RELATIVE_ERROR + 2.0 ** -10).all()  # nearest E4M3 value


def fp8_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, gen, device=DEVICE):
    """``make_batch`` with its caches quantized to E4M3 (keys at K_SCALE, values at V_SCALE),
    their NaN slots kept NaN; also returns the caches dequantized to float32."""
    batch = make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, gen, device="cpu")
    keys = batch["k_cache"].float() * (K_SCALE * 150)  # keys of a real model's size, mostly in range
    batch["k_cache"] = quantize_kv_torch(keys, K_SCALE)
    batch["v_cache"] = quantize_kv_torch(batch["v_cache"], V_SCALE)
    dequantized = {"k_cache": batch["k_cache"].float() * K_SCALE,
                   "v_cache": batch["v_cache"].float() * V_SCALE}
    return ({name: t.to(device) for name, t in batch.items()},
            {name: t.to(device) for name, t in dequantized.items()})


def check_fp8_attention(batch, dequantized, max_query_len, max_seq_len=None, split_kv_size=None):
    """Triton on the FP8 caches against the torch reference on them, which in turn must equal
    plain float32 attention over the caches dequantized by hand."""
    scale = batch["q"].shape[-1] ** -0.5
    expected = paged_attention_torch(**batch, scale=scale, k_scale=K_SCALE, v_scale=V_SCALE)
    by_hand = paged_attention_torch(**{**batch, **dequantized, "q": batch["q"].float()}, scale=scale)
    num_tokens = int(batch["query_start_loc"][-1])
    torch.testing.assert_close(expected[:num_tokens].float(),
                               by_hand[:num_tokens].to(batch["q"].dtype).float(), atol=1e-5, rtol=1e-5)
    got = paged_attention_triton(**batch, scale=scale, max_query_len=max_query_len, max_seq_len=max_seq_len,
                                 split_kv_size=split_kv_size, k_scale=K_SCALE, v_scale=V_SCALE)
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}[batch["q"].dtype]
    torch.testing.assert_close(got[:num_tokens].float(), expected[:num_tokens].float(), atol=tol, rtol=tol)


FP8_CONFIGS = [(16, 64, 2, torch.float32), (32, 128, 4, torch.float16), (64, 96, 3, torch.float32)]


@pytest.mark.parametrize("config", FP8_CONFIGS, ids=lambda c: f"bs{c[0]}-d{c[1]}-g{c[2]}-{c[3]}")
@pytest.mark.parametrize("scenario", ["prefill", "chunked_prefill", "decode", "mixed"])
def test_paged_attention_fp8_matches_reference(scenario, config):
    block_size, head_dim, group, dtype = config
    seqs = SCENARIOS[scenario]
    gen = _generator("fp8", scenario, config)
    batch, dequantized = fp8_batch(seqs, 2, group, head_dim, block_size, dtype, gen)
    check_fp8_attention(batch, dequantized, max_query_len=max(q for _, q in seqs))


def test_split_kv_fp8_matches_reference():
    seqs = [(200, 1), (15, 1), (64, 1), (127, 1)]
    batch, dequantized = fp8_batch(seqs, 2, 4, 64, 16, torch.float16, _generator("fp8-split"))
    check_fp8_attention(batch, dequantized, max_query_len=1, max_seq_len=201, split_kv_size=64)


def test_cascade_fp8_matches_reference():
    own = [1, 17, 64, 130, 5, 33, 90, 250]
    shared_blocks = 4  # 4 x 32 = 128 keys = two prefix tiles
    seqs = [(shared_blocks * 32 + n - 1, 1) for n in own]
    batch, dequantized = fp8_batch(seqs, 2, 2, 64, 32, torch.float32, _generator("fp8-cascade"))
    share_prefix(batch, shared_blocks)
    scale = 64 ** -0.5
    expected = paged_attention_torch(**batch, scale=scale, k_scale=K_SCALE, v_scale=V_SCALE)
    by_hand = paged_attention_torch(**{**batch, **dequantized}, scale=scale)
    torch.testing.assert_close(expected, by_hand, atol=1e-5, rtol=1e-5)
    buffers = CascadeBuffers.allocate(len(own), DEVICE)
    buffers.set_prefix_len(128)
    got = cascade_attention_triton(batch["q"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
                                   batch["seq_lens"], batch["block_tables"], buffers, scale,
                                   max_seq_len=int(batch["seq_lens"].max()) + 50, k_scale=K_SCALE,
                                   v_scale=V_SCALE)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fp8_attention_stays_close_to_float_attention():
    """What the FP8 cache costs: attention over E4M3 keys and values of real-model size stays
    within a few percent of attention over the unquantized ones."""
    gen = _generator("fp8-accuracy")
    seqs = [(0, 40), (100, 1), (30, 8)]
    batch = make_batch(seqs, 2, 2, 64, 16, torch.float32, gen)
    scale = 64 ** -0.5
    exact = paged_attention_torch(**batch, scale=scale)
    fp8 = {**batch, "k_cache": quantize_kv_torch(batch["k_cache"], 1.0),
           "v_cache": quantize_kv_torch(batch["v_cache"], 1.0)}
    approx = paged_attention_torch(**fp8, scale=scale)
    error = (approx - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.05, error


def test_backends_agree_on_an_fp8_cache():
    """Each backend writes the step's keys and values into an FP8 cache and attends: the same."""
    gen = _generator("fp8-backends")
    seqs = [(16, 1), (0, 9), (33, 1)]
    batch, _ = fp8_batch(seqs, 2, 2, 64, 16, torch.float32, gen)
    slots = [int(batch["block_tables"][i, pos // 16]) * 16 + pos % 16
             for i, (context_len, query_len) in enumerate(seqs)
             for pos in range(context_len, context_len + query_len)]
    slot_mapping = torch.tensor(slots, device=DEVICE)
    key = (torch.randn(len(slots), 2, 64, generator=gen) * 3).to(DEVICE)
    value = torch.randn(len(slots), 2, 64, generator=gen).to(DEVICE)
    metadata = AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=batch["query_start_loc"],
                                 seq_lens=batch["seq_lens"], block_tables=batch["block_tables"],
                                 max_query_len=9, max_seq_len=34)
    outputs, caches = [], []
    for name in ("torch", "triton"):
        backend = get_attention_backend(name, torch.device(DEVICE))
        k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
        backend.write_kv(key, value, k_cache, v_cache, slot_mapping, K_SCALE, V_SCALE)
        outputs.append(backend.attend(batch["q"], k_cache, v_cache, metadata, 0.125, K_SCALE, V_SCALE))
        caches.append(k_cache.view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


def test_mismatched_cache_dtypes_are_refused():
    batch = make_batch([(3, 2)], 2, 2, 64, 16, torch.float32, _generator("fp8-bad"))
    args = {name: batch[name] for name in ("query_start_loc", "seq_lens", "block_tables")}
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        paged_attention_triton(batch["q"], batch["k_cache"].half(), batch["v_cache"].half(), **args,
                               scale=1.0)
    with pytest.raises(ValueError, match="one dtype"):
        write_kv_triton(batch["q"][:, :2], batch["q"][:, :2], quantize_kv_torch(batch["k_cache"], 1.0),
                        batch["v_cache"], torch.zeros(2, dtype=torch.long, device=DEVICE))


# ---------------------------------------------------------------- real sizes on the GPU (bf16)

def _real_fp8_batch(seqs, block_size, name):
    return fp8_batch(seqs, 8, 4, 128, block_size, torch.bfloat16, _generator(name, block_size), device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_fp8_prefill_256x512(block_size):
    check_fp8_attention(*_real_fp8_batch([(0, 512)] * 256, block_size, "gpu-fp8-prefill"), max_query_len=512)


@pytest.mark.gpu
@gpu
def test_gpu_fp8_decode_and_split_kv():
    check_fp8_attention(*_real_fp8_batch([(575, 1)] * 256, 16, "gpu-fp8-decode"), max_query_len=1,
                        max_seq_len=576)
    seqs = [(4000 + 997 * i, 1) for i in range(4)]
    max_seq_len = max(c + q for c, q in seqs)
    split = choose_split_kv_size(4, 8, 1, max_seq_len)
    check_fp8_attention(*_real_fp8_batch(seqs, 16, "gpu-fp8-split"), max_query_len=1, max_seq_len=max_seq_len,
                        split_kv_size=split)


@pytest.mark.gpu
@gpu
def test_gpu_fp8_mixed_chunked_prefill_and_cascade():
    seqs = [(6144, 2048), (2048, 64), (0, 300)] + [(100 + 37 * i, 1) for i in range(64)]
    check_fp8_attention(*_real_fp8_batch(seqs, 32, "gpu-fp8-mixed"), max_query_len=2048)
    seqs = [(2048 + 64 + i % 64, 1) for i in range(256)]
    batch, _ = _real_fp8_batch(seqs, 16, "gpu-fp8-cascade")
    share_prefix(batch, 2048 // 16)
    expected = paged_attention_torch(**batch, scale=128 ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    buffers = CascadeBuffers.allocate(256, "cuda")
    buffers.set_prefix_len(2048)
    got = cascade_attention_triton(batch["q"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
                                   batch["seq_lens"], batch["block_tables"], buffers, 128 ** -0.5,
                                   max_seq_len=4096, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
def test_gpu_write_kv_fp8_from_bf16():
    gen = _generator("gpu-kv-fp8")
    num_tokens, num_blocks, block_size = 4096, 1024, 16
    key = (torch.randn(num_tokens, 8, 128, generator=gen) * 100).to("cuda", torch.bfloat16)
    value = torch.randn(num_tokens, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    k_ref = torch.zeros(num_blocks, block_size, 8, 128, device="cuda", dtype=FP8_KV_DTYPE)
    v_ref, k_got, v_got = k_ref.clone(), k_ref.clone(), k_ref.clone()
    write_kv_torch(key, value, k_ref, v_ref, slots.to("cuda"), 0.5, 1.0)
    write_kv_triton(key, value, k_got, v_got, slots.to("cuda"), 0.5, 1.0)
    assert torch.equal(k_got.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_got.view(torch.uint8), v_ref.view(torch.uint8))
