"""The dense GEMV with the LoRA expand in its epilogue (``kernels/gemv.py``'s ``GemvLoRA``) and
``linear_with_lora``'s choice of it, against the base linear plus ``add_lora_torch``: one-row,
split-K and tl.dot configs, rows of several slots and of none, fused outputs of three and two
slices, ranks below the maximum (zero-padded), bias on and off, the shrink's workspace poisoned
with NaN where it writes nothing. ``-m gpu``: Llama-3-8B's linears in bf16, eager and in a CUDA
graph.

On a machine without CUDA the kernels run under the Triton interpreter (float32 and float16);
``test_lora_kernels`` sets TRITON_INTERPRET before the kernel modules load.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_lora_kernels import DEVICE, host_to_device, random_layer, random_slots

from pagedlab.kernels import gemv_configs
from pagedlab.kernels.gemv_configs import TileConfig, row_bucket
from pagedlab.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedlab.lora.ops import LoRAMapping, add_lora_torch

pytest.importorskip("triton")
from pagedlab.kernels import gemv, lora

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=1e-2),
             torch.bfloat16: dict(atol=6e-2, rtol=2e-2)}
NUM_SLOTS, MAX_RANK = 4, 16


def lora_weights(sizes: list[int], k: int, dtype: torch.dtype, seed: int):
    """Stacked A and B of every slot at MAX_RANK, slot 1's adapter of rank 12 and slot 2's of
    rank 5 (zero-padded, as ``LoRALinear.set_slice`` leaves them)."""
    lora_a, lora_b = random_layer(NUM_SLOTS, sizes, MAX_RANK, k, dtype, seed)
    for slot, rank in ((1, 12), (2, 5)):
        lora_a[slot, :, rank:] = 0
        lora_b[slot, :, :, rank:] = 0
    return lora_a, lora_b


def filled_mapping(slots: list[int]) -> LoRAMapping:
    """A mapping of more tokens than the step's, as the engine allocates (the rest: no slot)."""
    mapping = LoRAMapping.empty(len(slots) + 7, NUM_SLOTS, torch.device(DEVICE))
    mapping.fill(slots, host_to_device)
    return mapping


def poisoned_workspace(rows: int, slices: int) -> torch.Tensor:
    """The shrink's workspace full of NaN: rows it does not write must not be read."""
    return torch.full((lora.workspace_numel(rows, slices, MAX_RANK),), float("nan"), device=DEVICE)


def reference(x, weight, bias, lora_a, lora_b, mapping, sizes) -> torch.Tensor:
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    add_lora_torch(x.float(), y, lora_a.float(), lora_b.float(), mapping, sizes)
    return y


