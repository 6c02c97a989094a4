"""Run keys and the weights a run reads: the key holds the weights' content checksums, so weights
rewritten at the same path (a fine-tune saved over its directory, an adapter trained again) make a
resumed sweep run again, even bytes of the same size under the old mtime, while a touch or a copy
of the same bytes keeps the run done; a run stored under the key from before the checksums counts
as done only over the weights its manifest recorded; a hub model id counts by the snapshot of it
the HF cache holds; a plan hashes each file once."""

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("yaml")
pytest.importorskip("sqlalchemy")

from huggingface_hub import constants as hub_constants

from hub_fixtures import write_hub_cache
from pagedlab.lab import manifest
from pagedlab.lab.experiments import expand_runs, experiment_from_dict, run_experiment
from pagedlab.lab.manifest import config_hash, files_checksum, weight_files
from pagedlab.lab.store import ResultStore
from pagedlab.lab.testing import make_tiny_model
from pagedlab.lora.random_adapter import write_random_adapter

ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 4 << 20}


def spec_of(model, engine=None, **extra):
    return experiment_from_dict({
        "name": "w", "model": model, "engine": {**ENGINE, **(engine or {})},
        "sampling": {"max_tokens": 2, "temperature": 0}, "dataset": {"prompts": ["the quick brown"]},
        "metrics": ["output_length"], "monitor": False, **extra})


def finished_rows(db) -> list[dict]:
    with ResultStore(db) as store:
        return store.runs(experiment="w", status="finished")


def test_a_resumed_sweep_runs_again_over_rewritten_weights_only(tmp_path):
    a, b = make_tiny_model(tmp_path / "a"), make_tiny_model(tmp_path / "b")
    spec = spec_of(str(a), grid={"model": [str(a), str(b)]})
    db = str(tmp_path / "r.db")
    assert len(run_experiment(spec, db=db, quiet=True).finished) == 2
    assert run_experiment(spec, db=db, quiet=True).skipped == 2  # nothing changed: nothing runs
    make_tiny_model(a, seed=1)  # a fine-tune saved over a's directory
    report = run_experiment(spec_of(str(a), grid={"model": [str(a), str(b)]}), db=db, quiet=True)
    assert report.skipped == 1 and len(report.finished) == 1
    rows = finished_rows(db)
    assert [r["model"] for r in rows] == [str(a), str(b), str(a)]
    old, new = rows[0]["manifest"], rows[2]["manifest"]
    assert old["model"]["weight_checksum"] != new["model"]["weight_checksum"]
    # the key holds the checksums the manifest records of the weights, and the manifest keeps them
    for recorded in (old, new):
        checksums = {name: recorded["model"][name] for name in ("config_hash", "weight_checksum")}
        assert recorded["experiment"]["weights"] == {"model": checksums}
    assert run_experiment(spec, db=db, quiet=True).skipped == 2


