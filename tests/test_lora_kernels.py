"""The batched multi-LoRA shrink/expand kernels (``pagedlab.kernels.lora``) against their torch
references (``pagedlab.lora.ops``) on random segment layouts: tokens of several slots
interleaved, slots without tokens, tokens without a slot, fused outputs of unequal slices, ranks
below the maximum and not a power of two, K not a multiple of the K step, K split several ways.
And the host side: the tile tables every step writes, and the split-K workspace bound.

On a machine without CUDA the kernels run under the Triton interpreter (float32 and float16:
the interpreter's ``tl.dot`` on bf16 is not trustworthy); TRITON_INTERPRET is set here, before
the kernel module is first imported.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch


from pagedlab.lora.ops import (TILE_BLOCK_MS, LoRAMapping, add_lora_torch, lora_expand_torch,
                               lora_shrink_torch, max_tiles, sort_tokens_by_slot, tile_table)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def host_to_device(values, dtype):
    return torch.as_tensor(np.asarray(values), dtype=dtype, device=DEVICE)


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    return importlib.import_module("pagedlab.kernels.lora")


def random_slots(num_tokens: int, num_slots: int, seed: int) -> np.ndarray:
    """Tokens of random slots but the last (which stays empty), about a quarter without one (but
    never all)."""
    rng = np.random.default_rng(seed)
    slots = rng.integers(0, num_slots - 1, num_tokens)
    slots[rng.random(num_tokens) < 0.25] = -1
    slots[0] = max(slots[0], 0)
    return slots.astype(np.int32)


def random_mapping(num_tokens: int, num_slots: int, seed: int) -> LoRAMapping:
    mapping = LoRAMapping.empty(num_tokens + 5, num_slots, torch.device(DEVICE))  # larger, as for graphs
    mapping.fill(random_slots(num_tokens, num_slots, seed), host_to_device)
    return mapping


def test_sort_tokens_by_slot_groups_each_slot():
    order, counts, starts = sort_tokens_by_slot([2, -1, 0, 2, 1, -1, 0], 4)
    assert order.tolist() == [2, 6, 4, 0, 3]
    assert counts.tolist() == [2, 1, 2, 0]
    assert starts.tolist() == [0, 2, 3, 5]


def test_tile_table_cuts_each_slot_without_spanning_two():
    # slot 0: 5 rows from 0; slot 1: none; slot 2: 2 rows from 5; slot 3: 9 rows from 7
    table = tile_table(np.array([5, 0, 2, 9]), np.array([0, 5, 5, 7]), 4)
    assert table[0] == 6
    assert table[1:].reshape(-1, 3).tolist() == [[0, 0, 4], [0, 4, 1], [2, 5, 2], [3, 7, 4], [3, 11, 4],
                                                 [3, 15, 1]]
    assert tile_table(np.zeros(3, dtype=np.int32), np.zeros(3, dtype=np.int32), 16).tolist() == [0]


@pytest.mark.parametrize("num_tokens", [1, 5, 37, 130, 700])
def test_fill_writes_tiles_covering_each_sorted_row_once(num_tokens):
    num_slots = 5
    slots = random_slots(num_tokens, num_slots, num_tokens)
    mapping = LoRAMapping.empty(800, num_slots, torch.device(DEVICE))
    mapping.fill(slots, host_to_device)
    sorted_ids = mapping.sorted_token_ids.cpu().numpy()
    assert mapping.token_slots[:num_tokens].tolist() == slots.tolist()
    for block_m in TILE_BLOCK_MS:
        table = mapping.tiles(block_m).cpu().numpy()
        tiles = table[1:1 + 3 * table[0]].reshape(-1, 3)
        assert 0 < len(tiles) <= max_tiles(num_tokens, num_slots, block_m)
        covered = []
        for slot, start, rows in tiles:
            assert 1 <= rows <= block_m
            assert (slots[sorted_ids[start:start + rows]] == slot).all()  # one slot per tile
            covered += range(start, start + rows)
        assert sorted(covered) == list(range((slots >= 0).sum()))
    mapping.clear()
    assert mapping.tile_tables[:, 0].tolist() == [0] * len(TILE_BLOCK_MS)


def test_token_slots_are_none_past_the_step_and_after_clear():
    """What a graph of more rows than the step's tokens, or replayed without adapters, reads."""
    mapping = LoRAMapping.empty(6, 3, torch.device(DEVICE))
    assert mapping.token_slots.tolist() == [-1] * 6
    mapping.fill([2, 0, 1, 1, 0], host_to_device)
    mapping.fill([1, -1], host_to_device)
    assert mapping.token_slots.tolist() == [1, -1, -1, -1, -1, -1]
    mapping.fill([0, 2, 2], host_to_device)
    mapping.clear()
    assert mapping.token_slots.tolist() == [-1] * 6


