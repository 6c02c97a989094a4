"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt (or a conversation through the chat
template) to token ids as the server would feed them to the model, and token ids back to text."""

from __future__ import annotations

from pydantic import BaseModel

from pagedlab.server.errors import bad_request
from pagedlab.server.protocol import (ChatCompletionRequest, OpenAIRequest, OpenAIResponse, TokenId,
                                      parse_request)
from pagedlab.server.serving_chat import OpenAIServingChat


class TokenizeCompletionRequest(OpenAIRequest):
    """``/tokenize`` with a ``prompt`` (a conversation is a ``TokenizeChatRequest``)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """``/tokenize`` with ``messages``: the conversation as a chat request renders it."""

    return_token_strs: bool = False


class TokenizeResponse(OpenAIResponse):
    """The prompt's token ids, their count, the model's context length and (if asked) each token's text."""

    omitted_when_none = frozenset({"token_strs"})

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    """``/detokenize``: token ids to text."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    """The text of the token ids."""

    prompt: str


class OpenAIServingTokenization(OpenAIServingChat):
    """Serves ``/tokenize`` and ``/detokenize`` with the chat endpoint's template and checks."""

    def tokenize(self, body: dict) -> TokenizeResponse:
        """``body`` holds ``prompt`` or ``messages`` (rendered as ``/v1/chat/completions`` would)."""
        tokenizer = self.require_tokenizer("/tokenize")
        if "messages" in body:
            request = parse_request(TokenizeChatRequest, body)
            self.check_model(request.model)
            ids, want_strs = self.render(request).token_ids, request.return_token_strs
        else:
            request = parse_request(TokenizeCompletionRequest, body)
            self.check_model(request.model)
            prompt = {"prompt": request.prompt, "add_special_tokens": request.add_special_tokens}
            ids, want_strs = self.encode(prompt, "prompt").token_ids, request.return_token_strs
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids,
                                token_strs=tokenizer.convert_ids_to_tokens(ids) if want_strs else None)

    def detokenize(self, body: dict) -> DetokenizeResponse:
        """The text of ``body["tokens"]``; a 400 for ids out of vocabulary."""
        tokenizer = self.require_tokenizer("/detokenize")
        request = parse_request(DetokenizeRequest, body)
        self.check_model(request.model)
        vocab = self.engine.info.hf_config.vocab_size
        bad = next((t for t in request.tokens if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of vocabulary (ids must be in [0, {vocab}))",
                              param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))