def test_the_key_follows_the_bytes_not_the_files_dates(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    same = shutil.copytree(model, tmp_path / "same")  # the same bytes, as another machine holds them
    spec, db = spec_of(str(model)), str(tmp_path / "r.db")
    run_experiment(spec, db=db, quiet=True)
    key = expand_runs(spec)[0].run_key
    weights = model / "model.safetensors"
    first = weights.stat()
    for f in model.iterdir():  # touched: a later mtime, the same bytes
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert weights.stat().st_mtime_ns != first.st_mtime_ns
    assert expand_runs(spec)[0].run_key == key and run_experiment(spec, db=db, quiet=True).skipped == 1
    for f in same.iterdir():  # the same bytes copied over the files: new mtimes again
        shutil.copyfile(f, model / f.name)
    assert weights.stat().st_mtime_ns not in (first.st_mtime_ns, first.st_mtime_ns + 10**9)
    assert expand_runs(spec)[0].run_key == key and run_experiment(spec, db=db, quiet=True).skipped == 1
    before = weights.stat()
    other = make_tiny_model(tmp_path / "other", seed=1)
    shutil.copyfile(other / "model.safetensors", weights)  # other bytes, the same size ...
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # ... under the old mtime
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert weights.read_bytes() != (same / "model.safetensors").read_bytes()
    assert expand_runs(spec)[0].run_key != key
    report = run_experiment(spec, db=db, quiet=True)
    assert report.skipped == 0 and len(report.finished) == 1
    old, new = (r["manifest"]["model"]["weight_checksum"] for r in finished_rows(db))
    assert old != new == files_checksum([other / "model.safetensors"])


def _store_under_the_path_only_key(db, run) -> None:
    with ResultStore(db) as store:
        assert store.rekey_runs({run.run_key: run.legacy_keys[-1]}) == 1


def test_a_run_from_before_the_checksums_is_done_only_over_the_weights_it_read(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "m")
    db = str(tmp_path / "r.db")
    run_experiment(spec_of(str(model)), db=db, quiet=True)
    run, = expand_runs(spec_of(str(model)))
    _store_under_the_path_only_key(db, run)
    os.utime(model / "model.safetensors")  # touched, not rewritten: the same bytes count as done
    run, = expand_runs(spec_of(str(model)))
    assert run_experiment(spec_of(str(model)), db=db, quiet=True).skipped == 1
    assert [r["run_key"] for r in finished_rows(db)] == [run.run_key]
    _store_under_the_path_only_key(db, run)
    make_tiny_model(model, seed=1)
    assert run_experiment(spec_of(str(model)), db=db, dry_run=True).skipped == 0
    assert "pending" in capsys.readouterr().out.splitlines()[-2]
    report = run_experiment(spec_of(str(model)), db=db, quiet=True)
    assert report.skipped == 0 and len(report.finished) == 1
    run, = expand_runs(spec_of(str(model)))
    assert [r["run_key"] for r in finished_rows(db)] == [run.legacy_keys[-1], run.run_key]


def test_an_adapter_is_keyed_by_its_weights_and_config(tmp_path):
    import torch

    from pagedlab.lora.adapter import load_adapter
    from pagedlab.lora.request import LoRARequest

    model, shapes = make_tiny_model(tmp_path / "m"), {"model.layers.0.self_attn.q_proj": (64, 64)}
    adapter = write_random_adapter(tmp_path / "sql", shapes, 4, 0, torch.float32)
    before, = expand_runs(spec_of(str(model), lora=[str(adapter)]))
    write_random_adapter(adapter, shapes, 4, 1, torch.float32)
    after, = expand_runs(spec_of(str(model), lora=[str(adapter)]))
    assert before.weights["model"] == after.weights["model"]
    # the checksum the manifest records of the adapter (``lora.weights_sha256``)
    loaded = load_adapter(LoRARequest("sql", 1, str(adapter)), 4, torch.float32)
    assert after.weights["lora"]["weights_sha256"] == loaded.sha256
    assert before.weights["lora"]["weights_sha256"] != loaded.sha256
    assert before.run_key != after.run_key
    write_random_adapter(adapter, shapes, 4, 1, torch.float32, lora_alpha=3)  # its scaling alone changes
    rescaled, = expand_runs(spec_of(str(model), lora=[str(adapter)]))
    assert rescaled.weights["lora"]["weights_sha256"] == after.weights["lora"]["weights_sha256"]
    assert rescaled.weights["lora"]["config"]["lora_alpha"] == 3 and rescaled.run_key != after.run_key


def _model_weights(snapshot: Path) -> dict:
    return {"config_hash": config_hash(snapshot), "weight_checksum": files_checksum(weight_files(snapshot))}


def test_a_hub_model_is_keyed_by_the_snapshot_the_hf_cache_holds(tmp_path, monkeypatch):
    cache, repo, db = tmp_path / "hub", "example-org/tiny-llama", str(tmp_path / "r.db")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))  # as huggingface_hub read it at import
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    uncached, = expand_runs(spec_of(repo))  # nothing to checksum: the key it has by name
    assert uncached.weights is None and uncached.run_key == uncached.legacy_keys[-1]
    first = write_hub_cache(cache, repo, make_tiny_model(tmp_path / "v1"), commit="1" * 40)
    assert len(run_experiment(spec_of(repo), db=db, quiet=True).finished) == 1
    run, = expand_runs(spec_of(repo))
    assert run.weights == {"model": _model_weights(first)} and run.run_key != uncached.run_key
    assert finished_rows(db)[0]["manifest"]["model"]["path"] == str(first.resolve())  # what the run loaded
    assert expand_runs(spec_of(repo))[0].run_key == run.run_key  # the same snapshot: the same key
    assert run_experiment(spec_of(repo), db=db, quiet=True).skipped == 1
    # stored under the key by name (run before it was cached, or before keys knew hub snapshots): done
    # over the snapshot it loaded
    _store_under_the_path_only_key(db, run)
    assert run_experiment(spec_of(repo), db=db, quiet=True).skipped == 1
    assert [r["run_key"] for r in finished_rows(db)] == [run.run_key]
    # a new download: a new commit of main, with other weights
    second = write_hub_cache(cache, repo, make_tiny_model(tmp_path / "v2", seed=1), commit="2" * 40)
    new, = expand_runs(spec_of(repo))
    assert new.weights == {"model": _model_weights(second)} and new.run_key != run.run_key
    report = run_experiment(spec_of(repo), db=db, quiet=True)
    assert report.skipped == 0 and len(report.finished) == 1
    assert finished_rows(db)[1]["manifest"]["model"]["path"] == str(second.resolve())
    # engine.revision picks the snapshot, as the engine does; dummy weights count by config.json
    pinned, = expand_runs(spec_of(repo, engine={"revision": "1" * 40}))
    assert pinned.weights == {"model": _model_weights(first)}
    dummy, = expand_runs(spec_of(repo, engine={"load_format": "dummy"}))
    assert dummy.weights == {"model": {"config_hash": config_hash(second)}}


