"""Experiments from YAML: a validated spec, expanded into runs, executed with the weights loaded
once per (model, dtype, quantization, ...) group, each run stored with its manifest.

See docs/lab.md for the schema. In short::

    name: block-size-sweep
    model: ./models/tiny                 # HF directory, .gguf file or embedded name
    engine: {dtype: float32, device: cpu, kv_cache_memory_bytes: 16777216}
    sampling: {temperature: 0, max_tokens: 32}
    dataset: {path: qa.jsonl, prompt_field: question, reference_field: answer,
              template: "Q: {question}\\nA:"}
    grid: {engine.block_size: [16, 32], sampling.temperature: [0, 0.7]}
    repeats: 2
    metrics: [exact_match, bleu, chrf, output_length, throughput, latency]

``load_experiment(path)`` parses and validates (errors name the file, line and key path),
``expand_runs(spec)`` gives the resolved runs, ``run_experiment(spec, db=...)`` executes the
pending ones: plan-level engine settings (block_size, max_num_seqs, ...) change through
``LLM.set_model_args`` and never reload the weights. A run is stored in one transaction when it
ends, so an interrupted experiment resumes where it stopped: rerunning skips finished runs.

This module gathers the public names of the pieces, which live in ``pagedlab.lab.schema`` (the keys, YAML with
line numbers), ``pagedlab.lab.spec`` (validation), ``pagedlab.lab.runs`` (expansion),
``pagedlab.lab.datasets``, ``pagedlab.lab.metrics`` (the metric registry) and
``pagedlab.lab.runner`` (execution).
"""

from __future__ import annotations

from pagedlab.lab.datasets import DatasetItem
from pagedlab.lab.metrics import METRICS, RunResult
from pagedlab.lab.runner import run_experiment
from pagedlab.lab.runs import expand_runs
from pagedlab.lab.schema import ExperimentError
from pagedlab.lab.spec import experiment_from_dict, load_experiment

__all__ = ["METRICS", "DatasetItem", "ExperimentError", "RunResult", "expand_runs", "experiment_from_dict",
           "load_experiment", "run_experiment"]
