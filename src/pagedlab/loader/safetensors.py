"""Read (sharded) safetensors checkpoints tensor by tensor."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weight file in {model_dir} (use load_format='dummy' for "
                         "random weights from config.json alone)")
    return files


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every weight file; a corrupt or truncated file names itself."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict: it has keys() but no __iter__
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for bad headers/sizes
            raise ValueError(f"weight file {path} is corrupt or truncated: {e}") from None
