"""Running an experiment: the pending runs, grouped so each model loads once, each run stored with
its metrics, outputs, telemetry and manifest in one transaction when it ends.

Runs are grouped by their weight-level engine settings (``pagedlab.config.WEIGHT_FIELDS``:
model, dtype, device, ...); within a group the plan-level ones (``PLAN_FIELDS``: block_size,
max_num_seqs, ...) change through ``LLM.set_model_args``, which keeps the weights. An interrupted
experiment resumes where it stopped: a rerun skips the runs already finished.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pagedlab.config import ENGINE_DEFAULTS, PLAN_FIELDS, WEIGHT_FIELDS
from pagedlab.lab.bench import run_benchmark
from pagedlab.lab.lora import adapter_manifest, lora_engine_args, lora_request
from pagedlab.lab.manifest import collect_manifest
from pagedlab.lab.metrics import RunResult, compute_metrics
from pagedlab.lab.monitor import GPUMonitor, telemetry_metrics
from pagedlab.lab.profile import profiled
from pagedlab.lab.runs import ResolvedRun, expand_runs, format_plan
from pagedlab.lab.schema import ExperimentSpec
from pagedlab.lab.store import ResultStore, RunRecord
from pagedlab.lab.unstored import record_or_save
from pagedlab.lab.weights import legacy_renames
from pagedlab.llm import LLM
from pagedlab.sampling_params import SamplingParams


@dataclass
class ExperimentReport:
    """What ``run_experiment`` did."""

    name: str
    total: int
    skipped: int = 0
    finished: list[int] = field(default_factory=list)  # run ids stored
    failed: list[tuple[str, str]] = field(default_factory=list)  # (run label, error)
    model_loads: list[dict] = field(default_factory=list)  # {"group", "seconds"}
    replans: int = 0
    replan_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class RunSession:
    """What the runs of one experiment (or of one group, in a Ray worker) share: the spec, the
    store, the report and the progress."""

    spec: ExperimentSpec
    store: ResultStore
    report: ExperimentReport
    quiet: bool
    bar: Any = None  # a tqdm progress bar, or None
    profile_dir: str | None = None  # profile each run into a directory of its own here

    def profile_dir_of(self, run: ResolvedRun) -> Path | None:
        """Where ``run``'s profile goes: ``<profile_dir>/<experiment>/run<index>-<key digest>``."""
        if self.profile_dir is None:
            return None
        return Path(self.profile_dir) / self.spec.name / f"run{run.index}-{run.run_key.split(':')[-1][:12]}"

    def log(self, msg: str) -> None:
        _log(msg, self.quiet)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        from tqdm.auto import tqdm

        tqdm.write(msg, file=sys.stderr)


def run_experiment(spec: ExperimentSpec, db: str | None = None, dry_run: bool = False, quiet: bool = False,
                   llm_factory: Callable[..., Any] | None = None,
                   run_groups: Callable[[RunSession, list[list[ResolvedRun]]], None] | None = None,
                   profile_dir: str | None = None) -> ExperimentReport:
    """Execute the pending runs of ``spec`` and store each in the database at ``db``.

    Runs are grouped by their weight-level settings (model, dtype, quantization, device, ...):
    each group loads its model once, and runs within it switch plan-level settings through
    ``LLM.set_model_args``. ``dry_run`` prints the plan and executes nothing.
    ``llm_factory(model, **engine_kwargs)`` builds the LLM (default ``pagedlab.LLM``).
    ``run_groups(session, groups)`` executes the pending groups (default: one after the other
    here; ``pagedlab.lab.ray_runner`` spreads them over a Ray cluster). ``profile_dir``: profile
    each run (``pagedlab.lab.profile``) into a directory of its own there, referenced from the
    run's manifest (``profile``).
    """
    t_start = time.perf_counter()
    runs = expand_runs(spec)
    report = ExperimentReport(spec.name, len(runs))
    if dry_run:
        return _dry_run(spec, runs, db, report, quiet)
    with ResultStore(db) as store:
        store.ensure_experiment(spec.name, spec.to_dict())
        store.rekey_runs(legacy_renames(store, spec.name, runs))
        done = store.finished_keys(spec.name)
        pending = [r for r in runs if r.run_key not in done]
        report.skipped = len(runs) - len(pending)
        if report.skipped:
            _log(f"{spec.name}: {report.skipped} of {len(runs)} runs already finished in {store.safe_url()}; "
                 "skipping them", quiet)
        groups: dict[str, list[ResolvedRun]] = {}
        for run in pending:
            groups.setdefault(run.group_key, []).append(run)
        session = RunSession(spec, store, report, quiet,
                             None if quiet else _progress_bar(spec.name, len(pending)), profile_dir)
        try:
            if run_groups is None:
                run_groups = functools.partial(run_groups_here, llm_factory=llm_factory or LLM)
            run_groups(session, list(groups.values()))
        finally:
            if session.bar is not None:
                session.bar.close()
    report.elapsed_s = time.perf_counter() - t_start
    _log(format_summary(report), quiet and report.ok)  # failures are reported even when quiet
    return report


