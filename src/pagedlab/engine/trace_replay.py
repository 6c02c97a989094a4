"""vLLM's trace replay (``SamplingParams.trace_decode_token_ids``): a request's completion is a given
list of tokens, each forced at its decode step, so the engine scores a completion (an RL rollout, a
run under other numerics) through the same decode path, with the logprobs of its own distribution.

As in vLLM (``EngineCore.apply_trace_replay``), the engine replays the whole trace and stops there:
``max_tokens`` becomes the trace's length (finish_reason "length"), and EOS, ``stop_token_ids`` and
``min_tokens`` are switched off, so a trace holding EOS or a stop id goes on past it. Stop strings
still end it (vLLM's are matched in the text, after the engine core). Speculative decoding is refused,
and so is every trace unless the engine was built with ``enable_trace_replay=True`` (vLLM's gate).

As in vLLM (``TraceReplayState.apply_trace``), the row of output position ``p`` draws as usual and its
token is then replaced by ``trace[p]`` (``SamplingMetadata.replayed_token_ids``), so each token's
logprob, rank and top-``logprobs`` alternatives are those of the row's own distribution: the model's
under the default ``logprobs_mode``, the processed one (temperature, top-k, ...; -inf where they drop
the token) under ``processed_logprobs``. ``p`` comes from the schedule, so the asynchronous step loop
never waits for a read-back."""

from __future__ import annotations

from collections.abc import Sequence

from pagedlab.sampling_params import SamplingParams


def trace_replay_params(params: SamplingParams, enabled: bool, speculative) -> SamplingParams:
    """``params`` as the engine runs them: for a trace replay, its length as ``max_tokens``, with
    EOS, stop ids and ``min_tokens`` off; otherwise unchanged. ValueError unless ``enabled`` (the
    engine's ``enable_trace_replay``, vLLM's gate), and with ``speculative`` (the engine's
    speculative decoding, None without)."""
    trace = params.trace_decode_token_ids
    if trace is None:
        return params
    if not enabled:
        raise ValueError(f"trace_decode_token_ids={trace[:8]!r} is invalid here: trace replay is off; start "
                         "the engine with enable_trace_replay=True (--enable-trace-replay), as vLLM asks")
    if speculative is not None:
        raise ValueError(f"trace_decode_token_ids={trace[:8]!r} is invalid: trace replay needs an engine "
                         "without speculative_config (proposals would not be the trace's tokens)")
    return params.clone(max_tokens=len(trace), min_tokens=0, ignore_eos=True, stop_token_ids=[])


def trace_token(params: SamplingParams, position: int) -> int | None:
    """The token a trace forces at output ``position``, None past its end or without a trace (a row
    past the end samples a token the finished request drops)."""
    trace: Sequence[int] | None = params.trace_decode_token_ids
    return trace[position] if trace is not None and position < len(trace) else None
