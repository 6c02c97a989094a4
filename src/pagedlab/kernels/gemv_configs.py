"""Launch configurations of the linear-layer kernels (``kernels/gemv.py``, ``kernels/w4a16.py``):
the tiles, K splits, warps and pipeline stages, chosen per (row bucket, N, K) from measured
tables, else from a default heuristic. Pure Python (no torch, no triton), so the dense layers
can ask "Triton or cuBLAS?" without loading Triton.

Every choice depends on host ints only (the row count, the weight's shape), never on data, so
a CUDA graph captures the same kernels a later replay of that batch size runs.

The tables are filled from ``benchmarks/gemv_bench.py``, which prints the lines to paste here.
"""

from __future__ import annotations

from dataclasses import dataclass

# Batches of at most this many rows take a GEMV kernel (all rows in one program, K split).
GEMV_MAX_ROWS = 16
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Rows of a tl.dot tile: the smallest M tensor cores take.
DOT_MIN_ROWS = 16


@dataclass(frozen=True)
class TileConfig:
    """One kernel launch's shape.

    ``block_n``: output columns per program (AWQ: a multiple of 8, whole int32 words);
    ``block_k``: rows of K per loop step (AWQ: divides the group size); ``split_k``: segments K
    is cut into, each its own program, summed in a fixed order by the last to finish (GEMV only);
    ``block_m``: 0 multiplies on the CUDA cores with all rows in one program (GEMV only), 16 or
    more are ``tl.dot`` tiles of that many rows; ``num_warps``/``num_stages`` as in Triton."""

    block_n: int
    block_k: int
    split_k: int = 1
    block_m: int = 0
    num_warps: int = 4
    num_stages: int = 2

    def check(self, rows: int, gemv: bool) -> None:
        """Raise ValueError if this config cannot run ``rows`` rows (on the GEMV or GEMM kernel)."""
        powers = {"block_n": self.block_n, "block_k": self.block_k, "num_warps": self.num_warps}
        if self.block_m:
            powers["block_m"] = self.block_m
        for name, value in powers.items():
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"split_k={self.split_k} and num_stages={self.num_stages} must be >= 1")
        if self.block_m and (self.block_m < DOT_MIN_ROWS or min(self.block_n, self.block_k) < 16):
            raise ValueError(f"{self}: tl.dot tiles need block_m, block_n and block_k >= 16")
        if gemv and self.block_m and rows > self.block_m:
            raise ValueError(f"{self}: a GEMV program holds every row, {rows} > block_m={self.block_m}")
        if not gemv and (not self.block_m or self.split_k != 1):
            raise ValueError(f"{self}: the GEMM needs block_m >= 16 and split_k=1")


def row_bucket(rows: int) -> int:
    """The table row of a batch of ``rows`` rows: the smallest bucket that holds it (256 for more)."""
    return next((bucket for bucket in ROW_BUCKETS if rows <= bucket), ROW_BUCKETS[-1])


def splits_for(tiles: int, k_steps: int, num_sms: int, waves: int = 2) -> int:
    """K segments so that ``tiles`` column tiles make about ``waves`` programs per SM, with at
    least one K step per segment."""
    return max(1, min(k_steps, -(-waves * num_sms // max(tiles, 1))))


# (row bucket, N, K, group_size) -> config of the AWQ W4A16 kernels; measured on an H200.
AWQ_CONFIGS: dict[tuple[int, int, int, int], TileConfig] = {}
# (row bucket, N, K) -> config of the dense 16-bit GEMV, only where it beat cuBLAS (F.linear);
# a shape not listed runs cuBLAS.
DENSE_GEMV_CONFIGS: dict[tuple[int, int, int], TileConfig] = {}


def awq_config(rows: int, out_features: int, in_features: int, group_size: int, num_sms: int) -> TileConfig:
    """The AWQ kernel config for this batch and weight: the table's, else the default."""
    found = AWQ_CONFIGS.get((row_bucket(rows), out_features, in_features, group_size))
    return found or default_awq_config(rows, out_features, in_features, group_size, num_sms)


def default_awq_config(rows: int, out_features: int, in_features: int, group_size: int,
                       num_sms: int) -> TileConfig:
    """GEMV: 256-column tiles (32 words, 128-byte rows), K split for two programs per SM, the
    CUDA cores for one row and tl.dot for more. GEMM: 64/128 x 128 tiles, K steps of 64."""
    if rows > GEMV_MAX_ROWS:
        return TileConfig(block_n=128, block_k=min(group_size, 64), block_m=64 if rows <= 64 else 128,
                          num_warps=4 if rows <= 64 else 8, num_stages=3)
    block_n = 256 if out_features >= 2048 else 64
    block_k = min(group_size, 128)
    split_k = splits_for(-(-out_features // block_n), in_features // block_k, num_sms)
    return TileConfig(block_n=block_n, block_k=block_k, split_k=split_k,
                      block_m=0 if rows == 1 else DOT_MIN_ROWS, num_warps=4, num_stages=2)


def dense_gemv_config(rows: int, out_features: int, in_features: int) -> TileConfig | None:
    """The dense GEMV config for this batch and weight, or None: cuBLAS is at least as fast."""
    if rows > GEMV_MAX_ROWS:
        return None
    return DENSE_GEMV_CONFIGS.get((row_bucket(rows), out_features, in_features))


def default_dense_gemv_config(rows: int, out_features: int, in_features: int, num_sms: int) -> TileConfig:
    """For a direct call without a table entry: 16 weight rows per program, 512-byte row reads,
    K split when the rows alone make too few programs; tl.dot beyond 4 batch rows."""
    block_n, block_k = 16, 256
    split_k = splits_for(-(-out_features // block_n), -(-in_features // block_k), num_sms)
    return TileConfig(block_n=block_n, block_k=block_k, split_k=split_k,
                      block_m=0 if rows <= 4 else DOT_MIN_ROWS, num_warps=4, num_stages=2)


# The batch-invariant matmul (``kernels/batch_invariant.py``): ONE tile for every row count, so a
# row's reduction never depends on the batch; Hopper-sized (bf16: 128 x 128 x 64, 8 warps, 3
# stages, as the persistent matmuls of vLLM's and Thinking Machines' batch-invariant modes).
BATCH_INVARIANT_TILE = TileConfig(block_n=128, block_k=64, block_m=128, num_warps=8, num_stages=3)
# Fewest K steps in one segment of the batch-invariant matmul.
BATCH_INVARIANT_MIN_SEGMENT_STEPS = 4


def batch_invariant_splits(out_features: int, in_features: int, tile: TileConfig, num_sms: int) -> int:
    """K segments of the batch-invariant matmul for a weight of this shape: enough that one row
    tile fills about one wave of SMs, each at least ``BATCH_INVARIANT_MIN_SEGMENT_STEPS`` K steps.
    A function of the weight and the device alone, never of the row count."""
    tiles = -(-out_features // tile.block_n)
    k_steps = -(-in_features // tile.block_k)
    return max(1, min(k_steps // BATCH_INVARIANT_MIN_SEGMENT_STEPS, -(-num_sms // tiles)))
