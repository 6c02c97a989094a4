"""Engine configuration: the one place engine settings and their defaults are written.

``EngineConfig`` is what ``LLM(...)``, the CLI flags (``pagedlab.cli.engine_args``), the server,
the lm-eval model and the lab's YAML ``engine:`` section all derive from. Each field's metadata
says whether it changes only the plan (KV cache, scheduling, graphs: ``set_model_args`` can
change it without reloading weights) and gives its help text.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedlab.hf_overrides import check_hf_overrides, describe_hf_overrides
from pagedlab.names import did_you_mean
from pagedlab.scalars import python_scalar
from pagedlab.speculative_config import resolve_speculative_config

if TYPE_CHECKING:  # torch loads only where a dtype or device is resolved: the CLI starts without it
    import torch

DTYPE_NAMES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # "fp8_e4m3" is vLLM's alias of "fp8"
QUANTIZATIONS = (None, "awq", "fp8")  # quantization.formats resolves each against config.json
TOKENIZER_MODES = ("auto", "slow")
EXECUTOR_BACKENDS = ("mp", "ray")
SCHEDULING_POLICIES = ("fcfs", "priority")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")  # vLLM's
# the settings that name one of a few choices (checked before their type: the list is the better hint)
_CHOICES = {"tokenizer_mode": TOKENIZER_MODES, "kv_cache_dtype": KV_CACHE_DTYPES, "load_format": LOAD_FORMATS,
            "attention_backend": ATTENTION_BACKENDS, "distributed_executor_backend": EXECUTOR_BACKENDS,
            "quantization": QUANTIZATIONS, "scheduling_policy": SCHEDULING_POLICIES,
            "logprobs_mode": LOGPROBS_MODES}
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # a step's token budget with chunked prefill, unless set
_CPU_DEFAULT_KV_BYTES = 1 << 30


# A field annotation's type names: what fits (a bool is no integer: enforce_eager="no" would be
# true; a path is a string), and how an error names it.
_KINDS = {
    "None": (lambda v: v is None, "None"),
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, (str, Path)), "a string"),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "dict": (lambda v: isinstance(v, dict), "a dict"),
    "torch.dtype": (lambda v: type(v).__module__ == "torch", "a torch.dtype"),
    "Callable": (callable, "a callable"),
}


def _setting(default, help: str, plan: bool = False):
    return field(default=default, metadata={"help": help, "plan": plan})


@dataclass
class EngineConfig:
    """Every engine argument of ``LLM(...)``, with vLLM's names and defaults; the engine resolves
    the ``None``/"auto" ones against the model and the device."""

    model: str = _setting(DEFAULT_MODEL, "local HF directory, .gguf file, hub model id (org/name: the HF "
                                         "cache, else a download) or an embedded model")
    tokenizer: str | None = _setting(None, "tokenizer directory or hub id (default: the model's)")
    tokenizer_mode: str = _setting("auto", "auto (the fast tokenizer where there is one) or slow")
    revision: str | None = _setting(None, "hub model revision: a branch, tag or commit (default: main)")
    download_dir: str | None = _setting(None, "where hub models are downloaded and looked up (default: "
                                              "the HF cache, $HF_HOME/hub)")
    served_model_name: str | list[str] | None = _setting(
        None, "the name(s) the server answers to and reports (default: the model argument)")
    generation_config: str = _setting(
        "auto", "the sampling defaults of a request that sets none (LLM.generate without SamplingParams, "
                "a server request's unset fields): auto (the model's generation_config.json: temperature, "
                "top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm (SamplingParams' own) or "
                "a directory holding a generation_config.json")
    override_generation_config: dict | None = _setting(
        None, "values over (or, with generation_config=vllm, instead of) the generation config's, "
              "e.g. {\"temperature\": 0.5}: temperature, top_p, top_k, min_p, repetition_penalty, "
              "max_new_tokens (which, set here, caps every server request, as vLLM's)")
    hf_overrides: dict | Callable | None = _setting(
        None, "changes to the model's HF config before it is built, vLLM's: a dict such as "
              "{\"num_hidden_layers\": 4} or {\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}, "
              "\"max_position_embeddings\": 65536} (nested dicts merge into sub-configs), or (LLM(...) only) "
              "a callable taking and returning the PretrainedConfig; max_model_len and the KV cache follow "
              "the changed config, the tokenizer and generation config stay as they are")
    dtype: str | torch.dtype = _setting("auto", "auto, float32, bfloat16 or float16 (auto: the checkpoint's "
                                                "on a GPU, float32 on the CPU)")
    seed: int | None = _setting(0, "seed of the engine's sampler (requests without their own seed) and of "
                                   "dummy weights; None draws one at random (kept in the config)")
    max_model_len: int | None = _setting(None, "context length (default: the model's)", plan=True)
    block_size: int = _setting(16, "KV cache block size in tokens, a multiple of 16", plan=True)
    gpu_memory_utilization: float = _setting(
        0.9, "share of the GPU's total memory this engine may use (weights, activations, KV cache), as in "
             "vLLM: memory other processes hold is not counted against it", plan=True)
    kv_cache_memory_bytes: int | None = _setting(
        None, "KV cache size, e.g. 4GiB (default: 1 GiB on the CPU; on a GPU from gpu_memory_utilization)",
        plan=True)
    max_num_seqs: int = _setting(256, "most sequences in one step", plan=True)
    max_num_batched_tokens: int | None = _setting(
        None, f"token budget of one step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS}, or max_model_len "
              "without chunked prefill)", plan=True)
    enable_prefix_caching: bool = _setting(True, "reuse the KV blocks of cached prompt prefixes", plan=True)
    enable_chunked_prefill: bool = _setting(True, "split long prompts over several steps", plan=True)
    scheduling_policy: str = _setting(
        "fcfs", "which waiting request runs first and which running one is preempted when the KV cache "
                "runs out: fcfs (arrival order) or priority (a request's priority, lower first, then "
                "arrival; vLLM's)", plan=True)
    stream_interval: int = _setting(
        1, "new tokens batched into each streamed output of a request, vLLM's --stream-interval (a request's "
           "stream_interval may raise it); its first and final outputs go out at once", plan=True)
    speculative_config: dict | None = _setting(
        None, "speculative decoding, vLLM's dict: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
              "\"prompt_lookup_max\": n, \"prompt_lookup_min\": m} proposes up to k tokens that followed the "
              "longest earlier match (m to n tokens) of the sequence's end; {\"method\": \"draft_model\", "
              "\"model\": path, \"num_speculative_tokens\": k} has a smaller model of the same vocabulary "
              "propose k tokens greedily; either may add \"num_speculative_tokens_per_batch_size\": "
              "[[first, last, K], ...] (vLLM's dynamic speculative decoding: at most K tokens a request "
              "in a step of first..last requests); all are checked in one step, and outputs stay those "
              "of plain decoding", plan=True)
    chunked_prefill_size: int | None = _setting(
        None, "SGLang's name: chunked prefill with this token budget per step (sets "
              "max_num_batched_tokens)",
        plan=True)
    kv_cache_dtype: str = _setting(
        "auto", "auto (the model's dtype) or fp8 (alias fp8_e4m3: E4M3 with per-layer scales, twice the "
                "tokens per byte)", plan=True)
    enforce_eager: bool = _setting(False, "no CUDA graphs", plan=True)
    cuda_graph_mixed_steps: bool = _setting(
        True, "steps with prefill tokens (mixed and prefill steps) replay CUDA graphs at padded token "
              "counts too, not only decode steps (off: they run eagerly; enforce_eager turns both off)",
        plan=True)
    async_scheduling: bool | None = _setting(
        None, "prepare each step while the GPU runs the one before (default: on CUDA, off on the CPU; "
              "with speculative_config only between steps a batch-size schedule caps at K=0, since "
              "proposals need each step's tokens, and never beside a draft where both models are windowed)",
        plan=True)
    enable_cascade_attention: bool = _setting(
        True, "a decode batch attends its shared cached prefix once (Triton backend)", plan=True)
    batch_invariant: bool = _setting(
        False, "bitwise-identical logprobs for a prompt whatever else is in the batch, its place in it, "
               "prefix caching and chunked prefill: fixed-order matmuls, norms, softmax and attention "
               "(docs/repro.md: costs and limits)", plan=True)
    enable_return_routed_experts: bool = _setting(
        False, "MoE models: each completion's final output returns the experts every layer chose for each "
               "token (CompletionOutput.routed_experts; vLLM's, for routing replay in RL)", plan=True)
    load_format: str = _setting("auto", "auto, safetensors, gguf or dummy (random weights from config.json)")
    trust_remote_code: bool = _setting(
        False, "accepted for vLLM scripts; pagedlab never runs a model repository's own code (an "
               "architecture it does not implement is an error listing those it does)")
    device: str = _setting("auto", "auto, cpu, cuda or cuda:N")
    attention_backend: str = _setting("auto", "auto (Triton on CUDA, torch on the CPU), torch or triton")
    tensor_parallel_size: int = _setting(
        1, "processes to shard the model over (one per GPU; gloo on the CPU); it must divide the heads")
    distributed_executor_backend: str = _setting(
        "mp", "what runs the tensor-parallel workers: mp (processes of this host) or ray (actors placed "
              "by Ray, on one node or several)")
    disable_custom_all_reduce: bool = _setting(
        False, "all-reduce through NCCL only (default: small messages through pagedlab's one-shot "
               "all-reduce over GPU peer memory)")
    swap_space: float = _setting(4.0, "CPU swap space in GiB, accepted for vLLM scripts and unused: a "
                                      "preempted sequence is recomputed, never swapped")
    cpu_offload_gb: float = _setting(0.0, "GiB of weights to keep in CPU memory: not supported, must be 0")
    enable_sleep_mode: bool = _setting(False, "accepted for vLLM scripts: LLM.sleep() / wake_up() work on "
                                              "every engine (pagedlab's allocator needs no switch for them)")
    max_logprobs: int | None = _setting(
        None, "most logprobs / prompt_logprobs a request may ask for, -1 for no cap (vLLM's; its default is "
              "20, pagedlab's None: up to the vocabulary offline, 20 in `pagedlab serve`)")
    logprobs_mode: str = _setting(
        "raw_logprobs", "what logprobs hold (vLLM's): raw_logprobs (log_softmax of the model's logits), "
                        "raw_logits, processed_logprobs (of the distribution sampled from: after logit_bias, "
                        "allowed ids, bad words, penalties, temperature, min-p, top-k, top-p) or "
                        "processed_logits; prompt logprobs stay raw", plan=True)
    disable_log_stats: bool = _setting(True, "no periodic throughput/KV-cache log lines from LLM.generate "
                                             "(--no-disable-log-stats logs one every 5 s)", plan=True)
    quantization: str | None = _setting(
        None, "quantized weight format: None (the checkpoint's own, from config.json's quantization_config, "
              "else dense), awq (AutoAWQ 4-bit GEMM checkpoints; round-to-nearest 4-bit of a dense one) or "
              "fp8 (compressed-tensors FP8 checkpoints; FP8 E4M3 quantized at load from a dense one)")
    enable_lora: bool = _setting(False, "serve LoRA adapters (PEFT directories) given per request")
    max_loras: int = _setting(1, "adapters one step can run (GPU slots, least recently used evicted)")
    max_lora_rank: int = _setting(16, "largest adapter rank accepted (the slots' size)")
    max_cpu_loras: int | None = _setting(None, "adapters kept read in CPU memory (default: max_loras)")
    reasoning_config: dict | None = _setting(
        None, "the thinking markers of SamplingParams.thinking_token_budget, vLLM's dict: "
              "{\"reasoning_start_str\": \"<think>\", \"reasoning_end_str\": \"</think>\"} (the end may "
              "carry a phrase forced with it), or {\"reasoning_parser\": \"qwen3\"} for that parser's tags "
              "(pagedlab serve's --reasoning-parser fills it in)")
    enable_trace_replay: bool = _setting(
        False, "accept SamplingParams.trace_decode_token_ids (vLLM's gate on forcing a request's tokens; "
               "a trace on an engine without it is refused)")

    def __post_init__(self):
        for f in dataclasses.fields(self):  # numpy numbers from a sweep's table as Python ones
            setattr(self, f.name, python_scalar(getattr(self, f.name)))
        if self.seed is None:
            self.seed = random.SystemRandom().randrange(1 << 31)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid setting and what it may be."""

        def bad(name, allowed):
            raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {name} must be {allowed}")

        for f in dataclasses.fields(self):  # the type (or choice) first, so no check below meets a str
            value, kinds = getattr(self, f.name), [_KINDS[name] for name in f.type.split(" | ")]
            if f.name in _CHOICES and value not in _CHOICES[f.name]:
                bad(f.name, f"one of {_CHOICES[f.name]}")
            if not any(fits(value) for fits, _ in kinds):
                bad(f.name, " or ".join(words for _, words in kinds))
        if self.block_size < 1 or self.block_size % 16:
            bad("block_size", "a positive multiple of 16 (16, 32, 64, ...)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("gpu_memory_utilization", "in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            bad("kv_cache_memory_bytes", "a positive number of bytes or None")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", "an integer >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "an integer >= 1 or None")
        if self.stream_interval < 1:
            bad("stream_interval", "an integer >= 1 (new tokens batched into each streamed output)")
        if self.max_logprobs is not None and self.max_logprobs < -1:
            bad("max_logprobs", "an integer >= 0, -1 (no cap) or None")
        if self.chunked_prefill_size is not None:
            self._check_chunked_prefill_size()
        check_hf_overrides(self.hf_overrides)
        speculative = resolve_speculative_config(self.speculative_config)
        if speculative is not None and speculative.model is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config={self.speculative_config!r} is invalid with "
                             f"tensor_parallel_size={self.tensor_parallel_size}: a draft model runs with a "
                             "target of tensor_parallel_size=1 (n-gram proposals work at any size)")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "an integer >= 2 or None")
        if self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", "an integer >= 1 that divides the attention heads")
        self._validate_lora(bad)
        if self.swap_space < 0:
            bad("swap_space", "a number of GiB >= 0 (it is unused: preempted sequences are recomputed)")
        if self.batch_invariant and self.tensor_parallel_size != 1:
            raise ValueError(f"batch_invariant=True with tensor_parallel_size={self.tensor_parallel_size}: "
                             "batch-invariant mode runs on one device (an all-reduce's summation order "
                             "follows the message size); use tensor_parallel_size=1")
        if self.cpu_offload_gb:
            raise ValueError(f"cpu_offload_gb={self.cpu_offload_gb!r} is not supported: pagedlab keeps every "
                             "weight on the device; use 0, a smaller model, or tensor_parallel_size > 1")
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            bad("dtype", f"'auto' or one of {sorted(DTYPE_NAMES)}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            bad("device", "'auto', 'cpu', 'cuda' or 'cuda:N'")

    def _validate_lora(self, bad) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                bad(name, "an integer >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            bad("max_cpu_loras", f"None or an integer >= max_loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError(f"enable_lora=True with tensor_parallel_size={self.tensor_parallel_size} is not "
                             "supported: LoRA adapters run with tensor_parallel_size=1 only")

    def _check_chunked_prefill_size(self) -> None:
        size = self.chunked_prefill_size
        if size < 1:
            raise ValueError(f"chunked_prefill_size={size!r} is invalid: chunked_prefill_size must be an "
                             "integer >= 1 (the token budget of one step) or None")
        if not self.enable_chunked_prefill:
            raise ValueError(f"chunked_prefill_size={size!r} is invalid with enable_chunked_prefill=False: "
                             "it sets the chunk size of chunked prefill")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens != size:
            raise ValueError(f"chunked_prefill_size={size!r} is invalid next to max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: both set the token budget of a step; give one")

    def to_dict(self) -> dict:
        """The config as plain values, ``dtype`` by name (``resolved_settings`` starts from it)."""
        d = dataclasses.asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        d["hf_overrides"] = describe_hf_overrides(self.hf_overrides)  # a callable by its name
        return d

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """``EngineConfig(**kwargs)``, but an unknown name is a ValueError listing the known ones."""
        unknown = sorted(set(kwargs) - set(ENGINE_FIELDS))
        if unknown:
            hint = did_you_mean(unknown[0], ENGINE_FIELDS)
            raise ValueError(f"unknown argument {unknown[0]!r}{hint}" if hint else
                             f"unknown argument {unknown[0]!r}: the engine takes {list(ENGINE_FIELDS)}")
        return cls(**kwargs)


ENGINE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineConfig))
# Settings that change only the plan (KV cache, scheduling, graphs); the rest need new weights.
PLAN_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.metadata["plan"])
WEIGHT_FIELDS: tuple[str, ...] = tuple(name for name in ENGINE_FIELDS if name not in PLAN_FIELDS)
ENGINE_DEFAULTS: dict = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


