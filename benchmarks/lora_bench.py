"""The batched multi-LoRA kernels (``kernels/lora.py``) at a model's linears on one GPU, bf16:
Llama-3-8B's by default (q/k/v 4096 -> 4096 + 1024 + 1024, o 4096 -> 4096, gate/up 4096 ->
2 x 14336, down 14336 -> 4096), rank 16 on all seven projections, 8 adapter slots, 1/4/16/64/256
tokens spread round-robin over the slots (one token: one slot), as a decode step runs them.

Per (linear, tokens) it prints shrink, expand and both (``add_lora``, the default config), each
checked against the torch reference (float32 of the same bf16 inputs), next to the base linears:
cuBLAS, and the engine's base (``dense_linear``: the Triton GEMV where ``DENSE_GEMV_CONFIGS``
lists the shape, else cuBLAS); then the engine's LoRA linear both ways: that base with the
shrink beside it and the expand after (``separate``), and, where the GEMV runs, the shrink and
then the GEMV adding the deltas in its epilogue (``fused``, what ``linear_with_lora`` picks
there; checked against the float32 base plus delta). Per token count it sums them over the
model's layers: the LoRA cost of one decode step against its base linears. ``--sweep`` also
times ``add_lora`` at every split count, for tuning ``choose_config``. Times are medians of
CUDA-graph replays (``graph_seconds`` of gpu_timing.py: weights from HBM, no launch gaps, as in a
decode step's graph).

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
from gpu_timing import graph_seconds

from pagedlab.kernels.lora import (MAX_SPLITS, add_lora, choose_config, fused_gemv_config, linear_with_lora,
                                  lora_expand, lora_shrink, workspace_numel)
from pagedlab.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedlab.lora.ops import LoRAMapping, add_lora_torch
from pagedlab.quantization.linear_method import dense_gemv_choice, dense_linear
from pagedlab.workloads import model_shape

TOKENS = (1, 4, 16, 64, 256)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: tests/test_lora_kernel_bench.py
DTYPE = torch.bfloat16


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


def dense_layer(weight: torch.Tensor, sizes: list[int]) -> torch.nn.Module:
    """The engine's linear of ``sizes`` output slices holding ``weight`` (no bias): what a
    ``LoRALinear`` wraps, so ``linear_with_lora`` sees its GEMV choice."""
    with torch.device("meta"):
        k = weight.shape[1]
        layer = ColumnParallelLinear(k, sizes) if len(sizes) > 1 else RowParallelLinear(k, sizes[0])
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return layer


def linear_operands(k: int, sizes: list[int], num_tokens: int, num_slots: int, rank: int,
                    gen: torch.Generator) -> dict:
    """Random operands (DTYPE) of one LoRA linear (A uniform in +-1/sqrt(K) as PEFT draws it, B and
    the weight of std 0.02), the round-robin mapping, a workspace and the float32 references."""
    def random(*shape, scale=1.0, uniform=False):
        values = torch.rand(*shape, device=DEVICE, generator=gen) * 2 - 1 if uniform else \
            torch.randn(*shape, device=DEVICE, generator=gen)
        return (values * scale).to(DTYPE)
    slices = len(sizes)
    ops = dict(lora_a=random(num_slots, slices, rank, k, scale=k ** -0.5, uniform=True),
               lora_b=random(num_slots, slices, max(sizes), rank, scale=0.02),
               weight=random(sum(sizes), k, scale=0.02), x=random(num_tokens, k),
               mapping=round_robin_mapping(num_tokens, num_slots),
               workspace=torch.empty(workspace_numel(num_tokens, slices, rank), device=DEVICE))
    delta = torch.zeros(num_tokens, sum(sizes), device=DEVICE)
    add_lora_torch(ops["x"].float(), delta, ops["lora_a"].float(), ops["lora_b"].float(), ops["mapping"],
                   sizes)
    return dict(ops, delta=delta, full=F.linear(ops["x"].float(), ops["weight"].float()) + delta)


def bench_linear(k: int, sizes: list[int], num_tokens: int, num_slots: int, rank: int, sweep: bool,
                 gen: torch.Generator) -> dict:
    """Times and largest errors of one linear's LoRA at one token count."""
    o = linear_operands(k, sizes, num_tokens, num_slots, rank, gen)
    x, lora_a, lora_b, mapping, workspace = o["x"], o["lora_a"], o["lora_b"], o["mapping"], o["workspace"]
    config = choose_config(num_tokens, num_slots, len(sizes), k)
    layer = dense_layer(o["weight"], sizes)
    side_stream = torch.cuda.Stream() if DEVICE == "cuda" else None
    y = torch.zeros(num_tokens, sum(sizes), device=DEVICE, dtype=DTYPE)
    h = lora_shrink(x, lora_a, mapping, config, workspace)

    def with_lora(base):
        return lambda: linear_with_lora(base, x, lora_a, lora_b, mapping, sizes, workspace, side_stream)
    record = dict(config=asdict(config), max_error=delta_error(o, sizes, config, workspace),
                  tolerance=1e-2 * o["delta"].abs().max().item(),
                  base_us=graph_seconds(lambda: F.linear(x, o["weight"])) * 1e6,
                  gemv_us=graph_seconds(lambda: dense_linear(x, o["weight"])) * 1e6,
                  shrink_us=graph_seconds(lambda: lora_shrink(x, lora_a, mapping, config, workspace)) * 1e6,
                  expand_us=graph_seconds(lambda: lora_expand(h, lora_b, mapping, y, sizes, config)) * 1e6,
                  lora_us=graph_seconds(lambda: add_lora(x, y, lora_a, lora_b, mapping, sizes, workspace,
                                                         config)) * 1e6,
                  with_base_us=graph_seconds(with_lora(lambda t: F.linear(t, o["weight"]))) * 1e6,
                  separate_us=graph_seconds(with_lora(lambda t: dense_linear(t, o["weight"]))) * 1e6,
                  gemv_config=_asdict(dense_gemv_choice(x, o["weight"])), fused_config=None, fused_us=None,
                  fused_error=None)
    record["ok"] = record["max_error"] <= record["tolerance"]
    fused = fused_gemv_config(layer, x, sizes)
    if fused is not None:
        out = with_lora(layer)()
        record.update(fused_config=_asdict(fused), fused_us=graph_seconds(with_lora(layer)) * 1e6,
                      fused_error=(out.float() - o["full"]).abs().max().item(),
                      fused_tolerance=1e-2 * o["full"].abs().max().item())
        record["ok"] = record["ok"] and record["fused_error"] <= record["fused_tolerance"]
    if sweep:
        record["sweep"] = sweep_splits(o, sizes, config)
    return record


