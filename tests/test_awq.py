"""AWQ GEMM weights: the packing against hand-built words and against AutoAWQ's own code (when
``awq`` is importable; CI does not install it), the repack into the K-contiguous layout against
``dequantize_awq`` (bit for bit), the config errors, tensor-parallel shards, and the W4A16 Triton
kernels on repacked weights against ``awq_linear_torch`` on the GEMM-format ones.

On a machine without CUDA the kernels run under the Triton interpreter at small sizes;
TRITON_INTERPRET is set here, before ``pagedlab.kernels.w4a16`` (which imports triton when it
loads) is first imported. The ``gpu`` tests run real sizes in bf16 and print the bandwidth.
"""

from __future__ import annotations

import importlib
import re
import zlib

import pytest
import torch


from pagedlab.distributed import parallel_state
from pagedlab.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedlab.kernels import gemv_configs
from pagedlab.kernels.gemv_configs import TileConfig
from pagedlab.quantization.awq import (AWQ_PACK_ORDER, NATURAL_ORDER, AWQConfig, awq_linear_torch,
                                       dequantize_awq, dequantize_repacked, pack_awq, quantize_awq,
                                       repack_awq, repacked_linear_torch, repacked_shapes, unpack_awq)
from pagedlab.quantization.linear_method import AWQLinearMethod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def random_awq(in_features, out_features, group_size, gen, scale_dtype=torch.float16):
    """Random 4-bit values, zero points and small scales, and their packed tensors."""
    values = torch.randint(0, 16, (in_features, out_features), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 16, (in_features // group_size, out_features), generator=gen, dtype=torch.int32)
    scales = 0.005 + 0.02 * torch.rand(in_features // group_size, out_features, generator=gen)
    return values, zeros, scales.to(scale_dtype), pack_awq(values), pack_awq(zeros)


def _as_int32(word: int) -> int:
    return word - 2**32 if word >= 2**31 else word


# --- the packing -------------------------------------------------------------------------------------


def test_interleave_puts_even_columns_in_the_low_half_word():
    values = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    # nibble i holds logical column AWQ_PACK_ORDER[i]: 1, 3, 5, 7, 2, 4, 6, 8 from the low nibble up
    word = 0x86427531
    assert pack_awq(values).tolist() == [[_as_int32(word)]]
    assert unpack_awq(torch.tensor([[_as_int32(word)]], dtype=torch.int32)).tolist() == values.tolist()


@pytest.mark.parametrize("column", range(8))
def test_each_logical_column_has_its_own_nibble(column):
    values = torch.zeros(1, 8, dtype=torch.int32)
    values[0, column] = 15
    nibble = AWQ_PACK_ORDER.index(column)
    assert nibble == (column % 2) * 4 + column // 2
    assert pack_awq(values).item() == _as_int32(0xF << (4 * nibble))
    assert unpack_awq(pack_awq(values)).tolist() == values.tolist()


def test_pack_unpack_round_trip():
    values = torch.randint(0, 16, (48, 136), generator=_generator("round trip"), dtype=torch.int32)
    packed = pack_awq(values)
    assert packed.shape == (48, 17) and packed.dtype == torch.int32
    assert torch.equal(unpack_awq(packed), values)
    assert torch.equal(pack_awq(unpack_awq(packed)), packed)


def test_pack_rejects_values_and_shapes_it_cannot_hold():
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_awq(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 16]]))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_awq(torch.zeros(2, 12, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        unpack_awq(torch.zeros(2, 2, dtype=torch.int64))


def test_dequantize_is_q_minus_z_times_s_elementwise():
    group_size = 32
    values, zeros, scales, qweight, qzeros = random_awq(64, 16, group_size, _generator("by hand"))
    weight = dequantize_awq(qweight, qzeros, scales, group_size)
    assert weight.shape == (64, 16) and weight.dtype == torch.float16
    for k in range(64):
        for n in range(16):
            g = k // group_size
            expected = (int(values[k, n]) - int(zeros[g, n])) * float(scales[g, n])
            assert float(weight[k, n]) == float(torch.tensor(expected).half()), (k, n)


def test_awq_linear_torch_is_x_times_the_dequantized_weight_plus_bias():
    gen = _generator("linear")
    _, _, scales, qweight, qzeros = random_awq(128, 24, 64, gen, torch.float32)
    x, bias = torch.randn(5, 128, generator=gen), torch.randn(24, generator=gen)
    weight = dequantize_awq(qweight, qzeros, scales, 64)
    torch.testing.assert_close(awq_linear_torch(x, qweight, qzeros, scales, 64, bias), x @ weight + bias)


def test_quantize_round_trips_within_half_a_step():
    weight = torch.randn(256, 32, generator=_generator("quantize"))
    qweight, qzeros, scales = quantize_awq(weight, 64)
    error = (dequantize_awq(qweight, qzeros, scales, 64) - weight).abs()
    assert (error <= scales.repeat_interleave(64, dim=0) * 0.5 + 1e-6).all()


# --- the repacked layout ----------------------------------------------------------------------------


def test_repacked_words_hold_eight_consecutive_k_of_one_column_in_natural_order():
    values = torch.zeros(16, 8, dtype=torch.int32)
    values[:8, 3] = torch.arange(1, 9)  # column 3, k = 0..7 -> one word, nibble i holding k = i
    zeros = torch.zeros(1, 8, dtype=torch.int32)  # one group of 16 rows
    zeros[0, 3] = 5
    qweight, qzeros, _ = repack_awq(pack_awq(values), pack_awq(zeros), torch.ones(1, 8), 16)
    assert qweight.shape == (8, 2) and qzeros.shape == (8, 1)
    assert qweight[3].tolist() == [_as_int32(0x87654321), 0] and not qweight[[0, 1, 2, 4, 5, 6, 7]].any()
    assert qzeros[3].item() == 5 and pack_awq(values[:8, 3:4].t(), NATURAL_ORDER).item() == qweight[3, 0]


@pytest.mark.parametrize("in_features, out_features, group_size", [
    (256, 136, 32), (128, 64, 128), (192, 72, 64), (1024, 24, 32), (64, 8, 64), (4096, 16, 128),
    (128, 8 * 513, 64)])  # 513 words a row: repacked 512 at a time
def test_repacked_weights_dequantize_bit_for_bit_to_the_gemm_format_ones(in_features, out_features,
                                                                          group_size):
    gen = _generator("repack", in_features, out_features, group_size)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        _, _, scales, qweight, qzeros = random_awq(in_features, out_features, group_size, gen, dtype)
        repacked = repack_awq(qweight, qzeros, scales, group_size)
        assert all(t.is_contiguous() for t in repacked) and repacked[2].dtype == dtype
        assert repacked_shapes(*repacked, group_size) == (in_features, out_features)
        expected = dequantize_awq(qweight, qzeros, scales, group_size)
        assert torch.equal(dequantize_repacked(*repacked, group_size), expected.t())
        x = torch.randn(3, in_features, generator=gen, dtype=torch.float64)  # sums in any order agree
        torch.testing.assert_close(repacked_linear_torch(x, *repacked, group_size),
                                   awq_linear_torch(x, qweight, qzeros, scales, group_size))


def test_repacked_zero_words_pad_past_the_last_group():
    """24 groups take three words of zero points per column; 12 groups two, the second half empty."""
    gen = _generator("zero padding")
    for groups, words in ((24, 3), (12, 2)):
        _, zeros, scales, qweight, qzeros = random_awq(32 * groups, 16, 32, gen)
        packed_zeros = repack_awq(qweight, qzeros, scales, 32)[1]
        assert packed_zeros.shape == (16, words)
        unpacked = unpack_awq(packed_zeros, NATURAL_ORDER)
        assert torch.equal(unpacked[:, :groups], zeros.t()) and not unpacked[:, groups:].any()


def test_repacked_shapes_name_what_they_expected():
    _, _, scales, qweight, qzeros = random_awq(128, 16, 32, _generator("repacked shapes"))
    repacked = repack_awq(qweight, qzeros, scales, 32)
    with pytest.raises(ValueError, match=r"repacked AWQ tensors .* in groups of 64: expected"):
        repacked_shapes(*repacked, 64)
    with pytest.raises(ValueError, match="int32"):
        repacked_shapes(repacked[0].long(), repacked[1], repacked[2], 32)


# --- AutoAWQ as the independent reference (skipped where `awq` is not installed) ----------------------


def _import_autoawq(module: str):
    # Its import warns that AutoAWQ is deprecated, after resetting the warning filters: one warning.
    return pytest.importorskip(module, reason="AutoAWQ (`awq`) is not importable", exc_type=ImportError)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_matches_autoawq(group_size):
    packing_utils = _import_autoawq("awq.utils.packing_utils")
    _, _, scales, qweight, qzeros = random_awq(256, 72, group_size, _generator("autoawq", group_size))
    expected = packing_utils.dequantize_gemm(qweight, qzeros, scales, 4, group_size)
    assert torch.equal(dequantize_awq(qweight, qzeros, scales, group_size), expected)


@pytest.mark.parametrize("group_size", [32, 128])
def test_packing_matches_autoawq_from_linear(group_size):
    """AutoAWQ quantizes the dequantized weight again with the same zeros and scales: its packed
    words must be ours (it needs out_features a multiple of 32)."""
    gemm = _import_autoawq("awq.modules.linear.gemm")
    _, zeros, scales, qweight, qzeros = random_awq(256, 64, group_size, _generator("from_linear", group_size))
    linear = torch.nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(dequantize_awq(qweight, qzeros, scales, group_size).float().t())
    reference = gemm.WQLinear_GEMM.from_linear(linear, 4, group_size, scales=scales, zeros=zeros)
    assert torch.equal(reference.qweight, qweight)
    assert torch.equal(reference.qzeros, qzeros)


# --- the config ---------------------------------------------------------------------------------------


def test_config_reads_hf_and_autoawq_keys():
    hf = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": ["visual"]}
    assert AWQConfig.from_hf_config(hf) == AWQConfig(group_size=128, modules_to_not_convert=("visual",))
    autoawq = {"w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"}
    assert AWQConfig.from_hf_config(autoawq).group_size == 64


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "gptq"}, "quant_method='gptq'"),
    ({"bits": 8}, "bits=8 is not supported: only 4-bit"),
    ({"bits": 3}, "bits=3"),
    ({"group_size": -1}, "group_size=-1 is not supported: only 32, 64, 128"),
    ({"group_size": 256}, "group_size=256"),
    ({"zero_point": False}, "zero_point=False is not supported"),
    ({"version": "gemv"}, "version='gemv' is not supported: only 'gemm'"),
    ({"version": "gemv_fast"}, "version='gemv_fast'"),
    ({"desc_act": True}, "desc_act=True is not supported"),
])
def test_unsupported_configs_name_the_value_and_what_is_supported(change, message):
    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    with pytest.raises(ValueError, match=re.escape(message)):
        AWQConfig.from_hf_config({**config, **change})