@dataclass(frozen=True)
class DraftModelInfo:
    """A draft model's identity (speculative_config's ``model``), in ``EngineInfo``'s field names."""

    config: EngineConfig  # the engine's
    model_name: str  # as given in speculative_config
    model_path: Path
    original_file: Path | None
    load_format: str
    hf_config: Any
    weight_bytes: int


@dataclass(frozen=True)
class EngineInfo:
    """What a loaded engine resolved its settings to: the public view the lab, the server and
    the manifest read (``LLM.get_engine_info()``), instead of the engine's internals."""

    config: EngineConfig  # as given (after the last set_model_args)
    model_name: str  # what the user asked for
    model_path: Path  # the HF-layout directory the weights and config.json come from
    original_file: Path | None  # the GGUF file a converted model came from
    load_format: str  # "safetensors" or "dummy", resolved from "auto"/"gguf"
    hf_config: Any  # transformers' PretrainedConfig
    tokenizer: Any  # the transformers tokenizer, or None for a model without one
    tokenizer_path: Path | None
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_batched_tokens: int
    async_scheduling: bool
    attention_backend: str  # "torch" or "triton"
    cascade_attention: bool  # asked for, and the backend can run it
    cuda_graphs: bool  # decode steps replay CUDA graphs
    num_kv_blocks: int
    kv_cache_dtype: torch.dtype  # what the KV cache stores: the model's dtype, or torch.float8_e4m3fn
    eos_token_ids: tuple[int, ...] = ()  # the ids that end a sequence (config, generation config, tokenizer)
    quantization: str | None = None  # the weight format loaded, resolved from the request and config.json
    weight_bytes: int = 0  # the parameters as stored (this rank's shard under tensor parallelism)
    mixed_cuda_graphs: bool = False  # steps with prefill tokens replay CUDA graphs too
    # SamplingParams fields of a request that sets none (EngineConfig.generation_config)
    default_sampling_args: dict = field(default_factory=dict)
    draft_model: DraftModelInfo | None = None  # speculative decoding's draft model, where one runs

    def resolved_settings(self) -> dict:
        """The engine settings with every "auto"/None replaced by what the engine uses."""
        settings = self.config.to_dict()
        settings.update(
            dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
            max_model_len=self.max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
            async_scheduling=self.async_scheduling, attention_backend=self.attention_backend,
            enable_cascade_attention=self.cascade_attention, num_kv_blocks=self.num_kv_blocks,
            quantization=self.quantization, kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."))
        speculative = resolve_speculative_config(self.config.speculative_config)
        settings["speculative_config"] = speculative.to_dict() if speculative is not None else None
        return settings


def resolve_quantization(requested: str | None, hf_config) -> str | None:
    """The weight format the engine loads ("awq", "fp8" or None for dense): the checkpoint's
    ``quantization_config`` when ``requested`` is None; an explicit value must match it, or on a
    dense checkpoint says to quantize at load (see ``pagedlab.quantization.formats``)."""
    from pagedlab.quantization.formats import resolve_quant_config

    quant_config = resolve_quant_config(requested, hf_config)  # unsupported variants fail here, by name
    return quant_config.name if quant_config is not None else None


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's dtype for "auto", FP8 E4M3 for "fp8"/"fp8_e4m3"."""
    import torch

    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid: kv_cache_dtype must be one of "
                     f"{KV_CACHE_DTYPES}")


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} is invalid: no CUDA GPU is visible; use 'cpu' or 'auto'")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, hf_config, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's dtype on a GPU and float32 on the CPU (bf16 matmuls are slow there)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return getattr(torch, DTYPE_NAMES[dtype])
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, DTYPE_NAMES[config_dtype]) if config_dtype in DTYPE_NAMES else None
    if config_dtype in (None, torch.float32):
        return torch.bfloat16
    return config_dtype


