"""Batch-invariant attention (``paged_attention_triton(batch_invariant=True)``): a token's output
is bitwise the same prefilled with its whole prompt, in a later prefill chunk, decoded beside
other sequences and decoded with its keys split across programs (the mode's fixed key segments,
``BATCH_INVARIANT_SPLIT_KV_SIZE``, which every launch folds in one order), at each query-tile
size the mode may be given (``BATCH_INVARIANT_BLOCK_M``: 16 rows cost a decode step least, 64 a
long prefill), with the segments and without them (size 0). Small heads under the interpreter on
the CPU; Llama-3-8B's heads in bf16 on the GPU (``-m gpu``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from test_batch_invariant import DEVICE  # sets the interpreter up on a machine without CUDA

BLOCK_SIZE = 16
CASES = [
    pytest.param(dict(heads=4, kv_heads=2, head_dim=16, tokens=100, dtype=torch.float32, tile_rows=(16, 64),
                      segments=(64, 0)), id="small"),
    pytest.param(dict(heads=32, kv_heads=8, head_dim=128, tokens=700, dtype=torch.bfloat16,
                      tile_rows=(16, 32, 64), segments=(64, 128, 256, 512, 0)), id="llama3-8b-bf16",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                            reason="needs a CUDA GPU")]),
]


def _attend(q, k_cache, v_cache, query_lens, seq_lens, block_tables, split_kv_size=None):
    from pagedlab.kernels.paged_attention import paged_attention_triton

    starts = torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).int()
    return paged_attention_triton(q, k_cache, v_cache, starts, torch.tensor(seq_lens, device=DEVICE).int(),
                                  block_tables, q.shape[-1] ** -0.5, split_kv_size=split_kv_size,
                                  batch_invariant=True)


@pytest.mark.parametrize("case", CASES)
def test_a_token_has_the_same_bits_prefilled_chunked_and_decoded(case, monkeypatch):
    from pagedlab.kernels import paged_attention

    g = torch.Generator().manual_seed(5)
    tokens, heads, dim = case["tokens"], case["heads"], case["head_dim"]
    blocks_per_seq = -(-tokens // BLOCK_SIZE)
    cache_shape = (3 * blocks_per_seq, BLOCK_SIZE, case["kv_heads"], dim)
    k_cache, v_cache = (torch.randn(cache_shape, generator=g).to(DEVICE, case["dtype"]) for _ in range(2))
    # Three sequences' blocks, shuffled; the one under test is row 1.
    tables = torch.randperm(3 * blocks_per_seq, generator=g).int().view(3, -1).to(DEVICE)
    q = torch.randn(tokens, heads, dim, generator=g).to(DEVICE, case["dtype"])
    others_q = torch.randn(2, heads, dim, generator=g).to(DEVICE, case["dtype"])
    reference = paged_attention.paged_attention_torch(  # the prefill, in float32 SDPA
        q, k_cache, v_cache, torch.tensor([0, tokens], device=DEVICE).int(),
        torch.tensor([tokens], device=DEVICE).int(), tables[1:2], dim ** -0.5).float()
    close = dict(atol=1e-4, rtol=1e-4) if case["dtype"] == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for tile_rows, segment in itertools.product(case["tile_rows"], case["segments"]):
        monkeypatch.setattr(paged_attention, "BATCH_INVARIANT_BLOCK_M", tile_rows)
        monkeypatch.setattr(paged_attention, "BATCH_INVARIANT_SPLIT_KV_SIZE", segment)
        full = _attend(q, k_cache, v_cache, [tokens], [tokens], tables[1:2])
        torch.testing.assert_close(full.float(), reference, **close)
        for context in (1, tokens // 3 + 1, tokens - 1):
            chunk = _attend(q[context:], k_cache, v_cache, [tokens - context], [tokens], tables[1:2])
            assert torch.equal(chunk, full[context:]), (tile_rows, segment, context)
        decode_batch = torch.stack([others_q[0], q[-1], others_q[1]])
        lengths = [tokens // 2, tokens, tokens - 5]
        for split in (None, segment or None):
            decoded = _attend(decode_batch, k_cache, v_cache, [1, 1, 1], lengths, tables, split)
            assert torch.equal(decoded[1], full[-1]), (tile_rows, segment, split)
        other_split = 2 * segment or 128
        with pytest.raises(ValueError, match=f"split_kv_size={other_split}"):
            _attend(q[-1:], k_cache, v_cache, [1], [tokens], tables[1:2], split_kv_size=other_split)
