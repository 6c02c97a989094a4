"""``pagedlab report``: PNG plots and a self-contained HTML page, checked in headless Chromium
(Debian's chromium; .ci/install-chromium.sh installs it, the browser test skips without it)."""

import argparse
import base64
import copy
import math
import os
import re
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("sqlalchemy")
pytest.importorskip("yaml")

from pagedlab.lab import cli as lab_cli
from pagedlab.lab.experiments import load_experiment, run_experiment
from pagedlab.lab.report import build_report
from pagedlab.lab.store import ResultStore, RunRecord
from pagedlab.lab.testing import make_tiny_model

CHROMIUM = "/usr/bin/chromium"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """A database with a benchmark sweep (two batch sizes x two repeats), a QA experiment with
    quality metrics, and one copied run whose manifest says another torch version."""
    root = tmp_path_factory.mktemp("report")
    model = make_tiny_model(root / "tiny")
    url = f"sqlite:///{root / 'results.db'}"
    (root / "bench.yaml").write_text(textwrap.dedent(f"""
        name: bench
        model: {model}
        engine: {{device: cpu, kv_cache_memory_bytes: 4194304}}
        benchmark: {{input_len: 8, output_len: 3, warmup: 0}}
        grid: {{benchmark.batch_size: [1, 2]}}
        repeats: 2
        monitor: {{interval: 0.05}}
        """))
    (root / "qa.yaml").write_text(textwrap.dedent(f"""
        name: qa
        model: {model}
        engine: {{device: cpu, kv_cache_memory_bytes: 4194304}}
        sampling: {{max_tokens: 4, temperature: 0.9}}
        dataset:
          prompts:
            - {{prompt: the quick brown, reference: fox jumps}}
            - {{prompt: two plus two is, reference: four}}
        grid: {{engine.block_size: [16, 32]}}
        repeats: 2
        metrics: [exact_match, bleu, chrf, output_length, throughput, latency, memory]
        """))
    for name in ("bench", "qa"):
        assert run_experiment(load_experiment(root / f"{name}.yaml"), db=url, quiet=True).ok
    with ResultStore(url) as store:
        run = store.runs(experiment="qa")[0]
        manifest = copy.deepcopy(run["manifest"])
        manifest["versions"]["torch"] = "9.99.0"
        store.record_run(RunRecord("qa", "qa:other-torch", run["params"], run["metrics"], manifest,
                                   repeat=run["repeat"], seed=run["seed"], model=run["model"]))
    return url


def test_report_files(db, tmp_path):
    page = build_report(db, tmp_path / "rep")
    html = page.read_text()
    pngs = sorted(p.name for p in (tmp_path / "rep").glob("*.png"))
    assert pngs == ["latency.png", "memory.png", "quality.png", "seed_spread.png", "throughput_vs_batch.png"]
    for name in pngs:
        data = (tmp_path / "rep" / name).read_bytes()
        assert data.startswith(PNG_MAGIC)
        # the page embeds the same image, so it is self-contained
        assert base64.b64encode(data).decode() in html
    assert not re.search(r'(src|href)="(https?:)?//', html)  # nothing fetched from the network
    assert html.count('<img src="data:image/png;base64,') == 5
    # the tables: 9 runs (4 benchmark + 4 qa + the copy), the torch version highlighted as differing
    runs_table = re.search(r'<table id="runs-table">.*?</table>', html, re.S).group(0)
    assert runs_table.count("<tr>") == 1 + 9
    diff = re.search(r'<table id="manifest-diff-table">.*?</table>', html, re.S).group(0)
    assert '<th class="diff">versions.torch</th>' in diff
    assert '<td class="diff changed">9.99.0</td>' in diff
    assert 'id="manifest-shared-table"' in html and "versions.python" in html
    summary = re.search(r'<table id="summary-table">.*?</table>', html, re.S).group(0)
    assert "batch_size=1" in summary and "block_size=32" in summary and "bleu" in summary


def test_report_filters_and_errors(db, tmp_path, capsys):
    page = build_report(db, tmp_path / "only-bench", experiments=["bench"])
    assert not (tmp_path / "only-bench" / "quality.png").exists()  # the benchmark has no quality metrics
    assert "throughput_vs_batch.png" in page.read_text()
    with pytest.raises(ValueError, match="no finished runs of experiment"):
        build_report(db, tmp_path / "none", experiments=["missing"])
    parser = argparse.ArgumentParser()
    lab_cli.register(parser.add_subparsers())
    args = parser.parse_args(["report", "--db", db, "--out", str(tmp_path / "cli"), "--title", "My sweep"])
    assert args.func(args) == 0
    assert "<title>My sweep</title>" in (tmp_path / "cli" / "index.html").read_text()
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    args = parser.parse_args(["report", "--db", empty, "--out", str(tmp_path / "x")])
    assert args.func(args) == 2 and "there is no results database at" in capsys.readouterr().err
    assert not (tmp_path / "empty.db").exists()  # a read-only command creates no database
    ResultStore(empty).close()
    assert args.func(args) == 2 and "nothing to report" in capsys.readouterr().err


