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


@pytest.mark.parametrize("where, message", [("missing/report.json", "is not a writable directory"),
                                            (".", "is a directory: give a file name")])
def test_an_out_file_that_cannot_be_written_is_refused_before_any_check(where, message, tmp_path, runs,
                                                                        capsys):
    path = str(tmp_path / where)
    assert main([*BASE, "--checks", "batch", "--out", path]) == 2
    err = capsys.readouterr().err
    assert f"--out {path}" in err and message in err and "Traceback" not in err
    assert runs == []
