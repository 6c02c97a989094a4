"""``--profile DIR`` on ``pagedlab bench`` and ``pagedlab run``: a Chrome/Perfetto trace with the
engine's step ranges, a kernel table grouped by kind and each step kind's host-gap share, written
to DIR and (for ``run``) referenced from the stored run's manifest."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from pagedlab.cli.main import main

PHASES = {"pagedlab.step", "schedule", "prepare", "forward", "sample", "process_output"}


def _check_profile_dir(directory: Path, step_kinds: set[str]) -> dict:
    """The directory holds a trace with every step range, profile.json and a kernel table by kind."""
    traces = list(directory.glob("pagedlab-trace-*.json"))
    assert len(traces) == 1, list(directory.iterdir())
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert names >= PHASES
    summary = json.loads((directory / "profile.json").read_text())
    assert step_kinds <= set(summary["steps"]) and summary["trace_path"] == str(traces[0])
    assert summary["time_by_kind_us"]["gemm"] > 0 and summary["time_by_kind_us"]["attention"] > 0
    table = (directory / "kernels.txt").read_text()
    # one section per kernel kind, each with its kernels (on the CPU: aten operators)
    assert "\ngemm: " in table and "\nattention: " in table and "aten::" in table
    for kind in step_kinds:
        assert f"\n{kind} " in table
    assert "host gap" in table
    return summary


def test_bench_profile_writes_a_trace_and_a_kernel_table_per_row(tiny_llama, tmp_path, capsys):
    out, profile = tmp_path / "bench.json", tmp_path / "prof"
    rc = main(["bench", "throughput", "--model", tiny_llama.path, "--workload", "custom",
               "--batch-size", "2", "3", "--input-len", "12", "--output-len", "5", "--json", str(out),
               "--kv-cache-memory-bytes", str(16 << 20), "--dtype", "float32", "--profile", str(profile)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    for row, name in zip(rows, ("bs_2", "bs_3")):
        summary = _check_profile_dir(profile / name, {"prefill", "decode"})
        record = row["extra"]["profile"]
        assert record["dir"] == str(profile / name) and record["steps"]["decode"] == 4  # 5 tokens
        assert summary["steps"]["decode"]["count"] == 4
    assert f"profile in {profile / 'bs_2'}" in capsys.readouterr().out


@pytest.fixture(scope="module")
def experiments(tmp_path_factory, tiny_models):
    pytest.importorskip("yaml")
    pytest.importorskip("sqlalchemy")
    root = tmp_path_factory.mktemp("profile")
    model = tiny_models("llama").path
    (root / "bench.yaml").write_text(textwrap.dedent(f"""
        name: pbench
        model: {model}
        engine: {{device: cpu, kv_cache_memory_bytes: 4194304}}
        benchmark: {{batch_size: 2, input_len: 8, output_len: 3, warmup: 1}}
        monitor: false
        """))
    (root / "qa.yaml").write_text(textwrap.dedent(f"""
        name: pqa
        model: {model}
        engine: {{device: cpu, kv_cache_memory_bytes: 4194304, max_num_batched_tokens: 8}}
        sampling: {{max_tokens: 3, temperature: 0}}
        dataset: {{prompts: [[7, 8, 9], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]}}
        monitor: false
        """))
    return root


def test_run_profile_is_referenced_from_each_stored_run(experiments, tmp_path, capsys):
    from pagedlab.lab.store import ResultStore

    url, profile = f"sqlite:///{tmp_path / 'results.db'}", tmp_path / "prof"
    for name in ("bench", "qa"):
        argv = ["run", str(experiments / f"{name}.yaml"), "--db", url, "-q", "--profile", str(profile)]
        assert main(argv) == 0
    with ResultStore(url) as store:
        runs = {r["experiment"]: r for r in store.runs(status="finished", manifest=True)}
    bench = runs["pbench"]["manifest"]["profile"]
    # the benchmark's timed run only (the warm-up is not profiled): one prefill and two decode steps
    assert Path(bench["dir"]).parent.parent == profile / "pbench" and Path(bench["dir"]).name == "bs2-r0"
    assert bench["steps"] == {"prefill": 1, "decode": 2}
    _check_profile_dir(Path(bench["dir"]), {"prefill", "decode"})
    qa = runs["pqa"]["manifest"]["profile"]
    assert Path(qa["dir"]).parent == profile / "pqa"
    # 8-token steps over a 3-token and a 14-token prompt: both prefill, then chunks beside a decode
    _check_profile_dir(Path(qa["dir"]), {"prefill", "mixed", "decode"})
    assert Path(qa["trace"]).is_file() and Path(qa["kernel_table"]).is_file()
    assert main(["results", "show", str(runs["pqa"]["run_id"]), "--db", url]) == 0
    assert f"profile: {qa['dir']}" in capsys.readouterr().out


def test_run_profile_is_refused_with_ray(experiments, tmp_path, capsys):
    rc = main(["run", str(experiments / "bench.yaml"), "--db", f"sqlite:///{tmp_path / 'r.db'}", "--ray",
               "--profile", str(tmp_path / "p")])
    assert rc == 2 and "--profile runs here, not with --ray" in capsys.readouterr().err
