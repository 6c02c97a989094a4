"""`pagedlab repro check`: bad values of its own options are refused, naming the value and what is
allowed, before any model loads (and so before any check's work could be lost)."""

from __future__ import annotations

import pytest

from pagedlab.cli.main import main
from pagedlab.lab import repro_cli

BASE = ["repro", "check", "--model", "some/model", "--device", "cpu", "--no-progress"]


@pytest.fixture
def runs(monkeypatch) -> list:
    """The checks started (none run: each call is recorded)."""
    calls: list = []
    monkeypatch.setattr(repro_cli, "_run_llm_checks", lambda args, checks, *rest: calls.append(checks))
    return calls


@pytest.mark.parametrize("where, message", [("a-file/report.json", "cannot be made"),
                                            (".", "is a directory: give a file name")])
def test_an_out_file_that_cannot_be_written_is_refused_before_any_check(where, message, tmp_path, runs,
                                                                        capsys):
    (tmp_path / "a-file").write_text("")  # a folder cannot be made where a file is
    path = str(tmp_path / where)
    assert main([*BASE, "--checks", "batch", "--out", path]) == 2
    err = capsys.readouterr().err
    assert f"--out {path}" in err and message in err and "Traceback" not in err
    assert runs == []


@pytest.mark.parametrize("flag", ["--logprob-tolerance", "--kl-threshold", "--seed-threshold"])
@pytest.mark.parametrize("value", ["nan", "-1", "lots"])
def test_a_tolerance_that_no_difference_could_pass_or_fail_is_refused(flag, value, runs, capsys):
    """Every `difference > tolerance` is false for a NaN tolerance (a check that cannot fail: the
    batch check said SAME for a |Δ logprob| of 0.79 with "<= nan") and true at 0 for a negative one
    (bitwise-equal runs DIFFER)."""
    with pytest.raises(SystemExit) as exit_:
        main([*BASE, "--checks", "batch", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {value!r} is not a number >= 0" in capsys.readouterr().err
    assert runs == []


@pytest.mark.parametrize("value, parsed", [("0", 0.0), ("1e-5", 1e-5), ("inf", float("inf"))])
def test_a_tolerance_of_zero_or_more_is_taken(value, parsed, runs):
    assert main([*BASE, "--checks", "batch", "--logprob-tolerance", value]) == 0
    assert runs == [["batch"]]


@pytest.mark.parametrize("flag", ["--max-tokens", "--seed-max-tokens", "--num-seeds"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_count_below_one_is_refused_by_its_flag(flag, value, runs, capsys):
    """Taken as any int, these failed only once the model was loaded and the checks before ran,
    as `max_tokens=0 is invalid` or `seeds=[] is too few`, naming no flag."""
    with pytest.raises(SystemExit) as exit_:
        main([*BASE, "--checks", "batch,seeds", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {value!r} is not a whole number >= 1" in capsys.readouterr().err
    assert runs == []


def test_one_seed_is_refused_before_any_check_runs_when_the_seeds_check_runs(runs, capsys):
    assert main([*BASE, "--checks", "batch,seeds", "--num-seeds", "1"]) == 2
    assert "--num-seeds 1: the seeds check needs at least 2 seeds" in capsys.readouterr().err
    assert runs == []
    assert main([*BASE, "--checks", "batch,spec", "--num-seeds", "1"]) == 0  # spec: one seed is a test
    assert runs == [["batch", "spec"]]


def test_checks_help_names_every_check_the_default_leaves_out(capsys):
    with pytest.raises(SystemExit):
        main(["repro", "check", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    default = help_text[help_text.index("(default: all but"):]
    default = default[:default.index(")")]
    left_out = [c for c in repro_cli.ALL_CHECKS if c not in repro_cli.default_checks(None, None, None)]
    assert left_out == ["tokenizer", "lora", "spec"]
    for check, flag in zip(left_out, ["--tokenizer-b", "--lora", "--speculative-config"]):
        assert check in default and flag in default, default


def test_a_check_named_twice_runs_once(runs):
    assert main([*BASE, "--checks", "batch,seeds,batch"]) == 0
    assert runs == [["batch", "seeds"]]
