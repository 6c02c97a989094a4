"""``pagedlab bench serve`` against ``vllm bench serve`` (``vllm/benchmarks/serve.py`` and
``lib/endpoint_request_func.py``): the same traffic gives the same figures. Each test checks
one definition on synthetic timings against values worked out by hand."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time

import pytest
import test_bench_serve

from pagedlab.server import bench_serve
from pagedlab.server.bench_metrics import RequestResult, compute_metrics, parse_goodput
from pagedlab.server.bench_results import DETAILED_KEYS, result_filename
from pagedlab.server.bench_traffic import (RampUp, RpsChanges, arrival_times, ramp_up_from_flags,
                                           request_rates, send_times)

fake_server = test_bench_serve.fake_server  # the stand-in server (a fixture)


def test_arrival_times_are_vllms_seeded_gamma_schedule_scaled_to_n_over_rate():
    """vLLM's get_request: gaps drawn by np.random.gamma(shape=burstiness, scale=1/(rate *
    burstiness)) after np.random.seed(seed), summed from the start (the first request waits for
    its gap too), then scaled so the last lands at num_prompts / rate. Seed 0's first three
    gamma(1, 0.5) draws are 0.397937, 0.627965, 0.461612; summed 0.397937, 1.025903, 1.487514;
    times 1.5 / 1.487514: 0.401277, 1.034514, 1.5. pagedlab sent the first request at 0 and slept
    unscaled gaps from Python's random, so its run at the same seed offered other traffic."""
    assert arrival_times(3, 2.0, 1.0, seed=0) == pytest.approx([0.401277, 1.034514, 1.5], abs=1e-6)
    assert arrival_times(40, 8.0, 0.25, seed=3)[-1] == pytest.approx(5.0)  # burstier, same span


def test_burstiness_inf_is_a_constant_gap_and_rate_inf_sends_everything_at_once():
    """vLLM: 'when burstiness tends to infinity, the delay time becomes constant' (1 / rate);
    pagedlab's gamma draw raised ValueError on the second request."""
    assert arrival_times(3, 4.0, float("inf")) == pytest.approx([0.25, 0.5, 0.75])
    assert arrival_times(3, float("inf"), 0.5) == [0.0, 0.0, 0.0]


def test_requests_go_at_their_times_from_the_start_however_slow_the_loop():
    """vLLM sleeps until start + delay_ts[i]; sleeping each gap after the last send pushed every
    later request back by the time spent between sends (here 40 ms a request)."""
    async def sent_at() -> list[float]:
        start, out = time.perf_counter(), []
        async for _ in send_times([0.05, 0.10, 0.15, 0.20]):
            out.append(time.perf_counter() - start)
            time.sleep(0.04)  # a busy loop between sends
        return out

    times = asyncio.run(sent_at())
    assert times == pytest.approx([0.05, 0.10, 0.15, 0.20], abs=0.025)


def test_ramp_up_rates_are_vllms_and_their_gaps_are_not_rescaled():
    """vLLM's _get_current_request_rate over progress i / (n - 1): linear 2 -> 6 over five
    requests is 2, 3, 4, 5, 6 req/s, exponential 1 -> 16 is 1, 2, 4, 8, 16. At burstiness inf the
    gaps are 1/rate, summed and left unscaled (vLLM rescales only without a ramp): 0.5, 0.8333,
    1.0833, 1.2833, 1.45."""
    linear, exponential = RampUp("linear", 2, 6), RampUp("exponential", 1, 16)
    assert request_rates(5, float("inf"), linear) == pytest.approx([2, 3, 4, 5, 6])
    assert request_rates(5, float("inf"), exponential) == pytest.approx([1, 2, 4, 8, 16])
    assert arrival_times(5, float("inf"), float("inf"), ramp_up=linear) == pytest.approx(
        [0.5, 0.5 + 1 / 3, 0.5 + 1 / 3 + 0.25, 1.2833333, 1.45])
    changes = RpsChanges()
    changes.start(linear)
    for rate in (2.0, 3.5, 5.2):
        changes.sent(rate)
    assert [e["rps"] for e in changes.events] == [2, 3, 4, 5]  # each whole rate once, when first reached


