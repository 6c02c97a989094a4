"""Tuned decode launches of the paged attention kernel (``kernels/attention_configs.py``): a
128-key tile and other warps/stages give the torch reference's output (under the interpreter on
the CPU), only default-mode decode launches take a table entry, and the table's checks refuse
configs that cannot run."""

from __future__ import annotations

import pytest
import torch

from test_kernels import TOLERANCE, _generator, make_batch  # sets TRITON_INTERPRET first

from pagedlab.kernels import attention_configs
from pagedlab.kernels.attention_configs import (DECODE_ATTENTION_CONFIGS, TILE_N, AttentionLaunch,
                                                DecodeConfig, attention_launch, check_decode_config,
                                                check_decode_configs)
from pagedlab.kernels.paged_attention import (CascadeBuffers, cascade_attention_triton, paged_attention_torch,
                                              paged_attention_triton)
from test_attention_variants import _free_blocks_before_windows

# Decode sequences (context_len, 1): one key, lengths around and past 128-key tiles.
DECODE_SEQS = [(0, 1), (99, 1), (127, 1), (128, 1), (200, 1), (300, 1), (383, 1)]
MAX_SEQ_LEN = 384
# (block_size, head_dim, group, dtype): GQA 1/2/4, a padded head dim, both test dtypes.
SHAPES = [(16, 64, 1, torch.float32), (32, 128, 2, torch.float16), (16, 64, 4, torch.float32),
          (32, 80, 2, torch.float32)]
TUNED = [DecodeConfig(128, 2, 2), DecodeConfig(128, 8, 4), DecodeConfig(64, 2, 4)]


def _shape_id(shape):
    block_size, head_dim, group, dtype = shape
    return f"bs{block_size}-d{head_dim}-g{group}-{str(dtype).removeprefix('torch.')}"


@pytest.fixture
def launches(monkeypatch):
    """(TILE_N, num_warps, num_stages) of every attention-kernel launch, in order."""
    from pagedlab.kernels import triton_kernels

    kernel, seen = triton_kernels.paged_attention_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((kwargs["TILE_N"], kwargs["num_warps"], kwargs["num_stages"]))
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(triton_kernels, "paged_attention_kernel", Recorder())
    return seen


