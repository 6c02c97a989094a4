"""LoRA in benchmarks: random adapters spread round-robin over a workload's requests, on
pagedlab (``enable_lora``, one slot per adapter) and on HF transformers with PEFT (unmerged).

``pagedlab bench throughput --num-loras N --lora-rank R [--lora-targets ...]`` builds a
``LoRABench``; ``LLM.benchmark(lora_requests=[...])`` takes adapters of its own. Request ``i`` of a
batch runs adapter ``i mod N``, so a batch of ``b`` requests runs ``min(b, N)`` adapters.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedlab.config import resolve_device, resolve_dtype
from pagedlab.lora.adapter import SUPPORTED_TARGETS, read_adapter_config
from pagedlab.lora.random_adapter import parse_targets, write_random_adapters
from pagedlab.lora.request import LoRARequest


def as_list(loras: LoRARequest | Sequence[LoRARequest]) -> list[LoRARequest]:
    """``loras`` (one ``LoRARequest`` or a non-empty sequence of them) as a list."""
    listed = [loras] if isinstance(loras, LoRARequest) else list(loras) if isinstance(loras, Sequence) else []
    if not listed or not all(isinstance(lora, LoRARequest) for lora in listed):
        raise ValueError(f"lora_requests={loras!r} is invalid: give a LoRARequest or a non-empty list of "
                         "them")
    return listed


def round_robin(loras: LoRARequest | Sequence[LoRARequest], count: int) -> list[LoRARequest]:
    """The adapter of each of ``count`` requests: ``loras[i % len(loras)]`` (one adapter: all)."""
    listed = as_list(loras)
    return [listed[i % len(listed)] for i in range(count)]


def distinct(per_request: Iterable[Sequence[LoRARequest] | None]) -> list[LoRARequest]:
    """The adapters of one or more batches (lists of each request's adapter, or None), each once."""
    return list(dict.fromkeys(lora for loras in per_request for lora in loras or []))


def label(loras: Sequence[LoRARequest] | None) -> str:
    """A row label's part naming how many adapters its batch ran ("" without)."""
    return f" loras={len(set(loras))}" if loras else ""


def row_record(loras: Sequence[LoRARequest] | None, **settings) -> dict:
    """``{"lora": ...}``, what a benchmark row records of the adapters its requests ran (how many,
    which, their ranks and targets, and ``settings``); ``{}`` without adapters."""
    if not loras:
        return {}
    adapters = distinct([loras])
    configs = [read_adapter_config(lora.lora_path) for lora in adapters]
    return {"lora": {"adapters_in_batch": len(adapters), "names": [lora.lora_name for lora in adapters],
                     "ranks": sorted({c.get("r") for c in configs}),
                     "targets": sorted({t for c in configs for t in c.get("target_modules") or []}),
                     **settings}}


@dataclass(frozen=True)
class LoRABench:
    """``num_loras`` random rank-``rank`` adapters on ``targets`` (module names, or short ones:
    ``"q,k,v,o,gate,up,down"``), written for the benchmarked model's shape."""

    num_loras: int
    rank: int = 16
    targets: str | Sequence[str] = SUPPORTED_TARGETS

    def __post_init__(self):
        for name in ("num_loras", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                flag = "--num-loras" if name == "num_loras" else "--lora-rank"
                raise ValueError(f"{flag} {value!r} is invalid: it must be an integer >= 1")
        object.__setattr__(self, "targets", parse_targets(self.targets))

    @property
    def label(self) -> str:
        return f"lora={self.num_loras}xr{self.rank}"

    def engine_args(self) -> dict:
        """pagedlab's settings: LoRA on, a GPU slot per adapter, slots of the adapters' rank."""
        return {"enable_lora": True, "max_loras": self.num_loras, "max_lora_rank": self.rank}

    def spread_over(self, workloads: list, root: str | Path, hf_config, engine_args: dict) -> list:
        """Write the adapters under ``root`` (seeds 0..num_loras-1, in the dtype ``engine_args``
        give the model) and return ``workloads`` (``pagedlab.workloads.Workload``) with them
        spread round-robin over each one's requests."""
        dtype = resolve_dtype(engine_args.get("dtype", "auto"), hf_config,
                              resolve_device(engine_args.get("device", "auto")))
        loras = write_random_adapters(root, hf_config, self.num_loras, self.rank, self.targets, dtype)
        return [dataclasses.replace(w, loras=round_robin(loras, len(w.prompts))) for w in workloads]


def check_hf_peer(workload_name: str) -> None:
    """A ValueError, before anything runs, where the HF peer cannot apply adapters."""
    if workload_name == "W-nano":
        raise ValueError("the HF peer of W-nano (generate_batch) takes no LoRA adapters: LoRA on W-nano runs "
                         "with --backend pagedlab")
    if importlib.util.find_spec("peft") is None:
        raise ValueError("the HF peer applies LoRA adapters with peft, which is not installed: pip install "
                         "peft (or run --backend pagedlab alone)")


def peft_peer(model, loras: Sequence[LoRARequest]):
    """``model`` (HF transformers) with every adapter of ``loras`` loaded by PEFT, unmerged, in
    the model's dtype (PEFT would otherwise upcast bf16 adapters to float32)."""
    from peft import PeftModel

    distinct = list(dict.fromkeys(loras))
    peer = PeftModel.from_pretrained(model, distinct[0].lora_path, adapter_name=distinct[0].lora_name,
                                     autocast_adapter_dtype=False)
    for lora in distinct[1:]:
        peer.load_adapter(lora.lora_path, adapter_name=lora.lora_name, autocast_adapter_dtype=False)
    return peer.eval()


def peft_generate_kwargs(peer, loras: Sequence[LoRARequest]) -> dict:
    """``generate`` arguments that run row ``i`` under ``loras[i]``: one adapter is made the
    active one; several go row by row through PEFT's mixed-batch ``adapter_names``."""
    names = [lora.lora_name for lora in loras]
    if len(set(names)) == 1:
        peer.set_adapter(names[0])
        return {}
    return {"adapter_names": names}