@pytest.mark.parametrize("flags, error", [
    (("linear", 2, 6, 4.0), "leave out --request-rate"),
    (("linear", 2, None, float("inf")), "needs both --ramp-up-start-rps and --ramp-up-end-rps"),
    (("linear", 7, 6, float("inf")), "--ramp-up-start-rps 7 is invalid"),
    (("exponential", 0, 6, float("inf")), "--ramp-up-start-rps 0 is invalid"),
    (("linear", 0, 6, float("inf")), "--ramp-up-start-rps 0 is invalid"),
])
def test_ramp_up_flags_are_refused_where_vllm_refuses_them(flags, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        ramp_up_from_flags(*flags)


def test_a_ramp_up_run_saves_vllms_ramp_keys_and_rate_changes(fake_server, tmp_path):
    """Three requests ramped linearly 20 -> 40 req/s go at 20, 30 and 40: the record has vLLM's
    ramp_up_* keys and an rps_change_events entry for each whole rate from 20 to 40."""
    out = tmp_path / "ramp.json"
    assert bench_serve.main(["--base-url", fake_server(answered=99, interrupt=None), "--num-prompts", "3",
                             "--input-len", "4", "--output-len", "2", "--disable-tqdm", "--json", str(out),
                             "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "20",
                             "--ramp-up-end-rps", "40"]) == 0
    record = json.loads(out.read_text())
    assert [record[f"ramp_up_{k}"] for k in ("strategy", "start_rps", "end_rps")] == ["linear", 20, 40]
    assert [e["rps"] for e in record["rps_change_events"]] == list(range(20, 41))
    assert record["request_rate"] == "inf" and record["completed"] == 3


def _result(start: float, ttft: float, itl: list[float], tokens: int, prompt: int = 10) -> RequestResult:
    return RequestResult(True, prompt, tokens, ttft, ttft + sum(itl), list(itl), start_time=start)


def test_peak_output_throughput_counts_chunks_as_vllm_and_peak_concurrency_is_half_open():
    """vLLM counts each streamed chunk (start + TTFT + its ITLs) as one token in 1 s buckets from
    the first start. A: start 0, chunks at 0.2, 0.5, 0.8, 1.1, 8 tokens (2 a chunk); B: start 0.5,
    chunks at 0.6, 0.8; C: start 0.8 (as B ends), chunks at 0.9, 1.3, 2 tokens; D: start 1.1 (as A
    ends), a chunk at 1.3. Bucket 0 holds 3 + 2 + 1 = 6 chunks, bucket 1 three: peak 6.0
    (pagedlab spread each request's tokens over its chunks: 3 * 2 + 2 + 1 = 9). In flight: A and
    B, A and C, then C and D: an end and a start at the same time do not overlap (A, C and D
    would be 3), so the peak is 2."""
    results = [_result(0.0, 0.2, [0.3, 0.3, 0.3], 8), _result(0.5, 0.1, [0.2], 2),
               _result(0.8, 0.1, [0.4], 2), _result(1.1, 0.2, [], 1)]
    m = compute_metrics(results, 2.0)
    assert m["max_output_tokens_per_s"] == 6.0 and m["max_concurrent_requests"] == 2
    none = compute_metrics([RequestResult(False, 10, error="HTTP 500")], 1.0)
    assert (none["max_output_tokens_per_s"], none["max_concurrent_requests"]) == (0.0, 0)  # keys kept


def test_goodput_counts_the_requests_meeting_every_objective_as_vllm():
    """vLLM's goodput over 2 s with --goodput ttft:200 tpot:50: A (TTFT 0.1, latency 0.5, 5
    tokens: TPOT 0.1) misses the TPOT objective; B (TTFT 0.15, one token: TPOT 0 for goodput)
    meets both; C (TTFT 0.2, exactly the objective, 3 tokens over 0.28 s: TPOT 0.04) meets both
    (an objective is met at equality); D fails. 2 good requests / 2 s = 1.0 req/s. Without
    objectives the key is None, as vLLM saves it."""
    results = [_result(0.0, 0.1, [0.1] * 4, 5), _result(0.0, 0.15, [], 1), _result(0.0, 0.2, [0.04, 0.04], 3),
               RequestResult(False, 10, error="HTTP 500")]
    def goodput(*pairs: str) -> float | None:
        return compute_metrics(results, 2.0, goodput=parse_goodput(list(pairs)))["request_goodput"]

    assert goodput("ttft:200", "tpot:50") == 1.0 and goodput("e2el:300") == 1.0  # B and C both times
    assert compute_metrics(results, 2.0)["request_goodput"] is None
    report = bench_serve.format_report(compute_metrics(results, 2.0, goodput={"ttft": 200.0}))
    assert "Request goodput (req/s):                 1.50" in report


@pytest.mark.parametrize("pairs, error", [(["ttft=200"], "KEY:VALUE"), (["ttft:2:0"], "KEY:VALUE"),
                                          (["itl:20"], "the metric is ttft, tpot or e2el"),
                                          (["tpot:-1"], "must not be negative")])
def test_goodput_objectives_are_refused_where_vllm_refuses_them(pairs, error):
    with pytest.raises(ValueError, match=error):
        parse_goodput(pairs)


def test_metric_percentiles_0_and_100_are_the_least_and_the_most_as_numpys_are_in_vllm(capsys):
    """vLLM passes --metric-percentiles straight to np.percentile, where 100 is the largest value
    (a P100 TTFT: the worst request); pagedlab refused anything outside (0, 100)."""
    m = compute_metrics([_result(0.0, t, [], 1) for t in (0.1, 0.4, 0.2)], 1.0, (0, 100), ["ttft"])
    assert (m["p0_ttft_ms"], m["p100_ttft_ms"]) == pytest.approx((100.0, 400.0))
    assert bench_serve.main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--disable-tqdm",
                             "--metric-percentiles", "0,50,100"]) == 2
    assert "could not reach" in capsys.readouterr().err  # the flags passed; only the server is missing
    assert bench_serve.main(["--base-url", "http://127.0.0.1:9", "--metric-percentiles", "100.5"]) == 2
    assert "--metric-percentiles must lie in [0, 100]" in capsys.readouterr().err


