"""YAML experiments: validation errors that name the line and key, run expansion, the pipeline
end to end with weights loaded once, resuming, failures that fail alone, and kill -9 mid-run."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("yaml")
pytest.importorskip("sqlalchemy")
pytest.importorskip("sacrebleu")

from pagedlab import LLM
from pagedlab.lab import cli as lab_cli
from pagedlab.lab.experiments import ExperimentError, expand_runs, load_experiment, run_experiment
from pagedlab.lab.datasets import load_dataset
from pagedlab.lab.store import ResultStore, load_results
from pagedlab.lab.testing import make_tiny_model

QA = [
    {"question": "the quick brown", "answer": "fox"},
    {"question": "two plus two is", "answer": ["four", "4"]},
    {"question": "what is the capital of france", "answer": "paris"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("exp") / "tiny")


@pytest.fixture
def workdir(tmp_path, model_dir):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA))
    os.symlink(model_dir, tmp_path / "model")
    return tmp_path


def write(workdir, text, name="exp.yaml"):
    path = workdir / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


BASE = """
name: qa
model: model
engine: {device: cpu, dtype: float32, kv_cache_memory_bytes: 4194304}
sampling: {max_tokens: 4, temperature: 0.8}
dataset:
  path: data/qa.jsonl
  prompt_field: question
  reference_field: answer
