"""The scheduler alone, driven with fake model outputs: token budget, FCFS admission, preemption
and recompute, prefix hits, max_num_seqs, stop checks and abort in every state; the priority
policy's admission and preemption."""

from __future__ import annotations

from pagedlab import SamplingParams
from pagedlab.engine.kv_cache import KVCacheManager
from pagedlab.engine.request import Request, RequestStatus
from pagedlab.engine.scheduler import ScheduledBatch, Scheduler

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_model_len=256, chunked=True,
                   prefix_caching=True, policy="fcfs") -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len, enable_chunked_prefill=chunked, policy=policy)


def make_request(rid: str, num_prompt: int, first_token: int = 100, priority: int = 0,
                 arrival_time: float | None = None, **params) -> Request:
    params = {"max_tokens": 50, "ignore_eos": False, **params}
    timing = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(rid, list(range(first_token, first_token + num_prompt)), SamplingParams(**params),
                   eos_token_ids=(EOS,), model_eos_token_id=EOS, priority=priority, **timing)


def run(scheduler: Scheduler, token: int = 7, tokens: dict[str, int] | None = None) -> ScheduledBatch:
    """One step: schedule, launch (fake), read back ``token`` (or ``tokens[request_id]``)."""
    batch = scheduler.schedule()
    sampled = scheduler.update_after_launch(batch)
    scheduler.update_from_output(sampled, [(tokens or {}).get(r.request_id, token) for r in sampled])
    return batch


def scheduled(batch: ScheduledBatch) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(batch.requests, batch.num_new_tokens)}


def test_budget_goes_to_decodes_first_then_chunks_of_waiting_prompts():
    s = make_scheduler(budget=16)
    a, b = make_request("a", 10), make_request("b", 30, first_token=300)
    s.add_request(a)
    assert scheduled(run(s)) == {"a": 10}  # whole prompt, samples its first token
    s.add_request(b)
    batch = run(s)
    assert scheduled(batch) == {"a": 1, "b": 15}  # one decode token, the rest of the budget to b's chunk
    assert a.num_output_tokens == 2 and b.num_output_tokens == 0  # b's chunk does not sample
    assert b.num_computed_tokens == 15
    assert scheduled(run(s)) == {"a": 1, "b": 15}  # b's prompt completes (30 = 15 + 15) and samples
    assert b.num_output_tokens == 1
    assert scheduled(run(s)) == {"a": 1, "b": 1}


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it():
    s = make_scheduler(budget=16, chunked=False)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 8, first_token=300))
    assert scheduled(run(s)) == {"a": 10}  # b (8) does not fit in the 6 left, and is not split
    assert scheduled(run(s)) == {"a": 1, "b": 8}


def test_admission_is_first_come_first_served():
    s = make_scheduler(budget=64)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 4 + i, first_token=100 * (i + 1)))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["r0", "r1", "r2", "r3", "r4"]
    assert all(r.status == RequestStatus.RUNNING for r in batch.requests)


def test_max_num_seqs_bounds_the_running_set():
    s = make_scheduler(max_num_seqs=3, budget=200)
    requests = [make_request(f"r{i}", 5, first_token=100 * (i + 1)) for i in range(5)]
    for r in requests:
        s.add_request(r)
    assert set(scheduled(run(s))) == {"r0", "r1", "r2"}
    assert len(s.running) == 3 and [r.request_id for r in s.waiting] == ["r3", "r4"]
    s.finish_request(requests[1], "abort")
    assert set(scheduled(run(s))) == {"r0", "r2", "r3"}


