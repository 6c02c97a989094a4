"""Decode attention (``kernels/paged_attention.py``) over the sweep of its decode launch configs
(``DecodeConfig``: key tile 64/128 x num_warps 2/4/8 x num_stages 2/3/4) on one GPU, in bf16.

Per head shape (Qwen3-0.6B: 16 query / 8 KV heads, Llama-3-8B: 32 / 8, Qwen3-30B-A3B: 32 / 4,
head_dim 128) and decode batch (256, 128, 64 and 32 sequences of keys drawn uniformly from
[100, 2048] with a fixed seed, as W-nano's steps while its batch shrinks; 16 sequences of 8,192
keys; one of 640, W-seed's batch-1 decode near its end; 64 and 256 of 513-640, W-seed batch
64's and 256's decode steps), every candidate runs with the split-KV choice of the current
policy (``choose_split_kv_size``) and, where that splits (or with ``--all-splits`` everywhere),
with the policy's other split sizes and without the split too (the report's "split" lines; the
table takes the policy's split only).
``--batches`` picks some. Each is checked against the plain-torch reference
(``paged_attention_torch``, float32: within 1% of its largest value; bf16 rounds at 0.4%) and
timed as CUDA-graph replays with the KV cache read from HBM (``gpu_timing.graph_seconds``); it
prints microseconds, KV bytes read over the time and the fraction of 4.8 TB/s, then the
``DECODE_ATTENTION_CONFIGS`` lines to paste into ``src/pagedlab/kernels/attention_configs.py``:
per shape, the config with the lowest mean time relative to the current one over the batches
(policy split), where it beats the current one by 1% or more, else the current line. Every config
is compiled first on a thread pool (Triton's ``AsyncCompileMode``); ``--quick`` sweeps fewer
configs and batches.

    PYTHONPATH=src:benchmarks python3 benchmarks/attention_bench.py --out attention_bench.json
    PYTHONPATH=src:benchmarks python3 benchmarks/attention_bench.py --quick
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from contextlib import contextmanager
from dataclasses import asdict

import torch

from gpu_timing import PEAK_BYTES_PER_S, graph_seconds, precompile
from pagedlab.kernels.attention_configs import (DECODE_ATTENTION_CONFIGS, DecodeConfig, attention_launch,
                                                check_decode_config)
from pagedlab.kernels.paged_attention import (SPLIT_KV_MAX_SEGMENTS, SPLIT_KV_SIZE, SPLIT_KV_SMALL_SIZES,
                                              allocate_split_kv_scratch, choose_split_kv_size, decode_order,
                                              paged_attention_torch, paged_attention_triton)

# (query heads, KV heads, head_dim)
SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama3-8b": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128)}
# name -> (sequences, fewest keys, most keys)
BATCHES = {"256x[100,2048]": (256, 100, 2048), "128x[100,2048]": (128, 100, 2048),
           "64x[100,2048]": (64, 100, 2048), "32x[100,2048]": (32, 100, 2048), "16x8192": (16, 8192, 8192),
           "1x640": (1, 640, 640), "64x[513,640]": (64, 513, 640), "256x[513,640]": (256, 513, 640)}
QUICK_BATCHES = ("256x[100,2048]", "16x8192")
SWEEP = dict(tile_n=(64, 128), num_warps=(2, 4, 8), num_stages=(2, 3, 4))
QUICK_SWEEP = dict(tile_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3))
DEVICE = "cuda"
BLOCK_SIZE = 16  # the engine's default
KV_BITS = 16
SEED = 0
TOLERANCE = 1e-2  # of the reference's largest output
MIN_GAIN = 0.01  # a table entry must beat the current config by this much


def make_batch(num_seqs: int, fewest: int, most: int, num_heads: int, num_kv_heads: int,
               head_dim: int) -> dict:
    """A bf16 decode batch: key counts uniform in [fewest, most] (fixed seed), each sequence's
    blocks scattered over the pool as a long-running engine leaves them."""
    gen = torch.Generator().manual_seed(SEED)
    seq_lens = torch.randint(fewest, most + 1, (num_seqs,), generator=gen)
    blocks = (seq_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    order = torch.randperm(int(blocks.sum()), generator=gen)
    tables = torch.zeros(num_seqs, int(blocks.max()), dtype=torch.int32)
    used = 0
    for i, count in enumerate(blocks.tolist()):
        tables[i, :count] = order[used:used + count]
        used += count
    shape = (int(blocks.sum()), BLOCK_SIZE, num_kv_heads, head_dim)
    device_gen = torch.Generator(device=DEVICE).manual_seed(SEED)
    cache = [torch.randn(shape, generator=device_gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    q = torch.randn(num_seqs, num_heads, head_dim, generator=device_gen, device=DEVICE, dtype=torch.bfloat16)
    return dict(q=q, k_cache=cache[0], v_cache=cache[1],
                query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE),
                seq_lens=seq_lens.to(torch.int32).to(DEVICE), block_tables=tables.to(DEVICE))


def kv_bytes_read(batch: dict) -> int:
    """Bytes of K and V the batch's sequences hold (what one decode attention launch reads)."""
    k = batch["k_cache"]
    return int(batch["seq_lens"].sum()) * k.shape[2] * k.shape[3] * k.element_size() * 2


