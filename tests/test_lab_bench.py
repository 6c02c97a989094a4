"""LLM.benchmark / run_benchmark: numbers that are positive and consistent with what was generated."""

import json

import numpy as np
import pytest

from pagedlab import LLM
from pagedlab.lab.bench import BenchmarkResult, latency_stats, random_prompts
from pagedlab.lab.testing import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("bench") / "tiny", tokenizer=False)
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=4 << 20) as llm:
        yield llm


def test_benchmark_counts_latencies_and_memory(llm):
    result = llm.benchmark(batch_size=[2, 4], input_len=12, output_len=5, warmup=1, repeats=2)
    assert llm.get_stats().prompt_tokens_computed == 4 * 12  # the engine's count of the last run's prompts
    assert [(r.batch_size, r.repeat) for r in result.runs] == [(2, 0), (2, 1), (4, 0), (4, 1)]
    stats_block = llm.get_stats().block_size
    for r in result.runs:
        # every generated token is counted once, and the engine agrees (its counters were reset per run)
        assert r.num_prompts == r.batch_size
        assert r.output_tokens == r.num_prompts * 5 == r.engine_generation_tokens
        assert r.prompt_tokens == r.num_prompts * 12
        assert r.elapsed_s > 0
        assert r.output_throughput == pytest.approx(r.output_tokens / r.elapsed_s)
        assert r.total_throughput == pytest.approx((r.prompt_tokens + r.output_tokens) / r.elapsed_s)
        assert r.requests_per_s == pytest.approx(r.num_prompts / r.elapsed_s)
        lat = r.latency
        for kind in ("ttft", "tpot", "itl", "e2e"):
            p50, p90, p99 = (lat[f"{kind}_p{p}_ms"] for p in (50, 90, 99))
            assert 0 < p50 <= p90 <= p99
        assert lat["ttft_p50_ms"] <= lat["e2e_p50_ms"]
        assert lat["e2e_p99_ms"] <= r.elapsed_s * 1000 + 1
        m = r.memory
        assert m["weight_bytes"] > 0 and m["kv_cache_bytes"] > 0
        assert 0 < m["kv_peak_used_bytes"] <= m["kv_cache_bytes"]
        # all prompts fit at once, each in one block (12 prompt + 4 more tokens = 16 slots): the
        # block peak is first reached by the prefill, when each block holds its 12 prompt tokens
        assert stats_block == 16 and m["kv_peak_blocks"] == r.batch_size
        assert m["kv_tokens_at_peak"] == r.batch_size * 12
        assert m["fragmentation_at_peak"] == pytest.approx(1 - 12 / 16)
        assert m["memory_used_bytes"] > 0 and m["memory_total_bytes"] >= m["memory_used_bytes"]
        assert r.telemetry["backend"] in ("cpu", "nvml") and r.telemetry["num_samples"] >= 2
        assert r.prefix_cache_hit_rate == 0.0  # random prompts, cache reset before each run
    # the table and the seed's one-line summary
    text = str(result)
    assert "Throughput:" in text and "Memory usage:" in text and "tokens/s" in text
    assert text.count("\n") >= 4


def test_benchmark_itl_count_matches_tokens(llm):
    """ITL has (tokens - 1) gaps per request: with one prompt its mean equals TPOT."""
    result = llm.benchmark(batch_size=1, input_len=8, output_len=6, warmup=0)
    lat = result.runs[0].latency
    assert lat["itl_mean_ms"] == pytest.approx(lat["tpot_mean_ms"])
    assert result.runs[0].output_tokens == 6


def test_benchmark_save_load_dataframe_and_manifest(llm, tmp_path):
    result = llm.benchmark(batch_size=[1, 2], input_len=8, output_len=3, warmup=0)
    path = result.save(tmp_path / "out" / "bench.json")
    data = json.loads(path.read_text())
    assert data["kind"] == "pagedlab.benchmark"
    m = data["manifest"]
    for key in ("hardware", "versions", "model", "tokenizer", "engine", "sampling", "seeds", "git"):
        assert key in m
    assert m["model"]["weight_checksum"].startswith("sha256:")
    assert m["engine"]["dtype"] == "float32" and m["engine"]["device"] == "cpu"
    assert m["sampling"]["max_tokens"] == 3 and m["sampling"]["ignore_eos"] is True
    loaded = BenchmarkResult.load(path)
    assert [r.output_tokens for r in loaded.runs] == [r.output_tokens for r in result.runs]
    df = result.to_dataframe()
    assert list(df["batch_size"]) == [1, 2]
    assert list(df["output_tokens"]) == [3, 6]
    assert {"ttft_p99_ms", "kv_peak_used_bytes", "host_max_rss_bytes"} <= set(df.columns)
    with pytest.raises(ValueError, match="not a pagedlab benchmark"):
        (tmp_path / "x.json").write_text("{}")
        BenchmarkResult.load(tmp_path / "x.json")


