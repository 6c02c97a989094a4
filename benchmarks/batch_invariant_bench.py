"""Where batch-invariant mode's time goes on one GPU, and the config table that makes it fast.

First the mode's matmul as the model calls it (``fixed_tile_matmul_triton`` dispatched: the
table's config, or the persistent TMA launch for prefill) against cuBLAS at 256, 1,024 and 8,192
rows per Llama-3-8B linear but the LM head, with the launch it took, a bitwise check against the
in-program launch and the sum of the four (one layer); ``--dispatch-only`` stops there.

Linears (Llama-3-8B's qkv, o, gate_up, down and the LM head, bf16): every candidate config of
the fixed-tile matmul (``kernels/batch_invariant.py``; tiles, warps, stages and a K segment count
fixed per shape) at each batch of rows, against the default mode's linear (cuBLAS or the dense
GEMV, ``dense_linear``). Each config is VERIFIED before it counts: close to the fp32 reference,
and each row's output bitwise the same at every row count (row 0 alone equals row 0 of 8,192).
Configs of one shape are then grouped into classes whose outputs are bitwise equal on the same
input (same ``block_k`` and ``split_k`` required): only one class may serve a shape, but within
it each row bucket may take its fastest member (a 16- or 64-row tile for decode, 128 rows for
prefill) - the mixed table is checked once more through the dispatch. The class chosen per shape
is the one with the smallest geometric mean, over the row counts, of its time over the default
mode's. The script prints the lines to paste into ``BATCH_INVARIANT_CONFIGS`` in
``src/pagedlab/kernels/gemv_configs.py`` and the linear time of one decode step, 32 layers and
the LM head, in both modes.

Then the other kernels the mode swaps, in both modes: attention (decode at batch 1 and 640 keys
and at batch 256 and about 600, one 8,192-token prefill step; the mode's at query tiles of 16,
32 and 64 rows, ``paged_attention.BATCH_INVARIANT_BLOCK_M``), the RMSNorm with its residual add,
and the sampler's (log-)softmax.

Linears are timed as a decode step runs them (``gpu_timing.decode_seconds``: one CUDA graph
calls the linear on copies of its weight in turn, together over twice the L2, so every weight
comes from HBM with no flush writes between calls and no launch gaps); the other kernels by
``gpu_timing.graph_seconds`` (an L2 flush before each call). The first run compiles every config
(Triton caches them); ``--layers`` and ``--rows`` cut a run short.

    PYTHONPATH=src python3 benchmarks/batch_invariant_bench.py --out binv_bench.json
    PYTHONPATH=src python3 benchmarks/batch_invariant_bench.py --dispatch-only --out binv_dispatch.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from gemv_bench import model_linears
from gpu_timing import PEAK_BYTES_PER_S, decode_seconds, graph_seconds
from pagedlab.kernels.batch_invariant import fixed_tile_matmul_launch, fixed_tile_matmul_triton
from pagedlab.kernels.gemv import k_segments, num_sms
from pagedlab.kernels.gemv_configs import (BATCH_INVARIANT_ROW_BUCKETS, BATCH_INVARIANT_TILE, TileConfig,
                                           batch_invariant_config, batch_invariant_row_bucket,
                                           batch_invariant_split_launch)
from pagedlab.layers.batch_invariant import batch_invariant_mode
from pagedlab.quantization.linear_method import dense_linear
from pagedlab.workloads import model_shape

# (block_m, block_n, block_k, warps, stages): 128- and 256-row tiles for prefill, 64 rows (one
# wgmma warpgroup) and 16 rows (mma.sync on Hopper) for decode; block_k 64 and 128.
CANDIDATE_TILES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
                   (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (16, 32, 64, 4, 4),
                   (16, 64, 64, 4, 4), (16, 128, 64, 4, 4), (128, 128, 128, 8, 3), (64, 128, 128, 4, 3),
                   (16, 64, 128, 4, 4)]
DEVICE = "cuda"
# (phase, sequences, new tokens each, keys each) of the attention timed: W-seed's decode at batch
# 1 near its end and at batch 256 halfway, and a prefill step of the default 8,192-token budget
ATTENTION_CASES = (("decode", 1, 1, 640), ("decode", 256, 1, 576), ("prefill", 16, 512, 512))
# Query-tile rows of batch-invariant attention timed (the mode's is paged_attention.BATCH_INVARIANT_BLOCK_M)
INVARIANT_ATTENTION_ROWS = (16, 32, 64)
# Key segments of batch-invariant attention timed besides none and the mode's own: smaller ones let
# a batch-1 decode split its keys over more programs, at the cost of one merge per segment
INVARIANT_ATTENTION_SEGMENTS = (64, 128, 256)
# A config this many times slower than the default mode at some row count is not timed at more rows.
GIVE_UP_SLOWDOWN = 4.0
# The LM head runs on one row per sequence: never more rows than the largest decode batch.
LM_HEAD_MAX_ROWS = 256
# Row counts of the dispatched matmul timed against cuBLAS: a decode batch of 256 (the table's
# tiles) and prefill steps of 1,024 and 8,192 tokens (the persistent launch on Hopper)
DISPATCH_ROWS = (256, 1024, 8192)


def segment_counts(n: int, k: int, sms: int) -> list[int]:
    """K segment counts to try for a weight: none, and enough for 128-column tiles to make about
    one and two waves of programs (at least 4 steps of 64 in a segment)."""
    tiles, steps = -(-n // 128), k // 64
    return sorted({1} | {max(1, min(steps // 4, -(-waves * sms // tiles))) for waves in (1, 2)})


def candidates(n: int, k: int, sms: int) -> list[TileConfig]:
    """Every candidate tile with every segment count (the effective count: ``k_segments``), the
    default config first."""
    found = [batch_invariant_config(1, n, k, sms, table={})]
    for block_m, block_n, block_k, warps, stages in CANDIDATE_TILES:
        for segments in segment_counts(n, k, sms):
            effective = k_segments(k, block_k, segments)[1]
            found.append(TileConfig(block_n=block_n, block_k=block_k, split_k=effective, block_m=block_m,
                                    num_warps=warps, num_stages=stages))
    return list(dict.fromkeys(found))


def linear_seconds(linear, x: torch.Tensor, weight: torch.Tensor) -> float:
    """Seconds of ``linear(x, weight)`` in a decode step's graph (``decode_seconds``), after one
    eager call: Triton compiles and the split-K counters are made outside the capture."""
    linear(x, weight)
    return decode_seconds(linear, (x, weight))


def eager_then_graph_seconds(fn) -> float:
    """``graph_seconds(fn)`` after one eager call: Triton compiles and the split-K counters are
    made outside the capture."""
    fn()
    return graph_seconds(fn)


def timing(seconds: float, rows: int, n: int, k: int) -> dict:
    moved = 2 * (n * k + rows * k + rows * n)
    return dict(us=seconds * 1e6, gbps=moved / seconds / 1e9, tflops=2 * rows * n * k / seconds / 1e12,
                peak_fraction=moved / seconds / PEAK_BYTES_PER_S)


def bench_config(config: TileConfig, x: torch.Tensor, weight: torch.Tensor, rows_list: list[int],
                 reference: torch.Tensor, default_times: dict[int, dict]) -> tuple[dict, torch.Tensor | None]:
    """One config at every row count: its output for all of ``x`` (None if it failed), its
    error, whether each row count's rows equal those of the full batch bitwise, and its times
    (None past a row count where it took over ``GIVE_UP_SLOWDOWN`` times the default mode's)."""
    record = dict(config=asdict(config))
    try:
        full = fixed_tile_matmul_triton(x, weight, None, config)
        record["max_error"] = (full.float() - reference).abs().max().item()
        record["correct"] = record["max_error"] <= 1e-2 * reference.abs().max().item()
        record["invariant_rows"] = {}
        record["times"] = {}
        hopeless = False
        for rows in rows_list:
            part = x[:rows]
            record["invariant_rows"][rows] = True
            record["times"][rows] = None
            for split in launch_forms(config, rows, weight.shape[0], x.device):
                def run(p, w, split=split):
                    return fixed_tile_matmul_triton(p, w, None, config, split_across_programs=split)
                record["invariant_rows"][rows] &= torch.equal(run(part, weight), full[:rows])
                if hopeless:
                    continue
                found = dict(timing(linear_seconds(run, part, weight), rows, *weight.shape), split=split)
                if not record["times"][rows] or found["us"] < record["times"][rows]["us"]:
                    record["times"][rows] = found
            if record["times"][rows]:
                hopeless = record["times"][rows]["us"] > GIVE_UP_SLOWDOWN * default_times[rows]["us"]
        record["invariant"] = all(record["invariant_rows"].values())
        return record, full
    except Exception as error:  # a config the compiler rejects (e.g. out of shared memory)
        record.update(correct=False, invariant=False, failed=f"{type(error).__name__}: {str(error)[:150]}")
        return record, None


def launch_forms(config: TileConfig, rows: int, n: int, device: torch.device) -> tuple[bool, ...]:
    """The launches to time: segments looped in one program, and split across programs where
    there are segments and the output tiles alone make fewer than 4 programs per SM."""
    tiles = -(-rows // config.block_m) * -(-n // config.block_n)
    return (False, True) if config.split_k > 1 and tiles < 4 * num_sms(device) else (False,)


def assign_classes(records: list[dict], outputs: list[torch.Tensor | None]) -> None:
    """Set each record's ``class``: configs of one (block_k, split_k) whose full outputs are
    bitwise equal share it; failed or wrong configs get none."""
    representatives: list[tuple[tuple[int, int], torch.Tensor]] = []
    for record, full in zip(records, outputs):
        record["class"] = None
        if full is None or not (record["correct"] and record["invariant"]):
            continue
        key = (record["config"]["block_k"], record["config"]["split_k"])
        for index, (rep_key, rep) in enumerate(representatives):
            if rep_key == key and torch.equal(rep, full):
                record["class"] = index
                break
        else:
            record["class"] = len(representatives)
            representatives.append((key, full))


def choose_table(records: list[dict], default_times: dict[int, dict], rows_list: list[int]) -> dict:
    """The class with the smallest geometric-mean slowdown against the default mode, and per
    row bucket its fastest member: ``{bucket: record}``."""
    classes: dict[int, list[dict]] = {}
    for record in records:
        if record["class"] is not None:
            classes.setdefault(record["class"], []).append(record)

    def us(record, rows):
        return record["times"][rows]["us"] if record["times"][rows] else math.inf

    def per_bucket(members):
        return {batch_invariant_row_bucket(rows): min(members, key=lambda r: us(r, rows))
                for rows in rows_list}

    def cost(members):
        best = per_bucket(members)
        return sum(math.log(us(best[batch_invariant_row_bucket(rows)], rows) / default_times[rows]["us"])
                   for rows in rows_list) / len(rows_list)
    viable = [members for members in classes.values() if cost(members) < math.inf]
    return per_bucket(min(viable, key=cost)) if viable else {}


def verify_table(table: dict[tuple[int, int, int], TileConfig], split_launch: set[tuple[int, int, int]],
                 x: torch.Tensor, weight: torch.Tensor, rows_list: list[int]) -> bool:
    """Through the dispatch (``batch_invariant_config`` and ``batch_invariant_split_launch`` with
    these tables), every row count's rows bitwise equal to the full batch's."""
    n, k = weight.shape
    sms = num_sms(x.device)

    def run(part):
        rows = part.shape[0]
        config = batch_invariant_config(rows, n, k, sms, table)
        tiles = -(-rows // config.block_m) * -(-n // config.block_n)
        split = batch_invariant_split_launch(rows, n, k, tiles, sms, table, split_launch)
        return fixed_tile_matmul_triton(part, weight, None, config, split_across_programs=split)
    full = run(x)
    return all(torch.equal(run(x[:rows]), full[:rows]) for rows in rows_list)


def bench_linear(name: str, n: int, k: int, rows_list: list[int], sms: int, gen: torch.Generator) -> dict:
    """Every candidate for one weight, the default mode, and the table lines chosen for it."""
    rows_list = [rows for rows in rows_list if name != "lm_head" or rows <= LM_HEAD_MAX_ROWS]
    weight = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).bfloat16()
    x = torch.randn(max(rows_list), k, device=DEVICE, generator=gen).bfloat16()
    reference = x.float() @ weight.float().T
    default_times = {}
    for rows in rows_list:
        default_times[rows] = timing(linear_seconds(dense_linear, x[:rows], weight), rows, n, k)
    records, outputs = [], []
    for config in candidates(n, k, sms):
        record, full = bench_config(config, x, weight, rows_list, reference, default_times)
        records.append(record)
        outputs.append(full)
    assign_classes(records, outputs)
    del outputs
    chosen = choose_table(records, default_times, rows_list)
    table = {(bucket, n, k): TileConfig(**record["config"]) for bucket, record in chosen.items()}
    split_launch = {(batch_invariant_row_bucket(rows), n, k) for rows in rows_list
                    if chosen and chosen[batch_invariant_row_bucket(rows)]["times"][rows]["split"]}
    result = dict(layer=name, n=n, k=k, rows=rows_list, default_mode=default_times, candidates=records,
                  table_verified=bool(table) and verify_table(table, split_launch, x, weight, rows_list),
                  chosen={bucket: record["config"] for bucket, record in chosen.items()},
                  split_launch=sorted(split_launch))
    result["table_lines"] = table_lines(result, chosen, default_times)
    print(format_linear(result, records, chosen), flush=True)
    return result


def table_lines(result: dict, chosen: dict[int, dict], default_times: dict[int, dict]) -> list[str]:
    """The BATCH_INVARIANT_CONFIGS entries of one shape, one per row bucket measured."""
    lines = {}
    for rows in result["rows"]:
        bucket = batch_invariant_row_bucket(rows)
        if bucket in chosen and bucket not in lines:
            best, config = chosen[bucket]["times"][rows], TileConfig(**chosen[bucket]["config"])
            lines[bucket] = (f"    {(bucket, result['n'], result['k'])}: {config},  # {best['us']:.1f} us, "
                             f"{best['gbps']:.0f} GB/s, {best['tflops']:.0f} TFLOP/s (default mode "
                             f"{default_times[rows]['us']:.1f} us)")
    return list(lines.values())


def _versus(label: str, found: dict | None, default_us: float) -> str:
    if not found:
        return f" | {label} n/a"
    return (f" | {label} {found['us']:8.1f} us ({found['us'] / default_us:.2f}x) {found['gbps']:5.0f} GB/s "
            f"{found['tflops']:4.0f} TFLOP/s")


def format_linear(result: dict, records: list[dict], chosen: dict[int, dict]) -> str:
    good = sum(r["class"] is not None for r in records)
    lines = [f"{result['layer']} N={result['n']} K={result['k']}: {good} of {len(records)} configs correct "
             f"and row-invariant, in {len({r['class'] for r in records} - {None})} bitwise classes; table "
             f"verified: {result['table_verified']}"]
    for rows in result["rows"]:
        default_us = result["default_mode"][rows]["us"]
        best = chosen.get(batch_invariant_row_bucket(rows))
        lines.append(f"  M={rows:>5} default mode {default_us:8.1f} us"
                     + _versus("one-tile invariant", records[0].get("times", {}).get(rows), default_us)
                     + _versus("chosen", best["times"][rows] if best else None, default_us))
    broken = [TileConfig(**r["config"]) for r in records if "failed" not in r and not r["invariant"]]
    if broken:
        lines.append(f"  NOT row-invariant: {broken}")
    return "\n".join(lines + [f"  (one-tile invariant config: {TileConfig(**records[0]['config'])})"])


def step_estimates(results: list[dict]) -> dict:
    """Linear time of one decode step (32 layers + the LM head) at each decode batch, ms: the
    default mode, the one-tile invariant config, the chosen table."""
    by_layer = {r["layer"]: r for r in results}
    num_layers = model_shape("llama3-8b").num_hidden_layers
    if set(by_layer) != {"qkv", "o", "gate_up", "down", "lm_head"}:
        return {}

    def chosen(result, rows):
        config = result["chosen"].get(batch_invariant_row_bucket(rows))
        return next((r for r in result["candidates"] if r["config"] == config), {})
    paths = {"default_ms": lambda result, rows: result["default_mode"][rows],
             "one_tile_ms": lambda result, rows: result["candidates"][0].get("times", {}).get(rows),
             "invariant_ms": lambda result, rows: chosen(result, rows).get("times", {}).get(rows)}
    estimates = {}
    for rows in by_layer["lm_head"]["rows"]:
        estimates[rows] = {}
        for path, time_of in paths.items():
            times = {name: time_of(result, rows) for name, result in by_layer.items()}
            us = {name: found["us"] if found else math.nan for name, found in times.items()}
            layers = us["qkv"] + us["o"] + us["gate_up"] + us["down"]
            estimates[rows][path] = (num_layers * layers + us["lm_head"]) / 1e3
    return estimates


def bench_dispatch(gen: torch.Generator) -> list[dict]:
    """The mode's matmul as the model calls it (``fixed_tile_matmul_triton``, dispatched: the
    table's config, or the persistent launch from BATCH_INVARIANT_PERSISTENT_MIN_ROWS rows)
    against cuBLAS (``F.linear``) per Llama-3-8B linear but the LM head and row count of
    DISPATCH_ROWS: the launch it took, its output bitwise against the in-program launch with the
    table's config; then per row count the four summed (one layer's linears)."""
    found = []
    for name, n, k in model_linears("llama3-8b", 1):
        if name == "lm_head":
            continue
        weight = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).bfloat16()
        x = torch.randn(max(DISPATCH_ROWS), k, device=DEVICE, generator=gen).bfloat16()
        for rows in DISPATCH_ROWS:
            found.append(dict(layer=name, n=n, k=k, rows=rows, **dispatch_timing(x[:rows], weight)))
            print(format_dispatch(found[-1]), flush=True)
    for rows in DISPATCH_ROWS:
        mine = [record for record in found if record["rows"] == rows]
        found.append(dict(layer="layer", rows=rows, cublas_us=sum(r["cublas_us"] for r in mine),
                          invariant_us=sum(r["invariant_us"] for r in mine)))
        print(format_dispatch(found[-1]), flush=True)
    return found


def dispatch_timing(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """The launch and config ``fixed_tile_matmul_triton(x, weight)`` takes, whether its output is
    bitwise the in-program launch's with the table's config, its time and cuBLAS's."""
    config, split, persistent = fixed_tile_matmul_launch(x, weight)
    in_program = fixed_tile_matmul_triton(x, weight, split_across_programs=False, persistent=False)
    launch = "persistent" if persistent else "split" if split else "in-program"
    return dict(config=asdict(config), launch=launch,
                bitwise_vs_in_program=torch.equal(fixed_tile_matmul_triton(x, weight), in_program),
                cublas_us=linear_seconds(F.linear, x, weight) * 1e6,
                invariant_us=linear_seconds(fixed_tile_matmul_triton, x, weight) * 1e6)


def format_dispatch(record: dict) -> str:
    cublas_us, invariant_us = record["cublas_us"], record["invariant_us"]
    text = (f"dispatched {record['layer']:>7} M={record['rows']:>5}: cuBLAS {cublas_us:8.1f} us, invariant "
            f"{invariant_us:8.1f} us ({invariant_us / cublas_us:.2f}x)")
    if "launch" not in record:
        return text + " (sum of the four)"
    config = TileConfig(**record["config"])
    return (text + f" {record['launch']} {config.block_m}x{config.block_n}x{config.block_k} split_k "
            f"{config.split_k} w{config.num_warps} s{config.num_stages}, bitwise vs in-program: "
            f"{'yes' if record['bitwise_vs_in_program'] else 'NO'}")


def attention_inputs(seqs: int, query_len: int, keys: int, gen: torch.Generator, heads: int = 32,
                     kv_heads: int = 8, head_dim: int = 128, block_size: int = 16) -> tuple:
    """``paged_attention_triton``'s positional inputs (bf16): ``seqs`` sequences of ``query_len``
    new tokens and ``keys`` keys (decode batches: up to 63 more, varied) in shuffled cache blocks."""
    spread = 64 if seqs > 1 and query_len == 1 else 1
    seq_lens = keys + torch.randint(0, spread, (seqs,), device=DEVICE, generator=gen)
    blocks_per_seq = -(-int(seq_lens.max()) // block_size)
    cache_shape = (seqs * blocks_per_seq, block_size, kv_heads, head_dim)
    blocks = torch.randperm(seqs * blocks_per_seq, device=DEVICE, generator=gen).int().view(seqs, -1)
    return (torch.randn(seqs * query_len, heads, head_dim, device=DEVICE, generator=gen).bfloat16(),
            torch.randn(cache_shape, device=DEVICE, generator=gen).bfloat16(),
            torch.randn(cache_shape, device=DEVICE, generator=gen).bfloat16(),
            torch.arange(0, seqs * query_len + 1, query_len, device=DEVICE, dtype=torch.int32),
            seq_lens.int(), blocks)


def bench_attention(gen: torch.Generator) -> list[dict]:
    """Attention of one layer in the default mode and in batch-invariant mode (each splitting keys
    where the backend would: the mode only into its fixed key segments) at each query-tile size
    of ``INVARIANT_ATTENTION_ROWS``, with the mode's key segments (``BATCH_INVARIANT_SPLIT_KV_SIZE``),
    those of ``INVARIANT_ATTENTION_SEGMENTS`` and without any (0). Both constants hold for every
    launch of the mode, decode and prefill."""
    from pagedlab.kernels import paged_attention

    found = []
    settings = (paged_attention.BATCH_INVARIANT_BLOCK_M, paged_attention.BATCH_INVARIANT_SPLIT_KV_SIZE)
    for phase, seqs, query_len, keys in ATTENTION_CASES:
        args = attention_inputs(seqs, query_len, keys, gen)
        bounds = dict(max_query_len=query_len, max_seq_len=int(args[4].max()))
        split = paged_attention.choose_split_kv_size(seqs, 8, query_len, bounds["max_seq_len"])
        record = dict(kernel=f"{phase} attention (one layer)", batch=seqs, query_len=query_len,
                      keys=bounds["max_seq_len"], split_kv=split, invariant_tiles={},
                      default=dict(us=_attention_us(args, split_kv_size=split, **bounds)))
        try:
            for rows in sorted({*INVARIANT_ATTENTION_ROWS, settings[0]}):
                for segment in sorted({0, settings[1], *INVARIANT_ATTENTION_SEGMENTS}):
                    paged_attention.BATCH_INVARIANT_BLOCK_M = rows
                    paged_attention.BATCH_INVARIANT_SPLIT_KV_SIZE = segment
                    invariant_split = None
                    if segment:
                        invariant_split = paged_attention.choose_split_kv_size(seqs, 8, query_len,
                                                                               bounds["max_seq_len"], segment)
                    us = _attention_us(args, batch_invariant=True, split_kv_size=invariant_split, **bounds)
                    tiles = record["invariant_tiles"]
                    tiles[_tile_name(rows, segment)] = dict(us=us, split_kv=invariant_split)
        finally:
            paged_attention.BATCH_INVARIANT_BLOCK_M, paged_attention.BATCH_INVARIANT_SPLIT_KV_SIZE = settings
        record["invariant"] = record["invariant_tiles"][_tile_name(*settings)]
        found.append(record)
    return found


def _tile_name(rows: int, segment: int) -> str:
    return f"{rows}-row query tile, key segments {segment or 'off'}"


def _attention_us(args: tuple, **kwargs) -> float:
    from pagedlab.kernels.paged_attention import paged_attention_triton

    return eager_then_graph_seconds(lambda: paged_attention_triton(*args, 128 ** -0.5, **kwargs)) * 1e6


def bench_norm_and_softmax(gen: torch.Generator) -> list[dict]:
    """RMSNorm with its residual add (hidden 4096) and the sampler's softmax and log-softmax
    (128,256 float32 logits), in both modes."""
    from pagedlab.layers import batch_invariant
    from pagedlab.layers.norm import RMSNorm

    norm = RMSNorm(4096).to(DEVICE, torch.bfloat16)
    found = []
    for rows in (1, 256, 1024):
        x, residual = (torch.randn(rows, 4096, device=DEVICE, generator=gen).bfloat16() for _ in range(2))
        found.append(_both_modes("RMSNorm + residual (one layer)", rows, lambda x=x, r=residual: norm(x, r)))
    for rows in (1, 256):
        logits = torch.randn(rows, 128256, device=DEVICE, generator=gen)
        found.append(_both_modes("softmax", rows, lambda z=logits: batch_invariant.softmax(z)))
        found.append(_both_modes("log_softmax", rows, lambda z=logits: batch_invariant.log_softmax(z)))
    return found


def _both_modes(kernel: str, rows: int, fn) -> dict:
    def in_mode(enabled):
        def run():
            with batch_invariant_mode(enabled):
                return fn()
        return eager_then_graph_seconds(run) * 1e6
    return dict(kernel=kernel, batch=rows, default=dict(us=in_mode(False)), invariant=dict(us=in_mode(True)))


def format_other(record: dict) -> str:
    default, invariant = record["default"]["us"], record["invariant"]["us"]
    text = (f"{record['kernel']:>32} batch {record['batch']:>4}: default {default:8.1f} us, invariant "
            f"{invariant:8.1f} us ({invariant / default:.2f}x)")
    tiles = [f"\n{'':>36}invariant, {name}: {found['us']:8.1f} us ({found['us'] / default:.2f}x)"
             for name, found in record.get("invariant_tiles", {}).items()]
    return text + "".join(tiles)


def bench_tables(args: argparse.Namespace, sms: int, gen: torch.Generator) -> tuple[list, list, dict]:
    """Every candidate config per linear of ``args.layers`` at ``args.rows``: the results, the
    BATCH_INVARIANT_CONFIGS lines (printed to paste) and the decode-step estimates."""
    results = [bench_linear(name, n, k, args.rows, sms, gen) for name, n, k in model_linears("llama3-8b", 1)
               if name in args.layers]
    lines = [line for result in results for line in result["table_lines"]]
    splits = [f"    {tuple(key)}," for result in results for key in result["split_launch"]]
    split_set = "BATCH_INVARIANT_SPLIT_LAUNCH: set[tuple[int, int, int]] = "
    print("\n# paste into src/pagedlab/kernels/gemv_configs.py",
          "BATCH_INVARIANT_CONFIGS: dict[tuple[int, int, int], TileConfig] = {", *lines, "}",
          *([split_set + "{", *splits, "}"] if splits else [split_set + "set()"]), sep="\n")
    if not all(result["table_verified"] for result in results):
        print("WARNING: a shape's table failed the bitwise check through the dispatch: do not paste it")
    estimates = step_estimates(results)
    for rows, estimate in estimates.items():
        print(f"decode step at batch {rows}, linears (32 layers + LM head): default mode "
              f"{estimate['default_ms']:.2f} ms, one-tile invariant {estimate['one_tile_ms']:.2f} ms, "
              f"chosen invariant {estimate['invariant_ms']:.2f} ms")
    return results, lines, estimates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="binv_bench.json", help="JSON file of every measurement")
    parser.add_argument("--rows", type=int, nargs="+", default=list(BATCH_INVARIANT_ROW_BUCKETS))
    parser.add_argument("--layers", nargs="+", default=["qkv", "o", "gate_up", "down", "lm_head"])
    parser.add_argument("--skip-others", action="store_true",
                        help="linears only (no attention, norm or softmax)")
    parser.add_argument("--dispatch-only", action="store_true",
                        help="only the dispatched matmul against cuBLAS (about a minute)")
    args = parser.parse_args()
    start = time.perf_counter()
    sms = num_sms(torch.device(DEVICE))
    print(f"{torch.cuda.get_device_name()} ({sms} SMs); bf16; one-tile config {BATCH_INVARIANT_TILE}")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    dispatched = bench_dispatch(gen)
    results, lines, estimates = ([], [], {}) if args.dispatch_only else bench_tables(args, sms, gen)
    skip_others = args.skip_others or args.dispatch_only
    others = [] if skip_others else bench_attention(gen) + bench_norm_and_softmax(gen)
    for record in others:
        print(format_other(record))
    elapsed = time.perf_counter() - start
    print(f"done in {elapsed:.0f} s; JSON in {args.out}")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), sms=sms, dispatched=dispatched, linears=results,
                       table=lines, step_estimates=estimates, others=others, seconds=elapsed), f, indent=1)


if __name__ == "__main__":
    main()
