"""Launch configurations of the paged attention kernel (``kernels/paged_attention.py``): the query
tile from the batch's longest query, and for default-mode decode launches the key tile, warps and
pipeline stages from a measured per-shape table. Pure Python (no torch, no triton).

Every choice depends on host ints only (the longest query, the shapes, the split size), so a
CUDA graph captures the kernel a later replay of that batch runs.

``DECODE_ATTENTION_CONFIGS`` is filled from ``benchmarks/attention_bench.py``, which prints the
lines to paste here.
"""

from __future__ import annotations

from dataclasses import dataclass

# Key tile of the attention loop for every launch but a tuned decode: the same for every launch
# shape, so that a row's softmax is accumulated in the same order whatever batch it is in
# (batch-invariant mode depends on it; cascade prefixes and split sizes are multiples of it).
TILE_N = 64
# Key tiles a decode config may take.
DECODE_TILE_NS = (64, 128)


@dataclass(frozen=True)
class DecodeConfig:
    """A default-mode decode launch: ``tile_n`` keys per loop step (64 or 128), Triton's
    ``num_warps`` and ``num_stages``."""

    tile_n: int = TILE_N
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class AttentionLaunch:
    """One attention launch's shape: ``block_m`` rows (query tokens x the query heads of one KV
    head) of which ``block_q`` tokens, ``tile_n`` keys a step, warps and stages."""

    block_m: int
    block_q: int
    tile_n: int
    num_warps: int
    num_stages: int


# (head_dim, GQA group, bits of a KV-cache element) -> config of default-mode decode launches
# (longest query 1, no cascade). A shape not listed runs the default ``_default_launch``. Measured
# by attention_bench.py on one H200: qwen3-0.6b (2026-12-04) over W-nano's decode batches (256,
# 128, 64 and 32 sequences of 100-2,048 keys), decode attention time saved against 64-key tiles
# in the comment (32 sequences 24%, 128 5%, 256 1%; 64 sequences 3% slower; 16x8192 equal), and
# W-nano +1.2% output tok/s end to end (BENCHMARKS.md, session 31). llama3-8b
# (2026-12-04): 64-key tiles fit 5 programs an SM against 128-key tiles' 3, and W-seed's decode
# batches (64 and 256 sequences of 513-640 keys) then run in fewer waves: W-seed batch 64 +1.3%
# and batch 256 +0.8% output tok/s end to end (BENCHMARKS.md, session 29). qwen3-30b-a3b
# (2026-12-04, GQA 8): 64-key tiles, 2 stages tie 128-key tiles on the mean of the bench's batches
# (5.4% against 5.5%) and win W-seed's (1 x 640 keys, where the batch-1 split's 64-key segments
# rule out 128-key tiles: 7.5 against 7.9 us; 256 x [513, 640] 86.0 against 93.5 us); batch-1
# TPOT 2.49 -> 2.47 ms end to end (BENCHMARKS.md, session 33).
DECODE_ATTENTION_CONFIGS: dict[tuple[int, int, int], DecodeConfig] = {
    (128, 2, 16): DecodeConfig(tile_n=128, num_warps=4, num_stages=2),  # qwen3-0.6b: 5.9%
    (128, 4, 16): DecodeConfig(tile_n=64, num_warps=4, num_stages=2),  # llama3-8b
    (128, 8, 16): DecodeConfig(tile_n=64, num_warps=4, num_stages=2),  # qwen3-30b-a3b: 5.4%
}