def test_benchmark_num_prompts_caps_concurrency_and_restores_plan(llm):
    before = llm.llm_engine.config.max_num_seqs
    result = llm.benchmark(batch_size=2, input_len=8, output_len=4, num_prompts=5, warmup=0)
    run = result.runs[0]
    assert run.max_num_seqs == 2 and run.num_prompts == 5
    assert run.output_tokens == 20 == run.engine_generation_tokens
    # never more than two sequences' blocks at once: two 12-token sequences fit in 2 blocks of 16
    assert run.memory["kv_peak_blocks"] <= 2
    assert result.manifest["engine"]["max_num_seqs"] == 2
    assert llm.llm_engine.config.max_num_seqs == before


def test_a_benchmark_stopped_part_way_raises_with_the_runs_it_finished(llm, monkeypatch, tmp_path):
    """Batch sizes 1, 2 and 3, the third's timed run failing (out of memory, say): the error
    carries the two finished runs as a BenchmarkResult that prints, saves (marked partial, as
    bench serve and bench --json mark theirs) and loads, and the engine's plan is restored."""
    from pagedlab.lab import bench

    before, timed = llm.llm_engine.config.max_num_seqs, bench._timed_run

    def run(llm, prompts, *args):
        if len(prompts) == 3:
            raise RuntimeError("CUDA out of memory")
        return timed(llm, prompts, *args)

    monkeypatch.setattr(bench, "_timed_run", run)
    with pytest.raises(RuntimeError, match="out of memory") as failed:
        llm.benchmark(batch_size=[1, 2, 3], input_len=6, output_len=3, warmup=0)
    partial = failed.value.partial_result
    assert [(r.batch_size, r.output_tokens) for r in partial.runs] == [(1, 3), (2, 6)]
    assert partial.settings["batch_size"] == [1, 2, 3] and partial.manifest["model"]
    assert "2 run(s) finished" in failed.value.__notes__[0] and "batch 2:" in str(partial)
    saved = partial.save(tmp_path / "partial.json")
    record = json.loads(saved.read_text())
    assert record["partial"] is True and record["interrupted"] == "RuntimeError: CUDA out of memory"
    loaded = BenchmarkResult.load(saved)
    assert len(loaded.runs) == 2 and loaded.interrupted == "RuntimeError: CUDA out of memory"
    assert "partial" not in BenchmarkResult(partial.runs, partial.settings, partial.manifest).to_dict()
    assert llm.llm_engine.config.max_num_seqs == before


def test_benchmark_beam_search(llm):
    result = llm.benchmark(batch_size=2, input_len=6, output_len=3, use_beam_search=True, beam_width=2,
                           warmup=0)
    run = result.runs[0]
    assert run.use_beam_search and run.output_tokens == 2 * 3
    assert run.engine_generation_tokens > run.output_tokens  # every beam's candidates were sampled
    assert result.manifest["sampling"]["beam_width"] == 2


