"""examples/seed_walkthrough.py runs the seed's sections end to end (tiny models, tiny sizes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("seaborn")
pytest.importorskip("pandas")

from pagedlab.lab.testing import make_tiny_model

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "seed_walkthrough.py"


@pytest.mark.slow  # three model loads, two benchmarks, five re-plans and a profile: about 20 s on 2 cores
def test_seed_walkthrough_runs_every_section(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("seed_walkthrough", EXAMPLE)
    walkthrough = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walkthrough)
    small = make_tiny_model(tmp_path / "small", hidden_size=64)
    large = make_tiny_model(tmp_path / "large", hidden_size=128)
    out = tmp_path / "out"
    argv = ["--model", str(small), "--model", str(large), "--batch-size", "1", "2", "--input-len", "8",
            "--output-len", "3", "--device", "cpu", "--out", str(out)]
    assert walkthrough.main(argv) == 0
    text = capsys.readouterr().out
    titles = ("the machine", "will it fit", "loaded", "generate", "benchmark", "ablations",
              "where the time goes", "scaling")
    for number, title in enumerate(titles, start=1):
        assert f"== {number}. {title}" in text
    assert "llama3-70b (70B) on A100-80GB: does NOT fit" in text  # the seed's hardware table
    assert "beam search (width 2)" in text and "{'chunked_prefill_size': 32}:" in text
    bench = json.loads((out / "bench.json").read_text())
    assert [r["batch_size"] for r in bench["runs"]] == [1, 2]
    assert all(r["output_tokens"] == 3 * r["batch_size"] for r in bench["runs"])
    assert json.loads((out / "profile" / "profile.json").read_text())["steps"]["decode"]["count"] > 0
    assert (out / "scaling.png").read_bytes().startswith(b"\x89PNG")
