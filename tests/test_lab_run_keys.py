"""Run keys: specs that say the same thing share a key, settings that change a run change it, and
runs stored under the key an earlier pagedlab gave them still count as done (and are rekeyed)."""

import pytest

pytest.importorskip("yaml")
pytest.importorskip("sqlalchemy")

from pagedlab.lab.experiments import ExperimentError, expand_runs, experiment_from_dict, run_experiment
from pagedlab.lab.runs import format_plan
from pagedlab.lab.store import ResultStore, RunRecord

MODEL = "example-org/tiny-llama"  # a hub id: expansion never loads it


def bench_spec(**sections) -> dict:
    return {"name": "k", "model": MODEL, "engine": {"device": "cpu", "block_size": 32},
            "benchmark": {"batch_size": 2, "input_len": 8, "output_len": 4, "temperature": 0}, **sections}


def dataset_spec(sampling: dict, engine: dict | None = None) -> dict:
    return {"name": "d", "model": MODEL, "engine": {"device": "cpu", **(engine or {})}, "sampling": sampling,
            "dataset": {"prompts": ["a b c", "d e"]}}


def keys(spec: dict) -> list[str]:
    return [r.run_key for r in expand_runs(experiment_from_dict(spec))]


def test_equivalent_specs_share_a_key():
    sampling = {"max_tokens": 4, "temperature": 0.5, "stop": ["x"]}
    base = keys(dataset_spec(sampling))
    assert keys(dataset_spec({"max_tokens": 4, "temperature": 0.5, "stop": "x", "seed": 0, "top_k": 0,
                              "repetition_penalty": 1}, {"block_size": 16, "swap_space": 4})) == base
    zero = keys(dataset_spec({"max_tokens": 4, "temperature": 0}))
    assert keys(dataset_spec({"max_tokens": 4, "temperature": 0.0})) == zero
    # what changes a run changes its key
    assert keys(dataset_spec({**sampling, "stop": ["y"]})) != base
    assert keys(dataset_spec(sampling, {"block_size": 32})) != base
    assert keys(dataset_spec({**sampling, "seed": 1})) != base
    assert keys(dataset_spec({**sampling, "max_tokens": 5})) != base
    b = bench_spec()
    b["benchmark"] = {**b["benchmark"], "temperature": 0.0, "warmup": 1}
    assert keys(b) == keys(bench_spec())
    b["benchmark"]["warmup"] = 2
    assert keys(b) != keys(bench_spec())


def test_new_sampling_fields_leave_existing_keys_alone():
    """SamplingParams fields added later (here prompt_logprob_token_ids / prompt_logprob_start,
    default None, and flat_logprobs, default False) change no key of a spec written before them:
    the key pagedlab gave this spec before they existed, computed at commit 47bfd7c, and their
    defaults spelled out say the same."""
    sampling = {"max_tokens": 4, "temperature": 0.5, "prompt_logprobs": 2}
    before = ["d:361bbbf3cdfbb7e5da2cbf5e"]
    assert keys(dataset_spec(sampling)) == before
    defaults = {"prompt_logprob_token_ids": None, "prompt_logprob_start": None, "flat_logprobs": False}
    assert keys(dataset_spec({**sampling, **defaults})) == before
    assert keys(dataset_spec({**sampling, "prompt_logprob_token_ids": [5]})) != before
    assert keys(dataset_spec({**sampling, "flat_logprobs": True})) != before


def test_runs_equal_up_to_spelling_are_duplicates():
    spec = dataset_spec({"max_tokens": 4})
    spec["grid"] = {"sampling.temperature": [1, 1.0]}
    with pytest.raises(ExperimentError, match=r"runs 0 and 1 are identical \(sampling.temperature=1 and "
                                              r"sampling.temperature=1.0"):
        expand_runs(experiment_from_dict(spec))


