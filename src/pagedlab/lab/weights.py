"""What a run's key knows of the weights the run reads: their content.

A run names its model (and LoRA adapter, and draft model) by path, and the files at a path can be
rewritten: a fine-tune saved over its directory, an adapter trained again. A resumed sweep must
then run again rather than keep the results of the old weights, so the key holds the checksums
that the run's manifest records of them (``weights_checksums``): the model's ``config_hash`` and
``weight_checksum`` (config.json alone under ``load_format: dummy``, which reads no weights), the
adapter's ``config`` and ``weights_sha256``, the draft model's as the model's. The key follows the
bytes, not the files' dates: identical weights at one path on two machines that share one results
database give one key, a copy of the same bytes over the files or a ``touch`` runs nothing again,
and new bytes (even of the same size under the old mtime) run again. Each file is hashed once and then
costs a ``stat`` while it is unchanged (``pagedlab.lab.manifest.file_digest``), and a run's
manifest takes the digests its key took.

A hub model id (the model's or the draft's) counts by the snapshot the engine would load: the one
the HF cache (or ``engine.download_dir``) holds for ``engine.revision``, found offline
(``pagedlab.loader.hub.cached_hub_model``) and checksummed as a local directory, so a new download
of the model (a new commit of ``main``) runs again, and the same snapshot keeps the run done. A hub
model not in the cache yet, and an embedded model, keep the key they have by name; a run stored
under that key counts as done, once its snapshot is in the cache, over the snapshot it loaded
(``legacy_renames``).

The manifest records the checksums in the key as ``experiment.weights`` too. A run stored under
a key from before the checksums (which knew the path alone) still counts as done when the
checksums its manifest recorded are those in its key now (``legacy_renames``).
"""

from __future__ import annotations

import functools
from pathlib import Path

from pagedlab.lab.manifest import config_hash, file_digest, files_checksum, weight_files
from pagedlab.loader.gguf import EMBEDDED_MODELS
from pagedlab.loader.hub import cached_hub_model, is_hub_id
from pagedlab.lora.adapter import adapter_weights_file, read_adapter_config


def weights_checksums(configs: list[dict]) -> list[dict | None]:
    """For each run config, the checksums of the local weights the run reads, named as in its
    manifest: ``{"model": {"config_hash": ..., "weight_checksum": ...}, "lora": {"config": ...,
    "weights_sha256": ...}, "draft_model": {...}}`` (a GGUF file has its ``weight_checksum``
    alone); None for a run that reads none (an embedded model or a hub model id not in the HF
    cache, without a local adapter or draft). A hub model counts by the snapshot of it the engine
    would load from the cache. Each model and adapter is checksummed once however many configs
    name it."""
    where = functools.cache(_weights_path)
    model = functools.cache(_model_checksums)
    adapter = functools.cache(_adapter_checksums)
    return [_checksums(config, where, model, adapter) for config in configs]


def legacy_renames(store, experiment: str, runs: list) -> dict[str, str]:
    """``{old key: run key}`` for the stored runs of ``experiment`` to rekey (``ResultStore.rekey_runs``):
    every earlier key of ``runs``, except a finished run's whose manifest recorded checksums of its
    weights other than those in its key now (that run is to run again). Reads the store only."""
    renames = {old: r.run_key for r in runs for old in r.legacy_keys if old != r.run_key}
    checked = {old: r for r in runs if r.weights for old in r.legacy_keys if old != r.run_key}
    finished = store.finished_keys(experiment) & checked.keys()
    if not finished:
        return renames
    stored = store.runs(experiment=experiment, status="finished")
    manifests = {row["run_key"]: row["manifest"] or {} for row in stored if row["run_key"] in finished}
    for old in finished:
        if _recorded(manifests.get(old, {}), checked[old].weights) != checked[old].weights:
            del renames[old]
    return renames


def _checksums(config: dict, weights_path, model_checksums, adapter_checksums) -> dict | None:
    engine = config.get("engine") or {}
    dummy = engine.get("load_format") == "dummy"  # the draft model's weights are random then too
    download_dir = engine.get("download_dir")
    checksums = {}
    model = weights_path(config["model"], engine.get("revision"), download_dir, dummy)
    if model is not None:
        checksums["model"] = model_checksums(model, dummy)
    if config.get("lora") is not None:
        checksums["lora"] = adapter_checksums(config["lora"])
    # the engine loads a draft model at its default revision (``DraftModel.load``)
    draft = weights_path(_draft_model(engine), None, download_dir, dummy)
    if draft is not None:
        checksums["draft_model"] = model_checksums(draft, dummy)
    return checksums or None


def _model_checksums(path: Path, dummy: bool) -> dict:
    if path.is_file():  # a GGUF file: config and weights in one, so it counts under dummy too
        return {"weight_checksum": files_checksum(weight_files(path, path))}
    if dummy:
        return {"config_hash": config_hash(path)}
    return {"config_hash": config_hash(path), "weight_checksum": files_checksum(weight_files(path))}


def _adapter_checksums(path: str) -> dict:
    weights = adapter_weights_file(path)
    return {"config": read_adapter_config(path), "weights_sha256": file_digest(weights) if weights else None}


def _recorded(manifest: dict, weights: dict) -> dict:
    """The checksums ``manifest`` recorded, under the names ``weights`` has."""
    return {section: {name: (manifest.get(section) or {}).get(name) for name in checksums}
            for section, checksums in weights.items()}


def _weights_path(model: str | None, revision: str | None, download_dir: str | None,
                  dummy: bool) -> Path | None:
    """Where the engine would read ``model`` from without downloading: its local path, or the HF
    cache's snapshot of a hub model id (config.json alone needed under dummy weights); None for an
    embedded model and a hub model id not in the cache."""
    if model is None or model in EMBEDDED_MODELS:  # an embedded model comes with pagedlab itself
        return None
    path = Path(model).expanduser()
    if path.exists():
        return path
    return cached_hub_model(model, revision, download_dir, weights=not dummy) if is_hub_id(model) else None


def _draft_model(engine: dict) -> str | None:
    speculative = engine.get("speculative_config")
    return speculative.get("model") if isinstance(speculative, dict) else None
