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
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import inspect
import itertools
import json
import logging
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SECTIONS = ("engine", "sampling", "dataset", "benchmark")
TOP_LEVEL_KEYS = ("name", "description", "model", "engine", "sampling", "dataset", "benchmark", "grid", "runs",
                  "repeats", "seeds", "metrics", "monitor", "store_outputs")
DATASET_KEYS = ("path", "format", "prompts", "prompt_field", "reference_field", "template", "chat", "system",
                "limit")
BENCHMARK_KEYS = ("batch_size", "input_len", "output_len", "num_prompts", "warmup", "use_beam_search",
                  "beam_width", "temperature", "detokenize")
BENCHMARK_DEFAULTS = {"input_len": 512, "output_len": 128, "num_prompts": None, "warmup": 1,
                      "use_beam_search": False, "beam_width": 4, "temperature": 0.0, "detokenize": True}
# Engine settings that need new weights (a new LLM); the others change through set_model_args.
WEIGHT_LEVEL_KEYS = ("model", "tokenizer", "dtype", "quantization", "tensor_parallel_size", "load_format",
                     "trust_remote_code", "device", "seed", "attention_backend")
DEFAULT_METRICS = {"dataset": ["output_length", "throughput", "latency", "memory"],
                   "benchmark": ["throughput", "latency", "memory"]}


class ExperimentError(ValueError):
    """A malformed experiment: the message names the file, the line and the key path."""


# ---- YAML with line numbers -----------------------------------------------------------------------
def _yaml():
    try:
        import yaml
    except ImportError:
        raise ImportError("experiments from YAML need PyYAML: pip install pyyaml") from None
    return yaml


def parse_yaml(text: str, filename: str = "<string>") -> tuple[Any, dict[tuple, int]]:
    """The YAML document as Python data, and the 1-based line of every key path in it."""
    yaml = _yaml()
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise ExperimentError(f"{filename}: the file is empty: an experiment needs at least model and "
                                  "a dataset or benchmark")
        lines: dict[tuple, int] = {}

        def walk(n, path):
            lines.setdefault(path, n.start_mark.line + 1)
            if isinstance(n, yaml.MappingNode):
                loader.flatten_mapping(n)
                out = {}
                for key_node, value_node in n.value:
                    key = loader.construct_object(key_node, deep=True)
                    if not isinstance(key, (str, int, float, bool)) or key is None:
                        raise ExperimentError(f"{filename}:{key_node.start_mark.line + 1}: "
                                              f"{_dotted(path) or 'top level'}: keys must be strings")
                    if key in out:
                        raise ExperimentError(f"{filename}:{key_node.start_mark.line + 1}: "
                                              f"{_dotted(path + (key,))}: the key appears twice")
                    lines[path + (key,)] = key_node.start_mark.line + 1
                    out[key] = walk(value_node, path + (key,))
                return out
            if isinstance(n, yaml.SequenceNode):
                return [walk(item, path + (i,)) for i, item in enumerate(n.value)]
            return loader.construct_object(n, deep=True)

        return walk(node, ()), lines
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark is not None else filename
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        raise ExperimentError(f"{where}: malformed YAML: {problem}" + (f" ({context})" if context else "")) from None
    finally:
        loader.dispose()


def _dotted(path: tuple) -> str:
    return ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in path).replace(".[", "[")


# ---- the spec -------------------------------------------------------------------------------------
@dataclass
class ExperimentSpec:
    """A validated experiment. ``base`` holds the resolved sections: model (str), engine, sampling,
    dataset or benchmark (dicts); ``grid`` maps dotted keys to value lists; ``runs`` is a list of
    {dotted key: value} overrides."""

    name: str
    base: dict
    grid: dict[str, list] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)
    repeats: int = 1
    seeds: list[int] | None = None
    metrics: list[str] = field(default_factory=list)
    monitor_interval: float | None = 1.0
    store_outputs: bool = True
    description: str | None = None
    path: Path | None = None
    lines: dict[tuple, int] = field(default_factory=dict, repr=False)

    @property
    def workload(self) -> str:
        return "benchmark" if self.base.get("benchmark") is not None else "dataset"

    @property
    def filename(self) -> str:
        return str(self.path) if self.path and self.path.name != "<dict>" else "<experiment>"

    def where(self, *path) -> str:
        """``file:line: key.path`` for error messages (the nearest enclosing key with a line)."""
        p = tuple(path)
        while p and p not in self.lines:
            p = p[:-1]
        line = self.lines.get(p)
        loc = f"{self.filename}:{line}" if line else self.filename
        return f"{loc}: {_dotted(tuple(path))}" if path else loc

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, **self.base, "grid": self.grid,
                "runs": self.runs, "repeats": self.repeats, "seeds": self.seeds, "metrics": self.metrics,
                "monitor": {"interval": self.monitor_interval} if self.monitor_interval else False,
                "store_outputs": self.store_outputs, "file": str(self.path) if self.path else None}


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> ExperimentSpec:
    """Read and validate an experiment file; ``overrides`` are ``key.path=value`` strings (YAML
    values) applied on top, e.g. ``engine.device=cpu`` or ``repeats=1``."""
    path = Path(path)
    if not path.is_file():
        raise ExperimentError(f"experiment file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    data, lines = parse_yaml(text, str(path))
    if overrides:
        data = _apply_overrides(data, overrides, str(path))
    return validate_experiment(data, lines, path)


def experiment_from_dict(data: dict, base_dir: str | Path | None = None) -> ExperimentSpec:
    """Validate an experiment given as Python data (relative paths resolve against ``base_dir``)."""
    fake = Path(base_dir or ".") / "<dict>"
    return validate_experiment(data, {}, fake)


def _apply_overrides(data, overrides: list[str], filename: str):
    yaml = _yaml()
    if not isinstance(data, dict):
        return data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ExperimentError(f"--set {item!r} is invalid: write KEY=VALUE, e.g. engine.device=cpu")
        value = yaml.safe_load(raw) if raw.strip() else None
        key = key.strip()
        if key.startswith("grid.") and len(key) > 5:  # grid.engine.block_size=[16, 32]
            if not isinstance(data.setdefault("grid", {}), dict):
                raise ExperimentError(f"--set {item!r}: grid is not a mapping in {filename}")
            data["grid"][key[5:]] = value
            continue
        parts = key.split(".")
        if (parts[0] in SECTIONS and len(parts) == 2) or (len(parts) == 1 and parts[0] in TOP_LEVEL_KEYS):
            target = data
            for p in parts[:-1]:
                target = target.setdefault(p, {})
                if not isinstance(target, dict):
                    raise ExperimentError(f"--set {item!r}: {p} is not a mapping in {filename}")
            target[parts[-1]] = value
        else:
            raise ExperimentError(f"--set {item!r}: unknown key {key!r}; give a top-level key "
                                  f"({', '.join(TOP_LEVEL_KEYS)}), section.field such as engine.block_size, "
                                  "or grid.section.field")
    return data


def _engine_fields() -> list[str]:
    from pagedlab.llm import LLM

    return [p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "model")]


