"""Speculative decoding with a draft model (vLLM's ``speculative_config={"method": "draft_model",
"model": path, "num_speculative_tokens": k}``).

A smaller model of the target's vocabulary proposes each decode's next tokens greedily, and the
target checks them in one step by the rule n-gram proposals use (``engine/scheduler.py``): its
sampled tokens are kept up to the first that differs from the proposal. For a greedy (one-hot)
proposal that rule is exact speculative sampling (a proposed token is kept with the target's
probability of it, and a rejected position keeps the target's own sample), so outputs are those
of plain decoding, seeded sampling included.

The draft runs only where it proposes. Its own KV cache has as many blocks as the target's,
addressed by the same block tables, and ``Request.num_draft_computed_tokens`` counts the positions
whose keys and values it holds. Before a step in which a request proposes, pass 0 runs the draft
over that request's tokens from there to its last known one (in passes of at most the step's
token budget where the draft has fallen far behind) and reads its logits at that last token, for
the first proposal; pass j runs one token per proposing row, its j-th proposal, for the next one
(the last pass for the keys and values alone). A step that proposes nothing (a batch-size
schedule's K of 0) runs no draft at all, and a request the step does not propose for (a prompt
chunk) waits: the draft catches up when it next proposes. The scheduler keeps the count right:
rejected proposals are stepped back over with the target's ``num_computed_tokens``, and a request
admitted (or admitted again after a preemption) starts from its prefix-cache hit's leading blocks
whose draft keys are in place too (``KVBlock.draft_ready``). Where both models free keys outside a
sliding window (``kv_release_window``), the draft runs over every request of every step instead
(``lockstep``, and the steps do not run ahead), so that it never needs a key the target has let go.

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

import torch

from pagedlab.config import DraftModelInfo, EngineConfig, attention_windows, kv_release_window, model_max_len
from pagedlab.engine.model_runner import ModelRunner, RunnerPlan, load_model_runner
from pagedlab.engine.request import Request
from pagedlab.engine.scheduler import DraftProgress, ScheduledBatch
from pagedlab.engine.step_inputs import StepInputs, add_positions
from pagedlab.layers.rotary import long_rope_switch
from pagedlab.loader import ModelSource, resolve_model_source
from pagedlab.loader.hf_config import load_hf_config
from pagedlab.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


class DraftModel:
    """The draft model's runner and its proposals (``propose``)."""

    def __init__(self, runner: ModelRunner, model: str, source: ModelSource, hf_config, target_hf_config):
        self.runner = runner
        self.model = model  # as given in speculative_config
        self.source = source
        self.hf_config = hf_config
        # a padded target vocabulary may hold ids the draft lacks (never sampled in practice)
        self.clamp_ids = hf_config.vocab_size < target_hf_config.vocab_size
        # both models windowed: the KV manager frees old blocks as the target goes (release_window)
        self.lockstep = None not in (kv_release_window(hf_config), kv_release_window(target_hf_config))

    @classmethod
    def load(cls, config: EngineConfig, spec: SpeculativeConfig, target_hf_config, device: torch.device,
             dtype: torch.dtype) -> DraftModel:
        """Load ``spec.model`` on ``device`` in ``dtype`` (the target's; its own checkpoint's weight
        format, no LoRA), after checking that it can propose for ``target_hf_config``."""
        source = resolve_model_source(spec.model, config.load_format, None, config.download_dir)
        hf_config = load_hf_config(source.path)  # the target's hf_overrides are not the draft's, as in vLLM
        check_draft_config(spec.model, hf_config, target_hf_config)
        draft_config = dataclasses.replace(config, model=spec.model, revision=None, quantization=None,
                                           dtype=str(dtype).removeprefix("torch."), enable_lora=False,
                                           tensor_parallel_size=1, speculative_config=None, hf_overrides=None)
        logger.info("loading the draft model %s", spec.model)
        return cls(load_model_runner(draft_config, source, hf_config, device), spec.model, source, hf_config,
                   target_hf_config)

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

    def propose(self, batch: ScheduledBatch) -> dict[Request, DraftProgress]:
        """Fill in the batch's proposals (the scheduler's placeholders) with the draft's greedy
        tokens, running it first over each proposing request's tokens it has not seen (every
        request's, in lockstep); returns what it computed of each request it ran, for
        ``Scheduler.record_draft_pass`` once the step is launched."""
        rows = [i for i, d in enumerate(batch.draft_token_ids) if d or self.lockstep]
        if not rows:
            return {}
        # longest proposals first, so the rows still proposing at pass j are the first ones
        rows.sort(key=lambda i: -len(batch.draft_token_ids[i]))
        requests = [batch.requests[i] for i in rows]
        rooms = [len(batch.draft_token_ids[i]) for i in rows]
        ends = [r.num_computed_tokens + batch.num_new_tokens[i] - room
                for r, i, room in zip(requests, rows, rooms)]
        starts = [r.num_draft_computed_tokens for r in requests]
        proposing = sum(room > 0 for room in rooms)
        first = self._catch_up(requests, starts, ends, proposing)
        if proposing:
            drafts = self._draft_passes(requests[:proposing], ends, rooms[:proposing], first)
            for i, proposal, room in zip(rows, drafts.tolist(), rooms):
                batch.draft_token_ids[i] = proposal[:room]
        return {r: DraftProgress(end, end + room) for r, end, room in zip(requests, ends, rooms)}

    def _catch_up(self, requests: list[Request], starts: list[int], ends: list[int],
                  proposing: int) -> torch.Tensor | None:
        """Pass 0: the draft over tokens [starts[i], ends[i]) of each request; the greedy token after
        the last of each of the first ``proposing`` requests. Beyond the step's token budget, all
        but each request's last token go first, in passes of the budget's size."""
        budget = self.runner.plan.max_num_batched_tokens
        if sum(ends) - sum(starts) > budget:
            for chunk in _pack_ranges(requests, starts, [end - 1 for end in ends], budget):
                pieces, chunk_starts, counts = zip(*chunk)
                self.runner.forward_greedy(self._inputs(pieces, chunk_starts, counts, 0), list(pieces),
                                           list(counts), logits=False)
            starts = [end - 1 for end in ends]
        counts = [end - start for start, end in zip(starts, ends)]
        return self.runner.forward_greedy(self._inputs(requests, starts, counts, proposing), requests, counts,
                                          logits=proposing > 0)

    def _draft_passes(self, requests: list[Request], ends: list[int], rooms: list[int],
                      first: torch.Tensor) -> torch.Tensor:
        """Passes 1..K: each proposing row's j-th proposal at position ``ends[i] + j - 1`` gives the
        next (the last pass writes keys and values only); rows by decreasing room."""
        drafts = first.new_zeros(len(requests), rooms[0])
        drafts[:, 0] = first
        for j in range(1, rooms[0] + 1):
            rows = sum(room >= j for room in rooms)
            inputs = _range_inputs(requests[:rows], [end + j - 1 for end in ends[:rows]], [1] * rows,
                                   self.runner.block_size, rows)
            tokens = self.runner.forward_greedy(inputs, requests[:rows], [1] * rows,
                                                drafts[:rows, j - 1].contiguous(), logits=j < rooms[0])
            if tokens is not None:
                drafts[:rows, j] = tokens
        return drafts

    def _inputs(self, requests, starts, counts, num_sampling: int) -> StepInputs:
        inputs = _range_inputs(requests, starts, counts, self.runner.block_size, num_sampling)
        if self.clamp_ids:
            vocab = self.hf_config.vocab_size
            inputs.input_ids = [t if t < vocab else 0 for t in inputs.input_ids]
        return inputs

    def close(self) -> None:
        self.runner.close()


