"""Benchmark workloads: definitions, the physical floor, and a pagedlab-vs-HF run on a tiny model."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import KV_BYTES

from pagedlab import LLM, workloads
from pagedlab.cli import main
from pagedlab.lab.testing import make_tiny_model
from pagedlab.physical_floor import H200_BANDWIDTH, AllReduceCost, physical_floor, tpot_floor


def test_floor_matches_design_figures():
    llama = workloads.model_shape("llama3-8b")
    assert physical_floor(llama, [512] * 256, [128] * 256) == pytest.approx(3.3, rel=0.1)
    assert physical_floor(llama, [512], [129]) / 128 == pytest.approx(3.55e-3, rel=0.05)
    nano = workloads.make_workload("W-nano", 151936)
    qwen = workloads.model_shape("qwen3-0.6b")
    rate = sum(nano.output_lens) / physical_floor(qwen, list(map(len, nano.prompts)),
                                                            nano.output_lens)
    assert rate == pytest.approx(37000, rel=0.01)  # docs/benchmarks.md; DESIGN.md §4 still says 35,000


def test_floor_pins_the_figures_issue_21s_targets_are_read_against():
    """BENCHMARKS.md's floors since session 43 (an independent recount agreed to machine precision):
    W-seed batch 256 3.310 s (7,900 tok/s is 84% of it), batch 64 1.164 s, W-nano 3.822 s."""
    llama = workloads.model_shape("llama3-8b")
    assert physical_floor(llama, [512] * 256, [128] * 256) == pytest.approx(3.3097, rel=1e-3)
    assert physical_floor(llama, [512] * 64, [128] * 64) == pytest.approx(1.1638, rel=1e-3)
    nano = workloads.make_workload("W-nano", 151936)
    assert physical_floor(workloads.model_shape("qwen3-0.6b"), list(map(len, nano.prompts)),
                          nano.output_lens) == pytest.approx(3.8220, rel=1e-3)


def test_floor_of_prefill_runs_the_lm_head_on_each_prompts_last_token_only():
    """A one-layer dense shape by hand (hidden 8, q 8, kv 4, MLP 16, vocab 100): attention 192
    and MLP 384 parameters per token, LM head 800 once per prompt (the engine computes logits for
    the last position only). Prompts of 10 and 6 tokens, one FLOP per second: 2 x 576 x 16 layer
    FLOPs + 2 x 800 x 2 LM-head FLOPs + 4 x 8 x (55 + 21) attention FLOPs (causal: the query at
    position i sees i + 1 keys) = 24,064 s."""
    shape = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                            num_hidden_layers=1, intermediate_size=16, vocab_size=100)
    assert physical_floor(shape, [10, 6], [1, 1], flops=1.0) == pytest.approx(24064)


def _hf_matmul_params(hf_config) -> int:
    """The weights HF's own model multiplies a token by: its Linear / Conv1D layers' (a tied LM
    head once; embeddings are looked up, not multiplied), built on the meta device."""
    import transformers
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    weights = {id(m.weight): m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Linear | Conv1D)}
    return sum(weights.values())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma2", "gpt2", "gpt_neox"])
def test_floor_of_one_token_multiplies_every_weight_of_hf_own_model(arch):
    """Every dense family the engine serves: a one-token prompt (one FLOP per second) costs 2
    FLOPs per weight of HF's model of the config and 4 x query width per layer for its one
    (query, key) pair. GPT-2 and GPT-NeoX have no ``num_key_value_heads`` (every head has its
    keys) and a two-matrix MLP, GPT-2 no ``intermediate_size`` (``n_inner``, None: 4 x hidden)."""
    import transformers
    from conftest import tiny_config

    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_inner=None)
    elif arch == "gpt_neox":
        config = transformers.GPTNeoXConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=96)
    else:
        config = tiny_config(arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4 * config.num_attention_heads * head_dim * config.num_hidden_layers
    assert physical_floor(config, [1], [1], flops=1.0) == pytest.approx(
        2 * _hf_matmul_params(config) + attention)


def test_floor_of_sliding_window_layers_counts_only_the_keys_in_their_window():
    """Gemma 2's layout by hand: layer 0 windowed (3 keys: a query sees itself and the 2 before,
    as HF masks it), layer 1 full; one FLOP per second, then one byte per second. Prefill of 5 and
    2 tokens: the full layer attends 1+2+3+4+5 + 1+2 = 18 (query, key) pairs, the windowed one
    1+2+3+3+3 + 1+2 = 15, at 4 x 8 FLOPs each (1,056), beside 2 x 1,152 x 7 + 2 x 800 x 2 matmul
    FLOPs (19,328). Decode reads 1,952 parameters (3,904 bytes) a step plus 16 bytes of K and V
    per key per layer: step 1 keys 6 + 3 (full) and 3 + 3 (window), step 2 7 and 3, step 3 8 and
    3. With a cached 3-token prefix and contexts of 5, the full layer reads 5 + 5 - 3 keys and the
    windowed one 3 + 3 - 1 (only position 2 of the prefix is inside both windows)."""
    shape = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                            num_hidden_layers=2, intermediate_size=16, vocab_size=100, sliding_window=3,
                            layer_types=["sliding_attention", "full_attention"])
    assert physical_floor(shape, [5, 2], [1, 1], flops=1.0) == pytest.approx(19328 + 1056)
    steps = 3 * 3904 + 16 * ((6 + 3 + 3 + 3) + (7 + 3) + (8 + 3))
    assert physical_floor(shape, [5, 2], [4, 2], flops=float("inf"), bandwidth=1.0) == pytest.approx(steps)
    assert physical_floor(shape, [4, 4], [2, 2], cached_prefix=3, flops=float("inf"), bandwidth=1.0) == \
        pytest.approx(3904 + 16 * ((5 + 5 - 3) + (3 + 3 - 1)))
    mistral = SimpleNamespace(**{**vars(shape), "layer_types": None})  # every layer windowed
    assert physical_floor(mistral, [5, 2], [4, 2], flops=float("inf"), bandwidth=1.0) == \
        pytest.approx(3 * 3904 + 16 * ((3 + 3) * 2 + 3 * 2 + 3 * 2))
    # transformers' own Gemma2Config: its 21 local layers read 4,096 keys however long the context,
    # so 1,000 more keys cost only its 21 global layers' K and V
    gemma = workloads.model_shape("gemma2-9b")

    def step(context):  # the one decode step's floor
        return tpot_floor(gemma, [context], [2], flops=float("inf"))
    assert step(8000) - step(7000) == pytest.approx(21 * 1000 * 2 * 8 * 256 * 2 / H200_BANDWIDTH, rel=1e-6)


def test_tpot_floor_is_a_decode_steps_reads_on_average():
    """The one-layer shape by hand at one byte per second, batch 1, a 10-token prompt and 4 output
    tokens: decode steps 1-3 each read 1,376 parameters (attention 192, MLP 384, LM head 800) at 2
    bytes and K and V (2 x 4 elements, 2 bytes) of contexts 11, 12 and 13: (3 x 2,752 + 16 x 36) / 3
    = 2,944 s a step, whatever the prefill costs. A row's TPOT p50 is read against it (issue
    targets such as "batch 1 TPOT at most 1.6x its floor"); the run's time against the whole floor."""
    shape = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                            num_hidden_layers=1, intermediate_size=16, vocab_size=100)
    assert tpot_floor(shape, [10], [4], bandwidth=1.0) == pytest.approx(2944)
    assert tpot_floor(shape, [10], [1], bandwidth=1.0) is None  # no decode step
    row = workloads.WorkloadResult("W-seed", "pagedlab", "bs=1", 1, 10, 4, 1.0, 5.0, 5.0, 4.6, 4.7, None,
                                   0.5, tpot_floor_ms=2.3)
    assert row.tpot_over_floor == pytest.approx(2.0) and row.over_floor == pytest.approx(2.0)
    assert row.to_dict()["tpot_over_floor"] == pytest.approx(2.0)
    assert "(p50 2.00x a step's floor)" in workloads.format_row(row)


