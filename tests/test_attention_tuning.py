"""Prefill launches tuned at first use (``kernels/attention_tuning.py``): every candidate query
tile gives the torch reference's output (under the interpreter on the CPU; bitwise the untuned
launch's on the GPU), the tuner times its tuning batch and keeps the fastest, reuses it from
memory and from the cache file, re-tunes for another GPU or kernel, never times while a CUDA
graph is captured, and survives a broken cache file."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from test_kernels import TOLERANCE, _generator, make_batch  # sets TRITON_INTERPRET first

from pagedlab.kernels import attention_tuning
from pagedlab.kernels.attention_configs import TILE_N, AttentionLaunch, attention_launch
from pagedlab.kernels.attention_tuning import (PrefillShape, PrefillTileTuner, prefill_candidates,
                                               query_bucket, tuning_prompts)
from pagedlab.kernels.paged_attention import paged_attention_torch, paged_attention_triton

# (context_len, query_len): a fresh prefill, a chunk after a context, a decode, a short prompt.
SEQS = [(0, 37), (50, 20), (100, 1), (0, 5)]
SHAPE = PrefillShape(head_dim=128, group=4, num_kv_heads=8, q_dtype="bfloat16", kv_dtype_bits=16,
                     sliding=False, softcap=False, query_bucket=512, rule_block_m=64)


class FixedTuner:
    """Stands in for the tuner: every launch it is asked for is ``launch``."""

    def __init__(self, launch: AttentionLaunch):
        self.fixed, self.shapes = launch, []

    def launch(self, shape, fingerprint, default, make_run):
        self.shapes.append(shape)
        return self.fixed


def _batch_and_reference(group, dtype, key, **kwargs):
    batch = make_batch(SEQS, 2, group, 64, 16, dtype, _generator("tuning", group, key))
    scale = batch["q"].shape[-1] ** -0.5
    return batch, scale, paged_attention_torch(**batch, scale=scale, **kwargs)


@pytest.mark.parametrize("group, dtype", [(1, torch.float32), (2, torch.float16), (4, torch.float32)])
def test_every_query_tile_matches_reference(group, dtype):
    """Both classes' tiles (the tuner keeps to the rule's, the kernel runs any)."""
    batch, scale, expected = _batch_and_reference(group, dtype, "plain")
    rule = attention_launch(37, group, 64, dtype.itemsize * 8)
    shape = PrefillShape(64, group, 2, str(dtype).removeprefix("torch."), dtype.itemsize * 8, False, False,
                         query_bucket(37), rule.block_m)
    assert {launch.block_m for launch in prefill_candidates(shape)} == {64, 128}
    for block_m in (16, 32, 64, 128):
        tuner = FixedTuner(AttentionLaunch(block_m, block_m // group, TILE_N, 4, 2))
        got = paged_attention_triton(**batch, scale=scale, max_query_len=37, prefill_tuner=tuner)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol, msg=str(block_m))
        assert tuner.shapes == [shape]


def test_candidate_tiles_with_window_and_softcap_match_reference():
    window, softcap = 24, 30.0
    batch, scale, expected = _batch_and_reference(2, torch.float32, "variants", sliding_window=window,
                                                  softcap=softcap)
    for block_m in (16, 128):
        tuner = FixedTuner(AttentionLaunch(block_m, block_m // 2, TILE_N, 8, 2))
        got = paged_attention_triton(**batch, scale=scale, max_query_len=37, sliding_window=window,
                                     softcap=softcap, prefill_tuner=tuner)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert tuner.shapes[0].sliding and tuner.shapes[0].softcap


def test_decode_and_batch_invariant_launches_are_never_tuned():
    batch, scale, _ = _batch_and_reference(2, torch.float32, "untuned")
    tuner = FixedTuner(AttentionLaunch(128, 64, TILE_N, 8, 2))
    decode = {name: t for name, t in batch.items()}
    decode["query_start_loc"] = torch.arange(5, dtype=torch.int32)
    decode["seq_lens"] = torch.tensor([37, 70, 101, 5], dtype=torch.int32)
    decode["q"] = batch["q"][:4]
    paged_attention_triton(**decode, scale=scale, max_query_len=1, prefill_tuner=tuner)
    paged_attention_triton(**batch, scale=scale, max_query_len=37, batch_invariant=True, prefill_tuner=tuner)
    assert tuner.shapes == []


def test_candidates_stay_in_the_rules_tensor_core_class():
    assert {(c.block_m, c.num_warps, c.num_stages) for c in prefill_candidates(SHAPE)} == {
        (64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3)}
    assert all(c.block_q * 4 == c.block_m and c.tile_n == TILE_N for c in prefill_candidates(SHAPE))
    short = PrefillShape(64, 1, 4, "bfloat16", 16, False, False, query_bucket(8), rule_block_m=16)
    assert {(c.block_m, c.num_warps) for c in prefill_candidates(short)} == {(16, 2), (16, 4), (32, 2),
                                                                            (32, 4)}
    wide = PrefillShape(128, 32, 1, "bfloat16", 16, False, False, 2, rule_block_m=32)
    assert {c.block_m for c in prefill_candidates(wide)} == {32}
    gemma = PrefillShape(256, 2, 8, "bfloat16", 16, True, True, 64, rule_block_m=64)
    assert {c.num_stages for c in prefill_candidates(gemma)} == {1, 2}
    assert query_bucket(1) == 1 and query_bucket(37) == 64 and query_bucket(100_000) == 8192
    assert tuning_prompts(64) == [64] * 128 and tuning_prompts(8192) == [512] * 16
    assert tuning_prompts(2) == [2] * 256
    assert attention_launch(512, 4, 128, 16) in prefill_candidates(SHAPE)


def test_tuner_times_its_tuning_batch_and_the_call_keeps_the_reference(tmp_path, monkeypatch):
    """The real tuning run under the interpreter: every candidate runs on the bucket's tuning
    batch (not the call's 63 tokens), then the call's launch takes the fastest and gives the
    reference's output."""
    from pagedlab.kernels import triton_kernels

    kernel, seen = triton_kernels.paged_attention_kernel, []

    class Recorder:
        fn = kernel.fn

        def __getitem__(self, grid):
            def launch(q, *args, **kwargs):
                seen.append((q.shape[0], kwargs["BLOCK_M"], kwargs["num_warps"], kwargs["num_stages"]))
                return kernel[grid](q, *args, **kwargs)
            return launch
    monkeypatch.setattr(triton_kernels, "paged_attention_kernel", Recorder())
    monkeypatch.setattr(attention_tuning, "TUNING_BATCH_TOKENS", 128)  # two 64-token prompts
    batch, scale, expected = _batch_and_reference(2, torch.float32, "tuned")
    tuner = PrefillTileTuner(tmp_path / "tiles.json", lambda run: (run(), 1.0 if seen[-1][1:] == (128, 4, 2)
                                                                   else 2.0)[1])
    got = paged_attention_triton(**batch, scale=scale, max_query_len=37, prefill_tuner=tuner)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert [tokens for tokens, *_ in seen[:-1]] == [128] * 8
    assert seen[-1] == (63, 128, 4, 2)


def _tuner(path, times: dict[tuple[int, int, int], float]):
    """A tuner whose timer runs the launch and reports ``times[(block_m, warps, stages)]``
    (default 5 ms), and the list of the launches it ran."""
    timed: list[AttentionLaunch] = []

    def timer(run):
        run()
        launch = timed[-1]
        return times.get((launch.block_m, launch.num_warps, launch.num_stages), 5.0)
    return PrefillTileTuner(path, timer), timed


def _tune(tuner, timed, shape=SHAPE, fingerprint="H200|triton 3.6|abc"):
    rule = attention_launch(512, shape.group, shape.head_dim, 16)
    return tuner.launch(shape, fingerprint, rule, lambda: timed.append)


def test_tuner_keeps_the_fastest_candidate(tmp_path):
    tuner, timed = _tuner(tmp_path / "tiles.json", {(128, 8, 3): 2.0, (64, 8, 2): 1.5, (64, 4, 3): 3.0})
    assert _tune(tuner, timed) == AttentionLaunch(64, 16, TILE_N, 8, 2)
    assert timed == prefill_candidates(SHAPE)
    assert _tune(tuner, timed) == AttentionLaunch(64, 16, TILE_N, 8, 2)
    assert len(timed) == 8  # known: not timed again


def test_tuned_launch_is_read_back_from_the_cache_file(tmp_path):
    path = tmp_path / "cache" / "tiles.json"
    _tune(*_tuner(path, {(128, 8, 3): 1.0}))
    stored = json.loads(path.read_text())
    assert list(stored.values()) == [{"block_m": 128, "block_q": 32, "tile_n": TILE_N, "num_warps": 8,
                                      "num_stages": 3}]
    assert next(iter(stored)) == f"H200|triton 3.6|abc|{SHAPE.cache_key()}"
    fresh, timed = _tuner(path, {})
    assert _tune(fresh, timed) == AttentionLaunch(128, 32, TILE_N, 8, 3)
    assert timed == []
    _tune(fresh, timed, fingerprint="H100|triton 3.6|abc")  # another GPU: timed, and both kept
    assert len(timed) == 8 and len(json.loads(path.read_text())) == 2


def test_broken_cache_file_is_ignored_and_rewritten(tmp_path, caplog):
    path = tmp_path / "tiles.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=attention_tuning.__name__):
        assert _tune(*_tuner(path, {(64, 8, 3): 1.0})) == AttentionLaunch(64, 16, TILE_N, 8, 3)
    assert "ignoring the prefill tile cache" in caplog.text
    assert len(json.loads(path.read_text())) == 1


def test_nothing_is_timed_while_a_graph_is_captured(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    tuner, timed = _tuner(tmp_path / "tiles.json", {(128, 4, 2): 0.1})
    assert _tune(tuner, timed) == attention_launch(512, 4, 128, 16)
    assert timed == [] and not (tmp_path / "tiles.json").exists()


def test_no_memory_for_the_tuning_batch_keeps_the_rule_without_caching_it(tmp_path, caplog):
    def no_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    tuner = PrefillTileTuner(tmp_path / "tiles.json", timer=lambda run: 1.0)
    rule = attention_launch(512, 4, 128, 16)
    with caplog.at_level(logging.WARNING, logger=attention_tuning.__name__):
        assert tuner.launch(SHAPE, "H200", rule, no_memory) == rule
        assert tuner.launch(SHAPE, "H200", rule, no_memory) == rule  # not tried again
    assert caplog.text.count("no GPU memory to tune") == 1 and not (tmp_path / "tiles.json").exists()


def test_candidate_that_does_not_fit_is_skipped(tmp_path):
    from triton.runtime.errors import OutOfResources

    timed: list[AttentionLaunch] = []

    def timer(run):
        run()
        if timed[-1].block_m == 128:
            raise OutOfResources(300_000, 232_448, "shared memory")
        return 10.0 / timed[-1].block_m
    assert _tune(PrefillTileTuner(tmp_path / "tiles.json", timer), timed).block_m == 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("group, head_dim, query_len",
                         [(4, 128, 512), (1, 64, 512), (2, 256, 512), (1, 128, 8)])
def test_gpu_candidates_are_bitwise_the_untuned_launch(group, head_dim, query_len, tmp_path):
    """At real sizes, in both tensor-core classes: every candidate bitwise the rule's launch, and
    the tuner's pick cached."""
    seqs = [(0, query_len)] * 6 + [(1500, min(query_len, 300)), (3000, 1)]
    batch = make_batch(seqs, 8, group, head_dim, 16, torch.bfloat16, _generator("gpu", group), device="cuda")
    scale = head_dim ** -0.5
    untuned = paged_attention_triton(**batch, scale=scale, max_query_len=query_len)
    rule = attention_launch(query_len, group, head_dim, 16)
    shape = PrefillShape(head_dim, group, 8, "bfloat16", 16, False, False, query_bucket(query_len),
                         rule.block_m)
    for launch in prefill_candidates(shape):
        fixed = FixedTuner(launch)
        got = paged_attention_triton(**batch, scale=scale, max_query_len=query_len, prefill_tuner=fixed)
        assert torch.equal(got, untuned), launch
    tuner = PrefillTileTuner(tmp_path / "tiles.json")
    tuned = paged_attention_triton(**batch, scale=scale, max_query_len=query_len, prefill_tuner=tuner)
    assert torch.equal(tuned, untuned)
    stored = json.loads((tmp_path / "tiles.json").read_text())
    assert [key.endswith(shape.cache_key()) for key in stored] == [True]
