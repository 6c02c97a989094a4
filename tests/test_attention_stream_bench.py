"""``benchmarks/attention_stream_bench.py`` on the CPU: its stream kernel, under the interpreter,
sums exactly the keys and values its torch reference gathers through the block table (and the
slab variant the consecutive blocks), on fresh random caches."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import test_kernels  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
attention_stream_bench = pytest.importorskip("attention_stream_bench")
attention_bench = pytest.importorskip("attention_bench")


@pytest.fixture
def batch(monkeypatch):
    """Five float32 sequences of 17-70 keys over a scattered block pool (attention_bench's layout)."""
    monkeypatch.setattr(attention_bench, "DEVICE", "cpu")
    monkeypatch.setattr(attention_bench, "SEED", int(torch.randint(1 << 30, ())))
    made = attention_bench.make_batch(5, 17, 70, 4, 2, 16)
    return {name: t.float() if t.is_floating_point() else t for name, t in made.items()}


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "slab"])
@pytest.mark.parametrize("tile_n", [16, 32])
def test_stream_kernel_sums_the_reference_keys_and_values(batch, gather, tile_n):
    got = attention_stream_bench.stream_kv_triton(batch, gather, tile_n, 4, 2)()
    expected = attention_stream_bench.stream_kv_torch(batch, gather)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_slab_reads_as_many_bytes_from_other_blocks(batch):
    """The slab names as many blocks per sequence as the table, consecutive and disjoint."""
    slab = attention_stream_bench.slab_tables(batch)
    counts = ((batch["seq_lens"] + 15) // 16).tolist()
    for i, count in enumerate(counts):
        assert slab[i, :count].tolist() == list(range(sum(counts[:i]), sum(counts[:i + 1])))
    assert not torch.equal(attention_stream_bench.stream_kv_torch(batch, False),
                           attention_stream_bench.stream_kv_torch(batch, True))
    assert attention_bench.kv_bytes_read(batch) == int(batch["seq_lens"].sum()) * 2 * 16 * 4 * 2


def test_a_row_times_every_launch_and_reports_its_bytes(monkeypatch):
    """One small bf16 batch through the whole row under the interpreter (the GPU timing replaced
    by a clock that counts calls): the engine's launch, each stream and torch's sum are timed,
    and the bytes are the batch's keys and values."""
    monkeypatch.setattr(attention_bench, "DEVICE", "cpu")
    monkeypatch.setitem(attention_bench.BATCHES, "3x[20,70]", (3, 20, 70))
    calls = []

    def fake_clock(fn) -> float:
        calls.append(fn)
        return 1e-3 * len(calls)
    monkeypatch.setattr(attention_stream_bench, "graph_seconds", fake_clock)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    kv_bytes, times = attention_stream_bench.measure_row("qwen3-0.6b", "3x[20,70]")
    lens = attention_bench.make_batch(3, 20, 70, 16, 8, 128)["seq_lens"]
    assert kv_bytes == int(lens.sum()) * 8 * 128 * 2 * 2
    engine = attention_bench.current_config((128, 2, 16), None)
    launches = {(engine.tile_n, engine.num_warps, engine.num_stages), *attention_stream_bench.STREAM_LAUNCHES}
    assert len(times) == len(calls) == 1 + len(launches) + 2
    assert next(iter(times)) == "attention (engine's launch)" and "stream slab 128/4w/2s" in times


def test_stream_programs_take_the_sequences_the_order_names(batch, monkeypatch):
    """Program (head, i) streams sequence ``decode_order(...)[i]``: an order naming only
    sequences 3 and 1 writes exactly their rows."""
    named = np.array([3, 1, 3, 1, 3], dtype=np.int32)
    monkeypatch.setattr(attention_stream_bench, "decode_order", lambda lens: named)
    call = attention_stream_bench.stream_kv_triton(batch, True, 16, 4, 2)
    out = call()
    out.fill_(float("nan"))
    got = call()
    expected = attention_stream_bench.stream_kv_torch(batch, True)
    torch.testing.assert_close(got[[1, 3]], expected[[1, 3]], rtol=1e-5, atol=1e-4)
    assert got[[0, 2, 4]].isnan().all()
