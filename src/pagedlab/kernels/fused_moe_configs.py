"""Launch configurations of the fused MoE kernels (``kernels/fused_moe.py``). Pure Python (no
torch, no triton).

The grouped path (``MoeConfig``): the row block shared by both grouped GEMMs, and per GEMM the
column and K tiles, the row-block grouping, the K split (down projection only), warps and
pipeline stages. Chosen per (experts, hidden, intermediate, top_k) and token count from a
measured table (``MOE_CONFIGS``, nearest token count), else from a default heuristic.

The GEMV path (``MoeGemvConfig``), for decode batches of at most ``MOE_GEMV_MAX_TOKENS``
tokens and at most ``MOE_GEMV_MAX_EXPERTS`` experts: per launch (gate/up, down) the weight rows
and K step of a program, warps, and whether it prefetches the next K step (``num_stages``).
Taken only from ``MOE_GEMV_CONFIGS``, at exact token counts where the bench measured it faster
than the best grouped layer; there is no heuristic, so a shape or batch size not listed runs
the grouped path.

The routing launches (``moe_route_kernel``, and ``moe_align_kernel`` above one token block):
their warps, from ``ROUTE_NUM_WARPS`` at exact token counts, else ``default_route_num_warps``
(by a program's work size).

Every choice depends on host ints only (the token count, the weights' shapes), never on the
routing, so a CUDA graph captures the same launches a later replay of that batch size runs.
The tables are filled from ``benchmarks/moe_bench.py``, which prints the lines to paste here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Above this many (token, expert) pairs the routing and the sort by expert run as torch ops
# (``select_experts`` + ``align_by_expert``) instead of the two Triton kernels, whose sort scans
# every earlier token block's counts in each program.
ROUTE_ALIGN_TRITON_MAX_PAIRS = 16384
# The largest batch the GEMV path may take (``MOE_GEMV_CONFIGS`` keys): each (token, expert) pair
# reads its expert's weights on its own, which pays only while pairs rarely share an expert.
MOE_GEMV_MAX_TOKENS = 8
# The most experts the GEMV path's gate/up programs route themselves (each holds all of its
# token's logits in registers); more take the grouped path. Checked on an H200 up to 512.
MOE_GEMV_MAX_EXPERTS = 512
# A GEMV launch with num_stages of at least this reads each next K step before this step's products.
MOE_GEMV_PREFETCH_STAGES = 2
# Rows of a tl.dot tile: the smallest M tensor cores take; also the smallest column and K tiles.
DOT_MIN = 16


def _check_powers(**values: int) -> None:
    for name, value in values.items():
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two")


@dataclass(frozen=True)
class MoeGemmConfig:
    """One grouped GEMM launch. ``block_n``/``block_k``: output columns and K per step of a
    program; ``group_m``: row blocks walked together down each column tile (1: a row block
    sweeps every column tile before the next); ``split_k``: K segments, each its own program,
    summed by the reduce kernel (the down projection only: gate/up needs whole sums for silu);
    ``num_warps``/``num_stages`` as in Triton. Positional order is the table's."""

    block_n: int
    block_k: int
    group_m: int = 1
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def check(self, launch: str) -> None:
        """Raise ValueError if this config cannot run as ``launch`` ("gate_up" or "down")."""
        _check_powers(block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps)
        if min(self.block_n, self.block_k) < DOT_MIN:
            raise ValueError(f"{self}: tl.dot tiles need block_n and block_k >= {DOT_MIN}")
        if self.group_m < 1 or self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"{self}: group_m, split_k and num_stages must be >= 1")
        if launch == "gate_up" and self.split_k != 1:
            raise ValueError(f"{self}: gate/up cannot split K (silu needs the whole sums); split_k must be 1")


@dataclass(frozen=True)
class MoeConfig:
    """Both launches of one MoE layer: ``block_m`` rows of (token, expert) pairs per row block
    (each expert's run is padded to it), then the gate/up and down GEMMs' configs."""

    block_m: int
    gate_up: MoeGemmConfig
    down: MoeGemmConfig

    def check(self) -> None:
        """Raise ValueError if this config cannot run."""
        _check_powers(block_m=self.block_m)
        if self.block_m < DOT_MIN:
            raise ValueError(f"{self}: block_m={self.block_m} must be >= {DOT_MIN} (a tl.dot tile)")
        self.gate_up.check("gate_up")
        self.down.check("down")


