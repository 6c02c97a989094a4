"""Dataset files read as their authors wrote them: CSV/TSV quoting as Excel, pandas and the csv
module write it, a malformed quote an error naming its lines rather than a prompt that differs
from the file's text."""

import csv
import json
from types import SimpleNamespace

import pytest

from pagedlab.lab.datasets import load_dataset
from pagedlab.lab.metrics import METRICS, RunResult
from pagedlab.lab.schema import ExperimentError


def records(path, **conf):
    items = load_dataset({"path": str(path), "prompt_field": "q", "reference_field": "a", **conf}, None,
                         lambda key: f"dataset.{key}").items
    return [(it.prompt, it.reference) for it in items]


@pytest.mark.parametrize("fmt", ["tsv", "csv"])
def test_quoted_fields_read_as_the_csv_module_writes_them(tmp_path, fmt):
    """Prompts with quote marks anywhere, tabs, commas and line breaks, written by csv.writer (as
    pandas' to_csv and Excel write them), read back to the same text; a quote mark inside an
    unquoted field is text."""
    prompts = ['"To be" or not', 'say "hi" now', '"quoted whole"', 'a\ttab, a comma', 'two\nlines', '"']
    path = tmp_path / f"q.{fmt}"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter="\t" if fmt == "tsv" else ",")
        writer.writerows([["q", "a"], *[[p, f"ref {i}"] for i, p in enumerate(prompts)]])
    assert records(path) == [(p, [f"ref {i}"]) for i, p in enumerate(prompts)]
    path.write_text('q\ta\nsay "hi" now\tit is 5" long\n' if fmt == "tsv" else 'q,a\nsay "hi" now,5" long\n')
    assert records(path)[0][0] == 'say "hi" now'


def test_a_malformed_quote_is_an_error_naming_its_lines(tmp_path):
    """A field that opens a quote and does not close it would take in the rows after it (three
    records read as one prompt, tabs, line breaks and all, without a reference), and text after
    a closing quote mark would lose the quote marks ('"To be" or not' read as 'To be or not'):
    both are errors naming the file, the lines and the quoting rule."""
    path = tmp_path / "q.tsv"
    path.write_text('q\ta\nfine\t1\n"He said, hi\tx\nsecond\ty\nthird\tz\n')
    with pytest.raises(ExperimentError, match=r'^dataset q.tsv lines 3-5: a quoted field is not closed.*'
                                              r'write """To be"" or not"'):
        records(path)
    path.write_text('q\ta\nfine\t1\n\n"To be" or not\tHamlet\n')
    with pytest.raises(ExperimentError, match=r"^dataset q.tsv line 4: a quoted field is not closed, or "
                                              r"text follows its closing quote mark"):
        records(path)
    path.write_text('q,a\n"To be" or not,Hamlet\n')
    with pytest.raises(ExperimentError, match=r"^dataset q.tsv line 2: a quoted field"):
        records(path, format="csv")


def test_a_blank_entry_in_a_list_of_references_is_no_reference(tmp_path):
    """A blank string is no reference in a list either, as alone (docs/lab.md): kept, it counted an
    empty output as an exact match and a contained answer, and sacrebleu (which drops None, not "")
    took its length 0 as the closest reference length, so a short output escaped the brevity
    penalty (BLEU 100 for 8 of 17 words). A list of blanks gives no reference."""
    sacrebleu = pytest.importorskip("sacrebleu")
    long_ref = "the quick brown fox jumps over the lazy dog and then runs far away into the woods"
    rows = [{"q": "capital", "a": ["", "Paris"]}, {"q": "blank", "a": ["  ", ""]},
            {"q": "fox", "a": ["", long_ref]}]
    path = tmp_path / "refs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_dataset({"path": str(path), "prompt_field": "q", "reference_field": "a"}, None,
                         lambda key: f"dataset.{key}").items
    assert [it.reference for it in items] == [["Paris"], None, [long_ref]]

    def result(texts, chosen):
        outputs = [SimpleNamespace(outputs=[SimpleNamespace(text=t)]) for t in texts]
        return RunResult(outputs, chosen, 1.0, None)

    silent = result(["", ""], items[:2])
    assert METRICS["exact_match"].fn(silent) == {"exact_match": 0.0}
    assert METRICS["contains_answer"].fn(silent) == {"contains_answer": 0.0}
    short = "the quick brown fox jumps over the lazy"
    bleu = METRICS["bleu"].fn(result([short], items[2:]))["bleu"]
    assert bleu == pytest.approx(sacrebleu.corpus_bleu([short], [[long_ref]]).score)
    assert bleu < 50  # the brevity penalty: 8 words against 17


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_a_row_with_fewer_fields_than_the_header_is_an_error(tmp_path, fmt):
    """A short row was read with its missing reference as "no reference" (as csv.DictReader and
    pandas fill it), so it silently left exact match and BLEU; it is an error naming the file,
    the line and the fields expected and found, as a long row is. An empty last field written
    with its delimiter (``empty,``) is present and empty: no reference, and no error."""
    sep = "," if fmt == "csv" else "\t"
    path = tmp_path / f"s.{fmt}"
    path.write_text(f"q{sep}a{sep}n\nhello{sep}world{sep}1\n\nshort{sep}x\n")
    with pytest.raises(ExperimentError, match=rf"^dataset s.{fmt} line 4: 2 fields where the header has 3 "
                                              rf"\(q, a, n\)"):
        records(path)
    path.write_text(f"q{sep}a\nhello{sep}world\nshort\n")
    with pytest.raises(ExperimentError, match=rf"^dataset s.{fmt} line 3: 1 field where the header has 2"):
        records(path)
    path.write_text(f"q{sep}a\nhello{sep}world\nempty{sep}\n")
    assert records(path) == [("hello", ["world"]), ("empty", None)]
    path.write_text(f"q{sep}a\nhello{sep}world{sep}x\n")
    with pytest.raises(ExperimentError, match=rf"^dataset s.{fmt} line 2: 3 fields where the header has 2"):
        records(path)


def test_a_number_reference_is_the_text_of_its_value(tmp_path):
    """A JSON number reference 1.0 was the text "1.0" (Python's str), which SQuAD's normalization
    turns into "10", so the output "1" missed it; a number is its value's text, a whole one
    without a fraction (JSON's 1.0 and 1e3 are 1 and 1000), others as Python writes them; a
    string is kept as written, and a CSV cell is text."""
    path = tmp_path / "n.jsonl"
    rows = ['{"q": "one", "a": 1.0}', '{"q": "two", "a": 2}', '{"q": "more", "a": [0.5, 2.50, 1e3, "1.0"]}']
    path.write_text("\n".join(rows) + "\n")
    assert records(path) == [("one", ["1"]), ("two", ["2"]), ("more", ["0.5", "2.5", "1000", "1.0"])]
    outputs = [SimpleNamespace(outputs=[SimpleNamespace(text=t)]) for t in ("1", "2")]
    items = load_dataset({"path": str(path), "prompt_field": "q", "reference_field": "a", "limit": 2}, None,
                         lambda key: f"dataset.{key}").items
    assert METRICS["exact_match"].fn(RunResult(outputs, items, 1.0, None)) == {"exact_match": 1.0}
    table = tmp_path / "n.csv"
    table.write_text("q,a\none,1.0\n")
    assert records(table) == [("one", ["1.0"])]
