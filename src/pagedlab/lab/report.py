"""``pagedlab report``: PNG plots and one self-contained HTML page from the results database.

Plots (each written as a PNG file and embedded in the page as a data URI):

- ``throughput_vs_batch.png``: output tokens/s against batch size (``benchmark.batch_size``, or a
  swept ``engine.max_num_seqs``), one line per model, mean over repeats with the spread as bars;
  without a batch-size sweep, output tokens/s per configuration;
- ``latency.png``: TTFT, TPOT, ITL and end-to-end latency at P50/P90/P99 per configuration;
- ``model_scaling.png`` (a study of several model sizes): the seed's
  ``sns.lineplot(x="batch_size", y="throughput", hue="model_size")`` beside output tokens/s per
  GPU, mean over repeats with a confidence band (a line per configuration within a size class);
- ``memory.png``: weights, KV cache allocated and KV cache used at peak per configuration;
- ``seed_spread.png``: every repeat's value of the quality and speed metrics per configuration;
- ``quality.png``: exact match, BLEU and chrF per configuration (mean and spread).

The page holds a summary table (one row per configuration, mean ± std over repeats), the plots,
every run, and the manifests: fields that differ between runs in a highlighted table (one row
per run), and the fields shared by every run.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pagedlab.lab.manifest import diff_manifests, flatten
from pagedlab.lab.plan import size_class
from pagedlab.lab.store import ResultStore

# Manifest fields that differ for every run by nature; not shown as differences.
_UNINTERESTING = ("created_at", "experiment.run_key")
_QUALITY = ("exact_match", "bleu", "chrf")
_SPEED = ("output_throughput", "ttft_p50_ms", "tpot_p50_ms", "e2e_p50_ms")
_SUMMARY_METRICS = ("exact_match", "bleu", "chrf", "mean_output_tokens", "output_throughput",
                    "output_throughput_per_gpu", "total_throughput", "model_parameters", "memory_efficiency",
                    "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "e2e_p50_ms",
                    "kv_peak_used_bytes", "fragmentation_at_peak", "gpu_max_temperature_c",
                    "gpu_mean_power_w")
_LATENCY_KINDS = (("ttft", "time to first token"), ("tpot", "time per output token"),
                  ("itl", "inter-token latency"), ("e2e", "end-to-end latency"))


@dataclass
class Plot:
    filename: str
    title: str
    caption: str
    png: bytes


def build_report(db: str | None, out_dir: str | Path, experiments: list[str] | None = None,
                 title: str | None = None) -> Path:
    """Write the plots and ``index.html`` into ``out_dir``; returns the page's path."""
    with ResultStore(db, create=False) as store:
        runs = [r for r in store.runs(status="finished", manifest=True)
                if not experiments or r["experiment"] in experiments]
        url = store.safe_url()
        failed = sum(1 for r in store.runs(status="failed", manifest=False)
                     if not experiments or r["experiment"] in experiments)
    if not runs:
        which = f" of experiment(s) {', '.join(experiments)}" if experiments else ""
        raise ValueError(f"no finished runs{which} in {url}: nothing to report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _label_runs(runs)
    plots = [p for p in (_plot_throughput(runs), _plot_model_scaling(runs), _plot_latency(runs),
                         _plot_memory(runs), _plot_seed_spread(runs), _plot_quality(runs)) if p is not None]
    for p in plots:
        (out / p.filename).write_bytes(p.png)
    page = out / "index.html"
    page.write_text(_render_html(runs, plots, url, failed, title or "pagedlab report"), encoding="utf-8")
    return page


# ---- run labels -----------------------------------------------------------------------------------
def short_label(v) -> str:
    """A compact label for a run parameter: a path's last part, a float to 4 digits."""
    if isinstance(v, str) and "/" in v:
        return Path(v).name
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _label_runs(runs: list[dict]) -> None:
    """Give each run ``model_label`` (model, with dtype when dtypes differ), ``model_size`` (its
    size class, e.g. "135M", and parameter count ``model_parameters``), ``labels`` (its varied
    params but the seed, each value's label), ``config`` (those labels joined) and ``group``
    (experiment + config), and ``batch`` when it has one. Labels are short (a path's last part, a
    float to 4 digits) unless that would make two different values of a param look alike."""
    dtypes = {r["params"].get("engine.dtype") or (r.get("manifest") or {}).get("engine", {}).get("dtype")
              for r in runs}
    multi_exp = len({r["experiment"] for r in runs}) > 1
    varied_by_experiment = _varied_keys(runs)
    model_label = _labeller([r["model"] or r["params"].get("model") or "?" for r in runs])
    labellers = {(exp, k): _labeller([r["params"].get(k) for r in runs if r["experiment"] == exp])
                 for exp, keys in varied_by_experiment.items() for k in keys}
    for r in runs:
        p = r["params"]
        dtype = p.get("engine.dtype") or (r.get("manifest") or {}).get("engine", {}).get("dtype")
        r["model_label"] = (model_label(r["model"] or p.get("model") or "?")
                            + (f" ({dtype})" if len(dtypes) > 1 else ""))
        model = (r.get("manifest") or {}).get("model") or {}
        r["model_parameters"] = model.get("parameters") or r["metrics"].get("model_parameters")
        r["model_size"] = model.get("size_class") or size_class(r["model_parameters"])
        varied = varied_by_experiment[r["experiment"]]
        r["labels"] = {k: labellers[r["experiment"], k](p.get(k)) for k in varied}
        r["config"] = ", ".join(f"{k.split('.', 1)[-1]}={v}" for k, v in r["labels"].items()) or "base"
        r["group"] = (f"{r['experiment']}: " if multi_exp else "") + r["config"]
        if p.get("benchmark.batch_size") is not None:
            r["batch"] = p["benchmark.batch_size"]
        elif "engine.max_num_seqs" in varied:
            r["batch"] = p.get("engine.max_num_seqs")
        else:
            r["batch"] = None


def _labeller(values: list) -> Callable[[object], str]:
    """``short_label``, or the whole value where short labels would make two of ``values`` alike
    (checkpoints named alike in different directories, floats equal to 4 digits)."""
    distinct = {json.dumps(v, sort_keys=True, default=str): v for v in values}
    if len({short_label(v) for v in distinct.values()}) == len(distinct):
        return short_label
    return lambda v: v if isinstance(v, str) else json.dumps(v, default=str)


_REPEAT_KEYS = ("repeat", "seed", "sampling.seed", "benchmark.seed")  # what differs between repeats


def _varied_keys(runs: list[dict]) -> dict[str, list[str]]:
    """Per experiment, the params that tell its runs apart: those it declares varied, then any
    other whose value differs between its runs (results filed by separate calls, e.g. one
    benchmark per batch size), the repeat index and seeds left out."""
    params_by_experiment: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        params_by_experiment[r["experiment"]].append(r["params"])
    out = {}
    for experiment, params in params_by_experiment.items():
        keys = list(dict.fromkeys(k for p in params for k in p.get("varied", [])))
        keys += [k for k in dict.fromkeys(k for p in params for k in p)
                 if k not in keys and k != "varied" and len({repr(p.get(k)) for p in params}) > 1]
        out[experiment] = [k for k in keys if k not in _REPEAT_KEYS]
    return out


def _groups(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        out[r["group"]].append(r)
    return dict(out)


def _vals(runs, key):
    return [r["metrics"][key] for r in runs if isinstance(r["metrics"].get(key), (int, float))
            and not isinstance(r["metrics"].get(key), bool) and math.isfinite(r["metrics"][key])]


def _mean_std(values):
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _bar_mean_std(values) -> tuple[float, float]:
    """A bar's length and spread: NaN (no bar) where a configuration has no value, which a bar of
    0 would show as a measured zero (a benchmark's BLEU, a dataset run's ITL)."""
    mean, std = _mean_std(values)
    return (math.nan, math.nan) if mean is None else (mean, std)


# ---- plots ----------------------------------------------------------------------------------------
def _figure(width=8.0, height=4.5, ncols=1, nrows=1):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("the report's plots need matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig, axes


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _wrap(label: str, width: int = 28) -> str:
    words, lines, cur = label.split(", "), [], ""
    for w in words:
        if cur and len(cur) + len(w) + 2 > width:
            lines.append(cur + ",")
            cur = w
        else:
            cur = f"{cur}, {w}" if cur else w
    lines.append(cur)
    return "\n".join(lines)


def _plot_throughput(runs) -> Plot | None:
    have = [r for r in runs if "output_throughput" in r["metrics"]]
    if not have:
        return None
    with_batch = [r for r in have if r["batch"] is not None]
    if with_batch:
        fig, axes = _figure()
        ax = axes[0, 0]
        lines = _throughput_lines(with_batch)
        for name, points in lines.items():
            xs = sorted(x for x in points if _vals(points[x], "output_throughput"))
            stats = [_mean_std(_vals(points[x], "output_throughput")) for x in xs]
            ax.errorbar(xs, [m for m, _ in stats], yerr=[s for _, s in stats], marker="o", capsize=3,
                        label=name)
        ax.set_xscale("log", base=2)
        xs_all = sorted({r["batch"] for r in with_batch})
        ax.set_xticks(xs_all, [str(x) for x in xs_all])
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.set_title("Throughput vs batch size")
        caption = ("Output tokens per second against batch size, one line per model; bars show the spread "
                   "over repeats.")
    else:
        # a configuration whose throughput was never finite (stored as None) has no bar
        groups = {g: members for g, members in _groups(have).items() if _vals(members, "output_throughput")}
        if not groups:
            return None
        fig, axes = _figure(height=max(3.0, 0.45 * len(groups) + 1.5))
        ax = axes[0, 0]
        names = list(groups)
        stats = [_mean_std(_vals(groups[g], "output_throughput")) for g in names]
        ax.barh(range(len(names)), [m for m, _ in stats], xerr=[s for _, s in stats], capsize=3,
                color="#4C72B0")
        ax.set_yticks(range(len(names)), [_wrap(n, 40) for n in names], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("output tokens/s")
        ax.set_title("Throughput per configuration")
        caption = ("Output tokens per second per configuration (no batch-size sweep); bars show the spread "
                   "over repeats.")
    return Plot("throughput_vs_batch.png", "Throughput", caption, _png(fig))


def _throughput_lines(runs) -> dict[str, dict]:
    """The runs of the throughput plot, by line name and batch size: one line per configuration but
    its batch size. A param that equals the batch size in every run of its experiment is the batch
    size by another name (``to_store`` files ``num_prompts``, which defaults to it): it names no line."""
    multi_exp = len({r["experiment"] for r in runs}) > 1
    by_experiment: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_experiment[r["experiment"]].append(r)
    aliases = {(exp, k) for exp, members in by_experiment.items() for k in members[0]["labels"]
               if all(r["params"].get(k) == r["batch"] for r in members)}
    lines: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        extra = ", ".join(f"{k.split('.', 1)[-1]}={v}" for k, v in r["labels"].items()
                          if k not in ("benchmark.batch_size", "engine.max_num_seqs", "model")
                          and (r["experiment"], k) not in aliases)
        name = (r["model_label"] + (f" [{extra}]" if extra else "")
                + (f" ({r['experiment']})" if multi_exp else ""))
        lines[name][r["batch"]].append(r)
    return lines


def _plot_model_scaling(runs) -> Plot | None:
    """The seed's plot, for a study of several model sizes with a batch-size sweep."""
    have = [r for r in runs if r["batch"] is not None and r["model_size"] is not None
            and "output_throughput" in r["metrics"]]
    if len({r["model_size"] for r in have}) < 2:
        return None
    import pandas as pd
    import seaborn as sns

    line_of = {id(r): name for name, points in _throughput_lines(have).items() for rs in points.values()
               for r in rs}
    rows = [{"batch_size": r["batch"], "model_size": r["model_size"], "parameters": r["model_parameters"],
             "configuration": line_of[id(r)], "throughput": r["metrics"]["output_throughput"],
             "throughput_per_gpu": r["metrics"].get("output_throughput_per_gpu",
                                                    r["metrics"]["output_throughput"])} for r in have]
    df = pd.DataFrame(rows)
    order = list(df.sort_values("parameters")["model_size"].drop_duplicates())
    # configurations of one size class (another swept setting, two models of one size) are lines of
    # their own, not one mean with a band over them
    lines = ({"style": "configuration", "markers": True} if df["configuration"].nunique() > len(order)
             else {"marker": "o"})
    fig, axes = _figure(width=11.0, ncols=2)
    for ax, column, label in ((axes[0, 0], "throughput", "output tokens/s"),
                              (axes[0, 1], "throughput_per_gpu", "output tokens/s per GPU")):
        sns.lineplot(data=df, x="batch_size", y=column, hue="model_size", hue_order=order, ax=ax, **lines)
        ax.set_xscale("log", base=2)
        xs = sorted(df["batch_size"].unique())
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{label[0].upper()}{label[1:]} by model size", fontsize=10)
    return Plot("model_scaling.png", "Throughput by model size",
                "Output tokens per second (left) and per GPU (right) against batch size, one line per model "
                "size class (and per other configuration); the band is the confidence interval over repeats.",
                _png(fig))


def _plot_latency(runs) -> Plot | None:
    kinds = [(k, name) for k, name in _LATENCY_KINDS if any(_vals(runs, f"{k}_p50_ms"))]
    if not kinds:
        return None
    groups = _groups(runs)
    names = list(groups)
    nrows = (len(kinds) + 1) // 2
    fig, axes = _figure(width=5.0 * min(2, len(kinds)), height=max(3.2, 0.5 * len(names) + 1.8) * nrows,
                        ncols=min(2, len(kinds)), nrows=nrows)
    colors = {50: "#4C72B0", 90: "#DD8452", 99: "#C44E52"}
    for ax in axes.flat[len(kinds):]:
        ax.set_visible(False)
    for ax, (kind, title) in zip(axes.flat, kinds):
        height = 0.8 / 3
        for j, p in enumerate((50, 90, 99)):
            means = [_bar_mean_std(_vals(groups[g], f"{kind}_p{p}_ms"))[0] for g in names]
            ax.barh([i + (j - 1) * height for i in range(len(names))], means, height=height,
                    color=colors[p], label=f"P{p}")
        ax.set_yticks(range(len(names)), [_wrap(n) for n in names], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    return Plot("latency.png", "Latency percentiles",
                "P50, P90 and P99 of each latency per configuration (mean over repeats).", _png(fig))


def _plot_memory(runs) -> Plot | None:
    keys = (("weight_bytes", "weights", "#4C72B0"), ("kv_cache_bytes", "KV cache allocated", "#55A868"),
            ("kv_peak_used_bytes", "KV cache used at peak", "#DD8452"))
    if not any(_vals(runs, k) for k, _, _ in keys):
        return None
    groups = _groups(runs)
    names = list(groups)
    fig, axes = _figure(height=max(3.0, 0.55 * len(names) + 1.5))
    ax = axes[0, 0]
    height = 0.8 / len(keys)
    scale, unit = _bytes_unit(max(max(_vals(runs, k), default=0) for k, _, _ in keys))
    for j, (key, label, color) in enumerate(keys):
        vals = [max(_vals(groups[g], key), default=math.nan) / scale for g in names]
        ax.barh([i + (j - 1) * height for i in range(len(names))], vals, height=height, label=label,
                color=color)
    for i, g in enumerate(names):
        frag = _vals(groups[g], "fragmentation_at_peak")
        if frag:
            ax.annotate(f"frag {max(frag):.0%}", (0, i + height), xytext=(3, 0), textcoords="offset points",
                        fontsize=7, va="center")
    ax.set_yticks(range(len(names)), [_wrap(n) for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.legend(fontsize=8)
    ax.set_title("Memory")
    return Plot("memory.png", "Memory",
                "Weights, KV cache allocated and KV cache used at the peak, per configuration; 'frag' is the "
                "share of allocated token slots at the peak that held no token.", _png(fig))


def _bytes_unit(largest: float) -> tuple[float, str]:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if largest >= scale:
            return float(scale), unit
    return 1.0, "bytes"


def _plot_seed_spread(runs) -> Plot | None:
    groups = _groups(runs)
    if not any(len(g) > 1 for g in groups.values()):
        return None
    # metrics that actually vary between the repeats of some configuration
    metrics = [m for m in _QUALITY + _SPEED if any(len(set(_vals(g, m))) > 1 for g in groups.values())][:4]
    if not metrics:
        return None
    names = list(groups)
    ncols = min(2, len(metrics))
    nrows = (len(metrics) + 1) // 2
    fig, axes = _figure(width=5.0 * ncols, height=max(3.2, 0.45 * len(names) + 1.6) * nrows, ncols=ncols,
                        nrows=nrows)
    for ax in axes.flat[len(metrics):]:
        ax.set_visible(False)
    for ax, metric in zip(axes.flat, metrics):
        for i, g in enumerate(names):
            vals = _vals(groups[g], metric)
            ax.scatter(vals, [i] * len(vals), alpha=0.7, s=18, color="#4C72B0")
            if vals:
                ax.plot([statistics.fmean(vals)] * 2, [i - 0.3, i + 0.3], color="#C44E52", lw=2)
        ax.set_yticks(range(len(names)), [_wrap(n) for n in names], fontsize=7)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_title(metric, fontsize=10)
    return Plot("seed_spread.png", "Spread over seeds",
                "Each point is one repeat (one seed); the red bar is the mean.", _png(fig))


def _plot_quality(runs) -> Plot | None:
    metrics = [m for m in _QUALITY if _vals(runs, m)]
    if not metrics:
        return None
    groups = _groups(runs)
    names = list(groups)
    fig, axes = _figure(width=4.0 * len(metrics), height=max(3.0, 0.45 * len(names) + 1.5),
                        ncols=len(metrics))
    for ax, metric in zip(axes.flat, metrics):
        stats = [_bar_mean_std(_vals(groups[g], metric)) for g in names]
        ax.barh(range(len(names)), [m for m, _ in stats], xerr=[s for _, s in stats], capsize=3,
                color="#55A868")
        ax.set_yticks(range(len(names)),
                      [_wrap(n) for n in names] if ax is axes.flat[0] else [""] * len(names), fontsize=7)
        ax.invert_yaxis()
        ax.set_title(metric, fontsize=10)
    return Plot("quality.png", "Quality metrics", "Exact match (share), BLEU and chrF per configuration: "
                                                  "mean over repeats, bars show the spread.", _png(fig))


# ---- HTML -----------------------------------------------------------------------------------------
_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2rem auto;
     max-width:1400px;padding:0 1rem;color:#222}
h1{margin-bottom:.2rem} h2{margin-top:2.2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
.meta{color:#666;font-size:.9rem}
table{border-collapse:collapse;font-size:.82rem;margin:.6rem 0;display:block;overflow-x:auto;max-width:100%}
th,td{border:1px solid #ddd;padding:.25rem .5rem;text-align:left;vertical-align:top;white-space:nowrap}
th{background:#f4f4f6;position:sticky;top:0} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}
td.diff,th.diff{background:#fff3b0 !important} td.diff.changed{background:#ffd966 !important;font-weight:600}
figure{margin:1.2rem 0} figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;font-size:.85rem}
details summary{cursor:pointer;color:#225}
"""

_CHECK_JS = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images-loaded', ok + '/' + imgs.length);
});
"""


def _e(v) -> str:
    return html.escape(str(v))


def _cell(v) -> str:
    if v is None:
        return "<td></td>"
    if isinstance(v, bool):
        return f"<td>{v}</td>"
    if isinstance(v, (int, float)):
        return f'<td class="num">{_e(_fmt_num(v))}</td>'
    if isinstance(v, (list, dict)):
        v = json.dumps(v, default=str)
    return f"<td>{_e(_truncate(str(v)))}</td>"


def _fmt_num(v) -> str:
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.4e}"


def _truncate(s: str, n: int = 120) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def _table(header: list[str], rows: list[list], table_id: str,
           header_classes: list[str] | None = None) -> str:
    hc = header_classes or [""] * len(header)
    head = "".join(f'<th class="{c}">{_e(h)}</th>' if c else f"<th>{_e(h)}</th>" for h, c in zip(header, hc))
    body = "".join("<tr>" + "".join(c if isinstance(c, str) and c.startswith("<td") else _cell(c)
                                    for c in row)
                   + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _summary_table(runs) -> str:
    groups = _groups(runs)
    metrics = [m for m in _SUMMARY_METRICS if _vals(runs, m)]
    rows = []
    for members in groups.values():
        row = [members[0]["experiment"], members[0]["model_label"], members[0]["config"], len(members)]
        for m in metrics:
            mean, std = _mean_std(_vals(members, m))
            if mean is None:
                row.append(None)
            else:
                text = _fmt_num(mean) + (f" ± {_fmt_num(std)}" if len(members) > 1 and std else "")
                row.append(f'<td class="num">{_e(text)}</td>')
        rows.append(row)
    return _table(["experiment", "model", "configuration", "runs"] + metrics, rows, "summary-table")


def _runs_table(runs) -> str:
    """One row per run; its configuration as the summary names it, since runs filed apart (separate
    ``to_store`` calls) declare nothing varied and differ in params no other column shows."""
    varied = list(dict.fromkeys(k for r in runs for k in r["params"].get("varied", [])))
    metrics = list(dict.fromkeys(k for r in runs for k in r["metrics"]
                                 if k in _SUMMARY_METRICS or k in _QUALITY))
    rows = []
    for r in runs:
        rows.append([r["run_id"], r["experiment"], r["model_label"], r["config"], r["repeat"], r["seed"]]
                    + [r["params"].get(k) for k in varied] + [r["metrics"].get(k) for k in metrics]
                    + [(r["finished_at"] or "")[:19]])
    return _table(["id", "experiment", "model", "configuration", "repeat", "seed"] + varied + metrics
                  + ["finished"], rows, "runs-table")


def _manifest_tables(runs) -> tuple[str, int]:
    manifests = [r.get("manifest") or {} for r in runs]
    ignore = _UNINTERESTING
    differ = diff_manifests(manifests, ignore=ignore)
    flat = [flatten(m) for m in manifests]
    if differ:
        rows = []
        for r, f in zip(runs, flat):
            cells = [r["run_id"], r["experiment"]]
            for k in differ:
                v = f.get(k, "—")
                first = flat[0].get(k, "—")
                changed = " changed" if json.dumps(v, default=str) != json.dumps(first, default=str) else ""
                text = json.dumps(v, default=str) if isinstance(v, (list, dict)) else str(v)
                cells.append(f'<td class="diff{changed}">{_e(_truncate(text, 80))}</td>')
            rows.append(cells)
        diff_html = _table(["run", "experiment"] + differ, rows, "manifest-diff-table",
                           ["", ""] + ["diff"] * len(differ))
    else:
        diff_html = ('<p id="manifest-no-diff">Every run has the same manifest (apart from its time stamp).'
                     '</p>')
    shared_keys = [k for k in dict.fromkeys(k for f in flat for k in f)
                   if k not in differ and not any(k == i or k.startswith(i + ".") for i in ignore)]
    shared_rows = [[k, flat[0].get(k)] for k in shared_keys]
    shared_html = _table(["field", "value (same in every run)"], shared_rows, "manifest-shared-table")
    shared = (f"<details><summary>{len(shared_keys)} fields shared by every run</summary>{shared_html}"
              "</details>")
    return diff_html + shared, len(differ)


def _render_html(runs, plots, url, failed, title) -> str:
    experiments = list(dict.fromkeys(r["experiment"] for r in runs))
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    manifest_html, ndiff = _manifest_tables(runs)
    figures = "".join(
        f'<figure><img src="data:image/png;base64,{base64.b64encode(p.png).decode()}" alt="{_e(p.title)}" '
        f'data-file="{_e(p.filename)}"><figcaption><b>{_e(p.title)}.</b> {_e(p.caption)} '
        f'(<a href="{_e(p.filename)}">{_e(p.filename)}</a>)</figcaption></figure>' for p in plots)
    failed_note = f"; {failed} failed run(s) not shown" if failed else ""
    exp_list = ", ".join(f"{_e(e)} ({sum(r['experiment'] == e for r in runs)} runs)" for e in experiments)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title><style>{_CSS}</style><script>{_CHECK_JS}</script></head>
<body>
<h1>{_e(title)}</h1>
<p class="meta">Generated {_e(now)} from <code>{_e(url)}</code>: {len(runs)} finished run(s) of
{exp_list}{failed_note}.</p>
<h2 id="summary">Summary</h2>
<p class="meta">One row per configuration (the swept parameters); mean ± standard deviation over repeats.</p>
{_summary_table(runs)}
<h2 id="plots">Plots</h2>
{figures}
<h2 id="runs">Runs</h2>
{_runs_table(runs)}
<h2 id="manifests">Manifests</h2>
<p class="meta">{ndiff} manifest field(s) differ between runs (highlighted; the darker cells differ from the
first run).</p>
{manifest_html}
</body></html>
"""
