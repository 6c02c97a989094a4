"""Triton kernels against their torch references.

On a machine without CUDA the kernels run under the Triton interpreter at small sizes. Triton
decides compiled-or-interpreted when a kernel is decorated, so TRITON_INTERPRET is set here at
collection, before pagedlab imports its kernel module (it does so lazily, at first use). The
``gpu`` tests run the same checks at real sizes in bf16 on CUDA.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch


pytest.importorskip("triton")

from pagedlab.kernels import paged_attention
from pagedlab.kernels.kv_write import write_kv_torch, write_kv_triton
from pagedlab.kernels.paged_attention import (SPLIT_KV_MAX_SEGMENTS, SPLIT_KV_MIN_PROGRAMS,
                                              SPLIT_KV_SHORT_SEQ, SPLIT_KV_SIZE, SPLIT_KV_SMALL_SIZES, TILE_N,
                                              CascadeBuffers, _AttentionKernels, allocate_split_kv_scratch,
                                              cascade_attention_triton, choose_split_kv_size, decode_order,
                                              paged_attention_torch, paged_attention_triton)
from pagedlab.layers.attention import AttentionMetadata, get_attention_backend
from pagedlab.layers.attention.triton_backend import (CASCADE_MIN_SEQS, CASCADE_MIN_SHARED_KEYS,
                                                      TritonAttentionBackend, cascade_prefix_len)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, gen, device=DEVICE, extra_blocks=3):
    """A paged batch: ``seqs`` is [(context_len, query_len)]; blocks are shuffled over the pool.

    Every cache slot no sequence owns (spare blocks, the tail of last blocks) holds NaN, and
    unused block-table entries point at a NaN block, so reading past a sequence shows up.
    """
    seq_lens = [c + q for c, q in seqs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    order = torch.randperm(num_blocks, generator=gen)
    nan_block = int(order[-1])
    block_tables = torch.full((len(seqs), max(blocks_per_seq) + 2), nan_block, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for i, (n, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        block_tables[i, :n] = order[used:used + n]
        used += n
        slots = ((block_tables[i, :n].long()[:, None] * block_size + torch.arange(block_size))
                 .flatten()[:seq_len])
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        write_kv_torch(keys, values, k_cache, v_cache, slots)
    query_lens = torch.tensor([q for _, q in seqs])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(query_start_loc[-1]), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, query_start_loc=query_start_loc,
                   seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables)
    return {name: t.to(device) for name, t in tensors.items()}


def check_attention(batch, max_query_len, max_seq_len=None, split_kv_size=None, **kwargs):
    scale = batch["q"].shape[-1] ** -0.5
    expected = paged_attention_torch(**batch, scale=scale)
    got = paged_attention_triton(**batch, scale=scale, max_query_len=max_query_len, max_seq_len=max_seq_len,
                                 split_kv_size=split_kv_size, **kwargs)
    num_tokens = int(batch["query_start_loc"][-1])
    tol = TOLERANCE[batch["q"].dtype]
    torch.testing.assert_close(got[:num_tokens].float(), expected[:num_tokens].float(), atol=tol, rtol=tol)
    return got


# (context_len, query_len) per sequence; lengths cross 16/32/64-token block boundaries.
SCENARIOS = {
    "prefill": [(0, 70), (0, 1), (0, 33)],
    "prefix_hit": [(64, 9), (32, 40)],
    "chunked_prefill": [(48, 24), (100, 30)],
    "decode": [(0, 1), (15, 1), (16, 1), (63, 1), (64, 1), (129, 1)],
    "mixed": [(0, 20), (77, 1), (30, 17), (10, 0), (5, 1)],
}

# (block_size, head_dim, group, dtype): every block size, head dim 64/128 plus padded 32/80/96,
# GQA 1/2/3/4/8, both test dtypes.
CONFIGS = [
    (16, 64, 1, torch.float32),
    (16, 128, 4, torch.float16),
    (32, 64, 2, torch.float16),
    (32, 128, 8, torch.float32),
    (64, 96, 4, torch.float16),
    (64, 64, 8, torch.float16),
    (16, 32, 2, torch.float32),
    (32, 80, 3, torch.float32),
]


def _config_id(config):
    block_size, head_dim, group, dtype = config
    return f"bs{block_size}-d{head_dim}-g{group}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention_matches_reference(scenario, config):
    block_size, head_dim, group, dtype = config
    seqs = SCENARIOS[scenario]
    batch = make_batch(seqs, 2, group, head_dim, block_size, dtype, _generator(scenario, config))
    check_attention(batch, max_query_len=max(q for _, q in seqs))


@pytest.mark.parametrize("config", CONFIGS[:6], ids=_config_id)
def test_decode_split_kv_matches_reference(config):
    block_size, head_dim, group, dtype = config
    seqs = [(200, 1), (15, 1), (64, 1), (127, 1)]
    batch = make_batch(seqs, 2, group, head_dim, block_size, dtype, _generator("split", config))
    check_attention(batch, max_query_len=1, max_seq_len=201, split_kv_size=64)


def test_split_kv_general_batch_and_reused_buffers():
    # Split-KV is only chosen for decode, but it is correct for any batch; exercise prefix hits,
    # an empty sequence, an oversized preallocated scratch, a preallocated output and the
    # default max_seq_len bound.
    seqs = [(70, 12), (0, 1), (9, 0), (130, 1)]
    batch = make_batch(seqs, 2, 4, 64, 32, torch.float32, _generator("split-general"))
    num_tokens, num_heads, head_dim = batch["q"].shape
    scratch = allocate_split_kv_scratch(num_tokens + 5, num_heads, head_dim, 512, 128, DEVICE)
    out = torch.full_like(batch["q"], 7.0)
    got = check_attention(batch, max_query_len=12, max_seq_len=131, split_kv_size=128, scratch=scratch,
                          out=out)
    assert got is out
    check_attention(batch, max_query_len=12, split_kv_size=64)


@pytest.mark.parametrize("max_query_len", [1, 5], ids=["decode", "loose"])
def test_padding_rows_untouched_and_upper_bound_hints(max_query_len):
    # CUDA-graph style: q padded past the last sequence, a sequence with no query token between
    # two decodes, loose max_seq_len (and max_query_len) bounds. Decode (max_query_len 1) runs
    # one program per sequence, the loose bound the query-start search.
    seqs = [(40, 1), (9, 0), (3, 1)]
    batch = make_batch(seqs, 2, 2, 64, 16, torch.float32, _generator("padding"))
    batch["q"] = torch.cat([batch["q"], torch.zeros_like(batch["q"][:3])])
    for split in (None, 64):
        out = torch.full_like(batch["q"], 7.0)
        check_attention(batch, max_query_len=max_query_len, max_seq_len=300, split_kv_size=split, out=out)
        assert torch.all(out[2:] == 7.0)


def test_sequence_search_over_several_chunks(monkeypatch):
    # Programs find their sequence scanning query_start_loc a chunk at a time; use tiny chunks.
    import pagedlab.kernels.paged_attention as paged_attention

    monkeypatch.setattr(paged_attention, "SEQUENCE_SEARCH_CHUNK", 2)
    seqs = SCENARIOS["mixed"] + SCENARIOS["decode"]
    batch = make_batch(seqs, 1, 4, 64, 16, torch.float32, _generator("search"))
    check_attention(batch, max_query_len=20)
    check_attention(batch, max_query_len=20, split_kv_size=64)


def test_choose_split_kv_size():
    # the size is chosen for sequences of up to SPLIT_KV_SHORT_SEQ keys, whatever the launch's bound
    # (a CUDA graph's max_model_len); longer sequences' segments grow (max_kv_segments)
    assert choose_split_kv_size(1, 8, 1, 4096) == choose_split_kv_size(1, 8, 1, SPLIT_KV_SHORT_SEQ) == 64
    assert choose_split_kv_size(2, 8, 1, 40960) == choose_split_kv_size(2, 8, 1, SPLIT_KV_SHORT_SEQ) == 128
    assert choose_split_kv_size(4, 8, 1, 8192) == SPLIT_KV_SIZE
    assert choose_split_kv_size(4, 8, 1) == SPLIT_KV_SIZE
    assert choose_split_kv_size(SPLIT_KV_MIN_PROGRAMS // 8, 8, 1, 4096) is None  # grid already full
    assert choose_split_kv_size(1, 8, 7, 4096) is None  # not a decode-only batch
    assert choose_split_kv_size(1, 8, 1, SPLIT_KV_SIZE) is None  # one segment would hold it all
    assert choose_split_kv_size(1, 8, 1, 4096, split_kv_size=64) == 64
    # tiny batches of short sequences take smaller segments while the grid stays within ~one program per SM
    assert choose_split_kv_size(1, 8, 1, 640) == 64  # 80 programs
    assert choose_split_kv_size(2, 8, 1, 640) == 128  # 64-key segments would make 160
    assert choose_split_kv_size(1, 8, 1, 640, split_kv_size=SPLIT_KV_SIZE) == SPLIT_KV_SIZE


def test_capped_split_segments_grow_with_the_sequence():
    # At most 2 segments of at least 64 keys: 301 keys split as 2 x 192 and 129 as 2 x 128, while
    # short sequences keep 64-key segments; a loose bound sizes nothing past the cap. A sequence
    # with no query token before a long one: its decode row cannot count the long one's segments
    # by position and folds them all.
    seqs = [(300, 1), (15, 1), (3, 0), (128, 1), (0, 1)]
    batch = make_batch(seqs, 2, 2, 64, 16, torch.float32, _generator("capped"))
    scratch = allocate_split_kv_scratch(4, 4, 64, 4096, 64, DEVICE, max_kv_segments=2)
    assert scratch[0].shape[2] == 2
    check_attention(batch, max_query_len=1, max_seq_len=4096, split_kv_size=64, max_kv_segments=2,
                    scratch=scratch)
    check_attention(batch, max_query_len=5, max_seq_len=4096, split_kv_size=64, max_kv_segments=2)
    with pytest.raises(ValueError, match="max_kv_segments=0"):
        check_attention(batch, max_query_len=1, split_kv_size=64, max_kv_segments=0)


def test_decode_order_is_longest_first_with_ties_in_batch_order():
    assert decode_order([5, 9, 5, 12, 1]).tolist() == [3, 1, 0, 2, 4]
    assert decode_order([7]).dtype == np.int32


@pytest.mark.parametrize("split_kv_size", [None, 64])
def test_decode_launch_takes_its_sequences_in_the_given_order(split_kv_size):
    """Any order of the sequences gives the batch-order launch's output bitwise (each program's
    work is its own), longest first or shuffled, split or not."""
    seqs = [(15, 1), (200, 1), (64, 1), (127, 1), (0, 1), (130, 1)]
    batch = make_batch(seqs, 2, 4, 64, 16, torch.float32, _generator("order", split_kv_size))
    plain = check_attention(batch, 1, max_seq_len=201, split_kv_size=split_kv_size)
    longest_first = torch.from_numpy(decode_order(batch["seq_lens"].tolist())).to(DEVICE)
    assert longest_first.tolist() == [1, 5, 3, 2, 0, 4]
    shuffled = torch.randperm(6, generator=_generator("shuffle")).to(torch.int32).to(DEVICE)
    for order in (longest_first, shuffled):
        got = check_attention(batch, 1, max_seq_len=201, split_kv_size=split_kv_size, seq_order=order)
        assert torch.equal(got, plain)


def test_decode_programs_attend_the_sequences_the_order_names():
    """Program i attends sequence ``seq_order[i]``: an order naming sequences 3 and 1 (each
    several times) writes their rows, the reference's, and leaves the others untouched."""
    batch = make_batch([(40, 1), (200, 1), (2, 1), (90, 1)], 2, 2, 64, 16, torch.float32, _generator("named"))
    scale = 64 ** -0.5
    expected = paged_attention_torch(**batch, scale=scale)
    out = torch.full_like(batch["q"], float("nan"))
    order = torch.tensor([3, 1, 3, 1], dtype=torch.int32, device=DEVICE)
    paged_attention_triton(**batch, scale=scale, max_query_len=1, out=out, seq_order=order)
    torch.testing.assert_close(out[[1, 3]], expected[[1, 3]], atol=1e-4, rtol=1e-4)
    assert out[[0, 2]].isnan().all()