def run_groups_here(session: RunSession, groups: list[list[ResolvedRun]],
                    llm_factory: Callable[..., Any] = LLM) -> None:
    """Execute the groups one after the other in this process."""
    for group_runs in groups:
        run_group(session, group_runs, llm_factory)


def _progress_bar(name: str, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=name, unit="run", dynamic_ncols=True, file=sys.stderr)


def _dry_run(spec: ExperimentSpec, runs: list[ResolvedRun], db: str | None, report: ExperimentReport,
             quiet: bool) -> ExperimentReport:
    done: set[str] = set()
    try:
        with ResultStore(db, create=False) as store:
            done = store.finished_keys(spec.name)
            renames = legacy_renames(store, spec.name, runs)
        done |= {renames[k] for k in done if k in renames}  # rekeyed when they execute
    except FileNotFoundError:
        pass  # no database yet: every run is pending
    except Exception as e:  # a dry run still shows the plan without a database
        _log(f"(results database not readable: {e})", quiet)
    print(format_plan(spec, runs, done))
    report.skipped = sum(r.run_key in done for r in runs)
    return report


def run_group(session: RunSession, group_runs: list[ResolvedRun], llm_factory: Callable[..., Any]) -> None:
    """Load the group's model once and execute its runs, switching plans between them."""
    # Order runs so consecutive ones share plan settings (fewer re-plans); stable otherwise.
    group_runs = sorted(group_runs, key=lambda r: json.dumps(r.plan_args, sort_keys=True, default=str))
    llm, group_runs = _load_group(session, group_runs, llm_factory)
    if llm is None:
        return
    try:
        for run in group_runs:
            if session.store.is_finished(run.run_key):  # another process finished it meanwhile
                session.report.skipped += 1
            else:
                _run_one(session, run, llm)
            session.advance()
    finally:
        llm.close()


def _load_group(session: RunSession, group_runs: list[ResolvedRun], llm_factory: Callable[..., Any]):
    """The group's LLM, built with its first run's plan, and the runs left to execute on it. A
    load that fails fails the runs of that plan only; the next plan is tried, since a plan the
    engine cannot build (a KV cache too small for one sequence) must not fail the other runs."""
    adapters = [r.config.get("lora") for r in group_runs]
    engine_kwargs = lora_engine_args(adapters, dict(group_runs[0].config["engine"]))
    weight_args = ", ".join(f"{k}={v}" for k, v in engine_kwargs.items() if k in WEIGHT_FIELDS)
    label = f"{Path(group_runs[0].config['model']).name} ({weight_args or 'defaults'})"
    session.log(f"loading {label} for {len(group_runs)} run(s)")
    while group_runs:
        first = group_runs[0]
        engine_kwargs = lora_engine_args(adapters, dict(first.config["engine"]))
        t0 = time.perf_counter()
        try:
            llm = llm_factory(first.config["model"], **engine_kwargs)
        except Exception as e:
            msg = f"loading the model failed: {type(e).__name__}: {e}"
            for run in [r for r in group_runs if r.plan_args == first.plan_args]:
                store_failure(session, run, msg, None)
                session.advance()
            group_runs = [r for r in group_runs if r.plan_args != first.plan_args]
            session.log(f"{label}: {msg}" + ("; trying the next plan" if group_runs else ""))
            continue
        session.report.model_loads.append({"group": label, "seconds": time.perf_counter() - t0})
        return llm, group_runs
    return None, []


