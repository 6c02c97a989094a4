"""KVCacheManager invariants and prefix caching, alone and under a real engine workload."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import KV_BYTES, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams
from pagedlab.engine import gpu_memory
from pagedlab.engine import kv_cache as kv_module
from pagedlab.engine.kv_cache import KVCacheManager, PrefixHit
from pagedlab.engine.model_runner import ModelRunner
from pagedlab.engine.request import Request


def make_request(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams())


def admit(kv: KVCacheManager, request: Request) -> int:
    """Allocate a whole prompt the way the scheduler does, and count it computed (its step ran);
    returns the cached token count."""
    hit = kv.find_cached_prefix(request)
    cached = hit.num_tokens(kv.block_size)
    assert kv.allocate_slots(request, request.num_tokens - cached, hit)
    request.num_computed_tokens = request.num_tokens
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


def test_a_hit_counts_the_draft_keys_of_its_leading_marked_blocks_and_a_reused_block_loses_them():
    """``draft_ready_tokens``: a prefix hit's leading blocks a draft model computed (marked by
    ``mark_draft_ready`` up to the last block its tokens fill, those before it too); a block the
    pool hands out for other tokens holds no draft keys, even under the same name later."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request(range(14), "a")
    admit(kv, a)
    kv.mark_draft_ready(a, 3)  # no block full yet
    assert not any(kv.blocks[b].draft_ready for b in a.block_ids)
    kv.mark_draft_ready(a, 10)  # blocks 0 and 1 full, block 2 not
    assert [kv.blocks[b].draft_ready for b in a.block_ids] == [True, True, False, False]
    b = make_request(range(13), "b")
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens(4) == 12 and kv.draft_ready_tokens(hit) == 8
    kv.mark_draft_ready(a, 14)
    assert kv.draft_ready_tokens(kv.find_cached_prefix(b)) == 12
    kv.free(a)
    c = make_request([50 + t for t in range(16)], "c")  # takes every block over
    admit(kv, c)
    assert not any(kv.blocks[i].draft_ready for i in c.block_ids)
    kv.free(c)
    d = make_request([50 + t for t in range(13)], "d")
    assert kv.draft_ready_tokens(kv.find_cached_prefix(d)) == 0


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


def test_a_cache_too_small_for_one_sequence_names_the_bytes_and_the_length_that_fits(tiny_llama):
    """vLLM's check_enough_kv_cache_memory: the error names the memory one max_model_len sequence
    needs, the memory there is, and the longest max_model_len that fits (10 blocks of 16 here)."""
    cfg = tiny_llama.hf_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # K and V, float32
    with pytest.raises(ValueError) as error:
        LLM(tiny_llama.path, kv_cache_memory_bytes=10 * 16 * token_bytes + 100)
    message = str(error.value)
    assert f"kv_cache_memory_bytes={10 * 16 * token_bytes + 100}" in message
    length = cfg.max_position_embeddings
    assert f"max_model_len={length} needs {length * token_bytes} bytes" in message
    assert "lower max_model_len to at most 160" in message


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


