"""Find a model (HF directory, GGUF file, hub model id, embedded name), build it and fill its weights."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedlab.loader.dummy import init_dummy_weights
from pagedlab.loader.gguf import EMBEDDED_MODELS, convert_gguf, embedded_model_path
from pagedlab.loader.hf_config import layers_kept, without_layers_from
from pagedlab.loader.hub import is_hub_id, resolve_hub_model
from pagedlab.loader.safetensors import iterate_safetensors
from pagedlab.models.checkpoint import some_names
from pagedlab.models.registry import build_model

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """Where the weights come from: ``path`` is an HF-layout directory (config.json, ...)."""

    name: str  # what the user asked for
    path: Path
    load_format: str  # "safetensors" | "dummy"
    original_file: Path | None = None  # the GGUF file, for a converted one


def resolve_model_source(model: str, load_format: str = "auto", revision: str | None = None,
                         download_dir: str | None = None) -> ModelSource:
    """Where ``model`` is: an embedded name, a local directory or .gguf file, or a hub model id
    ("org/name", from the HF cache or downloaded: ``pagedlab.loader.hub``)."""
    original = None
    path = Path(model).expanduser()
    if model in EMBEDDED_MODELS:
        original = embedded_model_path(model)
        path = convert_gguf(original)
    elif not path.exists() and is_hub_id(model):
        path = resolve_hub_model(model, revision, download_dir, weights=load_format != "dummy")
    elif not path.exists():
        raise ValueError(
            f"model {model!r} does not exist: give a local HF directory (config.json + *.safetensors), a "
            f".gguf file, a hub model id (org/name) or one of the embedded models {sorted(EMBEDDED_MODELS)}")
    elif path.is_file():
        if path.suffix != ".gguf" and load_format != "gguf":
            raise ValueError(f"model {model!r} is a file but not a .gguf file; "
                             "give a directory or a GGUF file")
        original, path = path, convert_gguf(path)
    elif load_format == "gguf":
        raise ValueError(f"load_format='gguf' needs a .gguf file, but {model!r} is a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    return ModelSource(model, path, "dummy" if load_format == "dummy" else "safetensors", original)


def resolve_tokenizer_path(tokenizer: str | None, model_path: Path, download_dir: str | None = None) -> Path:
    """The directory of the tokenizer: the model's, a local directory, the conversion of a .gguf
    file (as vLLM reads a GGUF tokenizer), or a hub id's snapshot."""
    if tokenizer is None:
        return model_path
    path = Path(tokenizer).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"tokenizer {tokenizer!r} is a file but not a .gguf file; give a directory "
                             "with the tokenizer's files, a .gguf file or a hub model id (org/name)")
        return convert_gguf(path)
    if path.exists():
        return path
    if is_hub_id(tokenizer):
        return resolve_hub_model(tokenizer, None, download_dir, weights=False)
    raise ValueError(f"tokenizer {tokenizer!r} does not exist: give a local directory with the tokenizer's "
                     "files or a hub model id (org/name)")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(source: ModelSource, hf_config, dtype: torch.dtype, device: torch.device,
               max_position: int, seed: int = 0, quantization: str | None = None) -> torch.nn.Module:
    """Build the model straight on ``device`` in ``dtype`` and load (or randomise) its weights;
    ``quantization`` is the engine's argument (see ``pagedlab.quantization.formats``).

    In a tensor-parallel process (``pagedlab.distributed.parallel_state.init_tensor_parallel``
    called first) the model is this rank's shard and only its part of each tensor is read. Once
    loaded, each linear's weights take the layout its method multiplies
    (``process_weights_after_loading``)."""
    with _default_dtype(dtype), torch.device(device):
        model = build_model(hf_config, max_position, quantization)
    if source.load_format == "dummy":
        init_dummy_weights(model, seed, dtype=dtype)
    else:
        weights = iterate_safetensors(source.path)
        kept = layers_kept(hf_config, source.path)
        if kept is not None:
            logger.info("hf_overrides keeps the first %d layers of %s: the others' weights are not read",
                        kept, source.path)
            weights = without_layers_from(weights, kept)
        loaded = model.load_weights(weights)
        missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
        if missing:
            raise ValueError(f"the checkpoint in {source.path} lacks weights for: {some_names(missing)}")
    process_weights_after_loading(model)
    return model.eval()


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Let every linear's method turn its loaded, tensor-parallel cut parameters into the layout it
    multiplies (AWQ's repack); dummy and checkpoint weights alike."""
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
