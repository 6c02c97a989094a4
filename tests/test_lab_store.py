"""The results store, on SQLite always and on PostgreSQL when PAGEDLAB_TEST_POSTGRES_URL is set
(CI: export PAGEDLAB_TEST_POSTGRES_URL=$(.ci/start-postgres.sh))."""

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
import torch

pytest.importorskip("sqlalchemy")
pd = pytest.importorskip("pandas")

from pagedlab.lab import cli as lab_cli  # noqa: E402
from pagedlab.lab.store import ResultStore, RunRecord, load_results, resolve_url  # noqa: E402

# Under pytest-xdist (CI: -n 2 --dist loadgroup) the modules that start Ray or share the
# PostgreSQL database run on one worker, one after another.
pytestmark = pytest.mark.xdist_group("ray-and-postgres")
POSTGRES_URL = os.environ.get("PAGEDLAB_TEST_POSTGRES_URL")


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'results.db'}"
    if not POSTGRES_URL:  # reported as skipped, so a run without a server says what it did not test
        pytest.skip("no PostgreSQL server: set PAGEDLAB_TEST_POSTGRES_URL (CI: .ci/start-postgres.sh)")
    store = ResultStore(POSTGRES_URL)  # start from empty tables
    store.metadata.drop_all(store.engine)
    store.close()
    return POSTGRES_URL


def _record(key, experiment="exp", n_outputs=3, **metrics):
    return RunRecord(
        experiment=experiment, run_key=key, model="/models/tiny",
        params={"model": "/models/tiny", "engine.block_size": 16, "sampling.temperature": 0.5,
                "varied": ["x"]},
        metrics={"bleu": 12.5, "output_throughput": 100.0, **metrics},
        manifest={"host": {"hostname": "h1"}, "versions": {"torch": "2.11"}},
        telemetry={"backend": "cpu", "num_samples": 2}, telemetry_samples=[{"t": 1.0, "kind": "cpu"}],
        outputs=[{"prompt": f"p{i}", "text": f"out {i}", "token_ids": list(range(i + 1)), "reference": ["r"],
                  "finish_reason": "length", "ttft_ms": 1.5} for i in range(n_outputs)],
        repeat=1, seed=42)


def test_record_and_read_back(url):
    with ResultStore(url) as store:
        rid = store.record_run(_record("k1", weird=float("nan")))
        run = store.get_run(rid, samples=True)
        assert run["status"] == "finished" and run["experiment"] == "exp" and run["seed"] == 42
        assert run["params"]["engine.block_size"] == 16
        assert run["metrics"] == {"bleu": 12.5, "output_throughput": 100.0, "weird": None}  # NaN is not JSON
        assert run["manifest"]["versions"]["torch"] == "2.11" and run["host"] == "h1"
        assert run["telemetry_samples"] == [{"t": 1.0, "kind": "cpu"}]
        outs = run["outputs"]
        assert [o["idx"] for o in outs] == [0, 1, 2] and outs[2]["token_ids"] == [0, 1, 2]
        assert outs[2]["num_tokens"] == 3 and outs[0]["extra"] == {"ttft_ms": 1.5}
        assert store.finished_keys("exp") == {"k1"} and store.finished_keys("other") == set()
        exps = store.experiments()
        assert [(e["name"], e["runs"]) for e in exps] == [("exp", {"finished": 1})]
        with pytest.raises(KeyError, match="run 999"):
            store.get_run(999)


def test_finished_runs_are_stored_once_and_failures_replaced(url):
    with ResultStore(url) as store:
        failed = store.record_run(RunRecord("exp", "k", {}, {}, {}, status="failed", error="OOM"))
        again = store.record_run(RunRecord("exp", "k", {}, {}, {}, status="failed", error="OOM 2"))
        assert [r["error"] for r in store.runs(status="failed")] == ["OOM 2"] and again != failed
        ok = store.record_run(_record("k"))
        dup = store.record_run(_record("k", bleu=99.0))
        assert dup == ok
        runs = store.runs()
        assert len(runs) == 1 and runs[0]["status"] == "finished" and runs[0]["metrics"]["bleu"] == 12.5
        assert len(store.outputs(ok)) == 3


