"""The FP8 linear kernels (``pagedlab.kernels.fp8_linear``) against their torch references on fresh
random inputs: per-token activation quantization bit for bit (dynamic and static scales, an
all-zero row, values past E4M3's range), and the FP8 GEMV against the float32 product of the
dequantized operands, on the CUDA cores and through tl.dot, with K split and not.

On a machine without CUDA the kernels run under the Triton interpreter at small sizes;
TRITON_INTERPRET is set here, before the kernel modules are first imported.
"""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch


from pagedlab.kernels.gemv_configs import GEMV_MAX_ROWS, TileConfig
from pagedlab.quantization.fp8 import quantize_fp8, quantize_fp8_per_row

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def fp8_kernels():
    pytest.importorskip("triton")
    return importlib.import_module("pagedlab.kernels.fp8_linear")


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("in_features", [300, 2048 + 5])
def test_per_token_quantization_equals_torch_bit_for_bit(fp8_kernels, dtype, in_features):
    gen = _generator("dynamic", dtype, in_features)
    x = (torch.randn(6, in_features, generator=gen) * torch.rand(6, 1, generator=gen) * 10).to(dtype)
    x[1] = 0  # all-zero row: the minimum scale, zeros out
    x[2, 7] = 6e4 if dtype == torch.float16 else 1e5  # one outlier sets its row's scale
    x[3, ::3] *= 1e-4  # E4M3 subnormals
    values, scales = fp8_kernels.quantize_fp8_per_token_triton(x.to(DEVICE))
    expected_values, expected_scales = quantize_fp8_per_row(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (6, 1)
    assert torch.equal(scales.cpu(), expected_scales)
    assert torch.equal(_bits(values), _bits(expected_values))


@pytest.mark.parametrize("split_block", [0, 128])  # 2053 / 128: 17 chunks, the last of 5 values
def test_split_per_token_quantization_equals_torch_bit_for_bit(fp8_kernels, split_block):
    """The split form (what few rows run on a GPU: chunk maxima, then each chunk quantized at its
    row's scale) and the one-program form forced, on the cases above."""
    gen = _generator("split", split_block)
    x = (torch.randn(3, 2053, generator=gen) * 10).bfloat16()
    x[1] = 0
    x[2, 2052] = 1e5  # the outlier in the last, partial chunk
    x[0, ::3] *= 1e-4
    values, scales = fp8_kernels.quantize_fp8_per_token_triton(x.to(DEVICE), split_block=split_block)
    expected_values, expected_scales = quantize_fp8_per_row(x)
    assert torch.equal(scales.cpu(), expected_scales)
    assert torch.equal(_bits(values), _bits(expected_values))


def test_static_scale_quantization_saturates_like_torch(fp8_kernels):
    gen = _generator("static")
    x = (torch.randn(4, 96, generator=gen) * 8).bfloat16()
    static = torch.tensor([[0.005]])  # 8 / 0.005 is far past 448: values saturate, none is NaN
    values, scales = fp8_kernels.quantize_fp8_per_token_triton(x.to(DEVICE), static.to(DEVICE))
    expected = quantize_fp8(x, static.float())
    assert torch.equal(_bits(values), _bits(expected))
    assert torch.equal(scales.cpu(), torch.full((4, 1), 0.005))
    assert values.float().abs().max().item() == 448.0


# (rows, config): block_m=0 multiplies on the CUDA cores, 16 through tl.dot; split_k > 1 cuts K
# into segments summed in-kernel. K=200 is not a multiple of block_k, N=40 leaves a partial tile.
GEMV_CASES = [
    (1, None),
    (1, TileConfig(block_n=16, block_k=64, split_k=3)),
    (4, TileConfig(block_n=8, block_k=32, split_k=1)),
    (5, TileConfig(block_n=16, block_k=32, split_k=2, block_m=16)),
    (GEMV_MAX_ROWS, None),
    # the weight tile as the dot's A operand (swap_ab); on a GPU the FP8 operands go to wgmma as is
    (1, TileConfig(block_n=64, block_k=64, split_k=2, block_m=16, swap_ab=True)),
    (7, TileConfig(block_n=16, block_k=32, block_m=16, swap_ab=True)),
]


@pytest.mark.parametrize(("rows", "config"), GEMV_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemv_equals_the_dequantized_product(fp8_kernels, rows, config, with_bias):
    gen = _generator("gemv", rows, config, with_bias)
    x = torch.randn(rows, 200, generator=gen).bfloat16()
    weight = torch.randn(40, 200, generator=gen) * 0.05
    bias = torch.randn(40, generator=gen).bfloat16() if with_bias else None
    values, scales = quantize_fp8_per_row(x)
    weight_values, weight_scales = quantize_fp8_per_row(weight)
    out = fp8_kernels.fp8_gemv_triton(values.to(DEVICE), scales.to(DEVICE), weight_values.to(DEVICE),
                                      weight_scales.to(DEVICE), None if bias is None else bias.to(DEVICE),
                                      torch.float32, config)
    expected = (values.float() * scales) @ (weight_values.float() * weight_scales).T
    if bias is not None:
        expected += bias.float()
    assert out.shape == (rows, 40) and out.dtype == torch.float32
    # A swapped tile on a GPU sums each chunk of K in wgmma's FP8 accumulator, which keeps fewer
    # bits than float32 (about 1e-3 of the output on the H200); elsewhere products of E4M3 values
    # are exact in float32 and only the order of the sums differs.
    native = DEVICE == "cuda" and config is not None and config.swap_ab
    close = dict(atol=5e-4, rtol=5e-3) if native else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu(), expected, **close)


def test_fp8_gemv_refuses_a_batch_over_its_rows(fp8_kernels):
    values = torch.zeros(GEMV_MAX_ROWS + 1, 32, dtype=torch.float8_e4m3fn)
    weight = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"17 rows is over the GEMV's 16: use torch._scaled_mm"):
        fp8_kernels.fp8_gemv_triton(values, torch.ones(17, 1), weight, torch.ones(16, 1), None,
                                    torch.bfloat16)


