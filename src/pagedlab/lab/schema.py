"""The schema of an experiment file: its keys, the typed settings of its sections, the validated
``ExperimentSpec``, and YAML read with the line of every key, so an error names
``file:line: key.path``.

The ``engine:`` section takes the fields of ``pagedlab.config.EngineConfig`` (less ``model``,
given at the top level); ``sampling:`` those of ``pagedlab.SamplingParams``; ``dataset:`` and
``benchmark:`` those of ``DatasetSettings`` and ``BenchmarkSettings`` below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedlab.config import ENGINE_FIELDS
from pagedlab.sampling_params import SamplingParams

SECTIONS = ("engine", "sampling", "dataset", "benchmark")
TOP_LEVEL_KEYS = ("name", "description", "model", "engine", "sampling", "dataset", "benchmark", "grid",
                  "runs", "repeats", "seeds", "metrics", "monitor", "store_outputs", "lora")


class ExperimentError(ValueError):
    """A malformed experiment: the message names the file, the line and the key path."""


@dataclass
class DatasetSettings:
    """The ``dataset:`` section: prompts from a file (``path``) or inline (``prompts``)."""

    path: str | None = None  # a JSONL, CSV, TSV or JSON file, relative to the experiment file
    format: str | None = None  # jsonl, csv, tsv or json (default: the file's suffix)
    prompts: list | None = None  # strings, token-id lists or {prompt: ..., reference: ...}
    prompt_field: str = "prompt"
    reference_field: str | None = None
    template: str | None = None  # a str.format template over the record's fields
    chat: bool = False  # send each prompt as a user message through the chat template
    system: str | None = None  # the system message of chat prompts
    limit: int | None = None  # the first N records only


@dataclass
class BenchmarkSettings:
    """The ``benchmark:`` section: random prompts of fixed lengths (see ``LLM.benchmark``)."""

    batch_size: int | None = None  # required: one integer per run
    input_len: int = 512
    output_len: int = 128
    num_prompts: int | None = None
    warmup: int = 1
    use_beam_search: bool = False
    beam_width: int = 4
    temperature: float = 0.0
    detokenize: bool = True


DATASET_KEYS = tuple(f.name for f in dataclasses.fields(DatasetSettings))
BENCHMARK_KEYS = tuple(f.name for f in dataclasses.fields(BenchmarkSettings))
BENCHMARK_DEFAULTS = {f.name: f.default for f in dataclasses.fields(BenchmarkSettings)
                      if f.name != "batch_size"}
ENGINE_KEYS = tuple(name for name in ENGINE_FIELDS if name != "model")
SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))
SECTION_KEYS = {"engine": ENGINE_KEYS, "sampling": SAMPLING_KEYS, "dataset": DATASET_KEYS,
                "benchmark": BENCHMARK_KEYS}


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
        return f"{loc}: {dotted(tuple(path))}" if path else loc

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, **self.base, "grid": self.grid,
                "runs": self.runs, "repeats": self.repeats, "seeds": self.seeds, "metrics": self.metrics,
                "monitor": {"interval": self.monitor_interval} if self.monitor_interval else False,
                "store_outputs": self.store_outputs, "file": str(self.path) if self.path else None}


def dotted(path: tuple) -> str:
    """A key path as written in messages: ``("runs", 0, "engine.block_size")`` ->
    ``runs[0].engine.block_size``."""
    return ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in path).replace(".[", "[")


def load_yaml_module():
    """PyYAML, or an ImportError that says how to install it."""
    try:
        import yaml
    except ImportError:
        raise ImportError("experiments from YAML need PyYAML: pip install pyyaml") from None
    return yaml


def parse_yaml(text: str, filename: str = "<string>") -> tuple[Any, dict[tuple, int]]:
    """The YAML document as Python data, and the 1-based line of every key path in it."""
    yaml = load_yaml_module()
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise ExperimentError(f"{filename}: the file is empty: an experiment needs at least model and "
                                  "a dataset or benchmark")
        lines: dict[tuple, int] = {}
        return _construct(yaml, loader, node, (), lines, filename), lines
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark is not None else filename
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        raise ExperimentError(f"{where}: malformed YAML: {problem}" + (f" ({context})" if context else "")) \
            from None
    finally:
        loader.dispose()


def _construct(yaml, loader, node, path: tuple, lines: dict[tuple, int], filename: str):
    """The Python value of ``node``, recording the line of each key path under ``path``."""
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.SequenceNode):
        return [_construct(yaml, loader, item, path + (i,), lines, filename)
                for i, item in enumerate(node.value)]
    if not isinstance(node, yaml.MappingNode):
        return loader.construct_object(node, deep=True)
    loader.flatten_mapping(node)
    out = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, (str, int, float, bool)) or key is None:
            raise ExperimentError(f"{filename}:{line}: {dotted(path) or 'top level'}: keys must be strings")
        if key in out:
            raise ExperimentError(f"{filename}:{line}: {dotted(path + (key,))}: the key appears twice")
        lines[path + (key,)] = line
        out[key] = _construct(yaml, loader, value_node, path + (key,), lines, filename)
    return out
