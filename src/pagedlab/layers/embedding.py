"""The vocabulary-parallel token embedding and LM head (which may share the embedding's weight).

The vocabulary is padded to a multiple of the world size and each rank holds one contiguous
range of rows; padding rows are zero. At TP=1 the one rank holds every row and no collective runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlab.distributed.communication import tensor_parallel_all_gather, tensor_parallel_all_reduce
from pagedlab.distributed.parallel_state import get_tp_rank, get_tp_world_size
from pagedlab.distributed.sharding import check_shape, read_part
from pagedlab.quantization.linear_method import dense_linear


class VocabParallelEmbedding(nn.Module):
    """Token embedding with vocabulary rows sharded: a rank looks up the ids of its range, gives
    zeros for the others, and the ranks' results are summed. ``shared_weight`` is another
    layer's weight to use instead of a new one (a tied LM head)."""

    def __init__(self, vocab_size: int, hidden_size: int, shared_weight: nn.Parameter | None = None):
        super().__init__()
        self.vocab_size, self.tp_size = vocab_size, get_tp_world_size()
        self.padded_vocab_size = -(-vocab_size // self.tp_size) * self.tp_size
        self.rows_per_rank = self.padded_vocab_size // self.tp_size
        self.vocab_start = get_tp_rank() * self.rows_per_rank
        if shared_weight is not None:
            self.weight = shared_weight
            return
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.checkpoint_shapes = [(vocab_size, hidden_size)]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int | None = None) -> None:
        """Copy this rank's rows of the full ``[vocab, hidden]`` checkpoint tensor."""
        check_shape(loaded, param.checkpoint_shapes[0])
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))
        param.data[:rows].copy_(read_part(loaded, 0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.rows_per_rank)
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_parallel_all_reduce(hidden)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states to logits over the full vocabulary: each rank computes the logits of its
    vocabulary rows (``dense_linear``: cuBLAS, or the Triton GEMV where measured faster), the
    ranks' logits are gathered and the padding cut. ``tie_to`` shares an embedding's
    (identically sharded) weight."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden_size, shared_weight=tie_to.weight if tie_to is not None else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = tensor_parallel_all_gather(dense_linear(hidden, self.weight), dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size]