def test_preemption_takes_the_latest_arrival_and_it_recomputes_everything():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, prefix_caching=False)
    a, b = make_request("a", 8), make_request("b", 7, first_token=300)
    s.add_request(a)
    s.add_request(b)
    assert scheduled(run(s)) == {"a": 8, "b": 7}  # 2 + 2 blocks, each sampled one token
    run(s)  # a computes its 9th token (a third block), b its 8th
    run(s)  # b computes its 9th token: a third block, and the pool is full
    assert s.kv_cache.num_free_blocks == 0
    assert run(s).preempted == [] and run(s).preempted == []  # room left in both last blocks
    batch = run(s)  # a's 13th token needs a fourth block: b, the latest arrival, is preempted
    assert [r.request_id for r in batch.preempted] == ["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and s.stats.num_preemptions == 1
    assert scheduled(batch) == {"a": 1}  # no admission in a step that preempted
    b_tokens = b.num_tokens  # its prompt and the outputs so far
    s.finish_request(a, "abort")
    assert scheduled(run(s)) == {"b": b_tokens}  # recomputed whole, then it samples again
    assert b_tokens == 7 + 5 and b.num_computed_tokens == b_tokens and b.num_output_tokens == 6


def test_preemption_takes_the_latest_arrival_not_the_next_in_line():
    """Pool of 3 blocks of 4, each held by one of a (4 tokens), b and c (2 each). a's 5th token
    needs a new block: c, the latest arrival, is preempted; b, next after a, keeps running."""
    s = make_scheduler(num_blocks=3, block_size=4, budget=64, prefix_caching=False)
    a, b, c = make_request("a", 4), make_request("b", 2, 300), make_request("c", 2, 500)
    for request in (a, b, c):
        s.add_request(request)
    run(s)
    assert s.kv_cache.num_free_blocks == 0
    batch = run(s)
    assert batch.preempted == [c] and scheduled(batch) == {"a": 1, "b": 1}


def test_priority_policy_admits_by_priority_then_arrival():
    s = make_scheduler(max_num_seqs=2, budget=200, policy="priority")
    for t, (rid, priority) in enumerate([("late-3", 3), ("p1", 1), ("p0", 0), ("p1-later", 1)]):
        s.add_request(make_request(rid, 5, first_token=100 * (t + 1), priority=priority, arrival_time=t))
    assert set(scheduled(run(s))) == {"p0", "p1"}
    assert [r.request_id for r in s.waiting] == ["p1-later", "late-3"]
    s.finish_request(s.running[0], "abort")  # p0
    assert set(scheduled(run(s))) == {"p1", "p1-later"}
    fcfs = make_scheduler(max_num_seqs=2, budget=200)
    for t, (rid, priority) in enumerate([("late-3", 3), ("p1", 1), ("p0", 0)]):
        fcfs.add_request(make_request(rid, 5, first_token=100 * (t + 1), priority=priority, arrival_time=t))
    assert set(scheduled(run(fcfs))) == {"late-3", "p1"}  # arrival order: priorities ignored


def test_priority_policy_preempts_the_lowest_priority_not_the_latest_arrival():
    """As the FCFS case above (a's 5th token needs a block of a full pool), but c arrived last
    with the highest priority: b, of the lowest, is preempted and goes back by its priority."""
    s = make_scheduler(num_blocks=3, block_size=4, budget=64, prefix_caching=False, policy="priority")
    a = make_request("a", 4, priority=1, arrival_time=0)
    b = make_request("b", 2, 300, priority=2, arrival_time=1)
    c = make_request("c", 2, 500, priority=0, arrival_time=2)
    for request in (a, b, c):
        s.add_request(request)
    run(s)
    assert s.kv_cache.num_free_blocks == 0 and [r.request_id for r in s.running] == ["c", "a", "b"]
    batch = run(s)
    assert batch.preempted == [b] and scheduled(batch) == {"a": 1, "c": 1}
    s.add_request(make_request("d", 2, 700, priority=3, arrival_time=3))
    assert [r.request_id for r in s.waiting] == ["b", "d"]


def test_prefix_hit_skips_the_cached_blocks():
    s = make_scheduler(block_size=4, budget=64)
    a = make_request("a", 12)
    s.add_request(a)
    run(s)
    b = Request("b", list(range(100, 110)) + [999], SamplingParams(max_tokens=5), eos_token_ids=(EOS,),
                model_eos_token_id=EOS)
    s.add_request(b)
    batch = run(s)
    assert scheduled(batch)["b"] == 11 - 8  # two full blocks (8 tokens) of a's prompt are reused
    assert b.num_cached_prompt_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert b.metrics.num_cached_prompt_tokens == 8  # RequestOutput.metrics reports it too
    assert s.kv_cache.stats.hit_tokens == 8


def test_stop_checks_finish_and_free():
    s = make_scheduler(budget=64)
    eos, stop_id = make_request("eos", 5), make_request("stop_id", 5, first_token=200, stop_token_ids=[9])
    late = make_request("min", 5, first_token=300, min_tokens=2)
    length = make_request("length", 5, first_token=400, max_tokens=2)
    for r in (eos, stop_id, late, length):
        s.add_request(r)
    run(s, tokens={"eos": EOS, "stop_id": 9, "min": EOS, "length": 7})
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    assert (stop_id.finish_reason, stop_id.stop_reason) == ("stop", 9)
    assert not late.is_finished  # EOS before min_tokens does not stop it
    assert not length.is_finished
    run(s, tokens={"min": EOS, "length": 7})
    assert late.finish_reason == "stop" and length.finish_reason == "length"
    assert s.num_unfinished == 0 and s.kv_cache.num_free_blocks == s.kv_cache.num_blocks


def test_max_model_len_finishes_with_length():
    s = make_scheduler(budget=64, max_model_len=8)
    r = make_request("r", 6, max_tokens=None)
    s.add_request(r)
    run(s)
    run(s)
    assert r.finish_reason == "length" and r.num_tokens == 8


def test_a_stop_string_overrides_a_length_finish_but_not_a_stop_token():
    s = make_scheduler(budget=64)
    length, eos = make_request("length", 5, max_tokens=1), make_request("eos", 5, first_token=200)
    s.add_request(length)
    s.add_request(eos)
    run(s, tokens={"eos": EOS})
    s.finish_request(length, "stop", stop_reason="###")
    s.finish_request(eos, "stop", stop_reason="###")
    assert (length.finish_reason, length.stop_reason) == ("stop", "###")
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)


