"""Prompts as users give them, turned into token ids: written once for ``LLM``, ``AsyncEngine``
and the server.

A prompt is a string, a list of token ids, or a dict with ``"prompt"`` (and optionally
``"add_special_tokens"``) or ``"prompt_token_ids"`` (and optionally the ``"prompt"`` text), as
in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PromptType = str | list[int] | dict


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
        if "prompt_token_ids" in prompt:
            return EncodedPrompt(list(prompt["prompt_token_ids"]), prompt.get("prompt"))
        if "prompt" not in prompt:
            raise ValueError(f"prompt {prompt!r} is invalid: a dict prompt needs 'prompt' or "
                             "'prompt_token_ids'")
        text, add_special = prompt["prompt"], prompt.get("add_special_tokens", True)
    elif isinstance(prompt, str):
        text, add_special = prompt, True
    elif isinstance(prompt, (list, tuple)):
        return EncodedPrompt(list(prompt))
    else:
        raise ValueError(f"prompt {prompt!r} is invalid: a prompt is a string, a list of token ids, or a "
                         "dict with 'prompt' or 'prompt_token_ids'")
    tokenizer = require_tokenizer(tokenizer, "text prompts", model)
    return EncodedPrompt(tokenizer(text, add_special_tokens=add_special).input_ids, text)


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or a list of them, as a list (a flat list of ints is one token-id prompt)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def chat_prompt(tokenizer, conversation: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True, model: str = "", **template_kwargs) -> dict:
    """A conversation rendered through the chat template, as a prompt that adds no special tokens
    (the template already holds them). ``template_kwargs`` are extra variables for the template."""
    tokenizer = require_tokenizer(tokenizer, "chat conversations", model)
    text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)
    return {"prompt": text, "add_special_tokens": False}