# --- tensor-parallel shards --------------------------------------------------------------------------


def rank_awq_layer(layer_cls, in_features, out_features, group_size, rank, world_size, monkeypatch, tensors):
    """Rank ``rank``'s AWQ ``layer_cls`` (built without a process group: no forward runs) with the
    full packed ``tensors`` (qweight, qzeros, scales) loaded through its weight loaders."""
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(world_size, rank))
    try:
        layer = layer_cls(in_features, out_features, linear_method=AWQLinearMethod(AWQConfig(group_size)))
    finally:
        monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState())
    for name, full in zip(("qweight", "qzeros", "scales"), tensors):
        param = getattr(layer, name)
        param.weight_loader(param, full)
    return layer


@pytest.mark.parametrize("world_size", [2, 4])
def test_column_shards_concatenate_to_the_full_weight(world_size, monkeypatch):
    _, _, scales, qweight, qzeros = random_awq(128, 64, 32, _generator("column", world_size))
    full = dequantize_awq(qweight, qzeros, scales, 32)
    layers = [rank_awq_layer(ColumnParallelLinear, 128, 64, 32, rank, world_size, monkeypatch,
                             (qweight, qzeros, scales.float())) for rank in range(world_size)]
    shards = [dequantize_awq(layer.qweight, layer.qzeros, layer.scales, 32) for layer in layers]
    width = 64 // world_size
    for rank, shard in enumerate(shards):
        assert torch.equal(shard.half(), full[:, rank * width:(rank + 1) * width])
    assert torch.equal(torch.cat(shards, dim=1).half(), full)


