"""The command line's first seconds: ``--help``, ``--version`` and argument errors answer at once
(no torch, transformers or engine import), abbreviations are refused, and ``pagedlab bench``
refuses flags its workload does not read."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from pagedlab.cli.main import build_parser, main, warn_cpu_shape

STARTUP_BOUND_S = 3.0  # generous for CI; it is about 0.5 s on a laptop
HELP_COMMANDS = [["--help"], ["--version"], ["generate", "--help"], ["chat", "--help"],
                 ["bench", "throughput", "--help"], ["bench", "serve", "--help"], ["serve", "--help"],
                 ["run", "--help"], ["results", "list", "--help"], ["report", "--help"],
                 ["monitor", "--help"], ["repro", "check", "--help"]]


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["serve", "--help"],
                                  ["repro", "check", "--help"], ["generate", "--max-num-seq", "4"]],
                         ids=" ".join)
def test_answers_within_the_startup_bound(args):
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pagedlab.cli", *args], capture_output=True, text=True,
                            timeout=60)
    elapsed = time.perf_counter() - start
    assert result.returncode in (0, 2), result.stderr
    assert elapsed < STARTUP_BOUND_S, f"pagedlab {' '.join(args)} took {elapsed:.1f} s"


def test_help_of_every_command_imports_no_heavy_module():
    """Each subcommand's --help in one fresh interpreter: torch, transformers, triton and the
    engine stay unimported."""
    script = f"""
import json, sys
from pagedlab.cli.main import main
for args in {HELP_COMMANDS!r}:
    try:
        main(args)
    except SystemExit:
        pass
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'triton')
               or m.startswith(('pagedlab.engine', 'pagedlab.llm', 'pagedlab.models')))
print(json.dumps(heavy))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_version():
    import pagedlab

    result = subprocess.run([sys.executable, "-m", "pagedlab.cli", "--version"], capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.strip() == f"pagedlab {pagedlab.__version__}"


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_accepts_abbreviations(capsys):
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 15 and all(not p.allow_abbrev for p in parsers)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "--max-num-seq", "4"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --max-num-seq" in capsys.readouterr().err
    assert build_parser().parse_args(["generate", "--max-num-seqs", "4"]).max_num_seqs == 4


@pytest.mark.parametrize("argv, message", [
    (["--workload", "W-nano", "--batch-size", "4"], "--batch-size not used by workload W-nano"),
    (["--workload", "W-prefix", "--input-len", "9", "--output-len", "3"],
     "--input-len, --output-len not used by workload W-prefix"),
    (["--workload", "W-long", "--batch-size", "2"], "W-long takes --num-prompts"),
    (["--model", "some/dir", "--shape", "qwen3-0.6b"], "--shape qwen3-0.6b and --model some/dir"),
])
def test_bench_refuses_flags_its_workload_does_not_use(argv, message, capsys):
    assert main(["bench", "throughput", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "docs/benchmarks.md" in err or "--shape" in message


def test_bench_help_states_the_model_default_and_the_docs(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "docs/benchmarks.md" in text and "DESIGN.md" not in text
    assert "default: none: dummy weights of --shape" in text and "smollm2" not in text


def test_cpu_warning_before_an_8b_shape(capsys):
    warn_cpu_shape("llama3-8b", "cpu")
    assert "warning: building the llama3-8b shape" in capsys.readouterr().err
    warn_cpu_shape("qwen3-0.6b", "cpu")
    assert capsys.readouterr().err == ""


def test_chat_help_names_the_exit_commands(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    out = capsys.readouterr().out
    assert "/exit" in out and "/quit" in out


@pytest.mark.parametrize("command", [
    ["pagedlab.cli", "plan", "--model", "llama3-8b", "--gpu", "H200"],
    ["pagedlab.cli", "monitor", "--interval", "0.1", "--count", "50", "--gpu-only"],
    # docs/lab.md: `python -m pagedlab.lab.cli` runs the lab's commands as `pagedlab` does
    ["pagedlab.lab.cli", "monitor", "--interval", "0.1", "--count", "50", "--gpu-only"],
])
def test_a_reader_that_goes_away_ends_the_command_quietly(command):
    """`pagedlab plan ... | head -0`: output to a pipe whose reader has closed ends with exit 1
    and no BrokenPipeError traceback (nor a second one as the interpreter flushes at exit)."""
    proc = subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
