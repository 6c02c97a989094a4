"""Logprob records, as vLLM's ``vllm.logprobs``: ``Logprob`` (one token at one position), a
position's ``{token id: Logprob}`` dict, and ``FlatLogprobs``, the column-wise container a request
gets with ``SamplingParams(flat_logprobs=True)``."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field
from typing import overload


@dataclass
class Logprob:
    """Log-probability of one token, its rank in the distribution and its text. As in vLLM the rank
    is how many tokens are at least as likely (1 = most likely; tied tokens all rank at the end of
    their tie), except that the top-N alternatives of a position rank 1..N."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the top-N plus the chosen token).
PositionLogprobs = dict[int, Logprob]


@dataclass
class FlatLogprobs(MutableSequence[PositionLogprobs]):
    """A request's logprobs, position after position, in six flat lists rather than a list of
    ``{token id: Logprob}`` dicts: vLLM's ``FlatLogprobs``. However long the request and however many
    logprobs each position holds, the container is a constant number of objects, which spares the
    garbage collector the millions of ``Logprob`` records a long scoring run keeps alive.

    It reads as the list it replaces: ``len``, iteration and ``flat[i]`` give each position as a
    fresh ``{token id: Logprob}`` dict (a position recorded as None, prompt position 0, reads as
    ``{}``), a slice is a ``FlatLogprobs`` of those positions, and ``append`` / ``extend`` add
    positions. Positions cannot be replaced, deleted or inserted (TypeError), as in vLLM. Position
    ``i``'s entries are ``token_ids[start_indices[i]:end_indices[i]]`` and the same range of
    ``logprobs``, ``ranks`` and ``decoded_tokens``. Two are equal when their lists are.
    """

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, logprobs_one_position: PositionLogprobs | None) -> None:
        """Add the next position's ``{token id: Logprob}`` (None or ``{}``: a position with none)."""
        entries = (logprobs_one_position or {}).items()
        self.append_fast([t for t, _ in entries], [lp.logprob for _, lp in entries],
                         [lp.rank for _, lp in entries], [lp.decoded_token for _, lp in entries])

    def append_fast(self, token_ids: Iterable[int], logprobs: Iterable[float], ranks: Iterable[int | None],
                    decoded_tokens: Iterable[str | None]) -> None:
        """Add the next position from its columns, building no ``Logprob``: entry ``j`` is the
        ``j``-th of each (as ``zip``, up to the shortest; ``itertools.repeat(None)`` for no text).
        A token id given twice is stored twice, and the position reads back with its last entry."""
        self.start_indices.append(len(self.token_ids))
        for token_id, logprob, rank, text in zip(token_ids, logprobs, ranks, decoded_tokens):
            self.token_ids.append(token_id)
            self.logprobs.append(logprob)
            self.ranks.append(rank)
            self.decoded_tokens.append(text)
        self.end_indices.append(len(self.token_ids))

    def extend(self, logprobs_multi_positions: Iterable[PositionLogprobs | None]) -> None:
        """Add each of several positions in turn (another ``FlatLogprobs`` column by column)."""
        if not isinstance(logprobs_multi_positions, FlatLogprobs):
            for position in logprobs_multi_positions:
                self.append(position)
            return
        other = logprobs_multi_positions
        lo, hi = (other.start_indices[0], other.end_indices[-1]) if other else (0, 0)
        shift = len(self.token_ids) - lo
        self.start_indices.extend([s + shift for s in other.start_indices])
        self.end_indices.extend([e + shift for e in other.end_indices])
        self.token_ids.extend(other.token_ids[lo:hi])
        self.logprobs.extend(other.logprobs[lo:hi])
        self.ranks.extend(other.ranks[lo:hi])
        self.decoded_tokens.extend(other.decoded_tokens[lo:hi])

    def __len__(self) -> int:
        """The number of positions."""
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> PositionLogprobs: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index):
        """Position ``index`` as a new ``{token id: Logprob}`` dict, or a slice's positions as a new
        ``FlatLogprobs`` (any step; an empty slice gives an empty one, where vLLM's raises)."""
        if isinstance(index, slice):
            return self._positions(range(len(self))[index])
        position = operator.index(index)
        return {self.token_ids[j]: Logprob(self.logprobs[j], self.ranks[j], self.decoded_tokens[j])
                for j in range(self.start_indices[position], self.end_indices[position])}

    def _positions(self, positions: range) -> FlatLogprobs:
        part = FlatLogprobs()
        if positions.step != 1:
            for position in positions:
                part.extend(self._positions(range(position, position + 1)))
            return part
        part.extend(FlatLogprobs(self.start_indices[positions.start:positions.stop],
                                 self.end_indices[positions.start:positions.stop],
                                 self.token_ids, self.logprobs, self.ranks, self.decoded_tokens))
        return part

    def __iter__(self) -> Iterator[PositionLogprobs]:
        """Each position's ``{token id: Logprob}``, in order."""
        for position in range(len(self)):
            yield self[position]

    def __add__(self, other: FlatLogprobs) -> FlatLogprobs:
        """A new ``FlatLogprobs`` of this one's positions, then ``other``'s (``list + list``)."""
        if not isinstance(other, FlatLogprobs):
            return NotImplemented
        joined = self[:]
        joined.extend(other)
        return joined

    def __setitem__(self, index, value) -> None:
        raise TypeError("FlatLogprobs positions cannot be replaced: build a new one")

    def __delitem__(self, index) -> None:
        raise TypeError("FlatLogprobs positions cannot be deleted: slice out the ones to keep")

    def insert(self, index: int, value: PositionLogprobs | None) -> None:
        raise TypeError("FlatLogprobs positions cannot be inserted: only appended")


# A request's sample logprobs (``CompletionOutput.logprobs``) and prompt logprobs
# (``RequestOutput.prompt_logprobs``, None at prompt position 0), as vLLM types them.
SampleLogprobs = FlatLogprobs | list[PositionLogprobs]
PromptLogprobs = FlatLogprobs | list[PositionLogprobs | None]