def test_load_results_dataframe(url):
    with ResultStore(url) as store:
        for i in range(3):
            store.record_run(_record(f"k{i}", bleu=float(i)))
        store.record_run(_record("other", experiment="exp2"))
        store.record_run(RunRecord("exp", "bad", {}, {}, {}, status="failed", error="boom"))
    df = load_results(url)
    assert len(df) == 4 and set(df["status"]) == {"finished"}
    assert list(df.columns[:3]) == ["run_id", "experiment", "run_key"]
    assert {"engine.block_size", "sampling.temperature", "bleu", "output_throughput"} <= set(df.columns)
    mine = load_results(url, experiment="exp")
    assert sorted(mine["bleu"]) == [0.0, 1.0, 2.0] and set(mine["engine.block_size"]) == {16}
    everything = load_results(url, status=None, manifest=True)
    assert len(everything) == 5 and "manifest.versions.torch" in everything.columns
    assert everything.loc[everything["status"] == "failed", "error"].iloc[0] == "boom"


def test_export_formats(url, tmp_path):
    with ResultStore(url) as store:
        for i in range(2):
            store.record_run(_record(f"k{i}", bleu=float(i)))
        assert store.export(tmp_path / "r.csv") == 2
        assert store.export(tmp_path / "r.jsonl", outputs=True) == 2
        pytest.importorskip("pyarrow")
        assert store.export(tmp_path / "r.parquet", manifest=True) == 2
        with pytest.raises(ValueError, match="csv, jsonl or parquet"):
            store.export(tmp_path / "r.xlsx")
        # --outputs with a table format was ignored without a word
        with pytest.raises(ValueError, match=r"outputs \(--outputs\) are exported as jsonl only, not csv"):
            store.export(tmp_path / "o.csv", outputs=True)
        assert not (tmp_path / "o.csv").exists()
    csv = pd.read_csv(tmp_path / "r.csv")
    assert sorted(csv["bleu"]) == [0.0, 1.0] and json.loads(csv["varied"][0]) == ["x"]
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["params"]["engine.block_size"] == 16
    assert len(lines[0]["outputs"]) == 3 and lines[0]["manifest"]["host"]["hostname"] == "h1"
    parquet = pd.read_parquet(tmp_path / "r.parquet")
    assert len(parquet) == 2 and parquet["manifest.versions.torch"].tolist() == ["2.11", "2.11"]


def test_an_export_that_stops_part_way_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """An export interrupted part-way (Ctrl-C, a lost database connection) keeps the previous
    export whole and writes no partial file: a JSON lines file cut after its first run reads back
    as a complete export of one run."""
    out, fresh = tmp_path / "r.jsonl", tmp_path / "new.jsonl"
    with ResultStore(tmp_path / "e.db") as store:
        for i in range(3):
            store.record_run(_record(f"k{i}"))
        assert store.export(out, outputs=True) == 3
        before = out.read_bytes()
        store.record_run(_record("k3"))
        outputs = store.outputs

        def interrupted(run_id):
            if run_id > 1:
                raise KeyboardInterrupt
            return outputs(run_id)

        monkeypatch.setattr(store, "outputs", interrupted)
        for path in (out, fresh):
            with pytest.raises(KeyboardInterrupt):
                store.export(path, outputs=True)
    assert out.read_bytes() == before and not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.db", "r.jsonl"]


_WRITER = textwrap.dedent("""
    import sys
    from pagedlab.lab.store import ResultStore, RunRecord
    url, tag, n, shared = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    store = ResultStore(url)
    keys = [f"{tag}-{i}" for i in range(n)] + [f"shared-{i}" for i in range(shared)]
    for key in keys:
        store.record_run(RunRecord("concurrent", key, {"writer": tag}, {"value": 1.0}, {"w": tag},
                                   outputs=[{"prompt": key, "text": str(j), "token_ids": [j] * 50}
                                            for j in range(4)]))
    print("done", len(keys))
""")