"""


def error_of(workdir, text):
    with pytest.raises(ExperimentError) as info:
        load_experiment(write(workdir, text))
    return str(info.value)


# ---- validation ------------------------------------------------------------------------------------
def test_malformed_yaml_names_the_line(workdir):
    msg = error_of(workdir, BASE + "grid:\n  engine.block_size: [16, 32\nrepeats: 2\n")
    assert "exp.yaml:" in msg and "malformed YAML" in msg
    msg = error_of(workdir, "name: x\n  model: y\n")
    assert "exp.yaml:2:" in msg and "malformed YAML" in msg


def test_unknown_keys_name_key_path_and_line(workdir):
    msg = error_of(workdir, BASE + "repeets: 2\n")
    assert msg.startswith(f"{workdir / 'exp.yaml'}:9: repeets: unknown key") and "repeats" in msg
    msg = error_of(workdir, BASE.replace("dtype: float32", "dtype: float32, blok_size: 16"))
    assert ":3: engine.blok_size: unknown engine key 'blok_size'" in msg and "block_size" in msg
    msg = error_of(workdir, BASE + "grid:\n  sampling.temprature: [0, 1]\n")
    assert ":10: grid.sampling.temprature: unknown sampling key 'temprature'" in msg


def test_unknown_metric(workdir):
    msg = error_of(workdir, BASE + "metrics:\n  - bleu\n  - blue\n")
    assert ":11: metrics[1]: unknown metric 'blue'" in msg and "exact_match" in msg and "chrf" in msg


def test_missing_dataset_file(workdir):
    msg = error_of(workdir, BASE.replace("data/qa.jsonl", "data/nope.jsonl"))
    assert ":6: dataset.path: dataset file 'data/nope.jsonl' does not exist" in msg
    assert str(workdir / "data" / "nope.jsonl") in msg


def test_bad_values_cite_the_sweep_line(workdir):
    msg = error_of(workdir, BASE + "grid:\n  engine.block_size: [16, 17]\n")
    assert ":10: grid.engine.block_size: block_size=17 is invalid" in msg and "multiple of 16" in msg
    msg = error_of(workdir, BASE + "runs:\n  - {sampling.top_p: 0}\n")
    assert ":10: runs[0].sampling.top_p: top_p=0 is invalid" in msg


def test_other_clear_errors(workdir):
    with_template = BASE.replace("prompt_field: question", "template: '{q}'")
    assert "template uses field 'q'" in error_of(workdir, with_template)
    assert "has no field 'prompt'" in error_of(workdir, BASE.replace("  prompt_field: question\n", ""))
    no_refs = BASE.replace("  reference_field: answer\n", "") + "metrics: [exact_match]\n"
    assert "compare outputs with references, but the dataset has none" in error_of(workdir, no_refs)
    no_model = BASE.replace("model: model", "model: nowhere")
    assert "model 'nowhere' does not exist" in error_of(workdir, no_model)
    assert "give one seed per repeat" in error_of(workdir, BASE + "repeats: 2\nseeds: [1, 2, 3]\n")
    assert "the key appears twice" in error_of(workdir, BASE + "repeats: 2\nrepeats: 3\n")
    assert "exactly one workload" in error_of(workdir, BASE + "benchmark: {batch_size: 2}\n")
    bench = BASE.split("sampling:")[0] + "benchmark: {batch_size: 2}\nmetrics: [bleu]\n"
    assert "metric 'bleu' needs a dataset" in error_of(workdir, bench)
    assert "sets max_num_seqs to its batch_size" in error_of(
        workdir, bench.replace("metrics: [bleu]\n", "grid: {engine.max_num_seqs: [2, 4]}\n"))
    bad_jsonl = workdir / "data" / "broken.jsonl"
    bad_jsonl.write_text('{"question": "a", "answer": "b"}\n{"question": \n')
    assert "dataset broken.jsonl:2: not valid JSON" in error_of(workdir,
                                                                BASE.replace("qa.jsonl", "broken.jsonl"))


def test_references_that_are_numbers_become_strings(workdir):
    refs = workdir / "data" / "refs.jsonl"
    lines = [{"q": "legs of a spider", "a": ["eight", 8]}, {"q": "two plus two", "a": 4},
             {"q": "pi", "a": [3.5]}, {"q": "none", "a": None}]
    refs.write_text("".join(json.dumps(r) + "\n" for r in lines))
    conf = {"path": str(refs), "prompt_field": "q", "reference_field": "a"}
    ds = load_dataset(conf, None, lambda key: f"dataset.{key}")
    assert [it.reference for it in ds.items] == [["eight", "8"], ["4"], ["3.5"], None]
    for bad in ([None, "x"], ["x", ["y"]], {"x": 1}):
        records = ({"q": "ok", "a": "fine"}, {"q": "bad", "a": bad})
        refs.write_text("".join(json.dumps(r) + "\n" for r in records))
        with pytest.raises(ExperimentError, match=r"dataset refs.jsonl line 2: reference field 'a' must be"):
            load_dataset(conf, None, lambda key: f"dataset.{key}")


def test_an_empty_reference_cell_is_no_reference(workdir):
    """A CSV row whose reference cell is empty (or blank) has no reference, as a JSONL row
    without the field has none: it is not the reference "" that every output misses, and a
    reference column left empty throughout gives a dataset without references."""
    table = workdir / "data" / "qa.csv"
    table.write_text("question,answer\nthe quick brown,fox\ntwo plus two is,\npi,  \n")
    conf = {"path": str(table), "prompt_field": "question", "reference_field": "answer"}
    ds = load_dataset(conf, None, lambda key: f"dataset.{key}")
    assert [it.reference for it in ds.items] == [["fox"], None, None]
    table.write_text("question,answer\nthe quick brown,\ntwo plus two is,\n")
    assert not load_dataset(conf, None, lambda key: f"dataset.{key}").has_references


def test_a_utf8_file_with_a_byte_order_mark_reads_as_without(workdir):
    """A UTF-8 dataset file that starts with a byte order mark (as Excel and Notepad save CSV and
    JSON) gives the same records and the same content hash as the file without it: the mark is
    not part of the first field's name nor a JSON syntax error."""
    contents = {"csv": "question,answer\nthe quick brown,fox\n",
                "jsonl": json.dumps(QA[0]) + "\n", "json": json.dumps([QA[0]])}
    for suffix, text in contents.items():
        plain, marked = workdir / "data" / f"plain.{suffix}", workdir / "data" / f"marked.{suffix}"
        plain.write_text(text, encoding="utf-8")
        marked.write_text(text, encoding="utf-8-sig")
        conf = {"prompt_field": "question", "reference_field": "answer"}
        with_mark = load_dataset({**conf, "path": str(marked)}, None, lambda key: f"dataset.{key}")
        without = load_dataset({**conf, "path": str(plain)}, None, lambda key: f"dataset.{key}")
        assert with_mark.items == without.items
        assert [(it.prompt, it.reference) for it in with_mark.items] == [("the quick brown", ["fox"])]
        assert with_mark.sha256 == without.sha256


