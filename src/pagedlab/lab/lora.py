"""LoRA adapters in experiments: ``lora: [DIR, ...]`` (top level, or ``lora`` in ``grid:``/``runs:``)
sweeps adapters over one loaded base model; ``null`` in the list is the base model alone.

A run's config carries ``lora`` (the adapter's absolute path) only when it has one, so the run
keys of experiments without adapters stay what they were. The model group of such runs is
loaded once with ``enable_lora=True`` and a ``max_lora_rank`` that fits every adapter of the
group; each run's manifest records its adapter's name, path, config and weights checksum.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pagedlab.lab.schema import ExperimentError, ExperimentSpec
from pagedlab.lora.adapter import read_adapter_config
from pagedlab.lora.request import LoRARequest

LORA_KEY = "lora"


def resolve_adapter(value, spec: ExperimentSpec, path: tuple) -> str | None:
    """An adapter directory made absolute (relative to the experiment file first) and checked to
    hold a PEFT LoRA config; None stays None (the base model)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ExperimentError(f"{spec.where(*path)}: lora must be a PEFT adapter directory or null (the base "
                              f"model), not {value!r}")
    p = Path(value).expanduser()
    if not p.is_absolute() and spec.path is not None and (spec.path.parent / p).exists():
        p = spec.path.parent / p
    try:
        read_adapter_config(p)
    except ValueError as e:
        raise ExperimentError(f"{spec.where(*path)}: {e}") from None
    return str(p.resolve())


def adapter_rank(path: str) -> int:
    """The largest rank ``adapter_config.json`` declares (``r`` and any ``rank_pattern`` value)."""
    config = read_adapter_config(path)
    return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])


def lora_engine_args(adapters: list[str | None], engine_kwargs: dict) -> dict:
    """``engine_kwargs`` for a model group whose runs use ``adapters``: LoRA on, with a rank that
    fits them all, when any run has one (settings the experiment gives itself win)."""
    paths = [a for a in adapters if a is not None]
    if not paths:
        return engine_kwargs
    rank = max(adapter_rank(p) for p in paths)
    return {"enable_lora": True, "max_lora_rank": max(rank, engine_kwargs.get("max_lora_rank", 0)),
            **{k: v for k, v in engine_kwargs.items() if k != "max_lora_rank"}}


def lora_request(path: str | None) -> LoRARequest | None:
    """The request of the adapter at ``path``: named by its directory, with an id derived from
    the path (stable across runs, so the engine's caches know it again)."""
    if path is None:
        return None
    lora_id = 1 + int(hashlib.sha256(path.encode()).hexdigest()[:8], 16)
    return LoRARequest(Path(path).name, lora_id, path)


def adapter_manifest(llm, request: LoRARequest) -> dict:
    """What the manifest records of a run's adapter: name, path, config and weights checksum."""
    adapter = llm.llm_engine.runner.lora.get_adapter(request)
    return {"name": request.lora_name, "path": request.lora_path, "config": adapter.config,
            "rank": adapter.rank, "weights_sha256": adapter.sha256}