# (slots of the rows, slice sizes, K, config): one row on the CUDA cores, with and without K
# split; several rows on the cores (a 3-D tile) and through tl.dot, with and without K split, and swapped.
FUSED_CASES = [
    ([1], [64, 32, 32], 200, TileConfig(block_n=16, block_k=64)),
    ([3], [48, 48], 200, TileConfig(block_n=16, block_k=32, split_k=3)),
    ([-1], [64, 32, 32], 200, TileConfig(block_n=16, block_k=64)),
    ([2, -1, 0], [48, 48], 200, TileConfig(block_n=8, block_k=64, split_k=2)),
    ([0, 1, 1], [64, 32, 32], 96, TileConfig(block_n=16, block_k=32)),
    ([0, 2, -1], [80], 200, TileConfig(block_n=16, block_k=64, split_k=2, block_m=16)),
    (random_slots(16, NUM_SLOTS, 5).tolist(), [64, 32, 32], 200,
     TileConfig(block_n=32, block_k=32, block_m=16)),
    (random_slots(16, NUM_SLOTS, 6).tolist(), [48, 48], 160,
     TileConfig(block_n=16, block_k=32, split_k=4, block_m=16)),
    # the weight tile as the dot's A operand (swap_ab): the delta added after the transpose back
    ([2, -1, 0, 1], [64, 32, 32], 200,
     TileConfig(block_n=32, block_k=32, split_k=2, block_m=16, swap_ab=True)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", range(len(FUSED_CASES)))
def test_fused_gemv_is_the_base_plus_the_reference_delta(dtype, case):
    slots, sizes, k, config = FUSED_CASES[case]
    rows, with_bias = len(slots), case % 2 == 0
    gen = torch.Generator(device=DEVICE).manual_seed(case)
    weight = (torch.randn(sum(sizes), k, device=DEVICE, generator=gen) * k ** -0.5).to(dtype)
    bias = torch.randn(sum(sizes), device=DEVICE, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, k, device=DEVICE, generator=gen).to(dtype)
    lora_a, lora_b = lora_weights(sizes, k, dtype, case)
    mapping = filled_mapping(slots)
    h = lora.lora_shrink(x, lora_a, mapping, lora.choose_config(rows, NUM_SLOTS, len(sizes), k),
                         poisoned_workspace(rows, len(sizes)))
    fused = gemv.GemvLoRA(h, lora_b, mapping.token_slots, sizes)
    out = gemv.dense_gemv_triton(x, weight, bias, config, fused)
    expected = reference(x, weight, bias, lora_a, lora_b, mapping, sizes)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    has_slot = torch.tensor(slots, device=DEVICE) >= 0
    plain = gemv.dense_gemv_triton(x, weight, bias, config)
    assert torch.equal(out[~has_slot], plain[~has_slot])  # rows without an adapter: the GEMV's bits
    if has_slot.any():
        assert not torch.allclose(out[has_slot].float(), plain[has_slot].float(), **TOLERANCE[dtype])


def test_gemv_lora_refuses_what_does_not_fit():
    x, weight = torch.randn(2, 64, device=DEVICE), torch.randn(96, 64, device=DEVICE)
    lora_a, lora_b = lora_weights([48, 48], 64, torch.float32, 0)
    mapping = filled_mapping([0, 1])
    h = lora.lora_shrink(x, lora_a, mapping)
    config, slots = TileConfig(block_n=32, block_k=32), mapping.token_slots
    with pytest.raises(ValueError, match=r"block_n=32 must divide each but the last"):
        gemv.dense_gemv_triton(x, weight, None, config, gemv.GemvLoRA(h, lora_b, slots, [48, 48]))
    with pytest.raises(ValueError, match=r"LoRA slices \[64, 32\] do not fit"):
        gemv.dense_gemv_triton(x, weight, None, config, gemv.GemvLoRA(h, lora_b, slots, [64, 32]))
    with pytest.raises(ValueError, match="do not fit 2 rows"):
        gemv.dense_gemv_triton(x, weight, None, TileConfig(block_n=16, block_k=32),
                               gemv.GemvLoRA(h, lora_b, mapping.token_slots[:1], [48, 48]))


def dense_layer(k: int, sizes: list[int], dtype: torch.dtype, bias: bool, seed: int):
    """A column-parallel linear of ``sizes`` (one slice: row-parallel) with random weights."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    if len(sizes) > 1:
        layer = ColumnParallelLinear(k, sizes, bias=bias)
    else:
        layer = RowParallelLinear(k, sizes[0], bias=bias)
    for param in layer.parameters():
        param.data = (torch.randn(param.shape, device=DEVICE, generator=gen) * k ** -0.5).to(dtype)
    return layer


@pytest.mark.parametrize("sizes, config, fused", [
    ([64, 32, 32], TileConfig(block_n=16, block_k=64), True),  # q/k/v-like, one row
    ([96, 96], TileConfig(block_n=32, block_k=32, split_k=2), True),  # gate/up-like
    ([64], TileConfig(block_n=16, block_k=64, split_k=2, block_m=16), True),  # o/down-like
    ([64, 32, 32], None, False),  # no table entry: cuBLAS, then the expand
    ([48, 48], TileConfig(block_n=32, block_k=64), False),  # a tile would straddle the slices
])
@pytest.mark.parametrize("rows", [1, 3])
def test_linear_with_lora_fuses_where_the_base_runs_the_gemv(monkeypatch, sizes, config, fused, rows):
    k = 128
    layer = dense_layer(k, sizes, torch.float32, bias=rows == 3, seed=rows)
    lora_a, lora_b = lora_weights(sizes, k, torch.float32, rows)
    mapping = filled_mapping([1, -1, 2][:rows] if rows == 3 else [0])
    x = torch.randn(rows, k, device=DEVICE)
    monkeypatch.setattr(gemv_configs, "DENSE_GEMV_CONFIGS", {})
    if config is not None:
        monkeypatch.setitem(gemv_configs.DENSE_GEMV_CONFIGS, (row_bucket(rows), sum(sizes), k), config)
    calls = {"fused": 0, "expand": 0}
    fused_gemv, expand = lora.dense_gemv_triton, lora.lora_expand
    monkeypatch.setattr(lora, "dense_gemv_triton",
                        lambda *args: calls.__setitem__("fused", calls["fused"] + 1) or fused_gemv(*args))
    monkeypatch.setattr(lora, "lora_expand",
                        lambda *args: calls.__setitem__("expand", calls["expand"] + 1) or expand(*args))
    workspace = poisoned_workspace(rows, len(sizes))
    out = lora.linear_with_lora(layer, x, lora_a, lora_b, mapping, sizes, workspace)
    assert calls == ({"fused": 1, "expand": 0} if fused else {"fused": 0, "expand": 1})
    expected = reference(x, layer.weight, layer.bias, lora_a, lora_b, mapping, sizes)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_only_dense_one_rank_linears_offer_their_gemv(monkeypatch):
    """FP8 (or AWQ) bases and row-parallel linears of several ranks keep the separate expand."""
    from pagedlab.quantization.fp8 import FP8Config
    from pagedlab.quantization.linear_method import FP8LinearMethod

    x = torch.randn(1, 128, device=DEVICE)
    monkeypatch.setitem(gemv_configs.DENSE_GEMV_CONFIGS, (1, 64, 128), TileConfig(block_n=16, block_k=64))
    dense = RowParallelLinear(128, 64)
    assert lora.fused_gemv_config(dense, x, [64]) == TileConfig(block_n=16, block_k=64)
    assert lora.fused_gemv_config(dense, x.half(), [64]) is None  # the GEMV needs the weight's dtype
    dense.tp_size = 2
    assert lora.fused_gemv_config(dense, x, [64]) is None
    fp8 = RowParallelLinear(128, 64, linear_method=FP8LinearMethod(FP8Config()))
    assert lora.fused_gemv_config(fp8, x, [64]) is None
    assert lora.fused_gemv_config(lambda t: t, x, [64]) is None  # a plain callable: no GEMV to fuse into


LLAMA_8B = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
            "down": (14336, [4096])}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl", ["0", "1"], ids=["pdl-off", "pdl-on"])
@pytest.mark.parametrize("layer_name", list(LLAMA_8B))
@pytest.mark.parametrize("rows", [1, 4])
def test_fused_gemv_at_llama_8b_sizes_eager_and_in_a_graph(monkeypatch, layer_name, rows, pdl):
    """bf16 at Llama-3-8B's linears through ``linear_with_lora`` (the table's GEMV config where it
    lists the shape, else the default one put in the table), PDL off and on (Hopper): the fused
    path runs, eagerly and from a captured graph replayed on other mappings (a cleared one: the
    base alone), each within bf16 rounding of the float32 reference, and bitwise equal run to run."""
    monkeypatch.setenv("PAGEDLAB_PDL", pdl)
    k, sizes = LLAMA_8B[layer_name]
    key = (row_bucket(rows), sum(sizes), k)
    if key not in gemv_configs.DENSE_GEMV_CONFIGS:
        sms = gemv.num_sms(torch.device("cuda"))
        monkeypatch.setitem(gemv_configs.DENSE_GEMV_CONFIGS, key,
                            gemv_configs.default_dense_gemv_config(rows, sum(sizes), k, sms))
    layer = dense_layer(k, sizes, torch.bfloat16, bias=False, seed=rows)
    x = torch.randn(rows, k, device=DEVICE).bfloat16()
    assert lora.fused_gemv_config(layer, x, sizes) is not None, "the fused path must run"
    lora_a, lora_b = lora_weights(sizes, k, torch.bfloat16, rows)
    mapping = LoRAMapping.empty(16, NUM_SLOTS, torch.device(DEVICE))
    mapping.fill(random_slots(rows, NUM_SLOTS, rows), host_to_device)
    workspace, side_stream = poisoned_workspace(16, len(sizes)), torch.cuda.Stream()

    def run():  # given a side stream, as the engine: the fused path does not use it
        return lora.linear_with_lora(layer, x, lora_a, lora_b, mapping, sizes, workspace, side_stream)
    eager = run()
    assert torch.equal(run(), eager)
    expected = reference(x, layer.weight, None, lora_a, lora_b, mapping, sizes)
    torch.testing.assert_close(eager.float(), expected, **TOLERANCE[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for seed in (11, 12, None):
        if seed is None:
            mapping.clear()
        else:
            mapping.fill(random_slots(rows, NUM_SLOTS, seed), host_to_device)
        captured.fill_(float("nan"))
        graph.replay()
        expected = reference(x, layer.weight, None, lora_a, lora_b, mapping, sizes)
        torch.testing.assert_close(captured.float(), expected, **TOLERANCE[torch.bfloat16])
    plain = gemv.dense_gemv_triton(x, layer.weight, None, lora.fused_gemv_config(layer, x, sizes))
    assert torch.equal(captured, plain)  # no token with a slot: the GEMV's own bits