@pytest.mark.parametrize("world_size", [2, 4])
def test_row_shards_concatenate_to_the_full_weight(world_size, monkeypatch):
    _, _, scales, qweight, qzeros = random_awq(256, 24, 64, _generator("row", world_size))
    full = dequantize_awq(qweight, qzeros, scales, 64)
    layers = [rank_awq_layer(RowParallelLinear, 256, 24, 64, rank, world_size, monkeypatch,
                             (qweight, qzeros, scales.float())) for rank in range(world_size)]
    shards = [dequantize_awq(layer.qweight, layer.qzeros, layer.scales, 64) for layer in layers]
    height = 256 // world_size
    for rank, shard in enumerate(shards):
        assert torch.equal(shard.half(), full[rank * height:(rank + 1) * height])
    assert torch.equal(torch.cat(shards, dim=0).half(), full)


def test_shards_off_a_word_or_group_boundary_are_refused(monkeypatch):
    _, _, scales, qweight, qzeros = random_awq(128, 136, 64, _generator("bad shards"))
    with pytest.raises(ValueError, match=r"68 outputs \(this rank's\) needs .* whole int32 words of 8"):
        rank_awq_layer(ColumnParallelLinear, 128, 136, 64, 0, 2, monkeypatch, (qweight, qzeros, scales))
    with pytest.raises(ValueError, match=r"32 inputs and .* needs whole groups of 64 inputs"):
        rank_awq_layer(RowParallelLinear, 128, 136, 64, 0, 4, monkeypatch, (qweight, qzeros, scales))
    with pytest.raises(ValueError, match=r"does not match the expected"):  # another group size's tensors
        rank_awq_layer(RowParallelLinear, 128, 136, 32, 0, 2, monkeypatch, (qweight, qzeros, scales))


