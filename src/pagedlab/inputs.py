"""Prompts as users give them, turned into token ids: written once for ``LLM``, ``AsyncEngine``
and the server.

A prompt is a string, a list of token ids, or a dict with ``"prompt"`` (and optionally
``"add_special_tokens"``) or ``"prompt_token_ids"`` (and optionally the ``"prompt"`` text), as
in vLLM; ``TextPrompt`` and ``TokensPrompt`` are those dicts' types. Token ids may also come as
numpy integers, a 1-D numpy array or a torch tensor; they become Python ints here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from pagedlab.scalars import is_1d_array, is_value_list, python_numbers, python_scalar

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class TokenizeOptions:
    """vLLM's ``tokenization_kwargs`` of ``LLM.generate`` and ``LLM.chat`` (``tokenize_options``
    reads them): ``add_special_tokens`` for text prompts (None: the call's own default; a prompt
    dict's key wins), ``truncate_prompt_tokens`` (keep the prompt's last k tokens, the left
    truncation of vLLM's generate runner), ``max_length`` (a longer prompt is refused) and
    ``do_lower_case`` (the text is lower-cased before it is tokenized)."""

    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    max_length: int | None = None
    do_lower_case: bool = False

    def apply(self, token_ids: list[int], params, max_model_len: int) -> list[int]:
        """``token_ids`` truncated, then checked against ``max_length``. A ``truncate_prompt_tokens``
        of the request's ``params`` wins over these options' (vLLM merges it over them)."""
        if params.truncate_prompt_tokens is not None:
            token_ids = params.truncate_prompt(token_ids, max_model_len)
        elif self.truncate_prompt_tokens is not None and len(token_ids) > self.truncate_prompt_tokens:
            token_ids = list(token_ids[-self.truncate_prompt_tokens:])
        if self.max_length is not None and len(token_ids) > self.max_length:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than tokenization_kwargs' "
                             f"max_length={self.max_length}: shorten it, or truncate it (truncation=True)")
        return token_ids


def tokenize_options(kwargs: Mapping | None, max_model_len: int) -> TokenizeOptions:
    """``TokenizeOptions`` from vLLM's ``tokenization_kwargs`` (vLLM's ``TokenizeParams.with_kwargs``):
    ``truncation=True`` (or "longest_first") truncates to ``max_length``, False (or
    "do_not_truncate") not at all; ``truncate_prompt_tokens`` -1 keeps as many as ``max_length``,
    else ``max_model_len`` - 1, allow (room for one token). Padding is refused (pagedlab pads no
    prompt); other keys are ignored with a warning, as vLLM ignores them."""
    if kwargs is None:
        return TokenizeOptions()
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"tokenization_kwargs={kwargs!r:.200} is invalid: give a dict, e.g. "
                         "{'truncate_prompt_tokens': 512}")
    rest = dict(kwargs)
    max_length = python_scalar(rest.pop("max_length", None))
    keep = _truncation(rest, python_scalar(rest.pop("truncate_prompt_tokens", None)), max_length)
    add_special, lower = rest.pop("add_special_tokens", None), rest.pop("do_lower_case", False)
    padding, pad_tokens = rest.pop("padding", None), rest.pop("pad_prompt_tokens", None)
    if padding not in (None, False, "do_not_pad") or pad_tokens is not None:
        raise ValueError(f"tokenization_kwargs padding={padding!r}, pad_prompt_tokens={pad_tokens!r} is not "
                         "supported: pagedlab does not pad generation prompts")
    if rest:
        logger.warning("tokenization_kwargs %s are not supported and are ignored (as vLLM ignores them)",
                       sorted(rest))
    _check_option(max_length is None or (type(max_length) is int and max_length >= 1), "max_length",
                  max_length, "None or an integer >= 1")
    _check_option(keep is None or (type(keep) is int and (keep >= 1 or keep == -1)), "truncate_prompt_tokens",
                  keep, "None, an integer >= 1 (keep the prompt's last k tokens) or -1")
    cap, cap_name = (max_model_len, "max_model_len") if max_length is None else (max_length, "max_length")
    _check_option(keep is None or keep <= cap, "truncate_prompt_tokens", keep, f"at most {cap_name} ({cap})")
    if keep == -1:
        keep = min(cap, max_model_len - 1)
    return TokenizeOptions(None if add_special is None else bool(add_special), keep, max_length, bool(lower))


def _truncation(rest: dict, keep, max_length):
    """The tokens to keep once ``truncation`` (popped from ``rest``) has its say: True truncates to
    ``max_length`` (-1, as many as fit, without one), False not at all; any other value stays in
    ``rest`` for the warning, as vLLM leaves it."""
    truncation = rest.pop("truncation", None)
    if truncation in (True, "longest_first"):
        return -1 if max_length is None else max_length
    if truncation in (False, "do_not_truncate"):
        return None
    if truncation is not None:
        rest["truncation"] = truncation
    return keep


def _check_option(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"tokenization_kwargs {name}={value!r} is invalid: it must be {allowed}")


def encode_prompt(prompt: PromptType, tokenizer, model: str,
                  options: TokenizeOptions | None = None) -> EncodedPrompt:
    """Token ids (and text) of one prompt; text is tokenized with ``tokenizer`` (``options``:
    ``tokenization_kwargs``' add_special_tokens and do_lower_case; truncation is ``options.apply``'s)."""
    options = options or TokenizeOptions()
    default_special = True if options.add_special_tokens is None else options.add_special_tokens
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
        text, add_special = prompt["prompt"], prompt.get("add_special_tokens", default_special)
    elif isinstance(prompt, str):
        text, add_special = prompt, default_special
    elif isinstance(prompt, (list, tuple)) or is_1d_array(prompt):
        return EncodedPrompt(_token_ids(prompt))
    else:
        raise ValueError(f"prompt {prompt!r} is invalid: a prompt is a string, a list of token ids, or a "
                         "dict with 'prompt' or 'prompt_token_ids'")
    tokenizer = require_tokenizer(tokenizer, "text prompts", model)
    ids = tokenizer(text.lower() if options.do_lower_case else text, add_special_tokens=add_special).input_ids
    return EncodedPrompt(ids, text)


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
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                content_format: str = "auto") -> dict:
    """A conversation rendered through the chat template, as a prompt that adds no special tokens
    (the template already holds them). ``continue_final_message`` leaves the last (assistant)
    message open for the model to continue, as vLLM does; ``chat_template_kwargs`` are extra
    variables for the template (e.g. ``enable_thinking=False``), and win over the arguments of
    the same name, as vLLM's; ``tools`` (OpenAI's tool objects) go to the template's ``tools``.
    ``content_format`` is vLLM's ``chat_template_content_format``: "string" gives the template
    each message's text parts joined by newlines, "openai" a list of ``{"type": "text", "text":
    ...}`` parts (a string content as one part); "auto" is "string" (vLLM's "auto" reads the
    template to choose)."""
    tokenizer = require_tokenizer(tokenizer, "chat conversations", model)
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format={content_format!r} is invalid: give one of "
                         f"{', '.join(CONTENT_FORMATS)}")
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
    conversation = [_with_text_content(m, content_format == "openai") for m in conversation]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, **template_args)
    return {"prompt": text, "add_special_tokens": False}


CONTENT_FORMATS = ("auto", "string", "openai")


def _with_text_content(message: dict, as_parts: bool = False) -> dict:
    """``message`` with OpenAI-style content parts (``[{"type": "text", "text": ...}, ...]``, or
    bare strings) joined into one string by newlines, as vLLM gives them to a template that takes
    string content (and as the server does): rendered as they are, a template would print the
    list's Python repr into the prompt. ``as_parts`` (vLLM's "openai" content format): the texts
    as a list of ``{"type": "text", "text": ...}`` parts instead, a string content as one."""
    content = message.get("content")
    if as_parts and isinstance(content, str):
        content = [content]
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
    if as_parts:
        return {**message, "content": [{"type": "text", "text": text} for text in texts]}
    return {**message, "content": "\n".join(texts)}
