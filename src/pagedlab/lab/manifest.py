"""The provenance manifest attached to every number the lab stores (no number without its provenance).

``collect_manifest(llm, sampling_params=..., seeds=...)`` returns a JSON-able dict:

- ``hardware``: CPU model and cores, RAM, GPUs (name, memory, capability, UUID), NVIDIA driver,
  CUDA and cuDNN versions;
- ``versions``: Python, pagedlab, torch, triton, transformers, tokenizers, safetensors, numpy;
- ``model``: name and path, GGUF file if converted, architecture, load format, hashes of
  config.json and generation_config.json, and weight checksum (SHA-256 of the weight files;
  each file's digest cached by path, size, mtime and ctime: ``file_digest``);
- ``tokenizer``: class, path, checksum of its files, chat template hash;
- ``engine``: the fully resolved engine config (dtype, device, max_model_len, token budget, KV
  blocks), the ids that end a sequence and the generation config's sampling defaults;
- ``sampling``, ``seeds``; ``git``: commit and dirty flag of the working directory (and of the
  pagedlab source tree, when that is a checkout elsewhere); ``env``: variables that change numerics.

``diff_manifests`` names the fields that differ between manifests (the report highlights them).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import pagedlab
from pagedlab.cache import cache_root
from pagedlab.config import DraftModelInfo, EngineInfo
from pagedlab.lab.monitor import open_nvml
from pagedlab.lab.plan import count_parameters, size_class

MANIFEST_SCHEMA = 1
# Fields that differ between any two runs by nature; never reported as a difference.
VOLATILE_FIELDS = ("created_at",)
_PACKAGES = ("pagedlab", "torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "gguf")
_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED", "TRITON_INTERPRET",
             "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                    "chat_template.jinja", "chat_template.json")
# The files of a model directory whose bytes are its weights (what the weight checksum covers).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def collect_manifest(llm=None, sampling_params=None, seeds: dict | None = None, extra: dict | None = None,
                     hash_weights: bool = True) -> dict:
    """The manifest of the current process, and of ``llm`` (a ``pagedlab.LLM``) when given.

    ``sampling_params``: a SamplingParams / BeamSearchParams, a dict, or a list of them.
    ``hash_weights=False`` skips hashing the weight files (recorded as ``None``).
    """
    manifest: dict = {
        "schema": MANIFEST_SCHEMA,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                 "python": sys.version.split()[0]},
        "hardware": hardware_info(),
        "versions": library_versions(),
        "git": git_info(Path.cwd()),
        "env": {k: os.environ[k] for k in _ENV_VARS if k in os.environ},
    }
    source_git = _pagedlab_source_git()
    if source_git is not None and source_git.get("root") != manifest["git"].get("root"):
        manifest["pagedlab_git"] = source_git
    info = llm.get_engine_info() if llm is not None else None
    if info is not None:
        manifest["model"] = model_info(info, hash_weights=hash_weights)
        if info.draft_model is not None:
            manifest["draft_model"] = model_info(info.draft_model, hash_weights=hash_weights)
        manifest["tokenizer"] = tokenizer_info(info)
        manifest["engine"] = engine_info(info)
    if sampling_params is not None:
        manifest["sampling"] = _params_dict(sampling_params)
    seed_info = dict(seeds or {})
    if info is not None:
        seed_info.setdefault("engine", info.config.seed)
    if sampling_params is not None and "sampling" not in seed_info:
        found = _sampling_seeds(manifest["sampling"])
        if found:
            seed_info["sampling"] = found
    manifest["seeds"] = seed_info
    if extra:
        manifest.update(extra)
    return manifest


# ---- hardware and software ------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def hardware_info() -> dict:
    info: dict = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "ram_bytes": _ram_total(),
                  "machine": platform.machine()}
    try:
        import torch
    except ImportError:
        return info
    info["cuda"] = torch.version.cuda
    info["hip"] = getattr(torch.version, "hip", None)
    gpus = []
    if torch.cuda.is_available():
        info["cudnn"] = torch.backends.cudnn.version()
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_bytes": int(p.total_memory),
                         "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
                         "uuid": str(getattr(p, "uuid", "")) or None})
    info["gpus"] = gpus
    info["driver"] = _nvidia_driver() if gpus else None
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_total() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
    return None


def _nvidia_driver() -> str | None:
    nvml, _ = open_nvml()
    if nvml is None:
        return None
    try:
        return nvml.driver
    finally:
        nvml.close()


@functools.lru_cache(maxsize=1)
def library_versions() -> dict:
    versions = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    if versions["pagedlab"] is None:  # running from a source tree (PYTHONPATH=src)
        versions["pagedlab"] = pagedlab.__version__
    return versions


def git_info(path: str | os.PathLike) -> dict:
    """Commit and dirty flag (tracked files changed) of the git checkout holding ``path``."""
    def git(*args):
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)

    try:
        root = git("rev-parse", "--show-toplevel")
        if root.returncode != 0:
            return {"commit": None, "dirty": None, "root": None}
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": (head.stdout.strip() or None) if head.returncode == 0 else None,
                "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None,
                "root": root.stdout.strip()}
    except (OSError, subprocess.SubprocessError):  # no git binary
        return {"commit": None, "dirty": None, "root": None}


def _pagedlab_source_git() -> dict | None:
    info = git_info(Path(pagedlab.__file__).resolve().parent)
    return info if info["root"] else None


# ---- model, tokenizer, engine ---------------------------------------------------------------------
def model_info(info: EngineInfo | DraftModelInfo, hash_weights: bool = True) -> dict:
    """The model's identity: name, path, GGUF origin, architecture, config hash, weight checksum,
    and the bytes its weights take as loaded (quantized or not; this rank's under tensor parallelism).
    The same for a speculative draft model (``EngineInfo.draft_model``)."""
    path = Path(info.model_path)
    original = info.original_file
    out = {
        "name": info.model_name, "path": str(path.resolve()),
        "original_file": str(Path(original).resolve()) if original else None,
        "load_format": info.load_format,
        "architecture": (getattr(info.hf_config, "architectures", None) or [None])[0],
        "model_type": getattr(info.hf_config, "model_type", None),
        "config_hash": config_hash(path),
        "generation_config_hash": json_file_hash(path / "generation_config.json"),
        "weight_bytes": info.weight_bytes,
    }
    out["parameters"] = count_parameters(info.hf_config)
    out["size_class"] = size_class(out["parameters"])
    if info.load_format == "dummy":
        out["weight_checksum"] = f"dummy:seed={info.config.seed}"
    elif not hash_weights:
        out["weight_checksum"] = None
    else:
        out["weight_checksum"] = files_checksum(weight_files(path, original))
    return out


def weight_files(model_dir: Path, original_file: Path | None = None) -> list[Path]:
    """The files holding a model's weights: the GGUF file it was converted from, else the weight
    files (``WEIGHT_SUFFIXES``) of its directory, sorted."""
    if original_file:
        return [Path(original_file)]
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return []
    return sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def config_hash(model_dir: Path) -> str | None:
    """SHA-256 of config.json, canonicalised (key order and whitespace do not count)."""
    return json_file_hash(Path(model_dir) / "config.json")


def json_file_hash(path: Path) -> str | None:
    """SHA-256 of a JSON file, canonicalised (key order and whitespace do not count); None when
    there is no such (readable, valid) file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return _sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())


