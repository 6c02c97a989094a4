"""A chat choice's text as tool calls: the message of a full response and the deltas of a stream,
as vLLM returns them.

Named tool_choice: the (grammar-constrained) text is the call's arguments; a stream sends them as
they come, the id and name with the first part. "required": the text is a JSON array of
``{"name", "parameters"}``; "auto": the server's tool parser reads the calls. For these two a
stream sends the content before the calls as it comes and each call whole, with its id and name,
once the choice ends: the calls are read from the whole text exactly as the full response reads
them, so the deltas add up to the full response, and text that turns out not to be calls goes
out as content (vLLM guesses at partial JSON instead, and its stream and full responses can
differ). ``finish_reason`` is "tool_calls" when "auto" found calls, and in a stream that sent any;
a full response to a named or "required" tool_choice keeps the engine's reason, as vLLM's does.
"""

from __future__ import annotations

import json

from pagedlab.server.protocol_tools import (DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall,
                                            ToolFields, tool_call_id)
from pagedlab.server.tool_parsers import ExtractedToolCalls, ParsedToolCall, ToolParser


class ToolCalling:
    """How one request's output becomes tool calls (``active`` is False when it does not)."""

    def __init__(self, request: ToolFields, parser: ToolParser | None):
        self.named = request.named_tool
        self.required = request.tool_choice == "required"
        self.parser = parser if request.tool_choice == "auto" and request.tools else None
        self.parallel = request.parallel_tool_calls
        self.active = bool(self.named or self.required or self.parser)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a choice's whole text (only the first without ``parallel_tool_calls``);
        none, with the text as content, when it holds none."""
        if self.named:
            found = ExtractedToolCalls([ParsedToolCall(self.named.name, text)], "")
        elif self.required:
            found = _required_calls(text)
        elif self.parser:
            found = self.parser.extract(text)
        else:
            found = ExtractedToolCalls(content=text)
        if not found.calls:
            return ExtractedToolCalls(content=text)
        return found if self.parallel else ExtractedToolCalls(found.calls[:1], found.content)

    def message(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish_reason) of a full response's choice."""
        found = self.extract(text)
        calls = [ToolCall(function=FunctionCall(name=call.name, arguments=call.arguments))
                 for call in found.calls]
        return found.content, calls, "tool_calls" if calls and self.parser else finish_reason


def _required_calls(text: str) -> ExtractedToolCalls:
    """A "required" tool_choice's array of ``{"name", "parameters"}``; none when the text is not
    one (the output was cut short by max_tokens or a stop string)."""
    try:
        items = json.loads(text)
        calls = [ParsedToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                 for item in items]
    except (ValueError, TypeError, KeyError):
        return ExtractedToolCalls(content=text)
    return ExtractedToolCalls(calls, "")


class ToolStream:
    """What one streamed choice has sent of its content and tool calls."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.sent = 0  # characters of the text sent (as content, or a named call's arguments)
        self.calls_sent = 0

    def step(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        """(content delta, tool-call deltas) for the choice's text so far; None where nothing is new."""
        if self.calling.named:
            return None, self._named_step(text, finished)
        if not finished:
            hold = 0 if self.calling.required else self.calling.parser.hold_from(text)
            return self._content(text[:max(hold, self.sent)]), None
        found = self.calling.extract(text)
        content = self._content(found.content or "") if found.calls else self._content(text)
        deltas = [DeltaToolCall(index=i, id=tool_call_id(), type="function",
                                function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
                  for i, call in enumerate(found.calls)]
        self.calls_sent = len(deltas)
        return content, deltas or None

    def _content(self, text: str) -> str | None:
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta or None

    def _named_step(self, text: str, finished: bool) -> list[DeltaToolCall] | None:
        arguments, first = self._content(text), self.calls_sent == 0
        if arguments is None and not (first and finished):
            return None
        self.calls_sent = 1
        if first:
            return [DeltaToolCall(index=0, id=tool_call_id(), type="function",
                                  function=DeltaFunctionCall(name=self.calling.named.name,
                                                             arguments=arguments or ""))]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=arguments))]

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """A finished stream's finish_reason: "tool_calls" once it sent any (as vLLM's)."""
        return "tool_calls" if engine_reason is not None and self.calls_sent else engine_reason