def _replan(session: RunSession, run: ResolvedRun, llm) -> float:
    """Switch ``llm`` to the run's plan-level settings; the seconds it took (0 when unchanged)."""
    current = llm.get_engine_info().config
    wanted = {k: run.plan_args.get(k, ENGINE_DEFAULTS[k]) for k in PLAN_FIELDS}
    changes = {k: v for k, v in wanted.items() if getattr(current, k) != v}
    if not changes:
        return 0.0
    t = time.perf_counter()
    llm.set_model_args(**changes)
    replan_s = time.perf_counter() - t
    session.report.replans += 1
    session.report.replan_s += replan_s
    return replan_s


def _run_one(session: RunSession, run: ResolvedRun, llm) -> None:
    """Execute one run and store it (finished, or failed with its traceback). A run the store
    cannot take is saved to a file and stops the sweep (``pagedlab.lab.unstored``)."""
    spec = session.spec
    started = datetime.now(timezone.utc)
    planned = None  # llm once it holds this run's plan (a failed re-plan restores the previous run's)
    try:
        replan_s = _replan(session, run, llm)
        planned = llm
        metrics, outputs, telemetry, samples, manifest = _execute(spec, run, llm, session.profile_dir_of(run))
        metrics["replan_s"] = replan_s
        metrics["model_parameters"] = (manifest.get("model") or {}).get("parameters")
    except KeyboardInterrupt:
        raise
    except Exception as e:
        # a failed re-plan's manifest has no engine, as a failed load's, not the previous run's plan
        msg = f"{'' if planned is not None else 're-planning failed: '}{type(e).__name__}: {e}"
        store_failure(session, run, msg, planned, started, traceback.format_exc())
        session.log(f"{run_label(run)} failed: {msg}")
        return
    run_id = record_or_save(session.store, RunRecord(
        experiment=spec.name, run_key=run.run_key, params=run.params(), metrics=metrics, manifest=manifest,
        telemetry=telemetry, telemetry_samples=samples, outputs=outputs if spec.store_outputs else [],
        repeat=run.repeat, seed=run.seed, model=run.config["model"], status="finished",
        started_at=started, finished_at=datetime.now(timezone.utc)), run_label(run))
    session.report.finished.append(run_id)
    session.log(f"run {run.index} ({run.label()}, repeat {run.repeat}, seed {run.seed}): "
                f"{_headline(metrics)} -> run id {run_id}")


def _headline(metrics: dict) -> str:
    keys = ("exact_match", "bleu", "chrf", "output_throughput", "ttft_p50_ms", "mean_output_tokens")
    parts = []
    for k in keys:
        v = metrics.get(k)
        if v is not None:
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return ", ".join(parts)


def run_label(run: ResolvedRun) -> str:
    """How the report names ``run``: its index, its swept settings and its repeat."""
    return f"run {run.index} ({run.label()}, repeat {run.repeat})"


def store_failure(session: RunSession, run: ResolvedRun, msg: str, llm, started=None, tb=None) -> None:
    """Store ``run`` as failed with ``msg`` (and the traceback ``tb``), and report it."""
    session.report.failed.append((run_label(run), msg))
    try:
        manifest = collect_manifest(llm, sampling_params=run.sampling_params or None, hash_weights=False)
    except Exception:
        manifest = {}
    record_or_save(session.store, RunRecord(
        experiment=session.spec.name, run_key=run.run_key, params=run.params(), metrics={}, manifest=manifest,
        repeat=run.repeat, seed=run.seed, model=run.config["model"], status="failed",
        error=msg + ("\n\n" + tb if tb else ""), started_at=started), run_label(run))


def _execute(spec: ExperimentSpec, run: ResolvedRun, llm, profile_dir: Path | None = None):
    """Run one resolved run on ``llm``: (metrics, outputs, telemetry summary, samples, manifest);
    with ``profile_dir``, under the profiler, its record in the manifest's ``profile``."""
    if run.config.get("benchmark") is not None:
        return _execute_benchmark(spec, run, llm, profile_dir)
    params = SamplingParams(**run.sampling_params)
    with profiled(llm, profile_dir) if profile_dir else contextlib.nullcontext() as profile:
        result, telemetry, samples = _generate(spec, run, llm, params)
    metrics = compute_metrics(spec.metrics, result)
    metrics.update(telemetry_metrics(telemetry))
    outputs = [_output_record(it, o) for it, o in zip(run.dataset.items, result.outputs)]
    experiment = {"name": spec.name, "file": str(spec.path) if spec.path else None, "run_key": run.run_key,
                  "weights": run.weights, "dataset_sha256": run.dataset.sha256}
    extra = {"experiment": experiment, **({"profile": profile} if profile else {})}
    adapter = lora_request(run.config.get("lora"))
    if adapter is not None:
        extra["lora"] = adapter_manifest(llm, adapter)
    manifest = collect_manifest(llm, sampling_params=params, seeds={"sampling": run.seed}, extra=extra)
    return metrics, outputs, telemetry, samples, manifest