def tokenizer_info(info: EngineInfo) -> dict:
    """The tokenizer's class, path, checksum of its files and chat template hash."""
    tok = info.tokenizer
    if tok is None:
        return {"class": None, "path": None, "checksum": None, "chat_template_hash": None}
    path = Path(info.tokenizer_path)
    files = [path / name for name in _TOKENIZER_FILES if (path / name).is_file()] if path.is_dir() else []
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return {"class": type(tok).__name__, "path": str(path.resolve()) if path.exists() else str(path),
            "checksum": files_checksum(files) if files else None,
            "vocab_size": len(tok) if hasattr(tok, "__len__") else None,
            "chat_template_hash": _sha256(template.encode()) if template else None}


def engine_info(info: EngineInfo) -> dict:
    """The engine config with every "auto"/None resolved to what the engine actually uses, the
    token ids that end a sequence (config, generation config and tokenizer) and the sampling
    defaults a request that sets none gets (``generation_config``)."""
    return {**info.resolved_settings(), "eos_token_ids": list(info.eos_token_ids),
            "default_sampling_args": dict(info.default_sampling_args)}


# ---- checksums ------------------------------------------------------------------------------------
def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def files_checksum(paths: list[Path]) -> str | None:
    """SHA-256 over the names and contents of ``paths`` (each file's digest is cached:
    ``file_digest``, so a 16 GB checkpoint is read once)."""
    if not paths:
        return None
    outer = hashlib.sha256()
    for p in paths:
        outer.update(p.name.encode() + b"\0" + file_digest(Path(p)).encode() + b"\0")
    return "sha256:" + outer.hexdigest()


