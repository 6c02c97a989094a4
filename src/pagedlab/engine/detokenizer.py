"""Incremental detokenization: text grows token by token (for stop strings and streaming)."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Appends each new token's text; a token that ends mid-character waits for the next one."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def append(self, token_id: int) -> str:
        """Add one token; return the text it completed (possibly empty)."""
        piece = self._stream.step(self._backend, token_id) or ""
        self.text += piece
        return piece


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that the last ``new_len`` characters completed, and where it starts."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best
