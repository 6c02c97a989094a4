"""Routed experts (vLLM's ``enable_return_routed_experts``, for MoE routing replay in RL): the
experts every MoE layer chose for each token of a request, returned with its final output as
``CompletionOutput.routed_experts``, a ``[num_tokens - 1 - routed_experts_prompt_start,
num_hidden_layers, num_experts_per_tok]`` array (the last sampled token is never forwarded, so it
has no row). The parts, as vLLM's:

- ``RoutedExpertsCapture`` (the model runner's, on the device): a buffer ``[tokens, layers,
  top_k]`` sized for the largest step (and the largest CUDA graph), whose column ``i`` MoE layer
  ``i`` writes in every forward (``SparseMoeBlock.routes``) with the expert ids its kernels
  computed with, not a second top-k that could break ties another way. The buffer is static, so
  a captured graph writes it on every replay. After the forward, the step's rows go to pinned
  host memory by an asynchronous copy that the step's ``done`` event covers, as its sampled ids
  do (``read_step``): the step loop waits for nothing more.
- ``RoutedExperts`` (the engine's, on the host): a store of one row per KV slot of the block pool
  (``num_blocks * block_size``), written from each step as it is read back (``record``, in step
  order). Rows live where the keys and values of the same positions do: a prefix-cache hit's
  cached prompt positions keep their rows in the blocks it reuses, a request recomputed after
  preemption rewrites its rows in its new blocks, and a speculative proposal the sampler rejected
  is overwritten when the position is run again.
- At a request's finish (``Scheduler.finish_request``) the rows of its positions
  ``[routed_experts_prompt_start, num_tokens - 1)`` are copied out by its blocks' slots.

Expert ids are uint8 up to 256 experts, uint16 up to 65,536 (vLLM's slot store), int32 beyond.
A layer that is not MoE would keep zero rows, as in vLLM; pagedlab's MoE models have none.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedlab.engine.cuda_graph import capture_sizes
from pagedlab.engine.request import Request
from pagedlab.engine.step_outputs import StepRoutes
from pagedlab.models.mixtral import SparseMoeBlock
from pagedlab.sampling_params import SamplingParams


def expert_id_dtype(num_experts: int) -> np.dtype:
    """The dtype of returned expert ids: the narrowest that holds ``num_experts - 1``."""
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16 if num_experts <= 1 << 16 else np.int32)


def moe_layers(model: torch.nn.Module) -> list[tuple[int, SparseMoeBlock]]:
    """The model's MoE layers, each with its layer index."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return [(i, layer.mlp) for i, layer in enumerate(layers) if isinstance(getattr(layer, "mlp", None),
                                                                           SparseMoeBlock)]


def check_prompt_start(params: SamplingParams, prompt_len: int) -> None:
    """vLLM's bound on ``routed_experts_prompt_start``: at most the prompt's length (equal to it
    returns no prompt row)."""
    start = params.routed_experts_prompt_start
    if start > prompt_len:
        raise ValueError(f"routed_experts_prompt_start={start} is invalid: it must be at most the prompt's "
                         f"length ({prompt_len} tokens); rows are returned from that prompt position on")


class RoutedExpertsCapture:
    """The device buffer every MoE layer of ``model`` writes its tokens' experts into."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, device: torch.device):
        layers = moe_layers(model)
        if not layers:
            arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
            raise ValueError(f"enable_return_routed_experts=True is invalid: {arch} has no "
                             "mixture-of-experts layers (vLLM refuses a dense model too)")
        first = layers[0][1]
        self.num_experts, self.top_k = first.num_experts, first.top_k
        self.num_layers = model.config.num_hidden_layers
        dtype = torch.uint8 if self.num_experts <= 1 << 8 else torch.int32  # the store narrows int32
        self.buffer = torch.zeros(max_tokens, self.num_layers, self.top_k, dtype=dtype, device=device)
        self.blocks = [block for _, block in layers]
        for i, block in layers:
            block.routes = self.buffer[:, i]

    def detach(self) -> None:
        """Stop the layers writing the buffer (the flag is off in a new plan)."""
        for block in self.blocks:
            block.routes = None

    def read_step(self, num_tokens: int, slots: list[int],
                  to_host: Callable[[torch.Tensor], torch.Tensor]) -> StepRoutes:
        """The rows of a forward just queued over ``num_tokens`` tokens in ``slots``, on their way
        to the host (``to_host``: the runner's asynchronous copy; on the CPU a copy, since the next
        forward overwrites the buffer)."""
        rows = self.buffer[:num_tokens]
        return StepRoutes(to_host(rows) if rows.is_cuda else rows.clone(), slots)


class RoutedExperts:
    """The engine's side: the runner's capture and the host store by KV slot."""

    def __init__(self, runner, max_tokens: int):
        runner.routes = self.capture = RoutedExpertsCapture(runner.model, max_tokens, runner.device)
        self.rows: np.ndarray | None = None  # [slots, layers, top_k], allocated with the KV cache
        self.block_size = 0
        self._preempted: dict[Request, list[int]] = {}  # the blocks a request held before its preemption

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The store, one row per slot of the ``num_blocks`` KV blocks."""
        capture = self.capture
        self.rows = np.zeros((num_blocks * block_size, capture.num_layers, capture.top_k),
                             dtype=expert_id_dtype(capture.num_experts))
        self.block_size = block_size

    def record(self, step: StepRoutes) -> None:
        """Write a read-back step's rows to its tokens' slots."""
        self.rows[np.asarray(step.slots, dtype=np.int64)] = step.rows.numpy()

    def preempted(self, request: Request) -> None:
        """Note the blocks a request is about to free for recompute: a step launched before the
        preemption may still finish it, before it holds blocks again, and its rows are there
        (a later step's rows reach the store after that step's read-back)."""
        self._preempted[request] = list(request.block_ids)

    def finish(self, request: Request, reason: str) -> None:
        """Copy a finishing request's rows (not an aborted one's: vLLM returns none) from the
        slots of its positions ``[routed_experts_prompt_start, num_tokens - 1)``; call before its
        blocks are freed."""
        held_before = self._preempted.pop(request, [])
        if reason == "abort":
            return
        bs = self.block_size
        block_ids = np.asarray(request.block_ids or held_before, dtype=np.int64)
        positions = np.arange(request.sampling_params.routed_experts_prompt_start, request.num_tokens - 1)
        request.routed_experts = self.rows[block_ids[positions // bs] * bs + positions % bs]


def plan_routed_experts(enabled: bool, runner, max_num_batched_tokens: int,
                        max_num_seqs: int) -> RoutedExperts | None:
    """Before ``runner.configure`` (whose memory profile and CUDA graphs must run with the buffer):
    drop the runner's capture, and where ``enabled`` give it one for the largest forward of the
    plan (a step's token budget, or a decode graph's padded batch)."""
    if runner.routes is not None:
        runner.routes.detach()
        runner.routes = None
    if not enabled:
        return None
    return RoutedExperts(runner, max(max_num_batched_tokens, capture_sizes(max_num_seqs)[-1]))
