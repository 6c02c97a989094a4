"""Probe: does programmatic dependent launch (PDL) take the ramp-up and tail off the batch-1 GEMVs?

A batch-1 decode step on an H200 spends most of its time in ~128 back-to-back weight-read kernels
(Llama-3-8B: qkv, o, gate_up, down per layer), each paying a fixed ramp-up (launch, first bytes in
flight) and tail (last wave) of a few microseconds that the next kernel cannot overlap. With PDL
(Hopper) a kernel launched with ``launch_pdl=True`` may start while the previous one drains: its
programs run up to ``tl.extra.cuda.gdc_wait()`` (which waits until the previous grid has finished
and its writes are visible), and a grid lets the next one launch once all its programs have called
``tl.extra.cuda.gdc_launch_dependents()`` or exited. A CUDA graph captures the launch attribute as
a programmatic edge.

The probe builds 32 layers of those four bf16 linears at batch 1, each layer's own weights (14 GB:
weights come from HBM, as in decode), every linear's input the first K columns of the previous
one's output (a true data dependency), and times the whole chain as one CUDA-graph replay:

- ``cublas``: ``F.linear``;
- ``no-pdl``: the probe's GEMV (one program per ``block_n`` output rows looping over K, no split-K),
  its config per shape the fastest of ``CANDIDATES`` (timed first, shape by shape);
- ``pdl``: the same kernel launched with PDL, ``gdc_wait`` before any load, then
  ``gdc_launch_dependents``;
- ``pdl-prefetch``: the first weight tile is loaded before ``gdc_wait`` (weights do not depend on
  the previous kernel), then the wait, the trigger, the first x tile;
- ``pdl-prefetch-early``: as ``pdl-prefetch`` with the trigger the program's first instruction
  (the next grid may launch as soon as this one's last programs are resident);
- ``pdl-no-wait``: the race control, PDL with the trigger first and no wait: its outputs should be
  WRONG if the PDL edges survive capture (the next kernel reads x before it is written);
- ``pagedlab``: ``dense_linear``, the engine's dispatch (the Triton split-K GEMV where
  ``DENSE_GEMV_CONFIGS`` lists the shape, cuBLAS elsewhere).

Each chain's outputs are poisoned (NaN) before a checking replay, then every linear's output is
compared with ``input.float() @ weight.float().T`` of the input it should have read. It reports
ms per chain, us per linear, weight GB/s, the fraction of the 4.25 TB/s floor, the same chains
run eagerly (no graph: launch gaps included), and for each PDL mode the saving over ``no-pdl`` in
microseconds per kernel boundary; per shape, the same for 32 independent calls of one linear, and
the order of ``griddepcontrol``/first global load in each PDL kernel's PTX. Every variant runs
under try/except and prints its whole exception.

    PYTHONPATH=src python3 benchmarks/pdl_probe.py --out pdl_probe.json   # H200: under a minute

On a CPU, ``tests/test_pdl_probe.py`` runs the non-PDL kernel and the chain check under
TRITON_INTERPRET=1 (``gdc_*`` do not interpret: they sit behind constexpr flags).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedlab.kernels.gemv_configs import dense_gemv_config
from pagedlab.physical_floor import H200_BANDWIDTH

# (name, N, K): one Llama-3-8B layer's linears in execution order, one GPU.
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
CHECK_TOLERANCE = 1e-2  # max |error| over max |reference| per linear: bf16 output rounding is 2**-8


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape of the probe's GEMV."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Plain loads are not software-pipelined: a program has one weight tile in flight, so the tiles
# are 4-16 KB and the grids thousands to hundreds of programs.
CANDIDATES = (GemvConfig(4, 512), GemvConfig(8, 512), GemvConfig(4, 1024), GemvConfig(16, 256),
              GemvConfig(16, 512, num_warps=8))


@dataclass(frozen=True)
class Mode:
    """Where a kernel waits and triggers; all False is a plain launch."""

    name: str
    launch_pdl: bool = False
    wait_before_w: bool = False
    wait_after_w: bool = False
    trigger_at_entry: bool = False
    trigger_after_wait: bool = False


NO_PDL = Mode("no-pdl")
PDL_MODES = (
    Mode("pdl", launch_pdl=True, wait_before_w=True, trigger_after_wait=True),
    Mode("pdl-prefetch", launch_pdl=True, wait_after_w=True, trigger_after_wait=True),
    Mode("pdl-prefetch-early", launch_pdl=True, wait_after_w=True, trigger_at_entry=True),
)
RACE_CONTROL = Mode("pdl-no-wait", launch_pdl=True, trigger_at_entry=True)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 WAIT_BEFORE_W: tl.constexpr, WAIT_AFTER_W: tl.constexpr, TRIGGER_AT_ENTRY: tl.constexpr,
                 TRIGGER_AFTER_WAIT: tl.constexpr):
    """``out[n] = sum_k x[k] * w[n, k]`` for this program's ``BLOCK_N`` rows, K in ``BLOCK_K``
    steps; the first step is peeled so the first weight tile can be loaded before the wait."""
    if TRIGGER_AT_ENTRY:
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    if WAIT_BEFORE_W:
        tl.extra.cuda.gdc_wait()
    w = tl.load(w_rows + offs_k[None, :], mask=n_valid[:, None] & (offs_k < K)[None, :], other=0.0)
    if WAIT_AFTER_W:
        tl.extra.cuda.gdc_wait()
    if TRIGGER_AFTER_WAIT:
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
    products = x.to(tl.float32)[None, :] * w.to(tl.float32)
    for k_start in range(BLOCK_K, K, BLOCK_K):
        offs = k_start + offs_k
        k_valid = offs < K
        w = tl.load(w_rows + offs[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        x = tl.load(x_ptr + offs, mask=k_valid, other=0.0)
        products += x.to(tl.float32)[None, :] * w.to(tl.float32)
    tl.store(out_ptr + offs_n, tl.sum(products, axis=1).to(out_ptr.dtype.element_ty), mask=n_valid)


def probe_gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, mode: Mode = NO_PDL,
               out: torch.Tensor | None = None):
    """``x`` ``[1, K]`` (last dimension contiguous) @ ``weight.T`` into ``out`` ``[1, N]`` (made
    when None); returns ``(out, the launched kernel)``."""
    out_features, in_features = weight.shape
    if x.shape != (1, in_features) or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be one contiguous row of {in_features} (weight "
                         f"{tuple(weight.shape)} with contiguous rows)")
    if out is None:
        out = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
    kernel = _gemv_kernel[(triton.cdiv(out_features, config.block_n),)](
        x, weight, out, out_features, in_features, weight.stride(0), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, WAIT_BEFORE_W=mode.wait_before_w, WAIT_AFTER_W=mode.wait_after_w,
        TRIGGER_AT_ENTRY=mode.trigger_at_entry, TRIGGER_AFTER_WAIT=mode.trigger_after_wait,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=mode.launch_pdl)
    return out, kernel


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def run_chain(linear: Linear, x0: torch.Tensor, layers: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Every layer's linears in order, each fed the first K columns of the previous output
    (``x0`` the first); returns every output."""
    outputs, x = [], x0
    for weights in layers:
        for weight in weights:
            x = linear(x[:, :weight.shape[1]], weight)
            outputs.append(x)
    return outputs


