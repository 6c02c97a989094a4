"""Tensor-parallel linear layers (one implementation for every world size; at TP=1 each rank
holds everything and no collective runs).

- ``ColumnParallelLinear``: the output dimension is sharded; each rank computes its slice of
  ``y``. Several checkpoint tensors fused into one matrix (gate/up) are sharded per part, so a
  rank holds its gate slice followed by its up slice.
- ``QKVParallelLinear``: q/k/v sharded by attention heads (see ``split_attention_heads``).
- ``RowParallelLinear``: the input dimension is sharded; the partial products are summed over
  the ranks and the bias is added once, after the sum.

Each layer's weight scheme comes from its ``linear_method`` (``pagedlab.quantization.linear_method``):
dense ``weight``, AWQ's packed ``qweight``/``qzeros``/``scales``, or FP8's ``weight``/``weight_scale``
(/``input_scale``); one layer class serves all. Each parameter's ``weight_loader(param,
full_checkpoint_tensor, shard_id)`` copies this rank's part of the full tensor, cut along the
parameter's own output or input dimension in its units (``read_shard``: whole int32 words of 8
columns, whole groups of rows); ``checkpoint_shapes`` lists the full tensor of each ``shard_id``
and ``dense_checkpoint_shapes`` the dense ``[out, in]`` weight of each part.
``load_dense_weight`` takes such a dense weight, quantizes the FULL tensor with the layer's
method and loads this rank's part of each result: the way formats quantized at load read a dense
checkpoint and the way the dummy loader fills every linear, so a rank's quantized weights are
its cut of the TP=1 ones, whatever the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedlab.distributed.communication import tensor_parallel_all_reduce
from pagedlab.distributed.parallel_state import get_tp_rank, get_tp_world_size
from pagedlab.distributed.head_split import divide_evenly, split_attention_heads
from pagedlab.distributed.sharding import check_shape, read_shard, read_whole
from pagedlab.kernels.gemv_configs import TileConfig
from pagedlab.kernels.norm_fold import FoldedRMSNorm
from pagedlab.quantization.fp8 import QuantizedActivations
from pagedlab.quantization.linear_method import DenseLinearMethod, WeightSpec


def create_weights(layer: nn.Module, in_features: int, out_features: int,
                   checkpoint_shapes) -> None:
    """Register the parameters of ``layer.linear_method`` for a linear of this rank's
    ``in_features`` x ``out_features``; ``checkpoint_shapes(spec)`` lists each part's full shape."""
    for spec in layer.linear_method.weight_specs(in_features, out_features):
        param = nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype), requires_grad=False)
        if spec.out_dim is None and spec.in_dim is None:
            param.data.zero_()  # a per-layer scalar: parts load as their maximum
        param.weight_loader, param.spec = layer.weight_loader, spec
        param.checkpoint_shapes = checkpoint_shapes(spec)
        layer.register_parameter(spec.name, param)


def _checkpoint_tensor(layer: nn.Module, param: nn.Parameter, loaded, shard_id: int):
    """``loaded`` in the layout of ``param``, its full shape checked; a per-layer scalar is
    merged here (fused parts quantize one input: the largest scale serves them all) and None
    is returned."""
    loaded = layer.linear_method.checkpoint_tensor(param.spec, loaded, param.checkpoint_shapes[shard_id])
    check_shape(loaded, param.checkpoint_shapes[shard_id])
    if param.spec.out_dim is None and param.spec.in_dim is None:
        param.data.copy_(torch.maximum(param.data, read_whole(loaded).to(param.device, param.dtype)))
        return None
    return loaded


class QuantizesAtLoad:
    """``load_dense_weight``, shared by the column- and row-parallel layers."""

    def load_dense_weight(self, loaded, shard_id: int | None = None) -> list[str]:
        """Quantize the FULL dense checkpoint weight of part ``shard_id`` (``[out, in]``) with the
        layer's method, on the layer's device, and load this rank's part of each resulting tensor
        (so per-row scales are the full rows'); returns the names of the parameters set."""
        check_shape(loaded, self.dense_checkpoint_shapes[shard_id or 0])
        weight = read_whole(loaded).to(next(self.parameters()).device)
        tensors = self.linear_method.quantize_dense(weight)
        for name, tensor in tensors.items():
            param = getattr(self, name)
            param.weight_loader(param, tensor, shard_id)
        return list(tensors)


