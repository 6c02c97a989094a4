"""``LLM.benchmark``: throughput, latency percentiles, memory and GPU telemetry on random prompts.

One timed run submits ``num_prompts`` (default: the batch size) random prompts of ``input_len``
token ids at once, each generating exactly ``output_len`` tokens (``ignore_eos``), and drives the
engine's step loop itself so every token gets a timestamp: TTFT (first token minus arrival),
TPOT (per request, (last - first) / (tokens - 1)), ITL (every gap between consecutive tokens of a
request) and end-to-end latency are reported at P50/P90/P99. Before each run the prefix cache is
reset and the engine's peak counters are zeroed; the prompts differ from run to run.

``BenchmarkResult`` prints a table, ``save(path)`` writes JSON with the provenance manifest,
``to_dataframe()`` gives one row per (batch size, repeat), ``to_store(url)`` files the runs in
the results database.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pagedlab.config import PLAN_FIELDS
from pagedlab.interrupt import stop_reason
from pagedlab.lab.lora import adapter_manifest
from pagedlab.lab.manifest import collect_manifest
from pagedlab.lab.metrics import memory_efficiency
from pagedlab.lab.monitor import GPUMonitor, telemetry_metrics
from pagedlab.lab.profile import profile_subdir, profiled
from pagedlab.lab.store import ResultStore, RunRecord, jsonable
from pagedlab.lora.bench import as_list, round_robin
from pagedlab.lora.request import LoRARequest
from pagedlab.sampling_params import BeamSearchParams, SamplingParams
from pagedlab.scalars import is_value_list, python_numbers, python_scalar
from pagedlab.stats import latency_stats


@dataclass
class BenchmarkRun:
    """The figures of one timed run (one batch size, one repeat)."""

    batch_size: int
    repeat: int
    num_prompts: int
    input_len: int
    output_len: int
    max_num_seqs: int
    use_beam_search: bool
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int  # tokens in the returned outputs (the best beam for beam search)
    engine_generation_tokens: int  # tokens the engine sampled (every beam for beam search)
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt + output) tokens / s
    output_throughput_per_gpu: float
    requests_per_s: float
    latency: dict = field(default_factory=dict)  # ttft/tpot/itl/e2e _p50/_p90/_p99/_mean _ms
    memory: dict = field(default_factory=dict)
    telemetry: dict = field(default_factory=dict)  # GPUMonitor.summary()
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    lora_adapters: int = 0  # distinct LoRA adapters the run's requests used (lora_requests)
    profile: dict | None = None  # pagedlab.lab.profile.save_profile's record, when profiled

    def metrics(self) -> dict:
        """Every figure as one flat dict of scalars (what the results store keeps)."""
        d = {k: v for k, v in dataclasses.asdict(self).items()
             if k not in ("latency", "memory", "telemetry", "profile")}
        d.update(self.latency)
        d.update(self.memory)
        d.update(telemetry_metrics(self.telemetry))
        return d


@dataclass
class BenchmarkResult:
    """The runs of one ``LLM.benchmark`` call, its settings and the provenance manifest;
    ``interrupted``: why a call stopped before its last run (``error.partial_result``), None for
    a whole one."""

    runs: list[BenchmarkRun]
    settings: dict
    manifest: dict
    interrupted: str | None = None

    # ---- views ----------------------------------------------------------------------------
    def to_dataframe(self):
        """One row per (batch size, repeat) with every figure as a column."""
        import pandas as pd

        rows = []
        for run in self.runs:
            row = {"model": self.manifest.get("model", {}).get("name")}
            row.update(run.metrics())
            rows.append(row)
        return pd.DataFrame(rows)

    def summary(self) -> list[dict]:
        """Per batch size: the mean over repeats of the headline figures (and the spread)."""
        out = []
        for b in dict.fromkeys(r.batch_size for r in self.runs):
            runs = [r for r in self.runs if r.batch_size == b]
            tput = [r.output_throughput for r in runs]
            row = {"batch_size": b, "repeats": len(runs), "num_prompts": runs[0].num_prompts,
                   "output_throughput": _mean(tput), "output_throughput_std": _std(tput),
                   "total_throughput": _mean([r.total_throughput for r in runs]),
                   "requests_per_s": _mean([r.requests_per_s for r in runs])}
            for key in runs[0].latency:
                row[key] = _mean([r.latency.get(key) for r in runs])
            for key in ("memory_used_bytes", "memory_total_bytes", "kv_peak_used_bytes", "kv_cache_bytes",
                        "fragmentation_at_peak", "weight_bytes"):
                row[key] = _max([r.memory.get(key) for r in runs])
            out.append(row)
        return out

    def __str__(self) -> str:
        return format_result(self)

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))

    # ---- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The saved form; a partial result's is marked as ``pagedlab bench`` marks a partial
        ``--json``: ``"partial": true`` and ``"interrupted"``."""
        d = {"kind": "pagedlab.benchmark", "version": 1, "settings": self.settings, "manifest": self.manifest,
             "runs": [dataclasses.asdict(r) for r in self.runs], "summary": self.summary()}
        if self.interrupted is not None:
            d.update(partial=True, interrupted=self.interrupted)
        return d

    def save(self, path: str | Path) -> Path:
        """Write the result, its summary and its manifest as JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_jsonable(self.to_dict()), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> BenchmarkResult:
        data = json.loads(Path(path).read_text())
        if data.get("kind") != "pagedlab.benchmark":
            raise ValueError(f"{path} is not a pagedlab benchmark result (no kind: pagedlab.benchmark)")
        return cls([BenchmarkRun(**r) for r in data["runs"]], data["settings"], data["manifest"],
                   data.get("interrupted"))

    def to_store(self, url: str | None = None, experiment: str = "benchmark") -> list[int]:
        """File every run in the results database (see ``pagedlab.lab.store``); returns the run ids.
        Each run's key is a digest of the run, the settings and the manifest, so storing the same
        result again (after a crash part-way, or from its saved file) stores only the runs missing."""
        store = ResultStore(url)
        ids = []
        try:
            store.ensure_experiment(experiment, {"benchmark": self.settings})
            model = self.manifest.get("model", {})
            for run in self.runs:
                params = self._stored_params(run)
                ident = json.dumps(jsonable({"run": dataclasses.asdict(run), "settings": self.settings,
                                             "manifest": self.manifest}), sort_keys=True)
                key = f"{experiment}:{hashlib.sha256(ident.encode()).hexdigest()[:32]}"
                rid = store.record_run(RunRecord(
                    experiment=experiment, run_key=key, params=params, metrics=run.metrics(),
                    manifest=self.manifest, telemetry=run.telemetry, repeat=run.repeat,
                    seed=self.settings.get("seed"), model=model.get("name"), status="finished"))
                ids.append(rid)
        finally:
            store.close()
        return ids

    def _stored_params(self, run: BenchmarkRun) -> dict:
        """The params ``to_store`` files ``run`` under: what set it up, so that benchmarks filed by
        separate calls into one experiment (an ablation over block_size, two temperatures) stay apart
        in ``load_results`` and the report. The engine's settings are those it ran with (the
        manifest's); max_num_seqs is left out, the benchmark sets it per batch size."""
        engine = self.manifest.get("engine", {})
        params = {"model": self.manifest.get("model", {}).get("name"), "engine.dtype": engine.get("dtype")}
        params.update({f"engine.{k}": engine[k] for k in _STORED_ENGINE_FIELDS if k in engine})
        params.update({"benchmark.batch_size": run.batch_size, "benchmark.input_len": run.input_len,
                       "benchmark.output_len": run.output_len, "benchmark.num_prompts": run.num_prompts,
                       "benchmark.use_beam_search": run.use_beam_search})
        params.update({f"benchmark.{k}": self.settings[k] for k in _STORED_SETTINGS if k in self.settings})
        if not run.use_beam_search:
            params.pop("benchmark.beam_width", None)
        params["varied"] = ["benchmark.batch_size"] if len(self.settings["batch_size"]) > 1 else []
        return params


