"""The one seam between the linear layers and a weight format: a linear method says which
parameters a layer holds (dense ``weight``, or AWQ's ``qweight``/``qzeros``/``scales``), along
which dimension and in which units each is cut into tensor-parallel shards, and how the layer
multiplies. The layers in ``pagedlab.layers.linear`` are the same for every format."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedlab.kernels.gemv_configs import dense_gemv_config
from pagedlab.quantization.awq import VALUES_PER_INT32, AWQConfig, awq_linear_torch


@dataclass(frozen=True)
class WeightSpec:
    """One parameter of a linear of ``in_features`` x ``out_features``: its ``shape``, its dtype
    (None: the model's), and for each of the two features the dimension it runs along and how
    many features one index there covers (8 per packed int32 column, ``group_size`` per group)."""

    name: str
    shape: tuple[int, int]
    dtype: torch.dtype | None
    out_dim: int
    out_unit: int
    in_dim: int
    in_unit: int


class DenseLinearMethod:
    """``nn.Linear``'s ``weight`` ``[out_features, in_features]``."""

    def weight_specs(self, in_features: int, out_features: int) -> list[WeightSpec]:
        return [WeightSpec("weight", (out_features, in_features), None, 0, 1, 1, 1)]

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or on CUDA the Triton GEMV (``pagedlab.kernels.gemv``) for the batch sizes and
    weight shapes where ``gemv_configs.DENSE_GEMV_CONFIGS`` records it beating cuBLAS. The choice
    depends on shapes alone, so CUDA graphs capture it."""
    if x.is_cuda and x.dtype == weight.dtype and x.stride(-1) == 1:
        config = dense_gemv_config(x.numel() // x.shape[-1], *weight.shape)
        if config is not None:
            from pagedlab.kernels.gemv import dense_gemv_triton

            return dense_gemv_triton(x, weight, bias, config)
    return F.linear(x, weight, bias)


class AWQLinearMethod:
    """AutoAWQ's GEMM format (``pagedlab.quantization.awq``): the Triton W4A16 kernels on CUDA,
    the plain-torch dequantize-and-multiply elsewhere."""

    def __init__(self, config: AWQConfig):
        self.group_size = config.group_size

    def weight_specs(self, in_features: int, out_features: int) -> list[WeightSpec]:
        group, word = self.group_size, VALUES_PER_INT32
        if in_features % group or out_features % word:
            raise ValueError(f"an AWQ linear of {in_features} inputs and {out_features} outputs "
                             f"(this rank's) needs whole groups of {group} inputs and whole int32 words "
                             f"of {word} outputs")
        return [WeightSpec("qweight", (in_features, out_features // word), torch.int32, 1, word, 0, 1),
                WeightSpec("qzeros", (in_features // group, out_features // word), torch.int32,
                           1, word, 0, group),
                WeightSpec("scales", (in_features // group, out_features), None, 1, 1, 0, group)]

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            from pagedlab.kernels.w4a16 import awq_linear_triton

            return awq_linear_triton(x, layer.qweight, layer.qzeros, layer.scales, self.group_size, bias)
        return awq_linear_torch(x, layer.qweight, layer.qzeros, layer.scales, self.group_size, bias)


def quantization_config_of(hf_config) -> AWQConfig | None:
    """The checkpoint's AWQ settings (from config.json's ``quantization_config``), or None."""
    quantization_config = getattr(hf_config, "quantization_config", None)
    if not quantization_config:
        return None
    if not isinstance(quantization_config, dict):
        quantization_config = quantization_config.to_dict()
    return AWQConfig.from_hf_config(quantization_config)


def linear_method_for(config: AWQConfig | None, prefix: str) -> DenseLinearMethod | AWQLinearMethod:
    """The method of the linear named ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``): dense
    without quantization and for the modules the checkpoint lists in ``modules_to_not_convert``."""
    if config is None or any(skipped in prefix for skipped in config.modules_to_not_convert):
        return DenseLinearMethod()
    return AWQLinearMethod(config)
