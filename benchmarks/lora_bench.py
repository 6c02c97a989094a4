"""The batched multi-LoRA kernels (``kernels/lora.py``) at a model's linears on one GPU, bf16:
Llama-3-8B's by default (q/k/v 4096 -> 4096 + 1024 + 1024, o 4096 -> 4096, gate/up 4096 ->
2 x 14336, down 14336 -> 4096), rank 16 on all seven projections, 8 adapter slots, 1/16/64/256
tokens spread round-robin over the slots (one token: one slot), as a decode step runs them.

Per (linear, tokens) it prints shrink, expand and both (``add_lora``, the default config), each
checked against the torch reference (float32 of the same bf16 inputs), next to the base cuBLAS
linear of that shape; then per token count the sum over the model's layers: the LoRA cost of one
decode step against its base linears. ``--sweep`` also times ``add_lora`` at every split count,
for tuning ``choose_config``. Times are medians of CUDA-graph replays (``graph_seconds`` of
gemv_bench.py: weights from HBM, no launch gaps, as in a decode step's graph).

    PYTHONPATH=src python3 benchmarks/lora_bench.py --out lora_bench.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace

import numpy as np
import torch
import torch.nn.functional as F
from gemv_bench import graph_seconds

from pagedlab.kernels.lora import (MAX_SPLITS, add_lora, choose_config, linear_with_lora, lora_expand,
                                  lora_shrink, workspace_numel)
from pagedlab.lora.ops import LoRAMapping, add_lora_torch
from pagedlab.workloads import model_shape

TOKENS = (1, 16, 64, 256)
DEVICE = "cuda"


def model_linears(shape: str) -> tuple[list[tuple[str, int, list[int]]], int]:
    """(name, K, output slices) of each LoRA linear of a known shape, and its layer count."""
    c = model_shape(shape)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    return [("qkv", c.hidden_size, [q, kv, kv]), ("o", q, [c.hidden_size]),
            ("gate_up", c.hidden_size, [c.intermediate_size] * 2),
            ("down", c.intermediate_size, [c.hidden_size])], c.num_hidden_layers


def round_robin_mapping(num_tokens: int, num_slots: int) -> LoRAMapping:
    mapping = LoRAMapping.empty(num_tokens, num_slots, torch.device(DEVICE))
    mapping.fill(np.arange(num_tokens) % num_slots, lambda values, dtype: torch.as_tensor(values, dtype=dtype,
                                                                                         device=DEVICE))
    return mapping


def bench_linear(k: int, sizes: list[int], num_tokens: int, num_slots: int, rank: int, sweep: bool,
                 gen: torch.Generator) -> dict:
    """Times and largest errors of one linear's LoRA at one token count (random adapters: A
    uniform in +-1/sqrt(K) as PEFT draws it, B of std 0.02)."""
    slices = len(sizes)

    def random(*shape, scale=1.0, uniform=False):
        values = torch.rand(*shape, device=DEVICE, generator=gen) * 2 - 1 if uniform else \
            torch.randn(*shape, device=DEVICE, generator=gen)
        return (values * scale).bfloat16()
    lora_a = random(num_slots, slices, rank, k, scale=k ** -0.5, uniform=True)
    lora_b = random(num_slots, slices, max(sizes), rank, scale=0.02)
    weight = random(sum(sizes), k, scale=0.02)
    x = random(num_tokens, k)
    mapping = round_robin_mapping(num_tokens, num_slots)
    workspace = torch.empty(workspace_numel(num_tokens, slices, rank), device=DEVICE)
    reference = torch.zeros(num_tokens, sum(sizes), device=DEVICE)
    add_lora_torch(x.float(), reference, lora_a.float(), lora_b.float(), mapping, sizes)
    config = choose_config(num_tokens, num_slots, slices, k)

    def error(config, workspace) -> float:
        y = torch.zeros(num_tokens, sum(sizes), device=DEVICE, dtype=torch.bfloat16)
        add_lora(x, y, lora_a, lora_b, mapping, sizes, workspace, config)
        return (y.float() - reference).abs().max().item()

    def lora_us(config, workspace) -> float:
        return graph_seconds(lambda: add_lora(x, y, lora_a, lora_b, mapping, sizes, workspace, config)) * 1e6

    y = torch.zeros(num_tokens, sum(sizes), device=DEVICE, dtype=torch.bfloat16)
    h = lora_shrink(x, lora_a, mapping, config, workspace)
    side_stream = torch.cuda.Stream()

    def base(t):
        return F.linear(t, weight)
    record = dict(config=asdict(config), max_error=error(config, workspace),
                  tolerance=1e-2 * reference.abs().max().item(),
                  base_us=graph_seconds(lambda: F.linear(x, weight)) * 1e6,
                  shrink_us=graph_seconds(lambda: lora_shrink(x, lora_a, mapping, config, workspace)) * 1e6,
                  expand_us=graph_seconds(lambda: lora_expand(h, lora_b, mapping, y, sizes, config)) * 1e6,
                  lora_us=lora_us(config, workspace),
                  with_base_us=graph_seconds(lambda: linear_with_lora(base, x, lora_a, lora_b, mapping, sizes,
                                                                      workspace, side_stream)) * 1e6)
    record["ok"] = record["max_error"] <= record["tolerance"]
    if sweep:
        record["sweep"] = []
        for num_splits in [1 << i for i in range(MAX_SPLITS.bit_length()) if (1 << i) * config.block_k <= k]:
            other = replace(config, num_splits=num_splits)
            scratch = torch.empty(num_splits * slices * num_tokens * rank, device=DEVICE)
            record["sweep"].append(dict(num_splits=num_splits, us=lora_us(other, scratch),
                                        max_error=error(other, scratch)))
    return record


def format_record(record: dict) -> str:
    line = (f"{record['layer']:>7} K={record['k']:>5} N={sum(record['sizes']):>5} M={record['tokens']:>3}  "
            f"LoRA {record['lora_us']:6.1f} us (shrink {record['shrink_us']:5.1f}, "
            f"expand {record['expand_us']:5.1f}, splits {record['config']['num_splits']:>2})  "
            f"base cuBLAS {record['base_us']:6.1f} us, with LoRA {record['with_base_us']:6.1f}  "
            f"err {record['max_error']:.1e} {'ok' if record['ok'] else 'WRONG'}")
    for row in record.get("sweep", []):
        line += f"\n      splits {row['num_splits']:>2}: {row['us']:6.1f} us err {row['max_error']:.1e}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="lora_bench.json", help="JSON file of every measurement")
    parser.add_argument("--shape", default="llama3-8b", help="a shape pagedlab.workloads.model_shape knows")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="also time every split count")
    args = parser.parse_args()
    linears, layers = model_linears(args.shape)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; {args.shape} bf16, rank {args.rank}, {args.slots} slots, "
          f"tokens round-robin over the slots")
    started, records, steps = time.time(), [], []
    for num_tokens in args.tokens:
        rows = []
        for name, k, sizes in linears:
            record = dict(layer=name, k=k, sizes=sizes, tokens=num_tokens,
                          **bench_linear(k, sizes, num_tokens, args.slots, args.rank, args.sweep, gen))
            rows.append(record)
            print(format_record(record), flush=True)
        lora_ms = layers * sum(r["lora_us"] for r in rows) / 1e3
        base_ms = layers * sum(r["base_us"] for r in rows) / 1e3
        added_ms = layers * sum(r["with_base_us"] - r["base_us"] for r in rows) / 1e3
        steps.append(dict(tokens=num_tokens, layers=layers, lora_ms=lora_ms, base_linears_ms=base_ms,
                          added_with_overlap_ms=added_ms))
        print(f"  {num_tokens} tokens, {layers} layers: LoRA {lora_ms:.3f} ms per step, base linears "
              f"{base_ms:.3f} ms ({100 * lora_ms / base_ms:.0f}%); LoRA with the shrink beside the base "
              f"adds {added_ms:.3f} ms", flush=True)
        records += rows
    wrong = [f"{r['layer']} M={r['tokens']}" for r in records if not r["ok"]]
    print(f"{len(records)} (linear, tokens) in {time.time() - started:.0f} s; "
          f"{'all within tolerance' if not wrong else 'WRONG: ' + ', '.join(wrong)}; JSON in {args.out}")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), shape=args.shape, slots=args.slots,
                       rank=args.rank, records=records, steps=steps), f, indent=1)


if __name__ == "__main__":
    main()
