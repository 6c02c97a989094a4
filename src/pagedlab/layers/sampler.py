"""From logits to tokens: logits controls, penalties, temperature, min-p, top-k/top-p, per-row
seeds.

The order follows vLLM: allowed token ids and logit bias, the grammar bitmask of structured
outputs, min-tokens and bad-words masking, penalties, then (for sampled rows) temperature, min-p
and top-k/top-p; last, a thinking budget's forced token overrides them all. A trace replay's token
(``trace_decode_token_ids``) replaces the drawn one afterwards, as in vLLM, so its logprobs are
those of the distribution it was forced over.

What the logprobs hold is the engine's ``logprobs_mode`` (vLLM's): ``raw_logprobs`` (the default),
``log_softmax`` of the model's logits, taken before anything rewrites them; ``raw_logits``, those
logits; ``processed_logprobs``, ``log_softmax`` of the logits the row was drawn from (every rewrite
above, and ``1 / T`` on a sampled row: a token min-p, top-k or top-p dropped is -inf, a greedy row
unscaled), and ``processed_logits``, those logits. Each mode ranks, picks the top alternatives and
reads ``logprob_token_ids`` in the same values, with one pass over the vocabulary for the values
(none in ``raw_logits`` without rewrites) and no other work in ``raw_logprobs``.

Every row is drawn by Gumbel-max (``kernels/sampling.py``): ``argmax(x / T + g)`` with Gumbel
noise ``g`` from Philox keyed by the row's 64-bit seed, which equals sampling from
``softmax(x / T)`` (the exponential race ``argmax(p / q)``, ``q ~ Exp(1)``, without the softmax);
greedy rows take ``argmax(x)``. One Triton kernel draws the whole batch on CUDA in one read of the
logits; the CPU runs its torch reference, which gives the same tokens. Rows with plain
temperature or greedy settings go straight to it; anything that rewrites logits (controls, masks,
penalties) works on a float32 copy first, and top-k/top-p/min-p only turn the tokens they drop
of their own rows to -inf, so the draw is the same Gumbel-max on every row. A row's seed (see
``engine/step_inputs.py``) is its request's seed mixed with the index of the token it samples,
or for a request without a seed the step's seed mixed with the row: a seeded request's k-th token
uses the same noise whatever shares the batch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from pagedlab.kernels.sampling import sample_tokens
from pagedlab.layers.batch_invariant import log_softmax, softmax


@dataclass
class SamplingMetadata:
    """Per-row settings for one batch of logits (row i = i-th sampling request)."""

    temperature: torch.Tensor  # [N] float32, 0.0 for greedy rows
    seeds: torch.Tensor  # [N] int64: each row's noise seed (pagedlab.kernels.sampling)
    tempered: bool = False  # some row samples at a temperature other than 1 (processed logprobs scale)
    # the sampled rows [R] with top-k, top-p or min-p, and their settings; None without such rows
    filtered_rows: torch.Tensor | None = None
    top_k: torch.Tensor | None = None  # [R] int64, vocab size where unused; None if no row uses it
    top_p: torch.Tensor | None = None  # [R] float32
    min_p: torch.Tensor | None = None  # [R] float32
    presence_penalty: torch.Tensor | None = None  # [N]; None when no row has penalties
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None  # [N, L] int64 padded with vocab_size
    prompt_token_ids: torch.Tensor | None = None  # [N, P] int64 padded with vocab_size
    banned_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids) masked by min_tokens
    # (rows, ids, biases) added to the logits; None when no row has a logit_bias
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (restricted rows [R], index into them, allowed ids): all other ids of those rows are masked
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows [R], packed bitmask [R, ceil(V/32)] int32) of the rows under a grammar
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int | None = None
    label_token_ids: torch.Tensor | None = None  # [N, L] logprob_token_ids per row (padded by repeats)
    # (row, SamplingParams.logits_processors, prompt ids, output ids so far) of the rows with any
    logits_processors: list[tuple[int, list, tuple[int, ...], list[int]]] | None = None
    # (rows, ids): each row samples its id, whatever the rest allow (thinking budgets)
    forced_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, ids): each row's drawn token replaced by its id (trace_decode_token_ids), its logprobs kept
    replayed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class TopLogprobs:
    """For each row: the chosen token's logprob and rank, and the top-``k`` alternatives."""

    token_logprob: torch.Tensor  # [N]
    token_rank: torch.Tensor  # [N]
    top_ids: torch.Tensor  # [N, k]
    top_logprobs: torch.Tensor  # [N, k]
    label_logprobs: torch.Tensor | None = None  # [N, L] of SamplingMetadata.label_token_ids
    label_ranks: torch.Tensor | None = None  # [N, L]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: TopLogprobs | None


