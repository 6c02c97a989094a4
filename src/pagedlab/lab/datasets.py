"""The prompts of a dataset workload: records from a JSONL/CSV/TSV/JSON file or an inline list,
turned into prompts (text after the template, or token ids) and references, with a content hash
that identifies the data in the results database."""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedlab.lab.schema import ExperimentError

FORMATS = {"jsonl": "jsonl", "ndjson": "jsonl", "csv": "csv", "tsv": "tsv", "json": "json"}

# A CSV/TSV quoting error, with the rule of Excel, pandas and the csv module.
QUOTING = ("a quoted field is not closed, or text follows its closing quote mark: a field that starts with a "
           "quote mark is quoted, ends at the next lone quote mark and holds a quote mark doubled (write "
           '"""To be"" or not" for the text "To be" or not)')
# DictReader's value for the cells a row lacks (a row's own cells are strings, never this)
_MISSING = object()
# ``where(key)`` gives ``file:line: dataset.key`` for an error about a dataset setting.
Where = Callable[[str], str]


@dataclass
class DatasetItem:
    """One prompt: its text (after the template) or its token ids, and its references."""

    prompt: str | None
    prompt_token_ids: list[int] | None
    reference: list[str] | None


@dataclass
class Dataset:
    """The prompts of a run, whether they go through the chat template, and their identity."""

    items: list[DatasetItem]
    chat: bool
    system: str | None
    sha256: str
    source: str

    @property
    def has_references(self) -> bool:
        return any(it.reference for it in self.items)


def load_dataset(conf: dict, base_dir: Path | None, where: Where) -> Dataset:
    """The dataset of a ``dataset:`` section (``conf``); relative paths resolve against ``base_dir``."""
    _check_settings(conf, where)
    records, source = (_read_records(conf, base_dir, where) if "path" in conf
                       else (_inline_records(conf["prompts"], where), "inline"))
    if conf.get("limit"):
        records = records[:conf["limit"]]
    if not records:
        raise ExperimentError(f"{where('path')}: the dataset has no records")
    chat = conf.get("chat", False)
    items = [_item(rec, f"{source} {loc}", conf, where) for loc, rec in records]
    if chat:
        for (loc, _), it in zip(records, items):
            if it.prompt is None:
                raise ExperimentError(f"{where('chat')}: chat prompts are messages of text; {source} {loc} "
                                      "has "
                                      "token ids")
    canonical = json.dumps([[it.prompt, it.prompt_token_ids, it.reference] for it in items]
                           + [chat, conf.get("system")], sort_keys=True)
    return Dataset(items, chat, conf.get("system"), hashlib.sha256(canonical.encode()).hexdigest(), source)


