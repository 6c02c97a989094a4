"""The command line on the embedded model: generate (text and JSON) and streamed chat."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import hf_greedy

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "pagedlab.cli"]
SMALL = ["--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "512"]


def run(args, stdin=None):
    return subprocess.run(CLI + args, input=stdin, capture_output=True, text=True, timeout=300,
                          env=os.environ)


def test_generate_json_matches_hf(smollm2_dir, smollm2_hf):
    model, tokenizer = smollm2_hf
    prompts = ["The capital of Italy is", "1, 2, 3, 4,"]
    result = run(["generate", "--prompt", prompts[0], "--prompt", prompts[1], "--max-tokens", "8", "--json",
                  "--quiet"] + SMALL)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    for row, prompt in zip(rows, prompts):
        expected = hf_greedy(model, tokenizer(prompt).input_ids, 8)
        assert row["token_ids"] == expected
        assert row["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert row["finish_reason"] in ("stop", "length")


def test_chat_streams_replies_for_each_turn(smollm2_dir, smollm2_hf):
    model, tokenizer = smollm2_hf
    result = run(["chat", "--max-tokens", "12"] + SMALL, stdin="Hello!\nWhat is 2+2?\n")
    assert result.returncode == 0, result.stderr
    history, replies = [], []
    for question in ("Hello!", "What is 2+2?"):  # the second turn sees the first and its reply
        history.append({"role": "user", "content": question})
        turn = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        reply_ids = hf_greedy(model, tokenizer(turn, add_special_tokens=False).input_ids, 12)
        replies.append(tokenizer.decode(reply_ids, skip_special_tokens=True))
        history.append({"role": "assistant", "content": replies[-1]})
    assert result.stdout == "".join(f"{reply}\n" for reply in replies)


def test_bad_model_is_a_clear_error_without_traceback():
    result = run(["generate", "--model", "/no/such/dir", "--prompt", "hi"])
    assert result.returncode == 2
    assert "model '/no/such/dir' does not exist" in result.stderr
    assert "Traceback" not in result.stderr