def test_the_triton_backend_hands_the_decode_launch_its_order(monkeypatch):
    batch = make_batch([(40, 1), (200, 1), (2, 1), (90, 1)], 2, 2, 64, 16, torch.float32,
                       _generator("backend"))
    order = torch.tensor([1, 3, 0, 2], dtype=torch.int32, device=DEVICE)
    metadata = AttentionMetadata(slot_mapping=torch.zeros(4, dtype=torch.int64, device=DEVICE),
                                 query_start_loc=batch["query_start_loc"], seq_lens=batch["seq_lens"],
                                 block_tables=batch["block_tables"], max_query_len=1, max_seq_len=240,
                                 seq_order=order)
    orders = []

    def launch(*args, _launch=paged_attention.paged_attention_triton, **kwargs):
        orders.append(kwargs["seq_order"])
        return _launch(*args, **kwargs)
    monkeypatch.setattr(paged_attention, "paged_attention_triton", launch)
    out = TritonAttentionBackend().attend(batch["q"], batch["k_cache"], batch["v_cache"], metadata, 0.125)
    assert len(orders) == 1 and orders[0] is order
    torch.testing.assert_close(out, paged_attention_torch(**batch, scale=0.125), atol=1e-4, rtol=1e-4)


def test_seq_order_must_be_an_int32_decode_order():
    batch = make_batch([(40, 1), (2, 1)], 2, 2, 64, 16, torch.float32, _generator("bad order"))
    good = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    elsewhere = good.to("meta")
    for order, max_query_len in ((good.long(), 1), (good[:1], 1), (good, 2), (elsewhere, 1)):
        with pytest.raises(ValueError, match=r"seq_order \(shape .*\) must be int32 of shape \(2,\) on "):
            paged_attention_triton(**batch, scale=1.0, max_query_len=max_query_len, seq_order=order)


