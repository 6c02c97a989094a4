"""Mixtral (``MixtralForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``): the Llama decoder
with a sparse mixture-of-experts MLP.

A router picks each token's ``num_experts_per_tok`` experts by softmax probability and weighs
their outputs by those probabilities, renormalized over the chosen ones (always in Mixtral;
where ``norm_topk_prob`` says in Qwen3-MoE). With tensor parallelism
every rank holds every expert's slice of the intermediate dimension (gate/up by rows, down by
columns) and the ranks' partial outputs are summed, as for the dense MLP. With the Triton
attention backend the experts run in the fused MoE kernels (``kernels.fused_moe``: two grouped
GEMM launches over all experts, or at measured decode batches two GEMVs over the routed pairs),
elsewhere in their plain-PyTorch reference.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from pagedlab.distributed.communication import tensor_parallel_all_reduce
from pagedlab.distributed.parallel_state import get_tp_rank, get_tp_world_size
from pagedlab.distributed.head_split import divide_evenly
from pagedlab.distributed.sharding import check_shape, checkpoint_shape, read_part
from pagedlab.kernels.fused_moe import fused_moe_triton, moe_torch
from pagedlab.kernels.norm_fold import FoldedRMSNorm
from pagedlab.layers.attention import get_forward_context
from pagedlab.models.llama import DecoderModel, LlamaForCausalLM
from pagedlab.quantization.linear_method import dense_gemv_runs, dense_linear

# checkpoint expert tensors: Mixtral's w1/w3/w2 and Qwen3-MoE's gate_proj/up_proj/down_proj
_EXPERT_WEIGHT = re.compile(r"(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                            r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_UP, _DOWN = ("w3", "up_proj"), ("w2", "down_proj")
# transformers 5's in-memory experts (``model.state_dict()``): every expert in one 3-D tensor,
# gate_up_proj ``[experts, 2 * inter, hidden]`` (gate rows first) and down_proj ``[experts, hidden, inter]``
_FUSED_EXPERTS = re.compile(r"(.*)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")


class SparseMoeBlock(nn.Module):
    """Router + experts; checkpoint parts: ``w13`` shard ``2 * expert + (0 gate | 1 up)``,
    ``w2`` shard ``expert``."""

    def __init__(self, hf_config, prefix: str, quant_config=None):
        super().__init__()
        if quant_config is not None:
            raise ValueError("quantized mixture-of-experts models are not supported")
        sparse_step = getattr(hf_config, "decoder_sparse_step", 1)
        dense_layers = getattr(hf_config, "mlp_only_layers", None)
        if sparse_step != 1 or dense_layers:
            raise ValueError(f"decoder_sparse_step={sparse_step}, mlp_only_layers={dense_layers}: dense "
                             "layers between MoE layers are not supported; only every layer MoE is")
        hidden = hf_config.hidden_size
        inter = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
        self.num_experts = num_experts(hf_config)
        self.top_k = hf_config.num_experts_per_tok
        self.renormalize = bool(getattr(hf_config, "norm_topk_prob", True))
        self.tp_size = get_tp_world_size()
        self.inter_per_rank = divide_evenly(inter, self.tp_size, "the experts' intermediate size")
        self.inter_start = get_tp_rank() * self.inter_per_rank
        self.gate = nn.Linear(hidden, self.num_experts, bias=False).requires_grad_(False)
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * self.inter_per_rank, hidden),
                                requires_grad=False)
        self.w13.weight_loader = self._load_w13
        self.w13.checkpoint_shapes = [(inter, hidden)] * (2 * self.num_experts)
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, self.inter_per_rank),
                               requires_grad=False)
        self.w2.weight_loader = self._load_w2
        self.w2.checkpoint_shapes = [(hidden, inter)] * self.num_experts

    def _load_w13(self, param: nn.Parameter, loaded, shard_id: int | None) -> None:
        check_shape(loaded, param.checkpoint_shapes[shard_id])
        expert, part = divmod(shard_id, 2)
        rows = param.data[expert].narrow(0, part * self.inter_per_rank, self.inter_per_rank)
        rows.copy_(read_part(loaded, 0, self.inter_start, self.inter_per_rank))

    def _load_w2(self, param: nn.Parameter, loaded, shard_id: int | None) -> None:
        check_shape(loaded, param.checkpoint_shapes[shard_id])
        param.data[shard_id].copy_(read_part(loaded, 1, self.inter_start, self.inter_per_rank))

    # a norm folded into the router's GEMV (``layers.norm.RMSNorm.fold_into``) writes the normalized
    # input the experts read
    takes_normed_copy = True
    # enable_return_routed_experts: this layer's ``[tokens, top_k]`` column of the capture buffer
    # (``engine.routed_experts``), into which every forward writes the experts its tokens ran
    routes: torch.Tensor | None = None

    def folds_norm(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` takes ``x``'s RMSNorm as a ``FoldedRMSNorm``: the router's Triton GEMV
        runs this batch."""
        return dense_gemv_runs(x, self.gate.weight)

    def forward(self, x: torch.Tensor | FoldedRMSNorm) -> torch.Tensor:
        experts = fused_moe_triton if get_forward_context().backend.name == "triton" else moe_torch
        router_logits = dense_linear(x, self.gate.weight)
        if isinstance(x, FoldedRMSNorm):
            x = x.normed
        out = experts(x, router_logits, self.w13, self.w2, self.top_k, self.renormalize, routes=self.routes)
        return out if self.tp_size == 1 else tensor_parallel_all_reduce(out)