def test_a_csv_row_with_more_fields_than_the_header_is_an_error(workdir):
    """A CSV row with more cells than the header (an unquoted comma in a prompt) is an error naming
    the file and line, not a record read with the prompt cut at the comma and the rest of the row
    shifted into the reference."""
    table = workdir / "data" / "qa.csv"
    table.write_text('question,answer\n"What is 1,000 plus 1?",1001\nWhat is 2,000 plus 2?,2002\n')
    conf = {"path": str(table), "prompt_field": "question", "reference_field": "answer"}
    with pytest.raises(ExperimentError, match=r"^dataset qa.csv line 3: 3 fields where the header has 2"):
        load_dataset(conf, None, lambda key: f"dataset.{key}")
    table.write_text('question,answer\n"What is 1,000 plus 1?",1001\n')
    items = load_dataset(conf, None, lambda key: f"dataset.{key}").items
    assert [(it.prompt, it.reference) for it in items] == [("What is 1,000 plus 1?", ["1001"])]


def test_csv_errors_name_the_line_past_blank_lines_and_quoted_line_breaks(workdir):
    """The line a CSV error names is the file's line, counting blank lines (which hold no row) and
    the line breaks inside a quoted field, not the row's number plus one."""
    table = workdir / "data" / "qa.csv"
    table.write_text('answer,question\n\nx,"two\nlines"\nno question\n')
    conf = {"path": str(table), "prompt_field": "question", "reference_field": "answer"}
    with pytest.raises(ExperimentError, match=r"^dataset qa.csv line 5: 1 field where the header has 2"):
        load_dataset(conf, None, lambda key: f"dataset.{key}")


def test_dataset_hash_follows_the_prompts_and_references_only(workdir):
    """The dataset's SHA-256 changes when a reference, a prompt or the chat setting changes, and not
    when the same records come in another file format or with fields the run does not use."""
    conf = {"prompt_field": "question", "reference_field": "answer"}

    def sha(records, suffix="jsonl", **settings):
        path = workdir / "data" / f"h.{suffix}"
        lines = [json.dumps(records)] if suffix == "json" else [json.dumps(r) + "\n" for r in records]
        path.write_text("".join(lines))
        ds = load_dataset({**conf, **settings, "path": str(path)}, None, lambda key: f"dataset.{key}")
        return ds.sha256

    base = sha(QA)
    assert sha(QA, "json") == base
    assert sha([{**r, "source": "wiki"} for r in QA]) == base
    assert sha(QA[:2] + [{**QA[2], "answer": "lyon"}]) != base
    assert sha(QA[:2] + [{**QA[2], "question": "capital of france"}]) != base
    assert sha(QA, chat=True) != base


def test_a_template_reaching_into_a_field_it_cannot_is_an_error_naming_the_record(workdir):
    """A template that takes an attribute or an item of a field (``{question.text}``,
    ``{question[text]}``) where the record's value is a plain string is an experiment error naming
    the template setting and the record, not an AttributeError or TypeError out of str.format."""
    for template in ("{question.text}", "{question[text]}"):
        conf = {"path": str(workdir / "data" / "qa.jsonl"), "template": template, "reference_field": "answer"}
        with pytest.raises(ExperimentError, match=r"^dataset.template: the template cannot format dataset "
                                                  r"qa.jsonl line 1: "):
            load_dataset(conf, None, lambda key: f"dataset.{key}")


# ---- expansion -------------------------------------------------------------------------------------
def test_grid_runs_repeats_and_seeds(workdir):
    spec = load_experiment(write(workdir, BASE + """
        grid:
          engine.block_size: [16, 32]
          sampling.temperature: [0.5, 1.0]
        runs:
          - {engine.max_num_seqs: 2}
          - {engine: {max_num_seqs: 4}, sampling.top_k: 5}
        repeats: 3
        """.replace("\n        ", "\n")))
    runs = expand_runs(spec)
    assert len(runs) == 2 * 4 * 3
    assert {r.seed for r in runs} == {0, 1, 2} and {r.repeat for r in runs} == {0, 1, 2}
    assert runs[0].overrides == {"engine.max_num_seqs": 2, "engine.block_size": 16,
                                 "sampling.temperature": 0.5}
    assert runs[-1].config["sampling"] == {"max_tokens": 4, "temperature": 1.0, "top_k": 5}
    assert len({r.run_key for r in runs}) == len(runs)
    assert len({r.group_key for r in runs}) == 1  # one model load for all 24 runs
    assert runs[0].params()["dataset.num_prompts"] == 3
    # keys are stable across loads, and change when the data changes
    assert [r.run_key for r in expand_runs(load_experiment(spec.path))] == [r.run_key for r in runs]
    (workdir / "data" / "qa.jsonl").write_text(json.dumps({"question": "new", "answer": "x"}) + "\n")
    assert expand_runs(load_experiment(spec.path))[0].run_key != runs[0].run_key