@dataclass(frozen=True)
class OutputShard:
    """This rank's rows of one checkpoint tensor of ``full_size`` rows: ``size`` rows from
    ``start``, at row ``offset`` of the rank's fused weight."""

    full_size: int
    start: int
    size: int
    offset: int


class OutputShardedLinear(QuantizesAtLoad, nn.Module):
    """``y = x W^T + b`` where W holds, row-wise, this rank's rows of one or more checkpoint
    tensors (the base of the column-parallel layers)."""

    def __init__(self, input_size: int, shards: list[tuple[int, int, int]], bias: bool, linear_method=None):
        super().__init__()
        self.linear_method = linear_method or DenseLinearMethod()
        self.shards: list[OutputShard] = []
        offset = 0
        for full_size, start, size in shards:
            self.shards.append(OutputShard(full_size, start, size, offset))
            offset += size
        self.output_size_per_rank = offset
        self.dense_checkpoint_shapes = [(s.full_size, input_size) for s in self.shards]
        create_weights(self, input_size, offset,
                       lambda spec: [spec_shape(spec, s.full_size, input_size) for s in self.shards])
        if bias:
            self.bias = nn.Parameter(torch.empty(offset), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.spec = WeightSpec("bias", (offset, 1), None, 0, 1, 0, 1)
            self.bias.checkpoint_shapes = [(s.full_size,) for s in self.shards]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int | None = None) -> None:
        """Copy this rank's output features of the full checkpoint tensor of part ``shard_id``."""
        if shard_id is None:
            if len(self.shards) != 1:
                raise ValueError(f"a fused weight of {len(self.shards)} parts needs a shard_id")
            shard_id = 0
        shard, spec = self.shards[shard_id], param.spec
        loaded = _checkpoint_tensor(self, param, loaded, shard_id)
        if loaded is None:
            return
        part = read_shard(loaded, spec.out_dim, spec.out_unit, shard.start, shard.size, "output")
        param.data.narrow(spec.out_dim, shard.offset // spec.out_unit, part.shape[spec.out_dim]).copy_(part)

    takes_normed_copy = False  # a folded norm before it (``layers.norm.RMSNorm.fold_into``) writes no copy

    def forward(self, x: torch.Tensor | FoldedRMSNorm) -> torch.Tensor:
        if isinstance(x, FoldedRMSNorm) and not self.folds_norm(x.x):
            x = x.materialize()
        return self.linear_method.apply(self, x, self.bias)

    def folds_norm(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` computes an RMSNorm of ``x`` folded into its kernel
        (``FoldedRMSNorm``): the Triton GEMV of its format at this batch."""
        return self.linear_method.folds_norm(self, x)

    def fuses_silu(self, x: torch.Tensor | FoldedRMSNorm) -> bool:
        """Whether ``silu_and_mul`` runs in one kernel at this batch (a gate_up projection's
        dense Triton GEMV with SiLU-and-mul in its epilogue)."""
        return self.linear_method.fuses_silu(self, x.x if isinstance(x, FoldedRMSNorm) else x)

    @property
    def silu_emits_fp8(self) -> bool:
        """Whether ``silu_and_mul`` returns ``QuantizedActivations`` (FP8 weights: the down
        projection's input) rather than a tensor."""
        return self.linear_method.silu_emits_fp8

    def silu_and_mul(self, x: torch.Tensor | FoldedRMSNorm) -> torch.Tensor | QuantizedActivations:
        """``silu(gate) * up`` of this gate_up projection's two output halves, in its GEMV's
        epilogue; only where ``fuses_silu(x)`` (so a ``FoldedRMSNorm`` folds in there too). A
        tensor, or with FP8 weights (``silu_emits_fp8``) the down projection's
        ``QuantizedActivations``."""
        return self.linear_method.apply_silu_and_mul(self, x, self.bias)

    def gemv_config(self, x: torch.Tensor) -> TileConfig | None:
        """The dense GEMV config ``forward(x)`` runs with (``weight`` and ``bias``), or None."""
        return self.linear_method.gemv_config(self, x)


def spec_shape(spec: WeightSpec, out_features: int, in_features: int) -> tuple[int, int]:
    """The shape of ``spec``'s parameter for a linear of ``in_features`` x ``out_features``."""
    shape = list(spec.shape)
    if spec.out_dim is not None:
        shape[spec.out_dim] = out_features // spec.out_unit
    if spec.in_dim is not None:
        shape[spec.in_dim] = in_features // spec.in_unit
    return tuple(shape)


class ColumnParallelLinear(OutputShardedLinear):
    """Output dimension sharded: ``output_sizes`` (one size, or several fused parts) are each
    split evenly over the ranks; the output is this rank's slice of every part, not gathered."""

    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool = False,
                 linear_method=None):
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        tp_size, tp_rank = get_tp_world_size(), get_tp_rank()
        shards = []
        for size in sizes:
            per_rank = divide_evenly(size, tp_size, "the output size")
            shards.append((size, tp_rank * per_rank, per_rank))
        super().__init__(input_size, shards, bias, linear_method)


class QKVParallelLinear(OutputShardedLinear):
    """The fused q/k/v projection sharded by heads (GQA-aware, see ``split_attention_heads``);
    ``num_heads``/``num_kv_heads`` are this rank's. Checkpoint parts: 0 = q, 1 = k, 2 = v."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, linear_method=None):
        split = split_attention_heads(num_heads, num_kv_heads, get_tp_world_size(), get_tp_rank())
        q = (num_heads * head_dim, split.first_head * head_dim, split.num_heads * head_dim)
        kv = (num_kv_heads * head_dim, split.first_kv_head * head_dim, split.num_kv_heads * head_dim)
        super().__init__(hidden_size, [q, kv, kv], bias, linear_method)
        self.num_heads, self.num_kv_heads, self.head_dim = split.num_heads, split.num_kv_heads, head_dim


class RowParallelLinear(QuantizesAtLoad, nn.Module):
    """Input dimension sharded: each rank multiplies its slice of ``x`` (the column-parallel
    output before it) by its columns of W; the results are summed over the ranks and the bias,
    which every rank holds whole, is added once after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, linear_method=None):
        super().__init__()
        self.linear_method = linear_method or DenseLinearMethod()
        self.tp_size = get_tp_world_size()
        self.input_size_per_rank = divide_evenly(input_size, self.tp_size, "the input size")
        self.input_start = get_tp_rank() * self.input_size_per_rank
        self.dense_checkpoint_shapes = [(output_size, input_size)]
        create_weights(self, self.input_size_per_rank, output_size,
                       lambda spec: [spec_shape(spec, output_size, input_size)])
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int | None = None) -> None:
        """Copy this rank's input features of the full checkpoint tensor."""
        spec = param.spec
        loaded = _checkpoint_tensor(self, param, loaded, 0)
        if loaded is None:
            return
        if spec.in_dim is None:  # does not run along the inputs (a per-channel scale): held whole
            param.data.copy_(read_whole(loaded))
            return
        param.data.copy_(read_shard(loaded, spec.in_dim, spec.in_unit, self.input_start,
                                    self.input_size_per_rank, "input"))

    def gemv_config(self, x: torch.Tensor) -> TileConfig | None:
        """The dense GEMV config ``forward(x)`` runs with (``weight`` and ``bias``, no all-reduce:
        one rank), or None."""
        return self.linear_method.gemv_config(self, x) if self.tp_size == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # the bias fused into the matmul, as without tensor parallelism
            return self.linear_method.apply(self, x, self.bias)
        out = tensor_parallel_all_reduce(self.linear_method.apply(self, x, None))
        return out if self.bias is None else out + self.bias