# --- the Triton kernels ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def w4a16():
    pytest.importorskip("triton")
    return importlib.import_module("pagedlab.kernels.w4a16")


def repacked_on_device(qweight, qzeros, scales, group_size):
    return [t.to(DEVICE) for t in repack_awq(qweight, qzeros, scales, group_size)]


def check_kernel(w4a16, rows, in_features, out_features, group_size, dtype, with_bias, key, config=None):
    gen = _generator(key, rows, in_features, out_features, group_size, dtype, config)
    _, _, scales, qweight, qzeros = random_awq(in_features, out_features, group_size, gen, dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    repacked = repacked_on_device(qweight, qzeros, scales, group_size)
    out = w4a16.awq_linear_triton(x.to(DEVICE), *repacked, group_size,
                                  None if bias is None else bias.to(DEVICE), config)
    expected = awq_linear_torch(x.float(), qweight, qzeros, scales.float(), group_size,
                                None if bias is None else bias.float())
    assert out.shape == (rows, out_features) and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, **TOLERANCE[dtype])
    return out


# (rows, config) covering every path: block_m=0 is the GEMV on the CUDA cores (a K step within a
# group, one group, or several: block_k 16 to 256), block_m=16 the GEMV through tl.dot,
# more than 16 rows the GEMM (x and the words read through TMA descriptors); split_k > 1 cuts K into
# segments summed in-kernel (3 segments of 8 K steps are uneven: 3, 3, 2), in the GEMM too.
KERNEL_CASES = [
    (1, TileConfig(block_n=8, block_k=256, split_k=1)),
    (1, TileConfig(block_n=4, block_k=64, split_k=1)),
    (1, TileConfig(block_n=64, block_k=32, split_k=3)),
    (1, TileConfig(block_n=32, block_k=16, split_k=4, num_warps=2)),
    (1, TileConfig(block_n=16, block_k=128, split_k=2)),
    (1, TileConfig(block_n=8, block_k=64, split_k=2, num_stages=1)),  # no prefetch of the next step
    (3, TileConfig(block_n=32, block_k=16, split_k=4, block_m=16)),
    (3, TileConfig(block_n=16, block_k=32, split_k=1, block_m=16, num_stages=1)),
    (1, TileConfig(block_n=64, block_k=32, split_k=2, block_m=16)),
    (5, TileConfig(block_n=128, block_k=16, split_k=1, block_m=16)),
    (16, TileConfig(block_n=32, block_k=32, split_k=8, block_m=16)),
    (17, TileConfig(block_n=64, block_k=32, block_m=16)),
    (40, TileConfig(block_n=32, block_k=32, block_m=32)),
    (40, TileConfig(block_n=64, block_k=32, split_k=3, block_m=16)),
    # 2-8 rows on the CUDA cores (block_m=0): a step over several groups with prefetch, 3 rows
    # padded to 4 without prefetch and K split, 8 rows in steps within a group, 5 on 2 warps
    (2, TileConfig(block_n=8, block_k=256, split_k=1)),
    (3, TileConfig(block_n=16, block_k=64, split_k=2, num_stages=1)),
    (8, TileConfig(block_n=16, block_k=32, split_k=3)),
    (5, TileConfig(block_n=32, block_k=16, split_k=1, num_warps=2)),
]
# (in_features, out_features, group_size, bias): 136 columns make a partial column tile; 192
# inputs a partial K step of 128 or 256.
SHAPES = [(256, 136, 32, True), (128, 64, 128, False), (192, 72, 64, True)]


