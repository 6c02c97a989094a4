"""N-gram prompt lookup: the draft tokens of speculative decoding (vLLM's ``method="ngram"``).

The sequence's last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
are looked up among its earlier tokens, prompt and output alike; where they occurred before, the
tokens that followed them are proposed. The longest match wins and, among matches as long, the
earliest (vLLM's rule); at most ``num_speculative_tokens`` are proposed, fewer where the sequence
ends sooner. The scheduler verifies them in one step (``engine/scheduler.py``).
"""

from __future__ import annotations

import numpy as np


def propose_ngram_drafts(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the longest earlier occurrence (``min_n`` to
    ``max_n`` tokens, the earliest of the longest) of the end of ``token_ids``; [] if none."""
    length = len(token_ids)
    if num_tokens < 1 or length <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # ends[i] = e: tokens[e - min_n:e] equals the last min_n tokens, e <= length - 1 (so a token follows)
    matched = np.ones(length - min_n, dtype=bool)
    for j in range(1, min_n + 1):
        matched &= tokens[min_n - j:length - j] == tokens[length - j]
    ends = np.flatnonzero(matched) + min_n
    if not len(ends):
        return []
    match_len = np.full(len(ends), min_n)
    for j in range(min_n + 1, min(max_n, length - 1) + 1):  # grow each match backwards while it holds
        grows = (match_len == j - 1) & (ends >= j)
        grows[grows] = tokens[ends[grows] - j] == tokens[length - j]
        match_len[grows] = j
    end = int(ends[np.argmax(match_len)])  # argmax: the first (earliest) of the longest
    return token_ids[end:end + num_tokens]
