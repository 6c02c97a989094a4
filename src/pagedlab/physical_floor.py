"""The physical floor of a workload (docs/benchmarks.md): the seconds no engine can beat on one
H200, or N of them with tensor parallelism. Plain arithmetic on a model's ``config.json``, so
benchmark scripts import it without loading the engine."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagedlab.config import attention_windows

# H200 figures measured on our machine (docs/benchmarks.md): device copy bandwidth and bf16 matmul peak.
H200_BANDWIDTH = 4.25e12
H200_BF16_FLOPS = 809e12


@dataclass(frozen=True)
class AllReduceCost:
    """One all-reduce's time as a latency plus bytes over the bus bandwidth, which NCCL defines as
    the algorithm bandwidth times 2(n - 1) / n on n GPUs (what each link carries in a ring), so
    ``nbytes`` take ``2(n - 1) / n * nbytes / bus_bandwidth``: 1x at two GPUs, 1.5x at four. The
    defaults are two H200s over NVLink, NCCL 2.28 (measured 2026-11-30): 19.8 us for one token's
    hidden state inside a CUDA graph, 272 GB/s bus bandwidth at 64 MB; past two GPUs they are
    that pair's figures."""

    latency_s: float = 19.8e-6
    bus_bandwidth: float = 272e9

    def seconds(self, nbytes: float, world_size: int) -> float:
        return self.latency_s + 2 * (world_size - 1) / world_size * nbytes / self.bus_bandwidth


def decode_weight_bytes(info) -> float:
    """The matmul weight bytes a decode step of a loaded engine reads, all ranks together: its
    stored parameters (``EngineInfo.weight_bytes``, one rank's shard) less the input embedding,
    of which a step reads only its tokens' rows, unless it is also the LM head (tied)."""
    c = info.hf_config
    tied = getattr(c, "tie_word_embeddings", False)
    embedding = 0 if tied else c.vocab_size * c.hidden_size * info.dtype.itemsize
    return info.weight_bytes * info.config.tensor_parallel_size - embedding

# an MLP of up and down projections, no gate (every other family's is gated: gate, up, down)
_UNGATED_MLP_MODEL_TYPES = ("gpt2", "gpt_neox")