def test_failed_note_counts_only_the_reported_experiments(db, tmp_path):
    copied = tmp_path / "failed.db"
    shutil.copyfile(db.removeprefix("sqlite:///"), copied)
    url = f"sqlite:///{copied}"
    with ResultStore(url) as store:
        for name in ("qa", "other"):
            store.record_run(RunRecord(name, f"{name}:crashed", {}, {}, {}, status="failed", error="boom"))

    def note(experiments):
        html = build_report(url, tmp_path / "rep", experiments=experiments).read_text()
        return re.search(r"finished run\(s\) of\n(.*?)\.</p>", html).group(1)

    assert note(["bench"]) == "bench (4 runs)"
    assert note(["qa"]) == "qa (5 runs); 1 failed run(s) not shown"
    assert note(["bench", "qa"]).endswith("; 1 failed run(s) not shown")
    assert note(None).endswith("; 2 failed run(s) not shown")


def _render_in_chromium(page: Path) -> str:
    """The page's DOM after it loaded (and its script counted the loaded images)."""
    profile = tempfile.mkdtemp(prefix="pagedlab-chromium-")
    try:
        out = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
            capture_output=True, text=True, timeout=120, env=dict(os.environ, HOME=profile))
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (.ci/install-chromium.sh)")
def test_report_in_headless_chromium(db, tmp_path):
    page = build_report(db, tmp_path / "rep")
    dom = _render_in_chromium(page)
    # every plot decoded (the page's load handler counts images with a natural width)
    assert re.search(r'<body[^>]*data-images-loaded="5/5"', dom), dom[:500]
    for table in ("summary-table", "runs-table", "manifest-diff-table", "manifest-shared-table"):
        assert f'<table id="{table}">' in dom
    assert re.search(r'<table id="runs-table">.*?</table>', dom, re.S).group(0).count("<tr>") == 10
    # and the check can fail: a corrupted plot is counted as not loaded
    html = page.read_text()
    first = re.search(r'data:image/png;base64,([A-Za-z0-9+/=]{40})', html).group(1)
    broken = tmp_path / "rep" / "broken.html"
    broken.write_text(html.replace(first, "A" * 40, 1))
    assert re.search(r'<body[^>]*data-images-loaded="4/5"', _render_in_chromium(broken))


def test_runs_filed_apart_are_told_apart_by_what_differs(tmp_path):
    """Two benchmarks of one batch size each, filed into one experiment by separate to_store
    calls, declare nothing varied; the report still groups them by batch size (not both as
    "base", averaging batch 1 with batch 4), while runs that differ only in seed share a group."""
    from pagedlab.lab.report import _groups, _label_runs

    def run(batch: int, seed: int) -> dict:
        params = {"model": "m", "benchmark.batch_size": batch, "benchmark.input_len": 8, "varied": []}
        params.update({"sampling.seed": seed, "repeat": seed})
        return {"experiment": "bench", "model": "m", "params": params, "metrics": {}, "manifest": {}}

    runs = [run(1, 0), run(1, 1), run(4, 0)]
    _label_runs(runs)
    assert [r["config"] for r in runs] == ["batch_size=1", "batch_size=1", "batch_size=4"]
    assert {g: len(members) for g, members in _groups(runs).items()} == {"batch_size=1": 2, "batch_size=4": 1}


def _sweep_run(model: str, temperature: float, seed: int, throughput, batch: int | None = None,
               input_len: int = 8, varied=("model", "sampling.temperature")) -> dict:
    params = {"model": model, "sampling.temperature": temperature, "benchmark.input_len": input_len,
              "varied": list(varied), "sampling.seed": seed, "repeat": seed}
    if batch is not None:
        params["benchmark.batch_size"] = batch
    return {"experiment": "e", "model": model, "params": params, "manifest": {},
            "metrics": {"output_throughput": throughput}}


def test_configurations_whose_labels_look_alike_stay_apart():
    """Two checkpoints named alike in different directories, and temperatures equal to 4 digits,
    are different configurations: the summary does not average them together."""
    from pagedlab.lab.report import _groups, _label_runs

    runs = [_sweep_run("/a/ckpt/final", 0.12341, s, 10.0 + s) for s in (0, 1)]
    runs += [_sweep_run("/b/ckpt/final", 0.12341, 0, 50.0), _sweep_run("/a/ckpt/final", 0.12344, 0, 90.0)]
    _label_runs(runs)
    groups = _groups(runs)
    distinct = {(r["model"], r["params"]["sampling.temperature"]) for r in runs}
    assert len(groups) == len(distinct) == 3
    assert sorted(len(members) for members in groups.values()) == [1, 1, 2]
    assert len({r["model_label"] for r in runs}) == 2  # the model column tells the checkpoints apart


