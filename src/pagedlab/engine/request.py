"""The state of one sequence as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedlab.engine.structured_output import RequestGrammar
from pagedlab.engine.thinking_budget import ThinkingBudget
from pagedlab.lora.request import LoRARequest
from pagedlab.outputs import RequestMetrics
from pagedlab.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence as the scheduler sees it: a prompt plus the tokens generated so far.

    The scheduler changes every field of it (the KV cache manager only its ``block_ids``,
    ``block_hashes`` and ``num_released_blocks``); text, logprobs and outputs live in the output processor.

    ``num_computed_tokens`` counts the tokens whose keys and values are in the KV cache;
    the scheduler runs ``num_tokens_with_pending - num_computed_tokens`` more (a whole prompt, a
    chunk of it, or the one newly sampled token). Preemption frees the blocks and sets it back to
    0, so the prompt and the output so far are recomputed.

    ``num_pending_tokens`` counts tokens sampled on the device but not yet read back (the
    asynchronous step loop schedules the next step before they arrive); ``all_token_ids`` holds
    only tokens the host knows.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # the tokenizer's EOS: ending on it leaves stop_reason None; the model's other EOS ids (its
    # generation config's) give their id, as vLLM's, which adds them to the stop token ids
    model_eos_token_id: int | None = None
    index: int = 0  # which of the parent's n completions this is
    parent_id: str | None = None
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0  # with scheduling_policy="priority": lower runs first and is preempted last
    seed: int | None = None  # SamplingParams.seed + index: keys its sampling noise (step_inputs.row_seeds)
    lora_request: LoRARequest | None = None  # the adapter it runs with, None for the base model
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # SamplingParams.bad_words, tokenized
    grammar: RequestGrammar | None = None  # structured outputs: a RequestGrammar fed every kept token
    thinking: ThinkingBudget | None = None  # SamplingParams.thinking_token_budget's count

    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_draft_computed_tokens: int = 0  # while it runs: of them, those a draft model's cache holds too
    num_pending_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_released_blocks: int = 0  # leading block_ids handed back already (outside every window)
    rope_position_offset: int = 0  # added to positions given to the model (LongRoPE's long rows)
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0  # times its blocks were freed to recompute it (preempted, or LongRoPE's switch)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: np.ndarray | None = None  # enable_return_routed_experts: its rows, taken at its finish
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def prefix_cache_salt(self) -> bytes | None:
        """What the first block's hash starts from: the adapter's id, so requests of different
        adapters (or of an adapter and the base model) never share KV blocks."""
        return b"lora:%d" % self.lora_int_id if self.lora_request is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def output_limit_reached(self) -> bool:
        """Every token ``max_tokens`` allows is sampled (the last ones perhaps not yet read back)."""
        limit = self.sampling_params.max_tokens
        return limit is not None and self.num_output_tokens + self.num_pending_tokens >= limit

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def needs_host_tokens(self) -> bool:
        """Its sampling reads every earlier token on the host (penalties, multi-token bad words,
        logits processors)."""
        return (self.sampling_params.has_penalties or bool(self.sampling_params.logits_processors)
                or any(len(w) > 1 for w in self.bad_words_token_ids))

    @property
    def samples_after_read_back(self) -> bool:
        """Its next row's sampling inputs need the tokens still pending on the device: its grammar's
        bitmask does, and its thinking budget's forced token may (``ModelRunner.finish_sampling``)."""
        return self.grammar is not None or (
            self.thinking is not None and self.thinking.needs_pending_tokens(self.all_token_ids,
                                                                             self.num_pending_tokens))

    @property
    def skips_reading_prefix_cache(self) -> bool:
        """``SamplingParams.skip_reading_prefix_cache`` (True for a request that scores its prompt):
        every prefill computes its whole prompt; its blocks still fill the prefix cache for others."""
        return self.sampling_params.skip_reading_prefix_cache is True
