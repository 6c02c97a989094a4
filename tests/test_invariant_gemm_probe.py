"""benchmarks/invariant_gemm_probe.py under the Triton interpreter: every candidate (pointer or TMA
loads, persistent or one program per tile, segment total in registers or in scratch) is bitwise
the current batch-invariant kernel's output with the same block_k/split_k and row-invariant, a
different split_k is not (the control), and the probe's driver records, checks and summarizes
them (with a stand-in timer) and skips candidates past its budget."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
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

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "invariant_gemm_probe.py"
_spec = importlib.util.spec_from_file_location("invariant_gemm_probe", _SCRIPT)
probe = sys.modules["invariant_gemm_probe"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(probe)

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
    runner = probe.Probe(budget_s=1e9, device="cpu", seconds=lambda fn, calls: (fn(), 1e-3)[1])
    runner.shape("tiny", 96, 512, 40, probe.CPU_CANDIDATES)  # default config: 2 segments of 4 steps
    kernels = [r["kernel"] for r in runner.records]
    assert kernels[:2] == ["cublas", "table"]
    candidates = runner.records[2:]
    assert len(candidates) == len(probe.CPU_CANDIDATES) - 1  # the current kernel's own launch is not repeated
    assert all(probe.valid(r) for r in candidates), candidates
    assert all(r["block_k"] == 64 and r["split_k"] == 2 for r in candidates)
    [line] = probe.summarize(runner.records)
    assert line["best"] in [r["kernel"] for r in candidates] and line["best_us"] == pytest.approx(1e3)

    late = probe.Probe(budget_s=-1.0, device="cpu", seconds=lambda fn, calls: 1e-3)
    late.shape("tiny", 96, 512, 40, probe.CPU_CANDIDATES)
    assert all("skipped" in r for r in late.records[2:])
    assert probe.summarize(late.records)[0]["best"] is None


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