def test_fill_refuses_bad_steps():
    mapping = LoRAMapping.empty(4, 2, torch.device(DEVICE))
    with pytest.raises(RuntimeError, match="a step of 5 tokens exceeds the LoRA mapping's 4"):
        mapping.fill([0, 0, 1, 1, 0], host_to_device)
    with pytest.raises(ValueError, match=r"token slots must lie in \[-1, 2\), got 0..2"):
        mapping.fill([0, 2], host_to_device)
    with pytest.raises(ValueError, match="block_m=32"):
        mapping.tiles(32)


def test_split_count_fits_the_workspace(kernels):
    """Every token count up to the maximum, every layer shape: the partial sums fit the bound."""
    for max_slices, k in [(1, 4096), (2, 4096), (3, 4096), (1, 14336), (3, 48)]:
        numel = kernels.workspace_numel(2100, max_slices, 16)
        for num_tokens in range(1, 2101):
            config = kernels.choose_config(num_tokens, 8, max_slices, k)
            assert config.num_splits * max_slices * num_tokens * 16 <= numel
            assert config.num_splits & (config.num_splits - 1) == 0
            assert config.num_splits * config.block_k <= max(k, config.block_k)
    assert kernels.choose_config(1, 8, 3, 4096).num_splits == 32  # one token: K spread wide
    assert kernels.choose_config(1, 8, 1, 14336).num_splits == 32  # at most MAX_SPLITS
    assert kernels.choose_config(4, 8, 3, 4096).num_splits == 8  # 4 tiles x 3 slices
    assert kernels.choose_config(256, 8, 3, 4096).num_splits == 4  # a decode batch: <= 1024 of K each
    assert kernels.choose_config(256, 8, 1, 14336).num_splits == 8  # ... up to 8 splits
    assert kernels.choose_config(8192, 8, 3, 4096).num_splits == 1  # a long prefill: enough tiles