# What ``to_store`` records of the engine and of the benchmark's settings besides the batch shape.
_STORED_ENGINE_FIELDS = tuple(k for k in PLAN_FIELDS if k != "max_num_seqs") + (
    "quantization", "tensor_parallel_size")
_STORED_SETTINGS = ("warmup", "temperature", "beam_width", "detokenize")


def _mean(values):
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _std(values):
    vals = [v for v in values if v is not None]
    if len(vals) < 2:
        return None
    m = sum(vals) / len(vals)
    return math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def _max(values):
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _jsonable(obj):
    """Replace NaN and infinities (not JSON) with None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


# ---- printing -------------------------------------------------------------------------------------
def _fmt(value, spec="{:.1f}", missing="-"):
    return missing if value is None else spec.format(value)


def _gb(nbytes):
    return None if nbytes is None else nbytes / 1e9


def format_result(result: BenchmarkResult) -> str:
    s, m = result.settings, result.manifest
    engine, model = m.get("engine", {}), m.get("model", {})
    gpus = m.get("hardware", {}).get("gpus") or []
    where = gpus[0]["name"] if gpus else f"CPU ({m.get('hardware', {}).get('cpu', '?')})"
    mode = f"beam search (width {s.get('beam_width')})" if s.get("use_beam_search") else (
        "greedy" if not s.get("temperature") else f"temperature {s.get('temperature')}")
    loras = f", {len(s['lora_requests'])} LoRA adapter(s) round-robin" if s.get("lora_requests") else ""
    lines = [f"pagedlab benchmark: {model.get('name')} ({engine.get('dtype')}, {where}), "
             f"input {s.get('input_len')} / output {s.get('output_len')} tokens, {mode}{loras}, "
             f"{s.get('repeats')} repeat(s)"]
    header = ["batch", "reqs", "out tok/s", "total tok/s", "req/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
              "ITL p50/p99 ms", "E2E p50/p99 ms", "KV peak GB", "frag", "memory GB"]
    rows = []
    for r in result.summary():
        rows.append([
            str(r["batch_size"]), str(r["num_prompts"]),
            _fmt(r["output_throughput"])
            + (f"±{r['output_throughput_std']:.1f}" if r["output_throughput_std"] else ""),
            _fmt(r["total_throughput"]), _fmt(r["requests_per_s"], "{:.2f}"),
            f"{_fmt(r.get('ttft_p50_ms'))}/{_fmt(r.get('ttft_p99_ms'))}",
            f"{_fmt(r.get('tpot_p50_ms'), '{:.2f}')}/{_fmt(r.get('tpot_p99_ms'), '{:.2f}')}",
            f"{_fmt(r.get('itl_p50_ms'), '{:.2f}')}/{_fmt(r.get('itl_p99_ms'), '{:.2f}')}",
            f"{_fmt(r.get('e2e_p50_ms'))}/{_fmt(r.get('e2e_p99_ms'))}",
            _fmt(_gb(r["kv_peak_used_bytes"]), "{:.3f}"), _fmt(r["fragmentation_at_peak"], "{:.1%}"),
            f"{_fmt(_gb(r['memory_used_bytes']))}/{_fmt(_gb(r['memory_total_bytes']), '{:.0f}')}",
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)
    for r in result.summary():
        lines.append(f"batch {r['batch_size']}: Throughput: {_fmt(r['output_throughput'], '{:.0f}')} "
                     f"tokens/s, Memory usage: {_fmt(_gb(r['memory_used_bytes']))}/"
                     f"{_fmt(_gb(r['memory_total_bytes']), '{:.0f}')}GB")
    return "\n".join(lines)


# ---- running --------------------------------------------------------------------------------------
def random_prompts(llm, num: int, length: int, seed) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly from the vocabulary without EOS and
    the tokenizer's special tokens."""
    import numpy as np

    info = llm.get_engine_info()
    vocab = int(info.hf_config.vocab_size)
    forbidden = set(info.eos_token_ids)
    if info.tokenizer is not None:
        forbidden.update(getattr(info.tokenizer, "all_special_ids", []) or [])
    allowed = np.setdiff1d(np.arange(vocab), np.fromiter(forbidden, dtype=np.int64, count=len(forbidden)))
    rng = np.random.default_rng(seed)
    return rng.choice(allowed, size=(num, length)).tolist()


