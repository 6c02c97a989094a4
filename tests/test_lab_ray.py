"""``pagedlab run --ray`` on a local Ray cluster of two nodes (a head and a second raylet, one CPU
each, temp dirs under the test's path): the same stored runs and seeded outputs as the local
runner; a worker killed mid-sweep still leaves every run stored exactly once, a run it stored
failed with its own traceback; a killed driver resumes without repeating finished runs. The store
is SQLite (every node is on this host), and PostgreSQL too when PAGEDLAB_TEST_POSTGRES_URL is set
(CI)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("yaml")
pytest.importorskip("sqlalchemy")
ray = pytest.importorskip("ray")

from pagedlab.lab import cli as lab_cli  # noqa: E402
from pagedlab.lab.experiments import expand_runs, load_experiment, run_experiment  # noqa: E402
from pagedlab.lab.ray_runner import (check_store_reachable, group_resources,  # noqa: E402
                                     run_experiment_on_ray)
from pagedlab.lab.store import ResultStore  # noqa: E402
from pagedlab.lab.testing import make_tiny_model  # noqa: E402

# Under pytest-xdist (CI: -n 2 --dist loadgroup) the modules that start Ray or share the
# PostgreSQL database run on one worker, one after another.
pytestmark = pytest.mark.xdist_group("ray-and-postgres")
SRC = str(Path(__file__).resolve().parents[1] / "src")
POSTGRES_URL = os.environ.get("PAGEDLAB_TEST_POSTGRES_URL")
STORES = ["sqlite"] + (["postgresql"] if POSTGRES_URL else [])
QA = [{"question": "the quick brown", "answer": "fox"}, {"question": "two plus two is", "answer": "four"},
      {"question": "what is the capital of france", "answer": "paris"}]
EXPERIMENT = """
name: {name}
model: {model}
engine: {{device: cpu, dtype: float32, kv_cache_memory_bytes: 4194304}}
sampling: {{max_tokens: {max_tokens}, temperature: 0.8}}
dataset: {{path: {data}, prompt_field: question, reference_field: answer}}
grid: {{engine.seed: {seeds}, engine.block_size: [16, 32]{extra_grid}}}
monitor: false
"""


def _start_cluster(temp: str, attempts: int = 3):
    """A head and a second raylet, one CPU each. A raylet that is slow to register (a loaded
    machine: Ray waits 30 s) is retried with a fresh cluster."""
    from ray.cluster_utils import Cluster

    for attempt in range(attempts):
        nodes = Cluster()
        try:
            nodes.add_node(num_cpus=1, temp_dir=temp, include_dashboard=False)
            nodes.add_node(num_cpus=1, temp_dir=temp)
            return nodes
        except Exception:
            nodes.shutdown()
            if attempt == attempts - 1:
                raise


@pytest.fixture(scope="module")
def cluster():
    """One two-node cluster for the module (Ray start-up is slow)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix socket paths live under it
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", SRC)  # the raylets' workers import this checkout
        # Ray 2.60's cluster utilities write the head's address into $RAY_TMPDIR/ray (default
        # /tmp/ray), which nothing creates on a fresh machine: keep it inside this directory.
        env.setenv("RAY_TMPDIR", temp)
        os.makedirs(os.path.join(temp, "ray"), exist_ok=True)
        nodes = _start_cluster(temp)
        ray.init(address=nodes.address, runtime_env={"env_vars": {"PYTHONPATH": SRC}})
        yield nodes
        ray.shutdown()
        nodes.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _experiment(tmp_path, model_dir, seeds=(0, 1), max_tokens=4, extra_grid="") -> Path:
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in QA))
    path = tmp_path / "exp.yaml"
    path.write_text(textwrap.dedent(EXPERIMENT.format(name=f"ray-{uuid.uuid4().hex[:8]}", model=model_dir,
                                                      data=data, seeds=list(seeds), max_tokens=max_tokens,
                                                      extra_grid=extra_grid)))
    return path


def _url(store: str, tmp_path, name: str) -> str:
    return POSTGRES_URL if store == "postgresql" else f"sqlite:///{tmp_path / name}"


