"""Tool calling in chat completions, as vLLM serves it: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, and the ``tool_calls`` of responses and stream chunks.

``tool_choice`` is "none", "auto" (the default when tools are given: the model decides, a
``--tool-call-parser`` reads the calls out of its text), "required" (at least one call, the
output constrained to a JSON array of ``{"name", "parameters"}`` objects over the given tools) or
``{"type": "function", "function": {"name": ...}}`` (one call of that tool, the output constrained
to its parameters' schema). The validation messages are vLLM's.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pagedlab.sampling_params import StructuredOutputsParams
from pagedlab.server.protocol_vllm import VLLMOutputFields, expecting, refused

_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def tool_call_id() -> str:
    """A fresh tool call id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _omitted_when_none() -> Any:
    return Field(None, exclude_if=lambda value: value is None)


# ---- request ------------------------------------------------------------------------------------
class FunctionDefinition(BaseModel):
    """A tool's function: its name, what it does and its parameters' JSON schema. Other fields
    (``strict``, ...) are kept and reach the chat template, as vLLM's do."""

    model_config = ConfigDict(strict=True, extra="allow")

    name: str
    description: str | None = None
    parameters: dict | None = None


class ChatCompletionToolsParam(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolFields(VLLMOutputFields):
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request (OpenAI's
    deprecated ``functions`` is refused)."""

    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Annotated[str | dict, expecting("a string or an object")] | None = None
    parallel_tool_calls: bool = True
    functions: Annotated[list | None, refused("functions (OpenAI's deprecated form of tools) are not "
                                              'supported: give tools, each {"type": "function", '
                                              '"function": {...}}')] = None

    @field_validator("tools")
    @classmethod
    def _not_empty(cls, tools: list) -> list:
        if not tools:
            raise ValueError("`tools` must not be an empty array. Either provide at least one tool or omit "
                             "the field entirely.")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, choice: str | dict, info: ValidationInfo) -> str | dict:
        if choice == "none":
            return choice
        tools = info.data.get("tools")
        if tools is None:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if isinstance(choice, str):
            if choice not in ("auto", "required"):
                raise ValueError(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", '
                                 '"auto" or "required" are supported.')
            return choice
        function = choice.get("function")
        if choice.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_USAGE}")
        if "name" not in function:
            raise ValueError(f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}")
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}")
        if all(tool.function.name != name for tool in tools):
            raise ValueError("The tool specified in `tool_choice` does not match any of the specified "
                             "`tools`")
        return choice

    @model_validator(mode="after")
    def _default_tool_choice(self):
        """No tool_choice: "auto" with tools, else "none" (vLLM's and OpenAI's defaults)."""
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        return self

    @property
    def named_tool(self) -> FunctionDefinition | None:
        """The function a named tool_choice forces, or None."""
        if not isinstance(self.tool_choice, dict):
            return None
        name = self.tool_choice["function"]["name"]
        return next(tool.function for tool in self.tools if tool.function.name == name)

    def tool_dicts(self, exclude_when_none: bool = False) -> list[dict] | None:
        """The tools as the chat template takes them (``tools=``); None without tools, or with
        tool_choice "none" when ``exclude_when_none`` (vLLM's --exclude-tools-when-tool-choice-none)."""
        if self.tools is None or (exclude_when_none and self.tool_choice == "none"):
            return None
        return [tool.model_dump() for tool in self.tools]

    def tool_json_schema(self) -> dict | None:
        """The JSON schema a named or "required" tool_choice constrains the output to, built as vLLM
        builds it; None otherwise."""
        named = self.named_tool
        if named is not None:
            return named.parameters or {"type": "object", "properties": {}}
        if self.tool_choice != "required":
            return None
        schema = {"type": "array", "minItems": 1,
                  "items": {"type": "object", "anyOf": [_call_schema(tool.function) for tool in self.tools]}}
        definitions = _shared_definitions(self.tools)
        if definitions:
            schema["$defs"] = definitions
        return schema

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The tool's grammar for a named or "required" tool_choice (which another structured
        output may not join), else the request's own structured output."""
        asked = super().structured_outputs_params()
        schema = self.tool_json_schema()
        if schema is None:
            return asked
        if asked is not None:
            raise ValueError(f"tool_choice={json.dumps(self.tool_choice)} is invalid: You can only either "
                             "use constraints for guided decoding or tools, not both (a named or "
                             "\"required\" tool_choice constrains the output to the tool's arguments)")
        return StructuredOutputsParams(json=schema)


def _call_schema(function: FunctionDefinition) -> dict:
    """One call of ``function`` in a "required" tool_choice's array; without parameters, an empty
    object (as vLLM)."""
    parameters = {k: v for k, v in (function.parameters or {}).items() if k != "$defs"}
    return {"properties": {"name": {"type": "string", "enum": [function.name]},
                           "parameters": parameters or {"type": "object", "properties": {}}},
            "required": ["name", "parameters"]}


def _shared_definitions(tools: list[ChatCompletionToolsParam]) -> dict:
    """The tools' ``$defs``, gathered at the array's root where their ``$ref``s point."""
    definitions: dict[str, Any] = {}
    for tool in tools:
        for name, schema in (tool.function.parameters or {}).get("$defs", {}).items():
            if definitions.setdefault(name, schema) != schema:
                raise ValueError(f"tool_choice=\"required\" is invalid: Tool definition '{name}' has "
                                 "multiple schemas, which is not supported.")
    return definitions


def template_messages(conversation: list[dict]) -> list[dict]:
    """The conversation as vLLM hands it to the chat template: the assistant's earlier tool calls'
    arguments as objects rather than JSON strings (how tool-use templates expect them; none,
    ``""`` or null, as ``{}``), and an empty ``tool_calls`` list left out (templates such as Llama
    3.1's take any message with the key for a call)."""
    for message in conversation:
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if calls == []:
            del message["tool_calls"]
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                function["arguments"] = _arguments_object(function.get("arguments"))
    return conversation


def _arguments_object(arguments: Any) -> Any:
    """An earlier call's arguments for the template: ``{}`` when empty, a JSON string decoded."""
    if not arguments:
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise ValueError(f"messages: a tool call's arguments {arguments!r} are not valid JSON") from None


# ---- responses ----------------------------------------------------------------------------------
class FunctionCall(BaseModel):
    """The function a tool call calls, its arguments a JSON string."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call of the assistant's message."""

    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    """A tool call's new part in a stream chunk: the name once, then arguments."""

    name: str | None = _omitted_when_none()
    arguments: str | None = _omitted_when_none()


class DeltaToolCall(BaseModel):
    """A tool call in a stream chunk: ``index`` says which; its first delta has the id and type."""

    index: int
    id: str | None = _omitted_when_none()
    type: Literal["function"] | None = _omitted_when_none()
    function: DeltaFunctionCall | None = _omitted_when_none()
