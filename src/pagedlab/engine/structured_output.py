"""Structured outputs: a grammar per request, compiled by xgrammar, and a token bitmask per step.

A request with ``SamplingParams.structured_outputs`` gets a ``RequestGrammar`` (an xgrammar
matcher over its compiled grammar). The output processor feeds it every token the request
keeps; before a step samples, each grammar row of the batch fills one row of a packed bitmask
(32 token ids per int32 word), which the sampler unpacks on the device and applies to the logits.
With asynchronous scheduling the runner queues the forward pass first and fills the bitmask while
the device computes it; the sampler is queued after the host has prepared the next step, so the
device does not sit idle while it does (see ``ModelRunner.finish_sampling``). With speculative
decoding a request samples several rows a step: each row after proposed tokens gets the bitmask
of the grammar moved past them (``RequestGrammar.fill_after``). Requests without a grammar pay
nothing.

xgrammar is imported on the first structured request; without it such a request is a ValueError
naming the package, and nothing else changes.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence

import torch

from pagedlab.layers.sampler import BITS_PER_WORD
from pagedlab.sampling_params import StructuredOutputsParams

INSTALL_HINT = ("structured outputs need the xgrammar package, which is not installed: "
                "pip install 'pagedlab[structured]' (or pip install xgrammar)")


def import_xgrammar():
    """The xgrammar module, or a ValueError saying how to install it."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} ({e})") from None
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def is_lark(grammar: str) -> bool:
    """vLLM's rule for which syntax a grammar is in: EBNF if a line (comments, ``#`` or ``//``,
    aside) defines a rule with ``::=``, else Lark."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.splitlines())


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and vocabulary (xgrammar caches
    compiled grammars, so the same schema compiles once). Thread-safe, so a server may compile
    off the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        # The grammar's vocabulary is the tokenizer's: ids past it (a model's padded embedding rows)
        # are never text, so the bitmask leaves them out (the sampler bans them). Telling xgrammar
        # about them instead costs ~15x in every mask fill (measured with 100k padded ids).
        self.vocab_size = vocab_size if tokenizer is None else min(vocab_size, len(tokenizer))
        self.stop_token_ids = [t for t in stop_token_ids if t < self.vocab_size]
        self.bitmask_filler = BitmaskFiller(self.vocab_size)
        self._compiler = None
        self._lock = threading.Lock()

    def _xgrammar_compiler(self):
        xgr = import_xgrammar()
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer, and this model has none")
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of ``spec``; a schema, regex or grammar xgrammar rejects is a
        ValueError naming the field."""
        compiler = self._xgrammar_compiler()
        kind = spec.kind
        if kind == "json":
            unenforced = unenforced_schema_keyword(spec.json)
            if unenforced is not None:
                raise ValueError(f"json={_shown(spec.json)} is invalid: xgrammar cannot enforce "
                                 f"{unenforced}, so outputs could break the schema; leave that keyword out")
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace)
            if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                return compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=not spec.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            if is_lark(spec.grammar):
                return compiler.compile_lark(spec.grammar)
            return compiler.compile_grammar(spec.grammar)
        except Exception as e:  # xgrammar raises RuntimeError / its own errors for bad input
            raise ValueError(f"{kind}={_shown(getattr(spec, kind))} is invalid: xgrammar could not compile "
                             f"it: {_first_line(e)}") from None

    def matcher(self, spec: StructuredOutputsParams, stop_token_ids: Sequence[int] = ()) -> RequestGrammar:
        """A fresh matcher for one request (each of ``n`` completions gets its own), whose own
        ``stop_token_ids`` may end it only where the grammar is complete (see ``RequestGrammar``)."""
        xgr = import_xgrammar()
        extra = tuple(t for t in dict.fromkeys(stop_token_ids)
                      if t < self.vocab_size and t not in self.stop_token_ids)
        return RequestGrammar(xgr.GrammarMatcher(self.compile(spec)), self.bitmask_filler, extra)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


# The string formats xgrammar enforces (those vLLM's xgrammar backend lets through).
ENFORCED_STRING_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})


def unenforced_schema_keyword(schema: dict | str) -> str | None:
    """Where a JSON schema uses a keyword xgrammar compiles without enforcing it (``'multipleOf' at
    /properties/price``), so a completion could break the schema; None if it has none. These are
    the schemas vLLM's xgrammar backend refuses (``has_xgrammar_unsupported_json_features``), save
    an integer's integral ``multipleOf``, which xgrammar enforces. A string that is not JSON is
    left to xgrammar's own error."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None
    stack = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}/{i}") for i, item in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, dict):
            continue
        keyword = _unenforced_keyword(node)
        if keyword is not None:
            return f"{keyword!r} at {path or '/'}"
        stack.extend((value, f"{path}/{key}") for key, value in reversed(node.items())
                     if isinstance(value, (dict, list)))
    return None


def _unenforced_keyword(node: dict) -> str | None:
    """The keyword of one schema node (its subschemas aside) that xgrammar does not enforce."""
    declared = node.get("type")
    declared = declared if isinstance(declared, list) else [declared]
    types = {t for t in declared if isinstance(t, str)}
    step = node.get("multipleOf")
    if "multipleOf" in node and types & {"integer", "number"} and not (
            types == {"integer"} and isinstance(step, (int, float)) and float(step).is_integer()):
        return "multipleOf"
    if "array" in types:
        for keyword in ("uniqueItems", "contains", "minContains", "maxContains"):
            if keyword in node:
                return keyword
    if "string" in types:
        if "format" in node and node["format"] not in ENFORCED_STRING_FORMATS:
            return "format"
        bound = _length_bound_beside_pattern(node)
        if bound is not None:
            return bound
    if "object" in types:
        names, patterns = node.get("propertyNames"), node.get("patternProperties")
        if "propertyNames" in node and (
                (isinstance(names, dict) and _length_bound_beside_pattern(names) is not None)
                or "properties" in node or "patternProperties" in node
                or isinstance(node.get("additionalProperties"), dict)
                or node.get("unevaluatedProperties", True) is not True):
            return "propertyNames"
        if isinstance(patterns, dict) and ("properties" in node or len(patterns) > 1):
            return "patternProperties"
    return None


def _length_bound_beside_pattern(node: dict) -> str | None:
    """minLength / maxLength beside a pattern or format: xgrammar keeps the pattern, drops the bound."""
    if "pattern" not in node and "format" not in node:
        return None
    return next((k for k in ("minLength", "maxLength") if k in node), None)


def _first_line(error: Exception) -> str:
    """An xgrammar error's message without its C++ time and source-location prefix."""
    lines = str(error).strip().splitlines()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(error).__name__


