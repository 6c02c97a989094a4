"""Speculative decoding with a draft model (vLLM's ``speculative_config={"method": "draft_model",
"model": path, "num_speculative_tokens": k}``).

A smaller model of the target's vocabulary proposes each decode's next tokens greedily, and the
target checks them in one step by the rule n-gram proposals use (``engine/scheduler.py``): its
sampled tokens are kept up to the first that differs from the proposal. For a greedy (one-hot)
proposal that rule is exact speculative sampling (a proposed token is kept with the target's
probability of it, and a rejected position keeps the target's own sample), so outputs are those
of plain decoding, seeded sampling included.

The draft runs in lockstep with the target. Its own KV cache has as many blocks as the target's,
addressed by the same block tables, and before each target step it computes the keys and values
of every token that step runs: pass 0 runs the step's known tokens (prompt chunks included) and
reads its logits at each proposing decode's last token, for its first proposal; pass j runs one
token per proposing row, its j-th proposal, for the next one (the last pass for the keys and
values alone). The draft's cache then holds exactly the positions the target's does: rejected
proposals are stepped back over with the target's ``num_computed_tokens``, and preemption and
prefix-cache hits need nothing of their own (a cached block was computed by both).

Memory: the target's cache is freed before a draft loads or closes (``LLMEngine._load_draft_model``);
its memory profile counts the draft's weights and its mixed-step graph pool (the draft's forward
activations at the largest step, ``share_of_target_plan``) and divides the KV budget by both
caches' bytes per block; the target allocates both caches as one tensor right after it (on an
H100, torch reserved 71.30 GiB against the 71.26 GiB 0.9 share for a Qwen3-0.6B-shaped target
proposing for itself, 71.53 GiB before the pool counted).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from pagedlab.config import (DraftModelInfo, EngineConfig, SpeculativeConfig, attention_windows,
                             kv_release_window, model_max_len)
from pagedlab.engine.model_runner import ModelRunner, RunnerPlan, load_model_runner
from pagedlab.engine.request import Request
from pagedlab.engine.scheduler import ScheduledBatch
from pagedlab.engine.step_inputs import StepInputs, prepare_step_inputs
from pagedlab.layers.rotary import long_rope_switch
from pagedlab.loader import ModelSource, resolve_model_source
from pagedlab.models.registry import check_config_file

logger = logging.getLogger(__name__)


class DraftModel:
    """The draft model's runner and its proposals (``propose``)."""

    def __init__(self, runner: ModelRunner, model: str, source: ModelSource, hf_config,
                 target_vocab_size: int):
        self.runner = runner
        self.model = model  # as given in speculative_config
        self.source = source
        self.hf_config = hf_config
        # a padded target vocabulary may hold ids the draft lacks (never sampled in practice)
        self.clamp_ids = hf_config.vocab_size < target_vocab_size

    @classmethod
    def load(cls, config: EngineConfig, spec: SpeculativeConfig, target_hf_config, device: torch.device,
             dtype: torch.dtype) -> DraftModel:
        """Load ``spec.model`` on ``device`` in ``dtype`` (the target's; its own checkpoint's weight
        format, no LoRA), after checking that it can propose for ``target_hf_config``."""
        from transformers import AutoConfig

        source = resolve_model_source(spec.model, config.load_format, None, config.download_dir)
        check_config_file(source.path)
        hf_config = AutoConfig.from_pretrained(str(source.path), trust_remote_code=False)
        check_draft_config(spec.model, hf_config, target_hf_config)
        draft_config = dataclasses.replace(config, model=spec.model, revision=None, quantization=None,
                                           dtype=str(dtype).removeprefix("torch."), enable_lora=False,
                                           tensor_parallel_size=1, speculative_config=None)
        logger.info("loading the draft model %s", spec.model)
        return cls(load_model_runner(draft_config, source, hf_config, device), spec.model, source, hf_config,
                   target_hf_config.vocab_size)

    def info(self, config: EngineConfig) -> DraftModelInfo:
        """The draft's identity for ``EngineInfo`` (and the lab's manifest)."""
        return DraftModelInfo(config, self.model, self.source.path, self.source.original_file,
                              self.source.load_format, self.hf_config, self.runner.weight_bytes)

    def share_of_target_plan(self, target_plan: RunnerPlan) -> RunnerPlan:
        """``target_plan`` with the draft's share of the memory: its cache's bytes on every block
        (in the target's cache dtype, the draft having the target's dtype) and, where the target
        profiles the GPU, its mixed-step graph pool (profiled now); ``max_model_len`` beyond the
        draft's positions is a ValueError."""
        limit = model_max_len(self.hf_config)
        if target_plan.max_model_len > limit:
            raise ValueError(f"speculative_config's draft model {self.model!r} supports at most {limit} "
                             f"positions, fewer than max_model_len={target_plan.max_model_len}: lower "
                             "max_model_len or give a draft model with a longer context")
        per_block = self.runner.kv_bytes_per_block(target_plan.block_size, target_plan.kv_cache_dtype)
        pool = (0 if target_plan.kv_cache_memory_bytes is not None
                else self.runner.graph_pool_bytes(self._plan(target_plan, 0)))
        return dataclasses.replace(target_plan, extra_bytes_per_block=per_block, extra_memory_bytes=pool)

    def configure(self, target_plan: RunnerPlan, num_blocks: int, storage: torch.Tensor) -> None:
        """Lay the draft's KV cache of ``num_blocks`` blocks (the target's count) in ``storage`` (the
        target runner allocated it with its own: ``extra_kv_storage``) and capture its CUDA graphs
        as the target's plan (``share_of_target_plan``'s) asks."""
        self.runner.configure(self._plan(target_plan, num_blocks * target_plan.extra_bytes_per_block),
                              kv_storage=storage)

    def _plan(self, target_plan: RunnerPlan, kv_bytes: int) -> RunnerPlan:
        """The draft runner's plan beside ``target_plan``: a cache of ``kv_bytes``, no cascades for
        a windowed draft."""
        return dataclasses.replace(
            target_plan, kv_cache_memory_bytes=kv_bytes, extra_bytes_per_block=0, extra_memory_bytes=0,
            cascade_attention=target_plan.cascade_attention and not any(attention_windows(self.hf_config)))

    def release_window(self, target_window: int | None) -> int | None:
        """The window after which both models' keys may be freed (None: keep every key)."""
        window = kv_release_window(self.hf_config)
        return None if window is None or target_window is None else max(window, target_window)

    def propose(self, batch: ScheduledBatch) -> None:
        """Run the draft over the batch's tokens and fill in its decodes' proposals (the
        scheduler's placeholders) with the draft's greedy tokens."""
        if batch.is_empty():
            return
        known = [n - len(d) for n, d in zip(batch.num_new_tokens, batch.draft_token_ids)]
        # longest proposals first, so the rows still proposing at pass j are the first ones
        proposing = sorted((i for i, d in enumerate(batch.draft_token_ids) if d),
                           key=lambda i: -len(batch.draft_token_ids[i]))
        last_rows = np.cumsum(known) - 1
        inputs = prepare_step_inputs(ScheduledBatch(batch.requests, known, [[] for _ in known]), {},
                                     self.runner.block_size)
        inputs.prompt_rows, inputs.prompt_chunks = [], {}
        if self.clamp_ids:
            vocab = self.hf_config.vocab_size
            inputs.input_ids = [t if t < vocab else 0 for t in inputs.input_ids]
        inputs.sample_rows = [int(last_rows[i]) for i in proposing]
        first = self.runner.forward_greedy(inputs, batch.requests, known)
        if not proposing:
            return
        rooms = [len(batch.draft_token_ids[i]) for i in proposing]
        drafts = first.new_zeros(len(proposing), rooms[0])
        drafts[:, 0] = first
        requests = [batch.requests[i] for i in proposing]
        last_positions = [r.num_computed_tokens + known[i] - 1 for r, i in zip(requests, proposing)]
        for j in range(1, rooms[0] + 1):
            rows = sum(room >= j for room in rooms)
            step_inputs = _decode_inputs(requests[:rows], [pos + j for pos in last_positions[:rows]],
                                         self.runner.block_size)
            tokens = self.runner.forward_greedy(step_inputs, requests[:rows], [1] * rows,
                                                drafts[:rows, j - 1].contiguous(), logits=j < rooms[0])
            if tokens is not None:
                drafts[:rows, j] = tokens
        for i, proposal, room in zip(proposing, drafts.tolist(), rooms):
            batch.draft_token_ids[i] = proposal[:room]

    def close(self) -> None:
        self.runner.close()


