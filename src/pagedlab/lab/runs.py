"""An experiment's runs: (explicit runs x grid points) x repeats, each resolved to a full config
with its seed, its dataset and a run key that identifies it in the results database (with the
checksums of the local weights it reads: ``pagedlab.lab.weights``)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedlab.config import PLAN_FIELDS, WEIGHT_FIELDS, EngineConfig
from pagedlab.lab.datasets import Dataset, load_dataset
from pagedlab.lab.metrics import METRICS
from pagedlab.lab.schema import SECTIONS, BenchmarkSettings, DatasetSettings, ExperimentError, ExperimentSpec
from pagedlab.lab.weights import weights_checksums
from pagedlab.sampling_params import SamplingParams

# ``where(section, key)`` gives ``file:line: key.path`` of the line that set a resolved setting
# (the grid entry, the explicit run or the section).
Locator = Callable[[str, str], str]


@dataclass
class ResolvedRun:
    """One run: the full config, what grid/runs changed, the repeat and its seed."""

    index: int
    config: dict  # model, engine, sampling, dataset | benchmark
    overrides: dict  # dotted key -> value set by grid / runs (the varied params)
    repeat: int
    seed: int
    run_key: str = ""
    dataset: Dataset | None = None
    # the keys earlier recipes gave the run: its config as written (pagedlab <= 0.1), then with
    # its dataset settings (before the dataset counted by its content alone), then without the
    # checksums of its weights
    legacy_keys: tuple[str, ...] = ()
    weights: dict | None = None  # its local weights' checksums (``weights_checksums``), in its key

    @property
    def group_key(self) -> str:
        """Runs with the same group key share one loaded model (the weight-level settings)."""
        engine = self.config["engine"]
        return json.dumps({"model": self.config["model"],
                           **{k: engine.get(k) for k in WEIGHT_FIELDS if k in engine}},
                          sort_keys=True, default=str)

    @property
    def plan_args(self) -> dict:
        """The plan-level engine settings the run sets (``LLM.set_model_args`` changes them)."""
        return {k: v for k, v in self.config["engine"].items() if k in PLAN_FIELDS}

    @property
    def sampling_params(self) -> dict:
        return {**self.config["sampling"], "seed": self.seed} if self.config.get("dataset") is not None \
            else dict(self.config["sampling"])

    def params(self) -> dict:
        """The flat, dotted params stored with the run (everything that defines it)."""
        out = {"model": self.config["model"]}
        if self.config.get("lora") is not None:
            out["lora"] = self.config["lora"]
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


def expand_runs(spec: ExperimentSpec, weights: bool = True) -> list[ResolvedRun]:
    """Every run of ``spec`` in order: (runs x grid points) x repeats; validates each resolved
    engine and sampling config and loads (and checks) the datasets. ``weights=False`` reads no
    weight file and leaves the weights' checksums out of the run keys (for validation alone: runs
    are duplicates with the checksums or without, which follow from their configs)."""
    grid_points = [dict(zip(spec.grid, combo)) for combo in itertools.product(*spec.grid.values())] \
        if spec.grid else [{}]
    datasets: dict[str, Dataset] = {}
    resolved: list[ResolvedRun] = []
    for j, run in enumerate(spec.runs or [{}]):
        for point in grid_points:
            overrides = {**run, **point}
            config = apply_overrides(spec.base, overrides)
            where = _locator(spec, run, point, j)
            _check_engine(config, where)
            dataset = _resolve_workload(spec, config, where, datasets)
            for r in range(spec.repeats):
                resolved.append(ResolvedRun(len(resolved), config, overrides, r, _seed(spec, config, r),
                                            dataset=dataset))
    _assign_run_keys(spec, resolved, weights)
    return resolved


def apply_overrides(base: dict, overrides: dict) -> dict:
    """A copy of the base config with the dotted ``overrides`` (``engine.block_size``, ``model``) set."""
    config = {"model": base["model"]}
    for section in SECTIONS:
        config[section] = dict(base[section]) if base.get(section) is not None else None
    for key, value in overrides.items():
        if key == "model":
            config["model"] = value
        elif key == "lora":
            if value is not None:  # absent for the base model: run keys without adapters stay as they were
                config["lora"] = value
            else:
                config.pop("lora", None)
        else:
            section, _, name = key.partition(".")
            config[section][name] = value
    return config


def _locator(spec: ExperimentSpec, run: dict, point: dict, run_index: int) -> Locator:
    def where(section: str, name: str) -> str:
        if not name:
            return spec.where(section)
        key = f"{section}.{name}"
        if key in point:
            return spec.where("grid", key)
        if key in run:
            return spec.where("runs", run_index, key)
        return spec.where(section, name)

    return where


def field_of(error: Exception) -> str | None:
    """The setting an EngineConfig/SamplingParams error names (``block_size=17 is invalid``)."""
    m = re.match(r"(\w+)=", str(error))
    if m:
        return m.group(1)
    m = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    return m.group(1) if m else None


def _check_engine(config: dict, where: Locator) -> None:
    try:
        EngineConfig(model=config["model"], **config["engine"]).validate()
    except (TypeError, ValueError) as e:
        raise ExperimentError(f"{where('engine', field_of(e) or '')}: {e}") from None


def _resolve_workload(spec: ExperimentSpec, config: dict, where: Locator,
                      datasets: dict[str, Dataset]) -> Dataset | None:
    """The run's dataset (loaded once per distinct ``dataset:`` config), after checking the
    sampling settings; None for a benchmark, after checking its settings."""
    if config.get("dataset") is None:
        _check_benchmark(spec, config, where)
        return None
    ds_conf = config["dataset"]
    ds_key = json.dumps(ds_conf, sort_keys=True, default=str)
    if ds_key not in datasets:
        base_dir = spec.path.parent if spec.path is not None else None
        datasets[ds_key] = load_dataset(ds_conf, base_dir, lambda name: where("dataset", name))
    dataset = datasets[ds_key]
    needs_refs = [m for m in spec.metrics if METRICS[m].needs_references]
    if needs_refs and not dataset.has_references:
        raise ExperimentError(f"{spec.where('metrics')}: metrics {needs_refs} compare outputs with "
                              f"references, but the dataset has none: set dataset.reference_field "
                              "(or give reference: in inline prompts)")
    try:
        SamplingParams(**config["sampling"])
    except (TypeError, ValueError) as e:
        raise ExperimentError(f"{where('sampling', field_of(e) or '')}: {e}") from None
    return dataset


def _check_benchmark(spec: ExperimentSpec, config: dict, where: Locator) -> None:
    b = config["benchmark"]
    for name in ("batch_size", "input_len", "output_len", "beam_width", "num_prompts"):
        v = b.get(name)
        if name == "num_prompts" and v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ExperimentError(f"{where('benchmark', name)}: {name}={v!r} is invalid: give an integer >= "
                                  "1")
    for name in ("use_beam_search", "detokenize"):  # a string such as "no" would count as true
        if not isinstance(b.get(name), bool):
            raise ExperimentError(f"{where('benchmark', name)}: {name}={b.get(name)!r} is invalid: give true "
                                  "or false")
    if not isinstance(b.get("warmup"), int) or isinstance(b["warmup"], bool) or b["warmup"] < 0:
        raise ExperimentError(f"{where('benchmark', 'warmup')}: warmup={b.get('warmup')!r} is invalid: give "
                              "an "
                              "integer >= 0")
    if not isinstance(b.get("temperature"), (int, float)) or b["temperature"] < 0:
        raise ExperimentError(f"{where('benchmark', 'temperature')}: temperature={b.get('temperature')!r} is "
                              "invalid: give a number >= 0")
    if "max_num_seqs" in config["engine"]:
        raise ExperimentError(f"{where('engine', 'max_num_seqs')}: a benchmark run sets max_num_seqs to "
                              "its batch_size; sweep benchmark.batch_size (with benchmark.num_prompts "
                              "for more requests than fit at once) instead")
    if config["sampling"]:
        raise ExperimentError(f"{spec.where('sampling')}: a benchmark workload samples with "
                              "benchmark.temperature (ignore_eos, fixed output_len); remove sampling")


def _seed(spec: ExperimentSpec, config: dict, repeat: int) -> int:
    if spec.seeds is not None:
        return spec.seeds[repeat]
    section = config["sampling"] if config.get("dataset") is not None else config["benchmark"]
    return (section.get("seed") or 0) + repeat


def _assign_run_keys(spec: ExperimentSpec, resolved: list[ResolvedRun], weights: bool) -> None:
    checksums = weights_checksums([r.config for r in resolved]) if weights else [None] * len(resolved)
    for run, run_weights in zip(resolved, checksums):
        ident = {"repeat": run.repeat, "seed": run.seed,
                 "dataset_sha256": run.dataset.sha256 if run.dataset else None}
        canonical = key_config(run.config)
        run.weights = run_weights
        path_only = f"{spec.name}:{_digest({'config': canonical, **ident, 'key': 2})}"
        # without local weights the key stays as it was before it held their checksums
        run.run_key = path_only if run.weights is None else \
            f"{spec.name}:{_digest({'config': canonical, **ident, 'weights': run.weights, 'key': 2})}"
        if run.config.get("dataset") is not None:
            canonical = {**canonical, "dataset": _key_section("dataset", run.config["dataset"])}
        run.legacy_keys = (f"{spec.name}:{_digest({'config': run.config, **ident})}",
                           f"{spec.name}:{_digest({'config': canonical, **ident, 'key': 2})}", path_only)
    keys = [r.run_key for r in resolved]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        first = [r for r in resolved if r.run_key == dup]
        raise ExperimentError(f"{spec.filename}: runs {first[0].index} and {first[1].index} are identical "
                              f"({first[0].label()} and {first[1].label()}, repeat {first[0].repeat}): "
                              "remove the duplicate from grid/runs")


def _digest(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:24]


_SECTION_FIELDS = {section: {f.name: f for f in dataclasses.fields(cls)} for section, cls in
                   (("engine", EngineConfig), ("sampling", SamplingParams), ("dataset", DatasetSettings),
                    ("benchmark", BenchmarkSettings))}


def key_config(config: dict) -> dict:
    """The run's config as its key sees it: settings equal to their defaults left out, whole
    numbers in float fields as floats and a lone stop string as a list, so specs that say the same
    thing (``temperature: 0`` or ``0.0``, ``seed: 0`` spelled out or not) share one key. The
    sampling seed is left to the key's own ``seed`` (the run's), and the dataset settings to its
    ``dataset_sha256`` (the prompts they read, however the file's path is written)."""
    out = {k: v for k, v in config.items() if k not in SECTIONS}
    for section in ("engine", "sampling", "benchmark"):
        if config.get(section) is not None:
            out[section] = _key_section(section, config[section])
    return out


def _key_section(section: str, given: dict) -> dict:
    """One section's settings as ``key_config`` sees them."""
    fields = _SECTION_FIELDS[section]
    kept = {}
    for name, value in given.items():
        f = fields[name]
        if f.type.split(" | ")[0] == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif name == "stop" and isinstance(value, str):
            value = [value]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if value != default or type(value) is not type(default):
            kept[name] = value
    if section == "sampling":
        kept.pop("seed", None)
    return kept


def format_plan(spec: ExperimentSpec, runs: list[ResolvedRun], done: set[str]) -> str:
    """The dry-run table: every run with its model group, params, repeat, seed and status."""
    groups = list(dict.fromkeys(r.group_key for r in runs))
    pending_groups = {r.group_key for r in runs if r.run_key not in done}
    lines = [f"experiment {spec.name}: {len(runs)} run(s), {sum(r.run_key not in done for r in runs)} "
             "pending, "
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
