"""Tool-call parsers for ``tool_choice: "auto"``: they read the calls a model wrote into its text,
named as vLLM's ``--tool-call-parser`` names them.

``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks (the last one may lack its closing tag); the text before the first block is the content.
``llama3_json`` (Llama 3.1 / 3.2 with a JSON tool template): a JSON object ``{"name": ...,
"parameters": {...}}`` (or ``"arguments"``), several separated by ``;`` (the calls end where no
object follows one), optionally after ``<|python_tag|>``; the text before the first object is
the content (vLLM drops it; pagedlab keeps it, so a streamed response can equal the full one).
Output that does not parse as calls stays content, whole. Only the standard library here: the
CLI lists the parsers without the server's packages.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedToolCall:
    """A call read from the text: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """The calls found in a model's text (none: the text is all content) and the content beside them."""

    calls: list[ParsedToolCall] = field(default_factory=list)
    content: str | None = None


class ToolParser:
    """Reads tool calls out of generated text. ``markers`` are where a call may start: a stream
    sends the text before the first one as it comes and holds the rest until the end."""

    name: str = ""
    markers: tuple[str, ...] = ()
    # whether the call markers may be special tokens, which the output text must then keep
    keeps_special_tokens: bool = False

    def extract(self, text: str) -> ExtractedToolCalls:
        """The tool calls in a whole output, or none and the text as content."""
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """Where the text a stream must hold back starts: the first marker, or the start of a
        marker's beginning at the very end of the text; ``len(text)`` when nothing needs holding."""
        starts = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if starts:
            return min(starts)
        for start in range(max(0, len(text) - max(map(len, self.markers)) + 1), len(text)):
            if any(m.startswith(text[start:]) for m in self.markers):
                return start
        return len(text)


def _function_call(obj, arguments_keys: tuple[str, ...]) -> ParsedToolCall:
    """A call from a parsed JSON object with a string ``name`` and arguments under the first of
    ``arguments_keys`` it has; a ValueError for anything else."""
    key = next((k for k in arguments_keys if isinstance(obj, dict) and k in obj), None)
    if key is None or not isinstance(obj.get("name"), str):
        raise ValueError(f"not a tool call: {obj!r}")
    return ParsedToolCall(obj["name"], json.dumps(obj[key], ensure_ascii=False))


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (vLLM's ``hermes``)."""

    name = "hermes"
    markers = ("<tool_call>",)
    keeps_special_tokens = True
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.markers[0])
        if start < 0:
            return ExtractedToolCalls(content=text)
        try:
            calls = [_function_call(json.loads(closed or unclosed), ("arguments",))
                     for closed, unclosed in self._BLOCK.findall(text)]
        except ValueError:  # malformed JSON, or an object that is no call: the text stays content
            return ExtractedToolCalls(content=text)
        return ExtractedToolCalls(calls, text[:start] or None)


class Llama3JsonToolParser(ToolParser):
    """JSON objects with ``name`` and ``parameters`` / ``arguments``, ``;``-separated (vLLM's
    ``llama3_json``)."""

    name = "llama3_json"
    markers = ("{", "<|python_tag|>")
    _DECODER = json.JSONDecoder()

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find("{")
        if start < 0:
            return ExtractedToolCalls(content=text)
        calls, position = [], start
        try:
            while True:
                obj, position = self._DECODER.raw_decode(text, position)
                calls.append(_function_call(obj, ("arguments", "parameters")))
                rest = text[position:].lstrip()
                after = rest[1:].lstrip()
                if not (rest.startswith(";") and after.startswith("{")):  # no further call: the calls end
                    break
                position = len(text) - len(after)
        except ValueError:  # malformed JSON, or an object that is no call: the text stays content
            return ExtractedToolCalls(content=text)
        return ExtractedToolCalls(calls, text[:start].replace("<|python_tag|>", "") or None)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def tool_parser_named(name: str | None, enable_auto_tool_choice: bool) -> ToolParser | None:
    """The parser ``--tool-call-parser NAME`` asks for when ``--enable-auto-tool-choice`` is on
    (None when it is off); a ValueError naming the flag for an unknown name or a missing one."""
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is invalid: choose one of {', '.join(TOOL_PARSERS)}")
    if enable_auto_tool_choice and name is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(TOOL_PARSERS)})")
    return TOOL_PARSERS[name]() if enable_auto_tool_choice else None