def test_throughput_plot_has_one_series_per_configuration(monkeypatch):
    """Runs filed apart (two input lengths, declared varied: batch size only) make two lines, each
    point the mean of its repeats (as pandas computes it); a repeat whose throughput was not
    finite (stored as None) is left out rather than breaking the report."""
    import pandas as pd

    from pagedlab.lab import report

    runs = [_sweep_run("m", 0.0, s, 100.0 * b + input_len + 3 * s, b, input_len, ["benchmark.batch_size"])
            for input_len in (8, 512) for b in (1, 4) for s in (0, 1)]
    runs.append(_sweep_run("m", 0.0, 2, None, 4, 512, ["benchmark.batch_size"]))
    figures = []
    monkeypatch.setattr(report, "_png", lambda fig: figures.append(fig) or b"")
    report._label_runs(runs)
    assert report._plot_throughput(runs) is not None
    ax = figures[0].axes[0]
    series = {c.get_label(): dict(zip(c.lines[0].get_xdata(), c.lines[0].get_ydata())) for c in ax.containers}
    df = pd.DataFrame([{**r["params"], "throughput": r["metrics"]["output_throughput"]} for r in runs])
    expected = df.groupby(["benchmark.input_len", "benchmark.batch_size"])["throughput"].mean()
    assert len(series) == 2
    for input_len in (8, 512):
        (name,) = [n for n in series if f"input_len={input_len}]" in n]
        assert series[name] == pytest.approx({b: expected[(input_len, b)] for b in (1, 4)})


def test_a_configuration_without_a_finite_throughput_gets_no_bar(monkeypatch):
    """Without a batch-size sweep each configuration is a bar; one whose every repeat's throughput
    was not finite (stored as None) is left out instead of failing the whole report, and the
    other bars keep their means."""
    from pagedlab.lab import report

    runs = [_sweep_run("m", 0.5, s, 10.0 + 2 * s) for s in (0, 1)] + [_sweep_run("m", 0.9, 0, None)]
    figures = []
    monkeypatch.setattr(report, "_png", lambda fig: figures.append(fig) or b"")
    report._label_runs(runs)
    assert report._plot_throughput(runs) is not None
    bars = figures[0].axes[0].patches
    assert [bar.get_width() for bar in bars] == [pytest.approx(11.0)]
    assert report._plot_throughput(runs[2:]) is None  # nothing finite: no plot at all


def test_a_configuration_without_a_metric_gets_no_bar_rather_than_a_zero(monkeypatch):
    """A report of a QA experiment beside a benchmark: the benchmark has no BLEU and the QA runs no
    inter-token latency or memory figures; their bars are absent (NaN), not a measured 0, while the
    others keep their means over repeats; the figures still render."""
    from pagedlab.lab import report

    def run(experiment: str, seed: int, metrics: dict) -> dict:
        params = {"model": "m", "x": experiment, "varied": ["x"], "sampling.seed": seed, "repeat": seed}
        return {"experiment": experiment, "model": "m", "params": params, "manifest": {}, "metrics": metrics}

    latency = {f"ttft_p{p}_ms": 1.0 for p in (50, 90, 99)}
    runs = [run("qa", s, {"bleu": 10.0 + s, **latency}) for s in (0, 1)]
    runs.append(run("bench", 0, {**latency, **{f"itl_p{p}_ms": p / 10 for p in (50, 90, 99)},
                                 "weight_bytes": 2048}))
    figures = []
    monkeypatch.setattr(report, "_png", lambda fig: figures.append(fig) or b"")
    report._label_runs(runs)
    quality, latency_plot, memory = (report._plot_quality(runs), report._plot_latency(runs),
                                     report._plot_memory(runs))
    assert quality and latency_plot and memory
    bleu = [bar.get_width() for bar in figures[0].axes[0].patches]
    assert bleu[0] == pytest.approx(10.5) and math.isnan(bleu[1])  # qa first, then bench
    itl = next(ax for ax in figures[1].axes if ax.get_title() == "inter-token latency")
    widths = [bar.get_width() for bar in itl.patches]  # P50, P90, P99 of qa then bench each
    assert [math.isnan(w) for w in widths] == [True, False] * 3 and widths[1::2] == pytest.approx([5, 9, 9.9])
    weights = [bar.get_width() for bar in figures[2].axes[0].patches[:2]]
    assert math.isnan(weights[0]) and weights[1] == pytest.approx(2.0)  # KiB
    monkeypatch.undo()
    assert all(report._png(fig).startswith(PNG_MAGIC) for fig in figures)


