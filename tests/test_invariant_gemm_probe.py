"""benchmarks/invariant_gemm_probe.py under the Triton interpreter: every candidate (pointer or TMA
loads, persistent or one program per tile, segment total in registers or in scratch) is bitwise
the current batch-invariant kernel's output with the same block_k/split_k and row-invariant, a
different split_k is not (the control), and the probe's driver records, checks and summarizes
them (with a stand-in timer) and skips candidates past its budget; the parent's child-process
plumbing, with a stand-in child that crashes, hangs and stops."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for module in ("gemv", "batch_invariant"):  # in import order
        if f"pagedlab.kernels.{module}" in sys.modules:
            importlib.reload(sys.modules[f"pagedlab.kernels.{module}"])

pytest.importorskip("triton")

from pagedlab.kernels.batch_invariant import fixed_tile_matmul_triton
from pagedlab.kernels.gemv_configs import TileConfig

_BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses and imports look it up
    spec.loader.exec_module(module)
    return module


child_runs = _load("child_runs")
probe = _load("invariant_gemm_probe")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="checks the interpreter's run; on a GPU the probe itself checks")


def test_every_candidate_is_bitwise_the_current_kernel_and_row_invariant():
    records = probe.cpu_check()
    assert len(records) == 2 * 2 * len(probe.CPU_CANDIDATES)
    for record in records:
        assert "error" not in record, record
        assert record["bitwise_vs_table"], record
        assert record["row_invariant"] == {1: True, 8: True}, record
        assert record["max_error"] < (1e-4 if record["dtype"] == "torch.float32" else 2e-3), record


def test_another_split_k_is_not_bitwise_equal():
    """The control: bitwise equality tells the sums apart (one K segment against three)."""
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(40, 112, generator=generator), torch.randn(80, 112, generator=generator)
    config = TileConfig(block_n=32, block_k=16, split_k=3, block_m=16, num_stages=2)
    current = fixed_tile_matmul_triton(x, weight, config=config, split_across_programs=False)
    probe.use_torch_allocator("cpu")
    for candidate in (probe.CPU_CANDIDATES[1], probe.CPU_CANDIDATES[-1]):
        assert torch.equal(probe.probe_matmul(x, weight, candidate, 16, 3, 4), current)
        other = probe.probe_matmul(x, weight, candidate, 16, 1, 4)
        assert not torch.equal(other, current)
        torch.testing.assert_close(other, current)


def test_probe_driver_records_checks_and_summary():
    probe.use_torch_allocator("cpu")
    messages = []
    runner = probe.Probe(budget_s=1e9, device="cpu", seconds=lambda fn, calls: (fn(), 1e-3)[1],
                         emit=lambda kind, record: messages.append((kind, record["kernel"])))
    assert runner.shape("tiny", 96, 512, 40, probe.CPU_CANDIDATES)  # default config: 2 segments of 4 steps
    kernels = [r["kernel"] for r in runner.records]
    assert kernels[:2] == ["cublas", "table"]
    candidates = runner.records[2:]
    assert len(candidates) == len(probe.CPU_CANDIDATES) - 1  # the current kernel's own launch is not repeated
    assert all(probe.valid(r) for r in candidates), candidates
    assert all(r["block_k"] == 64 and r["split_k"] == 2 for r in candidates)
    # what a child reports to its parent: each candidate begun, then its record
    assert messages == [("record", "cublas"), ("record", "table")] + [
        (kind, r["kernel"]) for r in candidates for kind in ("begin", "record")]
    assert [r["index"] for r in candidates] == [i for i, c in enumerate(probe.CPU_CANDIDATES)
                                                if c.tma or c.persistent]
    [line] = probe.summarize(runner.records)
    assert line["best"] in [r["kernel"] for r in candidates] and line["best_us"] == pytest.approx(1e3)

    late = probe.Probe(budget_s=-1.0, device="cpu", seconds=lambda fn, calls: 1e-3)
    late.shape("tiny", 96, 512, 40, probe.CPU_CANDIDATES)
    assert all("skipped" in r for r in late.records[2:])
    assert probe.summarize(late.records)[0]["best"] is None

    resumed = probe.Probe(budget_s=-1.0, device="cpu", seconds=lambda fn, calls: 1e-3)
    assert resumed.shape("tiny", 96, 512, 40, probe.CPU_CANDIDATES, first=3, cublas_us=2.0)
    assert [r["index"] for r in resumed.records] == [3, 4, 5]  # no cuBLAS or table timed again



def test_a_candidate_that_leaves_the_cuda_context_unusable_ends_the_process_run(monkeypatch):
    """The child then exits for a new one to go on from the next candidate."""
    refused = probe.Candidate(True, False, True, 16, 32, 4, 2)  # scratch total without the persistent launch
    runner = probe.Probe(budget_s=1e9, device="cpu", seconds=lambda fn, calls: 1e-3)
    assert runner.context_usable()
    monkeypatch.setattr(runner, "context_usable", lambda: False)
    assert not runner.shape("tiny", 96, 512, 40, [refused, probe.CPU_CANDIDATES[1]], cublas_us=1.0)
    [record] = runner.records
    assert record["index"] == 0 and "needs the persistent launch" in record["error"]

def test_timed_calls_once_eagerly_before_the_graph():
    """cuBLAS's first call (handle, workspace) and Triton's compile must not be in the capture."""
    made, made_when_timed = [], []
    runner = probe.Probe(budget_s=1e9, device="cpu",
                         seconds=lambda fn, calls: (made_when_timed.append(len(made)), 1e-3)[1])
    record: dict = {}
    runner.timed(record, lambda: made.append(1), 1e9, None)
    assert made_when_timed == [1] and record["us"] == pytest.approx(1e3)


def test_error_text_keeps_the_cuda_error_and_the_one_it_was_raised_while_handling():
    """A failed capture's end raises while handling the capture's first error: both, whole."""
    capture_end = ("CUDA error: operation failed due to a previous error during capture\n"
                   "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.")
    cublas = "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"
    try:
        try:
            raise RuntimeError(cublas)
        except RuntimeError:
            raise RuntimeError(capture_end)  # noqa: B904 - as torch.cuda.graph's __exit__ does
    except RuntimeError as error:
        lines = probe.error_text(error).splitlines()
    assert lines[0] == "RuntimeError: CUDA error: operation failed due to a previous error during capture"
    assert "TORCH_USE_CUDA_DSA" in lines[1]
    assert lines[2] == f"  raised while handling RuntimeError: {cublas}"


# A stand-in child of the probe's parent: from item argv[1] on, item 1 crashes, item 3 hangs,
# item 4 records an error and stops (as after a dead CUDA context), the others finish.
_STAND_IN = """
import json, os, sys, time
def emit(kind, **fields):
    print(PREFIX + json.dumps(dict(kind=kind, **fields)), flush=True)