# The GEMM's swapped form (the weight tile as the dot's A operand, the rows its N): partial row
# tiles (17 and 100 rows), one whole one, partial column tiles (72 columns of 64 or 32), K split.
SWAPPED_CASES = [
    (17, TileConfig(block_n=64, block_k=32, block_m=32, swap_ab=True)),
    (64, TileConfig(block_n=32, block_k=32, block_m=64, num_warps=2, swap_ab=True)),
    (100, TileConfig(block_n=64, block_k=64, block_m=64, num_stages=3, swap_ab=True)),
    (100, TileConfig(block_n=32, block_k=32, split_k=2, block_m=64, swap_ab=True)),
]


def _case_id(case):
    rows, config = case
    path = "gemm" if rows > 16 else ("dot" if config.block_m else "cuda-cores")
    path += "-swap" if config.swap_ab else ""
    return f"{path}-M{rows}-n{config.block_n}-k{config.block_k}-split{config.split_k}"


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "K{}-N{}-g{}".format(*s[:3]))
def test_triton_matches_torch_float16(w4a16, shape, case):
    in_features, out_features, group_size, with_bias = shape
    rows, config = case
    check_kernel(w4a16, rows, in_features, out_features, group_size, torch.float16, with_bias, "fp16", config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [KERNEL_CASES[0], KERNEL_CASES[2], KERNEL_CASES[6], KERNEL_CASES[10],
                                  KERNEL_CASES[13], KERNEL_CASES[15]], ids=_case_id)
