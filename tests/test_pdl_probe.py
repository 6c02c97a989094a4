"""benchmarks/pdl_probe.py under the Triton interpreter: the probe's GEMV without PDL (the gdc_*
calls do not interpret) matches torch on ragged shapes, and the chain it times feeds each linear
the previous output and is checked per linear by a check that catches a stale or poisoned output."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch


pytest.importorskip("triton")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "pdl_probe.py"
_spec = importlib.util.spec_from_file_location("pdl_probe", _PATH)
probe = sys.modules["pdl_probe"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(probe)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="checks the interpreter's run; on a GPU the probe checks itself")
# Small stand-ins for qkv, o, gate_up, down: N and K ragged against the tiles, down's K > o's N.
SMALL_SHAPES = (("qkv", 40, 48), ("o", 48, 40), ("gate_up", 100, 48), ("down", 48, 72))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [probe.GemvConfig(16, 32), probe.GemvConfig(4, 64)])
def test_gemv_matches_torch(dtype, config):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 100, generator=generator).to(dtype)
    x = torch.randn(1, 100, generator=generator).to(dtype)
    out, _ = probe.probe_gemv(x, weight, config)
    reference = x.float() @ weight.float().T
    assert out.dtype == dtype and out.shape == (1, 37)
    torch.testing.assert_close(out.float(), reference, rtol=2e-3, atol=2e-3)


def test_chain_feeds_each_linear_the_previous_output_and_checks_it():
    layers = probe.make_layers(2, SMALL_SHAPES, dtype=torch.float32, device="cpu")
    x0 = torch.randn(1, SMALL_SHAPES[0][2], generator=torch.Generator().manual_seed(1))
    outputs = probe.run_chain(lambda x, w: probe.probe_gemv(x, w, probe.GemvConfig(16, 32))[0], x0, layers)
    assert [out.shape[1] for out in outputs] == [n for _ in layers for _, n, _ in SMALL_SHAPES]
    assert probe.chain_error(x0, layers, outputs) < 1e-5
    # the last down output from the layer's own input, as the torch chain computes it
    expected = x0
    for weights in layers:
        for weight in weights:
            expected = expected[:, :weight.shape[1]] @ weight.T
    torch.testing.assert_close(outputs[-1], expected, rtol=1e-5, atol=1e-5)


def test_chain_check_catches_a_stale_or_poisoned_output():
    layers = probe.make_layers(1, SMALL_SHAPES, dtype=torch.float32, device="cpu")
    x0 = torch.randn(1, SMALL_SHAPES[0][2], generator=torch.Generator().manual_seed(2))
    outputs = probe.run_chain(lambda x, w: x @ w.T, x0, layers)
    assert probe.chain_error(x0, layers, outputs) < 1e-6
    stale = list(outputs)
    stale[2] = torch.zeros_like(outputs[1][:, :1]) @ layers[0][2][:, :1].T  # gate_up read a zero x
    assert probe.chain_error(x0, layers, stale) > 0.5
    poisoned = [out.clone() for out in outputs]
    poisoned[1].fill_(float("nan"))
    assert math.isnan(probe.chain_error(x0, layers, poisoned))


def test_gemv_rejects_more_than_one_row():
    with pytest.raises(ValueError, match="one contiguous row of 8"):
        probe.probe_gemv(torch.zeros(2, 8), torch.zeros(4, 8), probe.GemvConfig(4, 8))


def test_summary_reports_the_saving_per_kernel_boundary_and_the_race_control():
    record = {"graph_ms": 5.0, "eager_ms": 6.0, "error": 1e-3, "eager_error": 1e-3}
    chain = {"no-pdl": record, "pdl": {**record, "graph_ms": 5.0 - 0.127, "eager_ms": 6.0 - 0.254},
             "pdl-prefetch": {"exception": "boom"},
             "pdl-no-wait": {**record, "error": float("nan")}}
    lines = probe.summarize(chain, 128, 4.25e9)
    saving = next(line for line in lines if line.startswith("pdl: saves"))
    for expected in ("1.00 us per kernel boundary", "127 us per chain", "eager 2.00 us"):
        assert expected in saving
    assert not any(line.startswith("pdl-prefetch: saves") for line in lines)
    assert any(line.startswith("pdl-prefetch ") and "FAILED" in line for line in lines)
    row = next(line for line in lines if line.startswith("no-pdl "))
    assert " 850 " in row and "20.0%" in row and " ok " in row  # 4.25 GB in 5 ms; the floor is 1 ms
    assert "WRONG" in next(line for line in lines if line.startswith("pdl-no-wait "))
    assert lines[-1].endswith("PDL overlap is live")
