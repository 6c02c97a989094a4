"""The experiment spec: an experiment file read, validated and resolved into ``ExperimentSpec``.

Every error is an ``ExperimentError`` that names the file, the line and the key path
(``exp.yaml:10: grid.engine.block_size: block_size=17 is invalid: ...``). The keys each section
takes come from ``pagedlab.lab.schema``, the metric names from the registry of
``pagedlab.lab.metrics``; validation ends by expanding the runs, which checks every resolved
engine and sampling config and loads the datasets.
"""

from __future__ import annotations

import re
from pathlib import Path

from pagedlab.lab import schema
from pagedlab.lab.lora import LORA_KEY, resolve_adapter
from pagedlab.lab.metrics import DEFAULT_METRICS, METRICS
from pagedlab.lab.runs import expand_runs
from pagedlab.lab.schema import ExperimentError, ExperimentSpec
from pagedlab.loader.gguf import EMBEDDED_MODELS
from pagedlab.loader.hub import is_hub_id
from pagedlab.names import did_you_mean


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> ExperimentSpec:
    """Read and validate an experiment file; ``overrides`` are ``key.path=value`` strings (YAML
    values) applied on top, e.g. ``engine.device=cpu`` or ``repeats=1``."""
    path = Path(path)
    if not path.is_file():
        raise ExperimentError(f"experiment file {str(path)!r} does not exist")
    data, lines = schema.parse_yaml(path.read_text(encoding="utf-8"), str(path))
    if overrides:
        data = apply_set_overrides(data, overrides, str(path))
    return validate_experiment(data, lines, path)


def experiment_from_dict(data: dict, base_dir: str | Path | None = None) -> ExperimentSpec:
    """Validate an experiment given as Python data (relative paths resolve against ``base_dir``)."""
    return validate_experiment(data, {}, Path(base_dir or ".") / "<dict>")


def apply_set_overrides(data, overrides: list[str], filename: str):
    """``data`` with each ``--set KEY=VALUE`` applied (``grid.engine.block_size=[16, 32]`` sets a
    grid entry)."""
    yaml = schema.load_yaml_module()
    if not isinstance(data, dict):
        return data
    set_keys = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ExperimentError(f"--set {item!r} is invalid: write KEY=VALUE, e.g. engine.device=cpu")
        value = yaml.safe_load(raw) if raw.strip() else None
        key = key.strip()
        if key.startswith("grid.") and len(key) > 5:
            if data.get("grid") is None:  # absent, or a bare ``grid:`` (no grid)
                data["grid"] = {}
            if not isinstance(data["grid"], dict):
                raise ExperimentError(f"--set {item!r}: grid is not a mapping in {filename}")
            data["grid"][key[5:]] = value
            continue
        parts = key.split(".")
        section_field = parts[0] in schema.SECTIONS and len(parts) == 2
        if not (section_field or (len(parts) == 1 and parts[0] in schema.TOP_LEVEL_KEYS)):
            raise ExperimentError(f"--set {item!r}: unknown key {key!r}; give a top-level key "
                                  f"({', '.join(schema.TOP_LEVEL_KEYS)}), section.field such as "
                                  "engine.block_size, "
                                  "or grid.section.field")
        target = data
        for p in parts[:-1]:
            if target.get(p) is None:  # absent, or a bare ``engine:`` (no settings)
                target[p] = {}
            target = target[p]
            if not isinstance(target, dict):
                raise ExperimentError(f"--set {item!r}: {p} is not a mapping in {filename}")
        target[parts[-1]] = value
        set_keys[key] = item
    _check_set_keys_apply(data, set_keys)
    return data


def _check_set_keys_apply(data: dict, set_keys: dict[str, str]) -> None:
    """Refuse a ``--set section.field=VALUE`` (or ``model=``) that the grid or a run sets again:
    their values would replace it in every run it reaches, silently."""
    grid = data.get("grid") if isinstance(data.get("grid"), dict) else {}
    runs = data.get("runs") if isinstance(data.get("runs"), list) else []
    for key, item in set_keys.items():
        section, _, name = key.partition(".")
        in_runs = any(isinstance(run, dict) and (key in run or (
            name and isinstance(run.get(section), dict) and name in run[section])) for run in runs)
        if key in grid:
            raise ExperimentError(f"--set {item!r}: the grid sweeps {key}, whose values would replace this "
                                  f"one in every run; give the values to run with --set grid.{key}=[...]")
        if in_runs:
            raise ExperimentError(f"--set {item!r}: a run of runs: sets {key} itself, which would replace "
                                  "this value there; change it in the file's runs")


