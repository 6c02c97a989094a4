"""The server's limits as a plain record (no web framework needed to read the CLI's defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerLimits:
    """What one request may ask for and how many may wait, so no client can hold the engine.

    ``max_waiting_requests``: sequences (each prompt's ``n`` completions) admitted but not yet
    running, beyond which a request is answered 503 with ``Retry-After`` (None: unbounded).
    ``max_sequences_per_request``: prompts x ``n`` of one request. ``max_tokens_per_request``: the
    tokens one request may occupy at most, prompt and completion of every sequence.
    ``max_request_body_bytes``: a bigger body is answered 413.
    """

    max_waiting_requests: int | None = None
    max_sequences_per_request: int = 1024
    max_tokens_per_request: int = 1 << 22
    max_request_body_bytes: int = 32 << 20
