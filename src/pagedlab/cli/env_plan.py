"""``pagedlab env`` (the machine, and what on it can skew a benchmark) and ``pagedlab plan`` (will
a model fit, from its config.json alone)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedlab.cli.engine_args import fraction, parse_bytes, positive_int


def register(subparsers) -> None:
    env = subparsers.add_parser("env", help="versions, GPUs (ECC, clocks, throttling, PCIe, P2P) and what "
                                            "can skew a benchmark, with fixes", allow_abbrev=False)
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.add_argument("--compare", metavar="RESULTS",
                     help="a stored result's JSON (manifest, exported run, LLM.benchmark or pagedlab bench "
                          "--json file): name every difference from the environment it recorded")
    env.set_defaults(func=cmd_env)
    plan = subparsers.add_parser("plan", help="will a model fit a GPU? weights, activations and KV cache per "
                                              "GPU from config.json, with TP/quantization advice",
                                 allow_abbrev=False)
    plan.add_argument("--model", required=True, help="model directory (its config.json) or a benchmark shape "
                                                     "(llama3-8b, llama3-70b, qwen3-0.6b)")
    where = plan.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpu", help="a GPU by name: H200, H100-80GB, A100-80GB, A100-40GB, L40S, "
                                     "RTX-4090, ...")
    where.add_argument("--gpu-memory", help="memory of one GPU, e.g. 24GiB or 80GB")
    plan.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    plan.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16")
    plan.add_argument("--quantization", default=None, help="none (default), fp8 or awq")
    plan.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8")
    plan.add_argument("--max-model-len", type=positive_int, default=None, help="default: the model's")
    plan.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    plan.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)


def cmd_env(args: argparse.Namespace) -> int:
    from pagedlab.lab.env import compare_environment, env_report, load_results_file

    report = env_report()
    differences = None
    if args.compare:
        try:
            differences = compare_environment(report, load_results_file(args.compare))
        except (OSError, ValueError) as e:
            print(f"error: --compare {args.compare}: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps({**report.to_dict(), "differences": differences}, indent=1, default=str))
        return 0
    print(format_env(report))
    if differences is not None:
        print(f"\ndifferences from {args.compare}:" if differences
              else f"\nsame environment as {args.compare}")
        print("\n".join(f"  {d}" for d in differences))
    return 0


def format_env(report) -> str:
    v, h = report.versions, report.hardware
    lines = ["software: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
             f"CUDA (torch): {h.get('cuda')}; driver: {h.get('driver')} (CUDA {h.get('driver_cuda')})",
             f"CPU: {h.get('cpu')} x {h.get('cpu_count')}; RAM: {(h.get('ram_bytes') or 0) / 2**30:.1f} GiB"]
    if not report.gpus:
        lines.append(f"GPUs: none ({report.no_gpu_reason})")
    for g in report.gpus:
        sm, mem, pcie = g["sm_clock_mhz"], g["mem_clock_mhz"], g["pcie"]
        lines.append(f"GPU {g['index']}: {g['name']}, {(g['memory_bytes'] or 0) / 2**30:.1f} GiB, ECC "
                     f"{_onoff(g['ecc_enabled'])} (errors {g['ecc_errors']['corrected']} corrected, "
                     f"{g['ecc_errors']['uncorrected']} uncorrected), SM {sm['now']}/{sm['max']} MHz, memory "
                     f"{mem['now']}/{mem['max']} MHz, {g['temperature_c']} C, power limit "
                     f"{g['power_limit_w']} W, throttle {g['throttle_reasons'] or 'none'}, persistence "
                     f"{_onoff(g['persistence_mode'])}, MIG {_onoff(g['mig_enabled'])}, PCIe gen "
                     f"{pcie['gen']}/{pcie['max_gen']} x{pcie['width']}/x{pcie['max_width']}")
    for p in report.peer_to_peer:
        lines.append(f"P2P GPU {p['gpus'][0]} <-> {p['gpus'][1]}: {'ok' if p['ok'] else 'not available'}")
    lines += [f"warning: {w}" for w in report.warnings] or ["no warnings"]
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    from pagedlab.lab.plan import gpu_memory_bytes, plan_memory, suggestions

    try:
        hf_config = _model_config(args.model)
        memory = gpu_memory_bytes(args.gpu) if args.gpu else _gpu_memory(args.gpu_memory)
        settings = dict(dtype=args.dtype, quantization=_none(args.quantization),
                        kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        max_num_batched_tokens=args.max_num_batched_tokens)
        plan = plan_memory(hf_config, memory, args.tensor_parallel_size, **settings)
        alternatives = [] if plan.fits else suggestions(
            hf_config, memory, args.tensor_parallel_size, **settings)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "suggestions": [a.to_dict() for a in alternatives]},
                         indent=1))
        return 0
    print(f"{args.model} ({plan.parameters / 1e9:.2f} B parameters) on {args.gpu or args.gpu_memory}: "
          f"{'fits' if plan.fits else 'does NOT fit'}")
    print(f"  {plan.summary()}; KV {plan.kv_bytes_per_token:,} bytes per token")
    for alternative in alternatives:
        print(f"  would fit: {alternative.summary()}")
    if not plan.fits and not alternatives:
        print("  nothing up to 8 GPUs or with fp8/awq fits: lower --max-model-len or take a larger GPU")
    return 0 if plan.fits else 1


def _model_config(model: str):
    if Path(model).is_dir():
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"--model {model!r}: the directory has no config.json")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    from pagedlab.workloads import model_shape

    try:
        return model_shape(model)
    except ValueError as e:
        raise ValueError(f"--model {model!r} is not a directory; as a benchmark shape: {e}") from None


def _gpu_memory(text: str) -> int:
    try:
        size = parse_bytes(text)
    except argparse.ArgumentTypeError:
        size = 0
    if size < 1:
        raise ValueError(f"--gpu-memory {text!r} is invalid: give a positive size such as 24GiB, 80GB or "
                         "40960MiB")
    return size


def _none(value: str | None) -> str | None:
    return None if value in (None, "none", "None") else value


def _onoff(value) -> str:
    return "?" if value is None else ("on" if value else "off")
