"""FP8 (E4M3, ``torch.float8_e4m3fn``) weights and activations: the checkpoint config, the
quantization, the plain-torch emulation (the CPU path and the reference) and the
CUDA path (Triton kernels and ``torch._scaled_mm``).

A linear ``y = x W^T + b`` with ``W`` of shape ``[out_features, in_features]`` holds

- ``weight`` float8_e4m3fn ``[out_features, in_features]`` (one byte per weight), the values
  ``q = fp8(W / s_w)``;
- ``weight_scale`` float32 ``[out_features, 1]``: one scale per output channel,
  ``s_w = max|W[n, :]| / 448`` (448 is E4M3's largest finite value). A checkpoint's per-tensor
  scale is held as that value on every row of its tensor, which multiplies the same;
- ``input_scale`` float32 ``[1, 1]`` only for static activation scales (a calibrated per-tensor
  scale from the checkpoint); otherwise each token's activations get their own scale,
  ``s_x = max|x[t, :]| / 448``, computed on the fly.

and ``y[t, n] = (sum_k fp8(x[t, k] / s_x) * q[n, k]) * s_x * s_w[n] + b[n]``. Rounding to
E4M3 is round-to-nearest-even after clamping to +-448 (a float8 cast of a value beyond the range
would be NaN).

Dynamic per-token activations come either as the 16/32-bit tensor, quantized here (on CUDA by
one Triton launch before the GEMV or GEMM), or already quantized as ``QuantizedActivations``: in
the Llama-family decoder the RMSNorms before qkv_proj and gate_up_proj and the SiLU-and-mul
before down_proj emit them in their own kernel (``models/llama.py``'s ``emit_fp8_inputs``), the
same values ``quantize_fp8_per_row`` gives for the producer's output; o_proj quantizes its input.

Tensor parallelism: a column-parallel rank holds whole rows, so its scales are the TP=1 scales.
A row-parallel rank holds part of each row; its weight scales are still the full row's (the
loader quantizes the full checkpoint tensor, then cuts), but each rank's per-token activation
scale is over its own slice of the input (as in vLLM: the alternative is an all-reduce of the
maxima in every row-parallel layer), so TP=N is not bit-identical to TP=1 there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedlab.kernels.device import compute_capability
from pagedlab.kernels.gemv_configs import fp8_gemv_config

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_SCALE = 1e-12  # an all-zero row's scale: any positive value quantizes it to zeros
SUPPORTED = ("online quantization of 16/32-bit weights (quantization='fp8'), and compressed-tensors "
             "'float-quantized' checkpoints: 8-bit float weights with per-channel or per-tensor scales, "
             "activations dynamic per token, static per tensor, or not quantized")


@dataclass(frozen=True)
class FP8Config:
    """How a model's linears hold FP8: quantized at load from a 16/32-bit checkpoint
    (``quantize_at_load``, per-channel weight scales, dynamic per-token activations), or read from
    a compressed-tensors checkpoint (its weight scales per channel or per tensor; activations
    dynamic per token, static per tensor, or left unquantized). ``ignore`` lists the checkpoint's
    modules left dense (names, or ``re:`` regular expressions, as compressed-tensors writes them)."""

    quantize_at_load: bool = True
    activations: str = "dynamic"  # "dynamic" (per token), "static" (checkpoint input_scale) or "none"
    ignore: tuple[str, ...] = ()

    name = "fp8"

    def skips(self, module_names: list[str]) -> bool:
        """Whether the checkpoint modules ``module_names`` (the parts of one fused linear) stay
        dense; the parts of a fused linear must agree."""
        ignored = [any(_matches(rule, name) for rule in self.ignore) for name in module_names]
        if any(ignored) and not all(ignored):
            raise ValueError(f"the compressed-tensors ignore list {list(self.ignore)} leaves some of "
                             f"{module_names} dense but not all: they are one fused matrix here")
        return all(ignored)

    @classmethod
    def from_compressed_tensors(cls, quantization_config: dict[str, Any]) -> FP8Config:
        """Read a compressed-tensors ``quantization_config``; anything but FP8 float-quantized
        weights is a ValueError naming the value and what is supported."""
        def refuse(what: str) -> ValueError:
            return ValueError(f"compressed-tensors checkpoint with {what} is not supported: supported "
                              f"FP8 is {SUPPORTED}")

        status = quantization_config.get("quantization_status", "compressed")
        if status != "compressed":
            raise refuse(f"quantization_status={status!r} (only 'compressed' checkpoints)")
        for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
            if quantization_config.get(key):
                raise refuse(f"{key}={quantization_config[key]!r}")
        groups = list((quantization_config.get("config_groups") or {}).values())
        if not groups:
            raise refuse("no config_groups")
        schemes = {_scheme_of(group, quantization_config.get("format"), refuse) for group in groups}
        if len(schemes) > 1:
            raise refuse(f"several different schemes {sorted(schemes)} (one FP8 scheme for every layer)")
        for group in groups:
            targets = group.get("targets") or []
            if targets != ["Linear"]:
                raise refuse(f"targets={targets!r} (only ['Linear']: every linear layer, less 'ignore')")
        return cls(quantize_at_load=False, activations=schemes.pop(),
                   ignore=tuple(quantization_config.get("ignore") or ()))


def _scheme_of(group: dict, default_format: str | None, refuse) -> str:
    """The activation scheme ("dynamic", "static" or "none") of one FP8 config group."""
    fmt = group.get("format") or default_format
    if fmt != "float-quantized":
        raise refuse(f"format={fmt!r} (only 'float-quantized')")
    weights = group.get("weights") or {}
    kind = (weights.get("type"), weights.get("num_bits"))
    if kind != ("float", 8):
        raise refuse(f"weights of type {kind[0]!r} and {kind[1]!r} bits (int8 W8A8, W4A16 and FP4 are not "
                     "FP8)")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise refuse(f"weight strategy {weights.get('strategy')!r} (block-wise and group-wise FP8 scales "
                     "are not implemented)")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise refuse("asymmetric or dynamic weight scales")
    if group.get("output_activations"):
        raise refuse("quantized output activations")
    inputs = group.get("input_activations")
    if not inputs:
        return "none"
    if (inputs.get("type"), inputs.get("num_bits")) != ("float", 8) or not inputs.get("symmetric", True):
        raise refuse(f"input activations {inputs!r} (only symmetric 8-bit float)")
    if inputs.get("dynamic") is True and inputs.get("strategy") == "token":
        return "dynamic"
    if inputs.get("dynamic") is False and inputs.get("strategy") == "tensor":
        return "static"
    raise refuse(f"input activations of strategy {inputs.get('strategy')!r} and "
                 f"dynamic={inputs.get('dynamic')!r} (only dynamic per token or static per tensor)")


def _matches(rule: str, name: str) -> bool:
    """compressed-tensors' rule: ``re:PATTERN`` matches a module name from its start, else equality."""
    return re.match(rule[3:], name) is not None if rule.startswith("re:") else rule == name


