"""Experiment validation of values that would otherwise change a sweep silently: a benchmark
switch given as a string, and a --set that the grid or a run would override."""

import pytest

pytest.importorskip("yaml")

from pagedlab.lab.experiments import ExperimentError, expand_runs, experiment_from_dict

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