def _streamed(chunks: list[dict]) -> RequestResult:
    """``send_request`` against a stand-in stream of these chunks (then [DONE])."""
    import httpx

    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    async def run() -> RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await bench_serve.send_request(client, "http://x/v1/completions", {}, {}, False, 4)

    return asyncio.run(run())


def test_output_tokens_without_usage_are_the_texts_token_count_as_vllm_counts_them():
    """vLLM takes usage.completion_tokens, and where a server gives none tokenizes the generated
    text without special tokens; pagedlab counted the streamed chunks (2 here, where the text
    "Hello world again" is 3 tokens of one word each). Chunks remain the count only where the
    server's /tokenize fails. A count the server did give stays."""
    no_usage = [{"choices": [{"text": "Hello world"}]}, {"choices": [{"text": " again"}]}]
    with_usage = no_usage + [{"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 7}}]
    results = [_streamed(no_usage), _streamed(with_usage), _streamed(no_usage)]
    assert [r.success for r in results] == [True] * 3 and results[0].generated_text == "Hello world again"
    assert bench_serve.count_unreported_output_tokens(results[:2], lambda text: len(text.split())) == 0

    def no_tokenize(text: str) -> int:
        raise ValueError("the server's /tokenize failed: 404")

    assert bench_serve.count_unreported_output_tokens(results[2:], no_tokenize) == 1
    assert [r.output_tokens for r in results] == [3, 7, 2]
    m = compute_metrics(results[:1], 1.0)
    assert m["total_output_tokens"] == 3 and m["mean_tpot_ms"] == pytest.approx(results[0].itl[0] * 1000 / 2)


def test_sharegpt_requests_keep_the_prompt_length_vllm_gives_them(tmp_path):
    """vLLM's ShareGPT sample carries the prompt's token count, the input length of a request
    whose server gives no usage (and of a failed one in input_lens); pagedlab's had None (0)."""
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([{"conversations": [{"value": "w " * 5}, {"value": "r " * 7}]}]))
    spec, = bench_serve.load_dataset(str(data), 1, None, count_tokens=lambda text: len(text.split()))
    assert (spec.prompt_len, spec.output_len) == (5, 7)


def test_client_queue_metrics_and_per_request_keys_are_vllms():
    """With --max-concurrency vLLM also has client_queue_time (start - arrival, the wait for the
    cap) and, at a finite rate, e2el_including_client_queue, when asked for by
    --percentile-metrics. A: latency 0.5, queued 0; B: latency 0.4, queued 0.3; C failed. Queue:
    mean 150 ms; with the queue: 500 and 700 ms, mean 600. Without a cap neither is there, at
    rate inf only the first. latencies, start_times and queue_times cover every request, and a
    failed one's output length is 0."""
    a, b = _result(1.0, 0.1, [0.4], 2), _result(1.0, 0.1, [0.3], 2)
    b.client_queue_time = 0.3
    failed = RequestResult(False, 10, 3, start_time=2.0, error="HTTP 500")
    results, both = [a, b, failed], ["client_queue_time", "e2el_including_client_queue"]
    m = compute_metrics(results, 1.0, (99,), both, max_concurrency=1, request_rate=4.0)
    assert (m["mean_client_queue_time_ms"], m["p99_client_queue_time_ms"]) == pytest.approx((150, 297))
    assert m["mean_e2el_including_client_queue_ms"] == pytest.approx(600)
    assert "mean_client_queue_time_ms" not in compute_metrics(results, 1.0, (99,), both)
    at_once = compute_metrics(results, 1.0, (99,), both, max_concurrency=1)
    assert "mean_client_queue_time_ms" in at_once and "mean_e2el_including_client_queue_ms" not in at_once
    assert (m["latencies"], m["start_times"]) == ([0.5, 0.4, 0.0], [1.0, 1.0, 2.0])
    assert m["queue_times"] == [0.0, 0.3, 0.0]
    assert m["output_lens"] == [2, 2, 0] and m["rtfx"] == 0.0
    report = bench_serve.format_report(m, (99,), both)
    assert "Mean Client Queue Time (ms):             150.00" in report
    assert "P99 E2EL incl. Client Queue (ms):" in report


def test_a_request_waiting_for_the_cap_is_timed_from_its_start_and_its_wait_is_its_queue_time(fake_server):
    """Three requests at once under --max-concurrency 1: each starts once the one before has
    finished, so its queue time is at least the latency before it; TTFT and E2EL start at the
    send, as vLLM's start_time does."""
    specs = bench_serve.random_requests(3, 4, 2, 50)
    results, _ = asyncio.run(bench_serve.run_benchmark(fake_server(answered=99, interrupt=None), specs,
                                                       model="fake", max_concurrency=1, num_warmups=0,
                                                       disable_tqdm=True))
    queue = [r.client_queue_time for r in results]
    assert 0 <= queue[0] < queue[1] < queue[2] and queue[1] >= results[0].latency
    assert results[2].start_time >= results[1].start_time + results[1].latency


VLLM_RESULT_KEYS = {  # vllm/benchmarks/serve.py main_async's result_json without --save-detailed
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "latencies", "queue_times", "max_output_tokens_per_s",
    "max_concurrent_requests", "rtfx",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl"))}


def test_save_result_writes_vllms_file_name_and_keys(fake_server, tmp_path):
    """--save-result with vLLM's defaults (--percentile-metrics ttft,tpot,itl, --metric-percentiles
    99): {label}-{rate}qps-concurrency{C}-{model}-{date}.json in --result-dir, holding vLLM's keys
    (and --metadata's) and no per-request lists; --append-result adds a line; --save-detailed keeps
    the lists. pagedlab had only --json."""
    url, out = fake_server(answered=99, interrupt=None), tmp_path / "results"
    flags = ["--base-url", url, "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
             "--disable-tqdm", "--request-rate", "50", "--max-concurrency", "2", "--percentile-metrics",
             "ttft,tpot,itl", "--metric-percentiles", "99", "--goodput", "ttft:60000", "--result-dir",
             str(out), "--label", "lab"]
    assert bench_serve.main([*flags, "--save-result", "--metadata", "gpu=h100", "tp=1"]) == 0
    path, = out.glob("lab-50.0qps-concurrency2-fake-*.json")
    record = json.loads(path.read_text())
    assert set(record) == VLLM_RESULT_KEYS | {"gpu", "tp"}
    assert [record[k] for k in ("backend", "label", "model_id", "gpu")] == ["openai", "lab", "fake", "h100"]
    assert record["request_goodput"] == pytest.approx(2 / record["duration"])
    assert bench_serve.main([*flags, "--append-result", "--save-detailed", "--result-filename",
                             path.name]) == 0
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first == record and set(second) == VLLM_RESULT_KEYS | set(DETAILED_KEYS)


def test_result_file_names_and_backend_are_vllms():
    """compute_result_filename's two forms, and --backend openai-chat for the chat endpoint."""
    args = argparse.Namespace(max_concurrency=None, label=None, endpoint="/v1/chat/completions",
                              ramp_up_strategy="linear", ramp_up_start_rps=1, ramp_up_end_rps=8,
                              request_rate=float("inf"), result_filename=None, result_dir="d")
    assert result_filename(args, "org/Model-8B", "20250101-000000") == os.path.join(
        "d", "openai-chat-ramp-up-linear-1qps-8qps-Model-8B-20250101-000000.json")
    args.ramp_up_strategy, args.endpoint, args.max_concurrency = None, "/v1/completions", 16
    assert result_filename(args, "Model", "D") == os.path.join("d",
                                                               "openai-infqps-concurrency16-Model-D.json")


def test_a_bad_metadata_item_is_refused_before_any_request(capsys):
    """vLLM refuses it after the whole run, losing the results; here before the server is reached."""
    assert bench_serve.main(["--base-url", "http://127.0.0.1:9", "--save-result", "--metadata", "gpu"]) == 2
    assert "--metadata 'gpu' is invalid: give KEY=VALUE pairs" in capsys.readouterr().err


def test_random_prompts_ignore_eos_as_vllms_random_dataset(fake_server, tmp_path):
    """vLLM's main_async: 'when using random datasets, default to ignoring EOS so generation runs
    to the requested length'. pagedlab sent random prompts without ignore_eos unless asked, so a
    sampled EOS cut outputs short of --output-len and the two tools measured other workloads. A
    --dataset run still leaves EOS to the flag."""
    url = fake_server(answered=99, interrupt=None)
    common = ["--base-url", url, "--num-prompts", "2", "--output-len", "2", "--disable-tqdm"]
    assert bench_serve.main([*common, "--input-len", "4"]) == 0
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "a b c"}))
    assert bench_serve.main([*common, "--dataset", str(data)]) == 0
    bodies = fake_server.servers[-1].bodies
    assert [b.get("ignore_eos") for b in bodies if isinstance(b["prompt"], list)] == [True] * 2
    assert [b.get("ignore_eos") for b in bodies if isinstance(b["prompt"], str)] == [None] * 2