def _decode_inputs(requests: list[Request], positions: list[int], block_size: int) -> StepInputs:
    """One token per request at ``positions`` (its id given on the device), each sampling."""
    inputs = StepInputs(input_ids=[0] * len(requests), sample_rows=list(range(len(requests))))
    for request, pos in zip(requests, positions):
        inputs.positions.append(pos + request.rope_position_offset)
        inputs.slots.append(request.block_ids[pos // block_size] * block_size + pos % block_size)
        inputs.seq_lens.append(pos + 1)
    return inputs


def check_draft_config(model: str, hf_config, target_hf_config) -> None:
    """A ValueError unless the draft's token ids can mean the target's (a vocabulary no larger: a
    padded one, as Qwen2.5-0.5B's beside Qwen2.5-7B's, may be smaller, and a target id the draft
    lacks reaches it as id 0) and both models' positions are plain."""
    what = f"speculative_config's draft model {model!r}"
    if hf_config.vocab_size > target_hf_config.vocab_size:
        raise ValueError(f"{what} has a vocabulary of {hf_config.vocab_size} tokens, more than the target's "
                         f"{target_hf_config.vocab_size}: a draft model must share the target's tokenizer")
    for name, config in (("the draft model", hf_config), ("the target model", target_hf_config)):
        if long_rope_switch(config) is not None:
            raise ValueError(f"{what}: {name} uses LongRoPE, whose positions change regime with the length; "
                             "draft-model speculation needs plain positions (n-gram proposals work)")
