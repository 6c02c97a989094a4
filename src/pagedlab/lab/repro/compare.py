"""How two runs' outputs are compared: first divergence, chosen-token logprobs, teacher-forced
top-k logprobs and a KL divergence between partial distributions."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedlab.sampling_params import SamplingParams


def chosen_logprobs(completion) -> list[float]:
    if not completion.logprobs:
        return []
    return [pos[t].logprob for t, pos in zip(completion.token_ids, completion.logprobs)]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where the two sequences differ (the shorter length when one is
    a prefix of the other), or None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logprob_diff(x: float, y: float) -> float:
    """|x - y|: 0 where equal (both -inf too), inf where either is NaN (a NaN never agrees)."""
    if x == y:
        return 0.0
    d = abs(x - y)
    return d if not math.isnan(d) else math.inf


def compare_outputs(ref_ids, ref_lps, ids, lps) -> dict:
    """How a run's outputs (token ids and chosen-token logprobs per prompt) differ from a reference.
    The runs must cover the same prompts (ValueError); a logprob one side lacks where the tokens
    agree never agrees (infinite difference)."""
    firsts, max_dlp, n_diff = [], 0.0, 0
    for r, rl, o, ol in zip(ref_ids, ref_lps, ids, lps, strict=True):
        d = first_divergence(r, o)
        if d is not None:
            n_diff += 1
            firsts.append(d)
        upto = len(r) if d is None else d
        if len(rl[:upto]) != len(ol[:upto]):
            max_dlp = math.inf
        for x, y in zip(rl[:upto], ol[:upto]):
            max_dlp = max(max_dlp, logprob_diff(x, y))
    return {"prompts_differing": n_diff, "first_divergence": min(firsts) if firsts else None,
            "max_logprob_diff": max_dlp}


def teacher_forced(llm, sequences: Sequence[Sequence[int]], k: int = 20) -> list[list[dict[int, float]]]:
    """For each sequence, for each position 1..n-1: {token id: logprob} of the top-``k`` next tokens
    plus the actual token (pagedlab's ``prompt_logprobs`` with ``max_tokens=1``); ``k`` past the
    vocabulary lists all of it (the engine refuses more)."""
    k = min(k, llm.get_engine_info().hf_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
    outs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
    return [[{t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs[1:]] for o in outs]


def check_top_k(k: int) -> int:
    """``k`` of a teacher-forced comparison, refused below 1 (ValueError): its top-1 agreement needs
    each position's most likely token, and with ``k`` 0 the actual token alone is listed, so it
    would be taken for the top-1."""
    if k < 1:
        raise ValueError(f"k={k!r} is invalid: the teacher-forced top-1 needs at least each position's "
                         "most likely token, k >= 1")
    return k


def check_limit(name: str, value) -> None:
    """A tolerance or threshold, refused (ValueError) unless a number >= 0: every comparison with
    NaN is false, so a check against it could never fail, and a negative one fails identical runs."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name}={value!r} is invalid: give a number >= 0 (inf: no limit)")


def top1(d: dict[int, float]) -> int:
    """The most likely token of a {token id: logprob} dict, a tie going to the lowest id as greedy
    argmax does (not to the dict's first key, which in ``prompt_logprobs`` is the actual token)."""
    return max(d, key=lambda t: (d[t], -t))


def topk_kl(p: dict[int, float], q: dict[int, float], k: int | None = None) -> float:
    """KL(P || Q) on the coarse distribution {P's listed tokens, everything else}, from two partial
    logprob dicts. A token of P missing from Q's dict gets Q's ``k``-th largest logprob, the
    smallest of its top-``k`` (an upper bound on its probability): ``teacher_forced`` also lists
    the actual token where it ranks below the top-``k``, and that far smaller logprob bounds
    nothing. ``k`` None: every entry of Q is of its top-k. The coarse KL is a lower bound of the
    full-vocabulary KL and equals it when the dicts cover the vocabulary. A NaN logprob makes it
    inf (a NaN never agrees, as in ``logprob_diff``); a token P gives probability 0 adds nothing."""
    if any(math.isnan(lp) for lp in (*p.values(), *q.values())):
        return math.inf
    listed = sorted(q.values(), reverse=True)
    floor = listed[min(k, len(listed)) - 1] if k else listed[-1]
    kl, p_seen, q_seen = 0.0, 0.0, 0.0
    for t, lp in p.items():
        lq = q.get(t, floor)
        pp = math.exp(lp)
        if pp > 0.0:  # 0 * log(0 / q) is 0, not the NaN of 0 * -inf
            kl += pp * (lp - lq)
        p_seen += pp
        q_seen += math.exp(lq)
    p_rest, q_rest = max(1.0 - p_seen, 0.0), max(1.0 - q_seen, 1e-12)
    if p_rest > 1e-12:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)