def test_experiment_from_python_data(workdir):
    from pagedlab.lab.experiments import experiment_from_dict

    spec = experiment_from_dict({"name": "py", "model": "model", "engine": {"device": "cpu"},
                                 "dataset": {"prompts": ["a b", [1, 2, 3]]},
                                 "grid": {"sampling.temperature": [0, 1]}},
                                base_dir=workdir)
    runs = expand_runs(spec)
    assert len(runs) == 2 and runs[0].dataset.items[1].prompt_token_ids == [1, 2, 3]
    assert runs[0].config["model"] == str((workdir / "model").resolve())
    with pytest.raises(ExperimentError, match="metrics: must be a list"):
        experiment_from_dict({"name": "py", "model": "model", "dataset": {"prompts": ["x"]},
                              "metrics": "bleu"},
                             workdir)


def test_explicit_seeds_and_overrides(workdir):
    spec = load_experiment(write(workdir, BASE + "seeds: [11, 22]\n"),
                           ["sampling.max_tokens=2", "name=renamed"])
    runs = expand_runs(spec)
    assert spec.name == "renamed" and [r.seed for r in runs] == [11, 22]
    assert runs[0].sampling_params == {"max_tokens": 2, "temperature": 0.8, "seed": 11}
    with pytest.raises(ExperimentError, match="unknown key 'bogus'"):
        load_experiment(spec.path, ["bogus=1"])



def test_set_fills_a_section_left_empty_in_the_file(workdir):
    """A bare ``engine:`` or ``grid:`` is no settings, both without --set and under it: --set
    engine.x=... and --set grid.x=[...] fill them instead of calling them no mapping."""
    text = BASE.replace("engine: {device: cpu, dtype: float32, kv_cache_memory_bytes: 4194304}",
                        "engine:") + "grid:\n"
    spec = load_experiment(write(workdir, text), ["engine.device=cpu", "grid.engine.block_size=[16, 32]"])
    assert spec.base["engine"] == {"device": "cpu"} and spec.grid == {"engine.block_size": [16, 32]}



def test_a_seed_given_twice_is_refused(workdir):
    """seeds: [5, 5] would store two repeats of the very same samples as if they were independent
    (a spread over seeds of zero): refused, naming the seed."""
    assert "seed 5 is given twice" in error_of(workdir, BASE + "seeds: [5, 7, 5]\n")


# ---- running ---------------------------------------------------------------------------------------
class CountingFactory:
    """Builds the LLMs of an experiment and records what happens to their weights and plans."""

    def __init__(self):
        self.loads = 0
        self.replans = []
        self.weight_ids = set()

    def __call__(self, model, **kwargs):
        self.loads += 1
        factory = self

        class SpyLLM(LLM):
            def set_model_args(self, **changes):
                before = [(id(p), p.data_ptr()) for p in self.llm_engine.model.parameters()]
                super().set_model_args(**changes)
                after = [(id(p), p.data_ptr()) for p in self.llm_engine.model.parameters()]
                assert before == after  # the very same weight tensors
                factory.replans.append(changes)
                factory.weight_ids.add(tuple(before))

        return SpyLLM(model, **kwargs)


