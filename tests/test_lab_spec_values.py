"""Experiment validation of values that would otherwise change a sweep silently: a benchmark
switch given as a string, and a --set that the grid or a run would override."""

import re

import pytest

pytest.importorskip("yaml")

from pagedlab.lab.experiments import ExperimentError, expand_runs, experiment_from_dict, load_experiment

MODEL = "example-org/tiny-llama"  # a hub id: expansion never loads it


def bench_spec(**benchmark) -> dict:
    return {"name": "v", "model": MODEL, "engine": {"device": "cpu"},
            "benchmark": {"batch_size": 2, "input_len": 8, "output_len": 4, **benchmark}}


@pytest.mark.parametrize("name", ["use_beam_search", "detokenize"])
@pytest.mark.parametrize("value", ["no", "false", 0, None])
def test_a_benchmark_switch_must_be_true_or_false(name, value):
    # "no" is a truthy string: accepted, it ran beam search (or detokenized) against the spec's word
    with pytest.raises(ExperimentError, match=rf"benchmark.{name}: {name}={value!r} is invalid: give true "
                                              "or false"):
        experiment_from_dict(bench_spec(**{name: value}))


def test_benchmark_switches_and_counts_keep_their_types():
    (run,) = expand_runs(experiment_from_dict(bench_spec(use_beam_search=True, detokenize=False)))
    settings = run.config["benchmark"]
    assert settings["use_beam_search"] is True and settings["detokenize"] is False
    with pytest.raises(ExperimentError, match=r"benchmark.warmup: warmup=True is invalid"):
        experiment_from_dict(bench_spec(warmup=True))


EXPERIMENT = """
name: s
model: example-org/tiny-llama
engine: {device: cpu, block_size: 16}
sampling: {max_tokens: 2}
dataset: {prompts: [a b c]}
grid: {sampling.temperature: [0.3, 0.7]}
runs:
  - {engine: {max_num_seqs: 2}}
  - {sampling.top_k: 5}
"""


def test_a_set_that_the_grid_or_a_run_would_replace_is_refused(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT)
    # applied, the grid's 0.3 and 0.7 replaced the 0.5 in every run: a sweep at the wrong values
    with pytest.raises(ExperimentError, match=r"--set 'sampling.temperature=0.5': the grid sweeps "
                                              r"sampling.temperature.*--set grid.sampling.temperature="):
        load_experiment(path, ["sampling.temperature=0.5"])
    for item in ("engine.max_num_seqs=8", "sampling.top_k=1"):  # nested and dotted in runs
        with pytest.raises(ExperimentError, match=rf"--set '{item}': a run of runs: sets"):
            load_experiment(path, [item])
    spec = load_experiment(path, ["engine.block_size=32", "grid.sampling.temperature=[0.5]"])
    settings = {(r.config["engine"]["block_size"], r.config["sampling"]["temperature"])
                for r in expand_runs(spec)}
    assert settings == {(32, 0.5)}


@pytest.mark.parametrize("where", ["grid", "runs[1]"])
def test_seeds_beside_a_swept_sampling_seed_is_refused_by_name(where):
    # seeds[r] replaced the grid's (or the run's) sampling.seed: the runs then came out "identical"
    # under labels that differ only in the unused seed, an error that named the wrong cause
    spec = {"name": "s", "model": MODEL, "engine": {"device": "cpu"}, "sampling": {"max_tokens": 2},
            "dataset": {"prompts": ["a b c"]}, "seeds": [1, 2]}
    if where == "grid":
        spec["grid"] = {"sampling.seed": [5, 6]}
    else:
        spec["runs"] = [{"sampling.top_k": 5}, {"sampling.seed": 5}]
    message = f"sampling.seed that {re.escape(where)} sets would never be used"
    with pytest.raises(ExperimentError, match=rf"seeds: seeds: gives every run its seeds, so the {message}"):
        experiment_from_dict(spec)