def test_triton_matches_torch_other_dtypes(w4a16, case, dtype):
    rows, config = case
    check_kernel(w4a16, rows, 256, 136, 32, dtype, True, "dtypes", config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", SWAPPED_CASES, ids=_case_id)
def test_swapped_gemm_matches_torch(w4a16, case, dtype):
    rows, config = case
    check_kernel(w4a16, rows, 192, 72, 64, dtype, True, "swapped", config)


@pytest.mark.parametrize("rows", [1, 4, 20, 70])
@pytest.mark.parametrize("gemm_listed", [False, True])
def test_triton_default_configs(w4a16, monkeypatch, rows, gemm_listed):
    """Without a config the path follows the row count and the table: the GEMV up to 16 rows;
    beyond, the dequantizing GEMM where AWQ_CONFIGS lists the shape, else dequantize and matmul."""
    if gemm_listed:
        for bucket in (32, 128):
            monkeypatch.setitem(gemv_configs.AWQ_CONFIGS, (bucket, 64, 256, 128),
                                TileConfig(block_n=32, block_k=32, block_m=32))
    paths = []

    def recorded(name):
        original = getattr(w4a16, name)

        def call(*args, **kwargs):
            paths.append(name)
            return original(*args, **kwargs)
        return call

    for name in ("_launch_gemv", "_launch_gemm", "awq_dequantize_triton"):
        monkeypatch.setattr(w4a16, name, recorded(name))
    check_kernel(w4a16, rows, 256, 64, 128, torch.float16, True, "default")
    expected = "_launch_gemv" if rows <= 16 else "_launch_gemm" if gemm_listed else "awq_dequantize_triton"
    assert paths == [expected]


@pytest.mark.parametrize("rows, aligned, gemm", [(200, True, True), (300, True, False), (200, False, False)])
def test_gemm_takes_decode_batches_whose_operands_tma_reads(w4a16, monkeypatch, rows, aligned, gemm):
    """With the 256-row bucket listed, the GEMM runs a batch of up to AWQ_GEMM_MAX_ROWS rows whose
    x starts on 16 bytes; a prefill-sized batch, or an x view 2 bytes off (which TMA cannot
    read), is dequantized for the matmul instead, with the same result."""
    monkeypatch.setitem(gemv_configs.AWQ_CONFIGS, (256, 64, 256, 128),
                        TileConfig(block_n=32, block_k=32, block_m=64))
    launches = []
    launch_gemm = w4a16._launch_gemm
    monkeypatch.setattr(w4a16, "_launch_gemm", lambda *args: launches.append(launch_gemm(*args)))
    gen = _generator("tma path", rows)
    _, _, scales, qweight, qzeros = random_awq(256, 64, 128, gen, torch.float16)
    x_wide = torch.randn(rows, 257, generator=gen).to(DEVICE, torch.float16)
    x = x_wide[:, :256].contiguous() if aligned else x_wide[:, 1:]
    out = w4a16.awq_linear_triton(x, *repacked_on_device(qweight, qzeros, scales, 128), 128)
    assert len(launches) == int(gemm)
    expected = awq_linear_torch(x.float().cpu(), qweight, qzeros, scales.float(), 128)
    torch.testing.assert_close(out.float().cpu(), expected, **TOLERANCE[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "K{}-N{}-g{}".format(*s[:3]))
def test_triton_dequantize_equals_torch_bit_for_bit(w4a16, shape, dtype):
    in_features, out_features, group_size, _ = shape
    gen = _generator("dequantize", in_features, out_features, group_size, dtype)
    _, _, scales, qweight, qzeros = random_awq(in_features, out_features, group_size, gen, dtype)
    weight = w4a16.awq_dequantize_triton(*repacked_on_device(qweight, qzeros, scales, group_size), group_size,
                                         dtype)
    assert weight.shape == (out_features, in_features) and weight.dtype == dtype
    expected = dequantize_awq(qweight, qzeros, scales, group_size).t()
    if dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter's float32 -> bf16 cast truncates
        torch.testing.assert_close(weight, expected, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(weight.cpu(), expected)


def test_split_k_is_deterministic_and_leaves_its_counters_at_zero(w4a16):
    gemv = importlib.import_module("pagedlab.kernels.gemv")
    config = TileConfig(block_n=32, block_k=32, split_k=4)
    first = check_kernel(w4a16, 1, 256, 64, 32, torch.float32, False, "repeat", config)
    again = check_kernel(w4a16, 1, 256, 64, 32, torch.float32, False, "repeat", config)
    assert torch.equal(first, again)
    assert not gemv._counters[first.device].any()


@pytest.mark.parametrize("rows", [1, 2, 40])
def test_triton_on_column_shard_views(w4a16, rows):
    gen = _generator("shard views", rows)
    _, _, scales, qweight, qzeros = random_awq(128, 128, 32, gen, torch.float32)
    repacked = repacked_on_device(qweight, qzeros, scales, 32)
    shard = [t[64:] for t in repacked]  # the second of two column-parallel shards: the last 64 columns
    x = torch.randn(rows, 128, generator=gen)
    out = w4a16.awq_linear_triton(x.to(DEVICE), *shard, 32)
    expected = awq_linear_torch(x, qweight[:, 8:], qzeros[:, 8:], scales[:, 64:], 32)
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[torch.float32])


def test_triton_keeps_leading_dimensions_and_empty_batches(w4a16):
    gen = _generator("leading dims")
    _, _, scales, qweight, qzeros = random_awq(64, 32, 32, gen, torch.float32)
    weight = repacked_on_device(qweight, qzeros, scales, 32)
    x = torch.randn(2, 3, 64, generator=gen)
    out = w4a16.awq_linear_triton(x.to(DEVICE), *weight, 32)
    assert out.shape == (2, 3, 32)
    expected = awq_linear_torch(x, qweight, qzeros, scales, 32)
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[torch.float32])
    assert w4a16.awq_linear_triton(torch.zeros(0, 64, device=DEVICE), *weight, 32).shape == (0, 32)


@pytest.mark.parametrize("rows, config, message", [
    (3, TileConfig(block_n=64, block_k=64, block_m=16), "block_k=64 must divide group_size=32 on tl.dot"),
    (20, TileConfig(block_n=64, block_k=64, block_m=16), "block_k=64 must divide group_size=32 on tl.dot"),
    (1, TileConfig(block_n=4, block_k=8), "block_k=8 is under 16"),
    (20, TileConfig(block_n=64, block_k=32), "the GEMM needs block_m >= 16"),
    (20, TileConfig(block_n=64, block_k=16, block_m=16), "the GEMM's TMA tiles need block_k >= 32"),
    (20, TileConfig(block_n=512, block_k=32, block_m=16), "block_m, block_n, block_k <= 256"),
    (1, TileConfig(block_n=48, block_k=32), "block_n=48 must be a power of two"),
    (1, TileConfig(block_n=64, block_k=32, block_m=8), "tl.dot tiles need block_m"),
    (9, TileConfig(block_n=64, block_k=32), "block_m=0 (CUDA cores) is for at most 8 rows"),
    (3, TileConfig(block_n=64, block_k=32, block_m=16, swap_ab=True), "the AWQ GEMV has no swapped form"),
    (1, TileConfig(block_n=8, block_k=64, swap_ab=True), "swap_ab=True swaps a tl.dot tile's operands"),
    (20, TileConfig(block_n=64, block_k=32, swap_ab=True), "the GEMM needs block_m >= 16"),
])
def test_triton_rejects_configs_it_cannot_run(w4a16, rows, config, message):
    _, _, scales, qweight, qzeros = random_awq(64, 64, 32, _generator("bad config"), torch.float32)
    with pytest.raises(ValueError, match=re.escape(message)):
        w4a16.awq_linear_triton(torch.zeros(rows, 64), *repack_awq(qweight, qzeros, scales, 32), 32,
                                config=config)


def test_triton_rejects_what_it_cannot_run(w4a16):
    _, _, scales, qweight, qzeros = random_awq(64, 32, 32, _generator("bad input"), torch.float32)
    repacked = repack_awq(qweight, qzeros, scales, 32)
    with pytest.raises(ValueError, match="x has 32 features, the AWQ weight 64 inputs"):
        w4a16.awq_linear_triton(torch.zeros(1, 32), *repacked, 32)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        w4a16.awq_linear_triton(torch.zeros(1, 64, dtype=torch.float64), *repacked, 32)
    with pytest.raises(ValueError, match="do not make a linear"):
        w4a16.awq_linear_triton(torch.zeros(1, 64), *repacked, 64)
    with pytest.raises(ValueError, match="do not make a linear"):  # the GEMM format, not repacked
        w4a16.awq_linear_triton(torch.zeros(1, 64), qweight, qzeros, scales, 32)


# --- real sizes on the GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("in_features, out_features", [(4096, 6144), (4096, 4096), (14336, 4096),
                                                       (4096, 28672)])
