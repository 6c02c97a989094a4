"""The fused MoE Triton kernels against their plain-torch references (``moe_torch``; the routing
and sort by expert against ``select_experts`` + ``align_by_expert``), under the Triton
interpreter on the CPU (float32, small) and at real model sizes on a GPU, on both the grouped
path and the decode GEMV path; the config tables and the choice between the paths."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch


pytest.importorskip("triton")

from pagedlab.kernels import fused_moe_configs
from pagedlab.kernels import fused_moe
from pagedlab.kernels.fused_moe import (align_by_expert, fused_moe_triton, moe_torch, route_and_align_torch,
                                        route_and_align_triton, route_warps, select_experts)
from pagedlab.kernels.fused_moe_configs import (MOE_GEMV_MAX_EXPERTS, MOE_GEMV_MAX_TOKENS, MoeConfig,
                                                MoeGemmConfig, MoeGemvConfig,
                                                MoeGemvLaunch, default_moe_config, default_route_num_warps,
                                                moe_config, moe_gemv_config)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _moe_inputs(num_tokens, hidden, inter, num_experts, dtype=torch.float32, seed=0, skew=0.0):
    x, logits = _activations(num_tokens, hidden, num_experts, dtype, seed, skew)
    g = torch.Generator(DEVICE).manual_seed(seed + 1)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=DEVICE) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=DEVICE) * inter ** -0.5
    return x, logits, w13.to(dtype), w2.to(dtype)


def _activations(num_tokens, hidden, num_experts, dtype, seed=0, skew=0.0):
    g = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g, device=DEVICE)
    logits = torch.randn(num_tokens, num_experts, generator=g, device=DEVICE)
    logits[:, 0] += skew  # skew > 0 crowds expert 0 (several row blocks), leaving others empty
    return x.to(dtype), logits.to(dtype)


def _distinct_logits(num_tokens, num_experts, seed):
    """Float32 logits 0.05 apart within each token (a random order of the experts): at GPU sizes
    random ones come within exp's rounding of each other somewhere (and bf16 ones tie), where two
    top-k's may choose differently."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    order = torch.rand(num_tokens, num_experts, generator=g, device=DEVICE)
    return torch.argsort(order, dim=-1).float() * 0.05


def test_align_by_expert_sorts_pairs_into_padded_runs():
    experts = torch.tensor([[3, 0], [0, 1], [3, 0]])
    sorted_pairs, block_experts = align_by_expert(experts, 4, 4)
    pad = 6
    assert sorted_pairs.tolist()[:12] == [1, 2, 5, pad, 3, pad, pad, pad, 0, 4, pad, pad]
    assert block_experts.tolist()[:3] == [0, 1, 3]
    assert (block_experts[3:] == -1).all() and (sorted_pairs[12:] == pad).all()


def _assert_same_routing(got, expected):
    """Exactly the same experts, sorted pairs and row blocks; weights within float rounding."""
    assert torch.equal(got.experts.long(), expected.experts.long())
    assert torch.equal(got.sorted_pairs, expected.sorted_pairs)
    assert torch.equal(got.block_experts, expected.block_experts)
    torch.testing.assert_close(got.weights, expected.weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m, renormalize, skew", [
    # one token block (the route kernel sorts too):
    (1, 8, 2, 16, True, 0.0),  # decode
    (37, 8, 2, 32, True, 3.0),  # crowded expert 0: several row blocks, some experts empty
    (70, 16, 3, 16, False, 0.0),  # top_k not a power of two, unnormalized
    (5, 6, 6, 16, False, 0.0),  # every expert chosen; experts not a power of two
    # several token blocks (route, then align):
    (600, 8, 2, 64, False, 3.0),  # two blocks, crowded expert 0
    (300, 128, 8, 16, True, 0.0),  # Qwen3-MoE routing: 19 token blocks, counts summed in chunks
    # row blocks in chunks of 2048 // block_m = 16: 18 row blocks in one program, then in program 0
    (70, 16, 3, 128, True, 0.0),
    (600, 8, 2, 128, True, 3.0),
])
def test_route_and_align_triton_matches_torch(num_tokens, num_experts, top_k, block_m, renormalize, skew):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_tokens))
    logits[:, 0] += skew
    logits = logits.to(DEVICE)
    _assert_same_routing(route_and_align_triton(logits, top_k, renormalize, block_m, torch.float32),
                         route_and_align_torch(logits, top_k, renormalize, block_m, torch.float32))


