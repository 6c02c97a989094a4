"""Tensor parallelism: the process group of the ranks that shard one model (``parallel_state``),
its collectives (``communication``), how a model's sizes split over the ranks (``head_split``) and
how full tensors do (``sharding``); and vLLM's ``cleanup_dist_env_and_memory``, loaded on first use
(so that importing a module of this package alone does not load torch.distributed)."""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name != "cleanup_dist_env_and_memory":
        raise AttributeError(f"module 'pagedlab.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module("pagedlab.distributed.parallel_state"), name)