@contextmanager
def listed(key: tuple[int, int, int], config: DecodeConfig):
    """``config`` in DECODE_ATTENTION_CONFIGS for ``key`` while the block runs."""
    before = DECODE_ATTENTION_CONFIGS.get(key)
    DECODE_ATTENTION_CONFIGS[key] = config
    try:
        yield
    finally:
        if before is None:
            del DECODE_ATTENTION_CONFIGS[key]
        else:
            DECODE_ATTENTION_CONFIGS[key] = before


def decode_call(batch: dict, max_seq_len: int, split: int | None):
    """A no-argument decode attention call on preallocated output (and split-KV scratch), its
    segments capped and its sequences ordered as the engine's are (``SPLIT_KV_MAX_SEGMENTS``,
    ``decode_order``)."""
    q = batch["q"]
    seq_order = torch.from_numpy(decode_order(batch["seq_lens"].tolist())).to(q.device)
    out = torch.empty_like(q)
    segments = SPLIT_KV_MAX_SEGMENTS if split else None
    scratch = (allocate_split_kv_scratch(q.shape[0], q.shape[1], q.shape[2], max_seq_len, split, q.device,
                                         segments) if split else None)
    scale = q.shape[-1] ** -0.5
    return lambda: paged_attention_triton(**batch, scale=scale, max_query_len=1, max_seq_len=max_seq_len,
                                          split_kv_size=split, max_kv_segments=segments, out=out,
                                          scratch=scratch, seq_order=seq_order)


def measure(call, reference: torch.Tensor, kv_bytes: int) -> dict:
    """Time ``call`` (``graph_seconds``) and compare its output with ``reference`` before and
    after the timed calls; a config that does not compile or launch gives its error."""
    try:
        error = (call().float() - reference).abs().max().item()
    except Exception as e:  # out of resources, a compiler error: not a candidate
        return dict(failed=f"{type(e).__name__}: {str(e)[:200]}")
    seconds = graph_seconds(call)
    error = max(error, (call().float() - reference).abs().max().item())
    return dict(us=seconds * 1e6, gbps=kv_bytes / seconds / 1e9,
                peak_fraction=kv_bytes / seconds / PEAK_BYTES_PER_S, max_error=error,
                correct=error <= TOLERANCE * reference.abs().max().item())


def candidates(sweep: dict, key: tuple[int, int, int], current: DecodeConfig) -> list[DecodeConfig]:
    """The sweep's configs that pass ``check_decode_config``, the current one first."""
    found = [current]
    for values in itertools.product(*sweep.values()):
        config = DecodeConfig(**dict(zip(sweep, values)))
        try:
            check_decode_config(key, config)
        except ValueError:
            continue
        found += [config] if config != current else []
    return found