def chain_error(x0: torch.Tensor, layers: list[list[torch.Tensor]], outputs: list[torch.Tensor]) -> float:
    """The largest over the chain's linears of max |output - reference| / max |reference|, the
    reference computed in float32 from the input that linear should have read (NaN stays NaN)."""
    weights = [weight for layer in layers for weight in layer]
    worst = 0.0
    for x, weight, out in zip([x0, *outputs[:-1]], weights, outputs, strict=True):
        reference = x[:, :weight.shape[1]].float() @ weight.float().T
        error = ((out.float() - reference).abs().max() / reference.abs().max()).item()
        if math.isnan(error):
            return error
        worst = max(worst, error)
    return worst


def make_layers(num_layers: int, shapes=SHAPES, dtype=torch.bfloat16, device="cuda",
                seed: int = 0) -> list[list[torch.Tensor]]:
    """Each layer's own random weights, scaled by K**-0.5 so activations keep their size."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return [[torch.randn(n, k, generator=generator, dtype=dtype, device=device).mul_(k ** -0.5)
             for _, n, k in shapes] for _ in range(num_layers)]


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def capture(fn: Callable[[], list[torch.Tensor]]) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """``fn`` run once eagerly (compiles, makes pagedlab's split-K counters), then captured."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def time_chain(fn: Callable[[], list[torch.Tensor]], check: Callable[[list[torch.Tensor]], float],
               repeats: int) -> dict:
    """Graph-replay and eager milliseconds of ``fn``, and ``check`` of the graph's outputs after a
    replay into NaN-poisoned buffers."""
    graph, outputs = capture(fn)
    graph.replay()
    graph_ms = _median_ms(graph.replay, repeats)
    for out in outputs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    record = {"graph_ms": graph_ms, "error": check(outputs)}
    record["eager_ms"] = _median_ms(fn, repeats)
    eager_outputs = fn()
    record["eager_error"] = check(eager_outputs)
    return record