def _count_route_warps(monkeypatch) -> list[int]:
    """The ``num_warps`` of each route kernel launch (each still runs)."""
    from pagedlab.kernels import fused_moe_kernels

    warps, kernel = [], fused_moe_kernels.moe_route_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                warps.append(kwargs["num_warps"])
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(fused_moe_kernels, "moe_route_kernel", Recorded())
    return warps


@pytest.mark.parametrize("num_experts, top_k", [(128, 8), (8, 2)], ids=["qwen3-30b-a3b", "mixtral"])
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 8])
def test_route_and_align_triton_at_decode_batches(num_tokens, num_experts, top_k, monkeypatch):
    """Decode batches at the model routings (one route launch; a chunk of as many row blocks as
    pairs), at the default warps and at each warp count the bench sweeps."""
    warps = _count_route_warps(monkeypatch)
    logits = _distinct_logits(num_tokens, num_experts, seed=num_tokens)
    expected = route_and_align_torch(logits, top_k, True, 16, torch.float32)
    for num_warps in (None, 1, 2, 4, 8):
        got = route_and_align_triton(logits, top_k, True, 16, torch.float32, num_warps)
        _assert_same_routing(got, expected)
    # one program (top_k a power of two): the measured table's warps, else the heuristic's
    default = fused_moe_configs.ROUTE_NUM_WARPS.get((num_experts, top_k, num_tokens),
                                                    default_route_num_warps(num_tokens * top_k, num_experts))
    assert warps == [default, 1, 2, 4, 8] and route_warps(num_tokens, num_experts, top_k) == default


def test_route_warps_follow_the_table_and_else_the_work_size(monkeypatch):
    assert [default_route_num_warps(8 * t, 128) for t in (1, 2, 4, 8, 16)] == [1, 1, 8, 8, 8]
    assert [default_route_num_warps(2 * t, 8) for t in (1, 8, 64, 512)] == [1, 1, 4, 8]
    monkeypatch.setattr(fused_moe_configs, "ROUTE_NUM_WARPS", {(8, 2, 3): 2})
    warps = _count_route_warps(monkeypatch)
    for num_tokens in (3, 4):
        logits = _distinct_logits(num_tokens, 8, seed=num_tokens)
        _assert_same_routing(route_and_align_triton(logits, 2, True, 16, torch.float32),
                             route_and_align_torch(logits, 2, True, 16, torch.float32))
    assert warps == [2, default_route_num_warps(8, 8)]


@pytest.mark.parametrize("num_warps", [0, 3, 64])
def test_route_and_align_rejects_bad_warps(num_warps):
    with pytest.raises(ValueError, match=f"num_warps={num_warps} must be a power of two from 1 to 32"):
        route_and_align_triton(torch.zeros(2, 8, device=DEVICE), 2, True, 16, torch.float32, num_warps)


def test_route_and_align_rejects_top_k_above_experts():
    with pytest.raises(ValueError, match="top_k=9 must be between 1 and the number of experts \\(8\\)"):
        route_and_align_triton(torch.zeros(2, 8, device=DEVICE), 9, True, 16, torch.float32)


@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k, renormalize, skew, config", [
    (1, 64, 48, 8, 2, True, 0.0, None),  # decode: one pair per expert block
    (37, 64, 48, 8, 2, True, 0.0, None),  # Mixtral-like routing, ragged intermediate size
    (70, 96, 80, 8, 2, False, 3.0, None),  # Qwen3-MoE-like unnormalized weights, crowded and empty experts
    (9, 32, 16, 16, 4, True, 0.0, None),  # hidden and intermediate below one tile
    # explicit tiles: K split 3 (a ragged last segment, one empty), grouped row blocks, 32-row blocks
    (37, 64, 80, 8, 2, False, 3.0, MoeConfig(32, MoeGemmConfig(16, 32, 4), MoeGemmConfig(32, 16, 2, 3))),
    (37, 64, 48, 8, 2, True, 0.0, MoeConfig(16, MoeGemmConfig(32, 64, 2), MoeGemmConfig(16, 32, 1, 2))),
])
def test_fused_moe_matches_reference(num_tokens, hidden, inter, num_experts, top_k, renormalize, skew,
                                     config):
    x, logits, w13, w2 = _moe_inputs(num_tokens, hidden, inter, num_experts, skew=skew)
    expected = moe_torch(x, logits, w13, w2, top_k, renormalize)
    got = fused_moe_triton(x, logits, w13, w2, top_k, renormalize, config)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("config", [None, MoeConfig(16, MoeGemmConfig(32, 32), MoeGemmConfig(16, 16, 1, 3))],
                         ids=["default", "split-k"])
