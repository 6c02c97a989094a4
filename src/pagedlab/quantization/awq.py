"""AWQ 4-bit weights: AutoAWQ's GEMM format (the checkpoints' and the loader's), the K-contiguous
layout the engine repacks it into once loaded (``repack_awq``), the config, the packing,
plain-torch dequantization and matmul of both (the references of ``pagedlab.kernels.w4a16``, and
the CPU path), and a round-to-nearest quantizer. Tensor-parallel ranks cut the GEMM-format
tensors in ``pagedlab.layers.linear``, along each one's own dimension in whole int32 words
(column-parallel) or whole groups (row-parallel); the repack follows the cut.

A linear layer ``y = x @ W + b`` with ``W`` of shape ``[in_features, out_features]`` (the
transpose of ``nn.Linear.weight``) is stored as three tensors:

- ``qweight`` int32 ``[in_features, out_features // 8]``: 4-bit values ``q``, eight per int32;
- ``qzeros`` int32 ``[in_features // group_size, out_features // 8]``: 4-bit zero points ``z``,
  one per group of ``group_size`` input rows and output column, packed like ``qweight``;
- ``scales`` (float16 in AutoAWQ's checkpoints) ``[in_features // group_size, out_features]``.

and ``W[k, n] = (q[k, n] - z[k // group_size, n]) * scales[k // group_size, n]``.

The interleave: the int32 at packed column ``c`` holds logical columns ``8c .. 8c+7``, but not in
order. Its nibble ``i`` (bits ``4i .. 4i+3``) holds logical column ``8c + AWQ_PACK_ORDER[i]`` with
``AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``: the even columns sit in the low half-word and the
odd ones in the high half-word, so AutoAWQ's CUDA kernel turns a 32-bit word into fp16 pairs with
a few bit operations. Read back, logical column ``j`` of a group of eight is nibble
``(j % 2) * 4 + j // 2``.

The repacked layout (``repack_awq``; what every AWQ linear holds after loading, on every device)
keeps one output column's weights contiguous along K, so that a one-row GEMV streams each
column's words in order, as the dense GEMV streams an ``nn.Linear`` weight row:

- ``qweight`` int32 ``[out_features, in_features // 8]``: the int32 at ``[n, j]`` holds ``q[8j + i, n]``
  in nibble ``i`` (natural order, ``NATURAL_ORDER``);
- ``qzeros`` int32 ``[out_features, ceil(groups / 8)]``: zero point of group ``8j + i`` in nibble ``i``
  of ``[n, j]``, the nibbles past the last group zero;
- ``scales`` ``[out_features, groups]``, the checkpoint's dtype.

Only what AutoAWQ's GEMM kernels produce is supported: 4 bits, zero points, groups of 32, 64 or 128
input rows, no activation reordering. Everything else is a ``ValueError`` naming the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
NATURAL_ORDER = tuple(range(8))
VALUES_PER_INT32 = 8
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# int32 words of a GEMM-format row (8 columns each) ``repack_awq`` unpacks at a time.
_REPACK_WORDS = 512


def _shifts(order: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """The shift that reads logical value j (of a word's eight) out of its int32, for each j."""
    return torch.tensor([4 * order.index(j) for j in range(VALUES_PER_INT32)], dtype=dtype, device=device)


@dataclass(frozen=True)
class AWQConfig:
    """An AWQ checkpoint's quantization settings (only AutoAWQ's 4-bit GEMM format is supported),
    or with ``quantize_at_load`` the round-to-nearest quantization of a dense checkpoint."""

    group_size: int
    bits: int = 4
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: tuple[str, ...] = ()
    quantize_at_load: bool = False

    name = "awq"

    @classmethod
    def from_hf_config(cls, quantization_config: dict[str, Any]) -> AWQConfig:
        """Read the ``quantization_config`` of a HF ``config.json`` (or AutoAWQ's
        ``quant_config.json``, whose keys are ``w_bit`` and ``q_group_size``)."""
        method = str(quantization_config.get("quant_method", "awq")).lower()
        if method != "awq":
            raise ValueError(f"quant_method={method!r} is not AWQ: quantization='awq' reads only "
                             "checkpoints with quant_method 'awq'")
        bits = quantization_config.get("bits", quantization_config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"AWQ bits={bits!r} is not supported: only 4-bit weights")
        group_size = quantization_config.get("group_size", quantization_config.get("q_group_size"))
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"AWQ group_size={group_size!r} is not supported: only "
                             f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}")
        zero_point = quantization_config.get("zero_point", True)
        if zero_point is not True:
            raise ValueError(f"AWQ zero_point={zero_point!r} is not supported: only zero_point=True "
                             "(asymmetric 4-bit weights)")
        version = str(quantization_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version={version!r} is not supported: only 'gemm' (AutoAWQ's GEMM "
                             "packing; GEMV, GEMV_fast, Marlin and ExLlama layouts differ)")
        for key in ("desc_act", "act_order"):
            if quantization_config.get(key):
                raise ValueError(f"AWQ {key}={quantization_config[key]!r} is not supported: only weights "
                                 "without activation reordering")
        skipped = tuple(quantization_config.get("modules_to_not_convert") or ())
        return cls(group_size=group_size, modules_to_not_convert=skipped)


def unpack_awq(packed: torch.Tensor, order: tuple[int, ...] = AWQ_PACK_ORDER) -> torch.Tensor:
    """``qweight`` or ``qzeros`` ``[rows, cols]`` int32 -> its 4-bit values ``[rows, cols * 8]``
    (int32 in 0..15) in logical order; ``order``: the nibble of each value (AWQ's interleave, or
    ``NATURAL_ORDER`` for the repacked layout)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed AWQ tensors are int32, not {packed.dtype}")
    shifts = _shifts(order, torch.int32, packed.device)
    # The arithmetic shift copies a set sign bit into the high bits; the mask drops them.
    return ((packed[..., None] >> shifts) & 0xF).flatten(-2)


def pack_awq(values: torch.Tensor, order: tuple[int, ...] = AWQ_PACK_ORDER) -> torch.Tensor:
    """The inverse of ``unpack_awq``: 4-bit values ``[rows, cols]`` (any int dtype, 0..15,
    ``cols`` a multiple of 8) -> int32 ``[rows, cols // 8]`` in ``order`` (default AWQ's)."""
    rows, cols = values.shape
    if cols % VALUES_PER_INT32:
        raise ValueError(f"AWQ packs 8 columns per int32: {cols} columns is not a multiple of 8")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
        raise ValueError(f"4-bit values must lie in 0..15, got {int(values.min())}..{int(values.max())}")
    shifts = _shifts(order, torch.int64, values.device)
    words = (values.long().view(rows, cols // VALUES_PER_INT32, VALUES_PER_INT32) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as int32 bits


def awq_shapes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> tuple[int, int]:
    """Check that the three tensors make one AWQ linear with this group size; return
    ``(in_features, out_features)``."""
    in_features, out_features = qweight.shape[0], qweight.shape[1] * VALUES_PER_INT32
    expected = {"qweight": (in_features, out_features // VALUES_PER_INT32),
                "qzeros": (in_features // group_size, out_features // VALUES_PER_INT32),
                "scales": (in_features // group_size, out_features)}
    _check_tensors("AWQ", (qweight, qzeros, scales), expected, in_features, group_size)
    return in_features, out_features


def _check_tensors(kind: str, tensors: tuple[torch.Tensor, ...], expected: dict, in_features: int,
                   group_size: int) -> None:
    """Raise ValueError unless ``(qweight, qzeros, scales)`` have the ``expected`` shapes, whole
    groups and int32 words."""
    qweight, qzeros, scales = tensors
    got = {"qweight": tuple(qweight.shape), "qzeros": tuple(qzeros.shape), "scales": tuple(scales.shape)}
    if in_features % group_size or got != expected:
        raise ValueError(f"{kind} tensors {got} do not make a linear of {in_features} inputs in groups of "
                         f"{group_size}: expected {expected}")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight and qzeros are int32, not {qweight.dtype}/{qzeros.dtype}")


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """The weight ``[in_features, out_features]``, ``(q - z) * s``, in the dtype of ``scales``."""
    awq_shapes(qweight, qzeros, scales, group_size)
    zeros = unpack_awq(qzeros).repeat_interleave(group_size, dim=0)
    steps = scales.float().repeat_interleave(group_size, dim=0)
    return ((unpack_awq(qweight) - zeros) * steps).to(scales.dtype)


def awq_linear_torch(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W + bias`` for ``x`` of shape ``[..., in_features]``, with the dequantized weight cast
    to ``x``'s dtype, on AutoAWQ's GEMM tensors (an independent reference of the repacked path)."""
    out = x @ dequantize_awq(qweight, qzeros, scales, group_size).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def repack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's GEMM tensors -> the repacked ``(qweight, qzeros, scales)`` (module docstring),
    contiguous, on the same device: the same weights, each output column's along K."""
    awq_shapes(qweight, qzeros, scales, group_size)
    # a slice of columns at a time: the unpacked values of a whole gate/up weight take 1-2 GB
    words = torch.cat([pack_awq(unpack_awq(part).t().contiguous(), NATURAL_ORDER)
                       for part in qweight.split(_REPACK_WORDS, dim=1)])
    zeros = unpack_awq(qzeros).t()
    zeros = torch.nn.functional.pad(zeros, (0, -zeros.shape[1] % VALUES_PER_INT32))
    return words, pack_awq(zeros, NATURAL_ORDER), scales.t().contiguous()


def repacked_shapes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> tuple[int, int]:
    """Check that three repacked tensors (``repack_awq``) make one AWQ linear with this group
    size; return ``(in_features, out_features)``."""
    out_features, in_features = qweight.shape[0], qweight.shape[1] * VALUES_PER_INT32
    groups = in_features // group_size
    expected = {"qweight": (out_features, in_features // VALUES_PER_INT32),
                "qzeros": (out_features, -(-groups // VALUES_PER_INT32)), "scales": (out_features, groups)}
    _check_tensors("repacked AWQ", (qweight, qzeros, scales), expected, in_features, group_size)
    return in_features, out_features


def dequantize_repacked(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """The weight of repacked tensors as ``nn.Linear`` holds it, ``[out_features, in_features]``,
    ``(q - z) * s`` in the dtype of ``scales``: ``dequantize_awq``'s weight, transposed."""
    groups = repacked_shapes(qweight, qzeros, scales, group_size)[0] // group_size
    zeros = unpack_awq(qzeros, NATURAL_ORDER)[:, :groups].repeat_interleave(group_size, dim=1)
    steps = scales.float().repeat_interleave(group_size, dim=1)
    return ((unpack_awq(qweight, NATURAL_ORDER) - zeros) * steps).to(scales.dtype)


def repacked_linear_torch(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``awq_linear_torch`` on repacked tensors: the reference of ``awq_linear_triton``, and the
    CPU path of the engine's AWQ linears."""
    out = x @ dequantize_repacked(qweight, qzeros, scales, group_size).to(x.dtype).t()
    return out if bias is None else out + bias.to(x.dtype)


def quantize_awq(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit quantization of ``weight`` ``[in_features, out_features]``
    (no activation-aware scaling): ``(qweight, qzeros, scales)``, scales in ``weight``'s dtype.
    For tests, dummy weights and ``quantization="awq"`` on a dense checkpoint; real AWQ checkpoints
    are made by AutoAWQ or llm-compressor."""
    in_features, out_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features={in_features} is not a multiple of group_size={group_size}")
    groups = weight.float().view(in_features // group_size, group_size, out_features)
    low, high = groups.amin(dim=1), groups.amax(dim=1)
    scales = ((high - low) / 15).clamp(min=1e-6).to(weight.dtype)
    steps = scales.float()
    zeros = torch.round(-low / steps).clamp(0, 15)
    values = torch.round(groups / steps[:, None] + zeros[:, None]).clamp(0, 15)
    return pack_awq(values.view(in_features, out_features).int()), pack_awq(zeros.int()), scales