def _checked_args(llm, batch_size, input_len, output_len, num_prompts, warmup, repeats) -> tuple:
    """The arguments as Python numbers (numpy ones from a sweep too, ``pagedlab.scalars``), the
    batch sizes as a list; a bad one is a ValueError naming it."""
    def bad(name, value, allowed):
        raise ValueError(f"{name}={value!r} is invalid: {name} must be {allowed}")

    batch_sizes = python_numbers(batch_size if is_value_list(batch_size) else [batch_size])
    input_len, output_len, num_prompts, warmup, repeats = map(
        python_scalar, (input_len, output_len, num_prompts, warmup, repeats))
    if not batch_sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batch_sizes):
        bad("batch_size", batch_sizes, "a positive integer or a list of them")
    if not isinstance(input_len, int) or input_len < 1:
        bad("input_len", input_len, "an integer >= 1")
    if not isinstance(output_len, int) or output_len < 1:
        bad("output_len", output_len, "an integer >= 1")
    if num_prompts is not None and (not isinstance(num_prompts, int) or num_prompts < 1):
        bad("num_prompts", num_prompts, "None (one batch) or an integer >= 1")
    if not isinstance(warmup, int) or warmup < 0:
        bad("warmup", warmup, "an integer >= 0")
    if not isinstance(repeats, int) or repeats < 1:
        bad("repeats", repeats, "an integer >= 1")
    max_len = llm.get_engine_info().max_model_len
    if input_len + output_len > max_len:
        raise ValueError(f"input_len + output_len = {input_len + output_len} is invalid: it must be at most "
                         f"max_model_len ({max_len})")
    return batch_sizes, input_len, output_len, num_prompts, warmup, repeats


