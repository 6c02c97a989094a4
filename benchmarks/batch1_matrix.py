"""W-seed batch 1 (512 random ids in, 128 out) across the engine's batch-1 targets, each with
programmatic dependent launch off and on, in one process: one call measures what five issues
ask of batch-1 TPOT, every ratio from rows of the same run.

Rows: the Llama-3-8B shape in bf16, FP8 weights, AWQ weights, 8 random rank-16 LoRA adapters
(the batch's one request takes one), batch-invariant mode; Gemma-2-9B and Qwen3-30B-A3B in
bf16 (dummy weights throughout). ``PAGEDLAB_PDL`` is set before each engine is built (its CUDA
graphs capture the kernels of that setting). Building the engines in one process shares the
imports and the compiled kernels, which separate ``pagedlab bench`` commands pay for each row.

    PYTHONPATH=src python3 benchmarks/batch1_matrix.py --out batch1.json [--rows bf16 fp8 ...] [--pdl 0 1]

It prints TPOT p50 (and x its floor) per row and PDL setting, the LoRA and batch-invariant
ratios to bf16 at the same setting, and writes every row's result to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pagedlab import workloads
from pagedlab.lora.bench import LoRABench

# name: (shape, engine arguments, LoRA adapters)
ROWS = {
    "bf16": ("llama3-8b", {}, None),
    "fp8": ("llama3-8b", {"quantization": "fp8"}, None),
    "awq": ("llama3-8b", {"quantization": "awq"}, None),
    "lora": ("llama3-8b", {}, LoRABench(8, 16)),
    "batch_invariant": ("llama3-8b", {"batch_invariant": True}, None),
    "gemma2-9b": ("gemma2-9b", {}, None),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", {}, None),
}
# rows measured against bf16 at the same PDL setting, and their targets (issues 14 and 16)
RATIOS = {"lora": 1.15, "batch_invariant": 1.10}


def measure(name: str, pdl: str, run_bench=workloads.run_bench) -> dict:
    """One row at one PDL setting: its result as a dict (TPOT p50, floor ratio, ...)."""
    shape, engine_args, lora = ROWS[name]
    os.environ["PAGEDLAB_PDL"] = pdl
    result = run_bench("W-seed", [1], 512, 128, None, ["pagedlab"], shape=shape,
                       engine_args=dict(engine_args), lora=lora, progress=lambda line: None)[0]
    return dict(result.to_dict(), row=name, pdl=pdl)


def ratios(records: list[dict]) -> list[dict]:
    """Each ``RATIOS`` row's TPOT over bf16's at the same PDL setting, with its target."""
    tpot = {(r["row"], r["pdl"]): r["tpot_p50_ms"] for r in records}
    found = []
    for (name, pdl), value in tpot.items():
        if name in RATIOS and ("bf16", pdl) in tpot:
            found.append(dict(row=name, pdl=pdl, ratio=value / tpot["bf16", pdl], target=RATIOS[name]))
    return found


def format_table(records: list[dict]) -> list[str]:
    lines = [f"{'row':>16} {'PDL':>4} {'TPOT p50':>9} {'x floor':>8}"]  # x a decode step's floor
    for r in records:
        over = f"{r['tpot_over_floor']:.2f}" if r.get("tpot_over_floor") is not None else "-"
        lines.append(f"{r['row']:>16} {r['pdl']:>4} {r['tpot_p50_ms']:8.2f}  {over:>7}")
    for r in ratios(records):
        lines.append(f"{r['row']:>16} {r['pdl']:>4} {r['ratio']:.3f}x bf16 "
                     f"(target at most {r['target']:.2f}x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="batch1_matrix.json", help="JSON file of every row")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--pdl", nargs="+", default=["0", "1"], choices=["0", "1"])
    args = parser.parse_args()
    start, records = time.perf_counter(), []
    for name in args.rows:
        for pdl in args.pdl:
            records.append(measure(name, pdl))
            print(format_table(records[-1:])[1], flush=True)
    print("\n".join(format_table(records)))
    with open(args.out, "w") as f:
        json.dump(dict(environment=workloads.environment(), rows=records, ratios=ratios(records),
                       seconds=time.perf_counter() - start), f, indent=1)
    print(f"{len(records)} rows in {time.perf_counter() - start:.0f} s; JSON in {args.out}")


if __name__ == "__main__":
    main()