def test_pipeline_end_to_end_loads_weights_once(workdir, model_dir):
    import sacrebleu

    db = f"sqlite:///{workdir / 'r.db'}"
    spec = load_experiment(write(workdir, BASE + """
        grid:
          engine.block_size: [16, 32]
          sampling.temperature: [0, 0.8]
        repeats: 2
        metrics: [exact_match, bleu, chrf, output_length, throughput, latency, memory]
        monitor: {interval: 0.05}
        """.replace("\n        ", "\n")))
    factory = CountingFactory()
    report = run_experiment(spec, db=db, quiet=True, llm_factory=factory)
    assert report.ok and len(report.finished) == 8 and report.skipped == 0
    assert factory.loads == 1 and len(report.model_loads) == 1
    assert factory.replans == [{"block_size": 32}]  # runs ordered by plan: one re-plan in all
    assert len(factory.weight_ids) == 1

    df = load_results(db, experiment="qa")
    assert len(df) == 8 and set(df["engine.block_size"]) == {16, 32}
    tokenizer = LLM(str(model_dir), device="cpu", kv_cache_memory_bytes=1 << 20).get_tokenizer()
    with ResultStore(db) as store:
        for run in store.runs(experiment="qa"):
            p, m, man = run["params"], run["metrics"], run["manifest"]
            outs = store.outputs(run["run_id"])
            assert len(outs) == 3 == p["dataset.num_prompts"]
            # metrics agree with the stored outputs
            assert m["output_tokens"] == sum(len(o["token_ids"]) for o in outs)
            assert m["max_output_tokens"] <= 4 and m["elapsed_s"] > 0 and m["output_throughput"] > 0
            hyps = [o["text"] for o in outs]
            norm = lambda s: " ".join(w for w in re.sub(r"[^\w\s]", "", s.lower()).split()  # noqa: E731
                                      if w not in ("a", "an", "the"))
            exact = sum(norm(o["text"]) in {norm(r) for r in o["reference"]} for o in outs) / 3
            assert m["exact_match"] == pytest.approx(exact)
            refs = [[o["reference"][0] for o in outs], [o["reference"][1] if len(o["reference"]) > 1 else None
                                                        for o in outs]]
            assert m["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, refs).score)
            assert m["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, refs).score)
            for o in outs:  # as vLLM: the text the tokens add after the prompt's
                prompt_ids = tokenizer(o["prompt"]).input_ids
                after = tokenizer.decode(prompt_ids + o["token_ids"], skip_special_tokens=True)
                assert o["text"] == after[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)):]
            assert 0 < m["ttft_p50_ms"] <= m["e2e_p99_ms"]
            assert m["kv_peak_used_bytes"] <= m["kv_cache_bytes"]
            # the manifest records what the engine actually ran with
            assert man["engine"]["block_size"] == p["engine.block_size"]
            assert man["sampling"]["temperature"] == p["sampling.temperature"]
            assert man["sampling"]["seed"] == run["seed"] == p["sampling.seed"] == run["repeat"]
            assert man["model"]["weight_checksum"].startswith("sha256:")
            assert man["experiment"]["run_key"] == run["run_key"]
            assert run["telemetry"]["num_samples"] >= 2 and m["host_max_rss_bytes"] > 0
        # same seed, same sampling: same tokens whatever the block size (plan changes keep weights)
        by_config = {}
        for run in store.runs(experiment="qa"):
            key = (run["params"]["sampling.temperature"], run["seed"])
            by_config.setdefault(key, []).append([o["token_ids"] for o in store.outputs(run["run_id"])])
        assert all(a == b for a, b in by_config.values())

    # a rerun skips everything and loads nothing
    factory2 = CountingFactory()
    again = run_experiment(spec, db=db, quiet=True, llm_factory=factory2)
    assert again.skipped == 8 and not again.finished and factory2.loads == 0
    # a new grid value only runs the new runs
    spec3 = load_experiment(spec.path, ["grid.engine.block_size=[16, 32, 64]"])
    third = run_experiment(spec3, db=db, quiet=True)
    assert third.skipped == 8 and len(third.finished) == 4
    assert len(load_results(db)) == 12


def test_groups_by_weight_level_settings(workdir):
    spec = load_experiment(write(workdir, BASE + "grid:\n  engine.dtype: [float32, bfloat16]\n"
                                 "  engine.max_num_seqs: [1, 2]\n"))
    factory = CountingFactory()
    report = run_experiment(spec, db=str(workdir / "g.db"), quiet=True, llm_factory=factory)
    assert report.ok and len(report.finished) == 4
    assert factory.loads == 2 and len(factory.replans) == 2  # one load per dtype, one re-plan within each
    df = load_results(str(workdir / "g.db"))
    assert sorted(df["engine.dtype"]) == ["bfloat16", "bfloat16", "float32", "float32"]


def test_chat_dataset_and_inline_prompts(workdir):
    spec = load_experiment(write(workdir, """
        name: chat
        model: model
        engine: {device: cpu, kv_cache_memory_bytes: 4194304}
        sampling: {max_tokens: 3, temperature: 0}
        dataset:
          chat: true
          system: be brief
          prompts:
            - what is the capital of france
            - {prompt: two plus two is, reference: four}
        metrics: [exact_match, output_length]
        """))
    report = run_experiment(spec, db=str(workdir / "c.db"), quiet=True)
    assert report.ok
    with ResultStore(str(workdir / "c.db")) as store:
        run = store.runs()[0]
        outs = store.outputs(run["run_id"])
    assert outs[0]["prompt"].startswith("system : be brief user : what is the capital of france")
    assert outs[0]["reference"] is None and outs[1]["reference"] == ["four"]