def padded_head_dim(head_dim: int) -> int:
    """The kernel's head-dim tile: head_dim rounded up to a power of two, at least 16."""
    return max(16, next_power_of_2(head_dim))


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def check_decode_config(key: tuple[int, int, int], config: DecodeConfig) -> None:
    """Raise ValueError if ``config`` cannot run decode for ``key`` = (head_dim, group,
    kv_dtype_bits). Shared memory is not bounded here: the K and V loads go through the block
    table, which Triton does not software-pipeline, so stages do not multiply it (sm_90, Triton
    3.9: 22 KiB for 64-key tiles at head_dim 128, 40 KiB for 128-key ones, at 2 or 3 stages);
    a config that does not compile is never printed by ``benchmarks/attention_bench.py``."""
    head_dim, group, kv_bits = key
    if head_dim < 1 or group < 1:
        raise ValueError(f"decode config key {key}: head_dim and group must be positive")
    if kv_bits not in (8, 16, 32):
        raise ValueError(f"decode config key {key}: kv_dtype_bits={kv_bits} must be 8, 16 or 32")
    if config.tile_n not in DECODE_TILE_NS:
        raise ValueError(f"{config} for {key}: tile_n={config.tile_n} must be one of {DECODE_TILE_NS}")
    if config.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{config} for {key}: num_warps={config.num_warps} must be 1, 2, 4, 8 or 16")
    if not 1 <= config.num_stages <= 8:
        raise ValueError(f"{config} for {key}: num_stages={config.num_stages} must be in 1..8")


def check_decode_configs(table: dict[tuple[int, int, int], DecodeConfig]) -> None:
    """``check_decode_config`` on every entry of a table like ``DECODE_ATTENTION_CONFIGS``."""
    for key, config in table.items():
        check_decode_config(key, config)


def attention_launch(max_query_len: int, group: int, head_dim: int, kv_dtype_bits: int, *,
                     batch_invariant_rows: int = 0, tunable: bool = True, split_kv_size: int = 0,
                     table: dict[tuple[int, int, int], DecodeConfig] | None = None) -> AttentionLaunch:
    """The launch of a batch whose longest query is ``max_query_len``; ``batch_invariant_rows``
    (batch-invariant mode; 0: default mode): the query tile of every launch. A default-mode decode
    launch (``max_query_len == 1``, ``tunable``: not a cascade half) takes its key tile, warps
    and stages from ``table`` (default ``DECODE_ATTENTION_CONFIGS``) where the shape is listed
    and its tile divides ``split_kv_size`` (0: no split); every other launch keeps ``TILE_N``."""
    default = _default_launch(max_query_len, group, head_dim, batch_invariant_rows)
    if max_query_len != 1 or batch_invariant_rows or not tunable:
        return default
    found = (DECODE_ATTENTION_CONFIGS if table is None else table).get((head_dim, group, kv_dtype_bits))
    if found is None or split_kv_size % found.tile_n:
        return default
    return AttentionLaunch(default.block_m, default.block_q, found.tile_n, found.num_warps, found.num_stages)


def _default_launch(max_query_len: int, group: int, head_dim: int,
                    batch_invariant_rows: int) -> AttentionLaunch:
    """``batch_invariant_rows`` rows whatever the batch (where given), so a token's dots are the
    same instructions in decode and in any prefill.

    Rows are query tokens x the query heads of one KV head, at least 16 so that tl.dot runs on
    tensor cores in decode. Measured on an H200 (bf16, head_dim 128, GQA 4, TILE_N 64): 64 rows
    with 4 warps beat 128 rows with 8 warps for 512-token prefills (2.85 vs 3.04 ms for 256
    sequences) and for a 2,048-token chunk over 30k keys (334 vs 305 TFLOP/s). Gemma's head_dim
    256 takes two stages: three stages of its K and V tiles overflow shared memory.
    """
    block_m = max(16, min(64, next_power_of_2(max_query_len * group)), next_power_of_2(group))
    if batch_invariant_rows:
        block_m = max(batch_invariant_rows, next_power_of_2(group))
    num_warps = 8 if block_m >= 128 else 4
    num_stages = 2 if padded_head_dim(head_dim) > 128 else 3
    return AttentionLaunch(block_m, block_m // group, TILE_N, num_warps, num_stages)


check_decode_configs(DECODE_ATTENTION_CONFIGS)