def _stored(url: str, experiment: str) -> dict:
    """run key -> (status, each output's token ids, exact_match) for every stored row."""
    with ResultStore(url) as store:
        runs = store.runs(experiment=experiment, status=None)
        keys = [r["run_key"] for r in runs]
        assert len(keys) == len(set(keys))
        return {r["run_key"]: (r["status"], [o["token_ids"] for o in store.outputs(r["run_id"])],
                               r["metrics"].get("exact_match")) for r in runs}


@pytest.mark.parametrize("store", STORES)
def test_a_sweep_on_two_nodes_stores_what_a_local_run_stores(cluster, tmp_path, model_dir, store):
    spec = load_experiment(_experiment(tmp_path, model_dir))
    local_url, ray_url = f"sqlite:///{tmp_path / 'local.db'}", _url(store, tmp_path, "ray.db")
    assert run_experiment(spec, db=local_url, quiet=True).ok
    report = run_experiment_on_ray(spec, db=ray_url, quiet=True)
    assert report.ok and len(report.finished) == 4 and len(report.model_loads) == 2
    local, on_ray = _stored(local_url, spec.name), _stored(ray_url, spec.name)
    assert on_ray == local and len(local) == 4
    assert {status for status, _, _ in on_ray.values()} == {"finished"}
    with ResultStore(ray_url) as results:
        hosts = {r["manifest"]["host"]["hostname"] for r in results.runs(experiment=spec.name)}
    assert len(hosts) == 1  # both raylets are this machine


def test_a_worker_killed_mid_sweep_is_retried_and_stores_each_run_once(cluster, tmp_path, model_dir, capsys):
    spec = load_experiment(_experiment(tmp_path, model_dir, seeds=(0,)))
    url = f"sqlite:///{tmp_path / 'ray.db'}"
    # the group's first worker SIGKILLs itself while committing its second run
    report = run_experiment_on_ray(spec, db=url, runtime_env={"env_vars": {
        "PYTHONPATH": SRC, "PAGEDLAB_FAULT": "store.mid_write:2"}})
    assert "the group's worker died 1 time(s) (WorkerCrashedError); retrying its 1 unfinished run(s)" in (
        capsys.readouterr().err)
    assert report.ok and len(report.finished) == 2
    stored = _stored(url, spec.name)
    assert sorted(stored) == sorted(r.run_key for r in expand_runs(spec))
    assert all(status == "finished" and len(outputs) == 3 for status, outputs, _ in stored.values())


def test_a_killed_driver_resumes_without_repeating_runs(cluster, tmp_path, model_dir, capsys):
    # two groups of six runs: the workers Ray kills some time after the driver dies cannot finish
    # the whole sweep in that time, so the kill lands mid-sweep
    path = _experiment(tmp_path, model_dir, seeds=(0, 1), max_tokens=12,
                       extra_grid=", sampling.temperature: [0.6, 0.7, 0.8]")
    spec = load_experiment(path)
    url = f"sqlite:///{tmp_path / 'ray.db'}"
    cmd = [sys.executable, "-m", "pagedlab.lab.cli", "run", str(path), "--db", url, "--ray", cluster.address]
    driver = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    survivors: dict = {}
    while not survivors and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        with contextlib.suppress(Exception):  # the database may not exist yet
            survivors = _stored(url, spec.name)
    driver.send_signal(signal.SIGKILL)
    driver.communicate(timeout=60)
    survivors = _stored(url, spec.name)
    assert 1 <= len(survivors) < 12, driver.returncode
    with ResultStore(url) as store:
        ids = {r["run_key"]: r["run_id"] for r in store.runs(experiment=spec.name)}
    assert lab_cli.main(["run", str(path), "--db", url, "--ray", cluster.address]) == 0
    skipped = len([k for k, v in survivors.items() if v[0] == "finished"])
    assert f"{skipped} of 12 runs already finished" in capsys.readouterr().err
    final = _stored(url, spec.name)
    assert sorted(final) == sorted(r.run_key for r in expand_runs(spec))
    with ResultStore(url) as store:
        assert ids.items() <= {r["run_key"]: r["run_id"] for r in store.runs(experiment=spec.name)}.items()


