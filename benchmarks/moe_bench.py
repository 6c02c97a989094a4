"""The fused MoE kernels (``kernels/fused_moe.py``) at the Qwen3-30B-A3B and Mixtral-8x7B expert
shapes on one GPU, bf16, like vLLM's benchmark_moe.py: per token count, a sweep of launch
configs for each grouped GEMM, each checked against ``moe_torch`` (float32), then the best
config of the whole layer; at decode batches (at most ``MOE_GEMV_MAX_TOKENS`` tokens) also the
GEMV path's two launches (gate/up with the routing fused in, down folding each token's pairs)
and its whole layer, timed against the grouped layer, both with their routing.

Per (shape, tokens) it prints the routing + sort by expert in the two Triton kernels (at their
default warps, and swept over ``ROUTE_WARPS``) against the torch ops they replace; per row-block
size the best gate/up and down configs (time, GB/s of the routed experts' weights, TFLOP/s); the
whole fused layer with the best config and with the default heuristic; at decode batches the
best GEMV launches and the GEMV layer. Then the lines to paste into
``src/pagedlab/kernels/fused_moe_configs.py``: ``MOE_CONFIGS`` (every measured batch),
``MOE_GEMV_CONFIGS`` (only the batches where the GEMV layer beat the best grouped layer) and
``ROUTE_NUM_WARPS`` (every measured batch), and the MoE time of a batch-1 decode step (all
layers, the faster path). Times are medians of CUDA-graph replays (``graph_seconds`` of
gpu_timing.py: weights read from HBM, no launch gaps, as in a decode step's graph).

The sweep is two rounds per launch: a few tiles at fixed warps and stages (at each row-block
size), then the best tile's neighbours at the best row-block size (stages, warps, row grouping;
K splits of the down projection throughout). The GEMV launches are swept in one round
(``gemv_candidates``: block_n 8-64, block_k 128-1024, 2, 4 or 8 warps, plain or prefetching,
as many weight values a thread a step as ``GEMV_THREAD_VALUES`` allows), each checked through
the whole layer with the other launch at ``GEMV_CHECK``, all compiled first on a thread pool
(``precompile_gemv``). The first run compiles every config (Triton caches them: a second run is
mostly timing).

    PYTHONPATH=src:benchmarks python3 benchmarks/moe_bench.py --out moe_bench.json
    PYTHONPATH=src:benchmarks python3 benchmarks/moe_bench.py --route-only --tokens 1 2 4 8 --out route.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from dataclasses import asdict, replace
from types import SimpleNamespace

import torch
from gpu_timing import graph_seconds, precompile

from pagedlab.kernels.fused_moe import (fused_moe_triton, moe_down_gemv_triton, moe_down_triton,
                                        moe_gate_up_gemv_triton, moe_gate_up_triton, moe_torch,
                                        route_and_align_torch, route_and_align_triton, route_warps)
from pagedlab.kernels.fused_moe_configs import (MOE_GEMV_MAX_TOKENS, MoeConfig, MoeGemmConfig, MoeGemvConfig,
                                                MoeGemvLaunch, default_moe_config)

# name: (experts, hidden, expert intermediate, top_k, renormalize, layers)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8, True, 48), "mixtral-8x7b": (8, 4096, 14336, 2, True, 32)}
TOKENS = (1, 2, 4, 8, 64, 256, 2048)
DEVICE = "cuda"
DTYPE = torch.bfloat16
# The GEMV sweep's tiles, warps and stages (1: plain loop, 2: prefetch), the weight values a
# thread holds a step (of each of gate and up) that a candidate must stay within (fewer leave
# loads too small to stream, more spill), and the launch the other GEMV runs at while one is swept.
GEMV_BLOCK_N = (8, 16, 32, 64)
GEMV_BLOCK_K = (128, 256, 512, 1024)
GEMV_WARPS = (2, 4, 8)
GEMV_STAGES = (1, 2)
GEMV_THREAD_VALUES = (8, 32)
GEMV_CHECK = MoeGemvLaunch(8, 256)
# The down launch by token (``all_pairs``): its tiles hold the token's top_k pairs' rows a step,
# so they are narrower; a thread's weight values a step (top_k x block_n x block_k over the
# threads) within BY_TOKEN_THREAD_VALUES. Compiled for sm_90 (top-8, bf16 pairs), such tiles of
# 2-16 rows by 64-256 do not spill; 16 x 1024 at 4 warps (512 values) spilled 10,914 instructions.
BY_TOKEN_BLOCK_N = (2, 4, 8, 16)
BY_TOKEN_BLOCK_K = (64, 128, 256)
BY_TOKEN_THREAD_VALUES = (16, 64)
# The warps the routing launches are swept over.
ROUTE_WARPS = (1, 2, 4, 8)


def block_m_candidates(num_tokens: int, num_experts: int, top_k: int) -> list[int]:
    """Row-block sizes worth trying for this many pairs per expert."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 8:
        return [16]
    if per_expert <= 32:
        return [16, 32]
    return [32, 64] if per_expert <= 96 else [64, 128]