def _range_inputs(requests, starts, counts, block_size: int, num_sampling: int) -> StepInputs:
    """Tokens [starts[i], starts[i] + counts[i]) of each request (ids past its known ones are 0:
    a draft pass gives its proposals on the device), sampling at the last token of each of the
    first ``num_sampling`` requests."""
    inputs = StepInputs()
    for i, (request, start, n) in enumerate(zip(requests, starts, counts)):
        ids = request.all_token_ids[start:start + n]
        inputs.input_ids.extend(ids + [0] * (n - len(ids)))
        add_positions(inputs, request, start, n, block_size)
        if i < num_sampling:
            inputs.sample_rows.append(len(inputs.input_ids) - 1)
    return inputs


def _pack_ranges(requests, starts, ends, budget: int) -> list[list[tuple[Request, int, int]]]:
    """Tokens [starts[i], ends[i]) of each request as passes of at most ``budget`` tokens, each a
    list of (request, first token, count); a request's pieces come in order."""
    passes, current, room = [], [], budget
    for request, start, end in zip(requests, starts, ends):
        while start < end:
            n = min(end - start, room)
            current.append((request, start, n))
            start, room = start + n, room - n
            if room == 0:
                passes.append(current)
                current, room = [], budget
    return passes + [current] if current else passes


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
