"""The metric registry and the engine section's schema: a metric registered by a test is
validated, computed and stored; unknown metrics and engine keys are errors naming file and line."""

import json
import os
import textwrap

import pytest

pytest.importorskip("yaml")
pytest.importorskip("sqlalchemy")

from pagedlab.config import ENGINE_DEFAULTS, ENGINE_FIELDS, WEIGHT_FIELDS
from pagedlab.lab.metrics import METRICS, register_metric, unregister_metric
from pagedlab.lab.runner import run_experiment
from pagedlab.lab.runs import expand_runs
from pagedlab.lab.schema import ExperimentError
from pagedlab.lab.spec import load_experiment
from pagedlab.lab.store import ResultStore
from pagedlab.lab.testing import make_tiny_model

BASE = """
name: reg
model: model
engine: {device: cpu, dtype: float32, kv_cache_memory_bytes: 4194304}
sampling: {max_tokens: 3, temperature: 0}
dataset:
  prompts: [the quick brown, two plus two is, hello there]
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("reg") / "tiny")


@pytest.fixture
def workdir(tmp_path, model_dir):
    os.symlink(model_dir, tmp_path / "model")
    return tmp_path


@pytest.fixture
def even_tokens_metric():
    """A metric of the test's own: the share of outputs with an even number of tokens."""

    @register_metric("even_token_share", doc="share of outputs with an even token count")
    def even_token_share(result):
        counts = [len(o.outputs[0].token_ids) for o in result.outputs]
        return {"even_token_share": sum(n % 2 == 0 for n in counts) / len(counts)}

    yield even_token_share
    unregister_metric("even_token_share")


