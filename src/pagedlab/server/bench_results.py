"""``pagedlab bench serve``'s result files: ``--json PATH`` (pagedlab's: every key, the per-request
lists included, indented) and vLLM's ``--save-result`` / ``--append-result`` with
``--result-dir``, ``--result-filename``, ``--save-detailed``, ``--label`` and ``--metadata``,
named and laid out as ``vllm bench serve`` writes them (``main_async`` and
``compute_result_filename`` in ``vllm/benchmarks/serve.py``): the per-request lists only with
``--save-detailed``, one JSON object a line.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import datetime
from pathlib import Path

from pagedlab.cli.engine_args import check_writable
from pagedlab.interrupt import stop_reason

# The per-request lists vLLM saves only with --save-detailed (latencies and queue_times it keeps).
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def add_result_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write every figure and per-request list (vLLM's keys) here, indented")
    p.add_argument("--save-result", action="store_true",
                   help="save the results as vLLM does, to --result-dir/--result-filename (default: "
                        "{label}-{rate}qps[-concurrency{C}]-{model}-{date}.json in the current folder)")
    p.add_argument("--append-result", action="store_true", help="append them to that file as a line")
    p.add_argument("--save-detailed", action="store_true",
                   help="keep the per-request lists (input_lens, ttfts, itls, ...) in that file")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--label", default=None, help="the results' label (default: the backend, openai)")
    p.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="saved as top-level keys of the results")


def metadata(args: argparse.Namespace) -> dict[str, str]:
    """``--metadata KEY=VALUE ...`` as vLLM reads it; a ValueError for an item without '='."""
    out = {}
    for item in args.metadata or []:
        if "=" not in item:
            raise ValueError(f"--metadata {item!r} is invalid: give KEY=VALUE pairs")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def check_result_paths(args: argparse.Namespace) -> None:
    """A ValueError, before any request, where a result file could not be written."""
    metadata(args)
    if args.json:
        check_writable(args.json, "--json")
    if args.save_result or args.append_result:
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
        check_writable(os.path.join(args.result_dir or ".", args.result_filename or "x.json"),
                       "--result-filename" if args.result_filename else "--result-dir")


def result_filename(args: argparse.Namespace, model_id: str, date: str) -> str:
    """vLLM's ``compute_result_filename``."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    label, model = args.label or backend(args), model_id.split("/")[-1]
    if args.ramp_up_strategy is not None:
        name = (f"{label}-ramp-up-{args.ramp_up_strategy}-{args.ramp_up_start_rps}qps-"
                f"{args.ramp_up_end_rps}qps{concurrency}-{model}-{date}.json")
    else:
        name = f"{label}-{args.request_rate}qps{concurrency}-{model}-{date}.json"
    name = args.result_filename or name
    return os.path.join(args.result_dir, name) if args.result_dir else name


def backend(args: argparse.Namespace) -> str:
    """vLLM's ``--backend`` for the endpoint: ``openai-chat`` sends chat completions."""
    return "openai-chat" if args.endpoint.rstrip("/").endswith("chat/completions") else "openai"


def result_record(args: argparse.Namespace, model_id: str, metrics: dict, date: str,
                  rps_change_events: list[dict]) -> dict:
    """vLLM's saved result, key for key: the run's settings (``model_id`` the model's root, as
    vLLM records it, or ``--model``), ``--metadata``, the traffic, then the figures."""
    be = backend(args)
    record = {"date": date, "endpoint_type": be, "backend": be, "label": args.label, "model_id": model_id,
              "tokenizer_id": model_id, "num_prompts": args.num_prompts, **metadata(args),
              "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}
    if args.ramp_up_strategy is not None:
        record.update(ramp_up_strategy=args.ramp_up_strategy, ramp_up_start_rps=args.ramp_up_start_rps,
                      ramp_up_end_rps=args.ramp_up_end_rps)
    record.update(metrics)
    if rps_change_events:
        record["rps_change_events"] = rps_change_events
    return record


def save_results(args: argparse.Namespace, base_url: str, model_id: str, metrics: dict,
                 stopped: BaseException | None, rps_change_events: list[dict]) -> list[str]:
    """Write the files the flags ask for; a run stopped part-way is marked ``"partial": true``
    with why it stopped (``"interrupted"``). Returns the paths written."""
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    record = result_record(args, model_id, metrics, date, rps_change_events)
    if stopped is not None:
        record.update(partial=True, interrupted=stop_reason(stopped),
                      finished_requests=metrics["completed"] + metrics["failed"])
    written = []
    if args.json:
        extra = {"base_url": base_url, "endpoint": args.endpoint, "input_len": None if args.dataset else
                 args.input_len, "dataset": args.dataset, "output_len": args.output_len}
        Path(args.json).write_text(json.dumps({**record, **extra}, indent=2))
        written.append(args.json)
    if args.save_result or args.append_result:
        path = result_filename(args, model_id, date)
        saved = {k: v for k, v in record.items() if args.save_detailed or k not in DETAILED_KEYS}
        with open(path, "a+" if args.append_result else "w", encoding="utf-8") as f:
            if args.append_result and f.tell() != 0:
                f.write("\n")
            json.dump(saved, f)
        written.append(path)
    return written
