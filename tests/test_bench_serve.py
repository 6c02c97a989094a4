"""``pagedlab bench serve``'s prompts and figures, without a server: hand-computed references."""

from __future__ import annotations

import json

import pytest

from pagedlab.server.bench_serve import RequestResult, compute_metrics, load_dataset


def test_output_len_flag_overrides_the_datasets_lengths(tmp_path):
    """``--output-len`` is every request's output length, as vLLM's; without it a record's
    ``output_len`` (or ``max_tokens``) holds, and 128 where a record gives none."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (
        {"prompt": "a", "output_len": 4}, {"prompt": "b", "max_tokens": 9}, {"prompt": "c"})))
    assert [s.output_len for s in load_dataset(str(data), 3, 7, shuffle=False)] == [7, 7, 7]
    assert [s.output_len for s in load_dataset(str(data), 3, None, shuffle=False)] == [4, 9, 128]


def test_figures_leave_out_failed_requests_and_one_token_tpot():
    """vLLM's definitions by hand over 2 s: a 5-token request (TTFT 0.1 s, latency 0.5 s, prompt
    10), a 1-token one (TTFT = latency = 0.2 s, prompt 20) and a failed one (prompt 30). Counts and
    throughputs take the two successes only (30 input, 6 output tokens); TPOT is (0.5 - 0.1) / 4 =
    100 ms from the first alone (one token has none); TTFT P99 interpolates 100 and 200 ms."""
    results = [RequestResult(True, 10, 5, 0.1, 0.5, [0.1] * 4), RequestResult(True, 20, 1, 0.2, 0.2),
               RequestResult(False, 30, error="HTTP 500")]
    m = compute_metrics(results, 2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 6)
    assert (m["request_throughput"], m["output_throughput"], m["total_token_throughput"]) == (1.0, 3.0, 18.0)
    assert m["mean_tpot_ms"] == pytest.approx(100) and m["p99_tpot_ms"] == pytest.approx(100)
    assert m["mean_ttft_ms"] == pytest.approx(150) and m["std_ttft_ms"] == pytest.approx(50)
    assert m["p99_ttft_ms"] == pytest.approx(199) and m["mean_e2el_ms"] == pytest.approx(350)
    assert m["mean_itl_ms"] == pytest.approx(100) and m["output_lens"] == [5, 1, 0]


def test_sharegpt_records_are_sampled_as_vllm_samples_them(tmp_path):
    """vLLM's ShareGPT rule with a tokenizer of one token a word: the first turn is the prompt and
    the second's token count the output length; single turns, pairs under 4 tokens, prompts over
    1,024 and pairs over 2,048 are skipped; --output-len replaces the reply's length (and its
    4-token minimum) but not the prompt checks; sampling stops once enough records qualify."""
    def turns(prompt_words: int, reply_words: int | None) -> dict:
        conv = [{"from": "human", "value": "w " * prompt_words}]
        if reply_words is not None:
            conv.append({"from": "gpt", "value": "r " * reply_words})
        return {"conversations": conv}

    records = [turns(5, 7), turns(6, None), turns(3, 9), turns(8, 2), turns(1025, 5), turns(1000, 1049),
               turns(1000, 1048), turns(4, 4)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(records))
    counted = []

    def count_tokens(text: str) -> int:
        counted.append(text)
        return len(text.split())

    specs = load_dataset(str(data), 8, None, shuffle=False, count_tokens=count_tokens)
    assert [(s.prompt.count("w"), s.output_len) for s in specs] == [(5, 7), (1000, 1048), (4, 4)] * 2 + [
        (5, 7), (1000, 1048)]
    assert [(s.prompt.count("w"), s.output_len) for s in load_dataset(
        str(data), 3, 2, shuffle=False, count_tokens=count_tokens)] == [(5, 2), (8, 2), (1000, 2)]
    counted.clear()
    assert len(load_dataset(str(data), 1, None, shuffle=False, count_tokens=count_tokens)) == 1
    assert len(counted) == 2  # the first record qualified: no other was tokenized
    with pytest.raises(ValueError, match="ShareGPT conversation: sizing it needs count_tokens"):
        load_dataset(str(data), 1, None)