def write(workdir, text):
    path = workdir / "exp.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_unknown_metric_lists_the_registered_names(workdir, even_tokens_metric):
    path = write(workdir, BASE + "metrics: [output_length, even_tokens]\n")
    with pytest.raises(ExperimentError) as info:
        load_experiment(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:7: metrics[1]: unknown metric 'even_tokens'; available metrics: ")
    listed = msg.split("available metrics: ")[1].split(", ")
    assert listed == list(METRICS) and "even_token_share" in listed and "exact_match" in listed


def test_a_registered_metric_is_computed_and_stored(workdir, even_tokens_metric):
    spec = load_experiment(write(workdir,
                                 BASE + "metrics: [even_token_share, output_length]\nmonitor: false\n"))
    db = str(workdir / "m.db")
    report = run_experiment(spec, db=db, quiet=True)
    assert report.ok and len(report.finished) == 1
    with ResultStore(db) as store:
        run = store.runs()[0]
        outs = store.outputs(run["run_id"])
    counts = [len(o["token_ids"]) for o in outs]
    assert run["metrics"]["even_token_share"] == sum(n % 2 == 0 for n in counts) / 3
    assert run["metrics"]["output_tokens"] == sum(counts)
    with pytest.raises(ValueError, match="already registered"):
        register_metric("even_token_share")(even_tokens_metric)
    unregister_metric("even_token_share")
    with pytest.raises(ExperimentError, match="unknown metric 'even_token_share'"):
        load_experiment(spec.path)


def test_engine_section_takes_the_engine_config_fields(workdir):
    settable = {"block_size": 32, "max_num_seqs": 4, "enable_prefix_caching": False, "enforce_eager": True,
                "attention_backend": "torch", "seed": 3}
    assert set(settable) < set(ENGINE_FIELDS)
    spec = load_experiment(write(workdir, BASE.replace("kv_cache_memory_bytes: 4194304",
                                                       "kv_cache_memory_bytes: 4194304, "
                                                       + ", ".join(f"{k}: {json.dumps(v)}"
                                                                   for k, v in settable.items()))))
    run = expand_runs(spec)[0]
    assert {k: run.config["engine"][k] for k in settable} == settable
    # plan-level settings switch through set_model_args; weight-level ones define the model group
    assert run.plan_args == {k: v for k, v in run.config["engine"].items() if k not in WEIGHT_FIELDS}
    group = json.loads(run.group_key)
    assert set(group) == {"model"} | {k for k in run.config["engine"] if k in WEIGHT_FIELDS}
    assert ENGINE_DEFAULTS["block_size"] == 16


def test_engine_errors_name_the_line(workdir):
    def error(text):
        with pytest.raises(ExperimentError) as info:
            load_experiment(write(workdir, text))
        return str(info.value)

    msg = error(BASE.replace("device: cpu", "device: cpu, attention_backend: cuda"))
    assert ":3: engine.attention_backend: attention_backend='cuda' is invalid" in msg and "triton" in msg
    msg = error(BASE.replace("device: cpu", "device: cpu, model: other"))
    assert ":3: engine.model: give the model at the top level" in msg
    msg = error(BASE + "grid: {engine.max_num_sequences: [1, 2]}\n")
    assert ":7: grid.engine.max_num_sequences: unknown engine key 'max_num_sequences'" in msg
    assert all(name in msg for name in ENGINE_FIELDS if name != "model")


def test_bleu_and_chrf_are_sacrebleu_corpus_scores_over_the_referenced_rows():
    """BLEU and chrF are sacrebleu's corpus scores (not a mean of sentence scores) over the rows that
    have references, each row's references given as reference streams, a row with fewer
    references padded with None, and a row without a reference left out wherever it sits."""
    from types import SimpleNamespace

    import sacrebleu

    from pagedlab.lab.datasets import DatasetItem
    from pagedlab.lab.metrics import RunResult

    texts = ["the cat sat on the mat", "no reference here", "a dog ran in the park today"]
    refs = [["the cat sat on a mat", "a cat sat on the mat"], None, ["a dog ran in a park today"]]
    outputs = [SimpleNamespace(outputs=[SimpleNamespace(text=t)]) for t in texts]
    result = RunResult(outputs, [DatasetItem("q", None, r) for r in refs], 1.0, None)
    hyps, streams = [texts[0], texts[2]], [[refs[0][0], refs[2][0]], [refs[0][1], None]]
    bleu = METRICS["bleu"].fn(result)["bleu"]
    assert bleu == pytest.approx(sacrebleu.corpus_bleu(hyps, streams).score)
    assert METRICS["chrf"].fn(result)["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, streams).score)
    sentence_mean = sum(sacrebleu.sentence_bleu(h, [r for r in rs if r]).score
                        for h, rs in zip(hyps, zip(*streams))) / 2
    assert bleu != pytest.approx(sentence_mean)


def test_references_that_normalize_to_nothing_are_scored_as_squad_v2_scores_them():
    """SQuAD v2's official evaluation drops gold answers that normalize to nothing and, with none
    left, scores the question as unanswerable (gold ""). An empty output then matches ["the"] and
    ["."] (so does SQuAD v1.1, "" == ""), and a real answer does not; but ["the", "Paris"] is
    ["Paris"]: an empty output matched its "the" and counted as a correct answer."""
    from types import SimpleNamespace

    from pagedlab.lab.datasets import DatasetItem
    from pagedlab.lab.metrics import RunResult

    def scores(text, refs):
        result = RunResult([SimpleNamespace(outputs=[SimpleNamespace(text=text)])],
                           [DatasetItem("q", None, refs)], 1.0, None)
        return METRICS["exact_match"].fn(result)["exact_match"], \
            METRICS["contains_answer"].fn(result)["contains_answer"]

    assert scores("", ["the"]) == scores("The.", ["."]) == (1.0, 1.0)
    assert scores("Paris", ["the"]) == (0.0, 0.0)
    assert scores("", ["the", "Paris"]) == (0.0, 0.0)
    assert scores("It is Paris.", ["the", "Paris"]) == (0.0, 1.0)
    assert scores("the Paris", ["the", "Paris"]) == (1.0, 1.0)


def test_normalize_answer_is_squads_step_for_step():
    """SQuAD's script removes an article wherever word boundaries enclose it after removing ASCII
    punctuation: "The—end" is "—end" there (the dash is not ASCII punctuation); removing only
    whole whitespace-separated words kept "the—end", so the output "—end" missed it."""
    from pagedlab.lab.metrics import normalize_answer

    assert normalize_answer("The—end") == "—end" and normalize_answer("the\u2019s cat") == "\u2019s cat"
    assert normalize_answer("  A  cat,\tthe DOG. ") == "cat dog" and normalize_answer("Theory") == "theory"
    assert normalize_answer("the") == normalize_answer(".") == ""


def test_memory_metric_reports_long_rope_recomputes_apart_from_preemptions():
    """The memory group reports LongRoPE's recomputes in their own column, beside the preemptions
    (memory pressure) that no longer count them."""
    from types import SimpleNamespace

    from pagedlab.lab.metrics import RunResult

    stats = SimpleNamespace(weight_bytes=100, kv_cache_bytes=64, num_kv_blocks=4, peak_kv_blocks_used=2,
                            kv_tokens_at_peak=20, fragmentation_at_peak=0.375, num_preemptions=1,
                            num_long_rope_recomputes=3, prefix_cache_hit_rate=0.0)
    got = METRICS["memory"].fn(RunResult([], [], 1.0, stats))
    assert got["num_preemptions"] == 1 and got["num_long_rope_recomputes"] == 3