@dataclass
class _StepWeights:
    """The matmul weights a step touches: every layer's attention and router, the experts its
    tokens are routed to (all of a dense MLP), the LM head."""

    q_width: int
    kv_width: int
    shared_params: int  # attention, routers and LM head: read by every step
    expert_params: int  # one expert of one layer
    num_layers: int
    num_experts: int
    top_k: int
    lm_head_params: int  # within shared_params: prefill runs only a prompt's last token through it

    @classmethod
    def from_config(cls, c) -> _StepWeights:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads  # GPT-2, GPT-NeoX: MHA
        q, kv = c.num_attention_heads * head_dim, kv_heads * head_dim
        experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 1
        top_k = getattr(c, "num_experts_per_tok", 1) if experts > 1 else 1
        inter = ((getattr(c, "moe_intermediate_size", None) if experts > 1 else None)
                 or getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size)
        mlp_matrices = 2 if getattr(c, "model_type", None) in _UNGATED_MLP_MODEL_TYPES else 3
        router = experts * c.hidden_size if experts > 1 else 0
        shared = c.num_hidden_layers * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + router)
        lm_head = c.vocab_size * c.hidden_size
        return cls(q, kv, shared + lm_head, mlp_matrices * c.hidden_size * inter, c.num_hidden_layers,
                   experts, top_k, lm_head)

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies by."""
        return self.shared_params + self.num_layers * self.top_k * self.expert_params

    def params_read(self, batch: int) -> float:
        """Parameters a step of ``batch`` tokens reads: the experts hit at least once, expected
        under uniform routing (all of them for a large batch; ``top_k`` at batch 1)."""
        experts_hit = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)
        return self.shared_params + self.num_layers * experts_hit * self.expert_params

    @property
    def all_params(self) -> int:
        return self.shared_params + self.num_layers * self.num_experts * self.expert_params


def _pairs(start: int, end: int, window: int | None) -> int:
    """(query, key) pairs of the queries at positions ``start`` to ``end - 1``, causal: the query
    at position i sees i + 1 keys, at most ``window`` (itself and the ``window - 1`` before it)."""
    unwindowed_end = end if window is None else min(end, max(start, window))  # queries seeing i + 1 keys
    return ((unwindowed_end * (unwindowed_end + 1) - start * (start + 1)) // 2
            + (end - unwindowed_end) * (window or 0))


def _keys_held(contexts: list[int], cached_prefix: int, window: int | None) -> int:
    """Distinct keys one layer reads in a decode step: each sequence's last ``window`` (or all),
    the part of the shared ``cached_prefix`` inside them held, so read, once."""
    inside = [min(n, window) if window else n for n in contexts]
    shared = [max(0, cached_prefix - (n - k)) for n, k in zip(contexts, inside)]
    return sum(inside) - sum(shared) + max(shared)


def physical_floor(hf_config, prompt_lens: list[int], output_lens: list[int], dtype_bytes: int = 2,
                   cached_prefix: int = 0, bandwidth: float = H200_BANDWIDTH,
                   flops: float = H200_BF16_FLOPS, tensor_parallel_size: int = 1,
                   all_reduce: AllReduceCost = AllReduceCost(), kv_dtype_bytes: int | None = None,
                   decode_weight_bytes: float | None = None) -> float:
    """Seconds no engine can beat: prefill FLOPs at the matmul peak, then each decode step reads
    every weight once and every live KV byte (or is bound by its FLOPs, whichever is longer).
    A mixture of experts reads only the experts its step's tokens are routed to (``_StepWeights``);
    a sliding-window layer (``config.attention_windows``) attends and reads only its window's keys.

    ``cached_prefix``: every prompt after the first starts with that many tokens of the first,
    found in the prefix cache: they are not computed again, and their KV is held, so read, once.
    ``tensor_parallel_size`` N: each of N GPUs (``bandwidth`` and ``flops`` are one GPU's) reads
    and computes 1/N of the weights and the KV, and every layer's two row-parallel outputs are
    all-reduced (``all_reduce``), which nothing can overlap: the next layer needs the sum.
    ``kv_dtype_bytes``: bytes of a cached key or value element (default ``dtype_bytes``; 1 for
    an FP8 KV cache). ``decode_weight_bytes``: the bytes of the matmul weights, all ranks
    together, when they are not ``dtype_bytes`` per parameter (quantized weights; see
    ``decode_weight_bytes``); a mixture of experts' step reads its routed share of them."""
    c = hf_config
    tp = tensor_parallel_size
    weights = _StepWeights.from_config(c)
    bytes_per_param = decode_weight_bytes / weights.all_params if decode_weight_bytes else dtype_bytes
    kv_bytes_per_key = 2 * weights.kv_width * (kv_dtype_bytes or dtype_bytes)  # one layer's K and V
    layers_per_window = Counter(attention_windows(c)).items()  # (window or None, its layers)
    attn_flops_per_pair = 4 * weights.q_width  # QK^T and PV, per (query, key) pair of one layer
    num_all_reduces = 2 * c.num_hidden_layers if tp > 1 else 0

    def all_reduces(num_tokens: int) -> float:
        return num_all_reduces * all_reduce.seconds(num_tokens * c.hidden_size * dtype_bytes, tp)

    cached = [cached_prefix if i else 0 for i in range(len(prompt_lens))]
    lm_head = weights.lm_head_params
    # every new prompt token goes through the layers, but only the last one through the LM head (its
    # logits give the first output token)
    prefill = sum(2 * (weights.active_params - lm_head) * (n - k) + 2 * lm_head
                  + attn_flops_per_pair * sum(layers * _pairs(k, n, w) for w, layers in layers_per_window)
                  for n, k in zip(prompt_lens, cached)) / flops / tp
    prefill += all_reduces(sum(n - k for n, k in zip(prompt_lens, cached)))
    decode = 0.0
    for step in range(1, max(output_lens)):
        live = [p + step for p, o in zip(prompt_lens, output_lens) if o > step]
        keys_read = sum(layers * _keys_held(live, cached_prefix, w) for w, layers in layers_per_window)
        keys_seen = sum(layers * _keys_held(live, 0, w) for w, layers in layers_per_window)  # attended
        read = weights.params_read(len(live)) * bytes_per_param + kv_bytes_per_key * keys_read
        work = 2 * weights.active_params * len(live) + attn_flops_per_pair * keys_seen
        decode += max(read / bandwidth, work / flops) / tp + all_reduces(len(live))
    return prefill + decode


def tpot_floor(hf_config, prompt_lens: list[int], output_lens: list[int], whole: float | None = None,
               **floor_args) -> float | None:
    """Seconds of a decode step at the floor, over the workload's decode steps on average: what its
    TPOT (time per output token after the first; at batch 1 one decode step) cannot beat. None
    when no request decodes. ``floor_args`` as ``physical_floor``'s; the decode part is the floor
    of the whole workload (``whole``, when the caller has it) less that of its prefill (every
    request stopped after its first token)."""
    steps = max(output_lens) - 1
    if steps < 1:
        return None
    if whole is None:
        whole = physical_floor(hf_config, prompt_lens, output_lens, **floor_args)
    prefill = physical_floor(hf_config, prompt_lens, [1] * len(prompt_lens), **floor_args)
    return (whole - prefill) / steps