def run_benchmark(llm, batch_size: int | Sequence[int] = (4, 8, 16), input_len: int = 512,
                  output_len: int = 128,
                  num_prompts: int | None = None, use_beam_search: bool = False, warmup: int = 1,
                  repeats: int = 1, *, beam_width: int = 4, temperature: float = 0.0, seed: int = 0,
                  detokenize: bool = True, monitor: bool = True, monitor_interval: float = 0.2,
                  progress: bool = False, profile_dir: str | Path | None = None,
                  lora_requests: LoRARequest | Sequence[LoRARequest] | None = None) -> BenchmarkResult:
    """Benchmark ``llm`` at each batch size (see the module docstring).

    For a batch size ``b`` the engine runs at most ``b`` sequences at once: ``max_num_seqs`` is set
    to ``b`` (through ``set_model_args``, weights kept) when ``num_prompts`` exceeds ``b`` or the
    engine's own limit is below ``b``, and restored afterwards. ``warmup`` untimed runs of the same
    shape precede the ``repeats`` timed ones. ``temperature`` > 0 samples with per-request seeds
    derived from ``seed``. ``profile_dir`` profiles each timed run into ``bs<B>-r<R>`` there (see
    ``pagedlab.lab.profile``; the run's ``profile`` holds the record). ``lora_requests`` (one
    ``LoRARequest`` or a list; LLM with ``enable_lora``): prompt ``i`` of a run runs adapter ``i mod
    len``; runs record how many they used, the manifest each adapter's config and checksum."""
    batch_sizes, input_len, output_len, num_prompts, warmup, repeats = _checked_args(
        llm, batch_size, input_len, output_len, num_prompts, warmup, repeats)
    beam_width, temperature, seed = map(python_scalar, (beam_width, temperature, seed))
    if llm.llm_engine.has_unfinished_requests():
        raise RuntimeError("the engine has unfinished requests: benchmark an idle LLM")
    adapters = _read_adapters(llm, lora_requests)
    sampling = _sampling(use_beam_search, beam_width, output_len, temperature, seed, detokenize)
    settings = {"batch_size": batch_sizes, "input_len": input_len, "output_len": output_len,
                "num_prompts": num_prompts, "use_beam_search": use_beam_search, "beam_width": beam_width,
                "warmup": warmup, "repeats": repeats, "temperature": temperature, "seed": seed,
                "detokenize": detokenize, "monitor_interval": monitor_interval if monitor else None,
                "lora_requests": [dataclasses.asdict(a) for a in adapters]}
    original_max_seqs = llm.get_engine_info().config.max_num_seqs
    runs: list[BenchmarkRun] = []
    progress_bar = _progress_bar(len(batch_sizes) * (warmup + repeats), progress)
    try:
        for b in batch_sizes:
            n = num_prompts or b
            wanted = b if (n > b or original_max_seqs < b) else original_max_seqs
            if llm.get_engine_info().config.max_num_seqs != wanted:
                llm.set_model_args(max_num_seqs=wanted)
            for phase in range(warmup + repeats):
                prompts = random_prompts(llm, n, input_len, [seed, b, phase])
                timed_dir = None if profile_dir is None or phase < warmup else \
                    profile_subdir(profile_dir, f"bs{b}-r{phase - warmup}")
                with profiled(llm, timed_dir) if timed_dir else contextlib.nullcontext() as record:
                    timed = _timed_run(llm, prompts, round_robin(adapters, n) if adapters else None, sampling,
                                       use_beam_search, monitor and phase >= warmup, monitor_interval)
                if phase >= warmup:
                    runs.append(_make_run(llm, timed, b, phase - warmup, n, input_len, output_len,
                                          use_beam_search))
                    runs[-1].profile, runs[-1].lora_adapters = record, min(n, len(adapters))
                progress_bar.update(1)
        # While the last batch size's plan is still active, so one batch size is recorded exactly.
        manifest = _manifest(llm, sampling, seed, adapters)
    except BaseException as e:
        _keep_finished(e, runs, settings, lambda: _manifest(llm, sampling, seed, adapters))
        raise
    finally:
        progress_bar.close()
        if llm.get_engine_info().config.max_num_seqs != original_max_seqs:
            llm.set_model_args(max_num_seqs=original_max_seqs)
    return BenchmarkResult(runs, settings, manifest)


