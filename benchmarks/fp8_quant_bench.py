"""The FP8 activation quantization kernels (``kernels/fp8_linear.py``) at decode rows on one GPU:
o_proj's per-token quantization and down_proj's SiLU-and-mul + quantization at a model's widths
(Llama-3-8B's by default: 4,096 and 14,336 values a row), one program a row against the split
form in chunks of 512, 1,024 and 2,048 values, and the launch the engine picks
(``split_quant_block``). Every launch is checked bit for bit against ``quantize_fp8_per_row``
(of x, or of the kernel's own SiLU-and-mul) before it is timed.

Times are medians of CUDA-graph replays of the one call (``triton.testing.do_bench_cudagraph``),
programmatic dependent launch off unless ``--pdl 1`` (a kernel alone has nothing to overlap).

    PYTHONPATH=src python3 benchmarks/fp8_quant_bench.py --out fp8_quant.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

from pagedlab.workloads import model_shape

SPLIT_BLOCKS = (512, 1024, 2048)


def variants() -> list[tuple[str, int | None]]:
    """(label, ``split_block``): the engine's choice, one program a row, each split chunk width."""
    return [("engine", None), ("whole", 0)] + [(f"split-{block}", block) for block in SPLIT_BLOCKS]


def quantize(kind: str, x: torch.Tensor, split_block: int | None, act_out: torch.Tensor | None = None):
    """One launch of ``kind`` ("quant": x's per-token quantization; "silu": the SiLU-and-mul of x's
    halves, quantized): ``(values, scales)``."""
    from pagedlab.kernels import fp8_linear

    if kind == "quant":
        return fp8_linear.quantize_fp8_per_token_triton(x, split_block=split_block)
    out = fp8_linear.silu_and_mul_fp8_triton(x, act_out=act_out, split_block=split_block)
    return out.values, out.scales


def exact(kind: str, x: torch.Tensor, split_block: int | None) -> bool:
    """Whether the launch's values and scales are bitwise ``quantize_fp8_per_row`` of its input."""
    from pagedlab.quantization.fp8 import quantize_fp8_per_row

    rows, width = x.shape[0], x.shape[1] // (2 if kind == "silu" else 1)
    act = torch.empty(rows, width, dtype=x.dtype, device=x.device) if kind == "silu" else None
    values, scales = quantize(kind, x, split_block, act)
    expected_values, expected_scales = quantize_fp8_per_row(x if act is None else act)
    return (torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
            and torch.equal(scales, expected_scales))


def inputs(kind: str, rows: int, width: int, device: str) -> torch.Tensor:
    """bf16 activations of decode-like magnitudes (``[rows, 2 * width]`` for "silu")."""
    generator = torch.Generator(device).manual_seed(rows * width)
    columns = width * (2 if kind == "silu" else 1)
    return (torch.randn(rows, columns, generator=generator, device=device) * 3).bfloat16()


def measure(kind: str, rows: int, width: int) -> list[dict]:
    """Every variant at one (kind, rows): microseconds a call and whether it was exact."""
    import triton

    x = inputs(kind, rows, width, "cuda")
    found = []
    for label, split_block in variants():
        ok = exact(kind, x, split_block)
        call = functools.partial(quantize, kind, x, split_block)
        us = triton.testing.do_bench_cudagraph(call, rep=200) * 1e3
        found.append(dict(kind=kind, rows=rows, width=width, variant=label, us=round(us, 2), exact=ok))
        print(f"{kind:>5} {width:>6} x {rows:>2} rows  {label:>10}  {us:6.2f} us  "
              f"{'exact' if ok else 'WRONG'}", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", help="a known model shape (pagedlab.workloads)")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--pdl", choices=["0", "1"], default="0")
    parser.add_argument("--out", default="fp8_quant_bench.json")
    args = parser.parse_args()
    os.environ["PAGEDLAB_PDL"] = args.pdl  # read at each launch
    shape = model_shape(args.shape)
    widths = {"quant": shape.hidden_size, "silu": shape.intermediate_size}
    records = [record for rows in args.rows for kind, width in widths.items()
               for record in measure(kind, rows, width)]
    with open(args.out, "w") as f:
        json.dump(dict(shape=args.shape, pdl=args.pdl, device=torch.cuda.get_device_name(), rows=records), f,
                  indent=1)
    print(f"{len(records)} launches; JSON in {args.out}")


if __name__ == "__main__":
    main()
