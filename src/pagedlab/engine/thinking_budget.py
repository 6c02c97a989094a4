"""``thinking_token_budget`` (vLLM's SamplingParams field): at most that many tokens inside a thinking
section of a reasoning model, then its end marker, forced.

**Markers.** The engine's ``reasoning_config`` (vLLM's ``--reasoning-config``) names them:
``reasoning_start_str`` and ``reasoning_end_str`` (``"<think>"``, ``"</think>"``; the end may carry a
transition phrase, ``"Time to answer.</think>"``, forced whole), or a ``reasoning_parser``
(``pagedlab serve --reasoning-parser`` fills it in) whose tags stand in for the strings not given.
Each string is encoded without special tokens, as vLLM encodes it; either may be several tokens.
A budget on an engine without markers is a ValueError.

**Counting.** Over the prompt and the output, a thinking section opens where the tokens end with
the start marker (a later one in the section opens it afresh) and closes where they end with the
end marker. Every token after the start marker counts, the prompt's too: a chat template that puts
``<think>`` in the generation prompt opens the section there, and the tokens after it (Qwen3's
``"\\n"``) are part of the budget, as in vLLM. Once ``B`` tokens are in the section, the next ones
are the end marker's, forced one by one (every other logit of the row to -inf, after every other
control, so nothing a request bans overrides it): ``B`` thinking tokens, then the marker. Budget 0
closes a section right after its start marker; a prompt whose open section holds ``B`` tokens or
more gets the marker at its first output token. Each section gets the whole budget; vLLM's
processor, which looks for the start marker only until it first finds it, budgets the first one.

**Asynchronous steps.** The count reads the request's tokens on the host, and step N+1 is
launched before step N's token is read back. A batch whose forced tokens could depend on a pending
token (``ThinkingBudget.needs_pending_tokens``: a section that may have reached its budget by
then) samples as a grammar batch does: the forward runs at once, its sampling inputs are built
once step N is read back (``ModelRunner.finish_sampling``), and its sampler is queued before step
N+2's forward. Otherwise nothing waits: a row that cannot be forced at any outcome of the pending
tokens is built at launch. With speculative decoding the rows after proposed tokens count those
tokens, so the outputs are plain decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pagedlab.sampling_params import SamplingParams
from pagedlab.reasoning_parsers import REASONING_PARSERS

REASONING_CONFIG_KEYS = ("reasoning_parser", "reasoning_start_str", "reasoning_end_str")


@dataclass(frozen=True)
class ThinkingMarkers:
    """The token ids that open and close a thinking section."""

    start: tuple[int, ...]
    end: tuple[int, ...]


def thinking_markers(reasoning_config: dict | None, tokenizer, vocab_size: int) -> ThinkingMarkers | None:
    """The markers ``reasoning_config`` names (see the module's docstring), None without one; a
    ValueError naming the setting where it is malformed or names no usable markers."""
    if reasoning_config is None:
        return None

    def bad(why: str) -> ValueError:
        return ValueError(f"reasoning_config={reasoning_config!r} is invalid: {why}")

    unknown = [key for key in reasoning_config if key not in REASONING_CONFIG_KEYS]
    if unknown:
        raise bad(f"unknown key {unknown[0]!r} (allowed: {', '.join(REASONING_CONFIG_KEYS)})")
    if any(not isinstance(value, str) for value in reasoning_config.values()):
        raise bad("its values must be strings")
    parser_name = reasoning_config.get("reasoning_parser") or None
    if parser_name is not None and parser_name not in REASONING_PARSERS:
        raise bad(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}")
    parser = REASONING_PARSERS.get(parser_name)
    texts = [reasoning_config.get(key) or (getattr(parser, key) if parser else "")
             for key in REASONING_CONFIG_KEYS[1:]]
    if not all(texts):
        raise bad("give reasoning_start_str and reasoning_end_str, or a reasoning_parser to take them from")
    if tokenizer is None:
        raise bad("the model has no tokenizer to encode its strings")
    ids = [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    for key, text, encoded in zip(REASONING_CONFIG_KEYS[1:], texts, ids):
        if not encoded or not all(0 <= t < vocab_size for t in encoded):
            raise bad(f"{key} {text!r} encodes to {list(encoded)}, not to token ids in [0, {vocab_size})")
    return ThinkingMarkers(*ids)


def check_thinking_budget(params: SamplingParams, markers: ThinkingMarkers | None) -> None:
    """A ValueError naming ``thinking_token_budget`` when it is set and the engine has no markers."""
    budget = params.thinking_token_budget
    if budget is not None and markers is None:
        raise ValueError(f"thinking_token_budget={budget} is invalid here: the engine knows no thinking "
                         "markers; start it with reasoning_config={'reasoning_parser': 'qwen3'} or "
                         "{'reasoning_start_str': '<think>', 'reasoning_end_str': '</think>'} "
                         "(pagedlab serve: --reasoning-parser or --reasoning-config)")


def new_thinking_budget(params: SamplingParams, markers: ThinkingMarkers | None,
                        num_prompt_tokens: int) -> ThinkingBudget | None:
    """One sequence's ``ThinkingBudget`` for ``params``, None without a budget (ValueError: see
    ``check_thinking_budget``)."""
    check_thinking_budget(params, markers)
    budget = params.thinking_token_budget
    return None if budget is None else ThinkingBudget(markers, budget, num_prompt_tokens)


def _ends_with(tokens: Sequence[int], end: int, marker: tuple[int, ...]) -> bool:
    """Whether ``tokens[:end]`` ends with ``marker``."""
    n = len(marker)
    return end >= n and tokens[end - 1] == marker[-1] and tuple(tokens[end - n:end]) == marker


class _Section(NamedTuple):
    """Where a sequence stands after some of its tokens."""

    open: bool = False  # in a thinking section
    count: int = 0  # the section's tokens after its start marker (the forced ones included)
    forced: int = 0  # of them, the end marker's tokens forced so far


class ThinkingBudget:
    """One sequence's place in its thinking sections, read incrementally from its tokens (prompt,
    then output), and the token a sampled row must take next."""

    def __init__(self, markers: ThinkingMarkers, budget: int, num_prompt_tokens: int):
        self.markers = markers
        self.budget = budget
        self.num_prompt_tokens = num_prompt_tokens
        self._lookback = max(len(markers.start), len(markers.end)) - 1
        self._seen = 0  # tokens read
        self._section = _Section()

    def _after(self, tokens: Sequence[int], end: int, section: _Section, generated: bool) -> _Section:
        """The section once ``tokens[end - 1]`` is read (``generated``: an output token, which the
        budget forced where the section had reached it; a prompt's never was)."""
        if section.open and _ends_with(tokens, end, self.markers.end):
            return _Section()
        if _ends_with(tokens, end, self.markers.start):
            return _Section(open=True)
        if not section.open:
            return section
        forced = section.forced + (generated and section.count >= self.budget)
        return _Section(True, section.count + 1, forced)

    def _read(self, tokens: Sequence[int]) -> None:
        if len(tokens) < self._seen:  # tokens dropped after a stop string: read them all again
            self._seen, self._section = 0, _Section()
        for end in range(self._seen + 1, len(tokens) + 1):
            self._section = self._after(tokens, end, self._section, end > self.num_prompt_tokens)
        self._seen = len(tokens)

    def forced_token(self, tokens: Sequence[int], proposed: Sequence[int] = ()) -> int | None:
        """The token the position after ``tokens`` (the sequence's known tokens, prompt first) and
        ``proposed`` (speculative tokens before the row) must take, or None where it is free."""
        self._read(tokens)
        section = self._section
        if proposed:
            window = list(tokens[len(tokens) - self._lookback:]) + list(proposed)
            for end in range(len(window) - len(proposed) + 1, len(window) + 1):
                section = self._after(window, end, section, True)
        end_marker = self.markers.end
        if section.open and section.count >= self.budget and section.forced < len(end_marker):
            return end_marker[section.forced]
        return None

    def needs_pending_tokens(self, tokens: Sequence[int], num_pending: int) -> bool:
        """Whether the row after ``tokens`` and ``num_pending`` tokens not yet read back may be
        forced: its section's count could reach the budget by then (one opened among the pending
        tokens holds fewer than ``num_pending`` of them)."""
        if not num_pending:
            return False
        self._read(tokens)
        section = self._section
        return (section.open and section.count + num_pending >= self.budget) or num_pending > self.budget