def test_dummy_weights_count_by_config_and_a_draft_model_by_its_checksums(tmp_path):
    model, draft = make_tiny_model(tmp_path / "m"), make_tiny_model(tmp_path / "d")
    dummy, = expand_runs(spec_of(str(model), engine={"load_format": "dummy"}))
    assert dummy.weights == {"model": {"config_hash": config_hash(model)}}  # the weights are not read
    speculative = {"speculative_config": {"model": str(draft), "num_speculative_tokens": 2}}
    drafted, = expand_runs(spec_of(str(model), engine=speculative))
    assert drafted.weights["draft_model"] == {"config_hash": config_hash(draft),
                                              "weight_checksum": files_checksum(weight_files(draft))}
    make_tiny_model(model, seed=1)
    assert expand_runs(spec_of(str(model), engine={"load_format": "dummy"}))[0].run_key == dummy.run_key
    assert expand_runs(spec_of(str(model), engine=speculative))[0].run_key != drafted.run_key
    rekeyed, = expand_runs(spec_of(str(model), engine=speculative))
    make_tiny_model(draft, seed=1)
    assert expand_runs(spec_of(str(model), engine=speculative))[0].run_key != rekeyed.run_key


def test_a_plan_hashes_each_weight_file_once_and_a_resume_hashes_none(tmp_path, monkeypatch):
    model = make_tiny_model(tmp_path / "m")
    monkeypatch.setenv("PAGEDLAB_CACHE_DIR", str(tmp_path / "cache"))
    opened = []

    def counting_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(manifest, "open", counting_open, raising=False)
    spec, db = spec_of(str(model), grid={"sampling.max_tokens": [1, 2]}, repeats=2), str(tmp_path / "r.db")
    assert len(run_experiment(spec, db=db, quiet=True).finished) == 4
    # the keys' checksums and the four runs' manifests: each file read once (tokenizer files too)
    assert opened.count("model.safetensors") == 1 and len(opened) == len(set(opened))
    monkeypatch.setattr(manifest, "_DIGESTS", {})  # as in a new process: the digests cached on disk
    assert run_experiment(spec, db=db, quiet=True).skipped == 4
    assert opened.count("model.safetensors") == 1
    # a new process without a usable cache directory hashes the weights once for its keys, and its
    # runs' manifests take that digest
    monkeypatch.setattr(manifest, "_DIGESTS", {})
    monkeypatch.setenv("PAGEDLAB_CACHE_DIR", str(model / "config.json"))
    more = spec_of(str(model), grid={"sampling.max_tokens": [1, 2, 3]}, repeats=2)
    report = run_experiment(more, db=db, quiet=True)
    assert report.skipped == 4 and len(report.finished) == 2
    assert opened.count("model.safetensors") == 2