def test_abort_in_every_state_frees_everything():
    s = make_scheduler(num_blocks=16, block_size=4, budget=8)
    waiting, prefilling, decoding = (make_request("w", 4), make_request("p", 20, 200),
                                     make_request("d", 4, 300))
    s.add_request(decoding)
    run(s)
    s.add_request(prefilling)
    s.add_request(waiting)
    batch = s.schedule()  # d decodes, p takes a chunk, w still waits (budget spent)
    assert scheduled(batch) == {"d": 1, "p": 7} and waiting.status == RequestStatus.WAITING
    sampled = s.update_after_launch(batch)  # launched: d's token is pending on the device
    assert decoding.num_pending_tokens == 1
    for request in (waiting, prefilling, decoding):
        s.finish_request(request, "abort")
        assert request.is_finished and request.finish_reason == "abort" and request.block_ids == []
    appended = s.update_from_output(sampled, [7] * len(sampled))  # the in-flight step is read back
    assert appended == [] and decoding.num_pending_tokens == 0 and decoding.num_output_tokens == 1
    assert s.num_unfinished == 0 and s.kv_cache.num_free_blocks == 16
    assert s.schedule().is_empty()


def test_a_request_that_sampled_its_last_token_waits_for_it():
    """With a step in flight, a request whose max_tokens are all sampled is not scheduled again."""
    s = make_scheduler(budget=64)
    r = make_request("r", 5, max_tokens=2)
    s.add_request(r)
    first = s.schedule()
    s.update_after_launch(first)  # samples token 1 (pending)
    second = s.schedule()
    assert scheduled(second) == {"r": 1}  # decodes on the pending token
    sampled = s.update_after_launch(second)  # samples token 2 (pending): the limit
    assert s.schedule().is_empty()
    s.update_from_output([r], [7])
    s.update_from_output(sampled, [8])
    assert r.finish_reason == "length" and r.output_token_ids == [7, 8]


def test_a_running_prefill_chunk_stays_within_the_budget():
    """Budget 16: a decodes (1 token a step) while b's 40-token prompt runs in chunks of what is
    left, 15, 15 and 10; no step runs more than 16 tokens."""
    s = make_scheduler(budget=16)
    a, b = make_request("a", 10), make_request("b", 40, first_token=300)
    s.add_request(a)
    run(s)
    s.add_request(b)
    chunks = []
    for _ in range(3):
        batch = run(s)
        assert batch.total_tokens <= 16
        chunks.append(scheduled(batch))
    assert chunks == [{"a": 1, "b": 15}] * 2 + [{"a": 1, "b": 10}]
    assert b.num_computed_tokens == 40 and b.num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_that_fills_the_budget_exactly_is_admitted():
    s = make_scheduler(budget=16, chunked=False)
    s.add_request(make_request("a", 10))
    run(s)
    s.add_request(make_request("b", 15, first_token=300))
    assert scheduled(run(s)) == {"a": 1, "b": 15}  # 1 + 15 = 16


def test_a_preempted_request_goes_back_to_the_head_of_the_queue():
    """As in the preemption test, b is preempted while c (one block's worth) waits behind it; c
    arrived later, so it is not admitted ahead of b, even in the steps where b does not fit and
    c would."""
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, prefix_caching=False)
    a, b = make_request("a", 8), make_request("b", 7, first_token=300)
    c = make_request("c", 3, first_token=500)
    s.add_request(a)
    s.add_request(b)
    run(s)
    run(s)
    run(s)
    assert s.kv_cache.num_free_blocks == 0
    s.add_request(c)
    run(s)
    run(s)
    batch = run(s)  # a needs a fourth block: b is preempted
    assert [r.request_id for r in batch.preempted] == ["b"]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    for _ in range(2):  # b (12 tokens, 3 blocks) does not fit in the 2 free blocks; c waits behind it
        assert scheduled(run(s)) == {"a": 1} and s.kv_cache.num_free_blocks == 2
        assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_a_step_that_preempts_admits_nothing():
    """Blocks of 4, a pool of 5, 5 tokens a step. b's 16-token prompt runs in chunks of 4 beside
    a's decodes until the pool is full; its fourth chunk finds no block, so b, the latest arrival,
    is preempted. Its freed blocks would hold a new 4-token chunk of its own, but a step that
    preempts admits no one: b waits for the next step."""
    s = make_scheduler(num_blocks=5, block_size=4, budget=5, prefix_caching=False)
    a, b = make_request("a", 4), make_request("b", 16, first_token=300)
    s.add_request(a)
    run(s)
    s.add_request(b)
    assert [scheduled(run(s)) for _ in range(3)] == [{"a": 1, "b": 4}] * 3
    assert s.kv_cache.num_free_blocks == 0
    batch = run(s)
    assert batch.preempted == [b] and scheduled(batch) == {"a": 1}
    assert b.status == RequestStatus.WAITING and s.kv_cache.num_free_blocks == 3  # a holds 2
    assert scheduled(run(s)) == {"a": 1, "b": 4}  # admitted again, recomputing from its start


