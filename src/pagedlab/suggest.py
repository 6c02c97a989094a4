"""Did-you-mean for misspelled names: one wording for ``LLM(...)``'s keywords, the command line's
flags and the lab's YAML keys."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` most likely misspells, or None when none is close."""
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return matches[0] if matches else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'max_num_seqs'?"`` for a close known name, else ``""``."""
    match = closest_name(name, known)
    return f"; did you mean {match!r}?" if match else ""


def unknown_argument_message(name: str, known: Iterable[str], takes: str = "") -> str:
    """"unknown argument 'max_num_seq'; did you mean 'max_num_seqs'?" when a known name is close,
    else "unknown argument 'x': <takes> [the known names]"."""
    known = list(known)
    hint = did_you_mean(name, known)
    if hint:
        return f"unknown argument {name!r}{hint}"
    return f"unknown argument {name!r}: {takes or 'known arguments are'} {known}"