def model_max_len(hf_config) -> int:
    """Positions the model supports: ``max_position_embeddings``, times the RoPE scaling ``factor``
    that stretches it (linear, dynamic; YaRN's from its ``original_max_position_embeddings``), as
    vLLM derives it. Llama 3's and LongRoPE's scaling, and per-layer-type RoPE (Gemma 3), come with
    the scaled length already. Sliding windows do not cap it, since the attention kernels mask keys
    older than each layer's window."""
    limit = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in ("default", "llama3", "longrope", "su"):
        return limit
    if rope["rope_type"] == "yarn":
        limit = rope.get("original_max_position_embeddings") or limit
    return int(limit * (rope.get("factor") or 1.0))


def attention_windows(hf_config) -> list[int | None]:
    """Each layer's sliding window (a query sees itself and the ``W - 1`` keys before it), None
    for a full-attention layer: ``sliding_window`` on every layer (Mistral, Mixtral, Phi-3), or
    on the ``layer_types`` "sliding_attention" layers (Gemma 2/3, Qwen2/3's ``max_window_layers``).
    A config whose attention also sees later tokens (``use_bidirectional_attention``) is refused."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported: its tokens attend to later "
                         "ones too (an embedding model's attention), and pagedlab runs causal decoders only")
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return [int(window) if kind == "sliding_attention" else None for kind in layer_types]
    return [int(window)] * num_layers


def kv_release_window(hf_config) -> int | None:
    """The window after which a sequence's keys can be freed: the widest layer window when every
    layer is windowed, None when any layer attends in full (then every key stays needed)."""
    windows = attention_windows(hf_config)
    return None if not windows or None in windows else max(windows)


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    limit = model_max_len(hf_config)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} is invalid: the model supports at most {limit} positions "
            "(max_position_embeddings, times its RoPE scaling factor)")
    return requested


def resolve_max_num_batched_tokens(cfg: EngineConfig, max_model_len: int) -> int:
    if cfg.chunked_prefill_size is not None:
        return cfg.chunked_prefill_size
    if cfg.max_num_batched_tokens is not None:
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={cfg.max_num_batched_tokens} is invalid without chunked "
                f"prefill: it must be >= max_model_len ({max_model_len}) so every prompt fits in one step")
        return cfg.max_num_batched_tokens
    if cfg.enable_chunked_prefill:
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)


def cpu_kv_cache_bytes(cfg: EngineConfig) -> int:
    return cfg.kv_cache_memory_bytes or _CPU_DEFAULT_KV_BYTES
