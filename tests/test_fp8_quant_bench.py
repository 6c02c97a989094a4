"""benchmarks/fp8_quant_bench.py under the Triton interpreter: every variant it times (the engine's
choice, one program a row, the split chunk widths) passes its own bitwise check at small widths,
and the check catches a launch whose values are off."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch


pytest.importorskip("triton")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_quant_bench.py"
_spec = importlib.util.spec_from_file_location("fp8_quant_bench", _PATH)
bench = sys.modules["fp8_quant_bench"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="checks the interpreter's run; on a GPU the bench checks itself")


@pytest.mark.parametrize("kind", ["quant", "silu"])
@pytest.mark.parametrize("split_block", [None, 0, 64, 256])
def test_every_variant_is_exact(kind, split_block):
    x = bench.inputs(kind, 3, 300, "cpu")
    assert bench.exact(kind, x, split_block)


def test_the_check_catches_wrong_values(monkeypatch):
    real = bench.quantize

    def off_by_one_step(kind, x, split_block, act_out=None):
        values, scales = real(kind, x, split_block, act_out)
        return (values.view(torch.uint8) ^ 1).view(values.dtype), scales

    monkeypatch.setattr(bench, "quantize", off_by_one_step)
    assert not bench.exact("quant", bench.inputs("quant", 2, 100, "cpu"), 0)
