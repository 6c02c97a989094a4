"""Prefill attention's query tiles (``kernels/attention_tuning.py``) on one GPU, in bf16: per model's
heads and prefill batch, the rule's launch, every candidate of the rule's tensor-core class, and the
launch a fresh ``PrefillTileTuner`` picks from its own tuning batch, each timed on the batch as
CUDA-graph replays (the tuner's ``time_launch_on_gpu``) and checked bitwise against the rule's
output (the tuner's promise: a candidate never changes a result).

Batches (``BATCHES``): 16 fresh 512-token prompts (W-seed's prefill step), one 2,048-token chunk
after 14,336 cached keys, 8 prompts of 512 beside 128 decodes, 64 prompts of 32.

    PYTHONPATH=src:benchmarks python3 benchmarks/prefill_attention_bench.py --out prefill_attention.json
    PYTHONPATH=src:benchmarks python3 benchmarks/prefill_attention_bench.py --models gemma2-9b llama3-8b
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch

from pagedlab.kernels import attention_tuning
from pagedlab.kernels.attention_configs import attention_launch
from pagedlab.kernels.attention_tuning import PrefillShape, PrefillTileTuner, prefill_candidates, query_bucket
from pagedlab.kernels.paged_attention import paged_attention_triton

# (query heads, KV heads, head_dim, attention soft-capping)
MODELS = {"llama3-8b": (32, 8, 128, None), "qwen3-0.6b": (16, 8, 128, None),
          "qwen3-30b-a3b": (32, 4, 128, None), "gemma2-9b": (16, 8, 256, 50.0),
          "smollm2-135m": (9, 3, 64, None), "gpt2": (12, 12, 64, None)}
# name -> [(cached keys, query tokens)] per sequence
BATCHES = {"16x512": [(0, 512)] * 16, "chunk2048@14k": [(14336, 2048)],
           "8x512+128dec": [(0, 512)] * 8 + [(600, 1)] * 128, "64x32": [(0, 32)] * 64}
DEVICE = "cuda"
BLOCK_SIZE = 16
SEED = 0


class FixedTiles:
    """A stand-in tuner that hands every launch ``launch``."""

    def __init__(self, launch):
        self.fixed = launch

    def launch(self, shape, fingerprint, default, make_run):
        return self.fixed


def make_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """A bf16 batch: each sequence's blocks scattered over the pool (fixed seed)."""
    gen = torch.Generator(device=DEVICE).manual_seed(SEED)
    lens = [context + query for context, query in seqs]
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    order = torch.randperm(sum(blocks), device=DEVICE, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = order[used:used + count]
        used += count
    shape = (sum(blocks), BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen, device=DEVICE).bfloat16() for _ in range(2))
    queries = [query for _, query in seqs]
    starts = torch.tensor([0, *queries], device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(queries), num_heads, head_dim, generator=gen, device=DEVICE).bfloat16()
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, query_start_loc=starts,
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE), block_tables=tables)


def bench_batch(model: str, batch_name: str) -> dict:
    """Every candidate's time and bitwise agreement with the rule on one batch, and the tuner's pick."""
    num_heads, num_kv_heads, head_dim, softcap = MODELS[model]
    group, seqs = num_heads // num_kv_heads, BATCHES[batch_name]
    batch, max_query_len = make_batch(seqs, num_heads, num_kv_heads, head_dim), max(q for _, q in seqs)
    args = dict(scale=head_dim ** -0.5, max_query_len=max_query_len, softcap=softcap)
    reference = paged_attention_triton(**batch, **args)
    rule = attention_launch(max_query_len, group, head_dim, 16)
    shape = PrefillShape(head_dim, group, num_kv_heads, "bfloat16", 16, False, softcap is not None,
                         query_bucket(max_query_len), rule.block_m)
    results = []
    for launch in prefill_candidates(shape):
        def call(launch=launch):
            return paged_attention_triton(**batch, **args, prefill_tuner=FixedTiles(launch))
        ms = attention_tuning.time_launch_on_gpu(call, 20.0)
        results.append(dict(launch=asdict(launch), us=ms * 1e3, bitwise=bool(torch.equal(call(), reference))))
    tuner = PrefillTileTuner(None, timer=attention_tuning.time_launch_on_gpu)
    start = time.perf_counter()
    tuned = paged_attention_triton(**batch, **args, prefill_tuner=tuner)
    tuning_s = time.perf_counter() - start
    (picked,) = tuner.chosen.values()
    return dict(model=model, batch=batch_name, rule=asdict(rule), picked=asdict(picked), tuning_s=tuning_s,
                picked_bitwise=bool(torch.equal(tuned, reference)), results=results)


def report(record: dict) -> None:
    times = {json.dumps(r["launch"], sort_keys=True): r["us"] for r in record["results"]}

    def label(launch: dict) -> str:
        us = times[json.dumps(launch, sort_keys=True)]
        return f"{launch['block_m']}/{launch['num_warps']}/{launch['num_stages']} {us:8.1f} us"
    best = min(record["results"], key=lambda r: r["us"])["launch"]
    rule_us = times[json.dumps(record["rule"], sort_keys=True)]
    picked_us = times[json.dumps(record["picked"], sort_keys=True)]
    bitwise = sum(r["bitwise"] for r in record["results"])
    print(f"{record['model']:14s} {record['batch']:14s} rule {label(record['rule'])} | best {label(best)} | "
          f"tuner {label(record['picked'])} ({rule_us / picked_us:.3f}x, {record['tuning_s']:.2f} s) | "
          f"bitwise {bitwise}/{len(record['results'])}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="prefill_attention.json", help="JSON file of every measurement")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    options = parser.parse_args()
    records = []
    for model in options.models:
        for batch_name in options.batches:
            records.append(bench_batch(model, batch_name))
            report(records[-1])
            with open(options.out, "w") as file:  # after every batch: a cut-short run keeps what it measured
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, records=records),
                          file, indent=1)


if __name__ == "__main__":
    main()