def test_a_block_decode_fills_is_named_at_once_for_a_request_running_beside():
    """Decode steps that only write into the last block take the fast path, but the step whose
    tokens fill a block names it then (not when the next block is taken), so a prompt that
    repeats the running sequence hits it at the next step."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request(range(6))
    admit(kv, request)
    for step in range(7):
        decode(kv, request, 1, first_token=500 + step)
        assert len(request.block_hashes) == request.num_tokens // kv.block_size
        follower = make_request(request.all_token_ids + [7], f"f{step}")
        assert kv.find_cached_prefix(follower).num_tokens(kv.block_size) == (request.num_tokens // 4) * 4
    check_invariants(kv, [request])


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


def test_a_hit_on_free_cached_blocks_counts_them_against_the_pool():
    """Pool of 4 blocks of 4, all free, two of them naming tokens 0-7. A 16-token request reusing
    them needs 2 new blocks (4 in all): it fits. A 20-token one needs 3 new, and the 2 cached blocks
    it takes leave only 2: it fails and changes nothing."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request(range(9), "a")
    admit(kv, a)
    kv.free(a)
    too_big = make_request(list(range(8)) + list(range(50, 62)), "big")
    hit = kv.find_cached_prefix(too_big)
    assert len(hit.block_ids) == 2
    assert not kv.allocate_slots(too_big, too_big.num_tokens - 8, hit)
    assert too_big.block_ids == [] and kv.num_free_blocks == 4
    check_invariants(kv, [])
    fits = make_request(list(range(8)) + list(range(50, 58)), "fits")
    assert admit(kv, fits) == 8
    assert len(fits.block_ids) == 4 and kv.num_free_blocks == 0
    check_invariants(kv, [fits])


def test_evicting_a_duplicate_block_keeps_the_original_name():
    """b repeats a's 8 tokens, so it recomputes the second block (it holds b's last token) into a
    block of its own. Evicting that copy must not forget a's block, still held and named."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(range(8), "a")
    admit(kv, a)
    b = make_request(range(8), "b")
    assert admit(kv, b) == 4
    assert b.block_ids[1] != a.block_ids[1]
    kv.free(b)
    filler = make_request(range(100, 124), "f")  # the 6 free blocks, b's copy among them
    admit(kv, filler)
    assert b.block_ids == [] and kv.num_free_blocks == 0
    kv.free(filler)
    c = make_request(list(range(8)) + [99], "c")
    assert admit(kv, c) == 8 and c.block_ids[:2] == a.block_ids
    check_invariants(kv, [a, c])


def test_free_releases_the_tail_first_so_a_prefix_is_evicted_last():
    """Pool of 6: a (9 tokens) holds 3 blocks and frees them. A 16-token request takes the 3
    never-used blocks and one more: a's tail, the first of a's freed, so a's prefix survives."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request(range(9), "a")
    admit(kv, a)
    prefix_blocks, tail = a.block_ids[:2], a.block_ids[2]
    kv.free(a)
    filler = make_request(range(100, 116), "f")
    admit(kv, filler)
    assert tail in filler.block_ids and not set(prefix_blocks) & set(filler.block_ids)
    kv.free(filler)
    again = make_request(range(9), "a2")
    assert admit(kv, again) == 8 and again.block_ids[:2] == prefix_blocks
    check_invariants(kv, [again])