first = int(sys.argv[1])
emit("info", device="stand-in")
if first == 0:
    emit("record", record=dict(kernel="cublas", us=5.0))
for index in range(first, 6):
    record = dict(kernel=f"c{index}", index=index)
    emit("begin", record=record)
    if index == 1:
        print("Traceback: CUDA error: an illegal memory access was encountered", flush=True)
        os._exit(7)
    if index == 3:
        time.sleep(60)
    if index == 4:
        emit("record", record=dict(record, error="AcceleratorError: CUDA error"))
        sys.exit(3)
    emit("record", record=dict(record, us=1.0))
emit("done")
"""


def test_parent_loses_only_the_candidate_that_crashed_or_hung():
    script = f"PREFIX = {child_runs.MESSAGE_PREFIX!r}\n{_STAND_IN}"
    firsts, reported = [], []

    def argv_for(first, records):
        firsts.append((first, [r["kernel"] for r in records if r["kernel"] == "cublas"]))
        return [sys.executable, "-c", script, str(first)]
    started = time.time()
    records, info = child_runs.run_resumable(dict(shape="s"), argv_for, 6, time.time() + 60, reported.append,
                                             line_timeout_s=1.0)
    assert time.time() - started < 20
    assert info["device"] == "stand-in"
    assert [(r["kernel"], "error" in r) for r in records] == [("cublas", False), ("c0", False), ("c1", True),
                                                              ("c2", False), ("c3", True), ("c4", True),
                                                              ("c5", False)]
    assert records[2]["error"].startswith("child exited with status 7\nTraceback: CUDA error: an illegal")
    assert records[4]["error"].startswith("child killed: no output for 1 s")
    assert firsts == [(0, []), (2, ["cublas"]), (4, ["cublas"]), (5, ["cublas"])]
    assert reported == [records[2], records[4]]


def test_parent_loses_the_shape_when_the_child_dies_before_a_candidate():
    records, info = child_runs.run_resumable(
        dict(shape="s", rows=8), lambda first, records: [sys.executable, "-c", "raise SystemExit('no GPU')"],
        6, time.time() + 60, lambda record: None)
    assert info == {}
    [record] = records
    assert record["kernel"] == "all" and record["error"] == "child exited with status 1\nno GPU"


def test_child_command_resumes_with_cublas_time():
    argv = probe.child_argv("down", 1024, 12.5, 120.0, 3, [dict(kernel="cublas", us=321.5)])
    assert argv[1].endswith("invariant_gemm_probe.py")
    assert argv[2:] == ["--one", "down,1024", "--first-candidate", "3", "--started", "12.5", "--budget-s",
                        "120.0", "--cublas-us", "321.5"]
    assert "--cublas-us" not in probe.child_argv("down", 1024, 12.5, 120.0, 0, [])
