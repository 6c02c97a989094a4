"""Incremental detokenization: text grows token by token (for stop strings and streaming)."""

from __future__ import annotations

# tokenizers' DecodeStream error when a token rewrites text it already returned (see _step)
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Appends each new token's text; a token that ends mid-character waits for the next one.

    The stream first reads the end of the prompt (``prompt_token_ids``) and drops its text, so
    the first output token decodes as it does after the prompt: with SentencePiece tokenizers its
    leading space stays (prompt text + output text is the whole text), as in vLLM."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_token_ids: list[int] = ()):
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = _decode_stream(skip_special_tokens)
        for token_id in _prompt_tail(self._backend, list(prompt_token_ids), skip_special_tokens):
            self._step(token_id)
        self.text = ""

    def append(self, token_id: int) -> str:
        """Add one token; return the text it completed (possibly empty)."""
        piece = self._step(token_id)
        self.text += piece
        return piece

    def _step(self, token_id: int) -> str:
        """The stream's text for one more token. With byte-fallback tokens a token can turn text
        already returned into U+FFFD (an ASCII byte token followed by a stray continuation byte),
        which DecodeStream refuses with an error; as vLLM, the stream starts afresh at this token
        rather than failing the request (and the engine step that decoded it)."""
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            self._stream = _decode_stream(self._skip_special_tokens)
            return self._stream.step(self._backend, token_id) or ""


def _decode_stream(skip_special_tokens: bool):
    from tokenizers.decoders import DecodeStream

    return DecodeStream(skip_special_tokens=skip_special_tokens)


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[str, int] | None:
    """The stop string that the last ``new_len`` characters completed, and where it starts: of
    two, the one that starts first (the list's order among equal starts), so the text cut before
    it holds no stop string. vLLM takes the first in the list instead, which can leave one."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best


def _prompt_tail(backend, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The shortest tail of the prompt, from 4 tokens up, whose text does not start mid-character."""
    for n in range(min(4, len(prompt_token_ids)), min(24, len(prompt_token_ids)) + 1):
        tail = prompt_token_ids[-n:]
        if not backend.decode(tail, skip_special_tokens=skip_special_tokens).startswith("\ufffd"):
            return tail
    return prompt_token_ids[-4:]