def fp8_row_scales(x: torch.Tensor) -> torch.Tensor:
    """One float32 scale per row of the 2-D ``x``: ``max|row| / 448``, shape ``[rows, 1]``."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # A tensor divisor: CUDA divides by a Python number as a product with its rounded reciprocal,
    # which differs in the last bit from the division the CPU and the Triton kernel do.
    return (amax / amax.new_tensor(FP8_MAX)).clamp(min=_MIN_SCALE)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(x / scale)``: E4M3 values (round to nearest even, clamped to +-448); ``scale``
    broadcasts against ``x`` (a ``[rows, 1]`` or a one-element tensor)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per output channel of a weight, per token of activations) quantization of the
    2-D ``x``: ``(values float8_e4m3fn, scales float32 [rows, 1])``."""
    scale = fp8_row_scales(x)
    return quantize_fp8(x, scale), scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values * scale`` in ``dtype`` (the product computed in float32)."""
    return (values.float() * scale).to(dtype)


@dataclass(frozen=True)
class QuantizedActivations:
    """A linear's input already quantized per token, by the layer that produced it: ``values``
    float8_e4m3fn ``[tokens, in_features]``, ``scales`` float32 ``[tokens, 1]`` (what
    ``quantize_fp8_per_row`` returns), ``dtype`` the unquantized activations' dtype (the linear's
    output dtype). FP8 linears with dynamic per-token activation scales take it in place of ``x``."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def of(cls, x: torch.Tensor) -> QuantizedActivations:
        """``quantize_fp8_per_row`` of the 2-D ``x``: the reference of every fused producer."""
        return cls(*quantize_fp8_per_row(x), x.dtype)


def _check_dynamic(x: QuantizedActivations, input_scale: torch.Tensor | None, quantize_input: bool) -> None:
    if input_scale is not None or not quantize_input:
        other = "a static input_scale" if input_scale is not None else "unquantized inputs"
        raise ValueError(f"activations quantized per token ({tuple(x.values.shape)}) reached an FP8 linear "
                         f"with {other}: only dynamic per-token activation scales take them")