def test_two_processes_writing_at_once(url, tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    ResultStore(url).close()  # tables exist before the race (creating them concurrently is tested below)
    procs = [subprocess.Popen([sys.executable, str(script), url, tag, "25", "10"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for tag in ("a", "b")]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert "done 35" in out
    with ResultStore(url) as store:
        runs = store.runs(experiment="concurrent")
        keys = [r["run_key"] for r in runs]
        assert len(keys) == len(set(keys)) == 60  # 25 + 25 own runs, the 10 shared ones once
        for r in runs:
            outs = store.outputs(r["run_id"])
            assert [o["prompt"] for o in outs] == [r["run_key"]] * 4
            assert all(len(o["token_ids"]) == 50 for o in outs)
        if store.is_sqlite:
            with store.engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"


def test_two_processes_creating_the_schema_at_once(url, tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    procs = [subprocess.Popen([sys.executable, str(script), url, tag, "3", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for tag in ("a", "b", "c")]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert len(load_results(url)) == 9


_CRASHER = textwrap.dedent("""
    import sys
    from pagedlab.lab.store import ResultStore, RunRecord
    store = ResultStore(sys.argv[1])
    for i in range(3):
        store.record_run(RunRecord("crash", f"run-{i}", {}, {"i": i}, {},
                                   outputs=[{"prompt": "p", "text": "t", "token_ids": [1]}] * 5))
""")


def test_sigkill_in_the_middle_of_a_write_leaves_no_partial_run(url, tmp_path):
    script = tmp_path / "crasher.py"
    script.write_text(_CRASHER)
    env = dict(os.environ, PAGEDLAB_FAULT="store.mid_write:2")  # killed after inserting run 2, before commit
    proc = subprocess.run([sys.executable, str(script), url], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with ResultStore(url) as store:
        runs = store.runs(status=None)
        assert [(r["run_key"], r["status"]) for r in runs] == [("run-0", "finished")]
        assert len(store.outputs(runs[0]["run_id"])) == 5
        with store.engine.connect() as conn:
            assert conn.execute(store.sa.select(store.sa.func.count()).select_from(store.t_out)).scalar() == 5
    proc = subprocess.run([sys.executable, str(script), url], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(load_results(url)["run_key"]) == ["run-0", "run-1", "run-2"]


def test_results_cli(url, tmp_path, capsys):
    with ResultStore(url) as store:
        rid = store.record_run(_record("k0"))
        store.record_run(RunRecord("exp", "bad", {"varied": []}, {}, {}, status="failed",
                                   error="CUDA OOM\ntrace"))
    parser = argparse.ArgumentParser()
    lab_cli.register(parser.add_subparsers())

    def run(*argv):
        args = parser.parse_args(list(argv))
        return args.func(args)

    assert run("results", "list", "--db", url) == 0
    out = capsys.readouterr().out
    assert "finished" in out and "failed" in out and "bleu=12.5" in out
    assert "CUDA OOM" in out and "tiny" in out
    assert run("results", "list", "--db", url, "--status", "failed", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["status"] for r in rows] == ["failed"]
    assert run("results", "show", str(rid), "--db", url, "--outputs", "2") == 0
    out = capsys.readouterr().out
    assert "engine.block_size = 16" in out and "outputs (first 2 of 3)" in out and "'out 1'" in out
    assert run("results", "show", str(rid), "--db", url, "--json") == 0
    assert json.loads(capsys.readouterr().out)["outputs"][2]["text"] == "out 2"
    assert run("results", "show", "12345", "--db", url) == 2
    assert "run 12345 is not in" in capsys.readouterr().err
    target = tmp_path / "all.jsonl"
    assert run("results", "export", "--db", url, "--format", "jsonl", "--out", str(target), "--status",
               "all") == 0
    assert len(target.read_text().splitlines()) == 2


def test_export_to_a_name_without_suffix_writes_csv(tmp_path, capsys):
    """results export --out NAME, no suffix and no --format, writes CSV as its help says ("from
    the --out suffix, else csv") instead of refusing an export format ''."""
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with ResultStore(url) as store:
        store.record_run(_record("k0"))
    target = tmp_path / "runs"
    assert lab_cli.main(["results", "export", "--db", url, "--out", str(target)]) == 0
    header, row = target.read_text().splitlines()
    assert "output_throughput" in header.split(",") and "100.0" in row.split(",")


def test_bad_urls_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="nosuchdb"):
        ResultStore("nosuchdb://x/y")
    assert resolve_url(tmp_path / "a.db") == f"sqlite:///{tmp_path / 'a.db'}"
    assert resolve_url("postgresql://u@h/db") == "postgresql://u@h/db"


def test_a_postgresql_url_without_a_driver_uses_the_installed_one(monkeypatch):
    """docs/ray.md's postgresql://USER:PASSWORD@HOST/DB: SQLAlchemy 2.1 reads a driver-less URL as
    psycopg 3, while the lab installs psycopg2 (psycopg2-binary); the store picks what is there."""
    import importlib.util

    from sqlalchemy.engine import make_url

    from pagedlab.lab.store import with_installed_driver

    installed = {"psycopg2"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in installed else None)
    assert with_installed_driver(make_url("postgresql://u:p@h/db")).drivername == "postgresql+psycopg2"
    assert with_installed_driver(make_url("postgresql+pg8000://u@h/db")).drivername == "postgresql+pg8000"
    installed.add("psycopg")
    assert with_installed_driver(make_url("postgresql://u@h/db")).drivername == "postgresql"
    monkeypatch.undo()
    if POSTGRES_URL:  # CI: the real server through the URL as the docs write it
        import sqlalchemy as sa

        store = ResultStore(POSTGRES_URL.replace("postgresql+psycopg2://", "postgresql://"))
        with store.engine.connect() as connection:
            assert connection.execute(sa.text("SELECT 1")).scalar() == 1
        store.close()


# ---- on SQLite, read back with plain sqlite3 -----------------------------------------------------------
def _sqlite(path, query, *args) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(query, args).fetchall()


def test_times_and_scalars_are_stored_as_given(tmp_path):
    db = tmp_path / "t.db"
    started = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    metrics = {"np": np.float32(0.25), "torch": torch.tensor(7), "pair": (1, 2)}
    with ResultStore(db) as store:
        rid = store.record_run(RunRecord("exp", "k", {}, metrics, {}, started_at=started,
                                         finished_at=started + timedelta(seconds=90)))
        run = store.get_run(rid)
    assert run["started_at"] == "2025-01-02T03:04:05+00:00"
    assert run["finished_at"] == "2025-01-02T03:05:35+00:00"
    (duration, stored_metrics), = _sqlite(db, "SELECT duration_s, metrics FROM runs")
    assert duration == 90.0
    assert json.loads(stored_metrics) == {"np": 0.25, "torch": 7, "pair": [1, 2]}  # numbers, not strings


def test_runs_are_listed_oldest_first_and_picked_by_id(tmp_path):
    with ResultStore(tmp_path / "o.db") as store:
        ids = {key: store.record_run(RunRecord("exp", key, {}, {}, {})) for key in ("c", "a", "b")}
        assert [r["run_key"] for r in store.runs()] == ["c", "a", "b"]
        assert list(store.dataframe()["run_key"]) == ["c", "a", "b"]
        assert [r["run_key"] for r in store.runs(run_ids=[ids["a"]])] == ["a"]
        assert store.runs(run_ids=[]) == []


def test_delete_runs_deletes_only_what_it_is_asked_to(tmp_path):
    db = tmp_path / "d.db"
    outputs = [{"prompt": "p", "text": "t", "token_ids": [1]}] * 2
    with ResultStore(db) as store:
        store.record_run(RunRecord("a", "a-ok", {}, {}, {}, outputs=outputs))
        store.record_run(RunRecord("a", "a-bad", {}, {}, {}, outputs=outputs, status="failed", error="x"))
        store.record_run(RunRecord("b", "b-bad", {}, {}, {}, outputs=outputs, status="failed", error="x"))
        assert store.delete_runs(experiment="a", status="failed") == 1
        assert sorted(k for k, in _sqlite(db, "SELECT run_key FROM runs")) == ["a-ok", "b-bad"]
        assert store.delete_runs(status="failed") == 1
        assert _sqlite(db, "SELECT run_key FROM runs") == [("a-ok",)]
        assert _sqlite(db, "SELECT COUNT(*) FROM outputs") == [(2,)]  # the deleted runs' outputs went too
        assert store.delete_runs() == 1
        assert _sqlite(db, "SELECT COUNT(*) FROM runs") == [(0,)]
        assert _sqlite(db, "SELECT COUNT(*) FROM outputs") == [(0,)]


def test_a_metric_named_like_a_param_gets_a_column_of_its_own(tmp_path):
    with ResultStore(tmp_path / "m.db") as store:
        store.record_run(RunRecord("exp", "k", {"engine.block_size": 16, "score": "param"},
                                   {"score": 0.5, "repeat": 9.0}, {}, repeat=1))
        row = store.dataframe().iloc[0]
    assert row["score"] == "param" and row["metric.score"] == 0.5
    assert row["repeat"] == 1 and row["metric.repeat"] == 9.0


def test_storing_a_run_keeps_its_experiment_spec(tmp_path):
    db = tmp_path / "e.db"

    def specs():
        return [(i, json.loads(spec)) for i, spec in _sqlite(db, "SELECT id, spec FROM experiments")]

    with ResultStore(db) as store:
        exp_id = store.ensure_experiment("exp", {"grid": {"engine.block_size": [16]}})
        store.record_run(RunRecord("exp", "k", {}, {}, {}))
        assert specs() == [(exp_id, {"grid": {"engine.block_size": [16]}})]
        assert store.ensure_experiment("exp", {"repeats": 2}) == exp_id
    assert specs() == [(exp_id, {"repeats": 2})]


def test_a_newer_schema_and_a_bad_status_are_refused(tmp_path):
    db = tmp_path / "v.db"
    with ResultStore(db) as store, pytest.raises(ValueError, match="status='running' is invalid"):
        store.record_run(RunRecord("exp", "k", {}, {}, {}, status="running"))
    assert _sqlite(db, "SELECT COUNT(*) FROM runs") == [(0,)]
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE pagedlab_meta SET value = '2' WHERE key = 'schema_version'")
    with pytest.raises(ValueError, match="schema version 2, newer than this pagedlab's 1"):
        ResultStore(db)


def test_a_write_holds_the_write_lock_from_its_begin(tmp_path):
    # BEGIN IMMEDIATE: a second writer waits on the busy timeout, where a deferred BEGIN would let
    # it in and fail one of the two when the first upgrades its read to a write (SQLite WAL)
    db = tmp_path / "lock.db"
    outcomes = []
    with ResultStore(db) as store, contextlib.closing(sqlite3.connect(db, timeout=0)) as other:
        other.isolation_level = None

        def probe(conn, cursor, statement, *args):
            if statement.lstrip().upper().startswith("SELECT") and not outcomes:  # record_run's first read
                try:
                    other.execute("BEGIN IMMEDIATE")
                    other.execute("ROLLBACK")
                    outcomes.append("free")
                except sqlite3.OperationalError as e:
                    outcomes.append(str(e))

        store.sa.event.listen(store.engine, "before_cursor_execute", probe)
        store.record_run(RunRecord("exp", "k", {}, {}, {}))
    assert outcomes == ["database is locked"]
    assert _sqlite(db, "SELECT run_key, status FROM runs") == [("k", "finished")]


def test_sqlite_syncs_every_commit(tmp_path):
    """synchronous = FULL (2): in WAL mode NORMAL (1) can lose the last commits, finished runs, on
    a power loss or OS crash; FULL syncs the WAL at each commit. Every connection gets it."""
    with ResultStore(tmp_path / "sync.db") as store:
        store.record_run(RunRecord("exp", "k", {}, {}, {}))
        with store._write() as writer, store.engine.connect() as reader:
            for conn in (writer, reader):
                assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_a_nul_character_is_stored_as_a_replacement_character(url):
    """PostgreSQL's text and jsonb cannot hold NUL (a byte-level BPE model can sample the token of
    byte 0, a scraped dataset can hold one): the run is stored on every database, with U+FFFD in
    its place, and the token ids exact, instead of an error that stopped the sweep at that run."""
    nul = {"prompt": "two plus\x00 two", "text": "four\x00", "token_ids": [0, 7], "reference": ["4\x00"]}
    with ResultStore(url) as store:
        store.ensure_experiment("exp", {"dataset": {"prompts": ["a\x00b"]}})
        rid = store.record_run(RunRecord("exp", "k", {"dataset.template": "Q:\x00{q}"}, {"m\x00": 1.0}, {},
                                         outputs=[nul], model="/models/tiny"))
        failed = store.record_run(RunRecord("exp", "f", {}, {}, {}, status="failed",
                                            error="ValueError: bad prompt 'a\x00b'"))
        run, out = store.get_run(rid), store.outputs(rid)[0]
        assert store.get_run(failed)["error"] == "ValueError: bad prompt 'a\ufffdb'"
        assert store.experiments()[0]["spec"] == {"dataset": {"prompts": ["a\ufffdb"]}}
    assert run["params"] == {"dataset.template": "Q:\ufffd{q}"} and run["metrics"] == {"m\ufffd": 1.0}
    assert (out["prompt"], out["text"], out["reference"]) == ("two plus\ufffd two", "four\ufffd", ["4\ufffd"])
    assert out["token_ids"] == [0, 7]


def test_parquet_keeps_a_flag_some_runs_lack_a_boolean(tmp_path):
    """A param or metric that some runs lack is null in Parquet, and the others keep their type:
    a flag stays a boolean (not the text "True" beside the text "nan"), numbers mixing ints and
    floats stay numbers; a column mixing really different types is text, with nulls kept."""
    pytest.importorskip("pyarrow")
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with ResultStore(url) as store:
        store.record_run(RunRecord("e", "k1", {"engine.enable_prefix_caching": True, "mixed": 1},
                                   {"throttled": False, "n": 1}, {}))
        store.record_run(RunRecord("e", "k2", {"mixed": "auto"}, {"n": 2.5}, {}))
        store.record_run(RunRecord("e", "k3", {}, {}, {}))
        store.export(tmp_path / "r.parquet")
    rows = pd.read_parquet(tmp_path / "r.parquet").to_dict("records")
    assert [r["engine.enable_prefix_caching"] for r in rows] == [True, None, None]
    assert [r["throttled"] for r in rows] == [False, None, None]
    assert rows[0]["n"] == 1.0 and rows[1]["n"] == 2.5 and pd.isna(rows[2]["n"])
    assert [r["mixed"] for r in rows[:2]] == ["1", "auto"] and pd.isna(rows[2]["mixed"])


def test_a_param_a_run_left_at_its_default_reads_the_value_it_ran_with(url):
    """``runs: [{sampling.top_k: 5}, {engine.block_size: 32}]``: each run stores only what its YAML
    sets, so ``engine.block_size`` was NaN for the first and ``groupby`` dropped it; it now reads
    the value the run's manifest recorded (old rows too), in every experiment on its own."""
    resolved = {"engine": {"block_size": 16}, "sampling": {"top_k": -1, "temperature": 1.0}}
    with ResultStore(url) as store:
        store.record_run(RunRecord("e", "k1", {"sampling.top_k": 5, "varied": ["sampling.top_k"]},
                                   {"bleu": 1.0}, {**resolved, "sampling": {"top_k": 5}}))
        store.record_run(RunRecord("e", "k2", {"engine.block_size": 32, "varied": ["engine.block_size"]},
                                   {"bleu": 2.0}, {**resolved, "engine": {"block_size": 32}}))
        store.record_run(RunRecord("e", "k3", {"engine.block_size": 32}, {"bleu": 3.0}, {}))
        store.record_run(RunRecord("f", "k4", {}, {"bleu": 4.0}, resolved))
    for manifest in (False, True):
        df = load_results(url, experiment="e", manifest=manifest)
        assert df["engine.block_size"].tolist() == [16, 32, 32]
        assert df["sampling.top_k"].tolist()[:2] == [5, -1] and pd.isna(df["sampling.top_k"][2])
        assert df.groupby("engine.block_size")["bleu"].sum().to_dict() == {16: 1.0, 32: 5.0}
    assert "engine.block_size" not in load_results(url, experiment="f").columns
    assert "sampling.temperature" not in load_results(url).columns