def _generate(spec: ExperimentSpec, run: ResolvedRun, llm, params: SamplingParams):
    """Generate the run's dataset on a fresh cache and zeroed counters, timed and monitored."""
    import torch

    ds = run.dataset
    adapter = lora_request(run.config.get("lora"))
    device = llm.get_engine_info().device
    llm.reset_prefix_cache()
    llm.reset_stats()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    mon = GPUMonitor(interval=spec.monitor_interval).start() if spec.monitor_interval is not None else None
    try:
        t0 = time.perf_counter()
        if ds.chat:
            conversations = [([{"role": "system", "content": ds.system}] if ds.system else [])
                             + [{"role": "user", "content": it.prompt}] for it in ds.items]
            outs = llm.chat(conversations, params, use_tqdm=False, lora_request=adapter)
        else:
            prompts = [it.prompt_token_ids if it.prompt_token_ids is not None else it.prompt
                       for it in ds.items]
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapter)
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
    finally:
        telemetry, samples = _stop_monitor(mon)
    peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    reserved = int(torch.cuda.max_memory_reserved(device)) if cuda else None
    result = RunResult(outs, ds.items, elapsed, llm.get_stats(), peak, reserved,
                       llm.get_engine_info().config.tensor_parallel_size)
    return result, telemetry, samples


def _output_record(item, output) -> dict:
    """What the store keeps of one output: prompt, reference, text, tokens and timings."""
    first = output.outputs[0]
    m = output.metrics
    extra = {}
    if m is not None and m.first_token_time is not None:
        extra["ttft_ms"] = (m.first_token_time - m.arrival_time) * 1000
    if m is not None and m.finished_time is not None:
        extra["e2e_ms"] = (m.finished_time - m.arrival_time) * 1000
    if len(output.outputs) > 1:
        extra["completions"] = [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                                for c in output.outputs[1:]]
    return {"prompt": output.prompt if output.prompt is not None else item.prompt,
            "prompt_tokens": len(output.prompt_token_ids), "reference": item.reference, "text": first.text,
            "token_ids": list(first.token_ids), "finish_reason": first.finish_reason, **extra}


def _execute_benchmark(spec: ExperimentSpec, run: ResolvedRun, llm, profile_dir: Path | None):
    b = run.config["benchmark"]
    result = run_benchmark(llm, batch_size=b["batch_size"], input_len=b["input_len"],
                           output_len=b["output_len"], num_prompts=b["num_prompts"],
                           use_beam_search=b["use_beam_search"], warmup=b["warmup"], repeats=1,
                           beam_width=b["beam_width"], temperature=b["temperature"], seed=run.seed,
                           detokenize=b["detokenize"], monitor=spec.monitor_interval is not None,
                           monitor_interval=spec.monitor_interval or 1.0, profile_dir=profile_dir)
    bench_run = result.runs[0]
    metrics = bench_run.metrics()
    manifest = dict(result.manifest)
    manifest["experiment"] = {"name": spec.name, "file": str(spec.path) if spec.path else None,
                              "run_key": run.run_key, "weights": run.weights}
    if bench_run.profile:
        manifest["profile"] = bench_run.profile
    return metrics, [], bench_run.telemetry, [], manifest


def _stop_monitor(mon) -> tuple[dict, list]:
    if mon is None:
        return {}, []
    summary = mon.stop()
    samples = list(mon.samples)
    mon.close()
    return summary, samples


def format_summary(report: ExperimentReport) -> str:
    """One line of counts and times, then one line per failed run."""
    loads = sum(m["seconds"] for m in report.model_loads)
    lines = [f"{report.name}: {len(report.finished)} run(s) finished, {report.skipped} skipped (already "
             "done), "
             f"{len(report.failed)} failed in {report.elapsed_s:.1f} s; weights loaded "
             f"{len(report.model_loads)} "
             f"time(s) ({loads:.1f} s), {report.replans} re-plan(s) ({report.replan_s:.2f} s)"]
    for label, error in report.failed:
        lines.append(f"  FAILED {label}: {error}")
    return "\n".join(lines)