def test_a_step_must_be_read_back_while_a_penalized_request_is_unfinished():
    s = make_scheduler(budget=64)
    plain = make_request("plain", 5)
    penalized = make_request("pen", 5, first_token=300, repetition_penalty=1.2)
    s.add_request(plain)
    assert not s.must_read_back(ScheduledBatch())
    s.add_request(penalized)
    batch = run(s)
    assert s.must_read_back(batch)
    s.finish_request(penalized, "abort")
    assert not s.must_read_back(batch)
    s.finish_request(plain, "abort")
    assert s.num_unfinished == 0 and not s.must_read_back(batch)


def test_stats_count_prompt_and_generated_tokens_once():
    """a (10) and b (30, in chunks of 15) run 4 steps at a budget of 16: 40 prompt tokens, and one
    generated token per sampling (a: 4, b: 2)."""
    s = make_scheduler(budget=16)
    a, b = make_request("a", 10), make_request("b", 30, first_token=300)
    s.add_request(a)
    run(s)
    s.add_request(b)
    for _ in range(3):
        run(s)
    assert (a.num_output_tokens, b.num_output_tokens) == (4, 2)
    assert s.stats.prompt_tokens == 40 and s.stats.generation_tokens == 6


def test_stats_count_a_chunked_recompute_as_prompt_tokens():
    """After a preemption every token whose KV was lost runs again as a prompt token; only the
    final chunk's last token (the output never run) is a decode token. Expected: the prompts
    once, plus each preempted request's computed tokens at its preemption."""
    s = make_scheduler(num_blocks=8, block_size=4, budget=4, prefix_caching=False)
    requests = [make_request("a", 6, max_tokens=12, ignore_eos=True),
                make_request("b", 6, first_token=300, max_tokens=12, ignore_eos=True)]
    for request in requests:
        s.add_request(request)
    lost, chunks_within_outputs = 0, 0
    while s.num_unfinished:
        before = {r.request_id: (r.num_computed_tokens, r.num_preemptions) for r in requests}
        batch = s.schedule()
        lost += sum(before[r.request_id][0] for r in requests if r.num_preemptions > before[r.request_id][1])
        chunks_within_outputs += sum(
            1 for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens))
            if n > 1 and r.num_computed_tokens >= r.num_prompt_tokens and not batch.samples(i))
        sampled = s.update_after_launch(batch)
        s.update_from_output(sampled, [7] * len(sampled))
    assert s.stats.num_preemptions >= 1 and chunks_within_outputs >= 1 and lost > 12
    assert s.stats.prompt_tokens == 12 + lost
    assert s.stats.generation_tokens == 24


def test_cached_prompt_tokens_are_those_found_at_first_admission():
    """As vLLM's ``num_cached_tokens``: the prefix hit of a request's first admission. b (6-token
    prompt, nothing cached) is preempted after 5 outputs; re-admitted, it finds 8 of its own 11
    tokens cached, which is recompute saved, not a prompt cache hit (and more than its prompt);
    the prefix cache's hit rate leaves that lookup out too, as vLLM's."""
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = make_request("a", 8), make_request("b", 6, first_token=300)
    s.add_request(a)
    s.add_request(b)
    while not b.num_preemptions:
        run(s)
    s.finish_request(a, "abort")
    assert (s.kv_cache.stats.queried_tokens, s.kv_cache.stats.hit_tokens) == (8 + 6, 0)
    assert scheduled(run(s)) == {"b": 3}  # 11 tokens, 8 of them found cached
    assert b.num_cached_prompt_tokens == 0
    assert (s.kv_cache.stats.queried_tokens, s.kv_cache.stats.hit_tokens) == (8 + 6, 0)