def _bench_run(batch: int, num_prompts: int, seed: int, throughput: float) -> dict:
    params = {"model": "m", "benchmark.batch_size": batch, "benchmark.num_prompts": num_prompts,
              "varied": ["benchmark.batch_size"], "benchmark.seed": seed, "repeat": seed}
    return {"experiment": "e", "model": "m", "params": params, "manifest": {},
            "metrics": {"output_throughput": throughput}}


def test_num_prompts_that_follow_the_batch_size_make_one_line(monkeypatch):
    """LLM.benchmark(batch_size=[1, 4]).to_store files num_prompts = the batch size: that is no
    configuration of its own, so the plot has one line through both batch sizes (not one line of
    one point per batch size); num_prompts swept across the batch sizes still makes a line each."""
    from pagedlab.lab import report

    def series(runs):
        figures = []
        monkeypatch.setattr(report, "_png", lambda fig: figures.append(fig) or b"")
        report._label_runs(runs)
        report._plot_throughput(runs)
        return {c.get_label(): dict(zip(c.lines[0].get_xdata(), c.lines[0].get_ydata()))
                for c in figures[0].axes[0].containers}

    filed = [_bench_run(b, b, s, 10.0 * b + s) for b in (1, 4) for s in (0, 1)]
    assert series(filed) == {"m": pytest.approx({1: 10.5, 4: 40.5})}
    crossed = [_bench_run(b, n, 0, 10.0 * b + n) for b in (4, 8) for n in (4, 8)]
    assert series(crossed) == {"m [num_prompts=4]": pytest.approx({4: 44.0, 8: 84.0}),
                               "m [num_prompts=8]": pytest.approx({4: 48.0, 8: 88.0})}


def test_model_scaling_keeps_other_configurations_of_a_size_apart(monkeypatch):
    """A study of two model sizes that also sweeps block_size: each (size, block size) is a line of
    its own whose points are the means over repeats (as pandas computes them), not one line per
    size averaging the two block sizes under a confidence band."""
    import pandas as pd

    pytest.importorskip("seaborn")
    from pagedlab.lab import report

    def run(model: str, parameters: float, block: int, batch: int, seed: int) -> dict:
        params = {"model": model, "engine.block_size": block, "benchmark.batch_size": batch, "repeat": seed,
                  "varied": ["model", "engine.block_size", "benchmark.batch_size"], "benchmark.seed": seed}
        return {"experiment": "e", "model": model, "params": params,
                "manifest": {"model": {"parameters": parameters}},
                "metrics": {"output_throughput": parameters / 1e6 + 10 * block + batch + seed}}

    runs = [run(m, n, block, b, s) for m, n in (("a", 135e6), ("b", 8e9)) for block in (16, 32)
            for b in (1, 4) for s in (0, 1)]
    figures = []
    monkeypatch.setattr(report, "_png", lambda fig: figures.append(fig) or b"")
    report._label_runs(runs)
    assert report._plot_model_scaling(runs) is not None
    drawn = sorted(tuple(line.get_ydata()) for line in figures[0].axes[0].lines if len(line.get_xdata()))
    df = pd.DataFrame([{**r["params"], "throughput": r["metrics"]["output_throughput"]} for r in runs])
    means = df.groupby(["model", "engine.block_size", "benchmark.batch_size"])["throughput"].mean()
    expected = sorted(tuple(means[(m, block)].loc[[1, 4]]) for m in ("a", "b") for block in (16, 32))
    assert drawn == [pytest.approx(points) for points in expected]


def test_the_runs_table_names_each_runs_configuration():
    """Two block sizes filed apart by to_store into one experiment declare nothing varied: the
    runs table still tells their rows apart by the configuration the summary averages them under."""
    from pagedlab.lab.report import _label_runs, _runs_table

    def run(run_id: int, block: int, seed: int) -> dict:
        params = {"model": "m", "engine.block_size": block, "varied": [], "benchmark.seed": seed}
        return {"run_id": run_id, "experiment": "e", "model": "m", "params": params, "manifest": {},
                "metrics": {"output_throughput": 1.0}, "repeat": 0, "seed": seed, "finished_at": None}

    runs = [run(1, 16, 0), run(2, 32, 0), run(3, 16, 1)]
    _label_runs(runs)
    table = _runs_table(runs)
    header = re.findall(r"<th>(.*?)</th>", table)
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)[1:]]
    column = header.index("configuration")
    assert [row[column] for row in rows] == ["block_size=16", "block_size=32", "block_size=16"]