def _quantize_input(x2d: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``[tokens, in_features]`` to FP8 with per-token dynamic scales, or with the
    static per-tensor ``input_scale``; the scales are returned as ``[tokens, 1]``."""
    if input_scale is None:
        return quantize_fp8_per_row(x2d)
    scale = input_scale.float().reshape(1, 1).expand(x2d.shape[0], 1)
    return quantize_fp8(x2d, scale), scale


def fp8_linear_torch(x: torch.Tensor | QuantizedActivations, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     quantize_input: bool = True) -> torch.Tensor:
    """The emulation (CPU path and reference of ``fp8_linear_cuda``): ``x`` quantized to FP8
    and back (per token, or with the static ``input_scale``; not at all when ``quantize_input`` is
    False: FP8 weights with 16-bit activations; ``QuantizedActivations`` only dequantized), times
    the dequantized weight, both in the activations' dtype."""
    if isinstance(x, QuantizedActivations):
        _check_dynamic(x, input_scale, quantize_input)
        x2d, dtype, lead = dequantize_fp8(x.values, x.scales, x.dtype), x.dtype, x.values.shape[:-1]
    else:
        x2d, dtype, lead = x.reshape(-1, x.shape[-1]), x.dtype, x.shape[:-1]
        if quantize_input:
            values, scale = _quantize_input(x2d, input_scale)
            x2d = dequantize_fp8(values, scale, dtype)
    out = F.linear(x2d, dequantize_fp8(weight, weight_scale, dtype), None if bias is None else bias.to(dtype))
    return out.reshape(*lead, weight.shape[0])


def fp8_kernels_run(device: torch.device) -> bool:
    """Whether the FP8 Triton kernels run on the CUDA ``device``: FP8 tensor cores and E4M3
    conversions (compute capability 8.9+: Ada, Hopper and later)."""
    return compute_capability(device) >= (8, 9)


def scaled_mm_runs(weight: torch.Tensor) -> bool:
    """Whether ``fp8_linear_cuda`` can run on this FP8 ``weight``: a CUDA GPU where the FP8
    kernels run and both features multiples of 16 (cuBLASLt's rule)."""
    return (weight.is_cuda and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
            and fp8_kernels_run(weight.device))


def fp8_linear_cuda(x: torch.Tensor | QuantizedActivations, weight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA path (FP8 tensor cores, compute capability 8.9+): the activations quantized per
    token (or at the static ``input_scale``) by one Triton kernel, unless they come quantized
    (``QuantizedActivations``), then the shapes
    ``FP8_GEMV_CONFIGS`` lists (by row bucket) through the Triton FP8 GEMV, the rest through
    ``torch._scaled_mm`` (row-wise float32 scales ``[tokens, 1]`` and ``[1, out_features]``, bf16
    output, the one dtype row-wise scaling allows). Both sum exact E4M3 products in float32 (the
    GEMV's swapped tiles each 128 of K on the tensor cores first), so they differ from each other
    in summation order. ``weight`` is ``[out, in]`` row-major, so ``weight.t()``
    is the column-major operand cuBLASLt needs; both features must be multiples of 16."""
    from pagedlab.kernels.fp8_linear import fp8_gemv_triton, quantize_fp8_per_token_triton

    if isinstance(x, QuantizedActivations):
        _check_dynamic(x, input_scale, True)
        values, scale, dtype, lead = x.values, x.scales, x.dtype, x.values.shape[:-1]
    else:
        x2d, dtype, lead = x.reshape(-1, x.shape[-1]), x.dtype, x.shape[:-1]
        values, scale = quantize_fp8_per_token_triton(x2d if x2d.stride(-1) == 1 else x2d.contiguous(),
                                                      None if input_scale is None else input_scale.float())
    config = fp8_gemv_config(values.shape[0], *weight.shape)
    if config is not None:
        out = fp8_gemv_triton(values, scale, weight, weight_scale, bias, dtype, config)
    else:
        out = scaled_mm_fp8(values, scale, weight, weight_scale).to(dtype)
        if bias is not None:
            out = out + bias.to(dtype)
    return out.reshape(*lead, weight.shape[0])


def scaled_mm_fp8(values: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                  weight_scale: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_mm`` (cuBLASLt) of FP8 ``values`` ``[tokens, K]`` with row-wise ``scale``
    ``[tokens, 1]`` by the ``[out, K]`` FP8 ``weight`` with ``weight_scale`` ``[out, 1]``: the bf16
    ``[tokens, out]`` product, ``fp8_linear_cuda``'s path for shapes the FP8 GEMV does not take."""
    return torch._scaled_mm(values, weight.t(), scale_a=scale, scale_b=weight_scale.t(),
                            out_dtype=torch.bfloat16)