def _check_settings(conf: dict, where: Where) -> None:
    for key in ("prompt_field", "reference_field", "template", "system", "format"):
        if conf.get(key) is not None and not isinstance(conf[key], str):
            raise ExperimentError(f"{where(key)}: {key} must be a string")
    limit = conf.get("limit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ExperimentError(f"{where('limit')}: limit={limit!r} is invalid: give an integer >= 1")
    if not isinstance(conf.get("chat", False), bool):
        raise ExperimentError(f"{where('chat')}: chat must be true or false")


def _inline_records(prompts, where: Where) -> list[tuple[str, dict]]:
    if not isinstance(prompts, list) or not prompts:
        raise ExperimentError(f"{where('prompts')}: must be a non-empty list of strings, token-id lists "
                              "or mappings {prompt: ..., reference: ...}")
    records = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            records.append((f"prompts[{i}]", {"prompt": p}))
        elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            records.append((f"prompts[{i}]", {"prompt_token_ids": p}))
        elif isinstance(p, dict):
            records.append((f"prompts[{i}]", p))
        else:
            raise ExperimentError(f"{where('prompts')}[{i}]: {p!r} is not a prompt: give a string, a list of "
                                  "token ids or a mapping {prompt: ..., reference: ...}")
    return records


def _item(rec, loc: str, conf: dict, where: Where) -> DatasetItem:
    """The prompt and references of one record (``loc`` names it in errors)."""
    if not isinstance(rec, dict):
        raise ExperimentError(f"{loc}: a record must be an object/row of fields, not {rec!r}")
    ids = rec.get("prompt_token_ids")
    if ids is not None:
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
            raise ExperimentError(f"{loc}: prompt_token_ids must be a non-empty list of integers")
        return DatasetItem(None, list(ids), _references(rec, loc, conf, where))
    return DatasetItem(_prompt_text(rec, loc, conf, where), None, _references(rec, loc, conf, where))


def _prompt_text(rec: dict, loc: str, conf: dict, where: Where) -> str:
    template = conf.get("template")
    if template is not None:
        try:
            return template.format(**rec)
        except KeyError as e:
            raise ExperimentError(f"{where('template')}: the template uses field {e.args[0]!r}, which "
                                  f"{loc} lacks; its fields are {sorted(rec)}") from None
        except (IndexError, ValueError) as e:
            raise ExperimentError(f"{where('template')}: the template is not a valid format string: {e}") \
                from None
        except (AttributeError, TypeError) as e:  # {field.name} or {field[key]} on a value without it
            raise ExperimentError(f"{where('template')}: the template cannot format {loc}: {e}") from None
    prompt_field = conf.get("prompt_field", "prompt")
    if prompt_field not in rec:
        raise ExperimentError(f"{where('prompt_field')}: {loc} has no field {prompt_field!r}; its fields are "
                              f"{sorted(rec)} (set dataset.prompt_field or dataset.template)")
    text = rec[prompt_field]
    if not isinstance(text, str):
        raise ExperimentError(f"{loc}: field {prompt_field!r} must be a string, not {text!r}")
    return text


def _references(rec: dict, loc: str, conf: dict, where: Where) -> list[str] | None:
    key = conf.get("reference_field") or ("reference" if "reference" in rec else None)
    if key is None:
        return None
    if key not in rec:
        raise ExperimentError(f"{where('reference_field')}: {loc} has no field {key!r}; its fields are "
                              f"{sorted(rec)}")
    raw = rec[key]
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None  # a CSV row's empty cell (or a blank string) gives no reference
    values = raw if isinstance(raw, list) else [raw]
    bad = [v for v in values if not isinstance(v, (str, int, float))]
    if bad:
        raise ExperimentError(f"{loc}: reference field {key!r} must be a string, a number or a list of them; "
                              f"{bad[0]!r} in {raw!r} is not")
    # a blank entry of a list is no reference either (all blank: none): scored as one, it matched an
    # empty output in exact_match and gave BLEU a reference of length 0, so no brevity penalty
    refs = [_reference_text(v) for v in values if not (isinstance(v, str) and not v.strip())]
    return refs if refs or not values else None


def _reference_text(value: str | int | float) -> str:
    """A reference as text: a number as its value is written, an integral one without a fraction.
    JSON and YAML numbers have no type beyond their value (``1.0`` is ``1``), and a model answers
    "1": as Python's ``str`` the reference was "1.0", which SQuAD's normalization turns into "10"
    (the point is punctuation), so exact match missed it. Write a string to keep other text."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _read_records(conf: dict, base_dir: Path | None, where: Where) -> tuple[list[tuple[str, dict]], str]:
    raw = conf["path"]
    if not isinstance(raw, str) or not raw:
        raise ExperimentError(f"{where('path')}: must be a file path")
    p = Path(raw).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    if not p.is_file():
        raise ExperimentError(f"{where('path')}: dataset file {raw!r} does not exist (looked for "
                              f"{p.resolve()})")
    fmt = FORMATS.get((conf.get("format") or p.suffix.lstrip(".")).lower())
    if fmt is None:
        raise ExperimentError(f"{where('format' if conf.get('format') else 'path')}: unknown dataset format "
                              "for "
                              f"{p.name}: give dataset.format: jsonl, csv, tsv or json")
    readers = {"jsonl": _read_jsonl, "csv": _read_delimited, "tsv": _read_delimited, "json": _read_json}
    try:
        return readers[fmt](p, fmt), f"dataset {p.name}"
    except UnicodeDecodeError as e:
        raise ExperimentError(f"dataset {p.name}: not UTF-8 text ({e})") from None


def _read_jsonl(p: Path, fmt: str) -> list[tuple[str, dict]]:
    records = []
    with open(p, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ExperimentError(f"dataset {p.name}:{lineno}: not valid JSON ({e.msg})") from None
            records.append((f"line {lineno}", {"prompt": rec} if isinstance(rec, str) else rec))
    return records


def _read_delimited(p: Path, fmt: str) -> list[tuple[str, dict]]:
    with open(p, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f, delimiter="," if fmt == "csv" else "\t", strict=True, restval=_MISSING)
        records = []
        for row in _quoted_rows(reader, p.name):
            rowno = reader.line_num  # the row's last line: blank lines and quoted line breaks count
            _check_width(row, len(reader.fieldnames), f"dataset {p.name} line {rowno}", fmt)
            records.append((f"line {rowno}", row))
        return records


def _check_width(row: dict, width: int, loc: str, fmt: str) -> None:
    """A row must have as many fields as the header. One with more (an unquoted delimiter) and one
    with fewer are errors: ``csv.DictReader`` (as pandas) fills the cells a short row lacks (here
    with ``_MISSING``), which read as "no reference" and left the row out of the scores. An empty
    last field written ``a,b,`` is there, and empty."""
    delimiter = "comma" if fmt == "csv" else "tab"
    if None in row:  # DictReader's key for the cells past the header's
        raise ExperimentError(f"{loc}: {width + len(row[None])} fields where the header has {width} "
                              f"(quote a field that holds a {delimiter})")
    missing = sum(value is _MISSING for value in row.values())
    if missing:
        found = width - missing
        raise ExperimentError(f"{loc}: {found} field{'s' if found != 1 else ''} where the header has {width} "
                              f"({', '.join(row)}): write an empty last field as a trailing {delimiter}")


def _quoted_rows(reader: csv.DictReader, name: str):
    """The rows of a strict ``reader``, quoted as Excel, pandas and the csv module write them. A
    quoted field left open or followed by text is an error naming its lines, where a lenient reader
    read the rest of the file into one prompt or dropped the quote marks from the text."""
    try:
        yield from reader
    except csv.Error as e:  # the bad row starts past the last row read and ends where the parser stopped
        first, last = reader.line_num + 1, reader.reader.line_num
        lines = f"line {first}" if last <= first else f"lines {first}-{last}"
        quoting = '"' in str(e) or "end of data" in str(e)  # not, say, a field over csv's size limit
        raise ExperimentError(f"dataset {name} {lines}: {QUOTING if quoting else e}") from None


def _read_json(p: Path, fmt: str) -> list[tuple[str, dict]]:
    try:
        data = json.loads(p.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise ExperimentError(f"dataset {p.name}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, list):
        raise ExperimentError(f"dataset {p.name}: a JSON dataset is a list of records")
    return [(f"record {i}", {"prompt": r} if isinstance(r, str) else r) for i, r in enumerate(data)]