def test_floor_of_a_mixture_of_experts_reads_the_routed_experts():
    """Batch 1 by hand: Qwen3-30B-A3B reads attention, routers and LM head (1.23 G parameters)
    and 8 of 128 experts per layer (48 x 8 x 4.72 M = 1.81 G): 6.08 GB, 1.43 ms at 4.25 TB/s,
    plus the 512-token prefill (2.9 T FLOPs, 3.6 ms) spread over 128 tokens: 1.46 ms;
    Mixtral-8x7B 2 of 8 experts (11.3 G) beside 1.47 G others: 25.5 GB, 6.0 ms, plus 0.13 ms of
    prefill. At batch 256 nearly every expert is hit: Qwen3-30B-A3B reads about 30.5 G parameters
    per step."""
    qwen = workloads.model_shape("qwen3-30b-a3b")
    assert physical_floor(qwen, [512], [129]) / 128 == pytest.approx(1.46e-3, rel=0.02)
    mixtral = workloads.model_shape("mixtral-8x7b")
    assert physical_floor(mixtral, [512], [129]) / 128 == pytest.approx(6.13e-3, rel=0.02)
    step_256 = tpot_floor(qwen, [512] * 256, [2] * 256)
    assert step_256 > 30.5e9 * 2 / H200_BANDWIDTH
    # batch 4 by hand: 128 x (1 - (1 - 8/128)^4) = 29.4 experts hit a layer (routing uniform, top-8
    # without replacement), beside attention, routers and LM head; K and V of 2 keys a sequence
    step_4 = tpot_floor(qwen, [1] * 4, [2] * 4, flops=float("inf"))
    shared = 48 * (2048 * (4096 + 1024) + 4096 * 2048 + 128 * 2048) + 151936 * 2048
    experts_hit = 128 * (1 - (1 - 8 / 128) ** 4)
    kv = 4 * 2 * 48 * 2 * 512 * 2
    assert step_4 == pytest.approx((2 * (shared + 48 * experts_hit * 3 * 2048 * 768) + kv) / H200_BANDWIDTH,
                                   rel=1e-9)


