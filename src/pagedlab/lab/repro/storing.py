"""Storing a check's result in the lab's results database, with its provenance."""

from __future__ import annotations

import uuid
from pathlib import Path

from pagedlab.lab.manifest import collect_manifest, config_hash, files_checksum, weight_files
from pagedlab.lab.repro.common import CheckResult
from pagedlab.lab.store import ResultStore, RunRecord
from pagedlab.loader import resolve_model_source


def model_manifest(model: str) -> dict:
    """Model path, config hash and weight checksum without loading the model (for the checks that
    load it themselves: precision, padding)."""
    try:
        source = resolve_model_source(str(model))
    except Exception as e:  # recorded, not raised
        return {"name": str(model), "error": str(e)}
    path = Path(source.path)
    original = getattr(source, "original_file", None)
    weights = weight_files(path, original)
    return {"name": str(model), "path": str(path.resolve()), "config_hash": config_hash(path),
            "original_file": str(original) if original else None,
            "weight_checksum": files_checksum(weights) if weights else None}


def store_result(result: CheckResult, url, llm=None, model: str | None = None, store=None,
                 experiment: str = "repro") -> int:
    """Store ``result`` in the results database at ``url`` (experiment "repro", one run per check,
    with the provenance manifest of ``llm`` when given); returns the run id. Metrics are the
    result's numbers plus ``differs`` (0/1); the verdict, summary and details go into
    ``params["repro.*"]`` and the manifest's ``repro`` section."""
    seeds = {"repro": result.params.get("seeds")} if "seeds" in result.params else None
    manifest = collect_manifest(llm, seeds=seeds,
                                extra={"repro": {"check": result.check, "verdict": result.verdict,
                                                 "summary": result.summary, "details": result.details}},
                                hash_weights=True)
    if model is None and llm is not None:
        model = str(llm.get_engine_info().config.model)
    if llm is None and model is not None:
        manifest["model"] = model_manifest(model)
    params = {"repro.check": result.check, "repro.verdict": result.verdict}
    params.update({f"repro.{k}": v for k, v in result.params.items()})
    metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float)) or v is None}
    metrics["differs"] = int(not result.same)
    rec = RunRecord(experiment=experiment, run_key=f"{experiment}:{result.check}:{uuid.uuid4().hex}",
                    params=params, metrics=metrics, manifest=manifest, model=model)
    own = store is None
    store = store or ResultStore(url)
    try:
        return store.record_run(rec)
    finally:
        if own:
            store.close()
