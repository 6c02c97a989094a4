"""Prompts as users give them, turned into token ids: written once for ``LLM``, ``AsyncEngine``
and the server.

A prompt is a string, a list of token ids, or a dict with ``"prompt"`` (and optionally
``"add_special_tokens"``) or ``"prompt_token_ids"`` (and optionally the ``"prompt"`` text), as
in vLLM; ``TextPrompt`` and ``TokensPrompt`` are those dicts' types. Token ids may also come as
numpy integers, a 1-D numpy array or a torch tensor; they become Python ints here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypedDict

from pagedlab.scalars import is_1d_array, is_value_list, python_numbers, python_scalar


class _TextPromptRequired(TypedDict):
    prompt: str


class TextPrompt(_TextPromptRequired, total=False):
    """A text prompt, as vLLM's ``TextPrompt``: ``{"prompt": "...", "add_special_tokens": False}``
    (``add_special_tokens`` defaults to True: the tokenizer adds BOS and the like)."""

    add_special_tokens: bool


class _TokensPromptRequired(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptRequired, total=False):
    """A prompt of token ids, as vLLM's ``TokensPrompt``: ``{"prompt_token_ids": [...]}`` (with
    the optional ``prompt`` text, echoed in the output)."""

    prompt: str


PromptType = str | list[int] | TextPrompt | TokensPrompt | dict
# vLLM prompt keys for inputs this engine does not take (images, audio, embeddings, ...).
_UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "prompt_embeds", "cache_salt")


@dataclass
class EncodedPrompt:
    """A prompt's token ids and, where it had one, its text."""

    token_ids: list[int]
    text: str | None = None


def require_tokenizer(tokenizer, what: str, model: str):
    """``tokenizer``, or a ValueError saying that ``what`` needs one and ``model`` has none."""
    if tokenizer is None:
        raise ValueError(f"{what} need a tokenizer, and the model {model!r} has none: "
                         "pass prompts as token-id lists, or tokenizer=PATH")
    return tokenizer


def encode_prompt(prompt: PromptType, tokenizer, model: str) -> EncodedPrompt:
    """Token ids (and text) of one prompt; text is tokenized with ``tokenizer``."""
    if isinstance(prompt, dict):
        unsupported = [k for k in _UNSUPPORTED_PROMPT_KEYS if k in prompt]
        if unsupported:
            raise ValueError(f"prompt key {unsupported[0]!r} is not supported: pagedlab serves text-only "
                             "models; a prompt takes 'prompt' (with 'add_special_tokens') or "
                             "'prompt_token_ids'")
        if "prompt_token_ids" in prompt:
            return EncodedPrompt(_token_ids(prompt["prompt_token_ids"]), prompt.get("prompt"))
        if "prompt" not in prompt:
            raise ValueError(f"prompt {prompt!r} is invalid: a dict prompt needs 'prompt' or "
                             "'prompt_token_ids'")
        text, add_special = prompt["prompt"], prompt.get("add_special_tokens", True)
    elif isinstance(prompt, str):
        text, add_special = prompt, True
    elif isinstance(prompt, (list, tuple)) or is_1d_array(prompt):
        return EncodedPrompt(_token_ids(prompt))
    else:
        raise ValueError(f"prompt {prompt!r} is invalid: a prompt is a string, a list of token ids, or a "
                         "dict with 'prompt' or 'prompt_token_ids'")
    tokenizer = require_tokenizer(tokenizer, "text prompts", model)
    return EncodedPrompt(tokenizer(text, add_special_tokens=add_special).input_ids, text)


def _token_ids(ids) -> list[int]:
    if not is_value_list(ids):
        raise ValueError(f"prompt_token_ids={ids!r} is invalid: give a list of token ids (or a 1-D array)")
    return python_numbers(ids)


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or a list of them, as a list (a flat list of ints, numpy's too, or a 1-D array is
    one token-id prompt)."""
    if isinstance(prompts, (str, dict)) or is_1d_array(prompts):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise ValueError(f"prompts={prompts!r} is invalid: give a prompt (a string, a list of token ids, "
                         "or a dict with 'prompt' or 'prompt_token_ids') or a list of them")
    prompts = list(prompts)
    if prompts and all(type(python_scalar(t)) is int for t in prompts):
        return [prompts]
    return prompts


def as_conversation_list(messages) -> list[list]:
    """One conversation (a list of message dicts) or a list of them, as a list of conversations."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        return [list(messages)]
    if not (isinstance(messages, (list, tuple)) and all(
            isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c) for c in messages)):
        raise ValueError(f"messages={messages!r:.200} is invalid: give a conversation, a list of "
                         "{'role': ..., 'content': ...} dicts, or a list of conversations")
    return [list(c) for c in messages]


def chat_prompt(tokenizer, conversation: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True, model: str = "", continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> dict:
    """A conversation rendered through the chat template, as a prompt that adds no special tokens
    (the template already holds them). ``continue_final_message`` leaves the last (assistant)
    message open for the model to continue, as vLLM does; ``chat_template_kwargs`` are extra
    variables for the template (e.g. ``enable_thinking=False``), and win over the arguments of
    the same name, as vLLM's; ``tools`` (OpenAI's tool objects) go to the template's ``tools``."""
    tokenizer = require_tokenizer(tokenizer, "chat conversations", model)
    template_args = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
                     "tools": tools,
                     "continue_final_message": continue_final_message, **(chat_template_kwargs or {})}
    add_generation_prompt = template_args["add_generation_prompt"]
    continue_final_message = template_args["continue_final_message"]
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt=True and continue_final_message=True conflict: a reply "
                         "either starts a new assistant turn or continues the last message; set one to False")
    if continue_final_message and (not conversation or conversation[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message=True needs a conversation whose last message is the "
                         "assistant's (the text to continue)")
    conversation = [_with_text_content(m) for m in conversation]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, **template_args)
    return {"prompt": text, "add_special_tokens": False}


def _with_text_content(message: dict) -> dict:
    """``message`` with OpenAI-style content parts (``[{"type": "text", "text": ...}, ...]``, or
    bare strings) joined into one string by newlines, as vLLM gives them to a template that takes
    string content (and as the server does): rendered as they are, a template would print the
    list's Python repr into the prompt."""
    content = message.get("content")
    if not isinstance(content, (list, tuple)):
        return message
    texts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            part = part["text"]
        if not isinstance(part, str):
            raise ValueError(f"message content part {part!r:.200} is not supported: pagedlab serves "
                             "text-only models; a part is a string or {'type': 'text', 'text': ...}")
        texts.append(part)
    return {**message, "content": "\n".join(texts)}