def test_hf_static_batch_reports_tpot_percentiles_over_requests_and_itl_apart(monkeypatch):
    """HF generate on a fake clock: prefill 0.5 s, then gaps of 10, 10, 10 and 100 ms for 5 tokens.
    Every row of the static batch has TPOT (630 - 500) / 4 = 32.5 ms, so TPOT P50 and P99 are both
    32.5 ms (as pagedlab's rows: over requests); the 100 ms gap shows in ITL P99 (numpy's linear
    P99 of 10, 10, 10, 100 ms: 97.3 ms), not in the TPOT column."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(workloads, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    class FakeModel:
        device = torch.device("cpu")

        def generate(self, ids, *, max_new_tokens, logits_processor, **kwargs):
            for gap in (0.5, 0.01, 0.01, 0.01, 0.1)[:max_new_tokens]:
                clock.now += gap
                logits_processor[0](ids, None)
            return torch.cat([ids, torch.zeros(ids.shape[0], max_new_tokens, dtype=ids.dtype)], dim=1)

    batch = workloads.Workload("custom", [[1, 2, 3]] * 2, [5, 5])
    row = workloads.run_hf_generate(FakeModel(), batch, "bs=2", None)
    assert row.ttft_p50_ms == pytest.approx(500) and row.output_tokens == 10
    assert row.tpot_p50_ms == pytest.approx(32.5) and row.tpot_p99_ms == pytest.approx(32.5)
    assert row.extra["itl_p50_ms"] == pytest.approx(10) and row.extra["itl_p99_ms"] == pytest.approx(97.3)


def test_cli_offers_every_benchmark_shape():
    from pagedlab.cli.main import SHAPES

    assert SHAPES == workloads.SHAPES


def test_floor_with_tensor_parallelism_splits_reads_and_adds_the_all_reduces():
    """Batch 1 decode by hand: a Llama-3-70B shape holds 69.5 G matmul parameters (139 GB in
    bf16), so each of two H200s reads 69.5 GB per token at 4.25 TB/s (16.4 ms) and waits for 160
    all-reduces of one 16 KB hidden state (19.9 us each, 3.2 ms); the 8B shape (7.5 G parameters,
    3.55 ms per token on one GPU) reads 7.5 GB per GPU (1.77 ms) plus 64 all-reduces (1.3 ms). At
    one GPU nothing changes."""
    llama70, llama8 = workloads.model_shape("llama3-70b"), workloads.model_shape("llama3-8b")
    per_token_70 = physical_floor(llama70, [1], [129], tensor_parallel_size=2) / 128
    assert per_token_70 == pytest.approx(16.4e-3 + 160 * 19.86e-6, rel=0.02)
    per_token_8 = physical_floor(llama8, [1], [129], tensor_parallel_size=2) / 128
    assert per_token_8 == pytest.approx(1.77e-3 + 64 * 19.83e-6, rel=0.02)
    one_gpu = physical_floor(llama8, [512] * 64, [128] * 64)
    assert physical_floor(llama8, [512] * 64, [128] * 64, tensor_parallel_size=1) == one_gpu
    free_links = AllReduceCost(latency_s=0.0, bus_bandwidth=float("inf"))
    assert physical_floor(llama8, [512] * 64, [128] * 64, tensor_parallel_size=2,
                                    all_reduce=free_links) == pytest.approx(one_gpu / 2)
    # all-reduces alone (reads and FLOPs free): 2 x 32 a token, one prompt token and one decode step,
    # each of a 4,096-wide bf16 hidden state over a 1 GB/s bus; a ring moves 2(n - 1)/n of it a link
    links = AllReduceCost(latency_s=0.0, bus_bandwidth=1e9)
    for tp, ring in ((2, 1.0), (4, 1.5), (8, 1.75)):
        alone = physical_floor(llama8, [1], [2], tensor_parallel_size=tp, all_reduce=links,
                               bandwidth=float("inf"), flops=float("inf"))
        assert alone == pytest.approx(2 * 64 * ring * 8192 / 1e9)


def test_floor_counts_a_cached_prefix_once():
    """W-prefix by hand: 2,112 + 255 x 64 prompt tokens computed (~28 TFLOP, ~0.03 s at the bf16
    peak); 63 decode steps each read ~1.5 GB of weights and the shared 2,048-token prefix once
    plus every sequence's own keys (~3 GB at 112 KiB per token): ~1 ms each, ~0.1 s in all.
    Without the cache, all 256 x 2,112 tokens are computed and each sequence reads its own prefix."""
    qwen = workloads.model_shape("qwen3-0.6b")
    w = workloads.make_workload("W-prefix", 151936)
    lens = list(map(len, w.prompts))
    assert physical_floor(qwen, lens, w.output_lens, cached_prefix=2048) == \
        pytest.approx(0.1, rel=0.15)
    assert physical_floor(qwen, lens, w.output_lens) == pytest.approx(1.7, rel=0.15)


def test_workloads_are_deterministic_and_shaped():
    a, b = workloads.make_workload("W-nano", 1000), workloads.make_workload("W-nano", 1000)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert len(a.prompts) == 256 and all(100 <= len(p) <= 1024 for p in a.prompts)
    prefix = workloads.make_workload("W-prefix", 1000, num_prompts=3)
    assert [p[:2048] for p in prefix.prompts] == [prefix.prompts[0][:2048]] * 3
    assert {len(p) for p in prefix.prompts} == {2048 + 64}


def test_fixed_length_workloads_name_a_missing_or_bad_length():
    seed = workloads.make_workload("W-seed", 1000, 3, 7, 5)
    assert [len(p) for p in seed.prompts] == [7, 7, 7] and seed.output_lens == [5, 5, 5]
    from_numpy = workloads.make_workload("W-seed", 1000, np.int64(3), np.int64(7), np.int64(5))
    assert from_numpy.prompts == seed.prompts and from_numpy.output_lens == seed.output_lens
    with pytest.raises(ValueError, match="W-seed needs input_len as a whole number >= 1, not None"):
        workloads.make_workload("W-seed", 1000, 64, None, 128)
    with pytest.raises(ValueError, match=r"custom needs output_len .* not 0"):
        workloads.make_workload("custom", 1000, 2, 16, 0)
    with pytest.raises(ValueError, match=r"W-lat needs batch_size or num_prompts .* not 0"):
        workloads.make_workload("W-lat", 1000, 0)


def test_random_prompts_keep_the_benchmark_ids_of_real_vocabularies():
    """The prompts behind BENCHMARKS.md: ids drawn from [100, vocab - 100) with torch's generator."""
    assert workloads.make_workload("W-seed", 151936, 2, 6, 4).prompts == [
        [69120, 118259, 123185, 58668, 81167, 91455], [31199, 137587, 117221, 45383, 56649, 19286]]
    assert workloads.random_prompts(1, [8], 32000, seed=1) == [
        [24545, 20439, 11824, 29868, 14363, 23213, 19191, 8841]]
    assert workloads.random_prompts(2, [5, 3], 400, seed=3) == [[286, 148, 237, 167, 260], [180, 140, 225]]
    nano = workloads.make_workload("W-nano", 151936).prompts
    assert workloads.tokens_sha256(nano) == "cd80e6461526cd1afa36bbb82e515c437a57fd693daba8010c87572901d805c7"


