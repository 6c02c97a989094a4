"""Sliding-window and soft-capped paged attention: the Triton kernel (under the interpreter on
the CPU) against the torch reference, with the blocks before each sequence's window freed
(their block-table entries point at a NaN block, so reading them shows up)."""

from __future__ import annotations

import pytest
import torch

from test_kernels import DEVICE, TOLERANCE, _generator, make_batch  # sets TRITON_INTERPRET first

from conftest import hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.kernels.paged_attention import (CascadeBuffers, cascade_attention_triton, paged_attention_torch,
                                              paged_attention_triton)

# (context_len, query_len): decode, chunks and prefills longer than the windows, windows
# starting mid-block and mid-tile, a sequence shorter than the window.
SEQS = [(0, 90), (150, 1), (37, 1), (100, 30), (70, 12), (5, 3)]


def _free_blocks_before_windows(batch, seqs, block_size: int, window: int) -> None:
    """Point each sequence's blocks wholly before its first query's window at a NaN block."""
    nan_block = int(batch["block_tables"][0, -1])
    for i, (context_len, _) in enumerate(seqs):
        dead = max(context_len - window + 1, 0) // block_size
        batch["block_tables"][i, :dead] = nan_block


def _reference(batch, scale, **kwargs):
    return paged_attention_torch(**batch, scale=scale, **kwargs)


@pytest.mark.parametrize("window", [1, 16, 40, 64, 100])
@pytest.mark.parametrize("block_size, group, dtype", [(16, 2, torch.float32), (32, 4, torch.float16)])
def test_sliding_window_matches_reference_with_freed_blocks(window, block_size, group, dtype):
    batch = make_batch(SEQS, 2, group, 64, block_size, dtype, _generator("window", window, block_size))
    scale = 0.125
    expected = _reference(batch, scale, sliding_window=window)
    _free_blocks_before_windows(batch, SEQS, block_size, window)
    got_torch = _reference(batch, scale, sliding_window=window)
    got = paged_attention_triton(**batch, scale=scale, max_query_len=90, sliding_window=window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got_torch, expected)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    # the window changes the result where a sequence is longer than it
    full = _reference(batch | {"block_tables": make_batch(SEQS, 2, group, 64, block_size, dtype, _generator(
        "window", window, block_size))["block_tables"]}, scale)
    if window < 90:
        assert not torch.allclose(full.float(), expected.float(), atol=tol)


@pytest.mark.parametrize("window", [None, 48])
def test_sliding_window_split_kv_decode(window):
    seqs = [(200, 1), (15, 1), (64, 1), (127, 1)]
    batch = make_batch(seqs, 2, 4, 64, 16, torch.float32, _generator("window-split", window))
    expected = _reference(batch, 0.125, sliding_window=window, softcap=5.0)
    if window:
        _free_blocks_before_windows(batch, seqs, 16, window)
    got = paged_attention_triton(**batch, scale=0.125, max_query_len=1, max_seq_len=201, split_kv_size=64,
                                 sliding_window=window, softcap=5.0)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap_matches_reference(dtype):
    batch = make_batch(SEQS, 2, 2, 64, 16, dtype, _generator("softcap", dtype))
    batch["q"] = batch["q"] * 4  # scores well past the cap, where tanh bends them
    expected = _reference(batch, 0.125, softcap=2.0)
    got = paged_attention_triton(**batch, scale=0.125, max_query_len=90, softcap=2.0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    assert not torch.allclose(_reference(batch, 0.125).float(), expected.float(), atol=tol)


def test_softcap_reference_is_tanh_of_scaled_scores():
    """The torch reference against attention written out for one query row."""
    batch = make_batch([(20, 1)], 1, 1, 32, 16, torch.float32, _generator("softcap-def"))
    got = _reference(batch, 0.2, softcap=3.0)[0, 0]
    blocks = batch["block_tables"][0, :2].long()
    k = batch["k_cache"][blocks].flatten(0, 1)[:21, 0]
    v = batch["v_cache"][blocks].flatten(0, 1)[:21, 0]
    scores = 3.0 * torch.tanh(k @ batch["q"][0, 0] * 0.2 / 3.0)
    torch.testing.assert_close(got, torch.softmax(scores, 0) @ v)


def test_cascade_attention_with_softcap():
    seqs = [(96, 1)] * 4
    batch = make_batch(seqs, 2, 2, 64, 16, torch.float32, _generator("cascade-softcap"))
    batch["block_tables"][1:, :4] = batch["block_tables"][0, :4]
    expected = _reference(batch, 0.125, softcap=4.0)
    buffers = CascadeBuffers.allocate(4, DEVICE)
    buffers.set_prefix_len(64)
    got = cascade_attention_triton(**batch, buffers=buffers, scale=0.125, max_seq_len=97, softcap=4.0)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_bad_window_and_cap_are_named():
    batch = make_batch([(4, 1)], 1, 1, 32, 16, torch.float32, _generator("bad"))
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive"):
        paged_attention_triton(**batch, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match=r"softcap=-1\.0 must be positive"):
        paged_attention_triton(**batch, scale=1.0, softcap=-1.0)


@pytest.mark.slow  # the attention kernel interpreted through whole generations
@pytest.mark.parametrize("arch", ["mistral_window", "gemma2"])
def test_triton_backend_gives_hf_tokens_with_windows_and_softcaps(tiny_models, arch):
    """Through the engine on the Triton kernels: Mistral with a 16-token window in a pool of 4
    blocks (released blocks are handed to other sequences while stale entries stay in the block
    tables), Gemma 2 with soft-capping and local/global layers; HF's greedy tokens."""
    tiny = tiny_models(arch)
    prompts = random_prompts(2, min_len=24, max_len=32, seed=14)
    cfg = tiny.hf_model.config
    block_bytes = 2 * cfg.num_hidden_layers * 16 * 2 * 16 * 4  # 16 slots x 2 KV heads x head_dim 16
    num_blocks = 4 if arch == "mistral_window" else 64
    with LLM(tiny.path, dtype="float32", attention_backend="triton", max_num_batched_tokens=16,
             max_model_len=64, kv_cache_memory_bytes=num_blocks * block_bytes) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)]
    assert got == [hf_greedy(tiny.hf_model, p, 16, eos_token_id=None) for p in prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("split_kv_size", [None, 256])
def test_gemma2_9b_shaped_attention_on_gpu(split_kv_size):
    """Gemma-2-9B's attention in bf16 (head_dim 256, 16 heads over 8 KV heads, window 4096,
    soft-capping 50): a 512-token chunk after 5,000 keys and decodes past the window, local and
    global, against the torch reference."""
    seqs = [(5000, 512), (6000, 1), (300, 1), (4096, 1)] if split_kv_size is None else [(6000, 1), (4500, 1)]
    batch = make_batch(seqs, 8, 2, 256, 16, torch.bfloat16, _generator("gemma2-9b", split_kv_size))
    max_query_len = max(q for _, q in seqs)
    for window in (4096, None):
        expected = _reference(batch, 256 ** -0.5, sliding_window=window, softcap=50.0)
        got = paged_attention_triton(**batch, scale=256 ** -0.5, max_query_len=max_query_len,
                                     max_seq_len=6001 if split_kv_size else None, split_kv_size=split_kv_size,
                                     sliding_window=window, softcap=50.0)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