def test_a_sqlite_file_is_refused_when_the_cluster_spans_hosts():
    nodes = [{"NodeManagerAddress": f"10.0.0.{i}", "Alive": True} for i in (1, 2)]
    with pytest.raises(ValueError, match=r"local SQLite file, but the Ray cluster spans 2 hosts"):
        check_store_reachable("sqlite:////tmp/results.db", nodes)
    check_store_reachable("postgresql://u@db/results", nodes)
    check_store_reachable("sqlite:////tmp/results.db", nodes[:1] + [{"NodeManagerAddress": "10.0.0.2",
                                                                      "Alive": False}])


def test_a_group_asks_for_a_gpu_per_rank_or_a_cpu_per_rank_on_the_cpu(tmp_path, model_dir):
    spec = load_experiment(_experiment(tmp_path, model_dir), ["engine.device=auto",
                                                             "engine.tensor_parallel_size=2"])
    run = expand_runs(spec)[0]
    assert group_resources(run, cluster_has_gpus=True) == {"num_cpus": 1, "num_gpus": 2}
    assert group_resources(run, cluster_has_gpus=False) == {"num_cpus": 2, "num_gpus": 0}
    nested = expand_runs(load_experiment(_experiment(tmp_path, model_dir),
                                         ["engine.distributed_executor_backend=ray"]))[0]
    with pytest.raises(ValueError, match="would wait forever"):
        group_resources(nested, cluster_has_gpus=True)


def test_a_group_no_node_can_hold_is_stored_failed_not_left_pending(tmp_path, model_dir, monkeypatch):
    from pagedlab.lab.ray_runner import RayGroups
    from pagedlab.lab.runner import ExperimentReport, RunSession

    def never_submit(*args, **kwargs):
        raise AssertionError("submitted a task no node can hold: Ray keeps it pending forever")

    # two nodes of one CPU each (as the cluster fixture), a group of two CPU ranks
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeManagerAddress": "10.0.0.1", "Alive": True,
                                                "Resources": {"CPU": 1.0}}] * 2)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "remote", lambda fn: type("Task", (), {"options": never_submit}))
    spec = load_experiment(_experiment(tmp_path, model_dir, seeds=(0,)), ["engine.tensor_parallel_size=2"])
    runs = expand_runs(spec)
    url = f"sqlite:///{tmp_path / 'ray.db'}"
    with ResultStore(url) as store:
        report = ExperimentReport(spec.name, len(runs))
        RayGroups(url, 0, None)(RunSession(spec, store, report, quiet=True), [runs])
    assert len(report.failed) == 2 and "no node of the cluster has 2 CPU(s)" in report.failed[0][1]
    stored = _stored(url, spec.name)
    assert sorted(stored) == sorted(r.run_key for r in runs)
    assert {status for status, _, _ in stored.values()} == {"failed"}


def test_a_dead_worker_leaves_the_real_errors_of_its_failed_runs(cluster, tmp_path, model_dir):
    # max_model_len 4 cannot hold the prompts: a real error, stored with its traceback. Each worker
    # SIGKILLs itself while committing its second run. Attempt 1: (16, 4) fails, (16, 64) dies;
    # attempt 2: (16, 64) finishes, (32, 4) dies; attempt 3: (32, 4) fails, (32, 64) dies.
    spec = load_experiment(_experiment(tmp_path, model_dir, seeds=(0,),
                                       extra_grid=", engine.max_model_len: [4, 64]"))
    url = f"sqlite:///{tmp_path / 'ray.db'}"
    report = run_experiment_on_ray(spec, db=url, quiet=True, runtime_env={"env_vars": {
        "PYTHONPATH": SRC, "PAGEDLAB_FAULT": "store.mid_write:2"}})
    with ResultStore(url) as store:
        rows = {(r["params"]["engine.block_size"], r["params"]["engine.max_model_len"]): r
                for r in store.runs(experiment=spec.name, status=None)}
    assert rows[16, 64]["status"] == "finished" and report.finished == [rows[16, 64]["run_id"]]
    for key in ((16, 4), (32, 4)):
        message, _, trace = rows[key]["error"].partition("\n\n")
        assert rows[key]["status"] == "failed" and "max_model_len is 4" in message
        assert trace.startswith("Traceback (most recent call last):")
    assert rows[32, 64]["error"] == "the group's worker died 3 time(s) (WorkerCrashedError)"
    errors = sorted(error for _, error in report.failed)
    assert len(errors) == 3 and errors[2] == rows[32, 64]["error"]
    assert all("max_model_len is 4" in error for error in errors[:2])