@pytest.mark.parametrize("rows", [1, 4, 16, 256])
def test_triton_at_llama_size_on_gpu(w4a16, rows, in_features, out_features, capsys):
    """Llama-3-8B shapes, groups of 128, bf16 activations and scales, repacked weights: the default
    config against the torch reference on the GEMM-format tensors, bit-identical over repeated
    calls and replayed twice from a CUDA graph (split-K counters, where a config splits, back at
    zero after every launch), with its time and bandwidth next to a dense bf16 matmul's."""
    from triton.testing import do_bench_cudagraph

    gen = torch.Generator(device="cuda").manual_seed(rows)
    weight = torch.randn(in_features, out_features, device="cuda", generator=gen).bfloat16() * 0.02
    gemm_format = quantize_awq(weight, 128)
    qweight, qzeros, scales = repack_awq(*gemm_format, 128)
    x = torch.randn(rows, in_features, device="cuda", generator=gen).bfloat16()
    expected = awq_linear_torch(x.float(), gemm_format[0], gemm_format[1], gemm_format[2].float(), 128)
    out = w4a16.awq_linear_triton(x, qweight, qzeros, scales, 128)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[torch.bfloat16])
    for _ in range(20):  # a split-K sum: same bits whichever segment finishes last
        assert torch.equal(w4a16.awq_linear_triton(x, qweight, qzeros, scales, 128), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = w4a16.awq_linear_triton(x, qweight, qzeros, scales, 128)
    for _ in range(2):
        captured.zero_()
        graph.replay()
        torch.testing.assert_close(captured, out, atol=0, rtol=0)
    ms = do_bench_cudagraph(lambda: w4a16.awq_linear_triton(x, qweight, qzeros, scales, 128))
    dense_ms = do_bench_cudagraph(lambda: x @ weight)
    moved = sum(t.numel() * t.element_size() for t in (qweight, qzeros, scales, x, out))
    with capsys.disabled():
        print(f"\nAWQ W4A16 {rows}x{in_features}x{out_features}: {ms * 1e3:.1f} us, "
              f"{moved / ms / 1e6:.0f} GB/s ({moved / ms / 4.8e9:.0%} of 4.8 TB/s); "
              f"dense bf16 matmul {dense_ms * 1e3:.1f} us")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [TileConfig(128, 64, 1, block_m, 8, 3, True) for block_m in (64, 128, 256)]
                         + [TileConfig(64, 128, 1, 64, 4, 4, True), TileConfig(64, 128, 1, 256, 8, 2, True)],
                         ids=str)
