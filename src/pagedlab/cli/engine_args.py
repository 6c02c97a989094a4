"""The engine's command-line flags, derived from ``EngineConfig``: one flag per field, with the
field's default and help text, under vLLM's flag names (``--max-num-seqs``, ...); and
``CommandParser``, the argument parser of every ``pagedlab`` command; and vLLM's names for them,
``EngineArgs`` and ``FlexibleArgumentParser``, which vLLM's scripts build their parsers with.

A leaf module: every command that loads a model (``generate``, ``serve``, ``bench``, ``repro``,
``run``) imports it, and it imports nothing of theirs (nor torch: ``--help`` answers at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys

from pagedlab.config import ENGINE_FIELDS, EngineConfig


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without abbreviations: ``--max-num-seq`` is an error, not a
    silent ``--max-num-seqs``. Subcommand parsers are of the same class, so the whole tree is."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)


class FlexibleArgumentParser(CommandParser):
    """vLLM's ``FlexibleArgumentParser``: a flag's name may be spelt with underscores too
    (``--max_model_len=128`` is ``--max-model-len=128``)."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(arg) for arg in args], namespace)


def _dashed(arg: str) -> str:
    """``--a_b=c_d`` as ``--a-b=c_d``: underscores of a flag's name only, never of its value."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value


# byte units: binary (KiB..TiB, and K..T alone), decimal (KB..TB), as the units say
_BYTE_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10 ** 3, "mb": 10 ** 6,
               "gb": 10 ** 9, "tb": 10 ** 12, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "b": 1}


def parse_bytes(value: str) -> int:
    """A byte count: "1073741824", "512MiB", "2GiB" or "2G" (binary), "80GB" (decimal)."""
    text = value.strip().lower()
    unit = next((u for u in _BYTE_UNITS if text.endswith(u)), "")
    try:
        number = float(text[:len(text) - len(unit)])
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value!r} is not a byte count (e.g. 1073741824, 512MiB, 2GiB, "
                                         "80GB)")
    return int(number * _BYTE_UNITS.get(unit, 1))


_DECIMAL_SUFFIXES = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
_BINARY_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def human_readable_int(value: str) -> int:
    """A token count as vLLM's ``--max-model-len`` and ``--max-num-batched-tokens`` read it:
    "4096", "4k" or "25.6k" (decimal, lower case: 4000, 25600), "4K" (binary, upper case, whole
    numbers only: 4096)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value.strip())
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number (e.g. 4096, 4k = 4000, "
                                             "4K = 4096)") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: a binary suffix ({suffix}) takes a whole number; "
                                         f"did you mean {number}{suffix.lower()}?")
    return int(number) * _BINARY_SUFFIXES[suffix]


def positive_int(value: str) -> int:
    """A count or a length: a whole number >= 1."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 1")
    return number


def fraction(value: str) -> float:
    """A share of something: a number in (0, 1]."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number in (0, 1]")
    return number


def non_negative(value: str) -> float:
    """A tolerance or a threshold: a number >= 0 (inf: no limit). NaN is refused: every comparison
    with it is false, so a check compared against it could never fail."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number >= 0")
    return number


def check_writable(path: str, flag: str) -> None:
    """A ValueError, before any work, where the results could not be written to ``path`` (the value
    of ``flag``). A missing folder is made, as ``pagedlab results export`` makes it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory: give a file name")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: its folder {folder} cannot be made ({e.strerror})") from None
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: {folder} is not a writable directory")


def json_object(value: str) -> dict:
    """A JSON object given on the command line: '{"temperature": 0.5}'."""
    try:
        data = json.loads(value)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON object (e.g. '{{\"temperature\": 0.5}}')")
    return data


def _value_type(field: dataclasses.Field):
    """The argparse ``type`` of a field: the first non-None member of its annotation, read from
    the annotation's text (evaluating it would import torch for ``dtype``)."""
    if field.name.endswith("_bytes"):
        return parse_bytes
    if field.name in ("max_model_len", "max_num_batched_tokens"):  # vLLM's human-readable token counts
        return human_readable_int
    kinds = [k.strip() for k in str(field.type).split("|") if k.strip() != "None"]
    return {"int": int, "float": float, "bool": bool, "dict": json_object}.get(kinds[0], str)


def _describe(field: dataclasses.Field) -> str:
    """The field's help; a None default is explained there, the others are shown."""
    default = field.default
    if default is None:
        return field.metadata["help"]
    shown = "on" if default is True else "off" if default is False else default
    return f"{field.metadata['help']} (default: {shown})"


_GIVEN = "engine_flags_given"  # the Namespace attribute naming the engine flags given


def _note_given(namespace: argparse.Namespace, dest: str) -> None:
    setattr(namespace, _GIVEN, {*getattr(namespace, _GIVEN, ()), dest})


class _GivenValue(argparse.Action):
    """Stores the flag's value, as argparse's default action, and notes that the flag was given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _note_given(namespace, self.dest)


class _GivenBoolean(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x``, noting that the flag was given."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


def add_engine_args(parser: argparse.ArgumentParser, model_default: str | None = None,
                    model_help: str | None = None) -> None:
    """Add every ``EngineConfig`` field as a flag, in an "engine" group, noting which flags were
    given (``given_engine_kwargs``). A command whose model default differs from the engine's
    (``bench``: a benchmark shape) gives ``model_default`` and ``model_help``."""
    _add_field_flags(parser.add_argument_group("engine"), _GivenValue, _GivenBoolean,
                     {"model": (model_default, model_help)} if model_help is not None else {})


def _add_field_flags(container, value_action, boolean_action, overrides: dict) -> None:
    """One flag per ``EngineConfig`` field on ``container`` (a parser or a group); booleans get
    ``--x`` / ``--no-x``; ``overrides`` maps a field to its own (default, help)."""
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = _value_type(field)
        default, help_text = overrides.get(field.name, (field.default, _describe(field)))
        if kind is bool:
            container.add_argument(flag, dest=field.name, action=boolean_action, default=default,
                                   help=help_text)
        else:
            many = {"nargs": "+"} if "list[" in str(field.type) else {}
            container.add_argument(flag, dest=field.name, action=value_action, type=kind, default=default,
                                   help=help_text, **many)


class EngineArgs(EngineConfig):
    """vLLM's ``EngineArgs``: the engine settings (an ``EngineConfig``), with the command-line
    flags vLLM's scripts parse them from; ``LLMEngine.from_engine_args`` builds an engine of them."""

    @staticmethod
    def add_cli_args(parser):
        """Add every engine flag to ``parser`` (a parser or one of its groups) and return it; the
        parsed namespace holds only field names, so ``LLM(**vars(args))`` takes it."""
        _add_field_flags(parser, "store", argparse.BooleanOptionalAction, {})
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine settings among parsed ``args``."""
        return cls(**engine_kwargs(args))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings among parsed ``args``: ``LLM(**engine_kwargs(args))``."""
    return {name: getattr(args, name) for name in ENGINE_FIELDS if hasattr(args, name)}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**engine_kwargs(args))


def given_engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings whose flags were given on the command line, a value equal to the
    engine's default included: a command with defaults of its own (``bench``: bfloat16, a
    ``max_num_seqs`` of the batch size) must still take ``--dtype auto`` or ``--max-num-seqs 256``."""
    given = getattr(args, _GIVEN, ())
    return {k: v for k, v in engine_kwargs(args).items() if k in given}


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")