def test_reset_prefix_cache_forgets_old_names_and_caches_anew():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request(range(9), "a")
    admit(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.cached_blocks == {}
    b = make_request(range(9), "b")
    assert admit(kv, b) == 0  # computed again
    b_prefix = b.block_ids[:2]
    kv.free(b)
    c = make_request(range(9), "c")
    assert admit(kv, c) == 8 and c.block_ids[:2] == b_prefix
    check_invariants(kv, [c])


@pytest.mark.parametrize("block_size, window", [(4, 6), (4, 4), (8, 5)])
def test_sliding_window_releases_exactly_the_blocks_no_query_sees(block_size, window):
    """Token p attends to positions p - window + 1 .. p, so before computing token p the blocks
    wholly before p - window + 1 are dead: (p - window + 1) // block_size of them, no more, no less."""
    kv = KVCacheManager(num_blocks=16, block_size=block_size, sliding_window=window)
    request = make_request(range(10))
    admit(kv, request)
    request.num_computed_tokens = request.num_tokens
    for step in range(30):
        request.all_token_ids.append(500 + step)  # sampled; now computing it at position p
        p = request.num_computed_tokens
        assert kv.allocate_slots(request, 1)
        assert request.num_released_blocks == max(p - window + 1, 0) // block_size, p
        check_invariants(kv, [request])
        request.num_computed_tokens += 1
    kv.free(request)
    check_invariants(kv, [])
    assert kv.num_free_blocks == 16


def test_a_windowed_request_freed_and_taken_back_leaks_nothing():
    """A request that released blocks to its window is preempted (freed) and admitted again,
    from a prefix hit, then decodes past its window again: every block goes back to the pool."""
    kv = KVCacheManager(num_blocks=8, block_size=4, sliding_window=4)
    request = make_request(range(12))
    admit(kv, request)
    decode(kv, request, 8)
    assert request.num_released_blocks >= 3
    kv.free(request)  # preempted
    assert request.num_released_blocks == 0 and kv.num_free_blocks == 8
    request.num_computed_tokens = 0
    assert admit(kv, request) > 0
    decode(kv, request, 8)
    check_invariants(kv, [request])
    kv.free(request)
    check_invariants(kv, [])
    assert kv.num_free_blocks == 8


def test_a_block_is_named_for_its_tokens_before_the_window_hands_it_back():
    """Window 1, blocks of 4, asynchronous steps (one sampled token still pending when the next
    step is scheduled). Before computing position 16, ``a`` hands back the block of positions
    12..15, and with the pool otherwise held takes it straight back for positions 16..19. The
    block must not be named for tokens 12..15 afterwards: a prefix hit on them would read keys of
    positions 16..19."""
    kv = KVCacheManager(num_blocks=6, block_size=4, sliding_window=1)
    a = make_request(range(100, 115), "a")
    admit(kv, a)
    a.num_pending_tokens = 1  # its first output token, sampled on the device
    assert kv.allocate_slots(a, 1)  # position 15 computes from the pending id
    a.num_computed_tokens = 16
    a.all_token_ids.append(115)  # read back; position 16's token is pending now
    b = make_request(list(range(100, 112)) + [7], "b")
    assert admit(kv, b) == 12  # a's released blocks of positions 0..11
    d = make_request([900], "d")
    admit(kv, d)  # the last free block
    assert kv.allocate_slots(a, 1)  # position 16
    a.num_computed_tokens = 17
    check_invariants(kv, [a, b, d])
    holder = a.block_ids[4]  # where a's keys of positions 16.. are written
    hit = kv.find_cached_prefix(make_request(list(range(100, 116)) + [7], "e"))
    assert holder not in hit.block_ids


def test_prompt_logprobs_are_computed_even_where_the_prefix_is_cached(tiny_llama):
    """A prompt run once leaves its blocks cached; run again asking for prompt logprobs, it takes
    nothing from the cache (a cached position has no logits) and every prompt position's logprob
    is HF's teacher-forced one."""
    prompt = random_prompts(1, min_len=40, max_len=40, seed=72)[0]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, block_size=16) as llm:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                              use_tqdm=False)
        assert llm.get_stats().kv_blocks_used == 0
    with torch.no_grad():
        ref = torch.log_softmax(tiny_llama.hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_generated_blocks_are_cached_for_a_later_prompt(tiny_llama, async_scheduling):
    """A 20-token prompt generates 30 tokens (blocks of 16; asynchronously, each step's input token
    is still pending when its slot is allocated). Its 50 tokens fill 3 blocks whose keys are all
    computed (the last sampled token's is not), so a prompt repeating prompt and output takes 48
    tokens from the cache, and continues as HF does."""
    prompt = random_prompts(1, min_len=20, max_len=20, seed=73)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, block_size=16,
             async_scheduling=async_scheduling) as llm:
        first = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        longer = prompt + first
        (out,) = llm.generate([longer], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                              use_tqdm=False)
        assert llm.get_stats().kv_blocks_used == 0
    assert out.num_cached_tokens == 48
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama.hf_model, longer, 4, eos_token_id=None)