def _sampling_fields() -> list[str]:
    from pagedlab.sampling_params import SamplingParams

    return [f.name for f in dataclasses.fields(SamplingParams)]


def _allowed_fields(section: str) -> list[str]:
    return {"engine": _engine_fields, "sampling": _sampling_fields,
            "dataset": lambda: list(DATASET_KEYS), "benchmark": lambda: list(BENCHMARK_KEYS)}[section]()


def validate_experiment(data, lines: dict, path: Path) -> ExperimentSpec:
    spec = ExperimentSpec(name="", base={}, path=path, lines=lines)
    err = spec.where

    if not isinstance(data, dict):
        raise ExperimentError(f"{spec.filename}: an experiment is a mapping of keys "
                              f"({', '.join(TOP_LEVEL_KEYS)}), not a {type(data).__name__}")
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise ExperimentError(f"{err(key)}: unknown key; allowed top-level keys: {', '.join(TOP_LEVEL_KEYS)}")

    name = data.get("name", path.stem if path.name != "<dict>" else None)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][\w.\-]{0,127}", name):
        raise ExperimentError(f"{err('name')}: name={name!r} is invalid: give a name of letters, digits, "
                              "'_', '-' or '.' (it identifies the experiment in the results database)")
    spec.name = name
    desc = data.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ExperimentError(f"{err('description')}: must be a string")
    spec.description = desc

    # model
    if "model" not in data:
        raise ExperimentError(f"{spec.filename}: model is missing: give a local HF directory, a .gguf file "
                              "or an embedded model name")
    spec.base["model"] = _resolve_model(data["model"], spec, ("model",))

    # sections
    for section in SECTIONS:
        value = data.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ExperimentError(f"{err(section)}: must be a mapping of "
                                  f"{'fields' if section != 'dataset' else 'dataset settings'}")
        allowed = _allowed_fields(section)
        for key in value:
            if key not in allowed:
                raise ExperimentError(f"{err(section, key)}: unknown {section} key {key!r}; allowed: "
                                      f"{', '.join(allowed)}")
        if section == "engine" and "model" in value:
            raise ExperimentError(f"{err(section, 'model')}: give the model at the top level (model: ...)")
    spec.base["engine"] = dict(data.get("engine") or {})
    spec.base["sampling"] = dict(data.get("sampling") or {})
    has_dataset, has_bench = data.get("dataset") is not None, data.get("benchmark") is not None
    if has_dataset == has_bench:
        raise ExperimentError(f"{spec.filename}: give exactly one workload: dataset (prompts from a file or "
                              "inline) or benchmark (random prompts of fixed lengths)"
                              + (", not both" if has_dataset else ""))
    spec.base["dataset"] = dict(data["dataset"]) if has_dataset else None
    spec.base["benchmark"] = {**BENCHMARK_DEFAULTS, **data["benchmark"]} if has_bench else None
    if has_bench and "batch_size" not in data["benchmark"] and "benchmark.batch_size" not in (data.get("grid") or {}):
        raise ExperimentError(f"{err('benchmark')}: batch_size is missing (one integer per run; sweep it with "
                              "grid: {benchmark.batch_size: [4, 8, 16]})")
    if has_dataset:
        ds = spec.base["dataset"]
        if ("path" in ds) == ("prompts" in ds):
            raise ExperimentError(f"{err('dataset')}: give exactly one of dataset.path (a JSONL, CSV or JSON "
                                  "file) and dataset.prompts (an inline list)")

    # grid and runs
    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise ExperimentError(f"{err('grid')}: must be a mapping of dotted keys to lists of values, "
                              "e.g. engine.block_size: [16, 32]")
    for key, values in grid.items():
        _check_override_key(spec, key, ("grid", key))
        if not isinstance(values, list) or not values:
            raise ExperimentError(f"{err('grid', key)}: must be a non-empty list of values")
        spec.grid[key] = [_resolve_model(v, spec, ("grid", key, i)) if key == "model" else v
                          for i, v in enumerate(values)]
    runs = data.get("runs") or []
    if not isinstance(runs, list):
        raise ExperimentError(f"{err('runs')}: must be a list of mappings of dotted keys to values")
    for j, run in enumerate(runs):
        if not isinstance(run, dict) or not run:
            raise ExperimentError(f"{err('runs', j)}: each run is a non-empty mapping of dotted keys to values, "
                                  "e.g. {engine.max_num_seqs: 8}")
        flat = {}
        for key, value in run.items():
            if key in SECTIONS and isinstance(value, dict):  # nested form: {engine: {block_size: 32}}
                for sub, v in value.items():
                    flat[f"{key}.{sub}"] = v
                    spec.lines.setdefault(("runs", j, f"{key}.{sub}"), lines.get(("runs", j, key, sub), 0))
            else:
                flat[key] = value
        for key in flat:
            _check_override_key(spec, key, ("runs", j, key))
        if "model" in flat:
            flat["model"] = _resolve_model(flat["model"], spec, ("runs", j, "model"))
        spec.runs.append(flat)

    # repeats and seeds
    repeats, seeds = data.get("repeats"), data.get("seeds")
    if seeds is not None:
        if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool)
                                                               for s in seeds):
            raise ExperimentError(f"{err('seeds')}: must be a non-empty list of integers, one per repeat")
        if repeats is not None and repeats != len(seeds):
            raise ExperimentError(f"{err('seeds')}: {len(seeds)} seeds for repeats={repeats}: give one seed per repeat")
        spec.seeds = list(seeds)
        repeats = len(seeds)
    if repeats is None:
        repeats = 1
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ExperimentError(f"{err('repeats')}: repeats={repeats!r} is invalid: give an integer >= 1")
    spec.repeats = repeats

    # metrics
    metrics = data.get("metrics", DEFAULT_METRICS[spec.workload])
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise ExperimentError(f"{err('metrics')}: must be a list of metric names: {', '.join(METRICS)}")
    for i, m in enumerate(metrics):
        if m not in METRICS:
            raise ExperimentError(f"{err('metrics', i)}: unknown metric {m!r}; available metrics: "
                                  f"{', '.join(METRICS)}")
        if spec.workload not in METRICS[m].workloads:
            raise ExperimentError(f"{err('metrics', i)}: metric {m!r} needs a dataset with references; a benchmark "
                                  f"workload measures {', '.join(DEFAULT_METRICS['benchmark'])}")
    spec.metrics = list(dict.fromkeys(metrics))

    monitor = data.get("monitor", True)
    if monitor is True or monitor is None:
        spec.monitor_interval = 1.0
    elif monitor is False:
        spec.monitor_interval = None
    elif isinstance(monitor, dict) and set(monitor) <= {"interval"} and isinstance(
            monitor.get("interval", 1.0), (int, float)) and monitor.get("interval", 1.0) > 0:
        spec.monitor_interval = float(monitor.get("interval", 1.0))
    else:
        raise ExperimentError(f"{err('monitor')}: give true, false or {{interval: SECONDS}} (seconds > 0)")
    store_outputs = data.get("store_outputs", True)
    if not isinstance(store_outputs, bool):
        raise ExperimentError(f"{err('store_outputs')}: must be true or false")
    spec.store_outputs = store_outputs

    expand_runs(spec)  # validates every resolved run's engine and sampling settings and the datasets
    return spec


