"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter in PEFT format (a directory with ``adapter_config.json`` and
    ``adapter_model.safetensors`` or ``adapter_model.bin``), named by ``lora_name`` and identified
    by ``lora_int_id`` (an integer >= 1, unique per adapter: the engine caches weights and KV
    blocks under it).
    ``base_model_name``: the parent the server's ``/v1/models`` lists (default: the served model)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        lora_id = self.lora_int_id
        if not isinstance(lora_id, int) or isinstance(lora_id, bool) or lora_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} is invalid: it must be an integer >= 1 "
                             "(each adapter its own)")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r} has no lora_path: give the adapter's PEFT "
                             "directory")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of ``lora_name``."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of ``lora_path``."""
        return self.lora_path