@pytest.mark.parametrize("rows", [64, 100, 256])
@pytest.mark.parametrize("in_features, out_features", [(4096, 6144), (14336, 4096)])
def test_swapped_gemm_at_llama_size_on_gpu(w4a16, in_features, out_features, rows, config):
    """The GEMM's swapped form (wgmma on Hopper, the weights its A operand) compiled for the GPU at
    Llama-3-8B's qkv and down projections, bf16, groups of 128, whole and partial row tiles,
    against the float32 reference."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    weight = torch.randn(in_features, out_features, device="cuda", generator=gen).bfloat16() * 0.02
    gemm_format = quantize_awq(weight, 128)
    x = torch.randn(rows, in_features, device="cuda", generator=gen).bfloat16()
    expected = awq_linear_torch(x.float(), gemm_format[0], gemm_format[1], gemm_format[2].float(), 128)
    out = w4a16.awq_linear_triton(x, *repack_awq(*gemm_format, 128), 128, None, config)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [TileConfig(block_n=8, block_k=2048, num_stages=3),
                                    TileConfig(block_n=8, block_k=2048, num_stages=1),
                                    TileConfig(block_n=4, block_k=1024, split_k=2),
                                    TileConfig(block_n=16, block_k=1024, num_warps=8),
                                    TileConfig(block_n=32, block_k=128, split_k=3, block_m=16)], ids=str)
@pytest.mark.parametrize("group_size", [32, 128])
def test_one_row_gemv_tiles_at_llama_size_on_gpu(w4a16, config, group_size):
    """The one-row GEMV's tiles (K steps spanning 16 groups of 128 or 64 of 32, split or not, with
    and without the next step's prefetch, and the tl.dot path) compiled for the GPU, on the down
    projection's shape, against the reference."""
    gen = torch.Generator(device="cuda").manual_seed(group_size)
    weight = torch.randn(14336, 4096, device="cuda", generator=gen).bfloat16() * 0.02
    gemm_format = quantize_awq(weight, group_size)
    x = torch.randn(1, 14336, device="cuda", generator=gen).bfloat16()
    expected = awq_linear_torch(x.float(), gemm_format[0], gemm_format[1], gemm_format[2].float(), group_size)
    if group_size % config.block_k and config.block_m:
        config = TileConfig(config.block_n, group_size, config.split_k, config.block_m)
    out = w4a16.awq_linear_triton(x, *repack_awq(*gemm_format, group_size), group_size, None, config)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[torch.bfloat16])
