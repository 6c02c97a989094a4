"""The one seam between the linear layers and a weight format: a linear method says which
parameters a layer holds (dense ``weight``; AWQ's ``qweight``/``qzeros``/``scales``; FP8's
``weight``/``weight_scale``/``input_scale``), along which dimension and in which units each is cut
into tensor-parallel shards, how a dense checkpoint weight becomes them (``quantize_dense``, for
formats quantized at load and for dummy weights), what becomes of them once loaded
(``process_weights_after_loading``: AWQ repacks), and how the layer multiplies. The layers in
``pagedlab.layers.linear`` are the same for every format."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedlab.distributed.sharding import read_whole
from pagedlab.kernels.gemv_configs import GEMV_MAX_ROWS, TileConfig, dense_gemv_config, fp8_gemv_config
from pagedlab.kernels.norm_fold import FoldedRMSNorm, fold_rows
from pagedlab.layers.batch_invariant import batch_invariant_enabled, invariant_linear
from pagedlab.quantization.awq import (VALUES_PER_INT32, AWQConfig, quantize_awq, repack_awq,
                                       repacked_linear_torch)
from pagedlab.quantization.fp8 import (FP8_DTYPE, FP8Config, QuantizedActivations, fp8_kernels_run,
                                       fp8_linear_cuda, fp8_linear_torch, quantize_fp8_per_row,
                                       scaled_mm_runs)


@dataclass(frozen=True)
class WeightSpec:
    """One parameter of a linear of ``in_features`` x ``out_features``: its ``shape``, its dtype
    (None: the model's), and for each of the two features the dimension it runs along and how
    many features one index there covers (8 per packed int32 column, ``group_size`` per group);
    a dimension of None: the parameter does not run along that feature, and every rank holds it
    whole there (a per-channel scale has no input dimension; a per-layer scalar has neither)."""

    name: str
    shape: tuple[int, int]
    dtype: torch.dtype | None
    out_dim: int | None
    out_unit: int
    in_dim: int | None
    in_unit: int


class LinearMethod:
    """What every format shares: checkpoint tensors are loaded as they are, and only a format
    that sets ``quantize_at_load`` takes dense checkpoint weights (through ``quantize_dense``)."""

    quantize_at_load = False
    silu_emits_fp8 = False  # apply_silu_and_mul returns QuantizedActivations, not a tensor

    def checkpoint_tensor(self, spec: WeightSpec, loaded, shape: tuple[int, ...]):
        """The checkpoint tensor ``loaded`` of parameter ``spec`` in the layout the layer cuts,
        whose full shape is ``shape`` (the identity, unless a format stores it otherwise)."""
        return loaded

    def quantize_dense(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The full parameters of this format for the full dense ``weight`` ``[out, in]``."""
        raise NotImplementedError

    def gemv_config(self, layer, x: torch.Tensor) -> TileConfig | None:
        """The dense Triton GEMV config ``apply`` multiplies ``x`` with on a GPU, or None: another
        kernel (what a LoRA linear asks, to add its deltas in that GEMV's epilogue)."""
        return None

    def folds_norm(self, layer, x: torch.Tensor) -> bool:
        """Whether ``apply`` takes ``x``'s RMSNorm as a ``FoldedRMSNorm`` and computes it in its
        kernel (``kernels/norm_fold.py``): its Triton GEMV runs this batch (none here)."""
        return False

    def fuses_silu(self, layer, x: torch.Tensor) -> bool:
        """Whether ``apply_silu_and_mul`` runs at this batch: up to ``FOLD_MAX_ROWS`` rows, where
        the format's Triton GEMV (the one that folds norms) runs."""
        return fold_rows(x) and self.folds_norm(layer, x)

    def apply_silu_and_mul(self, layer, x: torch.Tensor | FoldedRMSNorm,
                           bias: torch.Tensor | None) -> torch.Tensor:
        """``silu_and_mul(apply(x))`` of a gate_up projection in one gated GEMV, SiLU-and-mul in
        its epilogue (``kernels/gemv.py``); only where ``fuses_silu``."""
        raise NotImplementedError(f"{type(self).__name__} has no gated GEMV")

    def process_weights_after_loading(self, layer) -> None:
        """Turn the loaded (and tensor-parallel cut) parameters into the layout ``apply`` reads;
        called once per layer by the loader after every weight is set (nothing to do here)."""


class DenseLinearMethod(LinearMethod):
    """``nn.Linear``'s ``weight`` ``[out_features, in_features]``."""

    def weight_specs(self, in_features: int, out_features: int) -> list[WeightSpec]:
        return [WeightSpec("weight", (out_features, in_features), None, 0, 1, 1, 1)]

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)

    def gemv_config(self, layer, x: torch.Tensor) -> TileConfig | None:
        return dense_gemv_choice(x, layer.weight)

    def folds_norm(self, layer, x: torch.Tensor) -> bool:
        return dense_gemv_runs(x, layer.weight)

    def apply_silu_and_mul(self, layer, x: torch.Tensor | FoldedRMSNorm,
                           bias: torch.Tensor | None) -> torch.Tensor:
        from pagedlab.kernels.gemv import dense_gemv_triton

        rows = x.x if isinstance(x, FoldedRMSNorm) else x
        return dense_gemv_triton(x, layer.weight, bias, dense_gemv_choice(rows, layer.weight), gated=True)

    def quantize_dense(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": weight}


def dense_linear(x: torch.Tensor | FoldedRMSNorm, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or on CUDA the Triton GEMV (``pagedlab.kernels.gemv``) for the batch sizes and
    weight shapes where ``gemv_configs.DENSE_GEMV_CONFIGS`` records it beating cuBLAS. The choice
    depends on shapes alone, so CUDA graphs capture it. In batch-invariant mode: the fixed-order
    matmul of ``pagedlab.layers.batch_invariant``. A ``FoldedRMSNorm`` ``x`` goes into the GEMV
    whole; elsewhere it is materialized first."""
    activations = x.x if isinstance(x, FoldedRMSNorm) else x
    config = dense_gemv_choice(activations, weight) if activations.is_cuda else None
    if config is not None:
        from pagedlab.kernels.gemv import dense_gemv_triton

        return dense_gemv_triton(x, weight, bias, config)
    if isinstance(x, FoldedRMSNorm):
        x = x.materialize()
    if batch_invariant_enabled():
        return invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def dense_gemv_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``dense_linear`` multiplies ``x`` by ``weight`` on the Triton GEMV (so that it can
    fold the RMSNorm before it, ``FoldedRMSNorm``)."""
    return x.is_cuda and dense_gemv_choice(x, weight) is not None


def dense_gemv_choice(x: torch.Tensor, weight: torch.Tensor) -> TileConfig | None:
    """The GEMV config ``dense_linear`` runs ``x @ weight.T`` with on a GPU (shapes and dtypes
    decide, not the device), or None: cuBLAS, or the batch-invariant matmul."""
    if batch_invariant_enabled() or x.dtype != weight.dtype or x.stride(-1) != 1:
        return None
    return dense_gemv_config(x.numel() // x.shape[-1], *weight.shape)


class AWQLinearMethod(LinearMethod):
    """AutoAWQ's GEMM format (``pagedlab.quantization.awq``) as loaded and cut for tensor
    parallelism; ``process_weights_after_loading`` repacks it once into the K-contiguous layout
    (``repack_awq``; same names, the old tensors freed), which ``apply`` multiplies: the Triton
    W4A16 kernels on CUDA, the plain-torch dequantize-and-multiply elsewhere. With
    ``quantize_at_load`` a dense checkpoint's weights are rounded to nearest (``quantize_awq``:
    not activation-aware)."""

    def __init__(self, config: AWQConfig):
        self.group_size = config.group_size
        self.quantize_at_load = config.quantize_at_load

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

    def process_weights_after_loading(self, layer) -> None:
        """Replace ``qweight``/``qzeros``/``scales`` by their repacked tensors (``repack_awq``)."""
        if getattr(layer, "awq_repacked", False):
            raise RuntimeError(f"{type(layer).__name__}'s AWQ weights are already repacked")
        tensors = repack_awq(layer.qweight, layer.qzeros, layer.scales, self.group_size)
        for name, tensor in zip(("qweight", "qzeros", "scales"), tensors):
            delattr(layer, name)
            layer.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
        layer.awq_repacked = True

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not getattr(layer, "awq_repacked", False):
            raise RuntimeError(f"{type(layer).__name__}'s AWQ weights are in AutoAWQ's GEMM layout: call "
                               "linear_method.process_weights_after_loading(layer) once they are loaded")
        if x.is_cuda:
            from pagedlab.kernels.w4a16 import awq_linear_triton

            return awq_linear_triton(x, layer.qweight, layer.qzeros, layer.scales, self.group_size, bias)
        return repacked_linear_torch(x, layer.qweight, layer.qzeros, layer.scales, self.group_size, bias)

    def apply_silu_and_mul(self, layer, x: torch.Tensor | FoldedRMSNorm,
                           bias: torch.Tensor | None) -> torch.Tensor:
        from pagedlab.kernels.w4a16 import awq_linear_triton

        return awq_linear_triton(x, layer.qweight, layer.qzeros, layer.scales, self.group_size, bias,
                                 gated=True)

    def folds_norm(self, layer, x: torch.Tensor) -> bool:
        """On CUDA up to ``GEMV_MAX_ROWS`` rows: ``awq_linear_triton`` runs its GEMV there."""
        rows = x.numel() // x.shape[-1]
        return x.is_cuda and rows <= GEMV_MAX_ROWS and getattr(layer, "awq_repacked", False)

    def quantize_dense(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        qweight, qzeros, scales = quantize_awq(weight.t().contiguous(), self.group_size)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales}


class FP8LinearMethod(LinearMethod):
    """FP8 weights with per-output-channel scales (``pagedlab.quantization.fp8``):
    ``torch._scaled_mm`` on GPUs with FP8 tensor cores, the quantize-dequantize emulation
    elsewhere (CPU, older GPUs, features not multiples of 16). Weight-only FP8 (a checkpoint
    without activation quantization) multiplies the dequantized weight. With dynamic per-token
    activation scales ``apply`` also takes ``QuantizedActivations`` from a fused producer
    (``takes_quantized_activations``) and skips the quantization."""

    silu_emits_fp8 = True

    def __init__(self, config: FP8Config):
        self.quantize_at_load = config.quantize_at_load
        self.activations = config.activations

    def weight_specs(self, in_features: int, out_features: int) -> list[WeightSpec]:
        specs = [WeightSpec("weight", (out_features, in_features), FP8_DTYPE, 0, 1, 1, 1),
                 WeightSpec("weight_scale", (out_features, 1), torch.float32, 0, 1, None, 1)]
        if self.activations == "static":
            specs.append(WeightSpec("input_scale", (1, 1), torch.float32, None, 1, None, 1))
        return specs

    def checkpoint_tensor(self, spec: WeightSpec, loaded, shape: tuple[int, ...]):
        """A per-tensor ``weight_scale`` (one value, of shape ``[1]`` or ``[]``, as vLLM reads it)
        becomes that value on each of the tensor's rows; a scalar ``input_scale`` the ``[1, 1]``
        the layer holds."""
        if spec.name in ("weight_scale", "input_scale"):
            value = read_whole(loaded)
            if value.numel() == 1:
                return value.float().reshape(1, 1).expand(shape)
        return loaded

    def quantize_dense(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        values, scale = quantize_fp8_per_row(weight)
        return {"weight": values, "weight_scale": scale}

    def fuses_silu(self, layer, x: torch.Tensor | QuantizedActivations) -> bool:
        """At up to ``FOLD_MAX_ROWS`` rows with dynamic activation scales, no bias, on a GPU where
        the FP8 GEMV runs this gate/up shape (``FP8_GEMV_CONFIGS``): ``apply_silu_and_mul`` then
        emits the down projection's ``QuantizedActivations`` in two launches."""
        rows = x.values if isinstance(x, QuantizedActivations) else x
        return (self.activations == "dynamic" and layer.bias is None and fold_rows(rows)
                and scaled_mm_runs(layer.weight)
                and fp8_gemv_config(rows.shape[0], *layer.weight.shape) is not None)

    def apply_silu_and_mul(self, layer, x: torch.Tensor | QuantizedActivations,
                           bias: torch.Tensor | None) -> QuantizedActivations:
        """The gated FP8 GEMV and the quantization of its SiLU-and-mul
        (``kernels/fp8_linear.fp8_gemv_silu_and_mul_triton``); only where ``fuses_silu``."""
        from pagedlab.kernels.fp8_linear import fp8_gemv_silu_and_mul_triton, quantize_fp8_per_token_triton

        if not isinstance(x, QuantizedActivations):
            x = QuantizedActivations(*quantize_fp8_per_token_triton(x), x.dtype)
        config = fp8_gemv_config(x.values.shape[0], *layer.weight.shape)
        return fp8_gemv_silu_and_mul_triton(x, layer.weight, layer.weight_scale, config)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        input_scale = layer.input_scale if self.activations == "static" else None
        if self.activations != "none" and scaled_mm_runs(layer.weight):
            return fp8_linear_cuda(x, layer.weight, layer.weight_scale, input_scale, bias)
        return fp8_linear_torch(x, layer.weight, layer.weight_scale, input_scale, bias,
                                quantize_input=self.activations != "none")


def takes_quantized_activations(linear) -> bool:
    """Whether the module ``linear`` takes ``QuantizedActivations`` from a fused producer: a linear
    of ``pagedlab.layers.linear`` in FP8 with dynamic per-token activation scales, on the CPU or
    on a GPU where the FP8 kernels that produce them run (a LoRA wrapper, whose shrink needs the
    unquantized input, is not one)."""
    method = getattr(linear, "linear_method", None)
    if not isinstance(method, FP8LinearMethod) or method.activations != "dynamic":
        return False
    return not linear.weight.is_cuda or fp8_kernels_run(linear.weight.device)


# Our fused linears and the checkpoint modules they hold.
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def linear_method_for(config: AWQConfig | FP8Config | None, prefix: str) -> LinearMethod:
    """The method of the linear named ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``): dense
    without quantization and for the modules the checkpoint leaves dense (AWQ's
    ``modules_to_not_convert``, compressed-tensors' ``ignore``)."""
    if config is None:
        return DenseLinearMethod()
    if isinstance(config, FP8Config):
        parent, _, leaf = prefix.rpartition(".")
        parts = [f"{parent}.{part}" for part in _FUSED_PARTS.get(leaf, (leaf,))]
        # a checkpoint that holds the fused module itself (Phi-3's qkv_proj) names it whole
        if config.skips([prefix]) or config.skips(parts):
            return DenseLinearMethod()
        return FP8LinearMethod(config)
    if any(skipped in prefix for skipped in config.modules_to_not_convert):
        return DenseLinearMethod()
    return AWQLinearMethod(config)