def guarded(label: str, run: Callable[[], dict]) -> dict:
    """``run()``, or its whole exception printed and recorded."""
    try:
        return run()
    except Exception:  # a probe records every failure and goes on
        text = traceback.format_exc()
        print(f"{label}: FAILED\n{text}", flush=True)
        return {"exception": text}


def ptx_order(kernel) -> str:
    """The order of the first ``griddepcontrol.*`` and first global load in ``kernel``'s PTX."""
    lines = kernel.asm["ptx"].splitlines()
    marks = {"wait": "griddepcontrol.wait", "launch_dependents": "griddepcontrol.launch_dependents",
             "global load": "ld.global", "async copy": "cp.async"}
    first = {name: next((i for i, line in enumerate(lines) if text in line), None)
             for name, text in marks.items()}
    return " < ".join(sorted((name for name in first if first[name] is not None), key=first.get))


def sweep_shape(name: str, weights: list[torch.Tensor], repeats: int) -> dict:
    """32 (one per layer) independent calls of one shape in a graph: us per call of cuBLAS, each
    candidate without PDL, and each PDL mode with the fastest candidate."""
    x = torch.randn(1, weights[0].shape[1], dtype=weights[0].dtype, device=weights[0].device)
    moved = sum(w.numel() * w.element_size() for w in weights)

    def calls_us(linear: Linear) -> dict:
        graph, _ = capture(lambda: [linear(x, w) for w in weights])
        graph.replay()
        us = _median_ms(graph.replay, repeats) * 1e3 / len(weights)
        return {"us": us, "GB/s": moved / len(weights) / (us * 1e-6) / 1e9}

    record = {"cublas": guarded(f"{name} cublas", lambda: calls_us(F.linear))}
    for config in CANDIDATES:
        record[str(config)] = guarded(f"{name} {config}", lambda c=config: calls_us(
            lambda a, w: probe_gemv(a, w, c)[0]))
    timed = [c for c in CANDIDATES if "us" in record[str(c)]]
    if not timed:
        return record
    best = min(timed, key=lambda c: record[str(c)]["us"])
    record["best"] = asdict(best)
    record["no-pdl"] = record[str(best)]
    for mode in PDL_MODES:
        record[mode.name] = guarded(f"{name} {mode.name}", lambda m=mode: calls_us(
            lambda a, w: probe_gemv(a, w, best, m)[0]))
        record[mode.name + " ptx"] = guarded(f"{name} {mode.name} ptx", lambda m=mode: {
            "order": ptx_order(probe_gemv(x, weights[0], best, m)[1])})
    return record


def chain_variants(configs: dict[tuple[int, int], GemvConfig]) -> dict[str, Linear]:
    """The chain's linears, by variant name."""
    from pagedlab.quantization.linear_method import dense_linear

    def probe(mode: Mode) -> Linear:
        return lambda x, w: probe_gemv(x, w, configs[tuple(w.shape)], mode)[0]

    variants = {"cublas": F.linear, NO_PDL.name: probe(NO_PDL)}
    variants.update({mode.name: probe(mode) for mode in (*PDL_MODES, RACE_CONTROL)})
    variants["pagedlab"] = dense_linear
    return variants


def _verdict(error: float) -> str:
    return "ok" if error <= CHECK_TOLERANCE else "WRONG"  # NaN is wrong


