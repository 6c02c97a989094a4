"""Run keys and the weights a run reads: weights rewritten at the same path (a fine-tune saved over
its directory, an adapter trained again) make a resumed sweep run again, unchanged weights are
skipped, and a run stored under the key from before weights were stamped counts as done only over
the weights its manifest recorded."""

import os

import pytest

pytest.importorskip("yaml")
pytest.importorskip("sqlalchemy")

from pagedlab.lab.experiments import expand_runs, experiment_from_dict, run_experiment
from pagedlab.lab.store import ResultStore
from pagedlab.lab.testing import make_tiny_model
from pagedlab.lora.random_adapter import write_random_adapter


def spec_of(model, **extra):
    return experiment_from_dict({
        "name": "w", "model": model,
        "engine": {"device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 4 << 20},
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
    # the provenance records the stamp the key was made of: each file's name, size and mtime
    stamp = {name: (size, mtime) for name, size, mtime in new["experiment"]["weights"]["model"]}
    st = (a / "model.safetensors").stat()
    assert stamp["model.safetensors"] == (st.st_size, st.st_mtime_ns) and "config.json" in stamp
    assert old["experiment"]["weights"] != new["experiment"]["weights"]
    assert run_experiment(spec, db=db, quiet=True).skipped == 2


def _store_under_the_unstamped_key(db, run) -> None:
    with ResultStore(db) as store:
        assert store.rekey_runs({run.run_key: run.legacy_keys[-1]}) == 1


def test_a_run_from_before_the_stamp_is_done_only_over_the_weights_it_read(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "m")
    db = str(tmp_path / "r.db")
    run_experiment(spec_of(str(model)), db=db, quiet=True)
    run, = expand_runs(spec_of(str(model)))
    _store_under_the_unstamped_key(db, run)
    os.utime(model / "model.safetensors")  # touched, not rewritten: the same bytes count as done
    run, = expand_runs(spec_of(str(model)))
    assert run_experiment(spec_of(str(model)), db=db, quiet=True).skipped == 1
    assert [r["run_key"] for r in finished_rows(db)] == [run.run_key]
    _store_under_the_unstamped_key(db, run)
    make_tiny_model(model, seed=1)
    assert run_experiment(spec_of(str(model)), db=db, dry_run=True).skipped == 0
    assert "pending" in capsys.readouterr().out.splitlines()[-2]
    report = run_experiment(spec_of(str(model)), db=db, quiet=True)
    assert report.skipped == 0 and len(report.finished) == 1
    run, = expand_runs(spec_of(str(model)))
    assert [r["run_key"] for r in finished_rows(db)] == [run.legacy_keys[-1], run.run_key]


def test_a_rewritten_adapter_changes_the_key_and_a_hub_model_keeps_its_own(tmp_path):
    import torch

    model = make_tiny_model(tmp_path / "m")
    adapter = write_random_adapter(tmp_path / "sql", {"model.layers.0.self_attn.q_proj": (64, 64)}, 4, 0,
                                   torch.float32)
    before, = expand_runs(spec_of(str(model), lora=[str(adapter)]))
    write_random_adapter(adapter, {"model.layers.0.self_attn.q_proj": (64, 64)}, 4, 1, torch.float32)
    after, = expand_runs(spec_of(str(model), lora=[str(adapter)]))
    assert before.weights["model"] == after.weights["model"]
    assert before.weights["lora"] != after.weights["lora"]
    assert before.run_key != after.run_key
    hub, = expand_runs(spec_of("example-org/tiny-llama"))  # no local files: the key is as before
    assert hub.weights is None and hub.run_key == hub.legacy_keys[-1]
