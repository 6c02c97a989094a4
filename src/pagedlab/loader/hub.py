"""Hub model ids (``"HuggingFaceTB/SmolLM2-135M-Instruct"``) resolved to a local directory the way
transformers and vLLM do it, through ``huggingface_hub``: the local HF cache first, else a
download of only the files the engine reads (config, tokenizer, generation config, safetensors).

``HF_HUB_OFFLINE=1`` keeps it to the cache, ``HF_TOKEN`` (or ``hf auth login``) authenticates a
gated or private repository, ``revision`` picks a branch, tag or commit and ``download_dir``
replaces the cache directory (``$HF_HOME/hub``). The download shows huggingface_hub's progress
bars (``HF_HUB_DISABLE_PROGRESS_BARS=1`` hides them).
"""

from __future__ import annotations

import re
from pathlib import Path

from pagedlab.loader.safetensors import indexed_files

# The files the engine reads: config.json, generation_config.json, the tokenizer's files, the
# safetensors weights (and their index), a chat template kept beside them.
_CONFIG_PATTERNS = ["*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja"]
_WEIGHT_PATTERNS = ["*.safetensors"]
# Other layouts some repositories ship beside the HF one (Meta's and Mistral's own checkpoints).
_IGNORE_PATTERNS = ["original/*", "consolidated*"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the form of a hub repository id ("org/name"), not of a local path."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.endswith((".gguf", ".json"))


def _offline() -> bool:
    import huggingface_hub

    if hasattr(huggingface_hub, "is_offline_mode"):
        return huggingface_hub.is_offline_mode()
    return bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def _has_weights(path: Path) -> bool:
    """Whether the snapshot holds the whole checkpoint: every shard its index names (a download
    cut short leaves some out, and huggingface_hub's cache lookup does not check), else a
    .safetensors file."""
    files = indexed_files(path)
    return all(f.is_file() for f in files) if files is not None else any(path.glob("*.safetensors"))


def _where(revision: str | None, download_dir: str | None, weights: bool) -> dict:
    """``snapshot_download``'s arguments for the files the engine reads of a revision."""
    patterns = _CONFIG_PATTERNS + (_WEIGHT_PATTERNS if weights else [])
    return {"revision": revision, "cache_dir": download_dir, "allow_patterns": patterns,
            "ignore_patterns": _IGNORE_PATTERNS}


def cached_hub_model(repo_id: str, revision: str | None = None, download_dir: str | None = None,
                     weights: bool = True) -> Path | None:
    """The snapshot directory of hub model ``repo_id`` that the HF cache (or ``download_dir``)
    holds for ``revision`` (the commit its ``refs/`` entry names; ``main`` by default), with
    config.json and, unless ``weights=False``, the whole checkpoint: what ``resolve_hub_model``
    loads without downloading. Found offline; None when the cache holds no such snapshot."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = _where(revision, download_dir, weights)
    try:
        cached = Path(snapshot_download(repo_id, local_files_only=True, **where))
        if (cached / "config.json").is_file() and (_has_weights(cached) or not weights):
            return cached
    except (LocalEntryNotFoundError, OSError):
        pass  # not cached, or only partly (IncompleteSnapshotError is an OSError)
    return None


def resolve_hub_model(repo_id: str, revision: str | None = None, download_dir: str | None = None,
                      weights: bool = True) -> Path:
    """The snapshot directory of hub model ``repo_id``: from the HF cache (or ``download_dir``) when
    it holds the files (``cached_hub_model``), otherwise downloaded there. ``weights=False`` (dummy
    weights, a tokenizer) skips the safetensors. A ValueError says why a model cannot be had and
    what to do instead."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    cached = cached_hub_model(repo_id, revision, download_dir, weights)
    if cached is not None:
        return cached
    where = _where(revision, download_dir, weights)
    what = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    local_hint = ("download it where there is network (`hf download " + repo_id + " --local-dir DIR`) and "
                  "give the directory instead: LLM('DIR') or --model DIR")
    if _offline():
        raise ValueError(f"model {what} is not in the Hugging Face cache "
                         f"({download_dir or 'the default HF cache, $HF_HOME/hub'}) and HF_HUB_OFFLINE=1 "
                         f"forbids downloading it: unset HF_HUB_OFFLINE, or {local_hint}")
    try:
        return Path(snapshot_download(repo_id, **where))
    except GatedRepoError:
        raise ValueError(f"model {what} is gated: accept its licence on huggingface.co and set HF_TOKEN "
                         "(or run `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {what} was not found on the Hugging Face Hub (a private repository needs "
                         "HF_TOKEN); a local model is a directory path, a .gguf file or an embedded "
                         "name") from None
    except RevisionNotFoundError:
        raise ValueError(f"revision {revision!r} of model {repo_id!r} does not exist on the Hub: give a "
                         "branch, tag or commit of it") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ValueError(f"model {what} is not in the Hugging Face cache and could not be downloaded (no "
                         f"network?): {type(e).__name__}: {str(e).splitlines()[0]}. {local_hint[0].upper()}"
                         f"{local_hint[1:]}") from None