class RequestGrammar:
    """One request's place in its grammar, and the engine's filler of its bitmask rows.

    ``stop_token_ids``: the request's stop ids beyond the model's (which xgrammar knows). As in
    vLLM, they are masked until the grammar is complete and allowed from then on: one that is also
    text the grammar allows (a digit, say) would otherwise end the completion mid-sentence."""

    def __init__(self, matcher, bitmask_filler: BitmaskFiller, stop_token_ids: tuple[int, ...] = ()):
        self.matcher = matcher
        self.bitmask_filler = bitmask_filler
        self.stop_token_ids = stop_token_ids

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (or has ended)."""
        if token_id in self.stop_token_ids and self.matcher.is_completed():
            return True  # the request stops here
        return not self.matcher.is_terminated() and self.matcher.accept_token(token_id)

    def mask_stop_token_ids(self, row: torch.Tensor) -> None:
        """Set the bits of ``stop_token_ids`` in this grammar's bitmask ``row`` where the grammar is
        complete, clear them where it is not."""
        allow = self.matcher.is_completed()
        for token_id in self.stop_token_ids:
            word, bit = divmod(token_id, BITS_PER_WORD)
            flag = 1 << bit if bit < BITS_PER_WORD - 1 else -(1 << bit)  # bit 31 is int32's sign
            row[word] = row[word] | flag if allow else row[word] & ~flag

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_after(self, proposed: list[int], bitmask: torch.Tensor, index: int) -> None:
        """Fill ``bitmask[index]`` for the position after ``proposed`` (speculative decoding's
        tokens before a sampled row) and leave the matcher where it was. The matcher moves past
        them as ``accept`` moves it when the output processor keeps them (a refused token, sampled
        where every token was banned, leaves it in place; a stop id on a complete grammar does
        too), so the row gets the mask plain decoding would give it; a terminated grammar's rows
        are unmasked, as ``_grammar_bitmask`` leaves them."""
        advanced = 0
        for token in proposed:
            stays = token in self.stop_token_ids and self.matcher.is_completed()
            advanced += self.accept(token) and not stays
        if self.matcher.is_terminated():
            bitmask[index].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, index)
            if self.stop_token_ids:
                self.mask_stop_token_ids(bitmask[index])
        self.matcher.rollback(advanced)


class BitmaskFiller:
    """Fills the bitmask rows of a step's grammars, together on xgrammar's threads, into one host
    buffer reused from step to step (allocating it anew cost 0.65 ms a step on the H200's host for
    128 rows). Each call overwrites every word of the rows it returns; the caller copies them off
    before the next call."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._buffer: torch.Tensor | None = None
        self._batch_matcher = None

    def fill(self, grammars: list[RequestGrammar], proposed: list[list[int]] | None = None) -> torch.Tensor:
        """``proposed[i]``: the tokens before row i (speculative decoding), which its grammar reads
        as accepted (``RequestGrammar.fill_after``)."""
        xgr = import_xgrammar()
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
        rows = len(grammars)
        if self._buffer is None or self._buffer.shape[0] < rows:
            self._buffer = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        bitmask = self._buffer[:rows]
        proposed = proposed or [None] * rows
        # each matcher once in the threaded fill (a request's later rows share its matcher), the
        # rows after proposed tokens one by one: the matcher moves past them and back
        now = [i for i in range(rows) if not proposed[i]]
        self._batch_matcher.batch_fill_next_token_bitmask([grammars[i].matcher for i in now], bitmask, now)
        for i in range(rows):
            if proposed[i]:
                grammars[i].fill_after(proposed[i], bitmask, i)
            elif grammars[i].stop_token_ids:
                grammars[i].mask_stop_token_ids(bitmask[i])
        return bitmask


def grammar_bitmask(grammars: list[RequestGrammar], proposed: list[list[int]] | None = None) -> torch.Tensor:
    """``[len(grammars), ceil(vocab/32)]`` int32 on the host, ``vocab`` the grammars' (the
    tokenizer's): bit ``t % 32`` of word ``t // 32`` of row i says whether token t may come next
    for ``grammars[i]`` (``apply_token_bitmask``, which bans ids past the width). Valid until the
    next call (see ``BitmaskFiller``). ``proposed``: see ``BitmaskFiller.fill``."""
    return grammars[0].bitmask_filler.fill(grammars, proposed)
