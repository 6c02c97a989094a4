"""Engine configuration: what the user asked for, validated and resolved against the model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_CPU_DEFAULT_KV_BYTES = 1 << 30

# Settings that change only the plan (KV cache, scheduling, graphs); the rest need new weights.
PLAN_FIELDS = (
    "block_size", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
    "enable_chunked_prefill", "enforce_eager", "gpu_memory_utilization", "kv_cache_memory_bytes",
    "max_model_len", "async_scheduling", "enable_cascade_attention",
)


@dataclass
class EngineConfig:
    """Every engine argument of ``LLM(...)``; ``resolve`` fills the ``None``/"auto" ones."""

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # None: on for CUDA, off on the CPU
    enable_cascade_attention: bool = True
    load_format: str = "auto"
    trust_remote_code: bool = False
    device: str = "auto"
    tensor_parallel_size: int = 1
    quantization: str | None = None

    def validate(self) -> None:
        def bad(name, allowed):
            raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {name} must be {allowed}")

        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size % 16:
            bad("block_size", "a positive multiple of 16 (16, 32, 64, ...)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("gpu_memory_utilization", "in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            bad("kv_cache_memory_bytes", "a positive number of bytes or None")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            bad("max_num_seqs", "an integer >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "an integer >= 1 or None")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "an integer >= 2 or None")
        if self.load_format not in _LOAD_FORMATS:
            bad("load_format", f"one of {_LOAD_FORMATS}")
        if self.tensor_parallel_size != 1:
            bad("tensor_parallel_size", "1 (tensor parallelism is not available yet)")
        if self.quantization is not None:
            bad("quantization", "None (quantized weights are not supported yet)")
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in _DTYPES:
            bad("dtype", f"'auto' or one of {sorted(_DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            bad("device", "'auto', 'cpu', 'cuda' or 'cuda:N'")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} is invalid: no CUDA GPU is visible; use 'cpu' or 'auto'")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, hf_config, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's dtype on a GPU and float32 on the CPU (bf16 matmuls are slow there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    if config_dtype in (None, torch.float32):
        return torch.bfloat16
    return config_dtype


def model_max_len(hf_config) -> int:
    """Positions the model supports; a Mistral-style sliding window caps it, since attention
    here is always full (within the window the two are the same)."""
    limit = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", getattr(hf_config, "model_type", "") == "mistral")
    if window and uses_window:
        limit = min(limit, int(window))
    return limit


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    limit = model_max_len(hf_config)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} is invalid: the model supports at most {limit} positions "
            "(max_position_embeddings)")
    return requested


def resolve_max_num_batched_tokens(cfg: EngineConfig, max_model_len: int) -> int:
    if cfg.max_num_batched_tokens is not None:
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={cfg.max_num_batched_tokens} is invalid without chunked "
                f"prefill: it must be >= max_model_len ({max_model_len}) so every prompt fits in one step")
        return cfg.max_num_batched_tokens
    if cfg.enable_chunked_prefill:
        return 8192
    return max(8192, max_model_len)


def cpu_kv_cache_bytes(cfg: EngineConfig) -> int:
    return cfg.kv_cache_memory_bytes or _CPU_DEFAULT_KV_BYTES
