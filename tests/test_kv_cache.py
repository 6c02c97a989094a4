"""KVCacheManager invariants and prefix caching, alone and under a real engine workload."""

from __future__ import annotations

import pytest

from conftest import KV_BYTES, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.engine import kv_cache as kv_module
from pagedlab.engine.kv_cache import KVCacheManager, PrefixHit
from pagedlab.engine.request import Request


def make_request(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams())


def admit(kv: KVCacheManager, request: Request) -> int:
    """Allocate a whole prompt the way the scheduler does; returns the cached token count."""
    hit = kv.find_cached_prefix(request)
    cached = hit.num_tokens(kv.block_size)
    assert kv.allocate_slots(request, request.num_tokens - cached, hit)
    request.num_computed_tokens += cached
    return cached


def check_invariants(kv: KVCacheManager, live: list[Request]) -> None:
    refs = [0] * kv.num_blocks
    for r in live:
        for b in r.block_ids[r.num_released_blocks:]:
            refs[b] += 1
    assert [b.ref_count for b in kv.blocks] == refs
    assert all(b.ref_count >= 0 for b in kv.blocks)
    assert set(kv.free_blocks) == {b.block_id for b in kv.blocks if b.ref_count == 0}
    for block_hash, block_id in kv.cached_blocks.items():
        assert kv.blocks[block_id].block_hash == block_hash


def test_prefix_hit_shares_blocks_and_counts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(range(10), "a")
    assert admit(kv, a) == 0
    b = make_request(list(range(8)) + [99, 98, 97], "b")
    assert admit(kv, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert kv.blocks[a.block_ids[0]].ref_count == 2
    assert kv.stats.hit_tokens == 8 and kv.stats.queried_tokens == 21
    check_invariants(kv, [a, b])
    kv.free(a)
    kv.free(b)
    check_invariants(kv, [])
    assert kv.num_free_blocks == 8


def test_last_token_is_never_taken_from_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(range(8), "a")
    admit(kv, a)
    b = make_request(range(8), "b")
    assert admit(kv, b) == 4  # the second block holds b's last token, so it is computed again


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(kv_module, "hash_block", lambda parent, tokens: b"same")
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, make_request([1, 2, 3, 4, 5], "a"))
    assert admit(kv, make_request([9, 9, 9, 9, 5], "b")) == 0


def test_freed_prefix_survives_until_evicted_least_recently_used_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request(range(9), "a")  # 3 blocks, 2 full
    admit(kv, a)
    kv.free(a)
    again = make_request(range(9), "a2")
    assert admit(kv, again) == 8  # reused after free
    kv.free(again)
    # Fill the pool with unrelated tokens: the cached prefix is evicted, tail block first.
    filler = make_request(range(100, 123), "f")
    assert admit(kv, filler) == 0
    check_invariants(kv, [filler])
    kv.free(filler)
    assert admit(kv, make_request(range(9), "a3")) == 0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request(range(8), "a")
    admit(kv, a)
    b = make_request(range(50, 60), "b")
    before = (kv.num_free_blocks, list(b.block_ids), b.num_computed_tokens)
    assert not kv.allocate_slots(b, 10, PrefixHit())
    assert (kv.num_free_blocks, list(b.block_ids), b.num_computed_tokens) == before
    check_invariants(kv, [a])


@pytest.mark.parametrize("block_size", [16, 32])
def test_engine_workload_leaks_nothing(tiny_llama, block_size):
    prompts = random_prompts(24, max_len=120, seed=60)
    prompts += [prompts[0][:50] + p for p in random_prompts(8, max_len=20, seed=61)]  # shared prefixes
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=4 + i % 30, ignore_eos=True)
              for i in range(32)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES // 8, block_size=block_size,
             max_num_batched_tokens=64, max_num_seqs=12) as llm:
        engine = llm.llm_engine
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            kv = engine.kv_cache
            check_invariants(kv, engine.scheduler.running)
            assert len(engine.scheduler.running) <= 12
        stats = llm.get_stats()
    assert len(finished) == 32
    assert [len(finished[str(i)].outputs[0].token_ids) for i in range(32)] == [sp.max_tokens for sp in params]
    assert stats.kv_blocks_used == 0
    assert stats.prefix_cache_hit_tokens >= 8 * (50 // block_size) * block_size
    assert 0 < stats.peak_kv_blocks_used <= stats.num_kv_blocks
    assert 0.0 <= stats.fragmentation_at_peak < 1.0


def test_fragmentation_counts_shared_prefix_blocks_once(tiny_llama):
    """4 prompts = one 32-token prefix (2 shared blocks of 16) + 5 own tokens (1 own block each):
    6 blocks = 96 slots at the peak, 32 + 4 * 5 = 52 of them filled."""
    prefix = random_prompts(1, min_len=32, max_len=32, seed=70)[0]
    prompts = [prefix + tail for tail in random_prompts(4, min_len=5, max_len=5, seed=71)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, block_size=16) as llm:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        stats = llm.get_stats()
    assert stats.prefix_cache_hit_tokens == 3 * 32
    assert stats.peak_kv_blocks_used == 6
    assert stats.kv_tokens_at_peak == 52
    assert stats.fragmentation_at_peak == pytest.approx(1 - 52 / 96)


def decode(kv: KVCacheManager, request: Request, steps: int, first_token: int = 500) -> None:
    """Run ``steps`` decode steps the way the scheduler does: allocate, compute, append."""
    for i in range(steps):
        request.num_computed_tokens = request.num_tokens - 1 if i else request.num_tokens
        request.all_token_ids.append(first_token + i)
        assert kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens


def test_sliding_window_holds_a_bounded_number_of_blocks():
    """Window 6, blocks of 4: a query sees at most two blocks back, so a 50-token sequence runs
    in a pool of 4 blocks; the released ones go back to the pool."""
    kv = KVCacheManager(num_blocks=4, block_size=4, sliding_window=6)
    request = make_request(range(10))
    admit(kv, request)
    for _ in range(40):
        decode(kv, request, 1)
        held = len(request.block_ids) - request.num_released_blocks
        assert held <= 3
        check_invariants(kv, [request])
        # every key the next query (at num_computed_tokens) sees is in a held block
        first_seen = request.num_computed_tokens - kv.sliding_window + 1
        assert request.num_released_blocks * kv.block_size <= first_seen
    assert request.num_released_blocks >= 9
    kv.free(request)
    check_invariants(kv, [])
    assert kv.num_free_blocks == 4


def test_released_block_is_a_prefix_only_while_it_holds_its_tokens():
    kv = KVCacheManager(num_blocks=6, block_size=4, sliding_window=4)
    a = make_request(range(12), "a")
    admit(kv, a)
    decode(kv, a, 6)
    assert a.num_released_blocks >= 2
    first_block = a.block_ids[0]
    assert kv.blocks[first_block].ref_count == 0  # freed, still named
    b = make_request(list(range(12)) + [7], "b")
    assert admit(kv, b) == 12  # the freed blocks still hold these keys: a correct hit
    assert b.block_ids[0] == first_block
    check_invariants(kv, [a, b])
    kv.free(b)
    kv.free(a)
    c = make_request(range(100, 124), "c")  # takes every block, so the old names are evicted
    admit(kv, c)
    kv.free(c)
    d = make_request(list(range(12)) + [7], "d")
    assert admit(kv, d) == 0
    check_invariants(kv, [d])