def test_decode_reduce_folds_only_the_segments_a_sequence_fills():
    # Poison the partials past each sequence's last segment: the decode reduce must not read them.
    batch = make_batch([(40, 1), (200, 1), (2, 1)], 2, 2, 64, 16, torch.float32, _generator("folds"))
    q, seq_lens = batch["q"], batch["seq_lens"]
    scale, num_segments = 64 ** -0.5, 8
    kernels = _AttentionKernels(q, batch["k_cache"], batch["v_cache"], scale)
    expected = paged_attention_torch(**batch, scale=scale)
    for decode in (True, False):
        scratch = allocate_split_kv_scratch(3, 4, 64, 512, 64, DEVICE)
        kernels.attend(scratch, batch["query_start_loc"], seq_lens, batch["block_tables"], 1, 64,
                       num_segments)
        for token, seq_len in enumerate(seq_lens.tolist()):
            scratch[1][token, :, -(-seq_len // 64):] = float("inf")
        out = torch.empty_like(q)
        kernels.reduce(out, scratch, batch["query_start_loc"], seq_lens, num_segments, 64, decode=decode)
        if decode:
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        else:
            assert not torch.isfinite(out).all()  # the poison is there to be read


def test_reduce_drops_the_acc_of_segments_without_keys():
    # Segments past a sequence's keys store stats (max -inf) and no acc; the reduce loads every
    # segment's acc with its stats, so their NaN-filled acc must not reach the output.
    batch = make_batch([(40, 1), (200, 1), (2, 1)], 2, 2, 64, 16, torch.float32, _generator("empty"))
    q, seq_lens, scale = batch["q"], batch["seq_lens"], 64 ** -0.5
    kernels = _AttentionKernels(q, batch["k_cache"], batch["v_cache"], scale)
    for decode in (True, False):
        scratch = allocate_split_kv_scratch(3, 4, 64, 512, 64, DEVICE)
        scratch[0].fill_(float("nan"))
        kernels.attend(scratch, batch["query_start_loc"], seq_lens, batch["block_tables"], 1, 64, 8)
        assert (scratch[1] == float("-inf")).any()  # empty segments are there to be dropped
        out = torch.empty_like(q)
        kernels.reduce(out, scratch, batch["query_start_loc"], seq_lens, 8, 64, decode=decode)
        torch.testing.assert_close(out, paged_attention_torch(**batch, scale=scale), atol=1e-4, rtol=1e-4)


def test_bad_split_size_is_rejected():
    batch = make_batch([(10, 1)], 1, 1, 64, 16, torch.float32, _generator("bad"))
    with pytest.raises(ValueError, match="split_kv_size=48"):
        paged_attention_triton(**batch, scale=0.125, max_query_len=1, split_kv_size=48)


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,dtype", [
    (16, 2, 64, torch.float32),
    (32, 3, 96, torch.float16),
    (64, 8, 128, torch.bfloat16),
])
def test_write_kv_matches_reference(block_size, num_kv_heads, head_dim, dtype):
    gen = _generator("kv", block_size, num_kv_heads, head_dim)
    num_blocks, num_tokens = 6, 23
    # key/value as strided slices of one fused tensor. float32 sources test the cast on the way,
    # except into bf16: the interpreter truncates float32 -> bf16 where torch rounds.
    source_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(DEVICE, source_dtype)
    key, value = fused[:, :num_kv_heads], fused[:, 2 * num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 6, 22]] = -1
    slot_mapping = slots.to(DEVICE)
    initial = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    k_ref, v_ref, k_got, v_got = initial.clone(), -initial, initial.clone(), -initial
    write_kv_torch(key, value, k_ref, v_ref, slot_mapping)
    write_kv_triton(key, value, k_got, v_got, slot_mapping)
    assert torch.equal(k_got, k_ref)
    assert torch.equal(v_got, v_ref)