def _fill_block_n(active_experts: int, n: int, sms: int) -> int:
    """The widest column tile (64, 32 or 16) that still gives every SM a program."""
    return next((b for b in (64, 32) if active_experts * -(-n // b) >= sms), 16)


def default_moe_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                       sms: int = 132) -> MoeConfig:
    """The heuristic for shapes the table lacks. Few pairs per expert (decode): 16-row blocks,
    narrow column tiles and a K split of the down projection so the few routed experts' weights
    are streamed by every SM; many: tensor-core tiles of 32 or 64 rows."""
    pairs = num_tokens * top_k
    per_expert = pairs / num_experts
    if per_expert <= 16:
        active = max(1, min(num_experts, pairs))  # no pairs (an empty batch): launches of no rows
        down_n = _fill_block_n(active, hidden, sms)
        k_steps = -(-inter // 128)
        split = max(1, min(k_steps // 2, -(-2 * sms // (active * -(-hidden // down_n)))))
        return MoeConfig(16, MoeGemmConfig(_fill_block_n(active, inter, sms), 128, num_stages=4),
                         MoeGemmConfig(down_n, 128, split_k=split, num_stages=4))
    if per_expert <= 64:
        return MoeConfig(32, MoeGemmConfig(64, 64, 8, num_stages=4), MoeGemmConfig(128, 64, 8, num_stages=4))
    return MoeConfig(64, MoeGemmConfig(128, 64, 8, num_warps=8), MoeGemmConfig(128, 64, 8))


# (num_experts, hidden, intermediate per rank, top_k, tokens) -> config, from
# ``benchmarks/moe_bench.py`` on one H200 (times of CUDA-graph replays, weights read from HBM).
# A token count takes the measured entry nearest it (in log2; a tie takes the smaller).
# MoeGemmConfig fields: block_n, block_k, group_m, split_k, num_warps, num_stages.
MOE_CONFIGS: dict[tuple[int, int, int, int, int], MoeConfig] = {
    (128, 2048, 768, 8, 1):  # qwen3-30b-a3b: 36.1 us, 2093 GB/s (default 36.9 us)
        MoeConfig(16, MoeGemmConfig(64, 128, 8, 1, 4, 4), MoeGemmConfig(32, 128, 1, 2, 4, 2)),
    (128, 2048, 768, 8, 2):  # qwen3-30b-a3b: 56.8 us, 2658 GB/s (default 60.2 us)
        MoeConfig(16, MoeGemmConfig(32, 128, 1, 1, 4, 4), MoeGemmConfig(64, 128, 1, 2, 4, 2)),
    (128, 2048, 768, 8, 4):  # qwen3-30b-a3b: 88.2 us, 3102 GB/s (default 91.0 us)
        MoeConfig(16, MoeGemmConfig(32, 128, 1, 1, 4, 5), MoeGemmConfig(64, 128, 1, 1, 4, 2)),
    (128, 2048, 768, 8, 8):  # qwen3-30b-a3b: 139.1 us, 3528 GB/s (default 141.9 us)
        MoeConfig(16, MoeGemmConfig(64, 256, 1, 1, 4, 2), MoeGemmConfig(32, 128, 1, 1, 4, 4)),
    (128, 2048, 768, 8, 64):  # qwen3-30b-a3b: 300.0 us, 3932 GB/s (default 301.0 us)
        MoeConfig(16, MoeGemmConfig(32, 128, 1, 1, 4, 4), MoeGemmConfig(32, 128, 1, 1, 4, 4)),
    (128, 2048, 768, 8, 256):  # qwen3-30b-a3b: 329.8 us, 3662 GB/s (default 356.8 us)
        MoeConfig(32, MoeGemmConfig(64, 128, 8, 1, 4, 2), MoeGemmConfig(128, 64, 8, 1, 4, 3)),
    (128, 2048, 768, 8, 2048):  # qwen3-30b-a3b: 637.9 us, 1894 GB/s (default 724.1 us)
        MoeConfig(128, MoeGemmConfig(128, 64, 8, 1, 8, 3), MoeGemmConfig(128, 64, 1, 1, 8, 3)),
    (8, 4096, 14336, 2, 1):  # mixtral-8x7b: 182.8 us, 3855 GB/s (default 187.9 us)
        MoeConfig(16, MoeGemmConfig(32, 256, 8, 1, 4, 4), MoeGemmConfig(32, 256, 1, 1, 4, 3)),
    (8, 4096, 14336, 2, 2):  # mixtral-8x7b: 259.1 us, 4080 GB/s (default 260.6 us; 2026-12-01)
        MoeConfig(16, MoeGemmConfig(64, 256, 1, 1, 4, 4), MoeGemmConfig(32, 128, 1, 1, 4, 4)),
    (8, 4096, 14336, 2, 4):  # mixtral-8x7b: 572.6 us, 4307 GB/s (default 605.1 us; 2026-12-01)
        MoeConfig(16, MoeGemmConfig(32, 128, 1, 1, 4, 2), MoeGemmConfig(64, 256, 1, 2, 4, 5)),
    (8, 4096, 14336, 2, 8):  # mixtral-8x7b: 651.0 us, 4330 GB/s (default 677.6 us)
        MoeConfig(16, MoeGemmConfig(64, 128, 1, 1, 4, 4), MoeGemmConfig(64, 256, 1, 1, 4, 3)),
    (8, 4096, 14336, 2, 64):  # mixtral-8x7b: 657.9 us, 4284 GB/s (default 806.6 us)
        MoeConfig(32, MoeGemmConfig(64, 128, 1, 1, 4, 3), MoeGemmConfig(64, 128, 1, 1, 4, 3)),
    (8, 4096, 14336, 2, 256):  # mixtral-8x7b: 800.8 us, 3520 GB/s (default 1067.6 us)
        MoeConfig(64, MoeGemmConfig(64, 64, 8, 1, 4, 3), MoeGemmConfig(128, 64, 8, 1, 4, 3)),
    (8, 4096, 14336, 2, 2048):  # mixtral-8x7b: 3050.8 us, 924 GB/s (default 3920.3 us)
        MoeConfig(128, MoeGemmConfig(128, 64, 8, 1, 8, 3), MoeGemmConfig(256, 64, 8, 1, 8, 3)),
}


def moe_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
               sms: int = 132) -> MoeConfig:
    """The table's config for this shape at the measured token count nearest ``num_tokens``, else
    ``default_moe_config``."""
    measured = [(key[4], config) for key, config in MOE_CONFIGS.items()
                if key[:4] == (num_experts, hidden, inter, top_k)]
    if not measured:
        return default_moe_config(num_tokens, num_experts, hidden, inter, top_k, sms)
    target = math.log2(max(num_tokens, 1))
    return min(measured, key=lambda entry: (abs(math.log2(entry[0]) - target), entry[0]))[1]


@dataclass(frozen=True)
class MoeGemvLaunch:
    """One GEMV launch of the GEMV path: ``block_n`` weight rows per program (of each of gate and
    up for the gate/up launch), walked over all of K in ``block_k`` steps; ``num_warps`` as in
    Triton; ``num_stages`` 1 runs the plain loop (a step's loads, then its products), from
    ``MOE_GEMV_PREFETCH_STAGES`` on each step first issues the next step's loads (the loop holds
    no tl.dot, so Triton's pipeliner stages nothing: that is the stage count's only effect).
    ``all_pairs`` (down only): one program per (column tile, token) reads all the token's pairs'
    rows each K step, instead of one per (column tile, pair) whose token's last program sums the
    pairs' shares, prefetching as the other launches do. Positional order is the table's."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    all_pairs: bool = False

    @property
    def prefetch(self) -> bool:
        """Whether the loop reads each next K step before this step's products."""
        return self.num_stages >= MOE_GEMV_PREFETCH_STAGES

    def check(self, launch: str) -> None:
        """Raise ValueError if this launch cannot run (``launch`` names it in the message)."""
        try:
            _check_powers(block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps)
            if self.num_warps > 32:
                raise ValueError(f"num_warps={self.num_warps} must be at most 32 (a CUDA block's 1024 "
                                 "threads)")
            if self.num_stages < 1:
                raise ValueError(f"num_stages={self.num_stages} must be >= 1")
            if self.all_pairs and launch != "down":
                raise ValueError("all_pairs is the down launch's (gate/up runs a program per pair)")
        except ValueError as error:
            raise ValueError(f"{launch} {self}: {error}") from None


@dataclass(frozen=True)
class MoeGemvConfig:
    """The GEMV path of one MoE layer: a gate/up launch of one program per (column tile, pair)
    that routes its pair itself, and a down launch of one program per (column tile, pair) whose
    token's last program sums the token's pairs, or per (column tile, token) with
    ``down.all_pairs``."""

    gate_up: MoeGemvLaunch
    down: MoeGemvLaunch

    def check(self) -> None:
        """Raise ValueError if this config cannot run."""
        self.gate_up.check("gate_up")
        self.down.check("down")


# (num_experts, hidden, intermediate per rank, top_k, tokens) -> GEMV config, from
# ``benchmarks/moe_bench.py`` on one H200: only where the GEMV layer beat the best grouped one,
# tokens at most MOE_GEMV_MAX_TOKENS, exact token counts (no nearest match).
# MoeGemvLaunch fields: block_n, block_k, num_warps, num_stages, all_pairs.
# Measured 2026-12-01: the two-launch path wins at 1, 2 and 4 tokens of Qwen3-30B-A3B's shape and
# loses at 8 (148.0 against 139.1 us); Mixtral's shape is not yet measured. The down launches at 1
# and 2 tokens: the form by token, from a probe of the down launch alone (2026-12-03, 10 tiles of
# it against the table's two per-pair ones, CUDA-graph timing): 11.03 against 11.90 us at 1
# token, 17.95 against 18.99 at 2, outputs equal. The 1- and 2-token lines: moe_bench's sweep
# with the by-token down launch in it (2026-12-03, session 24); at 1 token the new line took
# Qwen3-30B-A3B's W-seed batch-1 TPOT from 2.580 / 2.554 to 2.482 / 2.495 ms (BENCHMARKS.md).
# The 1-token gate/up launch at 2 warps (2026-12-04, session 35, after the programs past column
# tile 0 stopped computing the pair's weight): fewer copies of the routing row; in one LLM 2.338-
# 2.341 against the 4-warp line's 2.344-2.349 ms, end to end (run_bench, trees alternated) 2.343 /
# 2.343 against 2.345 / 2.345 ms. 1 warp, 128-wide K steps, 4 or 16 rows, and every other down
# tile tried were slower.
MOE_GEMV_CONFIGS: dict[tuple[int, int, int, int, int], MoeGemvConfig] = {
    (128, 2048, 768, 8, 1):  # qwen3-30b-a3b: 29.9 us, 2525 GB/s (grouped 34.4 us)
        MoeGemvConfig(MoeGemvLaunch(8, 256, 2, 2), MoeGemvLaunch(4, 256, 8, 1, True)),
    (128, 2048, 768, 8, 2):  # qwen3-30b-a3b: 48.3 us, 3126 GB/s (grouped 55.6 us)
        MoeGemvConfig(MoeGemvLaunch(8, 128, 2, 2), MoeGemvLaunch(2, 128, 2, 1, True)),
    (128, 2048, 768, 8, 4):  # qwen3-30b-a3b: 84.2 us, 3248 GB/s (grouped 88.7 us)
        MoeGemvConfig(MoeGemvLaunch(8, 128, 4, 1), MoeGemvLaunch(16, 256, 4, 1)),
}


def moe_gemv_config(num_tokens: int, num_experts: int, hidden: int, inter: int,
                    top_k: int) -> MoeGemvConfig | None:
    """The table's GEMV config for exactly this shape and token count, else None (the grouped
    path)."""
    if num_tokens > MOE_GEMV_MAX_TOKENS or num_experts > MOE_GEMV_MAX_EXPERTS:
        return None
    return MOE_GEMV_CONFIGS.get((num_experts, hidden, inter, top_k, num_tokens))


# (num_experts, top_k, tokens) -> warps of the routing launches, from ``benchmarks/moe_bench.py``'s
# route sweep on one H200 (exact token counts, no nearest match); only where it beat the default.
ROUTE_NUM_WARPS: dict[tuple[int, int, int], int] = {
    (128, 8, 4): 4,  # qwen3-30b-a3b: 5.9 us (default 8 warps 6.7 us)
}


def default_route_num_warps(pairs_block: int, experts_block: int) -> int:
    """Warps of a routing program of ``pairs_block`` (token, expert) pairs by ``experts_block``
    experts (its one-hot, the largest tile). One warp while that tile is at most 64 values a lane
    and 16 pairs: every max, min, sum and cumsum over the experts is then shuffles alone, where
    more warps pass each through shared memory between barriers (sm_90 SASS of the route kernel
    at 1 token, Qwen3-30B-A3B's 128 experts, top-8: 1 bar.sync and 1256 instructions a thread at
    one warp against 47 and 816 at four). Eight warps from 4096 values (the instructions a
    thread halve, the barriers stay), four between."""
    one_hot = pairs_block * experts_block
    if pairs_block <= 16 and one_hot <= 2048:
        return 1
    return 8 if one_hot >= 4096 else 4


def route_num_warps(num_tokens: int, num_experts: int, top_k: int, pairs_block: int,
                    experts_block: int) -> int:
    """``ROUTE_NUM_WARPS``'s warps for exactly this routing, else ``default_route_num_warps``."""
    measured = ROUTE_NUM_WARPS.get((num_experts, top_k, num_tokens))
    return measured if measured is not None else default_route_num_warps(pairs_block, experts_block)
