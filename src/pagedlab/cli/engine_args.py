"""The engine's command-line flags, derived from ``EngineConfig``: one flag per field, with the
field's default and help text, under vLLM's flag names (``--max-num-seqs``, ...).

A leaf module: every command that loads a model (``generate``, ``serve``, ``bench``, ``repro``,
``run``) imports it, and it imports nothing of theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from pagedlab.config import ENGINE_FIELDS, EngineConfig


def parse_bytes(value: str) -> int:
    """"1073741824", "1GiB", "512MiB", "2G", "100M"."""
    text = value.strip().lower().removesuffix("b").removesuffix("i")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(text[-1:], 1)
    try:
        number = float(text[:-1] if scale != 1 else text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a byte count (e.g. 1073741824, 512MiB, 2GiB)") from None
    return int(number * scale)


def _value_type(field: dataclasses.Field):
    """The argparse ``type`` of a field: the non-None member of its annotation (``str`` for dtype)."""
    hints = typing.get_type_hints(EngineConfig)
    kinds = [t for t in typing.get_args(hints[field.name]) if t is not type(None)] or [hints[field.name]]
    if field.name.endswith("_bytes"):
        return parse_bytes
    return kinds[0] if kinds[0] in (int, float, bool) else str


def _describe(field: dataclasses.Field) -> str:
    """The field's help; a None default is explained there, the others are shown."""
    default = field.default
    if default is None:
        return field.metadata["help"]
    shown = "on" if default is True else "off" if default is False else default
    return f"{field.metadata['help']} (default: {shown})"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every ``EngineConfig`` field as a flag; booleans get ``--x`` / ``--no-x``."""
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = _value_type(field)
        if kind is bool:
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                               default=field.default, help=_describe(field))
        else:
            group.add_argument(flag, dest=field.name, type=kind, default=field.default, help=_describe(field))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings among parsed ``args``: ``LLM(**engine_kwargs(args))``."""
    return {name: getattr(args, name) for name in ENGINE_FIELDS if hasattr(args, name)}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**engine_kwargs(args))


def changed_engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings whose flags were given a value other than the default."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in engine_kwargs(args).items() if v != defaults[k]}


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")

