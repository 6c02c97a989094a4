"""Bad values on the command line are refused up front, naming the flag and what it takes (exit 2,
no traceback); ``pagedlab bench`` checks where its ``--json`` goes before it runs. No model loads:
``run_bench`` is replaced by a recorder."""

from __future__ import annotations

import json
import shlex
import signal
from types import SimpleNamespace

import pytest

from pagedlab import bench_json, workloads
from pagedlab.cli.main import main


@pytest.fixture
def bench_calls(monkeypatch):
    """The arguments of every ``workloads.run_bench`` call (which returns no rows)."""
    calls = []
    monkeypatch.setattr(workloads, "run_bench", lambda *args, **kwargs: calls.append((args, kwargs)) or [])
    return calls


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "infGiB", "12XB"])
def test_a_byte_count_that_is_no_number_is_a_usage_error(value, capsys):
    err = usage_error(["generate", f"--kv-cache-memory-bytes={value}", "--prompt", "hi"], capsys)
    assert f"argument --kv-cache-memory-bytes: {value!r} is not a byte count" in err


@pytest.mark.parametrize("flag, value", [("--input-len", "0"), ("--output-len", "0"), ("--num-prompts", "0"),
                                         ("--num-prompts", "-3"), ("--repeats", "0"), ("--batch-size", "x")])
def test_bench_sizes_below_one_are_refused(flag, value, bench_calls, capsys):
    err = usage_error(["bench", "throughput", "--shape", "qwen3-0.6b", f"{flag}={value}"], capsys)
    assert f"argument {flag}: {value!r} is not a whole number >= 1" in err
    assert bench_calls == []


def test_bench_batch_sizes_are_each_checked(bench_calls, capsys):
    err = usage_error(["bench", "throughput", "--shape", "qwen3-0.6b", "--batch-size", "4", "0"], capsys)
    assert "argument --batch-size: '0' is not a whole number >= 1" in err


@pytest.mark.parametrize("command, given, sizes", [
    ("throughput", [], ([1, 16, 64, 256], 512, 128)),
    ("latency", [], ([1], 512, 128)),
    ("throughput", ["--batch-size", "2", "3", "--input-len", "7", "--output-len", "1"], ([2, 3], 7, 1)),
])
def test_bench_passes_the_sizes_given_else_the_defaults(command, given, sizes, bench_calls):
    assert main(["bench", command, "--shape", "qwen3-0.6b", *given]) == 0
    (args, kwargs), = bench_calls
    assert args[1:4] == sizes and kwargs["repeats"] == (1 if command == "throughput" else 3)


def test_bench_takes_engine_flags_given_at_the_engines_default(bench_calls):
    """An engine flag given its EngineConfig default still reaches run_bench, whose own defaults
    (bfloat16, max_num_seqs of the largest batch) it must override: --max-num-seqs 256 caps a batch
    of 512 as --max-num-seqs 255 would; engine flags not given stay out."""
    argv = ["bench", "throughput", "--shape", "qwen3-0.6b", "--batch-size", "512", "--max-num-seqs", "256",
            "--dtype", "auto", "--enable-prefix-caching", "--device", "cpu"]
    assert main(argv) == 0
    (_, kwargs), = bench_calls
    assert kwargs["engine_args"] == {"max_num_seqs": 256, "dtype": "auto", "enable_prefix_caching": True,
                                     "device": "cpu"}


@pytest.mark.parametrize("where, message", [("a-file/out.json", "cannot be made"),
                                            (".", "is a directory: give a file name")])
def test_bench_json_that_cannot_be_written_is_refused_before_the_run(where, message, tmp_path, bench_calls,
                                                                     capsys):
    (tmp_path / "a-file").write_text("")  # a folder cannot be made where a file is
    path = str(tmp_path / where)
    assert main(["bench", "throughput", "--shape", "qwen3-0.6b", "--json", path]) == 2
    assert f"--json/--output-json {path}" in (err := capsys.readouterr().err) and message in err
    assert bench_calls == []


