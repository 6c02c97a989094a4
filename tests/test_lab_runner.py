"""The runner's bookkeeping around each run: the seed and times stored with it, the plan it really
ran with, a traceback for a failure, a model that fails to load, progress, and a run that another
process finished meanwhile. The database is read back with plain sqlite3."""

import contextlib
import json
import sqlite3
from datetime import datetime
from types import SimpleNamespace

import pytest

pytest.importorskip("yaml")
pytest.importorskip("sqlalchemy")

import sqlalchemy as sa
import yaml

from pagedlab import LLM
from pagedlab.config import ENGINE_DEFAULTS
from pagedlab.lab import cli as lab_cli
from pagedlab.lab import runner
from pagedlab.lab.experiments import experiment_from_dict, load_experiment, run_experiment
from pagedlab.lab.store import ResultStore, RunRecord
from pagedlab.lab.testing import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("runner") / "tiny")


def spec_data(model, **extra) -> dict:
    return {"name": "r", "model": model,
            "engine": {"device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 4 << 20},
            "sampling": {"max_tokens": 2, "temperature": 0.8},
            "dataset": {"prompts": ["the quick brown", "two plus two is"]},
            "metrics": ["output_length"], "monitor": False, **extra}


def spec_of(model, **extra):
    return experiment_from_dict(spec_data(model, **extra))


def stored_runs(db) -> list[dict]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        rows = [dict(r) for r in conn.execute("SELECT * FROM runs ORDER BY id")]
    for r in rows:
        for col in ("params", "metrics", "manifest"):
            r[col] = json.loads(r[col])
    return rows


class Ticks:
    """A stand-in for the tqdm bar: counts the runs it is advanced by."""

    def __init__(self, total=None):
        self.total, self.n, self.closed = total, 0, False

    def update(self, k):
        self.n += k

    def close(self):
        self.closed = True


def test_each_run_stores_its_own_seed_and_times(tmp_path, model_dir):
    # repeat r samples with seed sampling.seed + r (docs/lab.md): 5 and 6, never the repeat index
    spec = spec_of(str(model_dir), sampling={"max_tokens": 2, "temperature": 0.8, "seed": 5}, repeats=2)
    report = run_experiment(spec, db=str(tmp_path / "s.db"), quiet=True)
    assert report.ok and len(report.finished) == 2
    rows = stored_runs(tmp_path / "s.db")
    assert [(r["repeat"], r["seed"]) for r in rows] == [(0, 5), (1, 6)]
    for r in rows:
        manifest = r["manifest"]
        assert r["params"]["sampling.seed"] == r["seed"] == manifest["sampling"]["seed"]
        assert manifest["seeds"]["sampling"] == r["seed"]
        started, finished = datetime.fromisoformat(r["started_at"]), datetime.fromisoformat(r["finished_at"])
        assert started < finished
        assert r["duration_s"] == pytest.approx((finished - started).total_seconds())


def test_a_run_that_leaves_a_plan_setting_unset_runs_with_its_default(tmp_path, model_dir):
    # the group loads with run 0's block_size 32; run 1 sets none, so it must re-plan to the default
    spec = spec_of(str(model_dir), runs=[{"engine.block_size": 32}, {"sampling.temperature": 0.5}])
    report = run_experiment(spec, db=str(tmp_path / "p.db"), quiet=True)
    assert report.ok and len(report.finished) == 2
    assert report.replans == 1 and report.replan_s > 0
    rows = {r["params"].get("engine.block_size"): r for r in stored_runs(tmp_path / "p.db")}
    assert rows.keys() == {32, None}
    assert rows[32]["manifest"]["engine"]["block_size"] == 32 and rows[32]["metrics"]["replan_s"] == 0.0
    assert rows[None]["manifest"]["engine"]["block_size"] == ENGINE_DEFAULTS["block_size"] != 32
    assert rows[None]["metrics"]["replan_s"] > 0


def test_the_runs_of_a_group_are_ordered_by_plan(tmp_path, model_dir):
    replans = []

    class SpyLLM(LLM):
        def set_model_args(self, **changes):
            replans.append(changes)
            super().set_model_args(**changes)

    # expansion alternates block sizes 16, 32, 16, 32: in plan order the group re-plans once
    spec = spec_of(str(model_dir), grid={"sampling.temperature": [0.5, 1.0], "engine.block_size": [16, 32]})
    report = run_experiment(spec, db=str(tmp_path / "o.db"), quiet=True, llm_factory=SpyLLM)
    assert report.ok and len(report.finished) == 4
    assert replans == [{"block_size": 32}] and report.replans == 1


def test_progress_counts_the_pending_runs_only(tmp_path, model_dir, monkeypatch):
    db = str(tmp_path / "g.db")
    run_experiment(spec_of(str(model_dir), grid={"engine.max_num_seqs": [1, 2]}), db=db, quiet=True)
    bars = []
    monkeypatch.setattr(runner, "_progress_bar", lambda name, total: bars.append(Ticks(total)) or bars[-1])
    report = run_experiment(spec_of(str(model_dir), grid={"engine.max_num_seqs": [1, 2, 4]}), db=db)
    assert report.skipped == 2 and len(report.finished) == 1
    assert [(bar.total, bar.n, bar.closed) for bar in bars] == [(1, 1, True)]


def test_a_run_another_process_finished_meanwhile_is_skipped(tmp_path, model_dir):
    spec = spec_of(str(model_dir), grid={"engine.block_size": [16, 32]})
    db = str(tmp_path / "m.db")
    seen = {"closed": 0}

    class ClosingLLM(LLM):
        def close(self):
            seen["closed"] += 1
            super().close()

    def run_groups(session, groups):
        (group,) = groups
        theirs = group[1]  # pending when the experiment started, stored by "another process" now
        session.store.record_run(RunRecord(spec.name, theirs.run_key, theirs.params(), {"by": "other"}, {}))
        seen["key"], session.bar = theirs.run_key, Ticks()
        runner.run_groups_here(session, groups, llm_factory=ClosingLLM)
        seen["ticks"] = session.bar.n

    report = run_experiment(spec, db=db, quiet=True, run_groups=run_groups)
    assert report.ok and report.skipped == 1 and len(report.finished) == 1
    assert seen["ticks"] == 2 and seen["closed"] == 1  # both runs advance the bar; the model is closed
    rows = stored_runs(tmp_path / "m.db")
    theirs = [r for r in rows if r["run_key"] == seen["key"]]
    ours = [r for r in rows if r["run_key"] != seen["key"]]
    assert len(theirs) == len(ours) == 1 and theirs[0]["metrics"] == {"by": "other"}
    assert report.finished == [ours[0]["id"]] and ours[0]["metrics"]["output_tokens"] > 0


def test_a_model_that_fails_to_load_fails_its_whole_group_then_is_retried(tmp_path, model_dir):
    spec = spec_of(str(model_dir), grid={"engine.max_num_seqs": [1, 2, 3]})  # one group of 3 runs
    db = str(tmp_path / "l.db")
    bar = Ticks()

    def no_gpu(model, **kwargs):
        raise RuntimeError("no GPU")

    def run_groups(session, groups):
        session.bar = bar
        runner.run_groups_here(session, groups, llm_factory=no_gpu)

    report = run_experiment(spec, db=db, quiet=True, run_groups=run_groups)
    assert len(report.failed) == 3 and not report.finished and bar.n == 3
    rows = stored_runs(tmp_path / "l.db")
    assert [r["status"] for r in rows] == ["failed"] * 3
    assert {r["error"] for r in rows} == {"loading the model failed: RuntimeError: no GPU"}
    again = run_experiment(spec, db=db, quiet=True)
    assert again.ok and again.skipped == 0 and len(again.finished) == 3
    retried = stored_runs(tmp_path / "l.db")
    assert [r["status"] for r in retried] == ["finished"] * 3  # one row per run key, the failures replaced
    assert {r["run_key"] for r in retried} == {r["run_key"] for r in rows}


def test_a_plan_the_engine_cannot_build_fails_its_own_runs_only(tmp_path, model_dir):
    """A KV cache too small for one sequence fails the load under the first plan of the group: its
    runs are stored failed, and the group's other plan loads and runs (docs/lab.md: the others go
    on)."""
    spec = spec_of(str(model_dir), grid={"engine.kv_cache_memory_bytes": [1024, 4 << 20]})
    report = run_experiment(spec, db=str(tmp_path / "p.db"), quiet=True)
    assert len(report.finished) == 1 and len(report.model_loads) == 1
    (label, error), = report.failed
    assert "kv_cache_memory_bytes=1024" in label and error.startswith("loading the model failed")
    rows = stored_runs(tmp_path / "p.db")
    assert {r["params"]["engine.kv_cache_memory_bytes"]: r["status"] for r in rows} == {
        1024: "failed", 4 << 20: "finished"}


def test_a_failed_run_is_stored_with_its_traceback(tmp_path, model_dir):
    # max_model_len 4 cannot hold the prompts (docs/lab.md: stored "with status = failed and its traceback")
    spec = spec_of(str(model_dir), grid={"engine.max_model_len": [4, 64]})
    report = run_experiment(spec, db=str(tmp_path / "t.db"), quiet=True)
    assert len(report.failed) == 1 and len(report.finished) == 1
    failed, = [r for r in stored_runs(tmp_path / "t.db") if r["status"] == "failed"]
    message, _, trace = failed["error"].partition("\n\n")
    assert "max_model_len is 4" in message and message == report.failed[0][1]
    assert trace.startswith("Traceback (most recent call last):") and "max_model_len is 4" in trace


def test_output_record_keeps_timings_and_further_completions():
    def completion(text, ids):
        return SimpleNamespace(text=text, token_ids=ids, finish_reason="length")

    output = SimpleNamespace(
        prompt="p", prompt_token_ids=[5, 6, 7], outputs=[completion("a", [1]), completion("b", [2, 3])],
        metrics=SimpleNamespace(arrival_time=10.0, first_token_time=10.25, finished_time=11.0))
    item = SimpleNamespace(prompt="p", reference=["r"])
    record = runner._output_record(item, output)
    assert record["prompt_tokens"] == 3 and record["text"] == "a" and record["token_ids"] == [1]
    assert record["ttft_ms"] == pytest.approx(250.0) and record["e2e_ms"] == pytest.approx(1000.0)
    assert record["completions"] == [{"text": "b", "token_ids": [2, 3], "finish_reason": "length"}]


def test_a_failed_replan_stores_no_other_plan_as_its_own_and_loses_nothing(tmp_path, model_dir):
    """A run whose re-plan fails (its KV cache cannot hold one sequence) is stored failed with a
    manifest that holds no engine, as a failed load's: the engine went back to the previous run's
    plan, which the manifest recorded as this run's. The run before it stays finished, and a rerun
    keeps it and retries the failed one only."""
    spec = spec_of(str(model_dir), grid={"engine.kv_cache_memory_bytes": [4 << 20, 5000]})
    db = str(tmp_path / "f.db")
    report = run_experiment(spec, db=db, quiet=True)
    rows = {r["params"]["engine.kv_cache_memory_bytes"]: r for r in stored_runs(tmp_path / "f.db")}
    assert rows[4 << 20]["status"] == "finished"
    assert rows[4 << 20]["manifest"]["engine"]["kv_cache_memory_bytes"] == 4 << 20
    assert rows[5000]["status"] == "failed" and "engine" not in rows[5000]["manifest"]
    (label, error), = report.failed
    assert "kv_cache_memory_bytes=5000" in label and error.startswith("re-planning failed: ValueError")
    assert rows[5000]["error"].startswith(error)
    again = run_experiment(spec, db=db, quiet=True)
    assert again.skipped == 1 and len(again.failed) == 1
    after = {r["params"]["engine.kv_cache_memory_bytes"]: r for r in stored_runs(tmp_path / "f.db")}
    assert after[4 << 20] == rows[4 << 20] and after[5000]["status"] == "failed"


def test_a_run_the_store_cannot_take_is_saved_to_a_file_and_stops_the_sweep(tmp_path, model_dir, monkeypatch,
                                                                             capsys):
    """A full disk (or a lost connection) while storing: the computed run is saved beside the
    database and named in the error; the sweep stops (exit code 2); `results import` stores it."""
    path, db = tmp_path / "exp.yaml", tmp_path / "full.db"
    path.write_text(yaml.safe_dump(spec_data(str(model_dir), grid={"engine.block_size": [16, 32]})))
    record_run = ResultStore.record_run

    def disk_full(store, rec):
        raise sa.exc.OperationalError("INSERT", {}, sqlite3.OperationalError("database or disk is full"))

    monkeypatch.setattr(ResultStore, "record_run", disk_full)
    assert lab_cli.main(["run", str(path), "--db", str(db), "-q"]) == 2
    saved, = tmp_path.glob("unstored-run-*.json")  # the first run; the second never ran
    err = capsys.readouterr().err
    assert "failed (OperationalError: database or disk is full); the run is saved in " + str(saved) in err
    monkeypatch.setattr(ResultStore, "record_run", record_run)  # the disk has room again
    assert lab_cli.main(["results", "import", str(saved), "--db", str(db)]) == 0
    row, = stored_runs(db)
    assert row["status"] == "finished" and row["manifest"]["experiment"]["run_key"] == row["run_key"]
    assert row["started_at"] < row["finished_at"]
    with ResultStore(db) as store:
        outputs = store.outputs(row["id"])
    assert len(outputs) == 2 and row["metrics"]["output_tokens"] == sum(o["num_tokens"] for o in outputs) > 0
    report = run_experiment(load_experiment(path), db=str(db), quiet=True)
    assert report.skipped == 1 and len(report.finished) == 1
