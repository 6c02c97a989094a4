"""The research lab: benchmarks with provenance, YAML experiments, a results database, GPU
telemetry, plots and an HTML report. Optional dependencies (pandas, SQLAlchemy, PyYAML, ...) are
imported only when the piece that needs them is used."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_results": "pagedlab.lab.store",
    "ResultStore": "pagedlab.lab.store",
    "RunRecord": "pagedlab.lab.store",
    "BenchmarkResult": "pagedlab.lab.bench",
    "BenchmarkRun": "pagedlab.lab.bench",
    "run_benchmark": "pagedlab.lab.bench",
    "collect_manifest": "pagedlab.lab.manifest",
    "diff_manifests": "pagedlab.lab.manifest",
    "GPUMonitor": "pagedlab.lab.monitor",
    "ExperimentError": "pagedlab.lab.schema",
    "ExperimentSpec": "pagedlab.lab.schema",
    "load_experiment": "pagedlab.lab.spec",
    "expand_runs": "pagedlab.lab.runs",
    "run_experiment": "pagedlab.lab.runner",
    "register_metric": "pagedlab.lab.metrics",
    "build_report": "pagedlab.lab.report",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedlab.lab' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return __all__