def validate_experiment(data, lines: dict, path: Path) -> ExperimentSpec:
    """The spec of experiment ``data`` (``lines``: the line of each key path, from ``parse_yaml``)."""
    spec = ExperimentSpec(name="", base={}, path=path, lines=lines)
    if not isinstance(data, dict):
        raise ExperimentError(f"{spec.filename}: an experiment is a mapping of keys "
                              f"({', '.join(schema.TOP_LEVEL_KEYS)}), not a {type(data).__name__}")
    for key in data:
        if key not in schema.TOP_LEVEL_KEYS:
            hint = did_you_mean(key, schema.TOP_LEVEL_KEYS)
            raise ExperimentError(f"{spec.where(key)}: unknown key{hint}; allowed top-level keys: "
                                  f"{', '.join(schema.TOP_LEVEL_KEYS)}")
    _read_identity(spec, data)
    _read_sections(spec, data)
    _read_grid(spec, data)
    _read_runs(spec, data)
    _read_repeats(spec, data)
    _read_metrics(spec, data)
    _read_options(spec, data)
    # validates every resolved run's engine and sampling settings and the datasets
    expand_runs(spec, weights=False)
    return spec


def _read_identity(spec: ExperimentSpec, data: dict) -> None:
    name = data.get("name", spec.path.stem if spec.path.name != "<dict>" else None)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][\w.\-]{0,127}", name):
        raise ExperimentError(f"{spec.where('name')}: name={name!r} is invalid: give a name of letters, "
                              "digits, "
                              "'_', '-' or '.' (it identifies the experiment in the results database)")
    spec.name = name
    desc = data.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ExperimentError(f"{spec.where('description')}: must be a string")
    spec.description = desc
    if "model" not in data:
        raise ExperimentError(f"{spec.filename}: model is missing: give a local HF directory, a .gguf file "
                              "or an embedded model name")
    models = data["model"]
    if isinstance(models, list):  # a multi-model study: the list is a grid over model (_read_grid)
        if not models:
            raise ExperimentError(f"{spec.where('model')}: the model list is empty: give one model or more")
        models = models[0]
    spec.base["model"] = resolve_model(models, spec, ("model", 0) if isinstance(data["model"], list)
                                       else ("model",))


def _read_sections(spec: ExperimentSpec, data: dict) -> None:
    for section in schema.SECTIONS:
        value = data.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ExperimentError(f"{spec.where(section)}: must be a mapping of "
                                  f"{'fields' if section != 'dataset' else 'dataset settings'}")
        if section == "engine" and "model" in value:
            raise ExperimentError(f"{spec.where(section, 'model')}: give the model at the top level (model: "
                                  "...)")
        for key in value:
            if key not in schema.SECTION_KEYS[section]:
                hint = did_you_mean(key, schema.SECTION_KEYS[section])
                raise ExperimentError(f"{spec.where(section, key)}: unknown {section} key {key!r}{hint}; "
                                      "allowed: "
                                      f"{', '.join(schema.SECTION_KEYS[section])}")
    spec.base["engine"] = dict(data.get("engine") or {})
    spec.base["sampling"] = dict(data.get("sampling") or {})
    has_dataset, has_bench = data.get("dataset") is not None, data.get("benchmark") is not None
    if has_dataset == has_bench:
        raise ExperimentError(f"{spec.filename}: give exactly one workload: dataset (prompts from a file or "
                              "inline) or benchmark (random prompts of fixed lengths)"
                              + (", not both" if has_dataset else ""))
    spec.base["dataset"] = dict(data["dataset"]) if has_dataset else None
    spec.base["benchmark"] = {**schema.BENCHMARK_DEFAULTS, **data["benchmark"]} if has_bench else None
    swept = "benchmark.batch_size" in (data.get("grid") or {})
    if has_bench and "batch_size" not in data["benchmark"] and not swept:
        raise ExperimentError(f"{spec.where('benchmark')}: batch_size is missing (one integer per run; sweep "
                              "it "
                              "with grid: {benchmark.batch_size: [4, 8, 16]})")
    if has_dataset and ("path" in spec.base["dataset"]) == ("prompts" in spec.base["dataset"]):
        raise ExperimentError(f"{spec.where('dataset')}: give exactly one of dataset.path (a JSONL, CSV or "
                              "JSON "
                              "file) and dataset.prompts (an inline list)")