def test_fused_moe_grouped_path_in_bfloat16(config):
    """bf16 weights and activations on the grouped GEMMs (the Triton backend runs them for a bf16
    model, on the CPU under the interpreter too, whose tl.dot is wrong for bf16): within bf16
    rounding of the float32 reference, as close as ``moe_torch`` in bf16 comes."""
    x, logits, w13, w2 = _moe_inputs(37, 64, 48, 8, torch.bfloat16, seed=5)
    expected = moe_torch(x.float(), logits.float(), w13.float(), w2.float(), 2, True)
    got = fused_moe_triton(x, logits, w13, w2, 2, True, config)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=2e-2)


def test_fused_moe_of_no_tokens_is_empty_as_the_reference():
    """A batch of no tokens on the default config (the heuristic's, for a shape no table lists)."""
    x, logits, w13, w2 = _moe_inputs(0, 40, 44, 8)
    expected = moe_torch(x, logits, w13, w2, 2, True)
    got = fused_moe_triton(x, logits, w13, w2, 2, True)
    assert got.shape == expected.shape == (0, 40) and got.dtype == expected.dtype


def test_fused_moe_rejects_mismatched_weights():
    x, logits, w13, w2 = _moe_inputs(4, 32, 16, 8)
    with pytest.raises(ValueError, match="must be \\[experts, 2 \\* inter"):
        fused_moe_triton(x, logits, w13, w2[:, :, :8], 2, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(2048, 768, 128, 8, True), (4096, 14336, 8, 2, True)],
                         ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_fused_moe_at_model_sizes_on_gpu(shape):
    """Real expert shapes in bf16 (two layers' worth of weights), decode to prefill token counts
    (each with its table or default config): the routing and sort equal to the torch ops, the
    fused MLP within bf16 rounding of the float32 reference (``_distinct_logits``)."""
    hidden, inter, num_experts, top_k, renormalize = shape
    for layer in range(2):
        _, _, w13, w2 = _moe_inputs(1, hidden, inter, num_experts, torch.bfloat16, seed=2 * layer)
        w13_ref, w2_ref = w13.float(), w2.float()
        for num_tokens in (1, 8, 64, 256, 2048):
            x, _ = _activations(num_tokens, hidden, num_experts, torch.bfloat16, seed=num_tokens)
            logits = _distinct_logits(num_tokens, num_experts, seed=num_tokens)
            _assert_same_routing(route_and_align_triton(logits, top_k, renormalize, 16, torch.float32),
                                 route_and_align_torch(logits, top_k, renormalize, 16, torch.float32))
            expected = moe_torch(x.float(), logits, w13_ref, w2_ref, top_k, renormalize)
            got = fused_moe_triton(x, logits, w13, w2, top_k, renormalize).float()
            torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2, msg=f"{num_tokens} tokens")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_experts, top_k", [(128, 8), (8, 2)], ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_route_and_align_at_every_swept_warp_count_on_gpu(num_experts, top_k):
    """The compiled routing at each warp count moe_bench sweeps (and the default), decode to
    prefill token counts: the same routing as the torch ops."""
    for num_tokens in (1, 2, 4, 8, 64, 2048):
        logits = _distinct_logits(num_tokens, num_experts, seed=num_tokens)
        expected = route_and_align_torch(logits, top_k, True, 16, torch.float32)
        for num_warps in (None, 1, 2, 4, 8):
            got = route_and_align_triton(logits, top_k, True, 16, torch.float32, num_warps)
            _assert_same_routing(got, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_moe_replays_in_a_cuda_graph():
    """Captured once at a decode batch (Qwen3-30B-A3B experts), replayed on new tokens and logits:
    no host sync, no shape from the routing, so each replay equals the reference on its inputs."""
    hidden, inter, num_experts, top_k = 2048, 768, 128, 8
    x, _, w13, w2 = _moe_inputs(8, hidden, inter, num_experts, torch.bfloat16)
    logits = torch.zeros(8, num_experts, device=DEVICE)
    fused_moe_triton(x, logits, w13, w2, top_k, True)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, logits, w13, w2, top_k, True)
    for seed in (1, 2):
        new_x, _ = _activations(8, hidden, num_experts, torch.bfloat16, seed)
        new_logits = _distinct_logits(8, num_experts, seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        expected = moe_torch(new_x.float(), new_logits, w13.float(), w2.float(), top_k, True)
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_moe_config_takes_the_nearest_measured_token_count(monkeypatch):
    small = MoeConfig(16, MoeGemmConfig(32, 128), MoeGemmConfig(64, 128, split_k=2))
    large = MoeConfig(64, MoeGemmConfig(128, 64, 8), MoeGemmConfig(128, 64, 8))
    table = {(8, 64, 48, 2, 1): small, (8, 64, 48, 2, 256): large}
    monkeypatch.setattr(fused_moe_configs, "MOE_CONFIGS", table)
    assert moe_config(1, 8, 64, 48, 2) is small
    assert moe_config(16, 8, 64, 48, 2) is small  # as near 1 as 256 in log2: the smaller
    assert moe_config(17, 8, 64, 48, 2) is large
    assert moe_config(4096, 8, 64, 48, 2) is large
    assert moe_config(1, 8, 64, 96, 2) == default_moe_config(1, 8, 64, 96, 2)  # a shape not measured


@pytest.mark.parametrize("num_experts, hidden, inter, top_k", [(128, 2048, 768, 8), (8, 4096, 14336, 2)])
def test_default_and_table_configs_are_valid_and_fill_the_sms_at_decode(num_experts, hidden, inter, top_k):
    for config in fused_moe_configs.MOE_CONFIGS.values():
        config.check()
    for num_tokens in (1, 2, 8, 64, 256, 2048, 16384):
        default_moe_config(num_tokens, num_experts, hidden, inter, top_k).check()
    decode = default_moe_config(1, num_experts, hidden, inter, top_k)
    programs = {launch: top_k * -(-n // gemm.block_n) * gemm.split_k
                for launch, n, gemm in (("gate_up", inter, decode.gate_up), ("down", hidden, decode.down))}
    assert min(programs.values()) >= 132, programs


@pytest.mark.parametrize("config, message", [
    (MoeConfig(16, MoeGemmConfig(32, 64, split_k=2), MoeGemmConfig(32, 64)), "gate/up cannot split K"),
    (MoeConfig(16, MoeGemmConfig(48, 64), MoeGemmConfig(32, 64)), "block_n=48 must be a power of two"),
    (MoeConfig(8, MoeGemmConfig(32, 64), MoeGemmConfig(32, 64)), "block_m=8 must be >= 16"),
    (MoeConfig(16, MoeGemmConfig(32, 64), MoeGemmConfig(32, 8)), "need block_n and block_k >= 16"),
])
def test_moe_config_check_rejects_what_cannot_run(config, message):
    with pytest.raises(ValueError, match=message):
        config.check()


def _gemv(gate_up: tuple, down: tuple) -> MoeGemvConfig:
    return MoeGemvConfig(MoeGemvLaunch(*gate_up), MoeGemvLaunch(*down))


@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize, hidden, inter, config", [
    # decode, every expert chosen; K steps dividing hidden and inter (EVEN_K), column tiles
    # dividing both, prefetch
    (1, 8, 8, True, 64, 48, _gemv((16, 32), (32, 16))),
    # top_k 1 (no fold); block_k past hidden and inter (one masked step); 48 columns in tiles of 32
    (2, 8, 1, False, 64, 48, _gemv((32, 128, 4, 1), (16, 64, 4, 1))),
    # Qwen3-MoE-like top-8 of 64 experts; hidden 40 and inter 24 in masked steps, a ragged column tile
    (3, 64, 8, True, 40, 24, _gemv((32, 16, 4, 1), (64, 16, 2, 2))),
    (4, 64, 8, False, 32, 16, _gemv((16, 16, 2), (32, 8, 2, 1))),  # unnormalized; 2 warps: one row of 64
    (5, 8, 2, False, 64, 48, _gemv((16, 64, 2, 3), (32, 16, 8))),  # one K step with prefetch; 8 warps
    (6, 64, 2, True, 48, 40, _gemv((64, 16), (32, 32, 2, 2))),  # one column tile past inter; masked prefetch
    (7, 8, 2, True, 32, 16, _gemv((16, 8), (32, 8))),  # 14 pairs of 8 experts: pairs share experts
    (8, 8, 2, True, 64, 48, _gemv((32, 64), (64, 32, 4, 1))),  # the largest GEMV batch
    # down by token (all_pairs): top-8 with prefetch; top-1; masked steps and a ragged column tile
    (1, 8, 8, True, 64, 48, _gemv((16, 32), (32, 16, 4, 2, True))),
    (2, 8, 1, False, 64, 48, _gemv((32, 128, 4, 1), (16, 64, 4, 1, True))),
    (3, 64, 8, True, 40, 24, _gemv((32, 16, 4, 1), (64, 16, 2, 2, True))),
    (2, 8, 6, True, 32, 16, _gemv((16, 16), (8, 16, 2, 1, True))),  # top-6: two masked slots of 8
])
def test_fused_moe_gemv_matches_reference(num_tokens, num_experts, top_k, renormalize, hidden, inter, config):
    """The two-launch GEMV path (routing fused into gate/up, the down shares folded per token)
    against ``moe_torch``, in float32 and float16, with the fused routing's experts equal to
    ``select_experts``'s (``_distinct_logits``: no ties, which ``torch.topk`` breaks its own way)
    and weights within rounding; the down launch gives the same output bit for bit twice (the
    slot-order fold), and within float32 rounding of the other form of the down launch (a
    program per pair or per token: the same shares in the same order)."""
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x, _, w13, w2 = _moe_inputs(num_tokens, hidden, inter, num_experts, dtype,
                                    seed=10 * num_tokens + top_k)
        logits = _distinct_logits(num_tokens, num_experts, seed=num_tokens) * 20 - 8
        expected = moe_torch(x.float(), logits, w13.float(), w2.float(), top_k, renormalize)
        got = fused_moe_triton(x, logits, w13, w2, top_k, renormalize, config)
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
        activated, weights, experts = fused_moe.moe_gate_up_gemv_triton(x, logits, w13, top_k, renormalize,
                                                                        config.gate_up)
        ref_weights, ref_experts = select_experts(logits, top_k, renormalize, dtype)
        assert experts.dtype == torch.int32 and torch.equal(experts.long(), ref_experts)
        torch.testing.assert_close(weights, ref_weights, atol=tolerance, rtol=tolerance)
        if dtype == torch.float32:
            again = fused_moe.moe_down_gemv_triton(activated, w2, weights, experts, config.down)
            assert torch.equal(again, got)
            other = replace(config.down, all_pairs=not config.down.all_pairs)
            other_form = fused_moe.moe_down_gemv_triton(activated, w2, weights, experts, other)
            torch.testing.assert_close(other_form, got, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_tokens, hidden, inter, config", [
    (2, 64, 48, _gemv((16, 32), (16, 16))),  # uint32 pairs: EVEN_K steps, prefetch
    (3, 40, 26, _gemv((16, 64, 4, 1), (32, 16, 2, 2))),  # pairs in masked steps (hidden 40, inter 26)
    (1, 40, 25, _gemv((16, 16), (16, 1, 2, 1))),  # odd inter, a step of one value: down unpaired
    (3, 40, 26, _gemv((16, 64, 4, 1), (8, 16, 2, 1, True))),  # down by token, pairs in masked steps
])
def test_fused_moe_gemv_in_bf16_reads_pairs_of_values(num_tokens, hidden, inter, config, monkeypatch):
    """bf16 x and weights (read as uint32 pairs where K and the step are even) within bf16
    rounding of the float32 reference, and the pairs' products the same as the plain loop's
    within float32 rounding of their sums."""
    x, logits, w13, w2 = _moe_inputs(num_tokens, hidden, inter, 8, torch.bfloat16, seed=num_tokens)
    logits = logits.float()
    expected = moe_torch(x.float(), logits, w13.float(), w2.float(), 2, True)
    got = fused_moe_triton(x, logits, w13, w2, 2, True, config)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)
    monkeypatch.setattr(fused_moe, "_bf16_pairs", lambda *args: False)
    unpaired = fused_moe_triton(x, logits, w13, w2, 2, True, config)
    torch.testing.assert_close(unpaired, got, atol=8e-3, rtol=8e-3)