def test_bench_json_in_a_missing_folder_makes_it(tmp_path, bench_calls):
    """`--json results/run1.json` before results/ exists: made, as `results export` makes it (it
    was refused as 'not a writable directory')."""
    path = tmp_path / "results" / "nested" / "run1.json"
    assert main(["bench", "throughput", "--shape", "qwen3-0.6b", "--json", str(path)]) == 0
    assert path.parent.is_dir() and len(bench_calls) == 1


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_bench_takes_vllms_output_json_for_json(command, monkeypatch, tmp_path):
    """`vllm bench throughput|latency --output-json PATH` works here as it is typed there."""
    def one_row(*args, results, **kwargs):
        results.append(workloads.WorkloadResult("W-seed", "pagedlab", "bs=1", 1, 8, 4, 0.5,
                                                None, None, None, None, None, None))
        return results

    monkeypatch.setattr(workloads, "run_bench", one_row)
    out = tmp_path / "vllm-style.json"
    argv = ["bench", command, "--shape", "qwen3-0.6b", "--device", "cpu", "--output-json", str(out)]
    assert main(argv) == 0
    written = json.loads(out.read_text())
    assert [r["label"] for r in written["results"]] == ["bs=1"] and "partial" not in written


def test_bench_json_write_failure_is_an_error_not_a_traceback(tmp_path, bench_calls, monkeypatch, capsys):
    def fail(path, results, command, stopped=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench_json, "write_json", fail)
    path = str(tmp_path / "out.json")
    assert main(["bench", "throughput", "--shape", "qwen3-0.6b", "--json", path]) == 2
    assert f"--json {path}: [Errno 28] No space left on device" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, allowed", [
    ("--gpu-memory-utilization", "2", "a number in (0, 1]"),
    ("--gpu-memory-utilization", "0", "a number in (0, 1]"),
    ("--max-model-len", "0", "a whole number >= 1"), ("--max-model-len", "-5", "a whole number >= 1"),
    ("--max-num-batched-tokens", "0", "a whole number >= 1"),
    ("--tensor-parallel-size", "0", "a whole number >= 1"),
])
def test_plan_refuses_settings_out_of_range(flag, value, allowed, capsys):
    err = usage_error(["plan", "--model", "llama3-8b", "--gpu", "H200", f"{flag}={value}"], capsys)
    assert f"argument {flag}: {value!r} is not {allowed}" in err


@pytest.mark.parametrize("size", ["infGiB", "nanGiB", "-5GiB", "0GiB"])
def test_plan_refuses_a_gpu_memory_that_is_no_positive_size(size, capsys):
    assert main(["plan", "--model", "llama3-8b", f"--gpu-memory={size}"]) == 2
    assert f"--gpu-memory {size!r} is invalid: give a positive size" in capsys.readouterr().err


@pytest.mark.parametrize("text, size", [("1073741824", 1 << 30), ("512MiB", 512 << 20), ("2GiB", 2 << 30),
                                        ("2G", 2 << 30), ("80GB", 80 * 10 ** 9), ("1.5kb", 1500),
                                        ("64b", 64)])
def test_byte_sizes_mean_what_their_units_say_on_every_flag(text, size, capsys):
    from pagedlab.cli.engine_args import parse_bytes

    assert parse_bytes(text) == size
    assert main(["plan", "--model", "llama3-8b", f"--gpu-memory={text}", "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["plan"]["gpu_memory_bytes"] == size


@pytest.mark.parametrize("text, tokens", [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600),
                                          ("1M", 1 << 20)])
def test_max_model_len_takes_vllms_human_readable_counts(text, tokens):
    """--max-model-len reads "4k" (decimal, lower case) and "4K" (binary, upper case) as vLLM's
    human_readable_int does, into the engine config."""
    from pagedlab.cli.engine_args import engine_config_from_args
    from pagedlab.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--max-model-len", text])
    assert engine_config_from_args(args).max_model_len == tokens


@pytest.mark.parametrize("text, tokens", [("8k", 8000), ("2K", 2048)])
def test_max_num_batched_tokens_takes_vllms_human_readable_counts(text, tokens):
    """--max-num-batched-tokens reads human-readable counts as vLLM's flag does (8k = 8000,
    2K = 2048), so a vLLM command line with --max-num-batched-tokens 8k runs."""
    from pagedlab.cli.engine_args import engine_config_from_args
    from pagedlab.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--max-num-batched-tokens", text])
    assert engine_config_from_args(args).max_num_batched_tokens == tokens


@pytest.mark.parametrize("text, message", [("4.5K", "a binary suffix (K) takes a whole number"),
                                           ("4kb", "is not a whole number")])
def test_max_model_len_that_is_no_count_is_a_usage_error(text, message, capsys):
    """A binary suffix with decimals, or a unit vLLM does not read, is refused by the flag."""
    assert message in usage_error(["generate", "--max-model-len", text], capsys)


def test_plan_names_a_model_directory_without_config_json(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path), "--gpu", "H200"]) == 2
    assert f"--model {str(tmp_path)!r}: the directory has no config.json" in capsys.readouterr().err