def token_ranks(logprobs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's rank of a token of logprob ``values[i]`` in row ``i``: how many tokens have a logprob at
    least as large (a token that ties with others ranks at the end of the tie)."""
    return (logprobs >= values.unsqueeze(-1)).sum(-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TopLogprobs:
    token_logprob = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    token_rank = token_ranks(logprobs, token_logprob)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (
        logprobs.new_empty(logprobs.shape[0], 0), token_ids.new_empty(logprobs.shape[0], 0))
    return TopLogprobs(token_logprob, token_rank, top_ids, top_logprobs)


def gather_label_logprobs(logprobs: torch.Tensor, top: TopLogprobs, label_ids: torch.Tensor) -> None:
    """Add the logprobs and ranks of each row's label ids (``logprob_token_ids``) to ``top``; one
    label column at a time, so the rank comparison holds one ``[N, V]`` mask, not ``[N, L, V]``."""
    top.label_logprobs = logprobs.gather(-1, label_ids)
    top.label_ranks = torch.stack([token_ranks(logprobs, top.label_logprobs[:, j])
                                   for j in range(label_ids.shape[1])], dim=1)


BITS_PER_WORD = 32


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured outputs: in ``rows``, every id whose bit in the packed ``bitmask`` (bit ``t % 32``
    of word ``t // 32``) is clear goes to -inf, in place; ids past the packed width too."""
    vocab = logits.shape[-1]
    shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (HF's rule: divide positive logits, multiply
    negative ones); presence and frequency penalties over output tokens (OpenAI's rule)."""
    vocab = logits.shape[-1]
    output_counts = _token_counts(meta.output_token_ids, vocab)
    seen = (output_counts > 0) | (_token_counts(meta.prompt_token_ids, vocab) > 0)
    rep = meta.repetition_penalty.unsqueeze(1).expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - meta.frequency_penalty.unsqueeze(1) * output_counts
    return logits - meta.presence_penalty.unsqueeze(1) * (output_counts > 0)


def apply_logits_controls(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """vLLM's allowed_token_ids (every other id of a restricted row to -inf) and logit_bias (added),
    in place; rows without either are untouched."""
    if meta.allowed_token_ids is not None:
        rows, restricted_index, ids = meta.allowed_token_ids
        keep = torch.zeros(rows.shape[0], logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[restricted_index, ids] = True
        logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    if meta.logit_bias is not None:
        rows, ids, biases = meta.logit_bias
        logits.index_put_((rows, ids), biases, accumulate=True)
    return logits


def apply_logits_processors(logits: torch.Tensor, rows: list[tuple[int, list, tuple[int, ...], list[int]]]
                            ) -> torch.Tensor:
    """Each row's ``logits_processors`` in order, on its [vocab] logits: ``fn(output_ids, logits)``
    or, taking three parameters, ``fn(prompt_ids, output_ids, logits)`` (vLLM V0's forms)."""
    for row, processors, prompt_ids, output_ids in rows:
        values = logits[row]
        for fn in processors:
            values = fn(prompt_ids, output_ids, values) if _takes_prompt(fn) else fn(output_ids, values)
            if not isinstance(values, torch.Tensor) or values.shape != logits[row].shape:
                raise ValueError(f"logits processor {fn!r} returned {type(values).__name__} "
                                 f"{getattr(values, 'shape', '')}: it must return the row's logits, a tensor "
                                 f"of shape {tuple(logits[row].shape)}")
        logits[row] = values
    return logits


def _takes_prompt(fn) -> bool:
    return len(inspect.signature(fn).parameters) == 3


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = softmax(logits)
    threshold = probs.amax(-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the top-k logits (ties with the k-th kept) and the smallest set whose probability
    reaches top_p (at least one token)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(-1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - top_p.unsqueeze(1))
        remove[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """The sampler of a model runner: one token id per row, and the logprobs the rows ask for, in
    ``logprobs_mode`` (see the module docstring; ``pagedlab.config.LOGPROBS_MODES``)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs"):
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        wanted, rewrites = meta.max_num_logprobs is not None, _rewrites_logits(meta)
        processed = self.logprobs_mode.startswith("processed_")
        as_logits = self.logprobs_mode.endswith("_logits")
        scores = None
        if wanted and not processed:  # before the rewrites, which may write into the logits
            scores = logits.to(torch.float32, copy=rewrites) if as_logits else log_softmax(logits)
        if rewrites:
            logits = self._rewrite(logits.float(), meta)
        token_ids = sample_tokens(logits, meta.temperature, meta.seeds)
        if wanted and processed:
            scores = processed_scores(logits, meta, as_logits)
        if meta.replayed_token_ids is not None:
            rows, ids = meta.replayed_token_ids
            token_ids[rows] = ids
        logprobs = None
        if scores is not None:
            logprobs = gather_logprobs(scores, token_ids, meta.max_num_logprobs)
            if meta.label_token_ids is not None:
                gather_label_logprobs(scores, logprobs, meta.label_token_ids)
        return SamplerOutput(token_ids, logprobs)

    def _rewrite(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.logits_processors is not None:
            logits = apply_logits_processors(logits, meta.logits_processors)
        if meta.logit_bias is not None or meta.allowed_token_ids is not None:
            logits = apply_logits_controls(logits, meta)
        if meta.grammar_bitmask is not None:
            logits = apply_token_bitmask(logits, *meta.grammar_bitmask)
        if meta.banned_token_ids is not None:
            logits[meta.banned_token_ids] = float("-inf")
        if meta.repetition_penalty is not None:
            logits = apply_penalties(logits, meta)
        if meta.filtered_rows is not None:
            logits = apply_filters(logits, meta)
        if meta.forced_token_ids is not None:
            logits = apply_forced_tokens(logits, *meta.forced_token_ids)
        return logits


def _rewrites_logits(meta: SamplingMetadata) -> bool:
    return any(x is not None for x in (
        meta.logits_processors, meta.logit_bias, meta.allowed_token_ids, meta.grammar_bitmask,
        meta.banned_token_ids, meta.repetition_penalty, meta.filtered_rows, meta.forced_token_ids))


def processed_scores(logits: torch.Tensor, meta: SamplingMetadata, as_logits: bool) -> torch.Tensor:
    """The float32 logits each row was drawn from (``logits`` as rewritten, times ``1 / T`` on
    sampled rows, as the draw scales them; greedy rows as they are), or their ``log_softmax``."""
    if meta.tempered:
        inverse = torch.where(meta.temperature > 0, meta.temperature.reciprocal(), 1.0)
        logits = logits * inverse.unsqueeze(1)  # float32 whatever the logits' dtype
    return logits.float() if as_logits else log_softmax(logits)


def apply_forced_tokens(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each of ``rows`` keeps only its forced id (0, every other -inf), in place: the draw, greedy or
    sampled at any temperature, takes it."""
    logits.index_fill_(0, rows, float("-inf"))
    logits[rows, ids] = 0.0
    return logits


def apply_filters(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """min-p, then top-k/top-p, on ``logits / T`` of the filtered rows (scaled as the draw scales
    them); the tokens they drop go to -inf in ``logits``, the others keep their logits."""
    rows = meta.filtered_rows
    kept = logits[rows]
    scaled = kept * meta.temperature[rows].reciprocal().unsqueeze(1)
    if meta.min_p is not None:
        scaled = apply_min_p(scaled, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
    logits[rows] = kept.masked_fill(scaled.isneginf(), float("-inf"))
    return logits
