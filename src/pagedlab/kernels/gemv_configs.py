"""Launch configurations of the linear-layer kernels (``kernels/gemv.py``, ``kernels/w4a16.py``):
the tiles, K splits, warps and pipeline stages, chosen per (row bucket, N, K) from measured
tables, else from a default heuristic. Pure Python (no torch, no triton), so the dense layers
can ask "Triton or cuBLAS?" without loading Triton.

Every choice depends on host ints only (the row count, the weight's shape), never on data, so
a CUDA graph captures the same kernels a later replay of that batch size runs.

The tables are filled from ``benchmarks/gemv_bench.py``, which prints the lines to paste here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Batches of at most this many rows take a GEMV kernel (all rows in one program, K split).
GEMV_MAX_ROWS = 16
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The most rows the AWQ GEMM takes (a decode batch): more (prefill chunks) dequantize for cuBLAS.
AWQ_GEMM_MAX_ROWS = ROW_BUCKETS[-1]
# Rows of a tl.dot tile: the smallest M tensor cores take.
DOT_MIN_ROWS = 16
# The CUDA-core AWQ GEMV's default tile (``default_awq_config``): columns a program, largest K
# step (one row; half that for more), and the most rows it takes by default (more: tl.dot).
AWQ_CUDA_CORE_BLOCK_N = 16
AWQ_CUDA_CORE_BLOCK_K = 2048
AWQ_CUDA_CORE_DEFAULT_ROWS = 4
# The most rows an AWQ GEMV tile with block_m=0 multiplies on the CUDA cores (each K step's words
# unpacked once for all of them); more rows take tl.dot tiles.
AWQ_CUDA_CORE_MAX_ROWS = 8


@dataclass(frozen=True)
class TileConfig:
    """One kernel launch's shape.

    ``block_n``: output columns per program; ``block_k``: rows of K per loop step (AWQ: at least
    16; on tl.dot it divides the group size, on the CUDA cores it may span groups); ``split_k``: segments K
    is cut into, each its own program, summed in a fixed order by the last to finish (GEMV only);
    ``block_m``: 0 multiplies on the CUDA cores with all rows in one program (GEMV only), 16 or
    more are ``tl.dot`` tiles of that many rows; ``num_warps``/``num_stages`` as in Triton (the AWQ
    GEMV also reads the next K step's weights before this step's sums when ``num_stages > 1``, the
    dense one-row GEMV its next step's weights and activations when ``num_stages >= 4``);
    ``swap_ab`` (tl.dot tiles of the AWQ GEMM and of the dense and FP8 GEMV): the weight tile is
    the dot's A operand and the rows its N (the kernels' SWAP_AB)."""

    block_n: int
    block_k: int
    split_k: int = 1
    block_m: int = 0
    num_warps: int = 4
    num_stages: int = 2
    swap_ab: bool = False

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
        if not gemv and not self.block_m:
            raise ValueError(f"{self}: the GEMM needs block_m >= 16")
        if self.swap_ab and not self.block_m:
            raise ValueError(f"{self}: swap_ab=True swaps a tl.dot tile's operands, it needs block_m >= 16")


def row_bucket(rows: int) -> int:
    """The table row of a batch of ``rows`` rows: the smallest bucket that holds it (256 for more)."""
    return next((bucket for bucket in ROW_BUCKETS if rows <= bucket), ROW_BUCKETS[-1])


def splits_for(tiles: int, k_steps: int, num_sms: int, waves: int = 2) -> int:
    """K segments so that ``tiles`` column tiles make about ``waves`` programs per SM, with at
    least one K step per segment."""
    return max(1, min(k_steps, -(-waves * num_sms // max(tiles, 1))))


# The tables: ``benchmarks/gemv_bench.py`` on one H200 (2026-12-01), times of CUDA-graph replays
# with the weights read from HBM (the comments: microseconds).
# (row bucket, N, K, group_size) -> config of the AWQ W4A16 kernels over the repacked layout
# (``kernels/w4a16.py``). A batch of more than GEMV_MAX_ROWS rows (up to AWQ_GEMM_MAX_ROWS) takes
# the dequantizing GEMM only where it is listed (it beat dequantize-then-cuBLAS there); elsewhere
# the weight is dequantized for cuBLAS. Entries: TileConfig(block_n, block_k, split_k, block_m,
# num_warps, num_stages[, swap_ab]); comments: microseconds, and the share of 4.8 TB/s of the int4
# weights, zero points, scales and activations read. The 2-16-row tl.dot path ran at about half
# cuBLAS's speed on the 16-bit weights there. The 64-, 128- and 256-row lines: 2026-12-03 (session
# 27, a ``.dev`` probe of the GEMM that reads x and the words by TMA, each tile against
# dequantize-then-cuBLAS in the same run; comments: the GEMM's time, then that path's), K split where
# the column tiles are few. Where the GEMM lost, cuBLAS stays: qkv and o at 128 rows (35.6 / 33.9,
# 25.1 / 25.2), qkv, o and down at 256 (52.0 / 39.3, 35.8 / 26.8, 98.6 / 87.2). The probe timed
# dequantize-then-cuBLAS for gate/up at 64 rows at 68.9 us, half its 128-row time and less than
# writing and reading the 16-bit weight takes; end to end (session 28, W-seed batch 64 AWQ, one
# H200) it cost: without the 64-row lines 3,746-3,787 tok/s, with gate/up's alone 4,363 (session
# 27's old GEMM line), with all four 4,895 (bf16 5,179-5,185).
# The 1-, 2-, 4- and 8-row lines: 2026-12-02 (sessions 19-20, ``gpu_suite.sh gemv-awq``), the
# CUDA-core sums with the paired nibble unpacking (``w4a16._unpack_words_paired``): up to 4 rows
# they won all four linears (4 rows, qkv: 18.5 against 28.7 us for tl.dot), at 8 rows tl.dot
# tiles did; at 2 rows gate/up and down gained 10% and 5% on session 18's lines.
AWQ_CONFIGS: dict[tuple[int, int, int, int], TileConfig] = {
    (1, 6144, 4096, 128): TileConfig(16, 2048, 1, 0, 4, 1),  # 6.5, 42%
    (4, 6144, 4096, 128): TileConfig(16, 2048, 1, 0, 8, 3),  # 18.5, 15%
    (16, 6144, 4096, 128): TileConfig(64, 128, 6, 16, 4, 3),  # 29.0, 10%
    (1, 4096, 4096, 128): TileConfig(16, 2048, 1, 0, 8, 3),  # 4.5, 41%
    (4, 4096, 4096, 128): TileConfig(16, 1024, 1, 0, 4, 3),  # 12.0, 15%
    (16, 4096, 4096, 128): TileConfig(64, 128, 5, 16, 4, 3),  # 20.7, 9%
    (1, 28672, 4096, 128): TileConfig(32, 512, 1, 0, 4, 3),  # 21.6, 59%
    (4, 28672, 4096, 128): TileConfig(16, 1024, 1, 0, 4, 3),  # 70.2, 18%
    (16, 28672, 4096, 128): TileConfig(64, 128, 2, 16, 4, 3),  # 107.4, 12%
    (1, 4096, 14336, 128): TileConfig(16, 2048, 1, 0, 8, 3),  # 12.1, 53%
    (4, 4096, 14336, 128): TileConfig(8, 1024, 1, 0, 4, 1),  # 40.6, 16%
    (16, 4096, 14336, 128): TileConfig(64, 128, 9, 16, 4, 3),  # 59.2, 11%
    (2, 6144, 4096, 128): TileConfig(8, 2048, 1, 0, 4, 3),  # 12.7, 22%
    (8, 6144, 4096, 128): TileConfig(128, 128, 6, 16, 8, 3),  # 28.8, 10%
    (2, 4096, 4096, 128): TileConfig(16, 1024, 1, 0, 4, 3),  # 7.3, 25%
    (8, 4096, 4096, 128): TileConfig(64, 128, 9, 16, 4, 3),  # 19.3, 10%
    (2, 28672, 4096, 128): TileConfig(16, 512, 1, 0, 4, 3),  # 42.4, 30%
    (8, 28672, 4096, 128): TileConfig(64, 128, 2, 16, 4, 3),  # 104.0, 12%
    (2, 4096, 14336, 128): TileConfig(16, 1024, 1, 0, 8, 3),  # 23.2, 27%
    (8, 4096, 14336, 128): TileConfig(64, 128, 9, 16, 4, 3),  # 61.2, 10%
    (64, 6144, 4096, 128): TileConfig(64, 128, 2, 64, 4, 4, True),  # 26.1 (32.3)
    (64, 4096, 4096, 128): TileConfig(64, 128, 4, 64, 4, 4, True),  # 17.9 (21.0)
    (64, 28672, 4096, 128): TileConfig(128, 64, 1, 64, 4, 4),  # 71.6
    (64, 4096, 14336, 128): TileConfig(64, 128, 4, 64, 4, 4, True),  # 41.8 (77.2)
    (128, 28672, 4096, 128): TileConfig(128, 64, 1, 128, 8, 3),  # 84.5 (145.0)
    (128, 4096, 14336, 128): TileConfig(128, 64, 4, 128, 8, 4, True),  # 65.0 (78.4)
    (256, 28672, 4096, 128): TileConfig(128, 64, 1, 256, 8, 3, True),  # 157.6 (164.7)
}
# (row bucket, N, K) -> config of the dense 16-bit GEMV, only where it beat cuBLAS (F.linear);
# a shape not listed runs cuBLAS. The batch-1 Llama-3-8B entries marked "chain" come from
# benchmarks/pdl_probe.py instead: in a chain of 32 layers' linears, each reading its own weights
# as decode does, one program per few weight rows over all of K beat both cuBLAS and the split-K
# entries gemv_bench picked (times per linear in the chain, without PDL). Entries marked "decode"
# come from gemv_bench's decode-like timing (2026-12-01, session 10: each call on its own weight
# copy, the copies over twice the L2); its one-row picks for qkv, o and down equal the chain's.
# The Gemma-2-9B, Qwen3-30B-A3B and Mixtral (LM head) entries: the same timing, 2026-12-01
# (session 11); Gemma's one-row gate/up lost to cuBLAS there and runs cuBLAS. The Qwen3-30B-A3B
# router (128 experts x 2048) was timed end to end instead (benchmarks/batch1_matrix.py, batch-1
# TPOT, 2026-12-02); split-K 8 over 256-wide tiles ran 2.72 ms. Re-timed in the step (2026-12-04,
# session 35, one LLM re-planned per tile): a row a program over all of K in one step, 2.331-2.333
# ms, against 4 x 1,024's 2.352-2.360 (2 and 4 rows over all of K: 2.332-2.336). The swapped qkv
# lines at 4 and 16 rows: gemv_bench, 2026-12-02 (session 16); the 2- and 8-row lines, session 18.
DENSE_GEMV_CONFIGS: dict[tuple[int, int, int], TileConfig] = {
    (1, 6144, 4096): TileConfig(block_n=8, block_k=512, num_stages=3),  # chain 13.9 (cuBLAS 16.0)
    (1, 4096, 4096): TileConfig(block_n=4, block_k=1024, num_stages=3),  # chain 10.4 (cuBLAS 12.7)
    (1, 28672, 4096): TileConfig(block_n=16, block_k=256, num_stages=3),  # chain 54.5 (cuBLAS 56.2)
    (1, 4096, 14336): TileConfig(block_n=4, block_k=1024, num_stages=3),  # chain 28.3 (cuBLAS 30.4)
    (4, 4096, 4096): TileConfig(block_n=32, block_k=256, split_k=5, block_m=16),  # 14.7 (cuBLAS 15.6)
    (16, 4096, 4096): TileConfig(block_n=32, block_k=256, split_k=5, block_m=16),  # 14.9 (cuBLAS 15.7)
    (4, 28672, 4096): TileConfig(block_n=32, block_k=256, block_m=16),  # 64.8 (cuBLAS 67.2)
    (16, 28672, 4096): TileConfig(block_n=32, block_k=256, block_m=16),  # 65.0 (cuBLAS 67.0)
    (1, 128256, 4096): TileConfig(block_n=16, block_k=256, num_stages=3),  # decode 235.0 (cuBLAS 254.6)
    (4, 128256, 4096): TileConfig(block_n=64, block_k=128, block_m=16),  # 248.2 (cuBLAS 258.1)
    (16, 128256, 4096): TileConfig(block_n=64, block_k=128, block_m=16),  # 250.6 (cuBLAS 261.5)
    (1, 3072, 4096): TileConfig(block_n=32, block_k=256, split_k=6, block_m=16),  # 12.4 (cuBLAS 14.1)
    (1, 4096, 2048): TileConfig(block_n=8, block_k=512),  # 8.4 (cuBLAS 9.1)
    (1, 4096, 7168): TileConfig(block_n=32, block_k=256, split_k=5, block_m=16),  # 23.0 (cuBLAS 24.2)
    (1, 64128, 4096): TileConfig(block_n=64, block_k=128, block_m=16),  # 130.0 (cuBLAS 145.8)
    (1, 3584, 4096): TileConfig(block_n=4, block_k=1024, num_stages=3),  # decode 9.1 (cuBLAS 12.7)
    (4, 3584, 4096): TileConfig(block_n=32, block_k=256, split_k=5, block_m=16),  # decode 11.4 (cuBLAS 12.5)
    (16, 3584, 14336): TileConfig(block_n=32, block_k=256, split_k=5, block_m=16),  # decode 29.3, cuBLAS 30.4
    (1, 256000, 3584): TileConfig(block_n=8, block_k=512),  # decode 394.4 (cuBLAS 410.0)
    (16, 256000, 3584): TileConfig(block_n=64, block_k=128, block_m=16),  # decode 417.2 (cuBLAS 430.1)
    (16, 3584, 4096): TileConfig(block_n=32, block_k=256, split_k=5, block_m=16),  # decode 11.6 (cuBLAS 12.6)
    (1, 3584, 14336): TileConfig(block_n=4, block_k=1024, num_stages=3),  # decode 25.4 (cuBLAS 27.6)
    (1, 5120, 2048): TileConfig(block_n=4, block_k=1024, num_stages=3),  # decode 7.2 (cuBLAS 7.6)
    (1, 2048, 4096): TileConfig(block_n=4, block_k=1024, num_stages=3),  # decode 6.6 (cuBLAS 9.5)
    (4, 2048, 4096): TileConfig(block_n=32, block_k=256, split_k=9, block_m=16),  # decode 8.1 (cuBLAS 9.5)
    (16, 2048, 4096): TileConfig(block_n=32, block_k=256, split_k=9, block_m=16),  # decode 8.3 (cuBLAS 9.7)
    (1, 151936, 2048): TileConfig(block_n=4, block_k=1024, num_stages=3),  # decode 135.6 (cuBLAS 143.7)
    (1, 32000, 4096): TileConfig(block_n=4, block_k=1024, num_stages=3),  # decode 59.7 (cuBLAS 63.4)
    (16, 32000, 4096): TileConfig(block_n=64, block_k=128, block_m=16),  # decode 63.0 (cuBLAS 65.3)
    (1, 128, 2048): TileConfig(block_n=1, block_k=2048, num_stages=3),  # router: TPOT 2.33 (4 x 1024 2.35)
    (4, 6144, 4096): TileConfig(64, 128, 2, 16, 4, 3, True),  # 14.9 (cuBLAS 16.3), 70%
    (16, 6144, 4096): TileConfig(64, 128, 2, 16, 4, 3, True),  # 15.4 (cuBLAS 16.3), 68%
    (2, 6144, 4096): TileConfig(64, 128, 2, 16, 4, 3, True),  # 14.6 (cuBLAS 15.9), 72%
    (8, 6144, 4096): TileConfig(64, 128, 2, 16, 4, 3, True),  # 14.9 (cuBLAS 15.6), 71%
    (2, 4096, 4096): TileConfig(64, 128, 3, 16, 4, 3, True),  # 11.2 (cuBLAS 13.2), 63%
    (8, 4096, 4096): TileConfig(32, 256, 5, 16, 4, 2),  # 11.2 (cuBLAS 13.4), 62%
    (2, 128256, 4096): TileConfig(64, 128, 1, 16, 4, 3, True),  # 230.5 (cuBLAS 248.8), 95%
    (8, 128256, 4096): TileConfig(128, 128, 1, 16, 4, 3, True),  # 232.6 (cuBLAS 241.3), 94%
}
# (row bucket, N, K) -> config of the FP8 GEMV (``kernels/fp8_linear.py``) where it runs: where it
# beat ``torch._scaled_mm`` (gemv_bench lists no other); shapes not listed take ``torch._scaled_mm``.
# The Llama-3-8B lines with comments "(_scaled_mm ...)" are gemv_bench's decode-like timing of
# 2026-12-02 (session 16): at 4 and 16 rows only the swapped tl.dot tiles (``swap_ab``, FP8 fed
# to wgmma as E4M3) beat cuBLASLt, by 1.6-2.3x; at one row they win gate/up only.
# The 2- and 8-row lines (session 18): the same tiles, 1.8-2.3x faster than cuBLASLt.
FP8_GEMV_CONFIGS: dict[tuple[int, int, int], TileConfig] = {
    (1, 6144, 4096): TileConfig(4, 512, 1, 0, 4, 3),  # 8.4 (_scaled_mm 18.7), 62%
    (1, 4096, 4096): TileConfig(4, 1024, 1, 0, 4, 3),  # 5.9 (_scaled_mm 14.6), 59%
    (1, 28672, 4096): TileConfig(64, 128, 1, 16, 4, 3, True),  # 29.9 (_scaled_mm 47.5), 82%
    (1, 4096, 14336): TileConfig(4, 1024, 1, 0, 4, 3),  # 16.1 (_scaled_mm 43.1), 76%
    (1, 3072, 4096): TileConfig(block_n=8, block_k=1024),  # 12.4
    (1, 4096, 2048): TileConfig(block_n=8, block_k=1024),  # 9.1
    (1, 14336, 4096): TileConfig(block_n=8, block_k=1024),  # 33.4
    (1, 4096, 7168): TileConfig(block_n=8, block_k=1024),  # 20.7
    (1, 8192, 3584): TileConfig(block_n=8, block_k=512),  # decode 14.6
    (1, 3584, 4096): TileConfig(block_n=4, block_k=1024, num_stages=3),  # decode 9.5
    (1, 28672, 3584): TileConfig(block_n=8, block_k=512),  # decode 34.0
    (1, 3584, 14336): TileConfig(block_n=4, block_k=1024, num_stages=3),  # decode 21.6
    (1, 5120, 2048): TileConfig(block_n=4, block_k=512, num_stages=3),  # decode 7.6
    (1, 2048, 4096): TileConfig(block_n=4, block_k=1024, num_stages=3),  # decode 8.2
    (4, 6144, 4096): TileConfig(64, 128, 3, 16, 4, 3, True),  # 9.8 (_scaled_mm 18.9), 54%
    (16, 6144, 4096): TileConfig(64, 256, 2, 16, 4, 3, True),  # 10.0 (_scaled_mm 18.0), 53%
    (4, 4096, 4096): TileConfig(64, 128, 5, 16, 4, 3, True),  # 7.9 (_scaled_mm 14.7), 44%
    (16, 4096, 4096): TileConfig(64, 128, 5, 16, 4, 3, True),  # 8.3 (_scaled_mm 13.9), 43%
    (4, 28672, 4096): TileConfig(64, 128, 1, 16, 4, 3, True),  # 30.2 (_scaled_mm 49.9), 81%
    (16, 28672, 4096): TileConfig(64, 128, 1, 16, 4, 3, True),  # 31.0 (_scaled_mm 48.0), 80%
    (4, 4096, 14336): TileConfig(64, 256, 3, 16, 4, 3, True),  # 18.5 (_scaled_mm 42.6), 66%
    (16, 4096, 14336): TileConfig(64, 256, 3, 16, 4, 3, True),  # 19.2 (_scaled_mm 37.9), 64%
    (2, 6144, 4096): TileConfig(64, 128, 3, 16, 4, 3, True),  # 9.6 (_scaled_mm 18.2), 55%
    (8, 6144, 4096): TileConfig(64, 128, 3, 16, 4, 3, True),  # 9.7 (_scaled_mm 18.3), 54%
    (2, 4096, 4096): TileConfig(64, 128, 5, 16, 4, 3, True),  # 7.9 (_scaled_mm 14.6), 45%
    (8, 4096, 4096): TileConfig(64, 128, 5, 16, 4, 3, True),  # 7.9 (_scaled_mm 14.2), 44%
    (2, 28672, 4096): TileConfig(64, 128, 1, 16, 4, 3, True),  # 28.9 (_scaled_mm 47.9), 85%
    (8, 28672, 4096): TileConfig(64, 128, 1, 16, 4, 3, True),  # 29.2 (_scaled_mm 48.5), 84%
    (2, 4096, 14336): TileConfig(64, 256, 3, 16, 4, 3, True),  # 18.2 (_scaled_mm 41.6), 67%
    (8, 4096, 14336): TileConfig(64, 256, 3, 16, 4, 3, True),  # 18.7 (_scaled_mm 39.6), 66%
}


def awq_config(rows: int, out_features: int, in_features: int, group_size: int,
               num_sms: int) -> TileConfig | None:
    """The AWQ kernel config for this batch and weight: the table's, else the GEMV's default; None
    for a batch over GEMV_MAX_ROWS rows that the table does not list, and for any over
    AWQ_GEMM_MAX_ROWS (prefill chunks: dequantize once, then cuBLAS multiplies all the rows)."""
    if rows > AWQ_GEMM_MAX_ROWS:
        return None
    found = AWQ_CONFIGS.get((row_bucket(rows), out_features, in_features, group_size))
    if found or rows > GEMV_MAX_ROWS:
        return found
    return default_awq_config(rows, out_features, in_features, group_size, num_sms)


def default_awq_config(rows: int, out_features: int, in_features: int, group_size: int,
                       num_sms: int) -> TileConfig:
    """GEMV, up to ``AWQ_CUDA_CORE_DEFAULT_ROWS`` rows on the CUDA cores: ``AWQ_CUDA_CORE_BLOCK_N``
    columns a program, K steps of up to ``AWQ_CUDA_CORE_BLOCK_K`` (1 KB of each column's words;
    512 bytes from two rows on), 3 stages (the next step's weights read during this one's sums): the tile
    ``gemv_bench.py`` picked most often for the Llama-3-8B linears at one and four rows (session
    19); in the sm_90 SASS this tile's loop takes about 3.5 instructions a weight, no spills. More
    rows: tl.dot tiles of 32 columns, K steps of one group at most. K is split only where the
    column tiles give fewer than two programs per SM. GEMM: 64/128 x 128 tiles, K steps of 64."""
    if rows > GEMV_MAX_ROWS:
        return TileConfig(block_n=128, block_k=min(group_size, 64), block_m=64 if rows <= 64 else 128,
                          num_warps=4 if rows <= 64 else 8, num_stages=3)
    if rows <= AWQ_CUDA_CORE_DEFAULT_ROWS:
        block_n, block_m = AWQ_CUDA_CORE_BLOCK_N, 0
        block_k = AWQ_CUDA_CORE_BLOCK_K if rows == 1 else AWQ_CUDA_CORE_BLOCK_K // 2
        while in_features % block_k:  # whole steps (K is a multiple of the group size)
            block_k //= 2
    else:
        block_n, block_m, block_k = 32, DOT_MIN_ROWS, min(group_size, 128)
    split_k = splits_for(-(-out_features // block_n), -(-in_features // block_k), num_sms)
    return TileConfig(block_n=block_n, block_k=block_k, split_k=split_k, block_m=block_m, num_warps=4,
                      num_stages=3)


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


def fp8_gemv_config(rows: int, out_features: int, in_features: int) -> TileConfig | None:
    """The FP8 GEMV config for this batch and weight, or None: ``torch._scaled_mm`` runs it."""
    if rows > GEMV_MAX_ROWS:
        return None
    return FP8_GEMV_CONFIGS.get((row_bucket(rows), out_features, in_features))


def default_fp8_gemv_config(rows: int, out_features: int, in_features: int, num_sms: int) -> TileConfig:
    """The dense GEMV's tiles; one row reads K steps of 512 one-byte weights (512-byte rows, as
    the 16-bit GEMV), more rows steps of 256 (the registers hold every row's products)."""
    block_n, block_k = 16, 512 if rows == 1 else 256
    split_k = splits_for(-(-out_features // block_n), -(-in_features // block_k), num_sms)
    return TileConfig(block_n=block_n, block_k=block_k, split_k=split_k,
                      block_m=0 if rows <= 4 else DOT_MIN_ROWS, num_warps=4, num_stages=2)


# The batch-invariant matmul (``kernels/batch_invariant.py``). A row's sum over K is fixed by the
# config's block_k and split_k (K segments, summed in segment order) and by the tensor-core
# instruction its tiles compile to, never by the batch. The default: ONE Hopper-sized tile for
# every row count (bf16: 128 x 128 x 64, 8 warps, 3 stages, as the persistent matmuls of vLLM's
# and Thinking Machines' batch-invariant modes), K segments from ``batch_invariant_splits``.
BATCH_INVARIANT_TILE = TileConfig(block_n=128, block_k=64, block_m=128, num_warps=8, num_stages=3)
# The batch-invariant matmul's persistent launch for prefill (``kernels/batch_invariant.py``): one
# program per SM looping over 128 x 256 output tiles, operands through TMA descriptors (Hopper).
# Its block_k and split_k are always the table's (they fix the sum), so its rows are bitwise the
# other launches'; it runs only where the table's block_k is this one (four stages of 128 x 256 x
# 128 tiles would not fit in shared memory). On one H200 at Llama-3-8B's four linears it ran
# 0.94-1.27x cuBLAS's time at 1,024 and 8,192 rows, where the table's tiles run 1.40-1.71x.
BATCH_INVARIANT_PERSISTENT_TILE = TileConfig(block_n=256, block_k=64, block_m=128, num_warps=8, num_stages=4)
# Fewest rows that take the persistent launch: the smallest row count it was measured at, where it
# beat the table's tiles at every shape. Fewer rows make few 128 x 256 tiles for 132 SMs (256 rows
# of an o projection: 32), where the table's smaller tiles make more programs.
BATCH_INVARIANT_PERSISTENT_MIN_ROWS = 1024
# Fewest K steps in one segment of the batch-invariant matmul.
BATCH_INVARIANT_MIN_SEGMENT_STEPS = 4
# Row buckets of BATCH_INVARIANT_CONFIGS: a batch takes the smallest bucket that holds it (8192:
# a prefill step at the default token budget).
BATCH_INVARIANT_ROW_BUCKETS = (1, 8, 64, 256, 1024, 8192)
# (row bucket, N, K) -> config of the batch-invariant matmul (split_k: its K segments), pasted
# from ``benchmarks/batch_invariant_bench.py``. All entries of one (N, K) share block_k and
# split_k, and the bench (and tests/test_batch_invariant_gpu.py) found their outputs bitwise
# equal on the GPU: tiles of other rows or columns, warps or stages may differ only where they
# compile to an instruction that rounds the same. A shape not listed takes the default. Entries:
# TileConfig(block_n, block_k, split_k, block_m, num_warps, num_stages); bench times on one H200.
BATCH_INVARIANT_CONFIGS: dict[tuple[int, int, int], TileConfig] = {
    (1, 6144, 4096): TileConfig(64, 128, 1, 16, 4, 4),  # 16.1 us (default 14.3)
    (8, 6144, 4096): TileConfig(64, 128, 1, 16, 4, 4),  # 16.4 us (default 15.6)
    (64, 6144, 4096): TileConfig(128, 128, 1, 64, 4, 3),  # 24.5 us (default 16.3)
    (256, 6144, 4096): TileConfig(128, 128, 1, 128, 8, 3),  # 31.9 us (default 21.8)
    (1024, 6144, 4096): TileConfig(128, 128, 1, 128, 8, 3),  # 91.8 us (default 69.5)
    (8192, 6144, 4096): TileConfig(128, 128, 1, 128, 8, 3),  # 836.3 us (default 601.1)
    (1, 4096, 4096): TileConfig(64, 128, 1, 16, 4, 4),  # 14.2 us (default 10.3)
    (8, 4096, 4096): TileConfig(64, 128, 1, 16, 4, 4),  # 14.2 us (default 12.4)
    (64, 4096, 4096): TileConfig(64, 128, 1, 16, 4, 4),  # 18.8 us (default 12.0)
    (256, 4096, 4096): TileConfig(128, 128, 1, 64, 4, 3),  # 23.7 us (default 18.6)
    (1024, 4096, 4096): TileConfig(128, 128, 1, 128, 8, 3),  # 61.6 us (default 44.9)
    (8192, 4096, 4096): TileConfig(128, 128, 1, 128, 8, 3),  # 537.1 us (default 353.1)
    (1, 28672, 4096): TileConfig(32, 64, 1, 16, 4, 4),  # 56.9 us (default 54.7)
    (8, 28672, 4096): TileConfig(128, 64, 1, 16, 4, 4),  # 57.5 us (default 55.3)
    (64, 28672, 4096): TileConfig(128, 64, 1, 64, 4, 4),  # 60.5 us (default 60.6)
    (256, 28672, 4096): TileConfig(128, 64, 1, 128, 8, 3),  # 114.3 us (default 90.7)
    (1024, 28672, 4096): TileConfig(128, 64, 1, 256, 8, 3),  # 427.2 us (default 327.1)
    (8192, 28672, 4096): TileConfig(128, 64, 1, 256, 8, 3),  # 3452.9 us (default 2780.5)
    (1, 4096, 14336): TileConfig(32, 64, 5, 16, 4, 4),  # 31.4 us (default 32.3)
    (8, 4096, 14336): TileConfig(32, 64, 5, 16, 4, 4),  # 32.0 us (default 34.2)
    (64, 4096, 14336): TileConfig(64, 64, 5, 64, 4, 4),  # 38.7 us (default 34.5)
    (256, 4096, 14336): TileConfig(64, 64, 5, 64, 4, 4),  # 81.7 us (default 48.3)
    (1024, 4096, 14336): TileConfig(128, 64, 5, 256, 8, 3),  # 216.9 us (default 151.7)
    (8192, 4096, 14336): TileConfig(128, 64, 5, 256, 8, 3),  # 1957.8 us (default 1369.9)
    (1, 128256, 4096): TileConfig(128, 64, 1, 64, 4, 4),  # 238.3 us (default 230.1)
    (8, 128256, 4096): TileConfig(128, 64, 1, 64, 4, 4),  # 240.7 us (default 240.1)
    (64, 128256, 4096): TileConfig(128, 64, 1, 64, 4, 4),  # 251.7 us (default 268.9)
    (256, 128256, 4096): TileConfig(128, 64, 1, 256, 8, 3),  # 543.5 us (default 430.5)
}
# The entries of BATCH_INVARIANT_CONFIGS whose launch splits K across programs (the segments'
# sums meet in a scratch buffer), where the bench measured that faster than one program looping
# over the segments; the sum is the same either way.
BATCH_INVARIANT_SPLIT_LAUNCH: set[tuple[int, int, int]] = {
    (1, 4096, 14336), (8, 4096, 14336), (64, 4096, 14336),
}


def check_batch_invariant_table(table: dict[tuple[int, int, int], TileConfig],
                                split_launch: set[tuple[int, int, int]] = frozenset()) -> None:
    """Raise ValueError unless every key's bucket is in BATCH_INVARIANT_ROW_BUCKETS, every config
    can run (``check_batch_invariant_config``), the entries of one (N, K) share block_k and
    split_k (the K steps and segments that fix a row's sum) and ``split_launch`` names entries."""
    unknown = sorted(set(split_launch) - set(table))
    if unknown:
        raise ValueError(f"split launches {unknown} have no config in the table")
    segments: dict[tuple[int, int], tuple[int, int]] = {}
    for (bucket, n, k), config in table.items():
        if bucket not in BATCH_INVARIANT_ROW_BUCKETS:
            raise ValueError(f"row bucket {bucket} of ({n}, {k}) is not one of {BATCH_INVARIANT_ROW_BUCKETS}")
        check_batch_invariant_config(config)
        found = segments.setdefault((n, k), (config.block_k, config.split_k))
        if found != (config.block_k, config.split_k):
            raise ValueError(f"({n}, {k}) has entries with (block_k, split_k) {found} and "
                             f"{(config.block_k, config.split_k)}: one shape needs one, or its rows' sums "
                             "would follow the batch")


def batch_invariant_row_bucket(rows: int) -> int:
    """The BATCH_INVARIANT_CONFIGS bucket of a batch of ``rows`` rows (the largest for more)."""
    return next((bucket for bucket in BATCH_INVARIANT_ROW_BUCKETS if rows <= bucket),
                BATCH_INVARIANT_ROW_BUCKETS[-1])


def batch_invariant_config(rows: int, out_features: int, in_features: int, num_sms: int,
                           table: dict[tuple[int, int, int], TileConfig] | None = None) -> TileConfig:
    """The batch-invariant matmul's config for a batch of ``rows`` rows: the table's entry for its
    bucket; for a shape the table lists at other buckets only, the entry of the nearest listed
    bucket (never the default, whose sum may round differently); else ``BATCH_INVARIANT_TILE``
    with ``batch_invariant_splits`` segments."""
    table = BATCH_INVARIANT_CONFIGS if table is None else table
    bucket = _listed_bucket(rows, out_features, in_features, table)
    if bucket is None:
        splits = batch_invariant_splits(out_features, in_features, BATCH_INVARIANT_TILE, num_sms)
        return replace(BATCH_INVARIANT_TILE, split_k=splits)
    return table[(bucket, out_features, in_features)]


def batch_invariant_persistent_config(config: TileConfig) -> TileConfig:
    """The persistent launch's config for a batch whose table config is ``config``: the tiles,
    warps and stages of BATCH_INVARIANT_PERSISTENT_TILE with ``config``'s block_k and split_k,
    which fix the sum."""
    return replace(BATCH_INVARIANT_PERSISTENT_TILE, block_k=config.block_k, split_k=config.split_k)


def batch_invariant_split_launch(rows: int, out_features: int, in_features: int, tiles: int, num_sms: int,
                                 table: dict[tuple[int, int, int], TileConfig] | None = None,
                                 split_launch: set[tuple[int, int, int]] | None = None) -> bool:
    """Whether ``batch_invariant_config``'s launch for this batch splits K across programs: as
    measured (BATCH_INVARIANT_SPLIT_LAUNCH) for a shape of the table, else when its ``tiles``
    output tiles alone fill less than half the SMs. The launch never changes the result."""
    table = BATCH_INVARIANT_CONFIGS if table is None else table
    split_launch = BATCH_INVARIANT_SPLIT_LAUNCH if split_launch is None else split_launch
    bucket = _listed_bucket(rows, out_features, in_features, table)
    if bucket is None:
        return 2 * tiles <= num_sms
    return (bucket, out_features, in_features) in split_launch


def _listed_bucket(rows: int, out_features: int, in_features: int,
                   table: dict[tuple[int, int, int], TileConfig]) -> int | None:
    """The table's bucket for the batch: its own, else the nearest one listed for the shape."""
    shape = (out_features, in_features)
    listed = [bucket for (bucket, *weight) in table if tuple(weight) == shape]
    if not listed:
        return None
    wanted = batch_invariant_row_bucket(rows)
    return min(listed, key=lambda bucket: (abs(bucket - wanted), bucket))


def check_batch_invariant_config(config: TileConfig) -> None:
    """Raise ValueError unless ``config`` can run the batch-invariant matmul: ``tl.dot`` tiles of
    at least 16 rows, powers of two, split_k >= 1 K segments."""
    if config.block_m < DOT_MIN_ROWS or config.swap_ab:
        raise ValueError(f"{config}: the batch-invariant matmul needs block_m >= {DOT_MIN_ROWS}, unswapped")
    config.check(config.block_m, gemv=True)


def batch_invariant_splits(out_features: int, in_features: int, tile: TileConfig, num_sms: int) -> int:
    """K segments of the batch-invariant matmul for a weight of this shape: enough that one row
    tile fills about one wave of SMs, each at least ``BATCH_INVARIANT_MIN_SEGMENT_STEPS`` K steps.
    A function of the weight and the device alone, never of the row count."""
    tiles = -(-out_features // tile.block_n)
    k_steps = -(-in_features // tile.block_k)
    return max(1, min(k_steps // BATCH_INVARIANT_MIN_SEGMENT_STEPS, -(-num_sms // tiles)))


check_batch_invariant_table(BATCH_INVARIANT_CONFIGS, BATCH_INVARIANT_SPLIT_LAUNCH)