def test_plan_says_a_missing_model_is_neither_directory_nor_shape(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    assert main(["plan", "--model", missing, "--gpu", "H200"]) == 2
    err = capsys.readouterr().err
    assert f"--model {missing!r} is not a directory" in err and "llama3-8b" in err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from pagedlab.lab.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_generate_reads_stdin_prompts_one_per_line(tiny_dir, monkeypatch, capsys):
    import io
    import json

    import torch
    import transformers

    from conftest import hf_greedy

    monkeypatch.setattr("sys.stdin", io.StringIO("the quick brown fox\n\n   \nwhat is the capital\n"))
    argv = ["generate", "--model", tiny_dir, "--dtype", "float32", "--max-tokens", "5", "--json", "--quiet"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert [row["prompt"] for row in rows] == ["the quick brown fox", "what is the capital"]
    for row in rows:
        assert row["prompt_token_ids"] == tokenizer(row["prompt"]).input_ids
        assert row["token_ids"] == hf_greedy(model, row["prompt_token_ids"], 5)
        whole = tokenizer.decode(row["prompt_token_ids"] + row["token_ids"], skip_special_tokens=True)
        prompt = tokenizer.decode(row["prompt_token_ids"], skip_special_tokens=True)
        assert row["text"] == whole[len(prompt):]  # what the tokens add after the prompt (vLLM)


def test_generate_without_prompts_says_how_to_give_them(monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n"))
    assert main(["generate"]) == 2
    assert "give --prompt TEXT (repeatable) or prompts on standard input" in capsys.readouterr().err


def test_closed_stdin_is_no_input(tiny_dir, monkeypatch, capsys):
    """Standard input closed (``cmd <&-``: sys.stdin is None) reads as empty, not a traceback:
    generate says how to give prompts (exit 2) and chat ends as at end of input (exit 0)."""
    monkeypatch.setattr("sys.stdin", None)
    assert main(["generate"]) == 2
    assert "give --prompt TEXT (repeatable) or prompts on standard input" in capsys.readouterr().err
    assert main(["chat", "--model", tiny_dir, "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == ""


def test_sampling_flags_map_to_their_sampling_params():
    from pagedlab import SamplingParams
    from pagedlab.cli.main import build_parser, sampling_params

    args = build_parser().parse_args(["generate", "--max-tokens", "9", "--temperature", "0.7",
                                      "--top-p", "0.5", "--top-k", "3", "--sampling-seed", "11"])
    assert sampling_params(args) == SamplingParams(max_tokens=9, temperature=0.7, top_p=0.5, top_k=3, seed=11)
    chat_default = SamplingParams(max_tokens=512, temperature=0.0)
    assert sampling_params(build_parser().parse_args(["chat"])) == chat_default


def test_chat_puts_the_system_prompt_first(tiny_dir, monkeypatch, capsys):
    import io

    import torch
    import transformers

    from pagedlab.lab.repro.hf import hf_greedy_whole_sequence

    monkeypatch.setattr("sys.stdin", io.StringIO("what is the capital\n/exit\n"))
    argv = ["chat", "--model", tiny_dir, "--dtype", "float32", "--max-tokens", "6",
            "--system", "the lazy dog"]
    assert main(argv) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    history = [{"role": "system", "content": "the lazy dog"},
               {"role": "user", "content": "what is the capital"}]
    prompt_ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    # unmasked forwards: the template's words are <unk>, which is also the pad id generate() would mask
    reply_ids = hf_greedy_whole_sequence(model, prompt_ids, 6, {tokenizer.eos_token_id})[0]
    whole = tokenizer.decode(prompt_ids + reply_ids, skip_special_tokens=True)
    reply = whole[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)):]  # what it adds (vLLM)
    assert capsys.readouterr().out == reply + "\n"


def test_an_interrupted_command_exits_130(monkeypatch):
    import pagedlab

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pagedlab, "LLM", interrupted)
    assert main(["generate", "--prompt", "hi"]) == 130


def test_a_bad_lora_flag_is_refused_before_the_cpu_warning(bench_calls, capsys):
    assert main(["bench", "throughput", "--device", "cpu", "--lora-rank", "4"]) == 2
    err = capsys.readouterr().err
    assert "give --num-loras too" in err and "warning" not in err and bench_calls == []


def test_bench_json_keeps_the_rows_finished_before_a_crash(monkeypatch, tmp_path, capsys):
    """Out of memory at the last batch size: the rows measured before it reach --json, marked
    partial as bench serve marks its file, with why the run stopped and the command as typed."""
    def two_rows_then_oom(*args, results, **kwargs):
        for bs in (1, 16):
            results.append(workloads.WorkloadResult("W-seed", "pagedlab", f"bs={bs}", bs, 8 * bs, 4 * bs, 0.5,
                                                    None, None, None, None, None, None))
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(workloads, "run_bench", two_rows_then_oom)
    out = tmp_path / "rows.json"
    argv = ["bench", "throughput", "--shape", "qwen3-0.6b", "--workload", "W-seed", "--batch-size", "1", "16",
            "256", "--json", str(out), "--device", "cpu"]
    with pytest.raises(RuntimeError, match="out of memory"):
        main(argv)
    written = json.loads(out.read_text())
    assert [r["label"] for r in written["results"]] == ["bs=1", "bs=16"]
    assert written["error"] == "RuntimeError: CUDA out of memory"
    assert written["partial"] is True and written["interrupted"] == "RuntimeError: CUDA out of memory"
    assert shlex.split(written["command"]) == ["pagedlab", *argv]
    assert "wrote the 2 finished row(s)" in capsys.readouterr().err


def test_generate_interrupted_keeps_the_outputs_already_finished(tiny_dir, monkeypatch, capsys):
    """Ctrl-C after the second prompt finished first: its output is printed (not lost) and the
    exit code is 130."""
    import json

    from pagedlab import LLM

    real = LLM.generate_as_completed

    def interrupted_after_one(self, *args, **kwargs):
        finished = dict(real(self, *args, **kwargs))
        yield 1, finished[1]  # the second prompt first: held back until the first, which never comes
        raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "generate_as_completed", interrupted_after_one)
    argv = ["generate", "--model", tiny_dir, "--dtype", "float32", "--json", "--quiet", "--prompt",
            "the quick brown fox jumps", "--max-tokens", "1", "--prompt", "hello"]
    assert main(argv) == 130
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 1 and (rows[0]["index"], rows[0]["prompt"]) == (1, "hello")
    assert len(rows[0]["token_ids"]) == 1


def test_chat_drops_the_oldest_turns_that_no_longer_fit(tiny_dir, monkeypatch, capsys):
    """Room for one turn: the second, same question is asked alone again (same greedy reply, HF's);
    a message too long on its own is refused and the chat goes on."""
    import io

    import torch
    import transformers

    from pagedlab.lab.repro.hf import hf_greedy_whole_sequence

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    history = [{"role": "system", "content": "the lazy dog"},
               {"role": "user", "content": "what is the capital"}]
    prompt_ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    reply_ids = hf_greedy_whole_sequence(model, prompt_ids, 6, {tokenizer.eos_token_id})[0]
    whole = tokenizer.decode(prompt_ids + reply_ids, skip_special_tokens=True)
    reply = whole[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)):]
    lines = "what is the capital\n" + "the quick brown fox " * 30 + "\nwhat is the capital\n/exit\n"
    # the long message is refused without touching the conversation: the third line finds turn 1 there
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    argv = ["chat", "--model", tiny_dir, "--dtype", "float32", "--max-tokens", "6", "--system",
            "the lazy dog", "--max-model-len", str(len(prompt_ids) + 7)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == reply + "\n" + reply + "\n"
    assert "that message alone is too long" in captured.err
    assert "(the 2 oldest messages no longer fit" in captured.err


def test_in_order_printer_holds_each_output_until_the_earlier_ones_are_out(capsys):
    from pagedlab.cli.main import InOrderPrinter

    printer = InOrderPrinter(["p0", "p1", "p2", "p3", "p4"], as_json=False)
    done = lambda text: SimpleNamespace(outputs=[SimpleNamespace(text=text)])  # noqa: E731
    printer.add(2, done("c2"))
    printer.add(0, done("c0"))
    assert capsys.readouterr().out == "### p0\nc0\n\n"  # 2 waits for 1
    printer.add(1, done("c1"))
    assert capsys.readouterr().out == "### p1\nc1\n\n### p2\nc2\n\n"
    printer.add(4, done("c4"))
    assert capsys.readouterr().out == ""
    printer.flush_all()  # interrupted: 3 never finishes, 4 is printed all the same
    assert capsys.readouterr().out == "### p4\nc4\n\n"


def test_fitted_chat_prompt_drops_whole_turns_after_the_system_message(tiny_dir):
    """A prompt must be shorter than max_model_len; the oldest user message goes with its reply,
    never the system message; None when the newest message does not fit even alone."""
    import transformers

    from pagedlab.cli.main import fitted_chat_prompt

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    system = {"role": "system", "content": "the lazy dog"}
    turns = [{"role": "user", "content": "what is the capital"}, {"role": "assistant", "content": "paris"},
             {"role": "user", "content": "and of spain"}]

    def ids(history):
        return tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]

    for head in ([system], []):
        full = len(ids([*head, *turns]))
        history = [*head, *turns]
        assert fitted_chat_prompt(tokenizer, history, "m", full + 1).token_ids == ids([*head, *turns])
        assert history == [*head, *turns]
        prompt = fitted_chat_prompt(tokenizer, history, "m", full)  # exactly max_model_len: too long
        assert history == [*head, turns[2]] and prompt.token_ids == ids(history)
        alone = len(ids([*head, turns[2]]))
        assert fitted_chat_prompt(tokenizer, [*head, *turns], "m", alone) is None


