"""Reasoning parsers (vLLM's ``--reasoning-parser``): a chat choice's text split into its reasoning
(``message.reasoning``, and vLLM's older name ``reasoning_content``) and its content.

Both parsers read ``<think>``...``</think>``: the text between is the reasoning, the text after
``</think>`` the content (null when empty); a leading ``<think>`` is dropped. Where no
``</think>`` came (the model still thinking when it stopped):

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): everything is reasoning, since their chat
  templates open the ``<think>`` block in the prompt;
- ``qwen3`` (Qwen3, whose reasoning ``enable_thinking=False`` in ``chat_template_kwargs`` turns
  off): reasoning only if the text opens with a ``<think>`` block, else everything is content
  (a template that opens the block in the prompt, as Qwen3's 2507 thinking models', needs
  ``deepseek_r1``).

A stream sends reasoning and content as they come and holds back only text that may still turn
out to be a tag, so its deltas add up to the full response's fields. Tool calls are read from the
content. Only the standard library here: the CLI lists the parsers without the server's packages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """``implicit_start``: the text is reasoning up to a ``</think>`` (or its end) even without a
    leading ``<think>`` (``deepseek_r1``); otherwise only after one (``qwen3``)."""

    name: str
    implicit_start: bool
    # vLLM's names for the tags: the markers thinking_token_budget counts between (engine/thinking_budget.py)
    reasoning_start_str: ClassVar[str] = START
    reasoning_end_str: ClassVar[str] = END

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        lead = text.lstrip()
        started = lead.startswith(START)
        if not (started or self.implicit_start):
            return None, text
        body = lead[len(START):] if started else text
        if END not in body:
            return body, None
        reasoning, _, content = body.partition(END)
        return reasoning, content or None

    def safe_prefix(self, text: str) -> str:
        """The longest prefix of a stream's text so far whose split can no longer change: the text
        without a trailing partial tag (``<think>`` at its start, ``</think>`` while in reasoning)."""
        lead = text.lstrip()
        if len(lead) < len(START) and START.startswith(lead):
            return ""
        reasoning, content = self.split(text)
        if content is not None or reasoning is None:
            return text
        for keep in range(min(len(END) - 1, len(text)), 0, -1):
            if END.startswith(text[-keep:]):
                return text[:-keep]
        return text

    def explicit(self) -> ReasoningParser:
        """This parser with reasoning only inside a leading ``<think>`` block: for an output a
        grammar forced (structured outputs, a named or "required" tool_choice), which holds
        thinking only where the grammar wrote the tags."""
        return dataclasses.replace(self, implicit_start=False)


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
                     "qwen3": ReasoningParser("qwen3", implicit_start=False)}


def reasoning_parser_named(name: str | None) -> ReasoningParser | None:
    """The parser ``--reasoning-parser NAME`` asks for (None: none); a ValueError naming the choices."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is invalid: choose one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


class ReasoningStream:
    """What one streamed choice has sent of its reasoning and content."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.sent = {"reasoning": 0, "content": 0}

    def step(self, text: str, finished: bool) -> tuple[str | None, str | None, str]:
        """(reasoning delta, content delta, content so far) for the choice's text so far; a delta
        is None where nothing is new."""
        reasoning, content = self.parser.split(text if finished else self.parser.safe_prefix(text))
        return self._delta("reasoning", reasoning or ""), self._delta("content", content or ""), content or ""

    def _delta(self, part: str, so_far: str) -> str | None:
        delta, self.sent[part] = so_far[self.sent[part]:], max(self.sent[part], len(so_far))
        return delta or None