def _sampling(use_beam_search, beam_width, output_len, temperature, seed, detokenize):
    if use_beam_search:
        return BeamSearchParams(beam_width=beam_width, max_tokens=output_len, ignore_eos=True)
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature,
                          seed=seed if temperature > 0 else None, detokenize=detokenize)


def _read_adapters(llm, lora_requests) -> list[LoRARequest]:
    """The distinct adapters of ``lora_requests`` (none: []), each read now, so that a bad one
    (or LoRA not enabled) fails before any run."""
    if lora_requests is None:
        return []
    adapters = list(dict.fromkeys(as_list(lora_requests)))
    for adapter in adapters:
        llm.llm_engine.validate_lora_request(adapter)
    return adapters


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Benchmark", unit="run", dynamic_ncols=True, disable=not enabled)


def _manifest(llm, sampling, seed, adapters: list[LoRARequest]) -> dict:
    manifest = collect_manifest(llm, sampling_params=sampling, seeds={"benchmark_prompts": seed})
    manifest.update({"lora": [adapter_manifest(llm, a) for a in adapters]} if adapters else {})
    return manifest


def _keep_finished(error: BaseException, runs: list[BenchmarkRun], settings: dict, manifest) -> None:
    """Nothing finished is lost: a benchmark stopped part-way (out of memory at its largest batch
    size, Ctrl-C) raises with the runs it had finished as ``error.partial_result``, a
    ``BenchmarkResult`` (its manifest from ``manifest()``, {} where even that fails)."""
    if not runs:
        return
    try:
        collected = manifest()
    except Exception:  # the engine may be what failed
        collected = {}
    error.partial_result = BenchmarkResult(list(runs), settings, collected, stop_reason(error))
    error.add_note(f"LLM.benchmark: the {len(runs)} run(s) finished before this error are in its "
                   "partial_result, a BenchmarkResult (print, save(path), to_store(url))")


@dataclass
class _Timed:
    elapsed: float
    token_times: list[list[float]]  # per request, the wall time each output token was returned
    arrival: float
    output_tokens: int
    stats: object  # EngineStats after the run
    peak_allocated: int | None
    peak_reserved: int | None
    device_total: int | None
    telemetry: dict


def _timed_run(llm, prompts, loras, sampling, use_beam_search, monitor, monitor_interval) -> _Timed:
    import torch

    device = llm.get_engine_info().device
    cuda = device.type == "cuda"
    llm.reset_prefix_cache()
    llm.reset_stats()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    mon = GPUMonitor(interval=monitor_interval).start() if monitor else None
    try:
        t0, arrival = time.perf_counter(), time.time()
        if use_beam_search:
            outputs = llm.beam_search(prompts, sampling, lora_request=loras)
            token_times = [[] for _ in prompts]
            output_tokens = sum(len(o.sequences[0].tokens) - len(p) for o, p in zip(outputs, prompts))
        else:
            token_times = _drive_engine(llm.llm_engine, prompts, loras, sampling, arrival)
            output_tokens = sum(len(t) for t in token_times)
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
    finally:
        telemetry = mon.stop() if mon is not None else {}
        if mon is not None:
            mon.close()
    peak_alloc = peak_reserved = total = None
    if cuda:
        peak_alloc = int(torch.cuda.max_memory_allocated(device))
        peak_reserved = int(torch.cuda.max_memory_reserved(device))
        total = int(torch.cuda.mem_get_info(device)[1])
    return _Timed(elapsed, token_times, arrival, output_tokens, llm.get_stats(), peak_alloc, peak_reserved,
                  total, telemetry)