def random_layer(num_slots: int, sizes: list[int], rank: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    slices = len(sizes)
    lora_a = torch.randn(num_slots, slices, rank, k, device=DEVICE, generator=gen) / k ** 0.5
    lora_b = torch.randn(num_slots, slices, max(sizes), rank, device=DEVICE, generator=gen) / rank ** 0.5
    return lora_a.to(dtype), lora_b.to(dtype)


# (tokens, slice sizes, rank, K, config overrides: None = choose_config, with a workspace)
CASES = [
    (1, [40], 8, 48, None),
    (5, [40, 24, 24], 16, 300, dict(num_splits=4, block_k=32)),  # the last split a partial block
    (37, [64, 24], 12, 300, dict(num_splits=8, block_k=32)),  # three splits without any K
    (37, [64, 24], 12, 300, dict(num_splits=3, block_k=32)),  # a split count not a power of two
    (37, [40, 24, 24], 16, 300, None),  # two splits of the default K step
    (130, [40, 24, 24], 16, 200, dict(num_splits=2, block_k=64)),
    (130, [72], 8, 100, dict(block_m=64, block_k=32, block_n=32)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,sizes,rank,k,overrides", CASES)
def test_kernels_match_the_torch_reference(kernels, dtype, num_tokens, sizes, rank, k, overrides):
    num_slots = 4
    seed = num_tokens + k
    mapping = random_mapping(num_tokens, num_slots, seed)
    lora_a, lora_b = random_layer(num_slots, sizes, rank, k, dtype, seed)
    x = torch.randn(num_tokens, k, device=DEVICE).to(dtype)
    y = torch.randn(num_tokens, sum(sizes), device=DEVICE).to(dtype)
    config = kernels.LoRAKernelConfig(**overrides) if overrides is not None else None
    workspace = None if overrides else torch.empty(kernels.workspace_numel(num_tokens, 3, rank),
                                                   device=DEVICE)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    has_slot = mapping.token_slots[:num_tokens] >= 0

    # the composed kernels (what a LoRALinear runs) against the composed reference
    y_out, y_ref = y.clone(), y.clone()
    kernels.add_lora(x, y_out, lora_a, lora_b, mapping, sizes, workspace, config)
    add_lora_torch(x, y_ref, lora_a, lora_b, mapping, sizes)
    torch.testing.assert_close(y_out, y_ref, **tol)
    assert torch.equal(y_out[~has_slot], y[~has_slot])  # rows without an adapter are untouched
    assert not torch.allclose(y_ref[has_slot], y[has_slot], **tol)  # the adapters do change the rows

    # the shrink alone: its partial sums (token order) summed, on the tokens with a slot
    config = config or kernels.choose_config(num_tokens, num_slots, len(sizes), k)
    partials = kernels.lora_shrink(x, lora_a, mapping, config)
    assert partials.shape[0] == config.num_splits
    h_ref = lora_shrink_torch(x, lora_a, mapping)
    torch.testing.assert_close(partials[:, :, has_slot].sum(0), h_ref[:, has_slot], **tol)

    # the expand alone, from the reference h cut into random partial sums (NaN for tokens without
    # a slot: the shrink leaves those rows unwritten, and the expand must not read them)
    cuts = torch.rand(config.num_splits, 1, num_tokens, 1, device=DEVICE)
    h_parts = (h_ref * (cuts / cuts.sum(0))).contiguous()
    h_parts[:, :, ~has_slot] = float("nan")
    y_out, y_ref = y.clone(), y.clone()
    kernels.lora_expand(h_parts, lora_b, mapping, y_out, sizes, config)
    lora_expand_torch(h_ref, lora_b, mapping, y_ref, sizes)
    torch.testing.assert_close(y_out, y_ref, **tol)


def test_kernels_do_nothing_without_tiles(kernels):
    mapping = random_mapping(9, 3, 0)
    mapping.clear()
    lora_a, lora_b = random_layer(3, [32, 16], 8, 40, torch.float32, 0)
    x, y = torch.randn(9, 40, device=DEVICE), torch.randn(9, 48, device=DEVICE)
    y_out = y.clone()
    kernels.add_lora(x, y_out, lora_a, lora_b, mapping, [32, 16])
    assert torch.equal(y_out, y)


def test_kernels_refuse_what_does_not_fit(kernels):
    mapping = random_mapping(4, 3, 0)
    lora_a, lora_b = random_layer(3, [32, 16], 8, 40, torch.float32, 0)
    x, y = torch.randn(4, 40, device=DEVICE), torch.randn(4, 48, device=DEVICE)
    with pytest.raises(ValueError, match="the LoRA workspace holds 10 values"):
        kernels.add_lora(x, y, lora_a, lora_b, mapping, [32, 16], torch.empty(10, device=DEVICE))
    with pytest.raises(ValueError, match=r"slice_sizes \[32, 16, 8\] do not fit"):
        kernels.add_lora(x, y, lora_a, lora_b, mapping, [32, 16, 8])
    with pytest.raises(ValueError, match="the LoRA mapping has 3 slots, the weights 2"):
        kernels.add_lora(x, y, lora_a[:2], lora_b[:2], mapping, [32, 16])


LLAMA_8B = {"qkv": (4096, [4096, 1024, 1024]), "gate_up": (4096, [14336, 14336]), "down": (14336, [4096])}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", list(LLAMA_8B))
@pytest.mark.parametrize("num_tokens", [1, 8, 256, 2051])
def test_kernels_at_llama_8b_sizes_on_gpu(kernels, dtype, layer, num_tokens):
    """Llama-3-8B's linears, rank 16, eight slots (one empty), the default configs: equal to the
    reference within bf16 rounding, and bitwise equal run to run (the splits summed in order)."""
    k, sizes = LLAMA_8B[layer]
    mapping = random_mapping(num_tokens, 8, num_tokens)
    lora_a, lora_b = random_layer(8, sizes, 16, k, dtype, num_tokens)
    x = torch.randn(num_tokens, k, device=DEVICE).to(dtype)
    y = torch.randn(num_tokens, sum(sizes), device=DEVICE).to(dtype)
    workspace = torch.empty(kernels.workspace_numel(num_tokens, 3, 16), device=DEVICE)
    y_ref = y.float().clone()
    add_lora_torch(x.float(), y_ref, lora_a.float(), lora_b.float(), mapping, sizes)
    outs = []
    for _ in range(2):
        outs.append(y.clone())
        kernels.add_lora(x, outs[-1], lora_a, lora_b, mapping, sizes, workspace)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(outs[0].float(), y_ref, **tol)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_captured_graph_serves_any_mapping(kernels):
    """Captured with no tiles, the shrink on a side stream beside the base linear; replayed after
    writing other mappings of fewer tokens into the static buffers, each replay gives the base
    output plus that mapping's reference delta."""
    num_tokens, sizes = 64, [4096, 1024, 1024]
    mapping = LoRAMapping.empty(num_tokens, 8, torch.device(DEVICE))
    lora_a, lora_b = random_layer(8, sizes, 16, 4096, torch.bfloat16, 0)
    x = torch.randn(num_tokens, 4096, device=DEVICE).bfloat16()
    weight = (torch.randn(sum(sizes), 4096, device=DEVICE) / 64).bfloat16()

    def base(t):
        return torch.nn.functional.linear(t, weight)

    workspace = torch.empty(kernels.workspace_numel(num_tokens, 3, 16), device=DEVICE)
    side = torch.cuda.Stream()
    mapping.clear()
    kernels.linear_with_lora(base, x, lora_a, lora_b, mapping, sizes, workspace, side)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.linear_with_lora(base, x, lora_a, lora_b, mapping, sizes, workspace, side)
    for seed, used in [(1, 64), (2, 17), (3, 1)]:
        mapping.fill(random_slots(used, 8, seed), host_to_device)
        graph.replay()
        y_ref = base(x).float()
        add_lora_torch(x.float()[:used], y_ref[:used], lora_a.float(), lora_b.float(), mapping, sizes)
        torch.testing.assert_close(out.float(), y_ref, atol=6e-2, rtol=2e-2)


def test_linear_with_lora_is_the_base_plus_the_delta(kernels):
    """Outside a graph capture (and on the CPU) ``linear_with_lora`` runs the base, the shrink and
    the expand in order: the base output plus the reference delta."""
    sizes, k = [40, 24, 24], 96
    mapping = random_mapping(7, 4, 3)
    lora_a, lora_b = random_layer(4, sizes, 8, k, torch.float32, 3)
    x = torch.randn(7, k, device=DEVICE)
    weight = torch.randn(sum(sizes), k, device=DEVICE)

    def base(t):
        return torch.nn.functional.linear(t, weight)

    out = kernels.linear_with_lora(base, x, lora_a, lora_b, mapping, sizes)
    y_ref = base(x)
    add_lora_torch(x, y_ref, lora_a, lora_b, mapping, sizes)
    torch.testing.assert_close(out, y_ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(out, base(x), atol=1e-3)