def _resolve_model(value, spec: ExperimentSpec, path: tuple) -> str:
    from pagedlab.loader.gguf import EMBEDDED_MODELS

    if not isinstance(value, str) or not value:
        raise ExperimentError(f"{spec.where(*path)}: model must be a path or an embedded model name, not {value!r}")
    if value in EMBEDDED_MODELS:
        return value
    p = Path(value).expanduser()
    if not p.is_absolute() and spec.path is not None:
        candidate = spec.path.parent / p
        p = candidate if candidate.exists() or not p.exists() else p
    if not p.exists():
        raise ExperimentError(f"{spec.where(*path)}: model {value!r} does not exist (looked for {p.resolve()}): "
                              f"give a local HF directory, a .gguf file or one of {sorted(EMBEDDED_MODELS)}")
    return str(p.resolve())


def _check_override_key(spec: ExperimentSpec, key, path: tuple) -> None:
    if not isinstance(key, str):
        raise ExperimentError(f"{spec.where(*path)}: keys are dotted strings such as engine.block_size")
    if key == "model":
        return
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name:
        raise ExperimentError(f"{spec.where(*path)}: unknown key {key!r}; sweep model or section.field with section "
                              f"one of {', '.join(SECTIONS)} (e.g. engine.block_size, sampling.temperature)")
    if spec.base.get(section) is None and section in ("dataset", "benchmark"):
        raise ExperimentError(f"{spec.where(*path)}: {key!r} sweeps the {section}, but the experiment has no "
                              f"{section} section")
    allowed = _allowed_fields(section)
    if name not in allowed:
        raise ExperimentError(f"{spec.where(*path)}: unknown {section} key {name!r}; allowed: {', '.join(allowed)}")


# ---- resolved runs --------------------------------------------------------------------------------
@dataclass
class ResolvedRun:
    """One run: the full config, what grid/runs changed, the repeat and its seed."""

    index: int
    config: dict  # model, engine, sampling, dataset | benchmark
    overrides: dict  # dotted key -> value set by grid / runs (the varied params)
    repeat: int
    seed: int
    run_key: str = ""
    dataset: "Dataset | None" = None

    @property
    def group_key(self) -> str:
        """Runs with the same group key share one loaded model."""
        engine = self.config["engine"]
        return json.dumps({"model": self.config["model"],
                           **{k: engine.get(k) for k in WEIGHT_LEVEL_KEYS if k in engine}},
                          sort_keys=True, default=str)

    @property
    def plan_args(self) -> dict:
        from pagedlab.config import PLAN_FIELDS

        return {k: v for k, v in self.config["engine"].items() if k in PLAN_FIELDS}

    @property
    def sampling_params(self) -> dict:
        return {**self.config["sampling"], "seed": self.seed} if self.config.get("dataset") is not None \
            else dict(self.config["sampling"])

    def params(self) -> dict:
        """The flat, dotted params stored with the run (everything that defines it)."""
        out = {"model": self.config["model"]}
        for section in SECTIONS:
            for key, value in (self.config.get(section) or {}).items():
                out[f"{section}.{key}"] = value
        if self.config.get("dataset") is not None:
            out["sampling.seed"] = self.seed
            out["dataset.sha256"] = self.dataset.sha256 if self.dataset else None
            out["dataset.num_prompts"] = len(self.dataset.items) if self.dataset else None
        else:
            out["benchmark.seed"] = self.seed
        out["repeat"] = self.repeat
        out["varied"] = sorted(self.overrides)
        return out

    def label(self) -> str:
        parts = [f"{k}={_short(v)}" for k, v in self.overrides.items()]
        return ", ".join(parts) or "base"


def _short(v) -> str:
    if isinstance(v, str) and ("/" in v or "\\" in v):
        return Path(v).name
    return str(v)


