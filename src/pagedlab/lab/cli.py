"""The lab's subcommands: ``run``, ``results list|show|export|import``, ``monitor``, ``report``.

``register(subparsers)`` adds them to the ``pagedlab`` command line; ``python -m pagedlab.lab.cli``
runs them on their own. Each handler returns the process exit code: 0 success, 1 some runs
failed, 2 bad input (malformed experiment, unknown run, bad database URL) or a results database
that failed to store a run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pagedlab.cli.engine_args import CommandParser
from pagedlab.interrupt import reader_gone_exit

_DB_HELP = ("results database: a SQLAlchemy URL or a SQLite file path "
            "(default: $PAGEDLAB_DB or sqlite:///results.db)")


def register(subparsers) -> None:
    """Add ``run``, ``results``, ``monitor`` and ``report`` to an argparse subparsers object."""
    _register_run(subparsers)
    _register_results(subparsers)
    _register_monitor(subparsers)
    _register_report(subparsers)


def _register_run(subparsers) -> None:
    p = subparsers.add_parser("run", help="run an experiment from a YAML file (resumable, weights loaded "
                                          "once per model group)",
                              description="Run the pending runs of an experiment and store each one, with "
                                          "its manifest, in the results database. A rerun skips finished "
                                          "runs.")
    p.add_argument("experiment", help="experiment YAML file (schema: docs/lab.md)")
    p.add_argument("--db", default=None, help=_DB_HELP)
    p.add_argument("--dry-run", action="store_true", help="validate and print the runs, execute nothing")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the file, e.g. --set engine.device=cpu --set repeats=1")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or per-run lines")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile each run (torch profiler) into DIR/<experiment>/run<N>-<key>: a "
                        "Chrome/Perfetto trace, profile.json and kernels.txt (kernels by kind, host-gap "
                        "share per step kind), referenced from the run's manifest; profiling slows the runs")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run each model group as a Ray task on the cluster at ADDRESS (without one: "
                        "$RAY_ADDRESS, else a new local cluster); see docs/ray.md")
    p.set_defaults(func=cmd_run)


def _register_results(subparsers) -> None:
    p = subparsers.add_parser("results", help="list, show or export stored runs")
    sub = p.add_subparsers(dest="results_command", metavar="{list,show,export,import}")
    sub.required = True
    q = sub.add_parser("list", help="one line per stored run")
    q.add_argument("--db", default=None, help=_DB_HELP)
    q.add_argument("--experiment", "-e", default=None, help="only this experiment")
    q.add_argument("--status", choices=("finished", "failed", "all"), default="all")
    q.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    q.set_defaults(func=cmd_results_list)
    q = sub.add_parser("show", help="everything stored about one run")
    q.add_argument("run_id", type=int)
    q.add_argument("--db", default=None, help=_DB_HELP)
    q.add_argument("--outputs", type=int, default=5, metavar="N", help="show the first N outputs (default 5)")
    q.add_argument("--json", action="store_true", help="print the run as JSON (all outputs)")
    q.set_defaults(func=cmd_results_show)
    q = sub.add_parser("export", help="write the runs as CSV, JSON lines or Parquet")
    q.add_argument("--db", default=None, help=_DB_HELP)
    q.add_argument("--format", "-f", choices=("csv", "jsonl", "parquet"), default=None,
                   help="default: from the --out suffix, else csv")
    q.add_argument("--out", "-o", default=None, help="output file (default: results.FORMAT)")
    q.add_argument("--experiment", "-e", default=None, help="only this experiment")
    q.add_argument("--status", choices=("finished", "failed", "all"), default="finished")
    q.add_argument("--outputs", action="store_true", help="jsonl: include every run's outputs")
    q.add_argument("--manifest", action="store_true", help="csv/parquet: add the manifest.* columns")
    q.set_defaults(func=cmd_results_export)
    q = sub.add_parser("import", help="store runs saved to files when the database failed to store them")
    q.add_argument("files", nargs="+", metavar="FILE", help="a run file named by `pagedlab run`'s error")
    q.add_argument("--db", default=None, help=_DB_HELP)
    q.set_defaults(func=cmd_results_import)


def _register_monitor(subparsers) -> None:
    p = subparsers.add_parser("monitor", help="log GPU telemetry (NVML) as gpustat-like lines",
                              description="Print one line per GPU (and one for the host) every INTERVAL "
                                          "seconds and append it to --log. Without an NVIDIA GPU it says so "
                                          "once and records CPU and RAM.")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between samples (default 60)")
    p.add_argument("--log", default=None, help="append the lines to this file")
    p.add_argument("--count", type=int, default=None, help="stop after N samples (default: until Ctrl-C)")
    p.add_argument("--gpu-only", action="store_true", help="no host CPU/RAM line when there is a GPU")
    p.add_argument("-q", "--quiet", action="store_true", help="only write to --log")
    p.set_defaults(func=cmd_monitor)


def _register_report(subparsers) -> None:
    p = subparsers.add_parser("report", help="PNG plots and one self-contained HTML page from the results",
                              description="Plots (throughput vs batch size per model, latency percentiles, "
                                          "memory, spread over seeds, quality metrics) and an HTML page with "
                                          "the tables, the plots and the manifest fields that differ between "
                                          "runs highlighted.")
    p.add_argument("--db", default=None, help=_DB_HELP)
    p.add_argument("--out", default="report", help="output directory (default: report/)")
    p.add_argument("--experiment", "-e", action="append", default=None,
                   help="only this experiment (repeatable)")
    p.add_argument("--title", default=None, help="page title")
    p.set_defaults(func=cmd_report)


def _errors():
    from pagedlab.lab.schema import ExperimentError
    from pagedlab.lab.unstored import UnstoredRunError

    return (ExperimentError, ValueError, ImportError, KeyError, FileNotFoundError, UnstoredRunError)


def _fail(e: BaseException) -> int:
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    print(f"error: {msg}", file=sys.stderr)
    return 2


def cmd_run(args) -> int:
    from pagedlab.lab.runner import run_experiment
    from pagedlab.lab.spec import load_experiment

    try:
        spec = load_experiment(args.experiment, args.overrides)
        if args.ray is not None and args.profile is not None:
            raise ValueError("--profile runs here, not with --ray: profile the runs without --ray")
        if args.ray is not None and not args.dry_run:
            from pagedlab.lab.ray_runner import run_experiment_on_ray

            report = run_experiment_on_ray(spec, db=args.db, address=args.ray or None, quiet=args.quiet)
        else:
            report = run_experiment(spec, db=args.db, dry_run=args.dry_run, quiet=args.quiet,
                                    profile_dir=args.profile)
    except _errors() as e:
        return _fail(e)
    except KeyboardInterrupt:
        print("interrupted: every finished run is stored; run the same command again to resume",
              file=sys.stderr)
        return 130
    return 0 if report.ok else 1


def _status(value: str) -> str | None:
    return None if value == "all" else value


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


_HEADLINE = ("contains_answer", "exact_match", "bleu", "chrf", "output_throughput", "ttft_p50_ms",
             "tpot_p50_ms", "mean_output_tokens")


def _short_label(v) -> str:
    from pagedlab.lab.report import short_label

    return short_label(v)


def _summary_columns(run: dict) -> tuple[str, str]:
    """The params and metrics columns of one run: its varied params and headline metrics, or for a
    reproducibility check (``pagedlab repro check --db``) the check, its verdict and its numbers."""
    params, metrics = run["params"], run["metrics"]
    if "repro.check" in params:
        numbers = [f"{k}={_short_label(v)}" for k, v in metrics.items() if k != "differs" and v is not None]
        return (f"check={params['repro.check']}",
                ", ".join([f"verdict={params.get('repro.verdict')}", *numbers[:3]]))
    varied = ", ".join(f"{k}={_short_label(params.get(k))}" for k in params.get("varied", []))
    shown = ", ".join(f"{k}={_short_label(metrics[k])}" for k in _HEADLINE if metrics.get(k) is not None)
    return varied, shown


def cmd_results_list(args) -> int:
    from pagedlab.lab.store import ResultStore

    try:
        with ResultStore(args.db, create=False) as store:
            runs = store.runs(experiment=args.experiment, status=_status(args.status), manifest=False)
    except _errors() as e:
        return _fail(e)
    if args.json:
        for r in runs:
            print(json.dumps({k: r[k] for k in ("run_id", "experiment", "status", "model", "repeat", "seed",
                                                "params", "metrics", "finished_at", "error")}, default=str))
        return 0
    if not runs:
        print("no runs stored" + (f" for experiment {args.experiment!r}" if args.experiment else ""))
        return 0
    rows = []
    for r in runs:
        params, metrics = _summary_columns(r)
        if r["status"] == "failed":
            metrics = (r["error"] or "").splitlines()[0][:80]
        rows.append([str(r["run_id"]), r["experiment"], r["status"], _short_label(r["model"] or ""),
                     params or "-", str(r["repeat"]), str(r["seed"]), metrics, (r["finished_at"] or "")[:19]])
    print(_table(["id", "experiment", "status", "model", "params", "rep", "seed", "metrics", "finished"],
                 rows))
    return 0


def cmd_results_show(args) -> int:
    from pagedlab.lab.store import ResultStore

    try:
        with ResultStore(args.db, create=False) as store:
            run = store.get_run(args.run_id, outputs=True)
    except _errors() as e:
        return _fail(e)
    if args.json:
        from pagedlab.lab.store import jsonable

        print(json.dumps(jsonable(run), indent=2))
        return 0
    print(f"run {run['run_id']}  experiment {run['experiment']}  status {run['status']}")
    print(f"model {run['model']}  repeat {run['repeat']}  seed {run['seed']}  host {run['host']}")
    print(f"started {run['started_at']}  finished {run['finished_at']}  "
          f"({_short_label(run['duration_s'])} s)")
    print(f"run key {run['run_key']}")
    if run["error"]:
        print("\nerror:\n" + run["error"])
    print("\nparams:")
    for k, v in sorted(run["params"].items()):
        print(f"  {k} = {v}")
    print("\nmetrics:")
    for k, v in sorted(run["metrics"].items()):
        print(f"  {k} = {_short_label(v)}")
    m = run.get("manifest") or {}
    if m:
        print("\nmanifest:")
        hw, ver, model, tok, git = (m.get(k) or {} for k in ("hardware", "versions", "model", "tokenizer",
                                                             "git"))
        gpus = ", ".join(g["name"] for g in hw.get("gpus") or []) or "none"
        print(f"  hardware: {hw.get('cpu')} x{hw.get('cpu_count')}, GPUs: {gpus}, driver {hw.get('driver')}, "
              f"CUDA {hw.get('cuda')}")
        print("  versions: " + ", ".join(f"{k} {v}" for k, v in ver.items() if v))
        print(f"  model: {model.get('path')}  config {model.get('config_hash')}  "
              f"weights {model.get('weight_checksum')}")
        print(f"  tokenizer: {tok.get('class')}  {tok.get('checksum')}  chat template "
              f"{tok.get('chat_template_hash')}")
        print(f"  git: {git.get('commit')}{' (dirty)' if git.get('dirty') else ''}  seeds: {m.get('seeds')}")
        if m.get("profile"):
            print(f"  profile: {m['profile']['dir']}  (trace {Path(m['profile']['trace']).name}, "
                  f"kernels.txt, host gap {m['profile']['host_gap_share']})")
    tel = run.get("telemetry") or {}
    if tel:
        print(f"\ntelemetry ({tel.get('backend')}, {tel.get('num_samples')} samples): "
              + ", ".join(f"{k}={_short_label(v)}" for k, v in tel.items()
                          if k not in ("backend", "num_samples", "gpus", "cpu") and v is not None))
    outputs = run.get("outputs") or []
    if outputs and args.outputs > 0:
        print(f"\noutputs (first {min(args.outputs, len(outputs))} of {len(outputs)}):")
        for o in outputs[:args.outputs]:
            print(f"  [{o['idx']}] prompt: {(o['prompt'] or '')[:200]!r}")
            print(f"       output ({o['num_tokens']} tokens, {o['finish_reason']}): "
                  f"{(o['text'] or '')[:200]!r}")
            if o["reference"]:
                print(f"       reference: {o['reference']}")
    return 0


def cmd_results_export(args) -> int:
    from pagedlab.lab.store import ResultStore

    fmt = args.format or (Path(args.out).suffix.lstrip(".") if args.out else "") or "csv"
    out = args.out or f"results.{fmt}"
    try:
        with ResultStore(args.db, create=False) as store:
            n = store.export(out, fmt=fmt, experiment=args.experiment, status=_status(args.status),
                             outputs=args.outputs, manifest=args.manifest)
    except _errors() as e:
        return _fail(e)
    print(f"wrote {n} run(s) to {out}")
    return 0


def cmd_results_import(args) -> int:
    from pagedlab.lab.store import ResultStore
    from pagedlab.lab.unstored import load_record

    try:
        records = [load_record(path) for path in args.files]
        with ResultStore(args.db) as store:
            for path, rec in zip(args.files, records):
                print(f"{path}: run id {store.record_run(rec)} ({rec.status})")
    except (*_errors(), OSError) as e:
        return _fail(e)
    return 0


def cmd_monitor(args) -> int:
    from pagedlab.lab.monitor import run_monitor

    try:
        run_monitor(interval=args.interval, log=args.log, count=args.count,
                    stream=None if args.quiet else sys.stdout, gpu_only=args.gpu_only)
    except BrokenPipeError:  # the reader went away (`| head`): the command's main stops quietly
        raise
    except (ValueError, OSError) as e:
        return _fail(e)
    return 0


def cmd_report(args) -> int:
    from pagedlab.lab.report import build_report

    try:
        page = build_report(args.db, args.out, experiments=args.experiment, title=args.title)
    except _errors() as e:
        return _fail(e)
    print(f"wrote {page}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python -m pagedlab.lab.cli", description="pagedlab research lab")
    subparsers = parser.add_subparsers(dest="command", metavar="{run,results,monitor,report}")
    subparsers.required = True
    register(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as `pagedlab` does
        return reader_gone_exit()


if __name__ == "__main__":
    sys.exit(main())