def sweep_splits(o: dict, sizes: list[int], config) -> list[dict]:
    """``add_lora``'s time and error at every split count that gives each split a K step."""
    x, rank, k = o["x"], o["lora_a"].shape[2], o["lora_a"].shape[3]
    y = torch.zeros(x.shape[0], sum(sizes), device=DEVICE, dtype=DTYPE)

    def add_lora_us(config, workspace) -> float:
        return graph_seconds(lambda: add_lora(x, y, o["lora_a"], o["lora_b"], o["mapping"], sizes, workspace,
                                              config)) * 1e6
    rows = []
    for num_splits in [1 << i for i in range(MAX_SPLITS.bit_length()) if (1 << i) * config.block_k <= k]:
        other = replace(config, num_splits=num_splits)
        scratch = torch.empty(num_splits * len(sizes) * x.shape[0] * rank, device=DEVICE)
        rows.append(dict(num_splits=num_splits, us=add_lora_us(other, scratch),
                         max_error=delta_error(o, sizes, other, scratch)))
    return rows


def _asdict(config) -> dict | None:
    return None if config is None else asdict(config)


def delta_error(o: dict, sizes: list[int], config, workspace: torch.Tensor) -> float:
    """The largest difference of ``add_lora``'s deltas (DTYPE) from the float32 reference's."""
    y = torch.zeros(o["x"].shape[0], sum(sizes), device=DEVICE, dtype=DTYPE)
    add_lora(o["x"], y, o["lora_a"], o["lora_b"], o["mapping"], sizes, workspace, config)
    return (y.float() - o["delta"]).abs().max().item()