def test_triton_backend_matches_torch_backend():
    triton_backend = get_attention_backend("triton", torch.device(DEVICE))
    torch_backend = get_attention_backend("torch", torch.device(DEVICE))
    gen = _generator("backend")
    seqs = [(16, 1), (0, 9), (33, 1)]
    batch = make_batch(seqs, 2, 2, 64, 16, torch.float32, gen)
    # The step's new tokens are the last query_len positions of each sequence: rewrite them.
    slots = []
    for i, (context_len, query_len) in enumerate(seqs):
        for pos in range(context_len, context_len + query_len):
            slots.append(int(batch["block_tables"][i, pos // 16]) * 16 + pos % 16)
    slot_mapping = torch.tensor(slots, device=DEVICE)
    key = torch.randn(len(slots), 2, 64, generator=gen).to(DEVICE)
    value = torch.randn(len(slots), 2, 64, generator=gen).to(DEVICE)
    metadata = AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=batch["query_start_loc"],
                                 seq_lens=batch["seq_lens"], block_tables=batch["block_tables"],
                                 max_query_len=9, max_seq_len=34)
    outputs = []
    for backend in (torch_backend, triton_backend):
        k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
        backend.write_kv(key, value, k_cache, v_cache, slot_mapping)
        outputs.append(backend.attend(batch["q"], k_cache, v_cache, metadata, 0.125))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


def share_prefix(batch, prefix_blocks: int) -> None:
    """Point every sequence's first ``prefix_blocks`` table entries at sequence 0's blocks."""
    batch["block_tables"][1:, :prefix_blocks] = batch["block_tables"][0, :prefix_blocks]


def check_cascade(batch, prefix_len, buffers=None):
    """Cascade attention against the reference; ``buffers`` (reused across calls) as a graph does."""
    scale = batch["q"].shape[-1] ** -0.5
    if buffers is None:
        buffers = CascadeBuffers.allocate(batch["q"].shape[0], batch["q"].device)
    buffers.set_prefix_len(prefix_len)
    expected = paged_attention_torch(**batch, scale=scale)
    got = cascade_attention_triton(batch["q"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
                                   batch["seq_lens"], batch["block_tables"], buffers, scale,
                                   max_seq_len=int(batch["seq_lens"].max()) + 50)
    tol = TOLERANCE[batch["q"].dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[3], CONFIGS[5]], ids=_config_id)
def test_cascade_attention_matches_reference(config):
    """Decode over a shared prefix of 64, 192 or 320 keys (the last over two prefix segments) plus
    own keys that cross blocks; the same buffers serve each prefix length and also no prefix at
    all (a graph replays them so)."""
    block_size, head_dim, group, dtype = config
    own = [1, 2, 17, 63, 64, 65, 130, 300, 5, 33, 16, 1, 90, 7, 48, 250, 3]
    buffers = None
    for prefix_len in (5 * TILE_N, 3 * TILE_N, TILE_N, 0):
        shared_blocks = -(-max(prefix_len, 1) // block_size)  # whole blocks, past the prefix if need be
        seqs = [(shared_blocks * block_size + n - 1, 1) for n in own]
        batch = make_batch(seqs, 2, group, head_dim, block_size, dtype,
                           _generator("cascade", config, prefix_len))
        share_prefix(batch, shared_blocks)
        if buffers is None:
            buffers = CascadeBuffers.allocate(len(own), DEVICE)
        check_cascade(batch, prefix_len, buffers)


def test_cascade_prefix_len_finds_the_shared_tiles():
    block_size = 16
    num_seqs = max(CASCADE_MIN_SEQS, -(-CASCADE_MIN_SHARED_KEYS // TILE_N))  # one shared tile pays
    blocks = 3 * TILE_N // block_size + 1  # 3 tiles and one more block of shared keys
    shared = np.arange(blocks, dtype=np.int32)
    table = np.stack([np.concatenate([shared, 1000 + 10 * i + np.arange(10, dtype=np.int32)])
                      for i in range(num_seqs)])
    long = [blocks * block_size + 100] * num_seqs
    assert cascade_prefix_len(table, long, block_size) == 3 * TILE_N  # rounded down to whole tiles
    # the shortest sequence must keep its own last key out of the prefix
    assert cascade_prefix_len(table, long[:-1] + [2 * TILE_N], block_size) == TILE_N
    diverged = table.copy()
    diverged[5, TILE_N // block_size + 1] = 999  # one sequence differs inside the second tile
    assert cascade_prefix_len(diverged, long, block_size) == TILE_N
    half = num_seqs // 2  # one tile shared by half as many sequences does not pay
    assert cascade_prefix_len(diverged[:half], long[:half], block_size) == 0
    diverged[7, 0] = 998  # ... and one from the start
    assert cascade_prefix_len(diverged, long, block_size) == 0
    assert cascade_prefix_len(table[:CASCADE_MIN_SEQS - 1], long[:CASCADE_MIN_SEQS - 1], block_size) == 0
    buffers = CascadeBuffers.allocate(4, DEVICE)
    with pytest.raises(ValueError, match="prefix_len=100"):
        buffers.set_prefix_len(100)


def test_cascade_end_to_end_gives_hf_tokens(tiny_llama, monkeypatch):
    """A tiny model on the Triton backend: 16 prompts share a cached 256-token prefix, so decode
    steps take the cascade path (its threshold lowered to fit the interpreter); greedy tokens are
    HF's. Two prompts over a 68-token prefix (the thresholds lowered further) take it too, and with
    cascade attention off they never do and still give HF's tokens."""
    from conftest import hf_greedy, random_prompts
    from pagedlab import LLM, SamplingParams
    from pagedlab.layers.attention import triton_backend

    monkeypatch.setattr(triton_backend, "CASCADE_MIN_SHARED_KEYS", 0)
    calls = []
    real = paged_attention.cascade_attention_triton
    monkeypatch.setattr(paged_attention, "cascade_attention_triton",
                        lambda *a, **k: calls.append(int(a[6].prefix_len)) or real(*a, **k))
    prefix = random_prompts(1, min_len=260, max_len=260, seed=80)[0]
    prompts = [prefix + tail for tail in random_prompts(16, min_len=1, max_len=6, seed=81)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    short = [prefix[:68] + tail for tail in random_prompts(2, min_len=1, max_len=6, seed=82)]
    # (cascade on, prompts, the shared keys the cascade launches must see: none with it off)
    runs = [(True, prompts, {256}), (True, short, {64}), (False, short, set())]  # 260 / 68 shared tokens
    for cascade, batch, shared in runs:
        if batch is short:
            monkeypatch.setattr(triton_backend, "CASCADE_MIN_SEQS", 2)
        expected = [hf_greedy(tiny_llama.hf_model, p, 3, eos_token_id=None) for p in batch]
        with LLM(tiny_llama.path, attention_backend="triton", kv_cache_memory_bytes=16 << 20,
                 enable_cascade_attention=cascade) as llm:
            outputs = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        assert outputs == expected
        assert set(calls) == shared, calls
        calls.clear()


def test_tiny_model_end_to_end_triton_equals_torch(tiny_llama):
    """The whole engine on the Triton backend (interpreted here): prefills, chunked prefills,
    prefix-cache hits and decodes give the torch backend's greedy tokens, which are HF's."""
    from conftest import hf_greedy, random_prompts
    from pagedlab import LLM, SamplingParams

    prefix = random_prompts(1, min_len=40, max_len=40, seed=90)[0]
    prompts = [prefix + tail for tail in random_prompts(3, max_len=20, seed=91)] + random_prompts(3, seed=92)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        with LLM(tiny_llama.path, attention_backend=backend, kv_cache_memory_bytes=16 << 20,
                 max_num_batched_tokens=32) as llm:
            tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert llm.get_stats().prefix_cache_hit_tokens > 0
    assert tokens["triton"] == tokens["torch"]
    assert tokens["torch"] == [hf_greedy(tiny_llama.hf_model, p, 6, eos_token_id=None) for p in prompts]


# ---------------------------------------------------------------- real sizes on the GPU (bf16)

REAL = dict(num_kv_heads=8, group=4, head_dim=128, dtype=torch.bfloat16)


def _real_batch(seqs, block_size, name):
    return make_batch(seqs, REAL["num_kv_heads"], REAL["group"], REAL["head_dim"], block_size, REAL["dtype"],
                      _generator(name, block_size), device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_prefill_256x512(block_size):
    check_attention(_real_batch([(0, 512)] * 256, block_size, "gpu-prefill"), max_query_len=512)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_decode_256x576(block_size):
    batch = _real_batch([(575, 1)] * 256, block_size, "gpu-decode")
    assert choose_split_kv_size(256, REAL["num_kv_heads"], 1, 576) is None
    check_attention(batch, max_query_len=1, max_seq_len=576)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch_size", [1, 4, 15])
def test_gpu_decode_split_kv(batch_size):
    # the engine's split of long sequences: at batch 1 (64-key segments) and 15 (256) the longest
    # pass SPLIT_KV_MAX_SEGMENTS segments and theirs grow; then the uncapped split and no split
    seqs = [(4000 + 997 * i, 1) for i in range(batch_size)]
    max_seq_len = max(c + q for c, q in seqs)
    split = choose_split_kv_size(batch_size, REAL["num_kv_heads"], 1, max_seq_len)
    assert split in (*SPLIT_KV_SMALL_SIZES, SPLIT_KV_SIZE)
    batch = _real_batch(seqs, 16, f"gpu-split-{batch_size}")
    check_attention(batch, max_query_len=1, max_seq_len=max_seq_len, split_kv_size=split,
                    max_kv_segments=SPLIT_KV_MAX_SEGMENTS)
    check_attention(batch, max_query_len=1, max_seq_len=max_seq_len, split_kv_size=split)
    check_attention(batch, max_query_len=1, max_seq_len=max_seq_len)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch_size, split", [(1, 64), (2, 128)])
def test_gpu_decode_small_split_kv(batch_size, split):
    seqs = [(639 - 50 * i, 1) for i in range(batch_size)]
    assert choose_split_kv_size(batch_size, REAL["num_kv_heads"], 1, 640) == split
    batch = _real_batch(seqs, 16, f"gpu-small-split-{batch_size}")
    check_attention(batch, max_query_len=1, max_seq_len=640, split_kv_size=split)


@pytest.mark.gpu
@gpu
def test_gpu_mixed_chunked_prefill_prefix_and_decode():
    seqs = [(6144, 2048), (2048, 64), (0, 300)] + [(100 + 37 * i, 1) for i in range(64)]
    check_attention(_real_batch(seqs, 32, "gpu-mixed"), max_query_len=2048)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_cascade_decode_256_sequences_over_a_2048_key_prefix(block_size):
    seqs = [(2048 + 64 + i % 64, 1) for i in range(256)]
    batch = _real_batch(seqs, block_size, "gpu-cascade")
    share_prefix(batch, 2048 // block_size)
    table = batch["block_tables"].cpu().numpy()
    assert cascade_prefix_len(table, batch["seq_lens"].tolist(), block_size) == 2048
    check_cascade(batch, 2048)
    check_cascade(batch, 1024)  # a shorter prefix than shared is right too


@pytest.mark.gpu
@gpu
def test_gpu_write_kv():
    gen = _generator("gpu-kv")
    num_tokens, num_blocks, block_size = 4096, 1024, 16
    key = torch.randn(num_tokens, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    value = torch.randn(num_tokens, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    slot_mapping = slots.to("cuda")
    k_ref = torch.zeros(num_blocks, block_size, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_ref, k_got, v_got = k_ref.clone(), k_ref.clone(), k_ref.clone()
    write_kv_torch(key, value, k_ref, v_ref, slot_mapping)
    write_kv_triton(key, value, k_got, v_got, slot_mapping)
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)