def test_small_vocabularies_get_prompts_that_fit(tmp_path, capsys):
    prompts = workloads.random_prompts(3, [64] * 3, 49)
    assert prompts == workloads.random_prompts(3, [64] * 3, 49)
    assert {t for p in prompts for t in p} == set(range(12, 37))  # a quarter of the vocabulary off each end
    assert workloads.random_prompts(2, [3, 3], 1) == [[0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="vocab=0 is invalid"):
        workloads.random_prompts(1, [3], 0)
    model = make_tiny_model(tmp_path / "tiny")  # a vocabulary of 49, as docs/lab.md builds it
    out = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--model", str(model), "--device", "cpu", "--dtype", "float32",
               "--batch-size", "1", "--input-len", "16", "--output-len", "16", "--json", str(out)])
    assert rc == 0
    [row] = json.loads(out.read_text())["results"]
    assert row["input_tokens"] == 16 and row["output_tokens"] == 16 and row["output_tok_s"] > 0


def test_bench_cli_runs_both_backends_and_counts_tokens(tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--model", tiny_llama.path, "--workload", "custom",
               "--batch-size", "2", "3", "--input-len", "12", "--output-len", "5",
               "--backend", "pagedlab", "hf", "--json", str(out),
               "--kv-cache-memory-bytes", str(16 << 20), "--dtype", "float32"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["environment"]["torch"]
    assert ("x floor" in capsys.readouterr().out) == torch.cuda.is_available()
    rows = report["results"]
    assert [(r["backend"], r["num_requests"]) for r in rows] == [("pagedlab", 2), ("pagedlab", 3), ("hf", 2),
                                                                 ("hf", 3)]
    for r in rows:
        assert r["output_tokens"] == 5 * r["num_requests"]
        assert r["input_tokens"] == 12 * r["num_requests"]
        assert r["output_tok_s"] > 0
        # the physical floor is an H200's: its ratio is printed on a GPU only
        assert (r["over_floor"] > 1) if torch.cuda.is_available() else (r["over_floor"] is None)
        assert r["ttft_p50_ms"] > 0 and r["tpot_p50_ms"] > 0
        # vLLM's keys: tokens_per_second is its prompt + output tokens/s; one repeat, one latency
        assert r["tokens_per_second"] == pytest.approx(r["total_tok_s"])
        assert r["latencies"] == [r["elapsed_s"]]


def test_each_batch_is_warmed_on_its_own_requests_then_timed_without_their_cache(tiny_llama, monkeypatch):
    """Batch sizes 2 and 3: before each is timed, the bench runs that batch's own requests to their
    full lengths (so its prefill chunks, mixed steps and decode batches compile and allocate
    outside the timing), and the timed run still computes every prompt: no prefix-cache hit left
    over from the warm-up."""
    events = []
    generate, timed = LLM.generate, workloads.run_pagedlab

    def warm_up(self, prompts, params=None, use_tqdm=True, lora_request=None):
        events.append(("warm", prompts, max(p.max_tokens for p in params)))
        return generate(self, prompts, params, use_tqdm, lora_request)

    def run(llm, workload, *args, **kwargs):
        events.append(("timed", workload.prompts, max(workload.output_lens)))
        return timed(llm, workload, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", warm_up)
    monkeypatch.setattr(workloads, "run_pagedlab", run)
    rows = workloads.run_bench("custom", [2, 3], 40, 6, None, ["pagedlab"], model=tiny_llama.path,
                               engine_args=dict(kv_cache_memory_bytes=KV_BYTES, dtype="float32"),
                               progress=lambda line: None)
    two, three = (workloads.make_workload("custom", tiny_llama.hf_model.config.vocab_size, n, 40, 6).prompts
                  for n in (2, 3))
    assert events == [("warm", two, 6), ("timed", two, 6), ("warm", three, 6), ("timed", three, 6)]
    assert [(r.num_requests, r.output_tokens, r.extra["prefix_cache_hit_rate"]) for r in rows] == \
        [(2, 12, 0.0), (3, 18, 0.0)]


def test_more_prompts_than_the_batch_size_run_at_most_the_batch_size_at_once(tiny_llama, monkeypatch):
    """--batch-size 1 3 --num-prompts 4: each row times 4 requests with max_num_seqs its batch
    size (rows of 1 and 3 at once, not two runs of 4 at once) and says so in its label; the
    engine's own max_num_seqs comes back for a row that needs no cap."""
    seen, timed = [], workloads.run_pagedlab

    def run(llm, workload, *args, **kwargs):
        seen.append(llm.get_engine_info().config.max_num_seqs)
        return timed(llm, workload, *args, **kwargs)

    monkeypatch.setattr(workloads, "run_pagedlab", run)
    rows = workloads.run_bench("custom", [1, 3, 8], 8, 3, 4, ["pagedlab"], model=tiny_llama.path,
                               engine_args=dict(kv_cache_memory_bytes=KV_BYTES, dtype="float32"),
                               progress=lambda line: None)
    assert seen == [1, 3, 256]
    assert [(r.label, r.num_requests, r.output_tokens) for r in rows] == \
        [("bs=1 prompts=4", 4, 12), ("bs=3 prompts=4", 4, 12), ("bs=4", 4, 12)]


def test_floor_of_more_prompts_than_the_batch_size_is_its_batches_in_turn():
    llama = workloads.model_shape("llama3-8b")
    four = workloads.make_workload("custom", 128256, 2, 512, 128, num_prompts=4)
    floor, step = workloads._floors(llama, four, {})
    assert floor == pytest.approx(2 * physical_floor(llama, [512] * 2, [128] * 2))
    assert step == pytest.approx(tpot_floor(llama, [512] * 2, [128] * 2))


def test_hf_peer_refuses_more_prompts_than_a_batch_size_before_loading(tiny_llama, capsys):
    assert main(["bench", "throughput", "--model", tiny_llama.path, "--workload", "custom", "--batch-size",
                 "4", "2", "--num-prompts", "3", "--input-len", "8", "--output-len", "2", "--backend",
                 "pagedlab", "hf"]) == 2
    assert "--num-prompts 3 is above --batch-size 2" in capsys.readouterr().err


@pytest.mark.parametrize("flags, error", [
    (["--workload", "custom", "--batch-size", "2", "--input-len", "10", "--output-len", "12",
      "--max-model-len", "16"], "--input-len 10 + --output-len 12 = 22 tokens is over --max-model-len 16: "),
    (["--workload", "W-prefix", "--max-model-len", "256"],
     "W-prefix's longest request = 2176 tokens is over --max-model-len 256: "),
    (["--workload", "custom", "--input-len", "600"],
     "--input-len 600 + --output-len 128 = 728 tokens is over the 512 positions the model supports: "),
    (["--workload", "W-prefix"], "W-prefix's longest request = 2176 tokens is over the 512 positions "),
])
def test_requests_longer_than_max_model_len_are_refused_before_loading(tiny_llama, monkeypatch, capsys,
                                                                       flags, error):
    """The engine cut each request at --max-model-len: a row of 12 output tokens in all was
    reported for a workload of 2 requests x 12. Past the model's 512 positions the error named
    max_model_len=768, a value derived from the sizes rather than a flag the user gave."""
    monkeypatch.setattr(workloads, "LLM", None)  # building an engine fails the test
    assert main(["bench", "throughput", "--model", tiny_llama.path, *flags]) == 2
    assert error in capsys.readouterr().err


def test_max_model_len_rounds_up_to_64_tokens_within_the_models_positions(tmp_path, monkeypatch):
    """A 490-token request on a model of 500 positions asked the engine for 512 and was refused."""
    class Built(Exception):
        pass

    def build(model, **args):
        raise Built(args["max_model_len"])

    model = make_tiny_model(tmp_path / "tiny", tokenizer=False, max_position_embeddings=500)
    monkeypatch.setattr(workloads, "LLM", build)
    with pytest.raises(Built) as built:
        workloads.run_bench("custom", [1], 480, 10, None, ["pagedlab"], model=str(model))
    assert built.value.args == (500,)


def test_the_hf_peer_is_warmed_up_untimed_before_its_rows(tiny_llama, monkeypatch):
    """As pagedlab's rows, the HF peer's run each batch once untimed before its repeats: its first
    timed row no longer pays CUDA, cuBLAS and allocator start-up (BENCHMARKS.md: HF's first W-lat
    repeat 76.9 ms TPOT, the next two 22.7 and 22.3)."""
    calls, timed = [], workloads.run_hf_generate

    def run(model, workload, label, floor):
        calls.append((label, len(workload.prompts)))
        return timed(model, workload, label, floor)

    monkeypatch.setattr(workloads, "run_hf_generate", run)
    rows = workloads.run_bench("custom", [2, 3], 8, 2, None, ["hf"], model=tiny_llama.path, repeats=2,
                               progress=lambda line: None)
    assert calls == [("warm-up", 2), ("bs=2 #1", 2), ("bs=2 #2", 2), ("warm-up", 3), ("bs=3 #1", 3),
                     ("bs=3 #2", 3)]
    assert [r.label for r in rows] == ["bs=2 #1", "bs=2 #2", "bs=3 #1", "bs=3 #2"]


def test_rows_measured_before_a_failure_stay_in_the_callers_list(tiny_llama, monkeypatch):
    """Batch sizes 2, 3 and 4, the third failing (out of memory, say): the caller's ``results``
    holds the two rows measured before it, in order, when the error reaches it."""
    timed = workloads.run_pagedlab

    def run(llm, workload, *args, **kwargs):
        if len(workload.prompts) == 4:
            raise RuntimeError("CUDA out of memory")
        return timed(llm, workload, *args, **kwargs)

    monkeypatch.setattr(workloads, "run_pagedlab", run)
    results = []
    with pytest.raises(RuntimeError, match="out of memory"):
        workloads.run_bench("custom", [2, 3, 4], 8, 2, None, ["pagedlab"], model=tiny_llama.path,
                            engine_args=dict(kv_cache_memory_bytes=KV_BYTES, dtype="float32"),
                            progress=lambda line: None, results=results)
    assert [(r.label, r.num_requests, r.output_tokens) for r in results] == [("bs=2", 2, 4), ("bs=3", 3, 6)]


def test_each_row_records_the_gpu_telemetry_of_its_timed_run_only(tiny_llama, monkeypatch, tmp_path, capsys):
    """A fake NVML reads 650 W and a power cap while a row is timed, 999 W while it warms up or
    its profile is written, 100 W idle: every row (pagedlab, profiled, and HF) records 650 W as
    its highest power, throttling for part of its samples, and the host's memory; the printed
    line gives the clock, power and limit, and why it throttled."""
    from pagedlab.lab import profile
    from test_lab_monitor import _fake_pynvml

    phase = {"now": "idle"}
    nv = _fake_pynvml()
    watts = {"idle": 100_000, "warm": 999_000, "profile": 999_000, "timed": 650_000}
    nv.nvmlDeviceGetPowerUsage = lambda h: watts[phase["now"]]
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4 if phase["now"] == "timed" else 0x1
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(workloads, "TELEMETRY_INTERVAL_S", 0.005)

    def in_phase(name, fn):
        def run(*args, **kwargs):
            phase["now"] = name
            try:
                out = fn(*args, **kwargs)
                time.sleep(0.05)  # several samples, however fast the tiny model runs
                return out
            finally:
                phase["now"] = "idle"
        return run

    monkeypatch.setattr(LLM, "generate", in_phase("warm", LLM.generate))
    monkeypatch.setattr(LLM, "stop_profile", in_phase("profile", LLM.stop_profile))
    monkeypatch.setattr(profile, "save_profile", in_phase("profile", profile.save_profile))
    for name in ("run_pagedlab", "run_hf_generate"):
        monkeypatch.setattr(workloads, name, in_phase("timed", getattr(workloads, name)))
    out = tmp_path / "bench.json"
    assert main(["bench", "throughput", "--model", tiny_llama.path, "--workload", "custom",
                 "--batch-size", "2", "--input-len", "8", "--output-len", "3", "--backend", "pagedlab", "hf",
                 "--profile", str(tmp_path / "profiles"), "--json", str(out),
                 "--kv-cache-memory-bytes", str(KV_BYTES), "--dtype", "float32"]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["backend"] for r in rows] == ["pagedlab", "hf"] and "profile" in rows[0]["extra"]
    for r in rows:
        extra = r["extra"]
        assert extra["gpu_max_power_w"] == 650.0 and 100.0 < extra["gpu_mean_power_w"] < 650.0
        assert extra["gpu_mean_sm_clock_mhz"] == 1980.0 and extra["gpu_power_limit_w"] == 700.0
        assert 0.0 < extra["gpu_throttled_share"] < 1.0
        assert extra["gpu_throttle_reasons"] == "gpu_idle,sw_power_cap"
        assert extra["host_max_rss_bytes"] > 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("custom")]
    assert len(lines) == 2
    for line in lines:
        assert "  GPU 1,980 MHz " in line and "/700 W, throttled " in line and "% (sw_power_cap)" in line


@pytest.mark.parametrize("extra, line", [
    ({}, ""),
    ({"gpu_mean_sm_clock_mhz": 1539.4}, "  GPU 1,539 MHz"),
    ({"gpu_mean_sm_clock_mhz": 1980.0, "gpu_mean_power_w": 650.4}, "  GPU 1,980 MHz 650 W"),
    ({"gpu_mean_sm_clock_mhz": 1980.0, "gpu_mean_power_w": 692.2, "gpu_power_limit_w": 700.0,
      "gpu_throttled_share": 0.0, "gpu_throttle_reasons": "gpu_idle"}, "  GPU 1,980 MHz 692/700 W"),
    ({"gpu_mean_sm_clock_mhz": 1539.0, "gpu_mean_power_w": 692.2, "gpu_power_limit_w": 700.0,
      "gpu_throttled_share": 0.6, "gpu_throttle_reasons": "gpu_idle,sw_power_cap,sw_thermal"},
     "  GPU 1,539 MHz 692/700 W, throttled 60% (sw_power_cap,sw_thermal)"),
    ({"gpu_mean_sm_clock_mhz": 1900.0, "gpu_mean_power_w": 500.0, "gpu_throttled_share": 0.005,
      "gpu_throttle_reasons": "hw_slowdown"}, "  GPU 1,900 MHz 500 W, throttled <1% (hw_slowdown)"),
])
def test_a_rows_telemetry_ends_its_line(extra, line):
    """Clock, power against its limit where known, and the throttled share with only the reasons
    that slow the GPU (idle is not one); a share under 1% is not rounded to 0%."""
    assert workloads.format_telemetry(extra) == line
