"""Decode GEMVs and small GEMMs of a model's linear layers (Llama-3-8B's by default; ``--shape``
names another known shape) on one GPU: cuBLAS bf16 (F.linear), the Triton dense GEMV
(``kernels/gemv.py``) and the AWQ W4A16 kernels (``kernels/w4a16.py``, on the weights repacked as
the engine holds them), each Triton kernel over a small sweep of ``TileConfig``s, checked against
its torch reference (AWQ: ``awq_linear_torch`` on AutoAWQ's GEMM tensors). A one-row gate_up
(up to ``FOLD_MAX_ROWS`` rows) runs its dense and AWQ GEMVs gated, as the engine's MLP does
(``silu(gate) * up`` in the epilogue, checked in ``sweep``), so that the table's tile is the one
for the kernel that runs; cuBLAS and FP8 time the plain product there.

Per (tensor-parallel size, layer, batch rows) it prints each path's best time, the bandwidth it
achieved (bytes of weights, scales/zeros and activations read plus the output written, over the
time) and its fraction of 4.8 TB/s, the best config and the largest error; then the lines to paste
into ``src/pagedlab/kernels/gemv_configs.py`` and the batch-1 linear time of one decode step
summed over the layers and the LM head (``--chain``: linear by linear, cuBLAS against the path the
table picks). Times are decode-like (``decode_seconds``): one CUDA graph calls the kernel on
copies of its weights in turn, as a decode step calls each layer's own weights, so every weight
comes from HBM with no launch gaps and nothing else in the graph. The first run compiles every
config (Triton caches them).

    PYTHONPATH=src python3 benchmarks/gemv_bench.py --out gemv.json
    PYTHONPATH=src python3 benchmarks/gemv_bench.py --shape gemma2-9b --tp 1 --rows 1 4 16 --chain
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, astuple, replace

import torch
import torch.nn.functional as F
from gpu_timing import COPY_CAP_BYTES, MIN_GRAPH_CALLS, PEAK_BYTES_PER_S, decode_seconds

from pagedlab.kernels.fp8_linear import fp8_gemv_triton, quantize_fp8_per_token_triton
from pagedlab.kernels.gemv import ONE_ROW_PREFETCH_STAGES, dense_gemv_triton, num_sms
from pagedlab.kernels.gemv_configs import (AWQ_CUDA_CORE_MAX_ROWS, GEMV_MAX_ROWS, TileConfig,
                                           default_awq_config, default_dense_gemv_config,
                                           default_fp8_gemv_config, row_bucket, splits_for)
from pagedlab.kernels import norm_fold
from pagedlab.kernels.w4a16 import awq_dequantize_triton, awq_linear_triton, check_awq_config
from pagedlab.layers.activation import silu_and_mul
from pagedlab.quantization.awq import awq_linear_torch, quantize_awq, repack_awq
from pagedlab.quantization.fp8 import fp8_linear_cuda, fp8_linear_torch, quantize_fp8_per_row, scaled_mm_fp8
from pagedlab.workloads import model_shape

# The one-row GEMV tiles without a K split (``one_row_tiles``, ``awq_cuda_core_tiles``).
ONE_ROW_BLOCK_N = (4, 8, 16)
ONE_ROW_BLOCK_K = (256, 512, 1024)
# One-row tiles of at most this many weight bytes a step (64 a thread at 4 warps) also run with
# the next K step read during this one's products (ONE_ROW_PREFETCH_STAGES): 48-128 registers, no
# spills (ptxas, sm_90); bf16's 16 x 512 took 167, 3 programs an SM.
ONE_ROW_PREFETCH_MAX_BYTES = 8192
AWQ_ONE_ROW_BLOCK_N = (4, 8, 16, 32)
AWQ_ONE_ROW_BLOCK_K = (512, 1024, 2048, 4096)
# The AWQ one-row tiles' int32 words a thread holds a K step. In the sm_90 SASS of the loop,
# 16 to 32 take 3.4-4.0 instructions a weight with the paired nibble unpacking (4.1-4.6 before
# it), no spills; 2 took 8.6.
AWQ_WORDS_PER_THREAD = (8, 32)
# The AWQ GEMM's tiles (block_m rows, block_n columns, block_k, warps, stages; block_k capped at the
# group size). K steps of 128 read 64 contiguous bytes of each column's words, of 64 only 32.
AWQ_GEMM_TILES = [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 256, 64, 8, 3),
                  (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (32, 128, 128, 4, 3), (64, 128, 128, 4, 3),
                  (64, 256, 128, 8, 3), (128, 256, 128, 8, 3)]
# Its swapped form's (``swap_ab``): block_n (the weight tile) is wgmma's M, block_m (the rows) its
# N. Compiled for sm_90a (bf16, groups of 128) none spills (68-254 registers; 256 x 128 tiles on 4
# warps spilled 2.9 KB, 256 x 64 x 128 on 4 warps 76 bytes) and each takes at most 148 KB of
# shared memory (256 x 64 x 128 at 4 stages would take 279 KB, over the H200's 227 KB).
AWQ_SWAPPED_GEMM_TILES = [(64, 64, 128, 4, 4), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
                          (64, 128, 128, 8, 3), (128, 64, 64, 4, 4), (128, 64, 128, 8, 4),
                          (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (256, 64, 128, 8, 2),
                          (256, 128, 64, 8, 3)]


# The GEMVs' swapped tl.dot tiles (block_n weight rows on wgmma's M, the rows padded to 16 on its
# N, block_k, stages): compiled for sm_90 with the launch's 16-divisible sizes, each K step's
# weight tile goes to shared memory by cp.async and straight into wgmma (FP8 as E4M3); the
# stages' tiles take at most 131 KB of shared memory (bf16 128 x 256 would take 197 KB at 3).
SWAPPED_GEMV_TILES = [(64, 128, 3), (64, 256, 3), (128, 128, 3), (128, 256, 2)]
SWAPPED_FP8_GEMV_TILES = [(64, 512, 3), (128, 512, 2), (128, 256, 3)]


# Linears the quantized models keep in 16 bits: the LM head (AWQ and FP8 checkpoints keep it so)
# and a mixture of experts' router (a plain linear, never quantized).
DENSE_ONLY_LINEARS = ("lm_head", "router")
# The kernel sweeps besides cuBLAS: the dense GEMV, FP8 and AWQ (``--paths`` picks some).
PATHS = ("gemv", "fp8", "awq")


def model_linears(shape: str, tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of each linear of a known shape (``pagedlab.workloads.model_shape``) on one
    rank: column-parallel ones cut N, row-parallel ones K. A mixture of experts lists its
    attention, its router (whole on every rank) and LM head (its experts run in the fused MoE
    kernels)."""
    c = model_shape(shape)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    linears = [("qkv", (q + 2 * kv) // tp, c.hidden_size), ("o", c.hidden_size, q // tp)]
    num_experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if num_experts:
        linears.append(("router", num_experts, c.hidden_size))
    else:
        linears += [("gate_up", 2 * c.intermediate_size // tp, c.hidden_size),
                    ("down", c.hidden_size, c.intermediate_size // tp)]
    return linears + [("lm_head", c.vocab_size // tp, c.hidden_size)]


def awq_candidates(rows: int, n: int, k: int, group_size: int, sms: int) -> list[TileConfig]:
    """The sweep of the kernels over the repacked layout: up to ``AWQ_CUDA_CORE_MAX_ROWS`` rows
    ``awq_cuda_core_tiles``, each also with K cut for about 2 programs per SM where its column
    tiles alone make fewer; from 2 to 16 rows tl.dot tiles with K steps of one group at most, K
    cut for about 1, 2 and 4 programs per SM; more rows Hopper-sized GEMM tiles, in both of the
    GEMM's forms (AWQ_GEMM_TILES and AWQ_SWAPPED_GEMM_TILES, those of at most ``max(64, rows)``
    rows), each also with K cut for about 2 programs per SM where its tiles alone make fewer. The
    default heuristic's choice first."""
    if rows > GEMV_MAX_ROWS:
        tiles = [(*t, False) for t in AWQ_GEMM_TILES] + [(*t, True) for t in AWQ_SWAPPED_GEMM_TILES]
        found = []
        for m, bn, bk, w, s, swap in tiles:
            if m <= max(64, rows):
                tile = TileConfig(block_m=m, block_n=bn, block_k=min(bk, group_size), num_warps=w,
                                  num_stages=s, swap_ab=swap)
                split = splits_for(-(-rows // m) * -(-n // bn), -(-k // tile.block_k), sms)
                found += [tile] + ([replace(tile, split_k=split)] if split > 1 else [])
        return _default_first(default_awq_config(rows, n, k, group_size, sms), found)
    found = []
    if rows <= AWQ_CUDA_CORE_MAX_ROWS:
        for tile in awq_cuda_core_tiles(k):
            split = splits_for(-(-n // tile.block_n), -(-k // tile.block_k), sms)
            found += [tile] + ([replace(tile, split_k=split)] if split > 1 else [])
    if rows > 1:
        for block_n, warps in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8)):
            block_k = min(128, group_size)
            for waves in (1, 2, 4):
                split = splits_for(-(-n // block_n), k // block_k, sms, waves)
                found.append(TileConfig(block_n=block_n, block_k=block_k, split_k=split, block_m=16,
                                        num_warps=warps, num_stages=3))
    return _default_first(default_awq_config(rows, n, k, group_size, sms), found)


def _default_first(default: TileConfig, found: list[TileConfig]) -> list[TileConfig]:
    return [default] + [c for c in dict.fromkeys(found) if c != default]


def awq_cuda_core_tiles(k: int) -> list[TileConfig]:
    """AWQ GEMV tiles on the CUDA cores (one row, or up to ``AWQ_CUDA_CORE_MAX_ROWS`` sharing each
    step's unpacked words) without a K split: ``AWQ_ONE_ROW_BLOCK_N`` columns and
    ``AWQ_ONE_ROW_BLOCK_K`` (dividing K) a step, 4 or 8 warps, where a thread holds
    ``AWQ_WORDS_PER_THREAD`` words a step, each with 3 stages (the next step's weights read
    during this one's sums) and 1 (after them). A K step may span several groups."""
    low, high = AWQ_WORDS_PER_THREAD
    return [TileConfig(block_n=block_n, block_k=block_k, split_k=1, block_m=0, num_warps=warps,
                       num_stages=stages)
            for block_n in AWQ_ONE_ROW_BLOCK_N for block_k in AWQ_ONE_ROW_BLOCK_K for warps in (4, 8)
            for stages in (3, 1)
            if k % block_k == 0 and low <= block_n * block_k // 8 // (32 * warps) <= high]


def dense_candidates(rows: int, n: int, k: int, sms: int, fp8: bool = False) -> list[TileConfig]:
    """The dense (or, with ``fp8``, the FP8) GEMV sweep, the default first: tl.dot tiles in both
    forms (SWAPPED_GEMV_TILES, and SWAPPED_FP8_GEMV_TILES for FP8), each with K cut for about 1, 2
    and 4 programs per SM; for up to 4 rows CUDA-core tiles, for one row also ``one_row_tiles``."""
    tiles = [(16, 16, 256, 4), (16, 32, 256, 4), (16, 64, 128, 4), (16, 32, 512, 8)]
    if rows <= 4:
        tiles += [(0, 16, 256, 4), (0, 8, 512, 4), (0, 32, 256, 8)]
    if fp8:
        tiles += [(16, 16, 512, 4), (16, 64, 256, 8)]
        tiles += [(0, 16, 512, 4), (0, 8, 1024, 4)] if rows == 1 else []
    bases = [TileConfig(block_n=block_n, block_k=block_k, block_m=block_m, num_warps=warps)
             for block_m, block_n, block_k, warps in tiles]
    bases += [TileConfig(block_n=block_n, block_k=block_k, block_m=16, num_stages=stages, swap_ab=True)
              for block_n, block_k, stages in SWAPPED_GEMV_TILES + (SWAPPED_FP8_GEMV_TILES if fp8 else [])]
    found = [replace(tile, split_k=splits_for(-(-n // tile.block_n), -(-k // tile.block_k), sms, waves))
             for tile in bases for waves in (1, 2, 4)]
    if rows == 1:
        found += one_row_tiles(ONE_ROW_BLOCK_K + ((2048,) if fp8 else ()), fp8)
    default = (default_fp8_gemv_config if fp8 else default_dense_gemv_config)(rows, n, k, sms)
    return [default] + [c for c in dict.fromkeys(found) if c != default]


def one_row_tiles(block_ks: tuple[int, ...], fp8: bool = False) -> list[TileConfig]:
    """One-row GEMV tiles without a K split: a program per 4-16 weight rows over all of K, 3
    stages, 4 warps, each K step one ``block_ks`` (an FP8 weight row is half the bytes, so its
    steps go to 2048). In ``pdl_probe.py``'s chain of Llama-3-8B's decode linears such tiles beat
    cuBLAS and the split-K tiles at every shape. Those of at most ONE_ROW_PREFETCH_MAX_BYTES
    (``fp8``: one byte a weight, else two) also with the next step's weights read before this
    step's products (a thread of the plain loop has one step's loads in flight, then none while
    it multiplies)."""
    tiles = [TileConfig(block_n=block_n, block_k=block_k, split_k=1, block_m=0, num_warps=4, num_stages=3)
             for block_n in ONE_ROW_BLOCK_N for block_k in block_ks]
    weight_bytes = 1 if fp8 else 2
    return tiles + [replace(tile, num_stages=ONE_ROW_PREFETCH_STAGES) for tile in tiles
                    if tile.block_n * tile.block_k * weight_bytes <= ONE_ROW_PREFETCH_MAX_BYTES]


def measure(fn, operands: tuple[torch.Tensor, ...], reference: torch.Tensor, moved_bytes: int) -> dict:
    """Time ``fn(*operands)`` (``decode_seconds``) and compare its output with ``reference``
    (fp32), before and after the timed calls (a split-K counter left wrong by one call would
    spoil the next)."""
    error = (fn(*operands).float() - reference).abs().max().item()
    seconds = decode_seconds(fn, operands)
    error = max(error, (fn(*operands).float() - reference).abs().max().item())
    return dict(us=seconds * 1e6, gbps=moved_bytes / seconds / 1e9, peak_fraction=moved_bytes / seconds /
                PEAK_BYTES_PER_S, max_error=error)


def sweep(candidates, run, operands: tuple[torch.Tensor, ...], reference: torch.Tensor,
          moved_bytes: int, gated: bool = False) -> dict:
    """The fastest correct candidate of ``run(config, *operands)`` (and the default's result, the
    first candidate). Correct: within 1% of the largest output of the fp32 ``reference`` (bf16
    rounding is 0.4%); ``gated`` (``run`` writes ``silu(gate) * up`` of the reference's halves):
    within 2% of the largest ``|gate| * |up|`` of ``silu_and_mul(reference)`` (the GEMV rounds
    gate and up to bf16 before multiplying them, 0.4% apiece, silu's slope up to 1.1)."""
    tolerance = 1e-2 * reference.abs().max().item()
    if gated:
        gate, up = reference.chunk(2, dim=-1)
        reference, tolerance = silu_and_mul(reference), 2e-2 * (gate.abs() * up.abs()).max().item()
    results = []
    for config in candidates:
        try:
            result = measure(lambda *ops, c=config: run(c, *ops), operands, reference, moved_bytes)
        except Exception as error:  # a config the compiler rejects (e.g. out of shared memory)
            result = dict(us=float("inf"), failed=f"{type(error).__name__}: {str(error)[:120]}")
        result["config"] = asdict(config)
        result["ok"] = "failed" not in result and result["max_error"] <= tolerance
        results.append(result)
    good = [r for r in results if r["ok"]]
    best = min(good, key=lambda r: r["us"]) if good else None
    return dict(best=best, default=results[0], candidates=results)


def bench_shape(tp: int, name: str, n: int, k: int, rows_list: list[int], group_size: int, sms: int,
                gen: torch.Generator, paths: tuple[str, ...] = PATHS) -> list[dict]:
    """Every path at every batch size for one weight shape (random bf16, and its AWQ quantization)."""
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    awq = quantize_awq(weight.T.contiguous(), group_size)
    records = []
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
        gated = name == "gate_up" and rows <= norm_fold.FOLD_MAX_ROWS  # as the engine's MLP runs it
        found = bench_rows(x, weight, awq, name not in DENSE_ONLY_LINEARS, group_size, sms, paths, gated)
        record = dict(tp=tp, layer=name, n=n, k=k, rows=rows, gated=gated, **found)
        records.append(record)
        print(format_record(record), flush=True)
    return records


def bench_rows(x: torch.Tensor, weight: torch.Tensor, awq: tuple, quantized: bool, group_size: int,
               sms: int, paths: tuple[str, ...] = PATHS, gated: bool = False) -> dict:
    """cuBLAS, the dense GEMV sweep (up to GEMV_MAX_ROWS rows) and, for a linear the quantized
    models quantize, the FP8 and AWQ sweeps for one batch: those of ``paths``. ``gated`` (a
    gate_up projection where the engine's MLP runs it so): the dense and AWQ GEMVs write
    ``silu(gate) * up`` (``gated=True``, checked by ``sweep``); cuBLAS and FP8
    (whose activation kernel emits FP8) time the plain product."""
    (rows, k), n = x.shape, weight.shape[0]
    io_bytes = (rows * k + rows * n) * 2
    dense_bytes = weight.numel() * 2 + io_bytes
    dense_ref = x.float() @ weight.float().T
    found = dict(cublas=measure(lambda w: F.linear(x, w), (weight,), dense_ref, dense_bytes))
    gated_bytes = rows * n if gated else 0  # half the output written
    if rows <= GEMV_MAX_ROWS and "gemv" in paths:
        found["gemv"] = sweep(dense_candidates(rows, n, k, sms),
                              lambda c, w: dense_gemv_triton(x, w, None, c, gated=gated), (weight,),
                              dense_ref, dense_bytes - gated_bytes, gated)
    if quantized and "fp8" in paths:
        found["fp8"] = bench_fp8(x, weight, io_bytes, sms)
    if quantized and "awq" in paths:
        found.update(bench_awq(x, awq, group_size, io_bytes - gated_bytes, sms, gated))
    return found


def bench_awq(x: torch.Tensor, awq: tuple, group_size: int, io_bytes: int, sms: int,
              gated: bool = False) -> dict:
    """The AWQ sweep on ``awq`` (AutoAWQ's GEMM tensors, the reference's operands) repacked as the
    engine holds them (``gated`` as in ``bench_rows``); with more than GEMV_MAX_ROWS rows also
    dequantize-then-cuBLAS."""
    (rows, k), (qweight, qzeros, scales) = x.shape, awq
    n = scales.shape[1]
    reference = awq_linear_torch(x.float(), qweight, qzeros, scales.float(), group_size)
    repacked = repack_awq(qweight, qzeros, scales, group_size)
    candidates = awq_candidates(rows, n, k, group_size, sms)
    for config in candidates:
        check_awq_config(config, rows, group_size)
    moved = sum(t.numel() * t.element_size() for t in repacked) + io_bytes

    def run(config, *packed):
        return awq_linear_triton(x, *packed, group_size, None, config, gated=gated)

    found = dict(awq=sweep(candidates, run, repacked, reference, moved, gated))
    if rows > GEMV_MAX_ROWS:
        def dequantized(*packed):
            return F.linear(x, awq_dequantize_triton(*packed, group_size, x.dtype))
        found["awq_dequant"] = measure(dequantized, repacked, reference, moved)
    return found


def bench_fp8(x: torch.Tensor, weight: torch.Tensor, io_bytes: int, sms: int) -> dict:
    """FP8 weights (per-channel scales) and per-token FP8 activations: up to GEMV_MAX_ROWS rows
    the GEMV sweep on activations quantized once beforehand (in the engine the RMSNorms and the
    SiLU-and-mul before qkv, gate/up and down emit them so, ``fp8_linear.QuantizedActivations``),
    else _scaled_mm including the activations' quantization kernel."""
    values, scale = quantize_fp8_per_row(weight)
    reference = fp8_linear_torch(x.float(), values, scale)
    rows, k = x.shape
    weight_bytes = values.numel() + scale.numel() * 4
    if rows > GEMV_MAX_ROWS:  # FP8 in, 16-bit out, the quantization's 16-bit in and FP8 out
        return dict(best=measure(lambda v, s: fp8_linear_cuda(x, v, s), (values, scale), reference,
                                 weight_bytes + io_bytes // 2 * 3))
    q, q_scale = quantize_fp8_per_token_triton(x)
    moved = weight_bytes + rows * k + rows * 4 + (io_bytes - rows * k * 2)  # FP8 x and scales, 16-bit out

    def run(config, v, s):
        return fp8_gemv_triton(q, q_scale, v, s, None, x.dtype, config)

    candidates = dense_candidates(rows, *weight.shape, sms, fp8=True)
    found = sweep(candidates, run, (values, scale), reference, moved)
    # the path of the shapes FP8_GEMV_CONFIGS leaves out, on the same quantized rows
    return dict(found, scaled_mm=measure(lambda v, s: scaled_mm_fp8(q, q_scale, v, s), (values, scale),
                                         reference, moved))


def _describe(result: dict | None) -> str:
    if result is None:
        return "no correct config"
    text = f"{result['us']:7.1f} us {result['gbps']:6.0f} GB/s {100 * result['peak_fraction']:3.0f}%"
    return text + (f" err {result['max_error']:.1e}" if "max_error" in result else "")


def format_record(record: dict) -> str:
    shape = f"N={record['n']:>6} K={record['k']:>5} M={record['rows']:>3}"
    gated = " (GEMVs gated: silu(gate) * up)" if record.get("gated") else ""
    parts = [f"TP={record['tp']} {record['layer']:>7} {shape}{gated}",
             f"cuBLAS {_describe(record['cublas'])}"]
    for path in ("gemv", "fp8", "awq"):
        if path in record:
            best, default = record[path]["best"], record[path].get("default")
            config = TileConfig(**best["config"]) if best and "config" in best else None
            speed = f" {record['cublas']['us'] / best['us']:.2f}x cuBLAS speed" if best else ""
            tail = f" [default {default['us']:.1f} us] {config}" if default else ""
            parts.append(f"{path} {_describe(best)}{speed}{tail}")
    if "scaled_mm" in record.get("fp8", {}):
        parts.append(f"fp8 torch._scaled_mm {_describe(record['fp8']['scaled_mm'])}")
    if "awq_dequant" in record:
        forms = gemm_forms(record["awq"])
        parts.append(f"awq GEMM plain {_describe(forms.get('plain'))}; "
                     f"swapped {_describe(forms.get('swap_ab'))}")
        parts.append(f"awq dequantize + cuBLAS {_describe(record['awq_dequant'])}")
    return "\n    ".join(parts)


def gemm_forms(awq: dict) -> dict:
    """The fastest correct candidate of each form of the AWQ GEMM in ``awq`` (a ``sweep``):
    ``plain`` and ``swap_ab``; a form without one is left out."""
    found = {}
    for result in awq["candidates"]:
        form = "swap_ab" if result["config"].get("swap_ab") else "plain"
        if result["ok"] and result["us"] < found.get(form, {}).get("us", float("inf")):
            found[form] = result
    return found


def bf16_choice(record: dict) -> tuple[str, float]:
    """The 16-bit path DENSE_GEMV_CONFIGS gives this (shape, rows) and its microseconds: the GEMV
    where its best beat cuBLAS by 3% or more (a margin over the timing's noise), else cuBLAS."""
    gemv = record.get("gemv", {}).get("best")
    if gemv and gemv["us"] < 0.97 * record["cublas"]["us"]:
        return "gemv", gemv["us"]
    return "cublas", record["cublas"]["us"]


def table_lines(records: list[dict], group_size: int) -> tuple[list[str], list[str], list[str]]:
    """The entries of AWQ_CONFIGS (above GEMV_MAX_ROWS only where the GEMM beat dequantize-then-
    cuBLAS), FP8_GEMV_CONFIGS (where the GEMV beat ``torch._scaled_mm``) and DENSE_GEMV_CONFIGS
    (where ``bf16_choice`` takes the GEMV), one per (row bucket, N, K)."""
    awq, dense, fp8 = {}, {}, {}
    for record in records:
        key = (row_bucket(record["rows"]), record["n"], record["k"])
        awq_best = record.get("awq", {}).get("best")
        dequant_us = record.get("awq_dequant", {}).get("us", float("inf"))  # the path of unlisted shapes
        if awq_best and awq_best["us"] < dequant_us:
            awq[(*key, group_size)] = awq_best, ""
        fp8_best = record.get("fp8", {}).get("best")
        scaled_mm = record.get("fp8", {}).get("scaled_mm", {}).get("us", float("inf"))
        if fp8_best and "config" in fp8_best and fp8_best["us"] < scaled_mm:
            fp8[key] = fp8_best, f" (_scaled_mm {scaled_mm:.1f})"
        if bf16_choice(record)[0] == "gemv":
            dense[key] = record["gemv"]["best"], f" (cuBLAS {record['cublas']['us']:.1f})"

    def lines(table):
        return [f"    {key}: {config_text(TileConfig(**best['config']))},  # {best['us']:.1f}{cublas}, "
                f"{100 * best['peak_fraction']:.0f}%" for key, (best, cublas) in table.items()]
    return lines(awq), lines(dense), lines(fp8)


def config_text(config: TileConfig) -> str:
    """``config`` as the tables spell it: its fields in order, positional (``swap_ab`` only where set,
    so that the other entries keep their six fields)."""
    fields = astuple(config)
    return f"TileConfig{fields if config.swap_ab else fields[:-1]}"


def linear_times(record: dict) -> dict:
    """One batch-1 linear's microseconds per path: ``cublas``, ``bf16`` (``bf16_choice``, its
    path in ``bf16_path``), ``fp8`` and ``awq`` (their best configs; None without a correct one).
    DENSE_ONLY_LINEARS run bf16 in the FP8 and AWQ models."""
    path, bf16 = bf16_choice(record)
    times = dict(cublas=record["cublas"]["us"], bf16=bf16, bf16_path=path)
    for name in ("fp8", "awq"):
        best = record.get(name, {}).get("best")
        times[name] = bf16 if record["layer"] in DENSE_ONLY_LINEARS else best["us"] if best else None
    return times


def decode_estimates(records: list[dict], num_layers: int) -> dict:
    """Per TP size, one decode step's batch-1 linear time per rank in ms: every measured layer
    linear ``num_layers`` times, the LM head once, for cuBLAS alone and for the bf16, FP8 and AWQ
    paths (``linear_times``; None where a linear has no correct config); ``linears``: each
    linear's ``linear_times``. A mixture of experts' experts are not among the linears."""
    estimates = {}
    for tp in sorted({r["tp"] for r in records}):
        linears = {r["layer"]: linear_times(r) for r in records if r["tp"] == tp and r["rows"] == 1}
        if not linears:
            continue
        estimate = dict(linears=linears)
        for path in ("cublas", "bf16", "fp8", "awq"):
            times = [(1 if name == "lm_head" else num_layers, t[path]) for name, t in linears.items()]
            found = None if any(us is None for _, us in times) else sum(c * us for c, us in times) / 1e3
            estimate[f"{path}_ms"] = found
        estimates[tp] = estimate
    return estimates


def _us(value: float | None) -> str:
    return f"{value:9.1f}" if value is not None else "      n/a"


def _ms(value: float | None) -> str:
    return f"{value:.2f} ms" if value is not None else "n/a"


def step_summary(estimates: dict, num_layers: int, chain: bool) -> list[str]:
    """Per TP size, one decode step's batch-1 linear time (cuBLAS alone, the bf16 paths the tables
    pick, FP8, AWQ); with ``chain`` first each linear's microseconds on those paths."""
    lines = []
    for tp, estimate in estimates.items():
        if chain:
            lines.append(f"TP={tp} batch-1 linears, us per call (a step: {num_layers} x each layer's, "
                         "the LM head once)")
            lines.append(f"    {'linear':>8} {'cuBLAS':>9} {'bf16':>9} {'(path)':8} {'FP8':>9} {'AWQ':>9}")
            lines += [f"    {name:>8} {_us(t['cublas'])} {_us(t['bf16'])} {t['bf16_path']:8} {_us(t['fp8'])} "
                      f"{_us(t['awq'])}" for name, t in estimate["linears"].items()]
        lines.append(f"TP={tp} batch-1 linears per token ({', '.join(estimate['linears'])}; per rank): "
                     f"cuBLAS {_ms(estimate['cublas_ms'])}, bf16 {_ms(estimate['bf16_ms'])}, "
                     f"FP8 {_ms(estimate['fp8_ms'])}, AWQ {_ms(estimate['awq_ms'])}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gemv_bench.json", help="JSON file of every measurement")
    parser.add_argument("--shape", default="llama3-8b", help="a known model shape (pagedlab.workloads)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    parser.add_argument("--layers", nargs="+", default=["qkv", "o", "gate_up", "down", "router", "lm_head"])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS,
                        help="the sweeps to run (cuBLAS always runs, the reference time)")
    parser.add_argument("--chain", action="store_true",
                        help="print each batch-1 linear's time and the decode step's sum, cuBLAS against "
                             "the paths the tables pick")
    args = parser.parse_args()
    start = time.perf_counter()
    sms = num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()} ({sms} SMs); AWQ group size {args.group_size}; bf16 activations")
    gen = torch.Generator(device="cuda").manual_seed(0)
    records = []
    for tp in args.tp:
        for name, n, k in model_linears(args.shape, tp):
            if name in args.layers:
                records += bench_shape(tp, name, n, k, args.rows, args.group_size, sms, gen,
                                       tuple(args.paths))
    awq_lines, dense_lines, fp8_lines = table_lines(records, args.group_size)
    num_layers = model_shape(args.shape).num_hidden_layers
    estimates = decode_estimates(records, num_layers)
    print("\n# paste into src/pagedlab/kernels/gemv_configs.py\nAWQ_CONFIGS = {", *awq_lines, "}", sep="\n")
    print("DENSE_GEMV_CONFIGS = {", *dense_lines, "}", sep="\n")
    print("FP8_GEMV_CONFIGS = {", *fp8_lines, "}", sep="\n")
    print(*step_summary(estimates, num_layers, args.chain), sep="\n")
    elapsed = time.perf_counter() - start
    print(f"{len(records)} shapes in {elapsed:.0f} s; JSON in {args.out}")
    timing = dict(method="decode_seconds", min_calls=MIN_GRAPH_CALLS, copy_cap_bytes=COPY_CAP_BYTES,
                  l2_bytes=torch.cuda.get_device_properties(0).L2_cache_size)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), sms=sms, group_size=args.group_size,
                       timing=timing, records=records, awq_table=awq_lines, dense_table=dense_lines,
                       fp8_table=fp8_lines, decode_estimates=estimates, seconds=elapsed), f, indent=1)


if __name__ == "__main__":
    main()