def test_warm_ups_are_none_by_default_and_each_repeats_the_first_requests_input(fake_server):
    """vLLM's --num-warmups is 0 by default, and each warm-up sends input_requests[0]; pagedlab
    sent one by default and cycled through the requests, so with --num-warmups 3 requests 1 and
    2 went to the server (and its prefix cache) before they were timed."""
    url = fake_server(answered=99, interrupt=None)
    common = ["--base-url", url, "--num-prompts", "3", "--input-len", "4", "--output-len", "2",
              "--max-concurrency", "1", "--disable-tqdm"]
    assert bench_serve.main(common) == 0
    bodies = fake_server.servers[-1].bodies
    assert len(bodies) == 3  # no warm-up
    del bodies[:]
    assert bench_serve.main([*common, "--num-warmups", "3"]) == 0
    warm, timed = bodies[:3], bodies[3:]
    assert len(timed) == 3 and warm == [timed[0]] * 3 and timed[1] != timed[0]


def test_the_report_prints_a_configured_rate_only_when_finite_as_vllm():
    """vLLM prints "Request rate configured (RPS):" only for a finite rate; pagedlab printed
    "inf" in its place, so the two reports differed line for line."""
    m = compute_metrics([_result(0.0, 0.1, [0.1], 2)], 1.0)
    assert "Request rate configured" not in bench_serve.format_report(m, request_rate=float("inf"))
    assert "Request rate configured (RPS):           4.00" in bench_serve.format_report(m, request_rate=4.0)


def test_an_error_event_fails_the_request_on_purpose_where_vllm_skips_it():
    """Deliberately not vLLM's: its client skips a chunk without choices or usage, so a stream
    that sent a token and then an error event counts as successful there; here it is failed."""
    result = _streamed([{"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}}])
    assert not result.success and "engine died" in result.error