def expand_runs(spec: ExperimentSpec) -> list[ResolvedRun]:
    """Every run of ``spec`` in order: (runs x grid points) x repeats; validates each resolved
    engine and sampling config and loads (and checks) the datasets."""
    from pagedlab.config import EngineConfig
    from pagedlab.sampling_params import SamplingParams

    grid_points = [dict(zip(spec.grid, combo)) for combo in itertools.product(*spec.grid.values())] \
        if spec.grid else [{}]
    explicit = spec.runs or [{}]
    datasets: dict[str, Dataset] = {}
    resolved = []
    for j, run in enumerate(explicit):
        for point in grid_points:
            overrides = {**run, **point}
            config = _apply(spec.base, overrides)

            def where(section, name, _run=run, _point=point, _j=j):
                if not name:
                    return spec.where(section)
                key = f"{section}.{name}"
                if key in _point:
                    return spec.where("grid", key)
                if key in _run:
                    return spec.where("runs", _j, key)
                return spec.where(section, name)

            engine = config["engine"]
            try:
                cfg_kwargs = {k: v for k, v in engine.items() if k != "attention_backend"}
                EngineConfig(model=config["model"], **cfg_kwargs).validate()
            except (TypeError, ValueError) as e:
                raise ExperimentError(f"{where('engine', _field_of(e) or '')}: {e}") from None
            if engine.get("attention_backend", "auto") not in ("auto", "torch", "triton"):
                raise ExperimentError(f"{where('engine', 'attention_backend')}: attention_backend="
                                      f"{engine['attention_backend']!r} is invalid: choose auto, torch or triton")
            if config.get("dataset") is not None:
                ds_conf = config["dataset"]
                ds_key = json.dumps(ds_conf, sort_keys=True, default=str)
                if ds_key not in datasets:
                    datasets[ds_key] = load_dataset(ds_conf, spec, lambda name: where("dataset", name))
                dataset = datasets[ds_key]
                needs_refs = [m for m in spec.metrics if METRICS[m].needs_references]
                if needs_refs and not dataset.has_references:
                    raise ExperimentError(f"{spec.where('metrics')}: metrics {needs_refs} compare outputs with "
                                          f"references, but the dataset has none: set dataset.reference_field "
                                          "(or give reference: in inline prompts)")
                try:
                    SamplingParams(**config["sampling"])
                except (TypeError, ValueError) as e:
                    raise ExperimentError(f"{where('sampling', _field_of(e) or '')}: {e}") from None
            else:
                dataset = None
                _check_benchmark(config["benchmark"], lambda name: where("benchmark", name))
                if "max_num_seqs" in engine:
                    raise ExperimentError(f"{where('engine', 'max_num_seqs')}: a benchmark run sets max_num_seqs to "
                                          "its batch_size; sweep benchmark.batch_size (with benchmark.num_prompts "
                                          "for more requests than fit at once) instead")
                if config["sampling"]:
                    raise ExperimentError(f"{spec.where('sampling')}: a benchmark workload samples with "
                                          "benchmark.temperature (ignore_eos, fixed output_len); remove sampling")
            for r in range(spec.repeats):
                if spec.seeds is not None:
                    seed = spec.seeds[r]
                else:
                    base_seed = (config["sampling"].get("seed") if dataset is not None
                                 else config["benchmark"].get("seed")) or 0
                    seed = base_seed + r
                resolved.append(ResolvedRun(len(resolved), config, overrides, r, seed, dataset=dataset))
    for run in resolved:
        run.run_key = _run_key(spec.name, run)
    keys = [r.run_key for r in resolved]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        first = [r for r in resolved if r.run_key == dup]
        raise ExperimentError(f"{spec.filename}: runs {first[0].index} and {first[1].index} are identical "
                              f"({first[0].label()}, repeat {first[0].repeat}): remove the duplicate from "
                              "grid/runs")
    return resolved


def _field_of(e: Exception) -> str | None:
    m = re.match(r"(\w+)=", str(e))
    if m:
        return m.group(1)
    m = re.search(r"unexpected keyword argument '(\w+)'", str(e))
    return m.group(1) if m else None


def _apply(base: dict, overrides: dict) -> dict:
    config = {"model": base["model"]}
    for section in SECTIONS:
        config[section] = dict(base[section]) if base.get(section) is not None else None
    for key, value in overrides.items():
        if key == "model":
            config["model"] = value
        else:
            section, _, name = key.partition(".")
            config[section][name] = value
    return config


def _check_benchmark(b: dict, where: Callable[[str], str]) -> None:
    def positive(name, allow_none=False):
        v = b.get(name)
        if allow_none and v is None:
            return
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ExperimentError(f"{where(name)}: {name}={v!r} is invalid: give an integer >= 1")

    for name in ("batch_size", "input_len", "output_len", "beam_width"):
        positive(name)
    positive("num_prompts", allow_none=True)
    if not isinstance(b.get("warmup"), int) or b["warmup"] < 0:
        raise ExperimentError(f"{where('warmup')}: warmup={b.get('warmup')!r} is invalid: give an integer >= 0")
    if not isinstance(b.get("temperature"), (int, float)) or b["temperature"] < 0:
        raise ExperimentError(f"{where('temperature')}: temperature={b.get('temperature')!r} is invalid: give a "
                              "number >= 0")


def _run_key(name: str, run: ResolvedRun) -> str:
    ident = {"config": run.config, "repeat": run.repeat, "seed": run.seed,
             "dataset_sha256": run.dataset.sha256 if run.dataset else None}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return f"{name}:{digest}"


# ---- datasets -------------------------------------------------------------------------------------
@dataclass
class DatasetItem:
    prompt: str | None  # text, after the template
    prompt_token_ids: list[int] | None
    reference: list[str] | None


@dataclass
class Dataset:
    items: list[DatasetItem]
    chat: bool
    system: str | None
    sha256: str
    source: str

    @property
    def has_references(self) -> bool:
        return any(it.reference for it in self.items)