def test_a_key_in_both_a_run_and_the_grid_is_an_error():
    spec = dataset_spec({"max_tokens": 4})
    spec["grid"] = {"sampling.top_k": [1, 2]}
    spec["runs"] = [{"sampling.temperature": 0.5}, {"sampling.top_k": 5}]
    with pytest.raises(ExperimentError, match=r"runs\[1\].*sampling.top_k is set both here and in the grid"):
        experiment_from_dict(spec)
    spec["runs"] = [{"sampling": {"top_k": 5}}]  # the nested spelling too
    with pytest.raises(ExperimentError, match="set both here and in the grid"):
        experiment_from_dict(spec)


def test_a_key_set_both_dotted_and_nested_in_one_run_is_an_error():
    """{engine.block_size: 16, engine: {block_size: 32}} names block_size twice: refused, not run
    with whichever spelling came last."""
    spec = dataset_spec({"max_tokens": 4})
    spec["runs"] = [{"sampling.top_k": 5, "sampling": {"top_k": 7}}]
    with pytest.raises(ExperimentError, match=r"runs\[0\].*sampling.top_k is set twice in this run"):
        experiment_from_dict(spec)


def test_legacy_key_is_the_earlier_recipe():
    # the key pagedlab gave this run before keys were canonical (computed at commit 5be19e2)
    run, = expand_runs(experiment_from_dict(bench_spec()))
    assert run.legacy_keys[0] == "k:c664e2ef3cb31192465f52b3" != run.run_key


def _store_legacy(db: str, run, status: str) -> None:
    with ResultStore(db) as store:
        old = run.legacy_keys[0]
        store.record_run(RunRecord(experiment="k", run_key=old, params=run.params(), metrics={},
                                   manifest={"experiment": {"name": "k", "run_key": old}},
                                   status=status, error="boom" if status == "failed" else None))


def _never_loaded(*args, **kwargs):
    raise AssertionError("a run stored under its legacy key ran again")


def test_runs_under_a_legacy_key_count_as_done(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'r.db'}"
    spec = experiment_from_dict(bench_spec())
    run, = expand_runs(spec)
    _store_legacy(db, run, "finished")
    assert run_experiment(spec, db=db, dry_run=True).skipped == 1  # read only
    assert "done" in capsys.readouterr().out.splitlines()[-2]
    with ResultStore(db) as store:
        assert store.finished_keys("k") == {run.legacy_keys[0]}
    report = run_experiment(spec, db=db, quiet=True, llm_factory=_never_loaded)
    assert report.skipped == 1 and report.finished == [] and report.failed == []
    with ResultStore(db) as store:
        stored, = store.runs(experiment="k")
        assert stored["run_key"] == run.run_key == stored["manifest"]["experiment"]["run_key"]


def test_failed_legacy_run_is_replaced_under_the_new_key(tmp_path):
    db = f"sqlite:///{tmp_path / 'f.db'}"
    spec = experiment_from_dict(bench_spec())
    run, = expand_runs(spec)
    _store_legacy(db, run, "failed")

    def fails(*args, **kwargs):
        raise RuntimeError("no GPU")

    report = run_experiment(spec, db=db, quiet=True, llm_factory=fails)
    assert report.skipped == 0 and len(report.failed) == 1
    with ResultStore(db) as store:
        stored, = store.runs(experiment="k")  # one row: the new attempt replaced the old one
        assert stored["run_key"] == run.run_key and "no GPU" in stored["error"]


def test_rekey_leaves_a_run_already_under_its_new_key(tmp_path):
    db = f"sqlite:///{tmp_path / 'b.db'}"
    with ResultStore(db) as store:
        for key in ("k:old", "k:new", "k:other"):
            store.record_run(RunRecord(experiment="k", run_key=key, params={}, metrics={}, manifest={}))
        assert store.rekey_runs({"k:old": "k:new", "k:other": "k:fresh", "k:absent": "k:x"}) == 1
        assert sorted(r["run_key"] for r in store.runs(experiment="k")) == ["k:fresh", "k:new", "k:old"]
        # two old keys for one new key: the first renamed takes it, the other stays as it was
        for key in ("k:a", "k:b"):
            store.record_run(RunRecord(experiment="k", run_key=key, params={}, metrics={}, manifest={}))
        assert store.rekey_runs({"k:a": "k:ab", "k:b": "k:ab"}) == 1
        left = sorted(r["run_key"] for r in store.runs(experiment="k")
                      if r["run_key"] in ("k:a", "k:b", "k:ab"))
        assert left in (["k:a", "k:ab"], ["k:ab", "k:b"])


