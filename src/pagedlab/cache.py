"""Where pagedlab keeps what it computes once and reuses across runs: converted GGUF models, the
lab's file digests, tuned kernel launches. ``PAGEDLAB_CACHE_DIR``, else
``$XDG_CACHE_HOME/pagedlab`` (``~/.cache/pagedlab``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache directory (not created here)."""
    root = os.environ.get("PAGEDLAB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pagedlab")
    return Path(root)