def test_gemv_reads_bf16_pairs_only_where_aligned():
    w = torch.zeros(4, 8, 6, dtype=torch.bfloat16)
    launch = MoeGemvLaunch(8, 4)
    assert fused_moe._bf16_pairs(6, launch, w, w[:, :2])
    assert not fused_moe._bf16_pairs(5, launch, w[:, :, :5])  # K odd
    assert not fused_moe._bf16_pairs(6, MoeGemvLaunch(8, 1), w)  # a step of one value
    assert not fused_moe._bf16_pairs(6, launch, w[:, :, 1:])  # a base 2 bytes past alignment
    odd_rows = torch.zeros(4, 8, 5, dtype=torch.bfloat16)[:, :, :4]
    assert not fused_moe._bf16_pairs(4, launch, odd_rows)
    assert not fused_moe._bf16_pairs(6, launch, w.half())


def _lowest_index_first(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ``top_k`` experts by logit, the lowest index first among equal logits (a stable sort)."""
    return torch.sort(-logits, dim=-1, stable=True).indices[:, :top_k]


def _tie_logits(num_experts: int, top_k: int) -> torch.Tensor:
    """Rows of ties: random, all equal, runs of a few values, one value repeated."""
    g = torch.Generator(DEVICE).manual_seed(num_experts + top_k)
    logits = torch.randn(4, num_experts, generator=g, device=DEVICE)
    logits[1] = 0.5
    logits[2] = torch.randint(0, 3, (num_experts,), generator=g, device=DEVICE).float()
    logits[3, ::2] = logits[3, 1]
    return logits


# 1-8 warps and 8-512 experts: on the H200 the per-row candidate ranking this routing replaced
# chose wrong experts at 128 experts with one warp and at 256-512 with most warp counts
@pytest.mark.parametrize("num_experts, top_k, renormalize, num_warps", [
    (8, 1, True, 4), (8, 2, False, 4), (64, 8, True, 4), (6, 6, False, 4), (128, 8, False, 4),
    (128, 8, True, 2), (128, 8, False, 8), (128, 8, True, 1), (256, 8, True, 4), (256, 2, False, 2),
    (512, 8, False, 8)])
def test_gemv_routing_breaks_ties_as_the_route_kernel(num_experts, top_k, renormalize, num_warps):
    """Each pair's expert by the route kernel's rule, highest logit first and the lowest index
    among equal logits, on rows of ties; the weights within rounding of ``select_experts``'s
    (equal logits, equal weights). Column tile 0 stores the experts; the second tile routes its
    own (``_route_expert``), seen in its columns of the activations."""
    logits = _tie_logits(num_experts, top_k)
    x, _, w13, _ = _moe_inputs(4, 32, 32, num_experts)
    activated, weights, experts = fused_moe.moe_gate_up_gemv_triton(x, logits, w13, top_k, renormalize,
                                                                    MoeGemvLaunch(16, 32, num_warps))
    expected = _lowest_index_first(logits, top_k)
    assert torch.equal(experts.long(), expected) and experts[1].tolist() == list(range(top_k))
    gate, up = (torch.einsum("ph,pnh->pn", x.repeat_interleave(top_k, 0), w13[expected.flatten(), rows])
                for rows in (slice(0, 32), slice(32, 64)))
    torch.testing.assert_close(activated, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert torch.equal(route_and_align_triton(logits, top_k, renormalize, 16, torch.float32).experts.long(),
                       expected)
    ref_weights, _ = select_experts(logits, top_k, renormalize, torch.float32)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_experts", [256, 512])
def test_route_kernel_breaks_ties_at_256_and_512_experts(num_experts):
    """The grouped path's route kernel, which routes every batch past the GEMV path's, by the
    same rule on the same rows of ties at 256 and 512 experts."""
    logits = _tie_logits(num_experts, 8)
    got = route_and_align_triton(logits, 8, True, 16, torch.float32).experts.long()
    assert torch.equal(got, _lowest_index_first(logits, 8))


def _count_paths(monkeypatch) -> dict[str, int]:
    """Counts of calls of the grouped and the GEMV gate/up launcher (each still runs)."""
    calls = {"grouped": 0, "gemv": 0}

    def counted(path, launcher):
        def launch(*args):
            calls[path] += 1
            return launcher(*args)
        return launch
    for path, name in (("grouped", "moe_gate_up_triton"), ("gemv", "moe_gate_up_gemv_triton")):
        monkeypatch.setattr(fused_moe, name, counted(path, getattr(fused_moe, name)))
    return calls


def test_default_config_takes_the_gemv_path_only_at_a_listed_token_count(monkeypatch):
    gemv = _gemv((8, 32), (16, 64))
    monkeypatch.setattr(fused_moe_configs, "MOE_GEMV_CONFIGS", {(8, 64, 48, 2, 2): gemv})
    assert moe_gemv_config(2, 8, 64, 48, 2) is gemv
    assert moe_gemv_config(1, 8, 64, 48, 2) is None and moe_gemv_config(2, 8, 64, 96, 2) is None
    calls = _count_paths(monkeypatch)
    for num_tokens, path in ((2, "gemv"), (1, "grouped"), (3, "grouped")):
        x, logits, w13, w2 = _moe_inputs(num_tokens, 64, 48, 8, seed=num_tokens)
        before = dict(calls)
        got = fused_moe_triton(x, logits, w13, w2, 2, True)
        torch.testing.assert_close(got, moe_torch(x, logits, w13, w2, 2, True), atol=1e-5, rtol=1e-4)
        assert {p: calls[p] - before[p] for p in calls} == {p: int(p == path) for p in calls}, num_tokens


def test_gemv_table_ignores_batches_above_its_maximum(monkeypatch):
    key = (8, 64, 48, 2, MOE_GEMV_MAX_TOKENS + 1)
    monkeypatch.setattr(fused_moe_configs, "MOE_GEMV_CONFIGS", {key: _gemv((8, 32), (8, 32))})
    assert moe_gemv_config(MOE_GEMV_MAX_TOKENS + 1, *key[:4]) is None


def test_gemv_table_entries_are_valid_decode_batches():
    for (_, _, _, _, num_tokens), config in fused_moe_configs.MOE_GEMV_CONFIGS.items():
        assert 1 <= num_tokens <= MOE_GEMV_MAX_TOKENS
        config.check()


@pytest.mark.parametrize("config, message", [
    (_gemv((8, 64, 64), (8, 64)), "gate_up .*num_warps=64 must be at most 32"),
    (_gemv((12, 64), (8, 64)), "gate_up .*block_n=12 must be a power of two"),
    (_gemv((8, 64), (8, 96)), "down .*block_k=96 must be a power of two"),
    (_gemv((8, 0), (8, 64)), "gate_up .*block_k=0 must be a power of two"),
    (_gemv((8, 64, 3), (8, 64)), "gate_up .*num_warps=3 must be a power of two"),
    (_gemv((8, 64), (8, 64, 4, 0)), "down .*num_stages=0 must be >= 1"),
    (_gemv((8, 64, 4, 2, True), (8, 64)), "gate_up .*all_pairs is the down launch's"),
])
def test_moe_gemv_config_check_rejects_what_cannot_run(config, message):
    with pytest.raises(ValueError, match=message):
        config.check()
    x, logits, w13, w2 = _moe_inputs(1, 64, 48, 8)
    with pytest.raises(ValueError, match=message):
        fused_moe_triton(x, logits, w13, w2, 2, True, config)


@pytest.mark.parametrize("num_experts, top_k, logits_shape, message", [
    (1024, 2, (1, 1024), "1024 experts is over the GEMV path's fused routing \\(512 experts at most\\)"),
    (8, 9, (1, 8), "top_k=9 must be between 1 and the number of experts \\(8\\)"),
    (8, 2, (1, 6), "router_logits \\(1, 6\\) must be \\[tokens=1, experts=8\\]"),
])
def test_gemv_path_rejects_what_its_routing_cannot_take(num_experts, top_k, logits_shape, message):
    x, _, w13, w2 = _moe_inputs(1, 16, 8, num_experts)
    with pytest.raises(ValueError, match=message):
        fused_moe_triton(x, torch.zeros(logits_shape, device=DEVICE), w13, w2, top_k, True,
                         _gemv((8, 16), (8, 16)))


def test_gemv_table_is_not_consulted_above_the_fused_routings_experts(monkeypatch):
    key = (MOE_GEMV_MAX_EXPERTS * 2, 64, 48, 2, 1)
    monkeypatch.setattr(fused_moe_configs, "MOE_GEMV_CONFIGS", {key: _gemv((8, 32), (8, 32))})
    assert moe_gemv_config(1, *key[:4]) is None


# gate/up plain with EVEN_K, down prefetching with block_k past Qwen3-30B-A3B's inter 768 (masked);
# 2 warps (routing rows of 64 experts); 8 warps; the down launch by token
_GPU_GEMVS = [_gemv((8, 512, 4, 1), (8, 1024, 4, 2)), _gemv((16, 128, 2, 2), (16, 256, 2, 1)),
              _gemv((16, 256, 8, 2), (32, 256, 8, 2)), _gemv((16, 256, 8, 1), (8, 128, 4, 1, True))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(2048, 768, 128, 8, True), (4096, 14336, 8, 2, True)],
                         ids=["qwen3-30b-a3b", "mixtral-8x7b"])
@pytest.mark.parametrize("config", _GPU_GEMVS, ids=["4-warps", "2-warps", "8-warps", "down-by-token"])
def test_fused_moe_gemv_at_model_sizes_on_gpu(shape, config):
    """The GEMV path in bf16 at real expert shapes and decode batches, eager (its routing equal to
    ``select_experts``'s, the same output twice) and, at 4 warps, replayed from a CUDA graph on
    new tokens and logits, within bf16 rounding of the float32 reference."""
    hidden, inter, num_experts, top_k, renormalize = shape
    _, _, w13, w2 = _moe_inputs(1, hidden, inter, num_experts, torch.bfloat16)
    w13_ref, w2_ref = w13.float(), w2.float()
    for num_tokens in (1, 2, 4, 8):
        x, _ = _activations(num_tokens, hidden, num_experts, torch.bfloat16, seed=num_tokens)
        logits = _distinct_logits(num_tokens, num_experts, seed=num_tokens)
        expected = moe_torch(x.float(), logits, w13_ref, w2_ref, top_k, renormalize)
        got = fused_moe_triton(x, logits, w13, w2, top_k, renormalize, config)
        torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2, msg=f"{num_tokens} tokens")
        assert torch.equal(fused_moe_triton(x, logits, w13, w2, top_k, renormalize, config), got)
        _, weights, experts = fused_moe.moe_gate_up_gemv_triton(x, logits, w13, top_k, renormalize,
                                                                config.gate_up)
        ref_weights, ref_experts = select_experts(logits, top_k, renormalize, torch.bfloat16)
        assert torch.equal(experts.long(), ref_experts)
        torch.testing.assert_close(weights, ref_weights, atol=1e-2, rtol=1e-2)
        if config is _GPU_GEMVS[0]:
            _check_graph_replays(x, logits, w13, w2, top_k, renormalize, config)


def _check_graph_replays(x, logits, w13, w2, top_k, renormalize, config):
    """``fused_moe_triton`` captured once on ``x`` and ``logits``, replayed on new ones: each
    replay within bf16 rounding of the reference on its inputs (no host sync, no routing shape)."""
    num_tokens, hidden = x.shape
    num_experts = w13.shape[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, logits, w13, w2, top_k, renormalize, config)
    for seed in (100, 101):
        new_x, _ = _activations(num_tokens, hidden, num_experts, torch.bfloat16, seed)
        new_logits = _distinct_logits(num_tokens, num_experts, seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        expected = moe_torch(new_x.float(), new_logits, w13.float(), w2.float(), top_k, renormalize)
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2,
                                   msg=f"{num_tokens} tokens replayed")


# two tensor-parallel ranks on the default device: two GPUs where it is CUDA
_TWO_RANKS = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                reason="two ranks on CUDA need two GPUs")


@pytest.mark.parametrize("arch", [pytest.param("mixtral", marks=[pytest.mark.slow, _TWO_RANKS]), "qwen3_moe"])
def test_triton_backend_runs_the_fused_kernel_with_hf_tokens(tiny_models, arch, monkeypatch):
    """The Triton backend sends the experts through the fused kernel (counted here) and gives
    HF's greedy tokens, at two tensor-parallel ranks for Mixtral (each rank's intermediate slice)."""
    from conftest import hf_greedy, random_prompts
    from pagedlab import LLM, SamplingParams
    from pagedlab.kernels import fused_moe

    calls = []
    gate_up = fused_moe.moe_gate_up_triton
    monkeypatch.setattr(fused_moe, "moe_gate_up_triton", lambda *args: calls.append(1) or gate_up(*args))
    tiny = tiny_models(arch)
    prompts = random_prompts(2, min_len=5, max_len=20, seed=13)
    tp = 2 if arch == "mixtral" else 1
    with LLM(tiny.path, dtype="float32", attention_backend="triton", tensor_parallel_size=tp,
             kv_cache_memory_bytes=4 << 20) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)]
    assert got == [hf_greedy(tiny.hf_model, p, 4, eos_token_id=None) for p in prompts]
    assert calls  # rank 0 runs in this process