def test_runs_expand_as_runs_then_grid_points_then_repeats():
    spec = dataset_spec({"max_tokens": 4})
    spec.update(runs=[{"sampling.top_k": 5}, {"sampling.top_k": 7}],
                grid={"sampling.temperature": [0.5, 1.0]}, repeats=2)
    runs = expand_runs(experiment_from_dict(spec))
    got = [(x.config["sampling"]["top_k"], x.config["sampling"]["temperature"], x.repeat) for x in runs]
    assert got == [(k, t, r) for k in (5, 7) for t in (0.5, 1.0) for r in (0, 1)]
    assert [x.index for x in runs] == list(range(8))


def test_each_dataset_setting_of_a_sweep_loads_its_own_prompts():
    spec = dataset_spec({"max_tokens": 4})
    spec.update(dataset={"prompts": ["a", "b c", "d"]}, grid={"dataset.limit": [1, 3]})
    runs = expand_runs(experiment_from_dict(spec))
    assert [len(r.dataset.items) for r in runs] == [1, 3] == [r.params()["dataset.num_prompts"] for r in runs]
    assert runs[0].dataset.sha256 != runs[1].dataset.sha256


def test_the_plan_loads_only_groups_with_pending_runs():
    spec = experiment_from_dict(bench_spec(grid={"engine.dtype": ["float32", "bfloat16"]}))
    runs = expand_runs(spec)
    done = {r.run_key for r in runs if r.config["engine"]["dtype"] == "float32"}
    plan = format_plan(spec, runs, done).splitlines()
    assert plan[0].startswith("experiment k: 2 run(s), 1 pending, 2 model group(s) (1 to load)")
    assert [line.split()[5] for line in plan[2:4]] == ["done", "pending"]


