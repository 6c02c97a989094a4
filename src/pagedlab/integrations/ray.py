"""Batch inference with Ray Data: one ``pagedlab.LLM`` per actor of ``map_batches``.

    import ray
    from pagedlab.integrations.ray import PagedLabPredictor

    ds = ray.data.read_json("prompts.jsonl")
    ds = ds.map_batches(PagedLabPredictor, concurrency=4, num_gpus=1, batch_size=64,
                        fn_constructor_kwargs={"model": "path/to/model",
                                               "sampling_params": {"temperature": 0, "max_tokens": 64}})
    ds.write_parquet("out/")

Each actor builds its ``LLM`` once (the weights load once per actor) and generates every batch it
is given in one ``generate`` call; each row keeps its columns and gains ``generated_text``,
``num_output_tokens`` and ``finish_reason``. ``run_batch_inference`` does the above from a JSONL
file to a Parquet directory and writes the run's manifest (``manifest.json``) alongside.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import ray

from pagedlab.lab.manifest import collect_manifest
from pagedlab.llm import LLM
from pagedlab.sampling_params import SamplingParams


class PagedLabPredictor:
    """The callable class for ``Dataset.map_batches``: an ``LLM(model, **engine_args)`` per actor.
    ``sampling_params``: a SamplingParams or its keyword arguments (default: those ``LLM.generate``
    uses without any, the model's recommended ones).
    ``prompt_column`` holds each row's prompt: its text, or a list of token ids. A row's
    ``sampling_params_column`` (vLLM's Ray Data processor's name), when the dataset has it, holds
    SamplingParams fields that row samples with over the actor's (a null one keeps the actor's; an
    integer field above 2**53 is not exact, Ray Data having turned it into a float)."""

    def __init__(self, model: str, sampling_params: SamplingParams | dict | None = None,
                 prompt_column: str = "prompt", output_column: str = "generated_text",
                 sampling_params_column: str = "sampling_params", **engine_args):
        if isinstance(sampling_params, dict):
            sampling_params = SamplingParams(**sampling_params)
        if sampling_params is not None:
            _one_completion(sampling_params)
        self.prompt_column, self.output_column = prompt_column, output_column
        self.sampling_params_column = sampling_params_column
        self.llm = LLM(model, **engine_args)
        self.sampling_params = sampling_params or self.llm.get_default_sampling_params()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.prompt_column not in batch:
            raise KeyError(f"prompt_column={self.prompt_column!r} is not a column of the dataset: its "
                           f"columns are {sorted(batch)}")
        outputs = (self.output_column, "num_output_tokens", "finish_reason")
        taken = [c for c in outputs if c in batch]
        if taken:
            raise ValueError(f"the dataset has the column(s) {', '.join(map(repr, taken))}, which the "
                             f"predictor's outputs {', '.join(outputs)} would overwrite: rename them (or give"
                             " another output_column)")
        prompts = [_prompt(self.prompt_column, i, p) for i, p in enumerate(batch[self.prompt_column])]
        params = self.sampling_params
        if self.sampling_params_column in batch:
            params = [self._row_params(i, row) for i, row in enumerate(batch[self.sampling_params_column])]
        outputs = [o.outputs[0] for o in self.llm.generate(prompts, params, use_tqdm=False)]
        return {**batch, self.output_column: np.array([o.text for o in outputs], dtype=object),
                "num_output_tokens": np.array([len(o.token_ids) for o in outputs], dtype=np.int64),
                "finish_reason": np.array([o.finish_reason for o in outputs], dtype=object)}

    def _row_params(self, index: int, fields: dict | None) -> SamplingParams:
        """The actor's sampling params with a row's non-null fields over them."""
        if fields is None:
            return self.sampling_params
        try:
            if not isinstance(fields, dict):
                raise ValueError(f"{fields!r} is not a dict of SamplingParams fields")
            changes = {k: _field_value(v, getattr(self.sampling_params, k, None)) for k, v in fields.items()
                       if not (v is None or (isinstance(v, float) and math.isnan(v)))}
            return _one_completion(dataclasses.replace(self.sampling_params, **changes))
        except (TypeError, ValueError) as e:
            raise ValueError(f"row {index} of the batch: {self.sampling_params_column}: {e}") from None


def _field_value(value: Any, current: Any) -> Any:
    """A struct field of a numpy batch as SamplingParams takes it: an array as a list, and an
    integral float as an int unless the field holds floats (Ray Data's numpy conversion turns an
    integer field into floats when some row lacks it: max_tokens 2 arrives as 2.0)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, float) and value.is_integer() and not isinstance(current, float):
        return int(value)
    return value


def _one_completion(params: SamplingParams) -> SamplingParams:
    """``params``, when they ask for one completion: a row has one output column to hold it."""
    if params.n != 1:
        raise ValueError(f"sampling n={params.n}: PagedLabPredictor writes one completion per row; use n=1 "
                         "(repeat the rows for several samples of a prompt)")
    return params


def _prompt(column: str, index: int, value: Any) -> str | list[int]:
    """One row's prompt for ``generate``: text as it is, a sequence of integers as token ids (an
    Arrow list column arrives as a numpy array); anything else (a missing value) is refused, never
    generated from its ``str()``."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, np.ndarray)) and all(isinstance(t, (int, np.integer)) for t in value):
        return [int(t) for t in value]
    raise ValueError(f"row {index} of the batch: {column}={value!r} is not a prompt: give its text or a list "
                     "of token ids")


def run_batch_inference(input_path: str | Path, output_dir: str | Path, model: str,
                        sampling_params: dict | None = None, concurrency: int = 1,
                        num_gpus: float | None = None, batch_size: int = 64, prompt_column: str = "prompt",
                        **engine_args) -> dict:
    """Generate a completion for every row of the JSONL file ``input_path`` with ``concurrency``
    actors, write the rows with their outputs as Parquet under ``output_dir`` and the manifest as
    ``output_dir/manifest.json``. Returns the manifest. Each actor asks for ``num_gpus`` (default:
    one per tensor-parallel rank, as vLLM's Ray Data processor; 0 on a CPU cluster, where it takes
    a CPU per rank)."""
    sampling = dict(sampling_params or {})
    ranks = int(engine_args.get("tensor_parallel_size", 1))
    num_gpus = ranks if num_gpus is None else num_gpus
    if 0 < num_gpus < ranks:
        raise ValueError(f"num_gpus={num_gpus} per actor, but tensor_parallel_size={ranks} runs a rank on "
                         f"each of {ranks} GPUs: give num_gpus={ranks} (or 0 on CPUs)")
    dataset = ray.data.read_json(str(input_path))
    resources: dict[str, Any] = {"num_gpus": num_gpus} if num_gpus else {"num_cpus": ranks}
    dataset = dataset.map_batches(
        PagedLabPredictor, concurrency=concurrency, batch_size=batch_size, **resources,
        fn_constructor_kwargs={"model": model, "sampling_params": sampling, "prompt_column": prompt_column,
                               **engine_args})
    output_dir = Path(output_dir)
    dataset.write_parquet(str(output_dir))
    data = Path(input_path).read_bytes()
    manifest = collect_manifest(sampling_params=SamplingParams(**sampling), extra={"ray_data": {
        "model": model, "engine_args": engine_args, "input": str(input_path),
        "input_sha256": hashlib.sha256(data).hexdigest(),
        "input_rows": sum(1 for line in data.splitlines() if line.strip()),
        "concurrency": concurrency, "num_gpus_per_actor": num_gpus, "batch_size": batch_size,
        "ray_version": ray.__version__}})
    (output_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    return manifest