def first_round(launch: str, block_m: int, n: int, k: int, row_blocks: int, sms: int) -> list[MoeGemmConfig]:
    """Tiles at fixed warps/stages: narrow ones with long K steps where few rows per expert make
    the launch a weight stream (16-row blocks), tensor-core tiles otherwise; for the down
    projection each with K split for about 1, 2 and 4 programs per SM."""
    if block_m == 16:
        tiles = [MoeGemmConfig(bn, bk, num_stages=4) for bn in (16, 32, 64) for bk in (128, 256)]
    else:
        shapes = [(64, 64, 4), (128, 64, 4), (128, 64, 8), (64, 128, 4)]
        if launch == "down" or block_m <= 64:
            shapes.append((256, 64, 8))
        tiles = [MoeGemmConfig(bn, bk, 8, num_warps=w) for bn, bk, w in shapes]
    if launch == "gate_up":
        return tiles
    found = []
    for tile in tiles:
        k_steps = -(-k // tile.block_k)
        programs = row_blocks * -(-n // tile.block_n)
        for waves in (1, 2, 4):
            split = max(1, min(k_steps // 2, -(-waves * sms // programs)))
            found.append(replace(tile, split_k=split))
    return list(dict.fromkeys(found))


def gemv_candidates(k: int, row_sets: int, top_k: int = 0) -> list[MoeGemvLaunch]:
    """The GEMV launches for K ``k`` and ``row_sets`` weight tiles a step (gate/up 2, down 1):
    block_n x block_k (capped at the power of two that holds K) x warps x stages, where a
    thread's weight values a step (``row_sets`` tiles over the warps' threads) lie within
    ``GEMV_THREAD_VALUES``. With ``top_k`` (the down launch) also its form by token
    (``all_pairs``): the ``BY_TOKEN_*`` tiles, whose steps hold the token's ``top_k`` pairs."""
    cap = 1 << max(k - 1, 0).bit_length()
    low, high = GEMV_THREAD_VALUES
    found = [MoeGemvLaunch(bn, bk, warps, stages)
             for bn in GEMV_BLOCK_N for bk in sorted({min(b, cap) for b in GEMV_BLOCK_K})
             for warps in GEMV_WARPS for stages in GEMV_STAGES
             if low <= row_sets * bn * bk // (32 * warps) <= high]
    if top_k:
        low, high = BY_TOKEN_THREAD_VALUES
        found += [MoeGemvLaunch(bn, bk, warps, stages, True)
                  for bn in BY_TOKEN_BLOCK_N for bk in sorted({min(b, cap) for b in BY_TOKEN_BLOCK_K})
                  for warps in GEMV_WARPS for stages in GEMV_STAGES
                  if low <= top_k * bn * bk // (32 * warps) <= high]
    return found


def second_round(best: MoeGemmConfig) -> list[MoeGemmConfig]:
    """The best tile's neighbours: other stage counts, twice the warps, the other row grouping."""
    return [replace(best, num_stages=s) for s in (2, 3, 5) if s != best.num_stages] + [
        replace(best, num_warps=best.num_warps * 2), replace(best, group_m=1 if best.group_m > 1 else 8)]


def try_config(config: MoeGemmConfig, check, timed, tolerance: float, moved_bytes: int, flops: int) -> dict:
    """One candidate: the largest error of the layer's output it gives, its launch's time."""
    result = dict(config=asdict(config))
    try:
        result["max_error"] = check(config)
        seconds = graph_seconds(lambda: timed(config))
    except Exception as error:  # a config the compiler rejects (e.g. out of shared memory)
        return dict(result, us=float("inf"), ok=False, failed=f"{type(error).__name__}: {str(error)[:120]}")
    return dict(result, us=seconds * 1e6, gbps=moved_bytes / seconds / 1e9, tflops=flops / seconds / 1e12,
                ok=result["max_error"] <= tolerance)


def sweep_launch(candidates: list[MoeGemmConfig], refine: bool, check, timed, tolerance: float,
                 moved_bytes: int, flops: int) -> dict:
    """The first round for one launch (with ``refine`` the second too); the fastest correct
    config and every result."""
    results = {}

    def run(configs):
        for config in configs:
            if config not in results:
                results[config] = try_config(config, check, timed, tolerance, moved_bytes, flops)
        good = [c for c, r in results.items() if r["ok"]]
        return min(good, key=lambda c: results[c]["us"]) if good else None

    best = run(candidates)
    if refine and best is not None:
        best = run(second_round(best))
    return dict(best=results[best] if best else None, candidates=list(results.values()))


def sweep_both(candidates: dict, refine: bool, launchers: tuple, fixed: dict, x, w13, w2, routing,
               reference: torch.Tensor) -> dict:
    """The sweeps of one path's gate/up and down launches (``launchers``: its gate/up and down
    functions), each candidate checked through the whole layer against ``reference`` with the
    other launch at its ``fixed`` config; moved bytes are the routed experts' weights."""
    gate_up_fn, down_fn = launchers
    num_tokens, hidden = x.shape
    inter, top_k = w13.shape[1] // 2, routing.experts.shape[1]
    activated = gate_up_fn(x, w13, routing, fixed["gate_up"])
    active = routing.experts.unique().numel()
    pairs = num_tokens * top_k
    tolerance = 2e-2 * reference.abs().max().item()

    def error(out):
        return (out.float() - reference).abs().max().item()
    gate_up = sweep_launch(
        candidates["gate_up"], refine,
        lambda c: error(down_fn(gate_up_fn(x, w13, routing, c), w2, routing, fixed["down"])),
        lambda c: gate_up_fn(x, w13, routing, c), tolerance, active * 2 * inter * hidden * w13.element_size(),
        4 * pairs * hidden * inter)
    down = sweep_launch(
        candidates["down"], refine, lambda c: error(down_fn(activated, w2, routing, c)),
        lambda c: down_fn(activated, w2, routing, c), tolerance, active * hidden * inter * w2.element_size(),
        2 * pairs * hidden * inter)
    return dict(gate_up=gate_up, down=down)


def bench_block_m(block_m: int, refine: bool, x, logits, w13, w2, spec: tuple, reference: torch.Tensor,
                  sms: int) -> dict:
    """Both grouped GEMMs' sweeps at one row-block size, the other launch at its default."""
    num_experts, hidden, inter, top_k, renormalize, _ = spec
    num_tokens = x.shape[0]
    routing = route_and_align_triton(logits, top_k, renormalize, block_m, x.dtype)
    default = default_moe_config(num_tokens, num_experts, hidden, inter, top_k, sms)
    row_blocks = (routing.block_experts >= 0).sum().item()
    candidates = {"gate_up": first_round("gate_up", block_m, inter, hidden, row_blocks, sms),
                  "down": first_round("down", block_m, hidden, inter, row_blocks, sms)}
    return sweep_both(candidates, refine, (moe_gate_up_triton, moe_down_triton),
                      {"gate_up": default.gate_up, "down": default.down}, x, w13, w2, routing, reference)


def gemv_launchers(logits, top_k: int, renormalize: bool) -> tuple:
    """The GEMV path's launches in ``sweep_both``'s form: gate/up (its routing included) and down
    (reading the routing that ``routing`` holds: weights and experts)."""
    def gate_up(x, w13, routing, launch):
        return moe_gate_up_gemv_triton(x, logits, w13, top_k, renormalize, launch)[0]

    def down(activated, w2, routing, launch):
        return moe_down_gemv_triton(activated, w2, routing.weights, routing.experts, launch)
    return gate_up, down


def precompile_gemv(candidates: dict, x, logits, w13, w2, spec: tuple) -> None:
    """Compile every GEMV candidate of both launches on a thread pool without running it
    (``gpu_timing.precompile``)."""
    from pagedlab.kernels import fused_moe_kernels

    _, _, inter, top_k, renormalize, _ = spec
    activated = torch.empty(x.shape[0] * top_k, inter, dtype=x.dtype, device=x.device)
    routing = SimpleNamespace(weights=torch.empty(x.shape[0], top_k, dtype=x.dtype, device=x.device),
                              experts=torch.zeros(x.shape[0], top_k, dtype=torch.int32, device=x.device))
    gate_up, down = gemv_launchers(logits, top_k, renormalize)
    calls = ([functools.partial(gate_up, x, w13, routing, launch) for launch in candidates["gate_up"]]
             + [functools.partial(down, activated, w2, routing, launch) for launch in candidates["down"]])
    precompile(fused_moe_kernels, ("moe_gate_up_gemv_kernel", "moe_down_gemv_kernel"), calls)


def bench_gemv(x, logits, w13, w2, spec: tuple, reference: torch.Tensor) -> dict:
    """Both GEMV launches' sweeps (one round each), the gate/up launch timed with its routing."""
    _, hidden, inter, top_k, renormalize, _ = spec
    _, weights, experts = moe_gate_up_gemv_triton(x, logits, w13, top_k, renormalize, GEMV_CHECK)
    routing = SimpleNamespace(weights=weights, experts=experts)
    candidates = {"gate_up": gemv_candidates(hidden, 2), "down": gemv_candidates(inter, 1, top_k)}
    precompile_gemv(candidates, x, logits, w13, w2, spec)
    return sweep_both(candidates, False, gemv_launchers(logits, top_k, renormalize),
                      {"gate_up": GEMV_CHECK, "down": GEMV_CHECK}, x, w13, w2, routing, reference)


def same_routing(got, expected) -> bool:
    """The same experts, sorted pairs and row blocks, weights within float rounding."""
    return (torch.equal(got.experts.long(), expected.experts.long())
            and torch.equal(got.sorted_pairs, expected.sorted_pairs)
            and torch.equal(got.block_experts, expected.block_experts)
            and torch.allclose(got.weights.float(), expected.weights.float(), atol=1e-6, rtol=1e-5))


def bench_route(logits, top_k: int, renormalize: bool, block_m: int, dtype: torch.dtype) -> dict:
    """The routing and sort by expert: the Triton launches at their default warps and at each of
    ``ROUTE_WARPS`` (each checked against the torch ops), the fastest correct warps, the torch ops."""
    num_tokens, num_experts = logits.shape
    expected = route_and_align_torch(logits, top_k, renormalize, block_m, dtype)

    def triton_us(num_warps=None):
        return graph_seconds(lambda: route_and_align_triton(logits, top_k, renormalize, block_m, dtype,
                                                            num_warps)) * 1e6
    route = dict(triton_us=triton_us(), default_warps=route_warps(num_tokens, num_experts, top_k), warps={})
    for num_warps in ROUTE_WARPS:
        got = route_and_align_triton(logits, top_k, renormalize, block_m, dtype, num_warps)
        route["warps"][str(num_warps)] = dict(us=triton_us(num_warps), ok=same_routing(got, expected))
    good = [w for w, r in route["warps"].items() if r["ok"]]
    route["best_warps"] = int(min(good, key=lambda w: route["warps"][w]["us"])) if good else None
    route["torch_us"] = graph_seconds(
        lambda: route_and_align_torch(logits, top_k, renormalize, block_m, dtype)) * 1e6
    return route


def best_gemv_config(launches: dict) -> MoeGemvConfig | None:
    """The GEMV config of both launches' best, if each has a correct one."""
    if not (launches["gate_up"]["best"] and launches["down"]["best"]):
        return None
    return MoeGemvConfig(*(MoeGemvLaunch(**launches[launch]["best"]["config"])
                           for launch in ("gate_up", "down")))


def router_logits(num_tokens: int, num_experts: int, gen) -> torch.Tensor:
    """A random order of the experts per token, logits 0.05 apart: no near-ties, where two
    top-k's may differ."""
    order = torch.rand(num_tokens, num_experts, device=DEVICE, generator=gen)
    return torch.argsort(order, dim=-1).float() * 0.05


def route_records(shapes: list[str], tokens: list[int], sms: int, gen) -> list[dict]:
    """``--route-only``: per (shape, tokens) only ``bench_route`` (no weights, no GEMMs), printed."""
    records = []
    for name in shapes:
        num_experts, hidden, inter, top_k, renormalize, _ = SHAPES[name]
        for num_tokens in tokens:
            block_m = default_moe_config(num_tokens, num_experts, hidden, inter, top_k, sms).block_m
            logits = router_logits(num_tokens, num_experts, gen)
            route = bench_route(logits, top_k, renormalize, block_m, DTYPE)
            records.append(dict(shape=name, tokens=num_tokens, route=route))
            print(f"{name} {num_tokens:>5} tokens:", *format_route(route), sep="\n", flush=True)
    return records


def layer_records(shapes: list[str], tokens: list[int], sms: int, gen) -> list[dict]:
    """Per shape its random weights, then ``bench_tokens`` per token count, printed."""
    records = []
    for name in shapes:
        num_experts, hidden, inter, _, _, _ = SHAPES[name]
        w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, generator=gen) * hidden ** -0.5
        w2 = torch.randn(num_experts, hidden, inter, device=DEVICE, generator=gen) * inter ** -0.5
        w13, w2 = w13.to(DTYPE), w2.to(DTYPE)
        w13_ref, w2_ref = w13.float(), w2.float()
        for num_tokens in tokens:
            records.append(bench_tokens(name, num_tokens, w13, w2, w13_ref, w2_ref, sms, gen))
            print(format_record(records[-1]), flush=True)
        del w13, w2, w13_ref, w2_ref
        torch.cuda.empty_cache()
    return records


def bench_tokens(name: str, num_tokens: int, w13, w2, w13_ref, w2_ref, sms: int, gen) -> dict:
    """Routing, both launches' sweeps at each row-block size (and on the GEMV path at decode
    batches), the whole layer best, default (and GEMV)."""
    spec = SHAPES[name]
    num_experts, hidden, inter, top_k, renormalize, _ = spec
    x = torch.randn(num_tokens, hidden, device=DEVICE, generator=gen).to(DTYPE)
    logits = router_logits(num_tokens, num_experts, gen)
    reference = moe_torch(x.float(), logits, w13_ref, w2_ref, top_k, renormalize)
    default = default_moe_config(num_tokens, num_experts, hidden, inter, top_k, sms)
    route = bench_route(logits, top_k, renormalize, default.block_m, x.dtype)
    # the first round at every row-block size, then both rounds at the best one's
    per_block_m = {bm: bench_block_m(bm, False, x, logits, w13, w2, spec, reference, sms)
                   for bm in block_m_candidates(num_tokens, num_experts, top_k)}
    first = best_config(per_block_m)
    if first:
        bm = first.block_m
        per_block_m[bm] = bench_block_m(bm, True, x, logits, w13, w2, spec, reference, sms)
    experts_read = torch.unique(torch.topk(logits, top_k, dim=-1).indices).numel()
    record = dict(shape=name, tokens=num_tokens, route=route, experts_read=experts_read,
                  expert_mb=experts_read * 3 * hidden * inter * w13.element_size() / 1e6,
                  block_m={str(bm): r for bm, r in per_block_m.items()})
    configs = {"default": default, "best": best_config(per_block_m)}
    if num_tokens <= MOE_GEMV_MAX_TOKENS:
        record["gemv_launches"] = bench_gemv(x, logits, w13, w2, spec, reference)
        configs["gemv"] = best_gemv_config(record["gemv_launches"])
    for kind, config in configs.items():
        if config is None:
            continue

        def layer(c=config):
            return fused_moe_triton(x, logits, w13, w2, top_k, renormalize, c)
        seconds = graph_seconds(layer)
        record[kind] = dict(config=asdict(config), us=seconds * 1e6, gbps=record["expert_mb"] / seconds / 1e3,
                            tflops=6 * num_tokens * top_k * hidden * inter / seconds / 1e12,
                            max_error=(layer().float() - reference).abs().max().item())
    return record


def best_config(per_block_m: dict) -> MoeConfig | None:
    """The row-block size whose best gate/up and down sum least, with those two configs."""
    complete = {bm: r for bm, r in per_block_m.items() if r["gate_up"]["best"] and r["down"]["best"]}
    if not complete:
        return None

    def total_us(bm):
        return complete[bm]["gate_up"]["best"]["us"] + complete[bm]["down"]["best"]["us"]
    bm = min(complete, key=total_us)
    return MoeConfig(bm, MoeGemmConfig(**complete[bm]["gate_up"]["best"]["config"]),
                     MoeGemmConfig(**complete[bm]["down"]["best"]["config"]))


def _describe(result: dict | None) -> str:
    if not result:
        return "no correct config"
    return (f"{result['us']:8.1f} us {result['gbps']:6.0f} GB/s {result['tflops']:6.1f} TFLOP/s "
            f"err {result['max_error']:.1e}")


def format_route(route: dict) -> list[str]:
    """``bench_route``'s result: the default launch against the torch ops, then by warps."""
    sweep = ", ".join(f"{w}: {r['us']:.1f}" + ("" if r["ok"] else " WRONG")
                      for w, r in route["warps"].items())
    return [f"    route+align Triton {route['triton_us']:.1f} us ({route['default_warps']} warps), "
            f"torch {route['torch_us']:.1f} us",
            f"    route+align by warps {sweep} us; best {route['best_warps']}"]


def format_record(record: dict) -> str:
    lines = [f"{record['shape']} {record['tokens']:>5} tokens ({record['experts_read']} experts read, "
             f"{record['expert_mb']:.0f} MB):", *format_route(record["route"])]
    for bm, result in record["block_m"].items():
        for launch in ("gate_up", "down"):
            best = result[launch]["best"]
            config = MoeGemmConfig(**best["config"]) if best else ""
            lines.append(f"    block_m {bm:>3} {launch:>7} {_describe(best)} {config}")
    for launch, result in record.get("gemv_launches", {}).items():
        best = result["best"]
        config = MoeGemvLaunch(**best["config"]) if best else ""
        lines.append(f"    GEMV        {launch:>7} {_describe(best)} {config}")
    for kind in ("best", "default", "gemv"):
        if kind in record:
            lines.append(f"    fused layer {kind:>7} {_describe(record[kind])}")
    return "\n".join(lines)


def config_source(config: dict) -> str:
    """A MoeConfig as the table writes it (positional fields)."""
    def gemm(g):
        return (f"MoeGemmConfig({g['block_n']}, {g['block_k']}, {g['group_m']}, {g['split_k']}, "
                f"{g['num_warps']}, {g['num_stages']})")
    return f"MoeConfig({config['block_m']}, {gemm(config['gate_up'])}, {gemm(config['down'])})"


def gemv_config_source(config: dict) -> str:
    """A MoeGemvConfig as the table writes it (positional fields)."""
    def launch(g):
        by_token = ", True" if g.get("all_pairs") else ""
        return f"MoeGemvLaunch({g['block_n']}, {g['block_k']}, {g['num_warps']}, {g['num_stages']}{by_token})"
    return f"MoeGemvConfig({launch(config['gate_up'])}, {launch(config['down'])})"


def grouped_layer(record: dict) -> dict:
    """The faster of the grouped layer's swept best and default configs."""
    default = record["default"]
    return min(record.get("best", default), default, key=lambda r: r["us"])


def _table_key(record: dict) -> tuple[int, ...]:
    num_experts, hidden, inter, top_k, _, _ = SHAPES[record["shape"]]
    return (num_experts, hidden, inter, top_k, record["tokens"])


def table_lines(records: list[dict]) -> list[str]:
    """The MOE_CONFIGS entries: every measured (shape, tokens), the swept best config or the
    default where the whole layer ran faster with it."""
    lines = []
    for record in records:
        best = grouped_layer(record)
        lines.append(f"    {_table_key(record)}:  # {record['shape']}: {best['us']:.1f} us, "
                     f"{best['gbps']:.0f} GB/s (default {record['default']['us']:.1f} us)")
        lines.append(f"        {config_source(best['config'])},")
    return lines


def gemv_table_lines(records: list[dict]) -> list[str]:
    """The MOE_GEMV_CONFIGS entries: the (shape, tokens) whose GEMV layer beat the grouped
    layer (``grouped_layer``), with the best GEMV launches."""
    lines = []
    for record in records:
        gemv, grouped = record.get("gemv"), grouped_layer(record)
        if gemv is None or gemv["us"] >= grouped["us"]:
            continue
        lines.append(f"    {_table_key(record)}:  # {record['shape']}: {gemv['us']:.1f} us, "
                     f"{gemv['gbps']:.0f} GB/s (grouped {grouped['us']:.1f} us)")
        lines.append(f"        {gemv_config_source(gemv['config'])},")
    return lines


def route_table_lines(records: list[dict]) -> list[str]:
    """The ROUTE_NUM_WARPS entries: every measured (shape, tokens) with its fastest correct warps."""
    lines = []
    for record in records:
        route = record["route"]
        if route["best_warps"] is None:
            continue
        num_experts, _, _, top_k, _, _ = SHAPES[record["shape"]]
        best = route["warps"][str(route["best_warps"])]["us"]
        lines.append(f"    {(num_experts, top_k, record['tokens'])}: {route['best_warps']},  "
                     f"# {record['shape']}: {best:.1f} us (default {route['default_warps']} warps "
                     f"{route['triton_us']:.1f} us)")
    return lines


def batch1_estimates(records: list[dict]) -> dict[str, float]:
    """Per shape, the MoE milliseconds of a batch-1 decode step (every layer at the faster path)."""
    estimates = {}
    for record in records:
        if record["tokens"] == 1:
            layers = SHAPES[record["shape"]][5]
            grouped_us = grouped_layer(record)["us"]
            best_us = min(grouped_us, record.get("gemv", {"us": grouped_us})["us"])
            estimates[record["shape"]] = ms = layers * best_us / 1e3
            print(f"{record['shape']}: batch-1 MoE per decode step ({layers} layers) {ms:.2f} ms "
                  f"(grouped {layers * grouped_us / 1e3:.2f} ms, default config "
                  f"{layers * record['default']['us'] / 1e3:.2f} ms)")
    return estimates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="moe_bench.json", help="JSON file of every measurement")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--route-only", action="store_true",
                        help="only the routing launches' warp sweep (seconds, no GEMM sweeps)")
    args = parser.parse_args()
    start = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs); bf16 activations and weights, float32 logits")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    lines, gemv_lines, estimates = [], [], {}
    if args.route_only:
        records = route_records(args.shapes, args.tokens, sms, gen)
    else:
        records = layer_records(args.shapes, args.tokens, sms, gen)
        lines, gemv_lines = table_lines(records), gemv_table_lines(records)
        print("\n# paste into MOE_CONFIGS in src/pagedlab/kernels/fused_moe_configs.py", *lines, sep="\n")
        print("\n# paste into MOE_GEMV_CONFIGS in src/pagedlab/kernels/fused_moe_configs.py (batches where "
              "the GEMV layer beat the grouped one)", *gemv_lines, sep="\n")
        estimates = batch1_estimates(records)
    route_lines = route_table_lines(records)
    print("\n# paste into ROUTE_NUM_WARPS in src/pagedlab/kernels/fused_moe_configs.py", *route_lines,
          sep="\n")
    elapsed = time.perf_counter() - start
    print(f"{len(records)} (shape, tokens) in {elapsed:.0f} s; JSON in {args.out}")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), sms=sms, records=records, table=lines,
                       gemv_table=gemv_lines, route_table=route_lines, batch1_moe_ms=estimates,
                       seconds=elapsed), f, indent=1)


if __name__ == "__main__":
    main()