def _read_grid(spec: ExperimentSpec, data: dict) -> None:
    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise ExperimentError(f"{spec.where('grid')}: must be a mapping of dotted keys to lists of values, "
                              "e.g. engine.block_size: [16, 32]")
    if isinstance(data["model"], list):
        if "model" in grid:
            raise ExperimentError(f"{spec.where('grid', 'model')}: the models are listed twice (model: is a "
                                  "list): give them in one place")
        models = [resolve_model(m, spec, ("model", i)) for i, m in enumerate(data["model"])]
        if len(set(models)) != len(models):
            raise ExperimentError(f"{spec.where('model')}: a model appears twice in the list")
        spec.grid["model"] = models  # first: each model's runs come together
    if LORA_KEY in data:  # the top-level adapter list is a grid key
        if LORA_KEY in grid:
            raise ExperimentError(f"{spec.where(LORA_KEY)}: adapters are given both here and in grid.lora: "
                                  "keep one")
        grid = {**grid, LORA_KEY: data[LORA_KEY]}
        spec.lines.setdefault(("grid", LORA_KEY), spec.lines.get((LORA_KEY,), 0))
    for key, values in grid.items():
        check_override_key(spec, key, ("grid", key))
        if not isinstance(values, list) or not values:
            raise ExperimentError(f"{spec.where('grid', key)}: must be a non-empty list of values")
        spec.grid[key] = [_resolve_value(key, v, spec, ("grid", key, i)) for i, v in enumerate(values)]


def _resolve_value(key: str, value, spec: ExperimentSpec, path: tuple):
    if key == "model":
        return resolve_model(value, spec, path)
    if key == LORA_KEY:
        return resolve_adapter(value, spec, path)
    return value


def _read_runs(spec: ExperimentSpec, data: dict) -> None:
    runs = data.get("runs") or []
    if not isinstance(runs, list):
        raise ExperimentError(f"{spec.where('runs')}: must be a list of mappings of dotted keys to values")
    for j, run in enumerate(runs):
        if not isinstance(run, dict) or not run:
            raise ExperimentError(f"{spec.where('runs', j)}: each run is a non-empty mapping of dotted keys "
                                  "to "
                                  "values, e.g. {engine.max_num_seqs: 8}")
        flat = _flatten_run(spec, j, run)
        for key in flat:
            check_override_key(spec, key, ("runs", j, key))
            if key in spec.grid:
                raise ExperimentError(f"{spec.where('runs', j, key)}: {key} is set both here and in the grid "
                                      f"({spec.where('grid', key)}), whose values would replace this one: "
                                      "set it in one of them")
        for key in ("model", LORA_KEY):
            if key in flat:
                flat[key] = _resolve_value(key, flat[key], spec, ("runs", j, key))
        spec.runs.append(flat)


def _flatten_run(spec: ExperimentSpec, j: int, run: dict) -> dict:
    """Run ``j`` as {dotted key: value}, its nested entries ({engine: {block_size: 32}}) flattened; a
    key set both dotted and nested is an error (neither value may silently win)."""
    flat = {}
    for key, value in run.items():
        if key in schema.SECTIONS and isinstance(value, dict):  # nested form: {engine: {block_size: 32}}
            entries = [(f"{key}.{sub}", v) for sub, v in value.items()]
            for sub in value:
                spec.lines.setdefault(("runs", j, f"{key}.{sub}"), spec.lines.get(("runs", j, key, sub), 0))
        else:
            entries = [(key, value)]
        for name, v in entries:
            if name in flat:
                raise ExperimentError(f"{spec.where('runs', j, name)}: {name} is set twice in this run "
                                      "(dotted and nested): keep one")
            flat[name] = v
    return flat