def test_benchmark_workload(workdir):
    spec = load_experiment(write(workdir, """
        name: bench
        model: model
        engine: {device: cpu, kv_cache_memory_bytes: 4194304}
        benchmark: {input_len: 8, output_len: 3, warmup: 0}
        grid: {benchmark.batch_size: [1, 3]}
        repeats: 2
        """))
    report = run_experiment(spec, db=str(workdir / "b.db"), quiet=True)
    assert report.ok and len(report.finished) == 4
    df = load_results(str(workdir / "b.db")).sort_values(["benchmark.batch_size", "repeat"])
    assert list(df["output_tokens"]) == [3, 3, 9, 9] == list(df["engine_generation_tokens"])
    assert list(df["benchmark.seed"]) == [0, 1, 0, 1]
    assert (df["output_throughput"] > 0).all() and (df["itl_p50_ms"] > 0).all()


def test_a_failing_run_fails_alone_and_is_retried(workdir, capsys):
    # max_model_len 4 cannot hold the prompts (3 to 6 tokens); 64 can
    path = write(workdir, BASE + "grid:\n  engine.max_model_len: [4, 64]\n")
    parser = argparse.ArgumentParser()
    lab_cli.register(parser.add_subparsers())
    db = str(workdir / "f.db")
    args = parser.parse_args(["run", str(path), "--db", db, "--quiet"])
    assert args.func(args) == 1
    df = load_results(db, status=None)
    assert sorted(df["status"]) == ["failed", "finished"]
    failed = df[df["status"] == "failed"].iloc[0]
    assert failed["engine.max_model_len"] == 4 and "max_model_len is 4" in failed["error"]
    assert "FAILED run" in capsys.readouterr().err
    assert args.func(args) == 1  # the failure is tried again, the finished run is not
    df = load_results(db, status=None)
    assert len(df) == 2 and sorted(df["status"]) == ["failed", "finished"]