def test_benchmark_rejects_bad_arguments(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.benchmark(batch_size=1, input_len=500, output_len=100)
    with pytest.raises(ValueError, match="batch_size"):
        llm.benchmark(batch_size=[0])
    with pytest.raises(ValueError, match="repeats"):
        llm.benchmark(batch_size=1, input_len=4, output_len=2, repeats=0)


def test_benchmark_takes_numpy_arguments_as_python_ones(llm, tmp_path):
    """A sweep's np.arange batch sizes and numpy lengths run as the Python values they hold, and
    the saved result is JSON with Python numbers."""
    result = llm.benchmark(batch_size=np.arange(1, 3), input_len=np.int64(8), output_len=np.int32(3),
                           warmup=np.int64(0), temperature=np.float32(0.5), seed=np.int64(4))
    assert [r.batch_size for r in result.runs] == [1, 2]
    assert all(type(r.batch_size) is int for r in result.runs)
    assert [r.output_tokens for r in result.runs] == [3, 6]
    data = json.loads(result.save(tmp_path / "bench.json").read_text())
    assert data["settings"]["batch_size"] == [1, 2] and data["settings"]["temperature"] == 0.5
    one = llm.benchmark(batch_size=np.int64(2), input_len=8, output_len=3, warmup=0)
    assert [r.batch_size for r in one.runs] == [2]
    with pytest.raises(ValueError, match=r"batch_size=\['8'\] is invalid"):
        llm.benchmark(batch_size="8")


def test_sampled_benchmark_seeds_each_request_apart(llm, monkeypatch):
    """temperature > 0 with seed s: request i samples with seed s + i (one seed for all would
    give every request the same noise), the same in every run; greedy runs carry no seed."""
    seeds = []
    engine = llm.llm_engine
    real_add = engine.add_request

    def recording_add(request_id, prompt, params, **kwargs):
        seeds.append(params.seed)
        return real_add(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording_add)
    llm.benchmark(batch_size=3, input_len=6, output_len=2, warmup=0, repeats=2, temperature=0.8, seed=11)
    assert seeds == [11, 12, 13] * 2
    seeds.clear()
    llm.benchmark(batch_size=2, input_len=6, output_len=2, warmup=0, repeats=1)
    assert seeds == [None, None]


def test_random_prompts_avoid_eos_and_are_reproducible(llm):
    a = random_prompts(llm, 3, 50, [0, 1])
    assert a == random_prompts(llm, 3, 50, [0, 1]) and a != random_prompts(llm, 3, 50, [0, 2])
    eos = set(llm.llm_engine.eos_token_ids)
    assert all(len(p) == 50 and not eos & set(p) for p in a)


def test_latency_stats():
    s = latency_stats([0.001, 0.002, 0.003, 0.004], "x")
    assert s["x_p50_ms"] == pytest.approx(2.5) and s["x_mean_ms"] == pytest.approx(2.5)
    assert s["x_p99_ms"] == pytest.approx(3.97)
    assert latency_stats([], "y") == {"y_p50_ms": None, "y_p90_ms": None, "y_p99_ms": None, "y_mean_ms": None}


def test_benchmark_to_store(llm, tmp_path):
    pytest.importorskip("sqlalchemy")
    from pagedlab.lab import load_results
    from pagedlab.lab.store import ResultStore

    result = llm.benchmark(batch_size=[1, 2], input_len=6, output_len=2, warmup=0)
    url = f"sqlite:///{tmp_path / 'b.db'}"
    ids = result.to_store(url, experiment="seed-table")
    df = load_results(url, experiment="seed-table")
    assert list(df["run_id"]) == ids and list(df["benchmark.batch_size"]) == [1, 2]
    assert list(df["output_tokens"]) == [2, 4] and (df["output_throughput"] > 0).all()
    with ResultStore(url) as store:
        run = store.get_run(ids[1])
    assert run["params"]["varied"] == ["benchmark.batch_size"]
    assert run["manifest"]["model"]["weight_checksum"] == result.manifest["model"]["weight_checksum"]
    assert run["telemetry"]["num_samples"] >= 2


def test_storing_a_benchmark_again_stores_only_its_runs_not_stored_yet(llm, tmp_path, monkeypatch):
    """to_store files one run per transaction: a process killed after the first leaves it alone in
    the store. Storing the same result again (from the object, or from its saved file) completes it
    instead of filing the first run a second time, which the report would count as a repeat."""
    pytest.importorskip("sqlalchemy")
    from pagedlab.lab import load_results
    from pagedlab.lab.bench import BenchmarkResult
    from pagedlab.lab.store import ResultStore

    result = llm.benchmark(batch_size=[1, 2, 4], input_len=4, output_len=2, warmup=0, monitor=False)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    stored = ResultStore.record_run

    def killed_after_the_first(store, rec):
        if store.runs(manifest=False):
            raise KeyboardInterrupt
        return stored(store, rec)

    monkeypatch.setattr(ResultStore, "record_run", killed_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        result.to_store(url, experiment="seed-table")
    monkeypatch.setattr(ResultStore, "record_run", stored)
    assert list(load_results(url)["benchmark.batch_size"]) == [1]
    ids = result.to_store(url, experiment="seed-table")
    saved = BenchmarkResult.load(result.save(tmp_path / "b.json"))
    assert saved.to_store(url, experiment="seed-table") == ids
    df = load_results(url)
    assert list(df["run_id"]) == ids and list(df["benchmark.batch_size"]) == [1, 2, 4]
    assert list(df["output_throughput"]) == [r.output_throughput for r in result.runs]


def test_benchmarks_filed_apart_keep_what_set_them_apart(llm, tmp_path):
    """An ablation filed by one to_store per setting (block size 16 then 32, temperature 0 then 1)
    into one experiment: load_results has the setting as a column and the report keeps one
    configuration per setting instead of averaging them together."""
    pytest.importorskip("sqlalchemy")
    from pagedlab.lab import load_results
    from pagedlab.lab.report import _groups, _label_runs
    from pagedlab.lab.store import ResultStore

    url = f"sqlite:///{tmp_path / 'a.db'}"
    original = llm.get_engine_info().config.block_size
    try:
        for block_size, temperature in ((16, 0.0), (32, 0.0), (32, 1.0)):
            llm.set_model_args(block_size=block_size)
            llm.benchmark(batch_size=[2], input_len=4, output_len=2, warmup=0, monitor=False,
                          temperature=temperature).to_store(url, experiment="ablation")
    finally:
        llm.set_model_args(block_size=original)
    df = load_results(url, experiment="ablation")
    settings = list(zip(df["engine.block_size"], df["benchmark.temperature"]))
    assert settings == [(16, 0.0), (32, 0.0), (32, 1.0)]
    with ResultStore(url) as store:
        runs = store.runs(experiment="ablation")
    _label_runs(runs)
    assert sorted(len(members) for members in _groups(runs).values()) == [1, 1, 1]
