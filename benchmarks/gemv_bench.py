"""Decode GEMVs and small GEMMs of a model's linear layers (Llama-3-8B's by default; ``--shape``
names another known shape) on one GPU: cuBLAS bf16 (F.linear), the Triton dense GEMV
(``kernels/gemv.py``) and the AWQ W4A16 kernels (``kernels/w4a16.py``), each Triton kernel over
a small sweep of ``TileConfig``s, checked against its torch reference.

Per (tensor-parallel size, layer, batch rows) it prints each path's best time, the bandwidth it
achieved (bytes of weights, scales/zeros and activations read plus the output written, over the
time) and its fraction of 4.8 TB/s, the best config and the largest error; then the lines to paste
into ``src/pagedlab/kernels/gemv_configs.py`` and the batch-1 decode GEMV time per token summed
over the layers and the LM head. Times are medians of CUDA-graph replays (``graph_seconds``:
weights read from HBM, no launch gaps, as in a decode step's graph). The first run compiles every
config (Triton caches them).

    PYTHONPATH=src python3 benchmarks/gemv_bench.py --out gemv.json
    PYTHONPATH=src python3 benchmarks/gemv_bench.py --shape gemma2-9b --tp 1 --out gemv_gemma2.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from pagedlab.kernels.fp8_linear import fp8_gemv_triton, quantize_fp8_per_token_triton
from pagedlab.kernels.gemv import dense_gemv_triton, num_sms
from pagedlab.kernels.gemv_configs import (GEMV_MAX_ROWS, TileConfig, default_awq_config,
                                           default_dense_gemv_config, default_fp8_gemv_config, row_bucket,
                                           splits_for)
from pagedlab.kernels.w4a16 import awq_dequantize_triton, awq_linear_triton, check_awq_config
from pagedlab.quantization.awq import awq_linear_torch, quantize_awq
from pagedlab.quantization.fp8 import fp8_linear_cuda, fp8_linear_torch, quantize_fp8_per_row
from pagedlab.workloads import model_shape

PEAK_BYTES_PER_S = 4.8e12


def model_linears(shape: str, tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of each linear of a known shape (``pagedlab.workloads.model_shape``) on one
    rank: column-parallel ones cut N, row-parallel ones K. A mixture of experts lists its
    attention and LM head only (its experts run in the fused MoE kernels)."""
    c = model_shape(shape)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    linears = [("qkv", (q + 2 * kv) // tp, c.hidden_size), ("o", c.hidden_size, q // tp)]
    if not getattr(c, "num_local_experts", None) and not getattr(c, "num_experts", None):
        linears += [("gate_up", 2 * c.intermediate_size // tp, c.hidden_size),
                    ("down", c.hidden_size, c.intermediate_size // tp)]
    return linears + [("lm_head", c.vocab_size // tp, c.hidden_size)]


def awq_candidates(rows: int, n: int, k: int, group_size: int, sms: int) -> list[TileConfig]:
    """The sweep: a few tiles, each with K cut for about 1, 2 and 4 programs per SM (GEMV), or
    Hopper-sized GEMM tiles; the default heuristic's choice first."""
    if rows > GEMV_MAX_ROWS:
        tiles = [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 256, 64, 8, 3),
                 (128, 128, 128, 8, 3), (256, 128, 64, 8, 3)]
        found = [TileConfig(block_m=m, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
                 for m, bn, bk, w, s in tiles if m <= max(64, rows)]
    else:
        # (block_m, block_n, block_k, warps): at most 32 words a thread per K step (no spills in
        # the sm_90 SASS); the CUDA-core ones have 8 rows a thread.
        tiles = [(16, 256, 128, 4), (16, 128, 128, 4), (16, 256, 128, 8), (16, 512, 64, 8)]
        if rows == 1:
            tiles += [(0, 256, 128, 4), (0, 512, 128, 8), (0, 1024, 32, 4), (0, 128, 128, 2)]
        found = []
        for block_m, block_n, block_k, warps in tiles:
            steps = k // min(block_k, group_size)
            for waves in (1, 2, 4):
                split = splits_for(-(-n // block_n), steps, sms, waves)
                found.append(TileConfig(block_n=block_n, block_k=min(block_k, group_size), split_k=split,
                                        block_m=block_m, num_warps=warps))
    default = default_awq_config(rows, n, k, group_size, sms)
    return [default] + [c for c in dict.fromkeys(found) if c != default]


def dense_candidates(rows: int, n: int, k: int, sms: int, fp8: bool = False) -> list[TileConfig]:
    """The dense (or, with ``fp8``, the FP8) GEMV sweep, the default first."""
    tiles = [(16, 16, 256, 4), (16, 32, 256, 4), (16, 64, 128, 4), (16, 32, 512, 8)]
    if rows <= 4:
        tiles += [(0, 16, 256, 4), (0, 8, 512, 4), (0, 32, 256, 8)]
    if fp8:
        tiles += [(16, 16, 512, 4), (16, 64, 256, 8)]
        tiles += [(0, 16, 512, 4), (0, 8, 1024, 4)] if rows == 1 else []
    found = []
    for block_m, block_n, block_k, warps in tiles:
        for waves in (1, 2, 4):
            split = splits_for(-(-n // block_n), -(-k // block_k), sms, waves)
            found.append(TileConfig(block_n=block_n, block_k=block_k, split_k=split, block_m=block_m,
                                    num_warps=warps))
    default = (default_fp8_gemv_config if fp8 else default_dense_gemv_config)(rows, n, k, sms)
    return [default] + [c for c in dict.fromkeys(found) if c != default]


def graph_seconds(fn, calls: int = 16) -> float:
    """Seconds one ``fn()`` takes on the GPU as a decode step's CUDA graph runs it: ``calls`` of
    it captured in one graph, each after a write of 64 MiB (more than the H200's 50 MB L2, so
    weights come from HBM), less the same graph without ``fn``. A graph has no launch gaps, which
    a timing of eager calls adds to every small kernel (more for two launches than for one)."""
    flush = torch.empty(64 << 20, dtype=torch.int8, device="cuda")

    def replay_seconds(with_fn: bool) -> float:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                flush.zero_()
                if with_fn:
                    fn()
        graph.replay()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return sorted(times)[2]
    return max(replay_seconds(True) - replay_seconds(False), 1e-9) / calls


def measure(fn, reference: torch.Tensor, moved_bytes: int) -> dict:
    """Time ``fn`` (``graph_seconds``) and compare its output with ``reference`` (fp32), before
    and after the timed calls (a split-K counter left wrong by one call would spoil the next)."""
    error = (fn().float() - reference).abs().max().item()
    seconds = graph_seconds(fn)
    error = max(error, (fn().float() - reference).abs().max().item())
    return dict(us=seconds * 1e6, gbps=moved_bytes / seconds / 1e9, peak_fraction=moved_bytes / seconds /
                PEAK_BYTES_PER_S, max_error=error)


def sweep(candidates, run, reference: torch.Tensor, moved_bytes: int) -> dict:
    """The fastest correct candidate (and the default's result, the first candidate). Correct:
    within 1% of the largest output of the fp32 reference (bf16 rounding is 0.4%)."""
    tolerance = 1e-2 * reference.abs().max().item()
    results = []
    for config in candidates:
        try:
            result = measure(lambda c=config: run(c), reference, moved_bytes)
        except Exception as error:  # a config the compiler rejects (e.g. out of shared memory)
            result = dict(us=float("inf"), failed=f"{type(error).__name__}: {str(error)[:120]}")
        result["config"] = asdict(config)
        result["ok"] = "failed" not in result and result["max_error"] <= tolerance
        results.append(result)
    good = [r for r in results if r["ok"]]
    best = min(good, key=lambda r: r["us"]) if good else None
    return dict(best=best, default=results[0], candidates=results)


def bench_shape(tp: int, name: str, n: int, k: int, rows_list: list[int], group_size: int, sms: int,
                gen: torch.Generator) -> list[dict]:
    """Every path at every batch size for one weight shape (random bf16, and its AWQ quantization)."""
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    awq = quantize_awq(weight.T.contiguous(), group_size)
    records = []
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
        record = dict(tp=tp, layer=name, n=n, k=k, rows=rows, **bench_rows(x, weight, awq, name != "lm_head",
                                                                          group_size, sms))
        records.append(record)
        print(format_record(record), flush=True)
    return records


def bench_rows(x: torch.Tensor, weight: torch.Tensor, awq: tuple, with_awq: bool, group_size: int,
               sms: int) -> dict:
    """cuBLAS, the dense GEMV sweep (up to GEMV_MAX_ROWS rows) and the AWQ sweep for one batch."""
    (rows, k), n = x.shape, weight.shape[0]
    io_bytes = (rows * k + rows * n) * 2
    dense_bytes = weight.numel() * 2 + io_bytes
    dense_ref = x.float() @ weight.float().T
    found = dict(cublas=measure(lambda: F.linear(x, weight), dense_ref, dense_bytes))
    if rows <= GEMV_MAX_ROWS:
        found["gemv"] = sweep(dense_candidates(rows, n, k, sms),
                              lambda c: dense_gemv_triton(x, weight, None, c), dense_ref, dense_bytes)
    found["fp8"] = bench_fp8(x, weight, io_bytes, sms)
    if with_awq:  # AWQ checkpoints keep the LM head in 16 bits
        qweight, qzeros, scales = awq
        awq_ref = awq_linear_torch(x.float(), qweight, qzeros, scales.float(), group_size)
        candidates = awq_candidates(rows, n, k, group_size, sms)
        for config in candidates:
            check_awq_config(config, rows, group_size)
        awq_bytes = sum(t.numel() * t.element_size() for t in awq) + io_bytes
        found["awq"] = sweep(candidates, lambda c: awq_linear_triton(x, *awq, group_size, None, c), awq_ref,
                             awq_bytes)
        if rows > GEMV_MAX_ROWS:  # the other way for more rows: dequantize, then cuBLAS
            found["awq_dequant"] = measure(lambda: x @ awq_dequantize_triton(*awq, group_size, x.dtype),
                                           awq_ref, awq_bytes)
    return found


def bench_fp8(x: torch.Tensor, weight: torch.Tensor, io_bytes: int, sms: int) -> dict:
    """FP8 weights (per-channel scales) and per-token FP8 activations, each time including the
    activations' quantization kernel: the GEMV sweep up to GEMV_MAX_ROWS rows, else _scaled_mm."""
    values, scale = quantize_fp8_per_row(weight)
    reference = fp8_linear_torch(x.float(), values, scale)
    moved = values.numel() + scale.numel() * 4 + io_bytes // 2 * 3  # FP8 in, 16-bit out, the quantization
    rows = x.shape[0]
    if rows > GEMV_MAX_ROWS:
        return dict(best=measure(lambda: fp8_linear_cuda(x, values, scale), reference, moved))

    def run(config):
        q, s = quantize_fp8_per_token_triton(x)
        return fp8_gemv_triton(q, s, values, scale, None, x.dtype, config)
    return sweep(dense_candidates(rows, *weight.shape, sms, fp8=True), run, reference, moved)


def _describe(result: dict | None) -> str:
    if result is None:
        return "no correct config"
    text = f"{result['us']:7.1f} us {result['gbps']:6.0f} GB/s {100 * result['peak_fraction']:3.0f}%"
    return text + (f" err {result['max_error']:.1e}" if "max_error" in result else "")


def format_record(record: dict) -> str:
    shape = f"N={record['n']:>6} K={record['k']:>5} M={record['rows']:>3}"
    parts = [f"TP={record['tp']} {record['layer']:>7} {shape}",
             f"cuBLAS {_describe(record['cublas'])}"]
    for path in ("gemv", "fp8", "awq"):
        if path in record:
            best, default = record[path]["best"], record[path].get("default")
            config = TileConfig(**best["config"]) if best and "config" in best else None
            speed = f" {record['cublas']['us'] / best['us']:.2f}x cuBLAS speed" if best else ""
            tail = f" [default {default['us']:.1f} us] {config}" if default else ""
            parts.append(f"{path} {_describe(best)}{speed}{tail}")
    if "awq_dequant" in record:
        parts.append(f"awq dequantize + cuBLAS {_describe(record['awq_dequant'])}")
    return "\n    ".join(parts)


def table_lines(records: list[dict], group_size: int) -> tuple[list[str], list[str]]:
    """The entries of AWQ_CONFIGS and FP8_GEMV_CONFIGS (every measured shape) and DENSE_GEMV_CONFIGS
    (only where the GEMV beat cuBLAS by 3% or more), one per (row bucket, N, K)."""
    awq, dense, fp8 = {}, {}, {}
    for record in records:
        bucket = row_bucket(record["rows"])
        awq_best = record.get("awq", {}).get("best")
        if awq_best:
            awq[(bucket, record["n"], record["k"], group_size)] = awq_best
        fp8_best = record["fp8"]["best"]
        if fp8_best and "config" in fp8_best:
            fp8[(bucket, record["n"], record["k"])] = fp8_best
        gemv_best = record.get("gemv", {}).get("best")
        if gemv_best and gemv_best["us"] < 0.97 * record["cublas"]["us"]:
            dense[(bucket, record["n"], record["k"])] = gemv_best

    def lines(table):
        return [f"    {key}: {TileConfig(**best['config'])},  # {best['us']:.1f} us, "
                f"{100 * best['peak_fraction']:.0f}% of 4.8 TB/s" for key, best in table.items()]
    return lines(awq), lines(dense), lines(fp8)


def decode_estimates(records: list[dict], num_layers: int) -> dict:
    """Per TP size: the batch-1 linear time of one token, every layer plus the LM head, for bf16
    (the faster of cuBLAS and the GEMV), FP8 and AWQ (their kernels, the LM head in bf16)."""
    estimates = {}
    for tp in sorted({r["tp"] for r in records}):
        one = {r["layer"]: r for r in records if r["tp"] == tp and r["rows"] == 1}
        if len(one) < 5:
            continue

        def bf16_us(r):
            gemv = r.get("gemv", {}).get("best")
            return min(r["cublas"]["us"], gemv["us"] if gemv else float("inf"))
        layers = ("qkv", "o", "gate_up", "down")
        bf16 = num_layers * sum(bf16_us(one[name]) for name in layers) + bf16_us(one["lm_head"])
        awq_ok = all(one[name]["awq"]["best"] for name in layers)
        awq = (num_layers * sum(one[name]["awq"]["best"]["us"] for name in layers) + bf16_us(one["lm_head"])
               if awq_ok else None)
        fp8 = num_layers * sum(one[name]["fp8"]["best"]["us"] for name in layers) + bf16_us(one["lm_head"])
        estimates[tp] = dict(bf16_ms=bf16 / 1e3, awq_ms=awq / 1e3 if awq else None, fp8_ms=fp8 / 1e3)
    return estimates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gemv_bench.json", help="JSON file of every measurement")
    parser.add_argument("--shape", default="llama3-8b", help="a known model shape (pagedlab.workloads)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    parser.add_argument("--layers", nargs="+", default=["qkv", "o", "gate_up", "down", "lm_head"])
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    start = time.perf_counter()
    sms = num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()} ({sms} SMs); AWQ group size {args.group_size}; bf16 activations")
    gen = torch.Generator(device="cuda").manual_seed(0)
    records = []
    for tp in args.tp:
        for name, n, k in model_linears(args.shape, tp):
            if name in args.layers:
                records += bench_shape(tp, name, n, k, args.rows, args.group_size, sms, gen)
    awq_lines, dense_lines, fp8_lines = table_lines(records, args.group_size)
    estimates = decode_estimates(records, model_shape(args.shape).num_hidden_layers)
    print("\n# paste into src/pagedlab/kernels/gemv_configs.py\nAWQ_CONFIGS = {", *awq_lines, "}", sep="\n")
    print("DENSE_GEMV_CONFIGS = {", *dense_lines, "}", sep="\n")
    print("FP8_GEMV_CONFIGS = {", *fp8_lines, "}", sep="\n")
    for tp, estimate in estimates.items():
        awq = f"{estimate['awq_ms']:.2f} ms" if estimate["awq_ms"] else "n/a"
        print(f"TP={tp} batch-1 linears per token (every layer + LM head, per rank): "
              f"bf16 {estimate['bf16_ms']:.2f} ms, FP8 {estimate['fp8_ms']:.2f} ms, AWQ {awq}")
    elapsed = time.perf_counter() - start
    print(f"{len(records)} shapes in {elapsed:.0f} s; JSON in {args.out}")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), sms=sms, group_size=args.group_size,
                       records=records, awq_table=awq_lines, dense_table=dense_lines, fp8_table=fp8_lines,
                       decode_estimates=estimates, seconds=elapsed), f, indent=1)


if __name__ == "__main__":
    main()
