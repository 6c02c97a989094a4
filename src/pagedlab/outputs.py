"""What generation returns: vLLM's RequestOutput / CompletionOutput records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedlab.logprobs import Logprob, PositionLogprobs, PromptLogprobs, SampleLogprobs

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["BeamSearchOutput", "BeamSearchSequence", "CompletionOutput", "EngineStats", "Logprob",
           "PositionLogprobs", "RequestMetrics", "RequestOutput"]


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    num_cached_prompt_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token; None before it."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sampled completion of a request. ``routed_experts`` (vLLM's, with the engine's
    ``enable_return_routed_experts``): in its final output, the experts every layer chose for each
    token it ran, ``[seq_len, layer_num, topk]`` for the prompt positions from
    ``SamplingParams.routed_experts_prompt_start`` and every output token but the last (never run),
    uint8 up to 256 experts (uint16 up to 65,536, else int32); None before then, and when aborted."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None  # a FlatLogprobs with SamplingParams.flat_logprobs
    finish_reason: str | None = None  # "stop" | "length" | "repetition" | "abort" | None while running
    # the stop string or stop token id that ended it ("repetition_detected" with "repetition")
    stop_reason: int | str | None = None
    routed_experts: np.ndarray | None = None  # [seq_len, layer_num, topk]

    def finished(self) -> bool:
        """Whether this completion has ended (its ``finish_reason`` is set)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All completions of one prompt, in vLLM's shape. ``prompt_token_id_logprobs``: with
    ``SamplingParams.prompt_logprob_token_ids``, a float32 CPU tensor whose ``[i, j]`` is the
    logprob of the j-th id at prompt row ``prompt_logprob_start + i`` (predicting prompt token
    ``prompt_logprob_start + i + 1``), once every row is computed (with ``DELTA``, in one output)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None  # likewise
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_token_id_logprobs: torch.Tensor | None = None

    def add(self, later: RequestOutput) -> RequestOutput:
        """Merge a later delta output (``RequestOutputKind.DELTA``) into this one, in place: text,
        token ids, logprobs and prompt logprobs are appended, the rest is taken from ``later``
        (``prompt_token_id_logprobs`` and a completion's ``routed_experts`` where it has them)."""
        if self.prompt_logprobs is not None and later.prompt_logprobs is not None:
            self.prompt_logprobs = self.prompt_logprobs + later.prompt_logprobs
        if later.prompt_token_id_logprobs is not None:
            self.prompt_token_id_logprobs = later.prompt_token_id_logprobs
        for mine, theirs in zip(self.outputs, later.outputs):
            mine.text += theirs.text
            mine.token_ids = mine.token_ids + theirs.token_ids
            if mine.logprobs is not None and theirs.logprobs is not None:
                mine.logprobs = mine.logprobs + theirs.logprobs
            mine.cumulative_logprob = theirs.cumulative_logprob
            mine.finish_reason, mine.stop_reason = theirs.finish_reason, theirs.stop_reason
            if theirs.routed_experts is not None:
                mine.routed_experts = theirs.routed_experts
        self.finished, self.metrics = later.finished, later.metrics
        return self


@dataclass
class BeamSearchSequence:
    """One finished beam."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class EngineStats:
    """Counters and memory figures of the engine, for benchmarks, metrics and the lab."""

    num_kv_blocks: int
    block_size: int
    kv_cache_bytes: int
    weight_bytes: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    peak_kv_blocks_used: int
    kv_tokens_at_peak: int  # filled token slots when the block peak was reached (shared ones once)
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int  # running sequences freed for want of KV blocks (recomputed later)
    prompt_tokens_computed: int  # prompt and recomputed tokens run through the model
    generation_tokens: int
    # LongRoPE: running sequences recomputed whole on growing past the switch to the long factors
    # (no memory pressure: not in num_preemptions; their tokens are in prompt_tokens_computed)
    num_long_rope_recomputes: int = 0
    # speculative decoding (vLLM's spec_decode counters): proposals verified, their tokens, those accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [j]: proposals' (j+1)-th tokens kept

    @property
    def kv_cache_usage(self) -> float:
        """Share of the KV cache's blocks in use, 0 to 1."""
        return self.kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Share of the proposed tokens that were accepted (0 without speculative decoding)."""
        n = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens a verified proposal's step gave on average: 1 + its accepted tokens (vLLM's mean
        acceptance length; 0 without proposals)."""
        n = self.spec_decode_num_drafts
        return 1 + self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of the prompt tokens looked up in the prefix cache that were found there (new
        requests only: a preempted request's recompute is left out, as in vLLM)."""
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def fragmentation_at_peak(self) -> float:
        """Share of the token slots allocated at the peak that held no token."""
        slots = self.peak_kv_blocks_used * self.block_size
        return 1.0 - self.kv_tokens_at_peak / slots if slots else 0.0
