"""What a run's key knows of the weights the run reads.

A run names its model (and LoRA adapter, and draft model) by path, and the files at a path can be
rewritten: a fine-tune saved over its directory, an adapter trained again. A resumed sweep must
then run again rather than keep the results of the old weights, so the key holds each file's name,
size and modification time (``weights_stamp``): a rewrite changes them, and taking them costs one
``stat`` a file where hashing a checkpoint would read gigabytes on every resume. The manifest
keeps the stamp (``experiment.weights``) beside the weights' full SHA-256 (``model.weight_checksum``).

A run stored under a key from before the stamp (which knew the path alone) still counts as done
when the checksums its manifest recorded are those of the files there now (``legacy_renames``).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from pagedlab.lab.manifest import config_hash, files_checksum, weight_files
from pagedlab.loader.gguf import EMBEDDED_MODELS
from pagedlab.lora.adapter import BIN_WEIGHTS_FILE, CONFIG_FILE, WEIGHTS_FILE


def weights_stamp(config: dict) -> dict | None:
    """``{"model": [[name, size, mtime_ns], ...], "lora": ..., "draft_model": ...}``: the local
    files the run of ``config`` reads its weights (and the model's config.json) from; None when
    it reads none (a hub model id or an embedded model, without a local adapter or draft)."""
    engine = config.get("engine") or {}
    stamp = {}
    model = _local_model(config["model"])
    if model is not None:
        stamp["model"] = _stat(_model_files(model, dummy=engine.get("load_format") == "dummy"))
    if config.get("lora") is not None:
        adapter = Path(config["lora"])
        stamp["lora"] = _stat([adapter / CONFIG_FILE, *weight_files(adapter)])
    draft = _local_model(_draft_model(engine))
    if draft is not None:
        stamp["draft_model"] = _stat(_model_files(draft, dummy=False))
    return stamp or None


def legacy_renames(store, experiment: str, runs: list) -> dict[str, str]:
    """``{old key: run key}`` for the stored runs of ``experiment`` to rekey (``ResultStore.rekey_runs``):
    every earlier key of ``runs``, except a finished run's whose run reads local weights that are
    no longer those its manifest recorded (that run is to run again). Reads the store only."""
    renames = {old: r.run_key for r in runs for old in r.legacy_keys if old != r.run_key}
    stamped = {old: r for r in runs if r.weights for old in r.legacy_keys if old != r.run_key}
    finished = store.finished_keys(experiment) & stamped.keys()
    if not finished:
        return renames
    stored = store.runs(experiment=experiment, status="finished")
    manifests = {row["run_key"]: row["manifest"] for row in stored if row["run_key"] in finished}
    checksum = functools.cache(_current_checksum)
    for old in finished:
        if not _same_weights(stamped[old].config, manifests.get(old) or {}, checksum):
            del renames[old]
    return renames


def _local_model(model: str | None) -> Path | None:
    if model is None or model in EMBEDDED_MODELS:  # an embedded model comes with pagedlab itself
        return None
    path = Path(model).expanduser()
    return path if path.exists() else None  # else a hub model id


def _draft_model(engine: dict) -> str | None:
    speculative = engine.get("speculative_config")
    return speculative.get("model") if isinstance(speculative, dict) else None


def _model_files(path: Path, dummy: bool) -> list[Path]:
    if path.is_file():  # a GGUF file: weights and config in one
        return [path]
    return [path / "config.json", *([] if dummy else weight_files(path))]


def _stat(paths: list[Path]) -> list[list]:
    out = []
    for p in paths:
        if p.is_file():
            st = p.stat()
            out.append([p.name, st.st_size, st.st_mtime_ns])
    return out


def _same_weights(config: dict, manifest: dict, checksum) -> bool:
    """Whether the local weights ``config`` names are those of the run whose manifest is given."""
    model = _local_model(config["model"])
    if model is not None:
        recorded = manifest.get("model") or {}
        dummy = (config.get("engine") or {}).get("load_format") == "dummy"
        if model.is_dir() and recorded.get("config_hash") != config_hash(model):
            return False
        if not dummy and (recorded.get("weight_checksum") is None
                          or recorded["weight_checksum"] != checksum("model", str(model))):
            return False
    draft = _local_model(_draft_model(config.get("engine") or {}))
    if draft is not None:
        recorded = (manifest.get("draft_model") or {}).get("weight_checksum")
        if recorded is None or recorded != checksum("model", str(draft)):
            return False
    if config.get("lora") is not None:
        recorded = (manifest.get("lora") or {}).get("weights_sha256")
        if recorded is None or recorded != checksum("lora", config["lora"]):
            return False
    return True


def _current_checksum(kind: str, path: str) -> str | None:
    """The checksum the manifest records of the weights at ``path`` now: ``model.weight_checksum``
    (its per-file digests cached by path, size and mtime) or an adapter's ``weights_sha256``."""
    p = Path(path)
    if kind == "model":
        return files_checksum(weight_files(p, p if p.is_file() else None))
    weights = next((p / name for name in (WEIGHTS_FILE, BIN_WEIGHTS_FILE) if (p / name).is_file()), None)
    return hashlib.sha256(weights.read_bytes()).hexdigest() if weights is not None else None