def load_dataset(conf: dict, spec: ExperimentSpec, where: Callable[[str], str]) -> Dataset:
    """Records from a JSONL/CSV/JSON file or an inline list, turned into prompts and references."""
    for key in ("prompt_field", "reference_field", "template", "system", "format"):
        if conf.get(key) is not None and not isinstance(conf[key], str):
            raise ExperimentError(f"{where(key)}: {key} must be a string")
    limit = conf.get("limit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ExperimentError(f"{where('limit')}: limit={limit!r} is invalid: give an integer >= 1")
    chat = conf.get("chat", False)
    if not isinstance(chat, bool):
        raise ExperimentError(f"{where('chat')}: chat must be true or false")

    if "path" in conf:
        records, source = _read_records(conf, spec, where)
    else:
        prompts = conf["prompts"]
        if not isinstance(prompts, list) or not prompts:
            raise ExperimentError(f"{where('prompts')}: must be a non-empty list of strings, token-id lists "
                                  "or mappings {prompt: ..., reference: ...}")
        records = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                records.append((f"prompts[{i}]", {"prompt": p}))
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                records.append((f"prompts[{i}]", {"prompt_token_ids": p}))
            elif isinstance(p, dict):
                records.append((f"prompts[{i}]", p))
            else:
                raise ExperimentError(f"{where('prompts')}[{i}]: {p!r} is not a prompt: give a string, a list of "
                                      "token ids or a mapping {prompt: ..., reference: ...}")
        source = "inline"
    if limit:
        records = records[:limit]
    if not records:
        raise ExperimentError(f"{where('path')}: the dataset has no records")

    prompt_field = conf.get("prompt_field", "prompt")
    template = conf.get("template")
    ref_field = conf.get("reference_field")
    items = []
    for loc, rec in records:
        if not isinstance(rec, dict):
            raise ExperimentError(f"{source} {loc}: a record must be an object/row of fields, not {rec!r}")
        ids = rec.get("prompt_token_ids")
        if ids is not None:
            if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
                raise ExperimentError(f"{source} {loc}: prompt_token_ids must be a non-empty list of integers")
            text = None
        elif template is not None:
            try:
                text = template.format(**rec)
            except KeyError as e:
                raise ExperimentError(f"{where('template')}: the template uses field {e.args[0]!r}, which "
                                      f"{source} {loc} lacks; its fields are {sorted(rec)}") from None
            except (IndexError, ValueError) as e:
                raise ExperimentError(f"{where('template')}: the template is not a valid format string: {e}") \
                    from None
        else:
            if prompt_field not in rec:
                raise ExperimentError(f"{where('prompt_field')}: {source} {loc} has no field {prompt_field!r}; its "
                                      f"fields are {sorted(rec)} (set dataset.prompt_field or dataset.template)")
            text = rec[prompt_field]
            if not isinstance(text, str):
                raise ExperimentError(f"{source} {loc}: field {prompt_field!r} must be a string, not {text!r}")
        if chat and text is None:
            raise ExperimentError(f"{where('chat')}: chat prompts are messages of text; {source} {loc} has token ids")
        ref = None
        key = ref_field or ("reference" if "reference" in rec else None)
        if key is not None:
            if key not in rec:
                raise ExperimentError(f"{where('reference_field')}: {source} {loc} has no field {key!r}; its fields "
                                      f"are {sorted(rec)}")
            raw = rec[key]
            if isinstance(raw, str):
                ref = [raw]
            elif isinstance(raw, list) and all(isinstance(r, str) for r in raw):
                ref = list(raw)
            elif raw is None:
                ref = None
            else:
                ref = [str(raw)]
        items.append(DatasetItem(text, list(ids) if ids is not None else None, ref))
    canonical = json.dumps([[it.prompt, it.prompt_token_ids, it.reference] for it in items]
                           + [chat, conf.get("system")], sort_keys=True)
    return Dataset(items, chat, conf.get("system"), hashlib.sha256(canonical.encode()).hexdigest(), source)


def _read_records(conf: dict, spec: ExperimentSpec, where) -> tuple[list[tuple[str, dict]], str]:
    raw = conf["path"]
    if not isinstance(raw, str) or not raw:
        raise ExperimentError(f"{where('path')}: must be a file path")
    p = Path(raw).expanduser()
    if not p.is_absolute() and spec.path is not None:
        p = spec.path.parent / p
    if not p.is_file():
        raise ExperimentError(f"{where('path')}: dataset file {raw!r} does not exist (looked for {p.resolve()})")
    fmt = (conf.get("format") or p.suffix.lstrip(".")).lower()
    fmt = {"jsonl": "jsonl", "ndjson": "jsonl", "csv": "csv", "tsv": "tsv", "json": "json"}.get(fmt)
    if fmt is None:
        raise ExperimentError(f"{where('format' if conf.get('format') else 'path')}: unknown dataset format for "
                              f"{p.name}: give dataset.format: jsonl, csv, tsv or json")
    name = p.name
    records = []
    try:
        if fmt == "jsonl":
            with open(p, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ExperimentError(f"dataset {name}:{lineno}: not valid JSON ({e.msg})") from None
                    records.append((f"line {lineno}", {"prompt": rec} if isinstance(rec, str) else rec))
        elif fmt in ("csv", "tsv"):
            with open(p, encoding="utf-8", newline="") as f:
                reader = csv.DictReader(f, delimiter="," if fmt == "csv" else "\t")
                for rowno, row in enumerate(reader, 2):
                    records.append((f"line {rowno}", dict(row)))
        else:
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ExperimentError(f"dataset {name}:{e.lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(data, list):
                raise ExperimentError(f"dataset {name}: a JSON dataset is a list of records")
            records = [(f"record {i}", {"prompt": r} if isinstance(r, str) else r) for i, r in enumerate(data)]
    except UnicodeDecodeError as e:
        raise ExperimentError(f"dataset {name}: not UTF-8 text ({e})") from None
    return records, f"dataset {name}"


# ---- metrics --------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """What a dataset run produced, for the metric functions."""

    outputs: list  # RequestOutput, in dataset order
    items: list[DatasetItem]
    elapsed_s: float
    stats: Any  # EngineStats
    peak_allocated_bytes: int | None = None

    @property
    def texts(self) -> list[str]:
        return [o.outputs[0].text for o in self.outputs]


@dataclass
class Metric:
    fn: Callable[[RunResult], dict]
    workloads: tuple[str, ...] = ("dataset",)
    needs_references: bool = False
    doc: str = ""


def _references(res: RunResult) -> tuple[list[str], list[list[str | None]]]:
    pairs = [(h, it.reference) for h, it in zip(res.texts, res.items) if it.reference]
    hyps = [h for h, _ in pairs]
    width = max(len(r) for _, r in pairs) if pairs else 0
    streams = [[r[k] if k < len(r) else None for _, r in pairs] for k in range(width)]
    return hyps, streams


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    import string

    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def _exact_match(res: RunResult) -> dict:
    scored = [normalize_answer(h) in {normalize_answer(r) for r in it.reference}
              for h, it in zip(res.texts, res.items) if it.reference]
    return {"exact_match": sum(scored) / len(scored) if scored else None}


def _bleu(res: RunResult) -> dict:
    import sacrebleu

    hyps, refs = _references(res)
    return {"bleu": sacrebleu.corpus_bleu(hyps, refs).score if hyps else None}


def _chrf(res: RunResult) -> dict:
    import sacrebleu

    hyps, refs = _references(res)
    return {"chrf": sacrebleu.corpus_chrf(hyps, refs).score if hyps else None}


def _output_length(res: RunResult) -> dict:
    lengths = [len(c.token_ids) for o in res.outputs for c in o.outputs]
    reasons = [c.finish_reason for o in res.outputs for c in o.outputs]
    return {"output_tokens": sum(lengths), "mean_output_tokens": sum(lengths) / len(lengths),
            "min_output_tokens": min(lengths), "max_output_tokens": max(lengths),
            "mean_output_chars": sum(len(c.text) for o in res.outputs for c in o.outputs) / len(lengths),
            "finished_by_length": reasons.count("length") / len(reasons)}


def _throughput(res: RunResult) -> dict:
    out_tokens = sum(len(c.token_ids) for o in res.outputs for c in o.outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in res.outputs)
    elapsed = max(res.elapsed_s, 1e-9)
    return {"elapsed_s": res.elapsed_s, "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
            "output_throughput": out_tokens / elapsed, "total_throughput": (prompt_tokens + out_tokens) / elapsed,
            "requests_per_s": len(res.outputs) / elapsed}


def _latency(res: RunResult) -> dict:
    from pagedlab.lab.bench import latency_stats

    ttft, tpot, e2e = [], [], []
    for o in res.outputs:
        m = o.metrics
        if m is None:
            continue
        if m.first_token_time is not None:
            ttft.append(m.first_token_time - m.arrival_time)
        n = len(o.outputs[0].token_ids)
        if n > 1 and m.first_token_time is not None and m.last_token_time is not None:
            tpot.append((m.last_token_time - m.first_token_time) / (n - 1))
        if m.finished_time is not None:
            e2e.append(m.finished_time - m.arrival_time)
    return {**latency_stats(ttft, "ttft"), **latency_stats(tpot, "tpot"), **latency_stats(e2e, "e2e")}


def _memory(res: RunResult) -> dict:
    s = res.stats
    per_block = s.kv_cache_bytes // s.num_kv_blocks if s.num_kv_blocks else 0
    return {"weight_bytes": s.weight_bytes, "kv_cache_bytes": s.kv_cache_bytes, "num_kv_blocks": s.num_kv_blocks,
            "kv_peak_blocks": s.peak_kv_blocks_used, "kv_peak_used_bytes": s.peak_kv_blocks_used * per_block,
            "kv_tokens_at_peak": s.kv_tokens_at_peak, "fragmentation_at_peak": s.fragmentation_at_peak,
            "num_preemptions": s.num_preemptions, "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "peak_allocated_bytes": res.peak_allocated_bytes}


METRICS: dict[str, Metric] = {
    "exact_match": Metric(_exact_match, needs_references=True,
                          doc="share of outputs equal to a reference after SQuAD normalization"),
    "bleu": Metric(_bleu, needs_references=True, doc="corpus BLEU (sacrebleu)"),
    "chrf": Metric(_chrf, needs_references=True, doc="corpus chrF (sacrebleu)"),
    "output_length": Metric(_output_length, doc="output tokens: total, mean, min, max; share cut by max_tokens"),
    "throughput": Metric(_throughput, workloads=("dataset", "benchmark"), doc="output and total tokens/s, requests/s"),
    "latency": Metric(_latency, workloads=("dataset", "benchmark"), doc="TTFT, TPOT, end-to-end P50/P90/P99 (ms)"),
    "memory": Metric(_memory, workloads=("dataset", "benchmark"),
                     doc="weights, KV cache allocated and used at peak, fragmentation, preemptions"),
}


# ---- running --------------------------------------------------------------------------------------
@dataclass
class ExperimentReport:
    """What ``run_experiment`` did."""

    name: str
    total: int
    skipped: int = 0
    finished: list[int] = field(default_factory=list)  # run ids stored
    failed: list[tuple[str, str]] = field(default_factory=list)  # (run label, error)
    model_loads: list[dict] = field(default_factory=list)  # {"group", "seconds"}
    replans: int = 0
    replan_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        from tqdm.auto import tqdm

        tqdm.write(msg, file=sys.stderr)


def run_experiment(spec: ExperimentSpec, db: str | None = None, dry_run: bool = False, quiet: bool = False,
                   llm_factory: Callable[..., Any] | None = None) -> ExperimentReport:
    """Execute the pending runs of ``spec`` and store each in the database at ``db``.

    Runs are grouped by their weight-level settings (model, dtype, quantization, device, ...):
    each group loads its model once, and runs within it switch plan-level settings through
    ``LLM.set_model_args``. ``dry_run`` prints the plan and executes nothing.
    ``llm_factory(model, **engine_kwargs)`` builds the LLM (default ``pagedlab.LLM``).
    """
    from pagedlab.lab.store import ResultStore

    t_start = time.perf_counter()
    runs = expand_runs(spec)
    report = ExperimentReport(spec.name, len(runs))
    if dry_run:
        done: set[str] = set()
        try:
            with ResultStore(db, create=False) as store:
                done = store.finished_keys(spec.name)
        except FileNotFoundError:
            pass  # no database yet: every run is pending
        except Exception as e:  # a dry run still shows the plan without a database
            _log(f"(results database not readable: {e})", quiet)
        print(format_plan(spec, runs, done))
        report.skipped = sum(r.run_key in done for r in runs)
        return report

    store = ResultStore(db)
    try:
        store.ensure_experiment(spec.name, spec.to_dict())
        done = store.finished_keys(spec.name)
        pending = [r for r in runs if r.run_key not in done]
        report.skipped = len(runs) - len(pending)
        if report.skipped:
            _log(f"{spec.name}: {report.skipped} of {len(runs)} runs already finished in {store._safe_url()}; "
                 "skipping them", quiet)
        groups: dict[str, list[ResolvedRun]] = {}
        for run in pending:
            groups.setdefault(run.group_key, []).append(run)
        bar = None
        if not quiet:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(pending), desc=spec.name, unit="run", dynamic_ncols=True, file=sys.stderr)
        try:
            for group_runs in groups.values():
                _run_group(spec, group_runs, store, report, quiet, bar, llm_factory)
        finally:
            if bar is not None:
                bar.close()
    finally:
        store.close()
    report.elapsed_s = time.perf_counter() - t_start
    _log(format_summary(report), quiet and report.ok)  # failures are reported even when quiet
    return report


def _run_group(spec, group_runs, store, report, quiet, bar, llm_factory) -> None:
    from pagedlab.config import PLAN_FIELDS
    from pagedlab.lab.store import RunRecord

    # Order runs so consecutive ones share plan settings (fewer re-plans); stable otherwise.
    group_runs = sorted(group_runs, key=lambda r: json.dumps(r.plan_args, sort_keys=True, default=str))
    first = group_runs[0]
    engine_kwargs = dict(first.config["engine"])
    weight_args = ", ".join(f"{k}={v}" for k, v in engine_kwargs.items() if k in WEIGHT_LEVEL_KEYS)
    label = f"{Path(first.config['model']).name} ({weight_args or 'defaults'})"
    _log(f"loading {label} for {len(group_runs)} run(s)", quiet)
    t0 = time.perf_counter()
    try:
        factory = llm_factory or _default_llm
        llm = factory(first.config["model"], **engine_kwargs)
    except Exception as e:
        msg = f"loading the model failed: {type(e).__name__}: {e}"
        for run in group_runs:
            _store_failure(spec, run, store, report, msg, None)
            if bar is not None:
                bar.update(1)
        _log(f"{label}: {msg}", quiet)
        return
    report.model_loads.append({"group": label, "seconds": time.perf_counter() - t0})
    try:
        for run in group_runs:
            if store.is_finished(run.run_key):  # another process finished it meanwhile
                report.skipped += 1
                if bar is not None:
                    bar.update(1)
                continue
            current = {k: getattr(llm.llm_engine.config, k) for k in PLAN_FIELDS}
            wanted = {k: run.plan_args.get(k, _plan_default(k)) for k in PLAN_FIELDS}
            changes = {k: v for k, v in wanted.items() if current[k] != v}
            replan_s = 0.0
            started = datetime.now(timezone.utc)
            try:
                if changes:
                    t = time.perf_counter()
                    llm.set_model_args(**changes)
                    replan_s = time.perf_counter() - t
                    report.replans += 1
                    report.replan_s += replan_s
                metrics, outputs, telemetry, samples, manifest = _execute(spec, run, llm)
                metrics["replan_s"] = replan_s
            except KeyboardInterrupt:
                raise
            except Exception as e:
                _store_failure(spec, run, store, report, f"{type(e).__name__}: {e}", llm, started,
                               traceback.format_exc())
                _log(f"run {run.index} ({run.label()}, repeat {run.repeat}) failed: {type(e).__name__}: {e}", quiet)
                if bar is not None:
                    bar.update(1)
                continue
            run_id = store.record_run(RunRecord(
                experiment=spec.name, run_key=run.run_key, params=run.params(), metrics=metrics, manifest=manifest,
                telemetry=telemetry, telemetry_samples=samples, outputs=outputs if spec.store_outputs else [],
                repeat=run.repeat, seed=run.seed, model=run.config["model"], status="finished",
                started_at=started, finished_at=datetime.now(timezone.utc)))
            report.finished.append(run_id)
            _log(f"run {run.index} ({run.label()}, repeat {run.repeat}, seed {run.seed}): "
                 f"{_headline(metrics)} -> run id {run_id}", quiet)
            if bar is not None:
                bar.update(1)
    finally:
        llm.close()


def _default_llm(model, **kwargs):
    from pagedlab.llm import LLM

    return LLM(model, **kwargs)


def _plan_default(name: str):
    from pagedlab.config import EngineConfig

    return {f.name: f.default for f in dataclasses.fields(EngineConfig)}[name]


def _headline(metrics: dict) -> str:
    keys = ("exact_match", "bleu", "chrf", "output_throughput", "ttft_p50_ms", "mean_output_tokens")
    parts = []
    for k in keys:
        v = metrics.get(k)
        if v is not None:
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return ", ".join(parts)


def _store_failure(spec, run, store, report, msg, llm, started=None, tb=None) -> None:
    from pagedlab.lab.manifest import collect_manifest
    from pagedlab.lab.store import RunRecord

    report.failed.append((f"run {run.index} ({run.label()}, repeat {run.repeat})", msg))
    try:
        manifest = collect_manifest(llm, sampling_params=run.sampling_params or None, hash_weights=False)
    except Exception:
        manifest = {}
    store.record_run(RunRecord(
        experiment=spec.name, run_key=run.run_key, params=run.params(), metrics={}, manifest=manifest,
        repeat=run.repeat, seed=run.seed, model=run.config["model"], status="failed",
        error=msg + ("\n\n" + tb if tb else ""), started_at=started))


def _execute(spec: ExperimentSpec, run: ResolvedRun, llm):
    """Run one resolved run on ``llm``: (metrics, outputs, telemetry summary, samples, manifest)."""
    from pagedlab.lab.manifest import collect_manifest

    if run.config.get("benchmark") is not None:
        return _execute_benchmark(spec, run, llm)
    import torch

    from pagedlab.sampling_params import SamplingParams

    params = SamplingParams(**run.sampling_params)
    ds = run.dataset
    engine = llm.llm_engine
    llm.reset_prefix_cache()
    engine.reset_stats()
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    mon = _start_monitor(spec)
    try:
        t0 = time.perf_counter()
        if ds.chat:
            conversations = [([{"role": "system", "content": ds.system}] if ds.system else [])
                             + [{"role": "user", "content": it.prompt}] for it in ds.items]
            outs = llm.chat(conversations, params, use_tqdm=False)
        else:
            prompts = [it.prompt_token_ids if it.prompt_token_ids is not None else it.prompt for it in ds.items]
            outs = llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize(engine.device)
        elapsed = time.perf_counter() - t0
    finally:
        telemetry, samples = _stop_monitor(mon)
    peak = int(torch.cuda.max_memory_allocated(engine.device)) if cuda else None
    result = RunResult(outs, ds.items, elapsed, llm.get_stats(), peak)
    metrics: dict = {}
    for name in spec.metrics:
        metrics.update(METRICS[name].fn(result))
    from pagedlab.lab.bench import telemetry_metrics

    metrics.update(telemetry_metrics(telemetry))
    outputs = []
    for it, o in zip(ds.items, outs):
        first = o.outputs[0]
        m = o.metrics
        extra = {}
        if m is not None and m.first_token_time is not None:
            extra["ttft_ms"] = (m.first_token_time - m.arrival_time) * 1000
        if m is not None and m.finished_time is not None:
            extra["e2e_ms"] = (m.finished_time - m.arrival_time) * 1000
        if len(o.outputs) > 1:
            extra["completions"] = [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                                    for c in o.outputs[1:]]
        outputs.append({"prompt": o.prompt if o.prompt is not None else it.prompt,
                        "prompt_tokens": len(o.prompt_token_ids), "reference": it.reference, "text": first.text,
                        "token_ids": list(first.token_ids), "finish_reason": first.finish_reason, **extra})
    manifest = collect_manifest(llm, sampling_params=params, seeds={"sampling": run.seed},
                                extra={"experiment": {"name": spec.name, "file": str(spec.path) if spec.path else None,
                                                      "run_key": run.run_key, "dataset_sha256": ds.sha256}})
    return metrics, outputs, telemetry, samples, manifest


def _execute_benchmark(spec, run, llm):
    from pagedlab.lab.bench import run_benchmark

    b = run.config["benchmark"]
    result = run_benchmark(llm, batch_size=b["batch_size"], input_len=b["input_len"], output_len=b["output_len"],
                           num_prompts=b["num_prompts"], use_beam_search=b["use_beam_search"], warmup=b["warmup"],
                           repeats=1, beam_width=b["beam_width"], temperature=b["temperature"], seed=run.seed,
                           detokenize=b["detokenize"], monitor=spec.monitor_interval is not None,
                           monitor_interval=spec.monitor_interval or 1.0)
    bench_run = result.runs[0]
    metrics = bench_run.metrics()
    manifest = dict(result.manifest)
    manifest["experiment"] = {"name": spec.name, "file": str(spec.path) if spec.path else None,
                              "run_key": run.run_key}
    return metrics, [], bench_run.telemetry, [], manifest


def _start_monitor(spec):
    if spec.monitor_interval is None:
        return None
    from pagedlab.lab.monitor import GPUMonitor

    return GPUMonitor(interval=spec.monitor_interval).start()


def _stop_monitor(mon) -> tuple[dict, list]:
    if mon is None:
        return {}, []
    summary = mon.stop()
    samples = list(mon.samples)
    mon.close()
    return summary, samples


# ---- printing -------------------------------------------------------------------------------------
def format_plan(spec: ExperimentSpec, runs: list[ResolvedRun], done: set[str]) -> str:
    groups = list(dict.fromkeys(r.group_key for r in runs))
    pending_groups = {r.group_key for r in runs if r.run_key not in done}
    lines = [f"experiment {spec.name}: {len(runs)} run(s), {sum(r.run_key not in done for r in runs)} pending, "
             f"{len(groups)} model group(s) ({len(pending_groups)} to load), workload: {spec.workload}, "
             f"metrics: {', '.join(spec.metrics)}"]
    if spec.workload == "dataset" and runs and runs[0].dataset is not None:
        ds = runs[0].dataset
        lines.append(f"dataset: {ds.source}, {len(ds.items)} prompt(s)"
                     f"{', with references' if ds.has_references else ''}{', chat' if ds.chat else ''}")
    header = ("#", "group", "params", "repeat", "seed", "status", "run key")
    rows = [(str(r.index), str(groups.index(r.group_key)), r.label(), str(r.repeat), str(r.seed),
             "done" if r.run_key in done else "pending", r.run_key.split(":")[-1][:12]) for r in runs]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)
    for i, g in enumerate(groups):
        lines.append(f"group {i}: {g}")
    return "\n".join(lines)


def format_summary(report: ExperimentReport) -> str:
    loads = sum(m["seconds"] for m in report.model_loads)
    lines = [f"{report.name}: {len(report.finished)} run(s) finished, {report.skipped} skipped (already done), "
             f"{len(report.failed)} failed in {report.elapsed_s:.1f} s; weights loaded {len(report.model_loads)} "
             f"time(s) ({loads:.1f} s), {report.replans} re-plan(s) ({report.replan_s:.2f} s)"]
    for label, error in report.failed:
        lines.append(f"  FAILED {label}: {error}")
    return "\n".join(lines)