def _read_repeats(spec: ExperimentSpec, data: dict) -> None:
    repeats, seeds = data.get("repeats"), data.get("seeds")
    if seeds is not None:
        if not isinstance(seeds, list) or not seeds or not all(
                isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            raise ExperimentError(f"{spec.where('seeds')}: must be a non-empty list of integers, one per "
                                  "repeat")
        repeated = next((s for s in seeds if seeds.count(s) > 1), None)
        if repeated is not None:
            raise ExperimentError(f"{spec.where('seeds')}: seed {repeated} is given twice: each repeat "
                                  "needs a seed of its own (a seed run again repeats the same samples)")
        swept = "grid" if "sampling.seed" in spec.grid else next(
            (f"runs[{j}]" for j, run in enumerate(spec.runs) if "sampling.seed" in run), None)
        if swept is not None:  # seeds[r] would replace its values, leaving runs that differ in nothing
            raise ExperimentError(f"{spec.where('seeds')}: seeds: gives every run its seeds, so the "
                                  f"sampling.seed that {swept} sets would never be used: keep one of them")
        if repeats is not None and repeats != len(seeds):
            raise ExperimentError(f"{spec.where('seeds')}: {len(seeds)} seeds for repeats={repeats}: give "
                                  "one "
                                  "seed per repeat")
        spec.seeds = list(seeds)
        repeats = len(seeds)
    if repeats is None:
        repeats = 1
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ExperimentError(f"{spec.where('repeats')}: repeats={repeats!r} is invalid: give an integer >= "
                              "1")
    spec.repeats = repeats


def _read_metrics(spec: ExperimentSpec, data: dict) -> None:
    """The metric names, each registered in ``pagedlab.lab.metrics`` and fit for the workload."""
    metrics = data.get("metrics", DEFAULT_METRICS[spec.workload])
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise ExperimentError(f"{spec.where('metrics')}: must be a list of metric names: "
                              f"{', '.join(METRICS)}")
    for i, m in enumerate(metrics):
        if m not in METRICS:
            raise ExperimentError(f"{spec.where('metrics', i)}: unknown metric {m!r}; available metrics: "
                                  f"{', '.join(METRICS)}")
        if spec.workload not in METRICS[m].workloads:
            raise ExperimentError(f"{spec.where('metrics', i)}: metric {m!r} needs a dataset with "
                                  "references; "
                                  f"a benchmark workload measures {', '.join(DEFAULT_METRICS['benchmark'])}")
    spec.metrics = list(dict.fromkeys(metrics))


def _read_options(spec: ExperimentSpec, data: dict) -> None:
    monitor = data.get("monitor", True)
    interval = monitor.get("interval", 1.0) if isinstance(monitor, dict) else None
    if monitor is True or monitor is None:
        spec.monitor_interval = 1.0
    elif monitor is False:
        spec.monitor_interval = None
    elif isinstance(monitor, dict) and set(monitor) <= {"interval"} and isinstance(interval,
                                                                                   (int,
                                                                                    float)) and interval > 0:
        spec.monitor_interval = float(interval)
    else:
        raise ExperimentError(f"{spec.where('monitor')}: give true, false or {{interval: SECONDS}} (seconds "
                              "> 0)")
    store_outputs = data.get("store_outputs", True)
    if not isinstance(store_outputs, bool):
        raise ExperimentError(f"{spec.where('store_outputs')}: must be true or false")
    spec.store_outputs = store_outputs


def resolve_model(value, spec: ExperimentSpec, path: tuple) -> str:
    """An embedded model's name or a hub model id as it is, or a model path made absolute (relative
    to the experiment file first)."""
    if not isinstance(value, str) or not value:
        raise ExperimentError(f"{spec.where(*path)}: model must be a path or an embedded model name, not "
                              f"{value!r}")
    if value in EMBEDDED_MODELS:
        return value
    p = Path(value).expanduser()
    if not p.is_absolute() and spec.path is not None:
        candidate = spec.path.parent / p
        p = candidate if candidate.exists() or not p.exists() else p
    if not p.exists() and is_hub_id(value):
        return value  # a hub model id: the engine finds it in the HF cache or downloads it
    if not p.exists():
        raise ExperimentError(f"{spec.where(*path)}: model {value!r} does not exist (looked for "
                              f"{p.resolve()}): give a local HF directory, a .gguf file, a hub model id "
                              f"(org/name) or one of {sorted(EMBEDDED_MODELS)}")
    return str(p.resolve())


def check_override_key(spec: ExperimentSpec, key, path: tuple) -> None:
    """A grid or runs key must be ``model`` or ``section.field`` of a section the experiment has."""
    if not isinstance(key, str):
        raise ExperimentError(f"{spec.where(*path)}: keys are dotted strings such as engine.block_size")
    if key in ("model", LORA_KEY):
        if key == LORA_KEY and spec.base.get("benchmark") is not None:
            raise ExperimentError(f"{spec.where(*path)}: LoRA adapters run on a dataset workload; a "
                                  "benchmark experiment cannot sweep lora")
        return
    section, _, name = key.partition(".")
    if section not in schema.SECTIONS or not name:
        raise ExperimentError(f"{spec.where(*path)}: unknown key {key!r}; sweep model or section.field with "
                              f"section one of {', '.join(schema.SECTIONS)} (e.g. engine.block_size, "
                              "sampling.temperature)")
    if spec.base.get(section) is None and section in ("dataset", "benchmark"):
        raise ExperimentError(f"{spec.where(*path)}: {key!r} sweeps the {section}, but the experiment has no "
                              f"{section} section")
    if name not in schema.SECTION_KEYS[section]:
        raise ExperimentError(f"{spec.where(*path)}: unknown {section} key {name!r}"
                              f"{did_you_mean(name, schema.SECTION_KEYS[section])}; allowed: "
                              f"{', '.join(schema.SECTION_KEYS[section])}")
