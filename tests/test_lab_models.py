"""Multi-model studies: ``model:`` as a list runs each model in turn, loading each once; the runs
carry the parameter count and size class, the seed's tokens/s/GPU and memory efficiency, and the
report draws the seed's ``sns.lineplot(x="batch_size", y="throughput", hue="model_size")``."""

from __future__ import annotations

import os
import re
import textwrap

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("seaborn")
pytest.importorskip("sqlalchemy")
pytest.importorskip("yaml")

from test_lab_report import CHROMIUM, _render_in_chromium

from pagedlab import LLM
from pagedlab.lab.report import build_report
from pagedlab.lab.runner import run_experiment
from pagedlab.lab.schema import ExperimentError
from pagedlab.lab.spec import load_experiment
from pagedlab.lab.store import ResultStore
from pagedlab.lab.testing import make_tiny_model

# Parameters of make_tiny_model's Llama (vocab 512, 2 layers, 4 heads, 2 KV heads, FFN 2 x hidden,
# untied), by hand: per layer q/o (h*h each), k/v (h*h/2 each), gate/up/down (3*h*2h) and two norms
# (2h); two embedding matrices (512*h) and the final norm (h).
SMALL_PARAMS = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 2 * 512 * 64 + 64  # 139,584
LARGE_PARAMS = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 2 * 128) + 2 * 512 * 128 + 128  # 426,624


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    small = make_tiny_model(root / "small", tokenizer=False, hidden_size=64)
    large = make_tiny_model(root / "large", tokenizer=False, hidden_size=128)
    (root / "scaling.yaml").write_text(textwrap.dedent(f"""
        name: scaling
        model: [{small}, {large}]
        engine: {{device: cpu, kv_cache_memory_bytes: 4194304}}
        benchmark: {{input_len: 8, output_len: 3, warmup: 0}}
        grid: {{benchmark.batch_size: [1, 2]}}
        repeats: 2
        monitor: false
        """))
    loads = []

    def counting_llm(model, **kwargs):
        loads.append(model)
        return LLM(model, **kwargs)

    url = f"sqlite:///{root / 'results.db'}"
    report = run_experiment(load_experiment(root / "scaling.yaml"), db=url, quiet=True,
                            llm_factory=counting_llm)
    assert report.ok
    return {"root": root, "url": url, "loads": loads, "small": str(small), "large": str(large),
            "report": report}


def test_each_model_runs_once_with_its_size(study):
    from transformers import AutoModelForCausalLM

    assert study["loads"] == [study["small"], study["large"]]  # each model loaded once, in list order
    assert len(study["report"].model_loads) == 2
    with ResultStore(study["url"]) as store:
        runs = store.runs(status="finished", manifest=True)
    assert len(runs) == 2 * 2 * 2  # models x batch sizes x repeats
    expected = {study["small"]: (SMALL_PARAMS, "140K"), study["large"]: (LARGE_PARAMS, "427K")}
    for path, (params, _) in expected.items():
        assert AutoModelForCausalLM.from_pretrained(path).num_parameters() == params  # HF agrees
    for r in runs:
        params, size = expected[r["model"]]
        assert r["metrics"]["model_parameters"] == params
        assert r["manifest"]["model"]["parameters"] == params and r["manifest"]["model"]["size_class"] == size
        assert "model" in r["params"]["varied"]
        m = r["metrics"]
        assert m["output_throughput_per_gpu"] == pytest.approx(m["output_throughput"])  # one "GPU" (rank)
        # on the CPU the engine reserves the weights and the KV pool; live are the weights and KV at the peak
        assert m["memory_reserved_bytes"] == m["weight_bytes"] + m["kv_cache_bytes"]
        assert m["memory_efficiency"] == pytest.approx(
            (m["weight_bytes"] + m["kv_peak_used_bytes"]) / m["memory_reserved_bytes"])
        assert 0 < m["memory_efficiency"] < 1


def test_report_draws_the_seeds_hue_plot(study, tmp_path, monkeypatch):
    import seaborn

    calls = []
    lineplot = seaborn.lineplot

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return lineplot(*args, **kwargs)

    monkeypatch.setattr(seaborn, "lineplot", spy)
    page = build_report(study["url"], tmp_path / "rep")
    assert (tmp_path / "rep" / "model_scaling.png").read_bytes().startswith(b"\x89PNG")
    assert [(c["x"], c["y"], c["hue"]) for c in calls] == [("batch_size", "throughput", "model_size"),
                                                          ("batch_size", "throughput_per_gpu", "model_size")]
    data = calls[0]["data"]
    assert len(data) == 8 and calls[0]["hue_order"] == ["140K", "427K"]
    assert sorted(data["batch_size"].unique()) == [1, 2]
    html = page.read_text()
    assert 'data-file="model_scaling.png"' in html
    summary = re.search(r'<table id="summary-table">.*?</table>', html, re.S).group(0)
    assert "model_parameters" in summary and "memory_efficiency" in summary
    if os.path.exists(CHROMIUM):
        count = html.count('<img src="data:image/png;base64,')
        assert re.search(rf'<body[^>]*data-images-loaded="{count}/{count}"', _render_in_chromium(page))


def test_model_lists_are_checked(study, tmp_path):
    path = tmp_path / "bad.yaml"
    base = "benchmark: {batch_size: 1, input_len: 4, output_len: 2}\n"
    path.write_text(f"model: [{study['small']}, {study['small']}]\n" + base)
    with pytest.raises(ExperimentError, match="a model appears twice in the list"):
        load_experiment(path)
    path.write_text(f"model: [{study['small']}]\ngrid: {{model: [{study['large']}]}}\n" + base)
    with pytest.raises(ExperimentError, match="the models are listed twice"):
        load_experiment(path)
    path.write_text("model: []\n" + base)
    with pytest.raises(ExperimentError, match="the model list is empty"):
        load_experiment(path)