# (rows, config) of the gated FP8 GEMV: one row on the CUDA cores with K split, the swapped tl.dot
# tile with K split (its second tile holds 8 of its 32 gate columns), rows on the CUDA cores and
# through tl.dot.
GATED_CASES = [
    (1, TileConfig(block_n=16, block_k=64, split_k=3)),
    (1, TileConfig(block_n=64, block_k=64, split_k=2, block_m=16, swap_ab=True)),
    (4, TileConfig(block_n=8, block_k=32, split_k=1)),
    (5, TileConfig(block_n=16, block_k=32, split_k=2, block_m=16)),
]


@pytest.mark.parametrize(("rows", "config"), GATED_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gated_fp8_gemv_quantizes_its_silu_and_mul(fp8_kernels, rows, config, dtype):
    """``fp8_gemv_silu_and_mul_triton``: the SiLU-and-mul it writes is ``silu_and_mul`` of the
    plain FP8 GEMV's gate and up (``gated_tolerance``; a bfloat16 rounding on the CPU, where
    numpy's exp may land on the other side of a tie), and its FP8 values and scales are
    ``quantize_fp8_per_row`` of what it wrote, bit for bit: the down projection's input as the
    unfused path would make it. The largest value sits in the last, partial column tile."""
    from conftest import gated_tolerance
    from pagedlab.layers.activation import silu_and_mul
    from pagedlab.quantization.fp8 import QuantizedActivations

    gen = _generator("gated", rows, config, dtype)
    direction = torch.randn(200, generator=gen)
    weight = torch.randn(80, 200, generator=gen) * 0.05
    weight[[39, 79]] = direction * 0.05  # gate and up of column 39 near 10 in every row: its maxima
    weight_values, weight_scales = (t.to(DEVICE) for t in quantize_fp8_per_row(weight))
    rows_in = torch.randn(rows, 200, generator=gen) * 0.1 + direction
    x = QuantizedActivations(*(t.to(DEVICE) for t in quantize_fp8_per_row(rows_in)), dtype)
    act = torch.empty(rows, 40, dtype=dtype, device=DEVICE)
    quantized = fp8_kernels.fp8_gemv_silu_and_mul_triton(x, weight_values, weight_scales, config, act_out=act)
    plain = fp8_kernels.fp8_gemv_triton(x.values, x.scales, weight_values, weight_scales, None, dtype, config)
    expected_act = silu_and_mul(plain.float()).to(dtype)
    close = gated_tolerance(dtype) if dtype == torch.float16 else dict(atol=1e-6, rtol=8e-3)
    torch.testing.assert_close(act, expected_act, **close)
    assert (act.float().abs().argmax(dim=1) == 39).all()
    expected_values, expected_scales = quantize_fp8_per_row(act.cpu())
    assert quantized.dtype == dtype and quantized.values.shape == (rows, 40)
    assert torch.equal(quantized.scales.cpu(), expected_scales)
    assert torch.equal(_bits(quantized.values), _bits(expected_values))


def test_tile_maxima_come_only_from_a_gated_launch(fp8_kernels):
    from pagedlab.kernels.gemv import launch_dense_gemv

    x = torch.zeros(1, 32, dtype=torch.float8_e4m3fn, device=DEVICE)
    weight = torch.zeros(16, 32, dtype=torch.float8_e4m3fn, device=DEVICE)
    out, ones = torch.empty(1, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match=r"must be a gated launch's contiguous float32 \(1, 2\)"):
        launch_dense_gemv(x, weight, None, out, TileConfig(block_n=8, block_k=32), row_scales=ones[:1],
                          col_scales=ones, tile_max=torch.empty(1, 2, device=DEVICE))
