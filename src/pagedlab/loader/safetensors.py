"""Read (sharded) safetensors checkpoints tensor by tensor, lazily: each rank of a
tensor-parallel model reads only its part of a tensor."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"


def indexed_files(model_dir: Path) -> list[Path] | None:
    """The weight files the checkpoint's index (``model.safetensors.index.json``) maps tensors to,
    None without one; other .safetensors files beside them (Mistral's consolidated.safetensors,
    another layout of the same weights) are not the checkpoint's, as for transformers and vLLM."""
    index = model_dir / INDEX_FILE
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"weight index {index} is not a safetensors index (a weight_map of tensor "
                         f"names to files): {type(e).__name__}: {e}") from None
    return [model_dir / name for name in names]


def safetensors_files(model_dir: Path) -> list[Path]:
    files = indexed_files(model_dir)
    if files is not None:
        absent = [path.name for path in files if not path.is_file()]
        if absent:
            raise ValueError(f"weight files {absent} listed in {model_dir / INDEX_FILE} are missing (an "
                             "interrupted download or copy?)")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weight file in {model_dir} (use load_format='dummy' for "
                         "random weights from config.json alone)")
    return files


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, object]]:
    """Yield (name, lazy slice) for every tensor of every weight file: the slice
    (``safe_open(...).get_slice(name)``) reads from the file only what is indexed
    (``s[a:b]``, ``s[:, a:b]``, ``s[:]``), and only while the iteration is at that tensor. A
    corrupt or truncated file names itself."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict: it has keys() but no __iter__
                    yield name, f.get_slice(name)
        except Exception as e:  # safetensors raises its own error types for bad headers/sizes
            raise ValueError(f"weight file {path} is corrupt or truncated: {e}") from None