def _digest_cache_path() -> Path:
    return cache_root() / "lab" / "file-digests.json"


# this process's digests, by the key of the cache file: a plan's run keys and every run's
# manifest ask for the same files, and the cache file need not be parsed again for each
_DIGESTS: dict[str, str] = {}


def file_digest(path: Path) -> str:
    """The SHA-256 (hex) of the file at ``path``, cached (in ``$PAGEDLAB_CACHE_DIR/lab/file-digests.json``
    and in this process) by its resolved path, size, mtime and ctime: a file unchanged since it
    was hashed costs a ``stat``. The ctime counts because every write sets it and, unlike the
    mtime, no call can set it back: bytes rewritten at the same size with the mtime restored
    (``os.utime``) are hashed again, and a ``touch`` or a copy of the same bytes over the file
    only costs hashing it once more."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    if key in _DIGESTS:
        return _DIGESTS[key]
    cache_file = _digest_cache_path()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        _DIGESTS[key] = cache[key]
        return cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = _DIGESTS[key] = h.hexdigest()
    try:  # re-read, merge and replace atomically: several processes may hash at once
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        cache[key] = digest
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)
    except OSError:
        pass  # a read-only cache only costs re-hashing
    return digest


# ---- sampling params and seeds --------------------------------------------------------------------
def _params_dict(params):
    if isinstance(params, (list, tuple)):
        return [_params_dict(p) for p in params]
    if isinstance(params, dict):
        return dict(params)
    if dataclasses.is_dataclass(params):
        record = dataclasses.asdict(params)
        if record.get("logits_processors"):  # code, not data: each recorded by its qualified name
            record["logits_processors"] = [_qualified_name(fn) for fn in params.logits_processors]
        return record
    raise TypeError(f"sampling_params must be SamplingParams, BeamSearchParams, a dict or a list of them, "
                    f"not {type(params).__name__}")


def _qualified_name(fn) -> str:
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def _sampling_seeds(sampling) -> list:
    items = sampling if isinstance(sampling, list) else [sampling]
    return sorted({p["seed"] for p in items if isinstance(p, dict) and p.get("seed") is not None})


# ---- comparing manifests --------------------------------------------------------------------------
def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are kept as values."""
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def diff_manifests(manifests: list[dict], ignore: tuple[str, ...] = VOLATILE_FIELDS) -> list[str]:
    """The flattened field names whose values are not the same in every manifest (a field missing
    from some manifests counts as different), in order of first appearance."""
    flat = [flatten(m) for m in manifests]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    differ = []
    for key in keys:
        if any(key == i or key.startswith(i + ".") for i in ignore):
            continue
        values = [json.dumps(f[key], sort_keys=True, default=str) if key in f else None for f in flat]
        if len(set(values)) > 1:
            differ.append(key)
    return differ


# ---- params a run left at their defaults ----------------------------------------------------------
_RESOLVED_SECTIONS = ("engine", "sampling")  # the manifest sections that hold every resolved setting


def unset_params(runs: list[dict]) -> dict[int, list[str]]:
    """Per run id, the ``engine.*`` and ``sampling.*`` params that other runs of its experiment
    store and it does not (it left them at their defaults: a run stores only what its YAML sets)."""
    keys: dict[str, dict] = {}
    for run in runs:
        keys.setdefault(run["experiment"], {}).update(
            dict.fromkeys(k for k in run["params"] if k.split(".", 1)[0] in _RESOLVED_SECTIONS))
    unset = {run["run_id"]: [k for k in keys[run["experiment"]] if k not in run["params"]] for run in runs}
    return {run_id: missing for run_id, missing in unset.items() if missing}


def fill_unset_params(runs: list[dict], unset: dict[int, list[str]], manifests: dict[int, dict]) -> None:
    """Set each run's ``unset`` params (``unset_params``) to the values it ran with: those its
    manifest (``manifests`` by run id) recorded in its resolved ``engine`` and ``sampling``
    sections; a param the manifest lacks stays unset."""
    for run in runs:
        manifest = manifests.get(run["run_id"]) or {}
        for key in unset.get(run["run_id"], ()):
            section, _, name = key.partition(".")
            resolved = manifest.get(section)
            if isinstance(resolved, dict) and name in resolved:
                run["params"][key] = resolved[name]