class MixtralDecoderModel(DecoderModel):
    mlp_class = SparseMoeBlock


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen3-MoE (``qk_norm``) causal LM over flat varlen batches (``input_ids``/
    ``positions``: ``[num_tokens]``)."""

    decoder_class = MixtralDecoderModel

    def route(self, name: str, tensor) -> Iterator[tuple[str, int | None, object]]:
        """Per-expert gate/up (``w1``/``w3``, ``gate_proj``/``up_proj``) into ``w13``, down
        (``w2``, ``down_proj``) into ``w2``, and likewise each expert of transformers 5's 3-D
        ``experts.gate_up_proj``/``experts.down_proj``; the router ``gate`` whole; the rest as in
        Llama."""
        fused = _FUSED_EXPERTS.match(name)
        if fused and len(checkpoint_shape(tensor)) == 3:
            mlp = f"{fused.group(1)}.mlp"
            yield from _split_experts(mlp, fused.group(2), tensor, num_experts(self.config))
            return
        match = _EXPERT_WEIGHT.match(name)
        if match:
            layer, expert, which = match.group(1), int(match.group(2)), match.group(3)
            if which in _DOWN:
                yield f"{layer}.mlp.w2", expert, tensor
            else:
                yield f"{layer}.mlp.w13", 2 * expert + (which in _UP), tensor
            return
        yield from super().route(name.replace(".block_sparse_moe.", ".mlp."), tensor)


def num_experts(hf_config) -> int:
    """The experts of each MoE layer (Mixtral's ``num_local_experts``, Qwen3-MoE's ``num_experts``)."""
    return getattr(hf_config, "num_local_experts", None) or hf_config.num_experts


def _split_experts(mlp: str, which: str, tensor, expected: int) -> Iterator[tuple[str, int, object]]:
    """Each expert's parts of a 3-D experts tensor (transformers 5) of ``expected`` experts: gate
    and up rows of ``gate_up_proj`` into ``w13``, ``down_proj`` into ``w2``."""
    experts, rows = checkpoint_shape(tensor)[:2]
    if experts != expected:  # fewer would load only some experts (an update checks each part alone)
        raise ValueError(f"weight shape {checkpoint_shape(tensor)} holds {experts} experts, the model has "
                         f"{expected}")
    for expert in range(experts):
        weights = read_part(tensor, 0, expert, 1)[0]
        if which == "down_proj":
            yield f"{mlp}.w2", expert, weights
        else:
            yield f"{mlp}.w13", 2 * expert, weights[:rows // 2]
            yield f"{mlp}.w13", 2 * expert + 1, weights[rows // 2:]