def format_record(record: dict) -> str:
    fused = "-" if record["fused_us"] is None else f"{record['fused_us']:6.1f}"
    line = (f"{record['layer']:>7} K={record['k']:>5} N={sum(record['sizes']):>5} M={record['tokens']:>3}  "
            f"LoRA {record['lora_us']:6.1f} us (shrink {record['shrink_us']:5.1f}, "
            f"expand {record['expand_us']:5.1f}, splits {record['config']['num_splits']:>2})  "
            f"base cuBLAS {record['base_us']:6.1f} us, with LoRA {record['with_base_us']:6.1f}  "
            f"engine base {record['gemv_us']:6.1f} ({'GEMV' if record['gemv_config'] else 'cuBLAS'}), "
            f"+ shrink + expand {record['separate_us']:6.1f}, fused {fused}  "
            f"err {record['max_error']:.1e} {'ok' if record['ok'] else 'WRONG'}")
    for row in record.get("sweep", []):
        line += f"\n      splits {row['num_splits']:>2}: {row['us']:6.1f} us err {row['max_error']:.1e}"
    return line


def step_sums(rows: list[dict], layers: int) -> dict:
    """One decode step's sums over ``layers`` layers of these linears' records (milliseconds): the
    LoRA kernels alone, the cuBLAS base and what LoRA adds to it with the shrink beside it; the
    engine's base linears and what LoRA adds to them, separately and as ``linear_with_lora`` runs
    it (fused where the GEMV runs)."""
    def total(key) -> float:
        return layers * sum(key(r) for r in rows) / 1e3
    engine = total(lambda r: (r["separate_us"] if r["fused_us"] is None else r["fused_us"]) - r["gemv_us"])
    return dict(tokens=rows[0]["tokens"], layers=layers, lora_ms=total(lambda r: r["lora_us"]),
                base_linears_ms=total(lambda r: r["base_us"]),
                added_with_overlap_ms=total(lambda r: r["with_base_us"] - r["base_us"]),
                engine_base_ms=total(lambda r: r["gemv_us"]),
                separate_added_ms=total(lambda r: r["separate_us"] - r["gemv_us"]), engine_added_ms=engine,
                linears=len(rows), fused_linears=sum(r["fused_us"] is not None for r in rows))


def format_step(step: dict) -> str:
    share = 100 * step["lora_ms"] / step["base_linears_ms"]
    return (f"  {step['tokens']} tokens, {step['layers']} layers: LoRA {step['lora_ms']:.3f} ms per step, "
            f"base linears {step['base_linears_ms']:.3f} ms ({share:.0f}%); "
            f"LoRA with the shrink beside the base adds {step['added_with_overlap_ms']:.3f} ms. Engine base "
            f"{step['engine_base_ms']:.3f} ms; LoRA adds {step['separate_added_ms']:.3f} ms with the expand "
            f"after it, {step['engine_added_ms']:.3f} ms as linear_with_lora runs it "
            f"({step['fused_linears']} of {step['linears']} linears fused)")


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
        steps.append(step_sums(rows, layers))
        print(format_step(steps[-1]), flush=True)
        records += rows
    wrong = [f"{r['layer']} M={r['tokens']}" for r in records if not r["ok"]]
    print(f"{len(records)} (linear, tokens) in {time.time() - started:.0f} s; "
          f"{'all within tolerance' if not wrong else 'WRONG: ' + ', '.join(wrong)}; JSON in {args.out}")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), shape=args.shape, slots=args.slots,
                       rank=args.rank, records=records, steps=steps), f, indent=1)


if __name__ == "__main__":
    main()