def test_bench_json_keeps_the_rows_finished_before_ctrl_c(monkeypatch, tmp_path, capsys):
    """Ctrl-C during the second batch size: the first row reaches --json, marked partial as bench
    serve marks its file, and the exit code is 130."""
    def one_row_then_ctrl_c(*args, results, **kwargs):
        results.append(workloads.WorkloadResult("W-seed", "pagedlab", "bs=1", 1, 8, 4, 0.5,
                                                None, None, None, None, None, None))
        raise KeyboardInterrupt

    monkeypatch.setattr(workloads, "run_bench", one_row_then_ctrl_c)
    out = tmp_path / "rows.json"
    argv = ["bench", "throughput", "--shape", "qwen3-0.6b", "--workload", "W-seed", "--batch-size", "1", "16",
            "--json", str(out), "--device", "cpu"]
    assert main(argv) == 130
    written = json.loads(out.read_text())
    assert [r["label"] for r in written["results"]] == ["bs=1"]
    assert written["error"].startswith("KeyboardInterrupt")
    assert written["partial"] is True and written["interrupted"] == "Ctrl-C"


def test_bench_json_keeps_the_rows_finished_before_a_sigterm(monkeypatch, tmp_path, capsys):
    """A scheduler's time limit (SIGTERM) during the second batch size stops the run as Ctrl-C
    does: the first row reaches --json, marked partial, and the exit code is 143 (128 + SIGTERM).
    Had bench left SIGTERM to the handler it found, that handler would fail the test."""
    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the handler from before the bench")

    def one_row_then_sigterm(*args, results, **kwargs):
        results.append(workloads.WorkloadResult("W-seed", "pagedlab", "bs=1", 1, 8, 4, 0.5,
                                                None, None, None, None, None, None))
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(workloads, "run_bench", one_row_then_sigterm)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        out = tmp_path / "rows.json"
        argv = ["bench", "throughput", "--shape", "qwen3-0.6b", "--batch-size", "1", "16", "--json", str(out),
                "--device", "cpu"]
        assert main(argv) == 143
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, before)
    written = json.loads(out.read_text())
    assert [r["label"] for r in written["results"]] == ["bs=1"]
    assert written["partial"] is True and written["interrupted"] == "SIGTERM"
    assert "marked partial (SIGTERM)" in capsys.readouterr().err