def test_cli_dry_run_and_errors(workdir, capsys):
    path = write(workdir, BASE + "grid: {engine.block_size: [16, 32]}\n")
    parser = argparse.ArgumentParser()
    lab_cli.register(parser.add_subparsers())
    db = workdir / "d.db"
    args = parser.parse_args(["run", str(path), "--db", str(db), "--dry-run"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "experiment qa: 2 run(s), 2 pending, 1 model group(s)" in out and "block_size=32" in out
    assert not db.exists()  # nothing executed, no database created
    bad = write(workdir, BASE + "metrics: [blue]\n", "bad.yaml")
    args = parser.parse_args(["run", str(bad), "--db", str(db)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.yaml:9: metrics[0]: unknown metric 'blue'" in err


# ---- crash safety ----------------------------------------------------------------------------------
def _kill_experiment(workdir, db, env_extra=None, wait_for_runs=None):
    # 12 runs, long enough (12 tokens each) that a kill after the second one lands mid-experiment
    spec = write(workdir, BASE.replace("max_tokens: 4", "max_tokens: 12") +
                 "grid:\n  engine.block_size: [16, 32, 48]\n  sampling.temperature: [0.5, 0.9]\nrepeats: 2\n"
                 "monitor: false\n", "kill.yaml")
    env = dict(os.environ, **(env_extra or {}))
    cmd = [sys.executable, "-m", "pagedlab.lab.cli", "run", str(spec), "--db", db]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait_for_runs is not None:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            try:
                if len(load_results(db)) >= wait_for_runs:
                    break
            except Exception:  # the database may not exist yet
                pass
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=240)
    return spec, cmd, proc.returncode


def _check_complete_runs(db):
    with ResultStore(db) as store:
        runs = store.runs(status=None)
        for run in runs:
            assert run["status"] == "finished"
            outs = store.outputs(run["run_id"])
            assert len(outs) == 3
            assert run["metrics"]["output_tokens"] == sum(len(o["token_ids"]) for o in outs)
            assert run["manifest"]["experiment"]["run_key"] == run["run_key"]
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
            total = conn.execute(store.sa.select(store.sa.func.count()).select_from(store.t_out)).scalar()
        assert total == 3 * len(runs)  # no outputs of a run that was not committed
    return runs


def test_kill_9_mid_experiment_then_resume(workdir):
    db = f"sqlite:///{workdir / 'k.db'}"
    _, cmd, rc = _kill_experiment(workdir, db, wait_for_runs=2)
    assert rc == -signal.SIGKILL
    survivors = _check_complete_runs(db)
    assert 2 <= len(survivors) < 12
    done = {r["run_key"] for r in survivors}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert f"{len(survivors)} of 12 runs already finished" in out.stderr
    final = _check_complete_runs(db)
    keys = [r["run_key"] for r in final]
    assert len(keys) == len(set(keys)) == 12 and done <= set(keys)
    assert {r["run_id"] for r in survivors} <= {r["run_id"] for r in final}  # finished runs untouched


def test_kill_9_while_writing_a_run(workdir):
    db = f"sqlite:///{workdir / 'w.db'}"
    _, cmd, rc = _kill_experiment(workdir, db, env_extra={"PAGEDLAB_FAULT": "store.mid_write:3"})
    assert rc == -signal.SIGKILL  # killed with run 3's rows inserted but not committed
    assert len(_check_complete_runs(db)) == 2
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert len(_check_complete_runs(db)) == 12


def test_text_metrics_on_known_outputs():
    from types import SimpleNamespace

    from pagedlab.lab.experiments import METRICS, DatasetItem, RunResult

    def out(text, n):
        return SimpleNamespace(outputs=[SimpleNamespace(text=text, token_ids=[1] * n, finish_reason="stop")],
                               prompt_token_ids=[1, 2], metrics=None)

    items = [DatasetItem("q1", None, ["Pacific Ocean"]), DatasetItem("q2", None, ["4", "Four"]),
             DatasetItem("q3", None, ["Paris"]), DatasetItem("q4", None, None)]
    res = RunResult([out("The Pacific ocean.", 4), out(" four", 1), out("Lyon", 1), out("x", 2)], items, 2.0,
                    None)
    assert METRICS["exact_match"].fn(res) == {"exact_match": pytest.approx(2 / 3)}  # q4 has no reference
    assert METRICS["chrf"].fn(res)["chrf"] > 0
    sentences = RunResult([out("It is the Pacific Ocean!", 6), out("Two plus two is four.", 6),
                           out("Parisian food", 2), out("x", 1)], items, 2.0, None)
    # whole normalized words: "Parisian" does not contain the answer "Paris"
    assert METRICS["contains_answer"].fn(sentences) == {"contains_answer": pytest.approx(2 / 3)}
    assert METRICS["exact_match"].fn(sentences) == {"exact_match": 0.0}
    lengths = METRICS["output_length"].fn(res)
    assert lengths["output_tokens"] == 8 and lengths["max_output_tokens"] == 4
    assert lengths["finished_by_length"] == 0
    tput = METRICS["throughput"].fn(res)
    assert tput["output_throughput"] == 4.0 and tput["prompt_tokens"] == 8 and tput["requests_per_s"] == 2.0


def test_a_grid_over_speculative_config_keeps_the_outputs_and_records_acceptance(workdir):
    """engine.speculative_config is a plan field: a grid over it re-plans without reloading, the
    greedy outputs stay those of plain decoding, and the speculation metric records acceptance."""
    db, key = f"sqlite:///{workdir / 's.db'}", "engine.speculative_config"
    ngram = "{method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 2, prompt_lookup_min: 1}"
    spec = load_experiment(write(workdir, BASE.replace("max_tokens: 4, temperature: 0.8", "max_tokens: 24, "
                                                       "temperature: 0, ignore_eos: true") + f"""
        grid:
          engine.speculative_config: [null, {ngram}]
        metrics: [speculation]
        """.replace("\n        ", "\n")))
    factory = CountingFactory()
    report = run_experiment(spec, db=db, quiet=True, llm_factory=factory)
    assert report.ok and len(report.finished) == 2 and factory.loads == 1
    with ResultStore(db) as store:
        runs = sorted(store.runs(experiment="qa"), key=lambda r: bool(r["params"][key]))
        outputs = [[o["token_ids"] for o in store.outputs(r["run_id"])] for r in runs]
    assert outputs[0] == outputs[1] and all(len(ids) == 24 for ids in outputs[0])
    assert runs[0]["metrics"]["spec_num_drafts"] == 0 and runs[1]["metrics"]["spec_num_drafts"] > 0
    assert 0 <= runs[1]["metrics"]["spec_acceptance_rate"] <= 1