def summarize(chain: dict, num_linears: int, moved: float) -> list[str]:
    """The chain table and each PDL mode's saving per kernel boundary (graph and eager)."""
    lines = [f"chain: {num_linears} linears, {moved / 1e9:.2f} GB of weights, floor "
             f"{moved / H200_BANDWIDTH * 1e3:.3f} ms at {H200_BANDWIDTH / 1e12:.2f} TB/s",
             f"{'variant':<20} {'graph ms':>9} {'us/linear':>10} {'GB/s':>7} {'floor/t':>7} {'eager ms':>9}"
             f" {'graph check':>18} {'eager check':>18}"]
    for name, record in chain.items():
        if "graph_ms" not in record:
            lines.append(f"{name:<20} FAILED (above)")
            continue
        ms = record["graph_ms"]
        lines.append(f"{name:<20} {ms:9.3f} {ms * 1e3 / num_linears:10.2f} {moved / ms / 1e6:7.0f} "
                     f"{moved / H200_BANDWIDTH * 1e3 / ms:7.1%} {record['eager_ms']:9.3f} "
                     f"{_verdict(record['error']):>7} {record['error']:10.2e} "
                     f"{_verdict(record['eager_error']):>7} {record['eager_error']:10.2e}")
    base = chain.get(NO_PDL.name, {})
    for mode in PDL_MODES:
        record = chain.get(mode.name, {})
        if "graph_ms" in base and "graph_ms" in record:
            saving = (base["graph_ms"] - record["graph_ms"]) * 1e3
            eager = (base["eager_ms"] - record["eager_ms"]) * 1e3
            lines.append(f"{mode.name}: saves {saving / (num_linears - 1):.2f} us per kernel boundary in the "
                         f"graph ({saving:.0f} us per chain, {saving / base['graph_ms'] / 1e3:.1%}); eager "
                         f"{eager / (num_linears - 1):.2f} us")
    race = chain.get(RACE_CONTROL.name, {}).get("error")
    if race is not None:
        seen = "PDL overlap is live" if _verdict(race) == "WRONG" else "no overlap seen: PDL edges lost?"
        lines.append(f"race control ({RACE_CONTROL.name}, expected WRONG) error {race:.2e}: {seen}")
    return lines


def shape_lines(label: str, record: dict) -> str:
    """One shape's sweep: us per call and GB/s of cuBLAS and each mode, and the PDL kernels' PTX order."""
    row = "  ".join(f"{key} {value['us']:.1f} us {value['GB/s']:.0f} GB/s" for key, value in record.items()
                    if isinstance(value, dict) and "us" in value and not key.startswith("GemvConfig"))
    lines = [f"{label} (best {record.get('best')}): {row}"]
    for mode in PDL_MODES:
        lines.append(f"  {mode.name} PTX: {record.get(mode.name + ' ptx', {}).get('order', 'FAILED')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10, help="timed replays per variant (median)")
    parser.add_argument("--out", help="write every record to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("pdl_probe needs a Hopper or newer GPU (PDL); on a CPU run tests/test_pdl_probe.py")
    started = time.perf_counter()
    torch.manual_seed(0)
    layers = make_layers(args.layers)
    moved = float(sum(w.numel() * w.element_size() for layer in layers for w in layer))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{args.layers} layers", flush=True)
    shapes, configs = {}, {}
    for index, (name, n, k) in enumerate(SHAPES):
        shapes[name] = sweep_shape(name, [layer[index] for layer in layers], args.repeats)
        configs[(n, k)] = GemvConfig(**shapes[name].get("best", asdict(CANDIDATES[0])))
        print(shape_lines(f"{name} {n}x{k}", shapes[name]), flush=True)
    print(f"shapes done at {time.perf_counter() - started:.0f} s", flush=True)
    print("pagedlab dispatch: " + ", ".join(f"{name} {dense_gemv_config(1, n, k) or 'cuBLAS'}"
                                            for name, n, k in SHAPES), flush=True)
    x0 = torch.randn(1, SHAPES[0][2], dtype=torch.bfloat16, device="cuda")
    chain = {}
    for name, linear in chain_variants(configs).items():
        chain[name] = guarded(name, lambda f=linear: time_chain(
            lambda: run_chain(f, x0, layers), lambda outs: chain_error(x0, layers, outs), args.repeats))
        print(f"{name}: {chain[name] if 'exception' not in chain[name] else 'FAILED'}", flush=True)
    lines = summarize(chain, args.layers * len(SHAPES), moved)
    print("\n".join(lines))
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shapes": shapes, "chain": chain, "summary": lines}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
