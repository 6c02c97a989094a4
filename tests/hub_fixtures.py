"""A Hugging Face cache laid out as huggingface_hub lays it out, for hub model ids offline."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(cache_dir: Path, repo_id: str, model_dir: str, revision: str = "main",
                    commit: str = COMMIT, suffixes: tuple[str, ...] | None = None) -> Path:
    """The HF cache layout (huggingface_hub's docs, "Manage the cache"): content-addressed files in
    blobs/, the revision's files as symlinks in snapshots/<commit>/, refs/<revision> holding the
    commit."""
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for src in Path(model_dir).iterdir():
        if suffixes is not None and src.suffix not in suffixes:
            continue
        blob = repo_dir / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / src.name)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / revision).write_text(commit)
    return snapshot
