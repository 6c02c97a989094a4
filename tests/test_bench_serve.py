"""``pagedlab bench serve``'s prompts and figures, without a server: hand-computed references;
and a run stopped part-way (Ctrl-C, SIGTERM, an error), against a stand-in server, keeps the
requests that finished."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedlab.server import bench_serve
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


class _Handler(BaseHTTPRequestHandler):
    """A stand-in for an OpenAI-compatible server: ``/v1/models`` names "fake"; its first
    ``answered`` completions stream 2 tokens at once; the next one sends this process the signal
    ``interrupt`` (SIGINT: Ctrl-C; None: none); later ones are held open until the server stops.
    The server keeps each request's body in ``bodies``."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, "application/json", json.dumps({"data": [{"id": "fake", "vocab_size": 50}]}).encode())

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        server.bodies.append(json.loads(body))
        with server.lock:
            n, server.count = server.count, server.count + 1
        self._send(200, "text/event-stream", b"")
        if n >= server.answered:
            if n == server.answered and server.interrupt is not None:
                os.kill(os.getpid(), server.interrupt)
            server.released.wait(30)
            return
        for chunk in ({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                      {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        if body:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def fake_server():
    servers = []

    def start(answered: int, interrupt: signal.Signals | None = signal.SIGINT) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.count, server.answered, server.interrupt = 0, answered, interrupt
        server.lock, server.released, server.bodies = threading.Lock(), threading.Event(), []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    start.servers = servers
    yield start
    for server in servers:
        server.released.set()
        server.shutdown()
        server.server_close()


BENCH_ARGS = ["--num-prompts", "6", "--input-len", "4", "--output-len", "2", "--max-concurrency", "1",
              "--num-warmups", "1", "--disable-tqdm"]


def _bench(url: str, out) -> int:
    """Six requests one at a time (so each finishes before the next is sent), after one warm-up."""
    try:
        return bench_serve.main(["--base-url", url, *BENCH_ARGS, "--json", str(out)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C or SIGTERM escaped bench serve, and with it the requests that had finished")


@pytest.fixture
def sigterm_unhandled():
    """A SIGTERM that bench serve leaves to the handler it found fails the test (an error the run
    keeps as any other) rather than ending pytest; that handler is this one."""
    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the handler from before bench serve")

    before = signal.signal(signal.SIGTERM, unhandled)
    # a pytest-xdist worker ignores SIGINT (its controller handles Ctrl-C): give this test the
    # handler an interactive process has, which raises KeyboardInterrupt
    before_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield unhandled
    signal.signal(signal.SIGTERM, before)
    signal.signal(signal.SIGINT, before_int)
    # A request task the stop left with its exception unread is collected now: collected later,
    # in the middle of another test's ast.parse, its "Task exception was never retrieved" log
    # parsed its traceback's source there, and Python 3.11 failed the outer parse with
    # "SystemError: AST constructor recursion depth mismatch".
    gc.collect()


STOPS = [pytest.param(signal.SIGINT, 130, "Ctrl-C", id="ctrl-c"),
         pytest.param(signal.SIGTERM, 143, "SIGTERM", id="sigterm")]


@pytest.mark.parametrize("sent, code, reason", STOPS)
def test_a_stop_mid_run_reports_and_saves_the_requests_that_finished(sent, code, reason, fake_server,
                                                                     sigterm_unhandled, tmp_path, capsys):
    """Ctrl-C, and SIGTERM as Ctrl-C (a scheduler's time limit): the exit code says which."""
    out = tmp_path / "run.json"
    assert _bench(fake_server(answered=1 + 3, interrupt=sent), out) == code  # the warm-up and 3 finish
    record = json.loads(out.read_text())
    assert record["partial"] is True and record["interrupted"] == reason
    assert (record["completed"], record["failed"], record["finished_requests"]) == (3, 0, 3)
    assert record["num_prompts"] == 6 and record["output_lens"] == [2, 2, 2]
    assert record["total_output_tokens"] == 6 and record["duration"] > 0
    report = capsys.readouterr().out
    assert f"stopped ({reason}): the figures below cover the 3 of 6 requests that finished" in report
    assert "Successful requests:                     3" in report
    assert signal.getsignal(signal.SIGTERM) is sigterm_unhandled


@pytest.mark.parametrize("sent, code, reason", STOPS)
def test_a_stop_before_any_request_finished_leaves_an_earlier_file(sent, code, reason, fake_server,
                                                                   sigterm_unhandled, tmp_path, capsys):
    out = tmp_path / "run.json"
    out.write_text("earlier")
    assert _bench(fake_server(answered=1, interrupt=sent), out) == code
    assert out.read_text() == "earlier"
    assert f"interrupted before any request finished ({reason})" in capsys.readouterr().err


def test_a_sigterm_from_outside_saves_the_finished_requests_and_exits_143(fake_server, tmp_path):
    """`timeout` or a job scheduler ending the command: its process gets SIGTERM mid-run, writes
    the three requests that finished and exits 143 (128 + SIGTERM)."""
    url, out = fake_server(answered=1 + 3, interrupt=None), tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-m", "pagedlab.server.bench_serve", "--base-url", url,
                                *BENCH_ARGS, "--json", str(out)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    server, deadline = fake_server.servers[-1], time.monotonic() + 60
    while server.count < 1 + 4 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # until the fourth timed request is held open
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    record = json.loads(out.read_text())
    assert record["partial"] is True and record["interrupted"] == "SIGTERM"
    assert record["completed"] == 3 and "stopped (SIGTERM)" in stdout


def _break_the_fourth_timed_request(monkeypatch) -> None:
    sent = []
    real = bench_serve.send_request

    async def breaks_at_the_fourth(*args, **kwargs):
        sent.append(1)
        if len(sent) == 1 + 4:  # after the warm-up
            raise RuntimeError("client broke")
        return await real(*args, **kwargs)

    monkeypatch.setattr(bench_serve, "send_request", breaks_at_the_fourth)


def test_an_error_mid_run_keeps_the_requests_that_finished(fake_server, tmp_path, monkeypatch, capsys):
    """An error escaping a request (here the fourth timed one) stops the run; the three that
    finished are reported and saved, and the requests left are cancelled, not counted as failed."""
    _break_the_fourth_timed_request(monkeypatch)
    out = tmp_path / "run.json"
    assert _bench(fake_server(answered=99, interrupt=None), out) == 1
    record = json.loads(out.read_text())
    assert record["partial"] is True and record["interrupted"] == "RuntimeError: client broke"
    assert (record["completed"], record["failed"], record["finished_requests"]) == (3, 0, 3)
    assert "RuntimeError: client broke" in capsys.readouterr().err


def test_a_run_that_raises_leaves_no_request_running_and_its_state_holds_the_finished(fake_server,
                                                                                      monkeypatch):
    _break_the_fourth_timed_request(monkeypatch)
    specs = bench_serve.random_requests(6, 4, 2, 50)

    async def run() -> bench_serve.BenchmarkState:
        state = bench_serve.BenchmarkState()
        with pytest.raises(RuntimeError, match="client broke"):
            await bench_serve.run_benchmark(fake_server(answered=99, interrupt=None), specs, model="fake",
                                            max_concurrency=1, num_warmups=1, disable_tqdm=True, state=state)
        assert asyncio.all_tasks() == {asyncio.current_task()}  # the requests after it were cancelled
        return state

    state = asyncio.run(run())
    assert [r is not None and r.success for r in state.results] == [True] * 3 + [False] * 3
    assert state.end > state.start