def split_modes(num_seqs: int, num_kv_heads: int, max_seq_len: int, all_splits: bool = False
                ) -> list[int | None]:
    """The policy's split (None: unsplit) first; where the policy splits (or with ``all_splits``),
    then the other sizes it chooses from (``SPLIT_KV_SMALL_SIZES`` and ``SPLIT_KV_SIZE``) and
    unsplit."""
    policy = choose_split_kv_size(num_seqs, num_kv_heads, 1, max_seq_len)
    if policy is None and not all_splits:
        return [None]
    sizes = [size for size in (SPLIT_KV_SIZE, *reversed(SPLIT_KV_SMALL_SIZES)) if size < max_seq_len]
    return list(dict.fromkeys([policy, *sizes, None]))


def current_config(key: tuple[int, int, int], split: int | None) -> DecodeConfig:
    """What a decode launch of this shape runs now (the table's entry or the default)."""
    launch = attention_launch(1, key[1], key[0], key[2], split_kv_size=split or 0)
    return DecodeConfig(launch.tile_n, launch.num_warps, launch.num_stages)


def bench_batch(shape: str, batch_name: str, sweep: dict, all_splits: bool = False) -> dict:
    """Every candidate of ``sweep`` (under each split mode) on one decode batch of one shape."""
    from pagedlab.kernels import triton_kernels

    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    num_seqs, fewest, most = BATCHES[batch_name]
    key = (head_dim, num_heads // num_kv_heads, KV_BITS)
    batch = make_batch(num_seqs, fewest, most, num_heads, num_kv_heads, head_dim)
    keys = int(batch["seq_lens"].sum())
    kv_bytes = kv_bytes_read(batch)
    modes = split_modes(num_seqs, num_kv_heads, most, all_splits)
    current = current_config(key, modes[0])

    def under(config, call):
        def run():
            with listed(key, config):
                return call()
        return run
    calls = {(config, split): under(config, decode_call(batch, most, split))
             for config in candidates(sweep, key, current) for split in modes}
    print(f"{shape} {batch_name}: compiling, checking and timing {len(calls)} launches", flush=True)
    start = time.perf_counter()
    precompile(triton_kernels, ("paged_attention_kernel",), calls.values())
    compile_s = time.perf_counter() - start
    reference = paged_attention_torch(batch["q"], batch["k_cache"], batch["v_cache"],
                                      batch["query_start_loc"], batch["seq_lens"], batch["block_tables"],
                                      head_dim ** -0.5).float()
    results = [dict(config=asdict(config), split=split, policy_split=split == modes[0],
                    **measure(call, reference, kv_bytes)) for (config, split), call in calls.items()]
    return dict(shape=shape, batch=batch_name, key=list(key), seqs=num_seqs, keys=keys, kv_bytes=kv_bytes,
                policy_split=modes[0], current=asdict(current), compile_s=compile_s, results=results)


def _name(result: dict) -> str:
    config = result["config"]
    split = f" split {result['split']}" if result["split"] else ""
    return f"{config['tile_n']:>3}-key {config['num_warps']}w {config['num_stages']}s{split}"


def _describe(result: dict) -> str:
    if "failed" in result:
        return f"{_name(result)}: {result['failed']}"
    wrong = "" if result["correct"] else "  WRONG"
    return (f"{_name(result)}: {result['us']:7.1f} us {result['gbps']:5.0f} GB/s "
            f"{100 * result['peak_fraction']:3.0f}% err {result['max_error']:.1e}{wrong}")


def report(record: dict) -> None:
    """The current config, the three fastest correct ones, failures, and split against unsplit."""
    results = record["results"]
    print(f"{record['shape']} {record['batch']}: {record['keys']} keys, "
          f"{record['kv_bytes'] / 1e9:.2f} GB of KV, policy split {record['policy_split']}, "
          f"compiled in {record['compile_s']:.0f} s")
    current = next(r for r in results if r["policy_split"] and r["config"] == record["current"])
    print(f"  current {_describe(current)}")
    timed = sorted((r for r in results if r.get("correct")), key=lambda r: r["us"])
    for result in timed[:3]:
        print(f"  best    {_describe(result)}")
    for result in results:
        if not result.get("correct", True) or "failed" in result:
            print(f"  bad     {_describe(result)}")
    splits = list(dict.fromkeys(r["split"] for r in results))
    if len(splits) > 1:
        for split in splits:
            best = next((r for r in timed if r["split"] == split), None)
            print(f"  split {split}: best {_describe(best) if best else 'none correct'}")


def table_entry(records: list[dict]) -> tuple[tuple, DecodeConfig, float] | None:
    """One shape's entry: the config correct on every batch (policy split) with the lowest mean
    time relative to the current config, if it beats it by MIN_GAIN; else None."""
    ratios: dict[DecodeConfig, list[float]] = {}
    for record in records:
        policy = [r for r in record["results"] if r["policy_split"] and r.get("correct")]
        current = next((r for r in policy if r["config"] == record["current"]), None)
        for result in policy if current else []:
            ratios.setdefault(DecodeConfig(**result["config"]), []).append(result["us"] / current["us"])
    means = {config: sum(r) / len(r) for config, r in ratios.items() if len(r) == len(records)}
    if not means:
        return None
    best = min(means, key=means.get)
    if means[best] > 1 - MIN_GAIN:
        return None
    return tuple(records[0]["key"]), best, means[best]


def table_line(shape: str, records: list[dict], batches: tuple[str, ...]) -> str:
    """The ``DECODE_ATTENTION_CONFIGS`` line for one shape's records: the better config found, else
    the table's current line (kept, so that pasting the lines never drops it), else a comment."""
    entry, key = table_entry(records), tuple(records[0]["key"])
    over = f"over {', '.join(batches)}"
    if entry:
        _, config, ratio = entry
        return (f"    {key}: {config},  # {shape}: {100 * (1 - ratio):.1f}% less decode attention time than "
                f"the current launch {over}")
    if key in DECODE_ATTENTION_CONFIGS:
        return (f"    {key}: {DECODE_ATTENTION_CONFIGS[key]},  # {shape}: the current line, within "
                f"{100 * MIN_GAIN:.0f}% of the best {over}")
    return f"    # {shape}: the default launch is within {100 * MIN_GAIN:.0f}% of the best {over}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention_bench.json", help="JSON file of every measurement")
    parser.add_argument("--quick", action="store_true",
                        help=f"batches {QUICK_BATCHES}, configs {QUICK_SWEEP}")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", choices=list(BATCHES), help="these batches only")
    parser.add_argument("--all-splits", action="store_true",
                        help="time every split size on every batch, not only where the policy splits")
    args = parser.parse_args()
    start = time.perf_counter()
    sweep, batches = (QUICK_SWEEP, QUICK_BATCHES) if args.quick else (SWEEP, tuple(BATCHES))
    batches = tuple(args.batches) if args.batches else batches
    print(f"{torch.cuda.get_device_name()}; bf16 KV cache, block size {BLOCK_SIZE}; sweep {sweep}")
    records, lines = [], []
    for shape in args.shapes:
        shape_records = []
        for batch_name in batches:
            shape_records.append(bench_batch(shape, batch_name, sweep, args.all_splits))
            report(shape_records[-1])
            print(f"  [{time.perf_counter() - start:.0f} s]", flush=True)
        lines.append(table_line(shape, shape_records, batches))
        records += shape_records
    print("\n# paste into src/pagedlab/kernels/attention_configs.py", "DECODE_ATTENTION_CONFIGS = {", *lines,
          "}", sep="\n")
    elapsed = time.perf_counter() - start
    print(f"{len(records)} batches in {elapsed:.0f} s; JSON in {args.out}")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), sweep=sweep, records=records, table=lines,
                       seconds=elapsed), f, indent=1)


if __name__ == "__main__":
    main()