def test_one_dataset_file_spelled_differently_keeps_its_key(tmp_path, capsys):
    """The same prompts, read from one file however its path is written (relative, ./, absolute,
    through a symlink) or given inline, are the same runs: one key. A run stored under the key
    the dataset's spelling gave it before still counts as done."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "qa.jsonl").write_text('{"prompt": "a b c"}\n{"prompt": "d e"}\n')
    (tmp_path / "link").symlink_to(data)

    def spec_keys(dataset: dict) -> list[str]:
        spec = {**dataset_spec({"max_tokens": 4}), "dataset": dataset}
        return [r.run_key for r in expand_runs(experiment_from_dict(spec, base_dir=tmp_path))]

    base = spec_keys({"path": "data/qa.jsonl"})
    for path in ("./data/qa.jsonl", "data//qa.jsonl", str(data / "qa.jsonl"), "link/qa.jsonl"):
        assert spec_keys({"path": path}) == base, path
    assert spec_keys({"path": "data/qa.jsonl", "format": "jsonl"}) == base
    assert spec_keys({"prompts": ["a b c", "d e"]}) == base
    assert spec_keys({"path": "data/qa.jsonl", "limit": 1}) != base  # other prompts: another run
    # stored under the earlier recipe's key: done, and rekeyed
    db = f"sqlite:///{tmp_path / 'r.db'}"
    spec = experiment_from_dict({**dataset_spec({"max_tokens": 4}), "dataset": {"path": "data/qa.jsonl"}},
                                base_dir=tmp_path)
    run, = expand_runs(spec)
    with ResultStore(db) as store:
        store.record_run(RunRecord(experiment="d", run_key=run.legacy_keys[-1], params=run.params(),
                                   metrics={}, manifest={}))
    assert run_experiment(spec, db=db, quiet=True, llm_factory=_never_loaded).skipped == 1
    with ResultStore(db) as store:
        assert store.finished_keys("d") == {run.run_key}


def test_repetition_detection_keeps_earlier_keys():
    """The field came with a default: a spec without it (or with it null) keeps the key it had
    before (computed at 47bfd7c), and one that sets it (as YAML does, a mapping) is another run."""
    sampling = {"max_tokens": 4, "temperature": 0.5, "stop": ["x"]}
    assert keys(dataset_spec(sampling)) == ["d:998c13c91aa370dce8aeb314"]
    assert keys(dataset_spec({**sampling, "repetition_detection": None})) == ["d:998c13c91aa370dce8aeb314"]
    looping = {**sampling, "repetition_detection": {"max_pattern_size": 4, "min_count": 3}}
    assert keys(dataset_spec(looping)) != ["d:998c13c91aa370dce8aeb314"]
    with pytest.raises(ExperimentError, match="min_count=1 is invalid"):
        keys(dataset_spec({**sampling, "repetition_detection": {"max_pattern_size": 4, "min_count": 1}}))


def test_new_settings_left_at_their_defaults_keep_earlier_keys():
    """A field added with a default (``thinking_token_budget``, ``reasoning_config``) changes no key
    of a spec written before it, spelt out or not (the key computed before they existed)."""
    spec = dataset_spec({"max_tokens": 4, "temperature": 0.5})
    assert keys(spec) == ["d:f60c293d044eb3897d66b56a"]
    spelt = dataset_spec({"max_tokens": 4, "temperature": 0.5, "thinking_token_budget": None},
                         {"reasoning_config": None})
    assert keys(spelt) == keys(spec)
    assert keys(dataset_spec({"max_tokens": 4, "temperature": 0.5, "thinking_token_budget": 8},
                             {"reasoning_config": {"reasoning_parser": "qwen3"}})) != keys(spec)


def test_stream_interval_and_skip_reading_prefix_cache_keep_earlier_keys():
    """Both came with defaults (SamplingParams' ``stream_interval`` and ``skip_reading_prefix_cache``,
    None; the engine's ``stream_interval``, 1): spelt out, a spec keeps the key computed before they
    existed; set, it is another run."""
    sampling = {"max_tokens": 4, "temperature": 0.5}
    spec = dataset_spec(sampling)
    assert keys(spec) == ["d:f60c293d044eb3897d66b56a"]
    spelt = {**sampling, "stream_interval": None, "skip_reading_prefix_cache": None}
    assert keys(dataset_spec(spelt, {"stream_interval": 1})) == keys(spec)
    assert keys(dataset_spec({**sampling, "skip_reading_prefix_cache": True})) != keys(spec)
    assert keys(dataset_spec(sampling, {"stream_interval": 4})) != keys(spec)
    with pytest.raises(ExperimentError, match="stream_interval=0 is invalid"):
        keys(dataset_spec({**sampling, "stream_interval": 0}))


def test_trace_decode_token_ids_keeps_earlier_keys():
    """SamplingParams' ``trace_decode_token_ids`` came with a default (None): spelt out, a spec keeps
    the key computed before it existed; set, it is another run."""
    sampling, before = {"max_tokens": 4, "temperature": 0.5}, ["d:f60c293d044eb3897d66b56a"]
    assert keys(dataset_spec({**sampling, "trace_decode_token_ids": None})) == before
    assert keys(dataset_spec({**sampling, "trace_decode_token_ids": [3, 4]})) != before


def test_hf_overrides_keeps_earlier_keys():
    """EngineConfig's ``hf_overrides`` came with a default (None): spelt out, a spec keeps the key
    computed before it existed; set, it is another run."""
    sampling, before = {"max_tokens": 4, "temperature": 0.5}, ["d:f60c293d044eb3897d66b56a"]
    assert keys(dataset_spec(sampling, {"hf_overrides": None})) == before
    assert keys(dataset_spec(sampling, {"hf_overrides": {"num_hidden_layers": 1}})) != before
    with pytest.raises(ExperimentError, match="hf_overrides=5 is invalid"):
        keys(dataset_spec(sampling, {"hf_overrides": 5}))