def _tune(monkeypatch, batch, config: DecodeConfig) -> None:
    """List ``config`` for the batch's shape in DECODE_ATTENTION_CONFIGS (undone after the test)."""
    q, k_cache = batch["q"], batch["k_cache"]
    key = (q.shape[2], q.shape[1] // k_cache.shape[2], k_cache.element_size() * 8)
    check_decode_config(key, config)
    monkeypatch.setitem(DECODE_ATTENTION_CONFIGS, key, config)


def _check(batch, launches, expected_launch, **kwargs):
    scale = batch["q"].shape[-1] ** -0.5
    reference_args = {k: kwargs[k] for k in ("sliding_window", "softcap") if k in kwargs}
    expected = paged_attention_torch(**batch, scale=scale, **reference_args)
    got = paged_attention_triton(**batch, scale=scale, max_query_len=1, max_seq_len=MAX_SEQ_LEN, **kwargs)
    tol = TOLERANCE[batch["q"].dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    assert launches == [expected_launch]


@pytest.mark.parametrize("split", [None, 128, 256])
@pytest.mark.parametrize("config", TUNED, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_tuned_decode_matches_reference(shape, config, split, launches, monkeypatch):
    block_size, head_dim, group, dtype = shape
    batch = make_batch(DECODE_SEQS, 2, group, head_dim, block_size, dtype, _generator("tuned", shape, split))
    _tune(monkeypatch, batch, config)
    _check(batch, launches, (config.tile_n, config.num_warps, config.num_stages), split_kv_size=split)


@pytest.mark.parametrize("window, softcap, split", [(48, None, None), (100, 5.0, None), (None, 5.0, 128),
                                                    (130, None, 256)])
def test_tuned_decode_with_window_and_softcap(window, softcap, split, launches, monkeypatch):
    batch = make_batch(DECODE_SEQS, 2, 4, 64, 16, torch.float32, _generator("tuned-window", window, split))
    reference = batch | {"block_tables": batch["block_tables"].clone()}
    if window:
        _free_blocks_before_windows(batch, DECODE_SEQS, 16, window)
    config = DecodeConfig(128, 4, 2)
    _tune(monkeypatch, batch, config)
    scale = 0.125
    expected = paged_attention_torch(**reference, scale=scale, sliding_window=window, softcap=softcap)
    got = paged_attention_triton(**batch, scale=scale, max_query_len=1, max_seq_len=MAX_SEQ_LEN,
                                 split_kv_size=split, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert launches == [(128, 4, 2)]


@pytest.mark.parametrize("split", [None, 256])
def test_default_decode_is_unchanged(split, launches, monkeypatch):
    """Table empty for the shape (another shape listed): the 64-key tile, 4 warps, 3 stages."""
    batch = make_batch(DECODE_SEQS, 2, 2, 64, 16, torch.float16, _generator("default", split))
    monkeypatch.setitem(DECODE_ATTENTION_CONFIGS, (128, 2, 16), DecodeConfig(128, 8, 2))
    _check(batch, launches, (TILE_N, 4, 3), split_kv_size=split)


def test_split_not_a_multiple_of_the_tuned_tile_keeps_64(launches, monkeypatch):
    batch = make_batch(DECODE_SEQS, 2, 2, 64, 16, torch.float32, _generator("split-64"))
    _tune(monkeypatch, batch, DecodeConfig(128, 8, 2))
    _check(batch, launches, (TILE_N, 4, 3), split_kv_size=192)


def test_only_default_mode_decode_takes_the_table():
    """Batch-invariant decode, prefill and cascade halves keep 64-key tiles whatever is listed."""
    key, tuned = (128, 4, 16), DecodeConfig(128, 8, 2)
    table = {key: tuned}
    assert attention_launch(1, 4, 128, 16, table=table) == AttentionLaunch(16, 4, 128, 8, 2)
    assert attention_launch(1, 4, 128, 16, split_kv_size=256, table=table).tile_n == 128
    assert attention_launch(1, 4, 128, 16, split_kv_size=192, table=table).tile_n == TILE_N
    assert attention_launch(1, 4, 128, 16, batch_invariant_rows=64, table=table) == AttentionLaunch(
        64, 16, TILE_N, 4, 3)
    assert attention_launch(1, 4, 128, 16, tunable=False, table=table).tile_n == TILE_N
    assert attention_launch(2, 4, 128, 16, table=table) == AttentionLaunch(16, 4, TILE_N, 4, 3)
    assert attention_launch(1, 4, 128, 8, table=table).tile_n == TILE_N  # FP8 cache: another key
    assert attention_launch(1, 4, 128, 16, table={}) == AttentionLaunch(16, 4, TILE_N, 4, 3)
    assert attention_launch(1, 2, 256, 16, table={}).num_stages == 2  # Gemma's 256: two stages


def test_batch_invariant_and_cascade_launches_ignore_the_table(launches, monkeypatch):
    seqs = [(70, 1), (200, 1), (129, 1)]
    batch = make_batch(seqs, 2, 4, 64, 16, torch.float32, _generator("invariant-tuned"))
    _tune(monkeypatch, batch, DecodeConfig(128, 8, 2))
    expected = paged_attention_torch(**batch, scale=0.125)
    got = paged_attention_triton(**batch, scale=0.125, max_query_len=1, batch_invariant=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert launches == [(TILE_N, 4, 3)]
    launches.clear()
    buffers = CascadeBuffers.allocate(len(seqs), batch["q"].device)
    buffers.set_prefix_len(TILE_N)
    table = batch["block_tables"]
    table[1:, :TILE_N // 16] = table[0, :TILE_N // 16]  # every sequence starts with the same 64 keys
    expected = paged_attention_torch(**batch, scale=0.125)
    got = cascade_attention_triton(**batch, buffers=buffers, scale=0.125, max_seq_len=256)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert launches == [(TILE_N, 4, 3)] * 2


@pytest.mark.parametrize("key, config, message", [
    ((128, 2, 16), DecodeConfig(96, 4, 2), "tile_n=96"),
    ((128, 2, 16), DecodeConfig(128, 3, 2), "num_warps=3"),
    ((128, 2, 16), DecodeConfig(128, 4, 0), "num_stages=0"),
    ((128, 2, 12), DecodeConfig(), "kv_dtype_bits=12"),
    ((0, 2, 16), DecodeConfig(), "head_dim and group"),
    ((128, 0, 16), DecodeConfig(), "head_dim and group"),
    ((128, 2, 16), DecodeConfig(128, 4, 9), "num_stages=9"),
])
def test_impossible_decode_configs_are_refused(key, config, message):
    with pytest.raises(ValueError, match=message):
        check_decode_config(key, config)
    with pytest.raises(ValueError, match=message):
        check_decode_configs({key: config})


def test_possible_decode_configs_pass_and_the_table_is_valid():
    for config in (DecodeConfig(), DecodeConfig(128, 8, 3), DecodeConfig(128, 2, 2), DecodeConfig(64, 2, 4)):
        check_decode_config((128, 2, 16), config)
    check_decode_config((256, 2, 8), DecodeConfig(128, 4, 2))
    check_decode_config((80, 1, 32), DecodeConfig(128, 1, 1))
    check_decode_configs(attention_configs.DECODE_ATTENTION_CONFIGS)
