"""``benchmarks/lora_bench.py`` on the CPU: one small linear's records through the whole
measurement path (the kernels under the Triton interpreter in float16, the GPU timing replaced by
a fake clock), the fused GEMV timed only where the GEMV table lists the shape, and the decode-step
sums of the records."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import test_lora_kernels  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)
import torch

from pagedlab.kernels import gemv_configs
from pagedlab.kernels.gemv_configs import TileConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
lora_bench = pytest.importorskip("lora_bench")


@pytest.fixture
def fake_clock(monkeypatch):
    """Every timed call runs once and takes 2 us; float16 (the interpreter's bf16 dot is wrong)."""
    timed = []
    monkeypatch.setattr(lora_bench, "graph_seconds", lambda fn: timed.append(fn()) or 2e-6)
    monkeypatch.setattr(lora_bench, "DTYPE", torch.float16)
    monkeypatch.setattr(gemv_configs, "DENSE_GEMV_CONFIGS", {})
    return timed


@pytest.mark.parametrize("tokens", [1, 3])
def test_bench_linear_times_the_fused_path_where_the_gemv_runs(fake_clock, tokens):
    sizes, k = [32, 16, 16], 64
    config = TileConfig(block_n=16, block_k=32)
    gemv_configs.DENSE_GEMV_CONFIGS[(gemv_configs.row_bucket(tokens), 64, k)] = config
    gen = torch.Generator(device=lora_bench.DEVICE).manual_seed(tokens)
    fused = lora_bench.bench_linear(k, sizes, tokens, 4, 8, False, gen)
    assert fused["ok"] and fused["fused_us"] == 2.0 and fused["fused_config"] == asdict(config)
    assert fused["gemv_config"] == fused["fused_config"]
    assert fused["fused_error"] <= fused["fused_tolerance"] and fused["max_error"] <= fused["tolerance"]
    assert len(fake_clock) == 8  # cuBLAS, engine base, shrink, expand, both, the linear with LoRA 3 ways
    plain = lora_bench.bench_linear(k, [48], tokens, 4, 8, False, gen)  # no table entry: cuBLAS
    assert plain["ok"] and plain["fused_us"] is None and plain["gemv_config"] is None
    line = lora_bench.format_record(dict(plain, layer="o", k=k, sizes=[48], tokens=tokens))
    assert "engine base    2.0 (cuBLAS)" in line and "fused -" in line


def test_step_sums_count_the_fused_linear_in_place_of_the_expand():
    def record(gemv, separate, fused):
        return dict(tokens=1, lora_us=7.0, base_us=20.0, with_base_us=26.0, gemv_us=gemv,
                    separate_us=separate, fused_us=fused)
    step = lora_bench.step_sums([record(10.0, 18.0, 13.0), record(30.0, 37.0, None)], layers=32)
    assert step["lora_ms"] == pytest.approx(32 * 14 / 1e3)
    assert step["added_with_overlap_ms"] == pytest.approx(32 * 12 / 1e3)
    assert step["engine_base_ms"] == pytest.approx(32 * 40 / 1e3)
    assert step["separate_added_ms"] == pytest.approx(32 * 15 / 1e3)
    assert step["engine_added_ms"] == pytest.approx(32 * 10 / 1e3)  # 3 fused + 7 separate
    assert (step["fused_linears"], step["linears"]) == (1, 2)
    assert "1 of 2 linears fused" in lora_bench.format_step(step)
