"""``pagedlab plan``: will a model fit a GPU, before anything is loaded, from ``config.json`` alone.

Per GPU of a tensor-parallel group: the weights (linears cut N ways, the embedding and LM head
cut along the vocabulary, KV heads replicated when there are fewer than N), the activation peak
of the largest step (the engine profiles the same step before it sizes the KV cache), and the
KV cache that the rest of ``gpu_memory_utilization`` holds, in tokens and in sequences of
``max_model_len``. When it does not fit, the smallest tensor-parallel size, then quantization,
that does. The engine itself sizes the cache by measuring; this is the same arithmetic done
ahead of time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from pagedlab.config import resolve_max_model_len
from pagedlab.distributed.head_split import split_attention_heads

GIB = 1 << 30
# Memory as nvidia-smi reports it (MiB) for the GPUs researchers name.
KNOWN_GPUS_MIB = {
    "H200": 143771, "H100-80GB": 81559, "H100-94GB": 95830, "A100-80GB": 81920, "A100-40GB": 40960,
    "L40S": 46068, "A10G": 23028, "L4": 23034, "RTX-4090": 24564, "RTX-3090": 24576, "RTX-A6000": 49140,
    "V100-32GB": 32768, "T4": 15360,
}
CUDA_CONTEXT_BYTES = 512 << 20  # the CUDA context and libraries, outside torch's allocator
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
KV_BYTES = {"auto": None, "fp8": 1, "fp8_e4m3": 1}
AWQ_GROUP = 128
# The sizes models are published at (SmolLM2, Qwen, Llama, Mistral/Mixtral, Gemma, Phi, Pythia, ...).
NOMINAL_SIZES = ("70M", "135M", "160M", "360M", "410M", "0.5B", "0.6B", "1B", "1.4B", "1.5B", "1.7B", "2B",
                 "2.8B", "3B", "3.8B", "4B", "7B", "8B", "9B", "12B", "13B", "14B", "27B", "32B",
                 "34B", "47B", "70B", "72B", "110B", "235B", "405B")
NON_GATED_MLP = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi"}


@dataclass(frozen=True)
class ModelSizes:
    """A model's matrices, counted from its config: parameters of the linears (per layer, split
    into what tensor parallelism cuts and what the KV projections replicate), the vocabulary
    matrices, and the KV width."""

    num_layers: int
    hidden: int
    vocab: int
    tied: bool
    q_width: int  # heads x head_dim
    num_kv_heads: int
    head_dim: int
    intermediate: int  # one expert's
    experts: int
    mlp_matrices: int  # 3 for gated MLPs (gate, up, down), 2 otherwise

    @property
    def total_params(self) -> int:
        """Every parameter: the layers' linears and two norms each, the vocabulary matrices, the
        final norm."""
        layer = self.linear_params_per_rank(1)[0] + 2 * self.hidden
        return self.num_layers * layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def mlp_params(self) -> int:
        """One layer's MLP, every expert and the router."""
        router = self.experts * self.hidden if self.experts > 1 else 0
        return self.experts * self.mlp_matrices * self.hidden * self.intermediate + router

    @classmethod
    def from_config(cls, c) -> ModelSizes:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        q = c.num_attention_heads * head_dim
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 1
        inter = (getattr(c, "moe_intermediate_size", None) if experts > 1 else None) or c.intermediate_size
        matrices = 2 if getattr(c, "model_type", "") in NON_GATED_MLP else 3
        tied = bool(getattr(c, "tie_word_embeddings", False))
        return cls(c.num_hidden_layers, c.hidden_size, c.vocab_size, tied, q, kv_heads, head_dim, inter,
                   experts, matrices)

    def kv_heads_per_rank(self, tp: int) -> int:
        return max(1, self.num_kv_heads // tp)  # fewer KV heads than ranks: each rank keeps one

    def linear_params_per_rank(self, tp: int) -> tuple[int, int]:
        """(parameters, output features) of one layer's linears on one rank."""
        kv = self.kv_heads_per_rank(tp) * self.head_dim
        q = self.q_width // tp
        params = self.hidden * (q + 2 * kv) + q * self.hidden + self.mlp_params // tp
        outputs = q + 2 * kv + self.hidden + self.experts * ((self.mlp_matrices - 1) * self.intermediate // tp
                                                           + self.hidden)
        return params, outputs


@dataclass
class MemoryPlan:
    """Where one GPU's memory goes; bytes are per GPU of ``tensor_parallel_size``."""

    gpu_memory_bytes: int
    tensor_parallel_size: int
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    max_model_len: int
    gpu_memory_utilization: float
    parameters: int
    weight_bytes: int
    activation_peak_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    kv_tokens: int
    max_sequences: int
    fits: bool

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        setting = (f"TP={self.tensor_parallel_size}, {self.quantization or self.dtype}, "
                   f"KV {self.kv_cache_dtype}")
        head = (f"{setting}: weights {self.weight_bytes / GIB:.2f} GiB + activations "
                f"{self.activation_peak_bytes / GIB:.2f} GiB per GPU")
        if not self.fits:
            return f"{head}; does not fit ({max(self.kv_tokens, 0):,} KV tokens, one sequence needs " \
                   f"{self.max_model_len:,})"
        return (f"{head}; KV cache {self.kv_cache_bytes / GIB:.2f} GiB = {self.kv_tokens:,} tokens = "
                f"{self.max_sequences:,} sequences of {self.max_model_len:,}")


def plan_memory(hf_config, gpu_memory_bytes: int, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                quantization: str | None = None, kv_cache_dtype: str = "auto",
                max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                max_num_batched_tokens: int = 8192, block_size: int = 16) -> MemoryPlan:
    """The memory plan of one configuration (see the module docstring)."""
    _check(dtype, quantization, kv_cache_dtype, tensor_parallel_size, hf_config)
    sizes = ModelSizes.from_config(hf_config)
    tp = tensor_parallel_size
    max_model_len = resolve_max_model_len(max_model_len, hf_config)  # the engine's default and limit
    act_bytes = int(WEIGHT_BYTES[dtype])
    kv_bytes = KV_BYTES[kv_cache_dtype] or act_bytes
    weights = weight_bytes_per_gpu(sizes, tp, dtype, quantization)
    activations = activation_peak_bytes(sizes, tp, act_bytes, max_num_batched_tokens, max_model_len)
    per_token = 2 * sizes.num_layers * sizes.kv_heads_per_rank(tp) * sizes.head_dim * kv_bytes
    kv_cache = int(gpu_memory_bytes * gpu_memory_utilization) - CUDA_CONTEXT_BYTES - weights - activations
    tokens = kv_cache // (per_token * block_size) * block_size if kv_cache > 0 else 0
    return MemoryPlan(gpu_memory_bytes, tp, dtype, quantization, kv_cache_dtype, max_model_len,
                      gpu_memory_utilization, sizes.total_params, weights, activations, per_token,
                      max(kv_cache, 0), tokens, tokens // max_model_len, tokens >= max_model_len)


def weight_bytes_per_gpu(sizes: ModelSizes, tp: int, dtype: str, quantization: str | None) -> int:
    """Linears in the weight format (FP8: a byte a weight and a float32 scale per output; AWQ: half
    a byte a weight, a 16-bit scale and a 4-bit zero per output and group of 128 inputs);
    embeddings, LM head and norms stay in the model dtype."""
    linear, outputs = sizes.linear_params_per_rank(tp)
    if quantization == "fp8":
        layer = linear + 4 * outputs
    elif quantization == "awq":
        layer = linear / 2 + linear / AWQ_GROUP * 2.5
    else:
        layer = linear * WEIGHT_BYTES[dtype]
    vocab = math.ceil(sizes.vocab / tp) * sizes.hidden * (1 if sizes.tied else 2)
    dense = (vocab + (2 * sizes.num_layers + 1) * sizes.hidden) * WEIGHT_BYTES[dtype]
    return int(sizes.num_layers * layer + dense)


def activation_peak_bytes(sizes: ModelSizes, tp: int, act_bytes: int, num_tokens: int,
                          max_model_len: int) -> int:
    """The largest step's live tensors: the residual stream and its normed copy, one layer's QKV,
    attention output and MLP intermediates on this rank, and float32 logits of the sampled rows
    (the LM head gathers the whole vocabulary). The step is the one the engine profiles:
    ``num_tokens`` as sequences of at most ``max_model_len`` (the last one full too), up to 256
    logit rows each."""
    seq_len = min(num_tokens, max_model_len)
    num_seqs = -(-num_tokens // seq_len)
    per_token = (2 * sizes.hidden + (sizes.q_width + 2 * sizes.num_kv_heads * sizes.head_dim) // tp
                 + sizes.q_width // tp + sizes.mlp_matrices * sizes.intermediate // tp)
    logit_rows = num_seqs * min(seq_len, 256)
    return num_seqs * seq_len * per_token * act_bytes + logit_rows * sizes.vocab * (act_bytes + 4)


def suggestions(hf_config, gpu_memory_bytes: int, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                quantization: str | None = None, **kwargs) -> list[MemoryPlan]:
    """What fits when the asked configuration does not: the smallest tensor-parallel size (up to
    8) with the asked weight format, and the first of FP8 and AWQ that fits at the asked size."""
    found = []
    for tp in (1, 2, 4, 8):
        if tp > tensor_parallel_size and _splits(hf_config, tp):
            plan = plan_memory(hf_config, gpu_memory_bytes, tp, dtype, quantization, **kwargs)
            if plan.fits:
                found.append(plan)
                break
    for quant in ("fp8", "awq"):
        if quant != quantization:
            plan = plan_memory(hf_config, gpu_memory_bytes, tensor_parallel_size, dtype, quant, **kwargs)
            if plan.fits:
                found.append(plan)
                break
    return found


def _splits(hf_config, tp: int) -> bool:
    try:
        check_tensor_parallel_split(hf_config, tp)
    except ValueError:
        return False
    return True


def count_parameters(hf_config) -> int | None:
    """The model's parameters counted from its config as ``plan_memory`` counts them (linears,
    vocabulary matrices, norms; biases and learned position tables are left out), or None for a
    config without the usual fields."""
    try:
        return ModelSizes.from_config(hf_config).total_params
    except (AttributeError, TypeError):
        return None


def size_class(parameters: int | None) -> str | None:
    """The size a model is known by: the nearest of the sizes models are published at
    (``NOMINAL_SIZES``: Llama-2-7B's 6.74e9 parameters are "7B", Llama-3-8B's 8.03e9 "8B") when
    within 10% of it, else two significant digits in billions or three in millions or thousands
    (every digit of a whole number of billions: "175B"), in the largest unit the rounded number
    is at least 1 of: 999,600 parameters are "1M", not "1e+03K"."""
    if parameters is None:
        return None
    nearest = min(NOMINAL_SIZES, key=lambda name: abs(math.log(parameters / _nominal_count(name))))
    if abs(parameters / _nominal_count(nearest) - 1) <= 0.1:
        return nearest
    for scale, suffix, digits in ((1e9, "B", 2), (1e6, "M", 3), (1e3, "K", 3)):
        text = _significant(parameters / scale, digits)
        if float(text) >= 1:
            return text + suffix
    return str(parameters)


def _significant(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits, or to a whole number where its whole part has
    more; never in e-notation (``format``'s "g" writes 999.6 to 3 digits as "1e+03")."""
    if len(str(int(value))) >= digits:
        return str(round(value))
    return f"{value:.{digits}g}"


def _nominal_count(name: str) -> float:
    return float(name[:-1]) * (1e9 if name.endswith("B") else 1e6)


def gpu_memory_bytes(gpu: str) -> int:
    """Memory of a named GPU (``KNOWN_GPUS_MIB``; case and dashes are ignored)."""
    key = {name.lower().replace("-", ""): name for name in KNOWN_GPUS_MIB}.get(gpu.lower().replace("-", ""))
    if key is None:
        raise ValueError(f"gpu={gpu!r} is unknown: known GPUs are {sorted(KNOWN_GPUS_MIB)}; or give "
                         "--gpu-memory (e.g. 24GiB)")
    return KNOWN_GPUS_MIB[key] << 20


def _check(dtype, quantization, kv_cache_dtype, tp, hf_config) -> None:
    if dtype not in WEIGHT_BYTES:
        raise ValueError(f"dtype={dtype!r} is invalid: dtype must be one of {sorted(WEIGHT_BYTES)}")
    if quantization not in (None, "fp8", "awq"):
        raise ValueError(f"quantization={quantization!r} is invalid: it must be None, 'fp8' or 'awq'")
    if kv_cache_dtype not in KV_BYTES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid: it must be one of "
                         f"{sorted(KV_BYTES)}")
    check_tensor_parallel_split(hf_config, tp)


def check_tensor_parallel_split(hf_config, tp: int) -> None:
    """A ValueError, the engine's, when its layers cannot be cut over ``tp`` ranks: the query
    heads must divide, the KV heads divide or be fewer and divide ``tp`` (then replicated)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp} is invalid: it must be an integer >= 1")
    sizes = ModelSizes.from_config(hf_config)
    split_attention_heads(hf_config.num_attention_heads, sizes.num_kv_heads, tp, 0)