def _drive_engine(engine, prompts, loras, params, arrival) -> list[list[float]]:
    """Add every prompt at once (prompt ``i`` under ``loras[i]``, if given, and with seeded
    sampling at ``params.seed + i``, so requests draw independent noise) and step until all
    finish, stamping each returned token."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}-"
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    token_times: list[list[float]] = [[] for _ in prompts]
    try:
        for i, (rid, prompt, lora) in enumerate(zip(ids, prompts, loras or [None] * len(prompts))):
            seeded = params.clone(seed=params.seed + i) if params.seed is not None else params
            engine.add_request(rid, prompt, seeded, arrival_time=arrival, lora_request=lora)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.time()
            for out in outputs:
                i = index.get(out.request_id)
                if i is None:
                    continue
                new = len(out.outputs[0].token_ids) - len(token_times[i])
                token_times[i].extend([now] * new)
    finally:
        for rid in ids:
            engine.abort_request(rid)
    return token_times


def _make_run(llm, t: _Timed, batch_size, repeat, num_prompts, input_len, output_len, beam) -> BenchmarkRun:
    info = llm.get_engine_info()
    stats = t.stats
    prompt_tokens = num_prompts * input_len
    if beam:
        latency = {**latency_stats([t.elapsed] * num_prompts, "e2e")}
        for name in ("ttft", "tpot", "itl"):
            latency.update(latency_stats([], name))
    else:
        ttft = [tt[0] - t.arrival for tt in t.token_times if tt]
        tpot = [(tt[-1] - tt[0]) / (len(tt) - 1) for tt in t.token_times if len(tt) > 1]
        itl = [b - a for tt in t.token_times for a, b in itertools.pairwise(tt)]
        e2e = [tt[-1] - t.arrival for tt in t.token_times if tt]
        latency = {**latency_stats(ttft, "ttft"), **latency_stats(tpot, "tpot"), **latency_stats(itl, "itl"),
                   **latency_stats(e2e, "e2e")}
    bytes_per_block = stats.kv_cache_bytes // stats.num_kv_blocks if stats.num_kv_blocks else 0
    telemetry = t.telemetry
    nvml_peak = telemetry.get("max_gpu_memory_used_bytes") if telemetry else None
    host = (telemetry or {}).get("cpu") or {}
    if info.device.type == "cuda":
        used = nvml_peak if nvml_peak is not None else t.peak_reserved
        total = t.device_total
    else:
        used, total = host.get("max_rss_bytes"), host.get("ram_total_bytes")
    memory = {
        "weight_bytes": stats.weight_bytes, "kv_cache_bytes": stats.kv_cache_bytes,
        "num_kv_blocks": stats.num_kv_blocks, "block_size": stats.block_size,
        "kv_peak_blocks": stats.peak_kv_blocks_used,
        "kv_peak_used_bytes": stats.peak_kv_blocks_used * bytes_per_block,
        "kv_tokens_at_peak": stats.kv_tokens_at_peak, "fragmentation_at_peak": stats.fragmentation_at_peak,
        "peak_allocated_bytes": t.peak_allocated, "peak_reserved_bytes": t.peak_reserved,
        "nvml_peak_used_bytes": nvml_peak, "memory_used_bytes": used, "memory_total_bytes": total,
        **memory_efficiency(stats.weight_bytes, stats.kv_cache_bytes,
                            stats.peak_kv_blocks_used * bytes_per_block, t.peak_reserved),
    }
    gpus = max(1, info.config.tensor_parallel_size)
    elapsed = max(t.elapsed, 1e-9)
    return BenchmarkRun(
        batch_size=batch_size, repeat=repeat, num_prompts=num_prompts, input_len=input_len,
        output_len=output_len,
        max_num_seqs=info.config.max_num_seqs, use_beam_search=beam, elapsed_s=t.elapsed,
        prompt_tokens=prompt_tokens, output_tokens=t.output_tokens,
        engine_generation_tokens=stats.generation_tokens,
        output_throughput=t.output_tokens / elapsed,
        total_throughput=(prompt_tokens + t.output_tokens) / elapsed,
        output_throughput_per_gpu=t.output_tokens / elapsed / gpus, requests_per_s=num_prompts / elapsed,
        latency=latency, memory=memory, telemetry=telemetry,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate, num_preemptions=stats.num_preemptions)