def test_a_step_that_failed_to_launch_leaves_no_prefix_to_find(tiny_llama):
    """Slots are named as prefix blocks when allocated, before their step runs. A 40-token prompt's
    first step fails to launch, so its two full blocks never get keys and values; the aborted
    request must take their names with it, or the same prompt run again takes 32 tokens of
    unwritten KV from the cache (the engine keeps serving after a failed step)."""
    prompt = random_prompts(1, min_len=40, max_len=40, seed=74)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, block_size=16) as llm:
        runner = llm.llm_engine.runner
        real_launch = runner.launch

        def failing_launch(batch, previous=None):
            raise RuntimeError("injected launch failure")

        runner.launch = failing_launch
        with pytest.raises(RuntimeError, match="injected launch failure"):
            llm.generate([prompt], greedy, use_tqdm=False)
        runner.launch = real_launch
        (out,) = llm.generate([prompt], greedy, use_tqdm=False)
        assert llm.get_stats().kv_blocks_used == 0
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama.hf_model, prompt, 4, eos_token_id=None)


GIB = 1 << 30


def _profile_on_a_fake_gpu(monkeypatch, utilization, others=40 * GIB, context=GIB // 2, draft_pool=0):
    """``profile_gpu_kv_blocks`` on an 80 GiB GPU where other processes hold ``others`` and this
    process's CUDA context ``context`` when the engine starts; by the profile this process has
    reserved 12 GiB through torch (peak allocated 10 GiB) and 0.25 GiB outside it."""
    state = {"reserved": 0, "own_non_torch": 0}

    def mem_get_info(device=None):
        used = others + context + state["reserved"] + state["own_non_torch"]
        return 80 * GIB - used, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    device = torch.device("cuda", 0)
    baseline = gpu_memory.take_memory_baseline(device)  # before the weights, as load_model_runner does
    state.update(reserved=12 * GIB, own_non_torch=GIB // 4)
    runner = types.SimpleNamespace(device=device, memory_baseline=baseline, uses_mixed_cuda_graphs=False,
                                   bytes_per_block=1 << 20,
                                   _profiled_peak=lambda num_tokens, max_model_len: (2 * GIB, 10 * GIB))
    return ModelRunner.profile_gpu_kv_blocks(runner, 8192, 4096, utilization, 0, draft_pool)


def test_gpu_memory_utilization_is_this_instances_share_of_the_total(monkeypatch, caplog):
    """vLLM (gpu_worker.determine_available_memory, CacheConfig.gpu_memory_utilization): the KV
    cache gets ``total x utilization`` less this instance's non-KV memory (its torch peak and the
    non-torch memory it added since it started); memory other processes held at the start is not
    this instance's: "if you have two vLLM instances running on the same GPU, you can set the GPU
    memory utilization to 0.5 for each instance"."""
    caplog.set_level("INFO", logger="pagedlab.engine.model_runner")
    blocks = _profile_on_a_fake_gpu(monkeypatch, 0.45)
    assert blocks == int(80 * GIB * 0.45 - 10 * GIB - GIB // 4) // (1 << 20)
    assert "draft" not in caplog.text
    # a draft model's graph pool (RunnerPlan.extra_memory_bytes) comes out of the same share
    blocks = _profile_on_a_fake_gpu(monkeypatch, 0.45, draft_pool=3 * GIB)
    assert blocks == int(80 * GIB * 0.45 - 10 * GIB - GIB // 4 - 3 * GIB) // (1 << 20)
    assert "outside torch + 3.00 GiB for a draft's graphs)" in caplog.text


def test_more_than_the_free_memory_at_start_is_refused(monkeypatch):
    """vLLM's start-up check: 0.9 of 80 GiB is more than the 39.5 GiB other processes (and the
    CUDA context) left when the engine started; the error names both and the largest share."""
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 asks for 72.00 GiB of the GPU's 80.00 "
                                         r"GiB, but .* held 40.50 GiB when the engine started, leaving "
                                         r"39.50 GiB: lower gpu_memory_utilization to at most 0.49"):
        _profile_on_a_fake_gpu(monkeypatch, 0.9)
