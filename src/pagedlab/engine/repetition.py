"""Repetition detection (vLLM's ``SamplingParams.repetition_detection``): whether a sequence's
output tokens end in one n-gram repeated ``min_count`` times in a row.

A repetition of a pattern of ``size`` tokens is the output's last ``size * min_count`` tokens read
as ``min_count`` equal blocks, for some size in ``[min_pattern_size, max_pattern_size]``
(``min_pattern_size`` 0 means 1). Only output tokens count, never the prompt, and only contiguous
blocks at the very end: a pattern seen ``min_count`` times with other tokens between is none.

The scheduler asks after every token it appends, so the check reads the tail alone: at most the
last ``max_pattern_size * min_count`` tokens, whatever the sequence's length. A size can repeat
only where the token ``size`` back equals the last one; those sizes are found with ``list.index``
(a scan in C) and only they are compared further, from the end, stopping at the first token that
differs. The usual cost is one C scan over ``max_pattern_size`` tokens; the worst (a long run of
one token with ``min_pattern_size`` above 1) is at most ``max_pattern_size ** 2 * min_count``
comparisons, as in vLLM's ``check_sequence_repetition``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pagedlab.sampling_params import RepetitionDetectionParams


def ends_in_repetition(token_ids: Sequence[int], params: RepetitionDetectionParams,
                       num_prompt_tokens: int = 0) -> bool:
    """Whether the output tokens (``token_ids`` after its first ``num_prompt_tokens``: a request's
    ``all_token_ids``, read in place) end in a pattern ``params`` describes, repeated
    ``params.min_count`` times in a row. False when ``params.max_pattern_size`` is 0."""
    count, smallest = params.min_count, max(params.min_pattern_size, 1)
    num_output = len(token_ids) - num_prompt_tokens
    largest = min(params.max_pattern_size, num_output // count) if count >= 2 else 0
    return any(_tail_repeats(token_ids, size, count)
               for size in _sizes_matching_the_last_token(token_ids, smallest, largest))


def _sizes_matching_the_last_token(token_ids: Sequence[int], smallest: int, largest: int) -> Iterator[int]:
    """The sizes in ``[smallest, largest]`` whose token that far back equals the last token."""
    if largest < smallest:
        return
    end = len(token_ids)
    last, position, stop = token_ids[-1], end - 1 - largest, end - smallest
    while True:
        try:
            position = token_ids.index(last, position, stop)
        except ValueError:
            return
        yield end - 1 - position
        position += 1


def _tail_repeats(token_ids: Sequence[int], size: int, count: int) -> bool:
    """Whether the last ``size * count`` tokens are ``count`` copies of their last ``size``: every
    token among the last ``size * (count - 1)`` equals the one ``size`` before it."""
    end = len(token_ids)
    return all(token_ids[i] == token_ids[i - size] for i in range(end - 1, end - 1 - size * (count - 1), -1))
