"""``pagedlab bench serve``'s figures: a request's streamed timings (``RequestResult``), the
run's metrics in ``vllm bench serve``'s names (``compute_metrics``) and its report
(``format_report``), as ``vllm/benchmarks/serve.py`` computes and prints them."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlab.stats import describe, percentile_label

METRICS = ("ttft", "tpot", "itl", "e2el")
QUEUE_METRICS = ("client_queue_time", "e2el_including_client_queue")  # vLLM's, with --max-concurrency
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency",
                 "client_queue_time": "Client-side Queueing",
                 "e2el_including_client_queue": "Queue-inclusive End-to-end Latency"}
METRIC_LABELS = {"client_queue_time": "Client Queue Time",
                 "e2el_including_client_queue": "E2EL incl. Client Queue"}


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""
    client_queue_time: float = 0.0  # from its arrival to its start: the wait for --max-concurrency



def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """vLLM's peak output token throughput and peak concurrent requests (0.0 and 0 for no
    successful request). The first is the most streamed chunks in one 1-second bucket from the
    first request's start, each chunk at start + TTFT + its ITLs counted as one token, as vLLM
    counts them (a chunk of several tokens counts one). The second is the most requests in flight
    at once, each over [start, start + latency): one ending as another starts does not overlap it."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    buckets: dict[int, int] = {}
    for r in ok:
        t = r.start_time + r.ttft
        for gap in [0.0, *r.itl]:
            t += gap
            buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    live = peak = 0
    for _, change in events:  # an end (-1) sorts before a start (+1) at the same time
        live += change
        peak = max(peak, live)
    return float(max(buckets.values())), peak


GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``--goodput ttft:200 tpot:50`` as vLLM's ``parse_goodput`` and ``check_goodput_args`` read
    it: service-level objectives in ms, of ``ttft``, ``tpot`` and ``e2el``, none negative."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            slo = float(value) if sep else float("nan")
        except ValueError:
            slo = float("nan")
        if slo != slo:  # NaN: no number
            raise ValueError(f"--goodput {pair!r} is invalid: give KEY:VALUE pairs, the value in ms")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r} is invalid: the metric is ttft, tpot or e2el")
        if slo < 0:
            raise ValueError(f"--goodput {pair!r} is invalid: the objective must not be negative")
        slos[name] = slo
    return slos


def _tpot(r: RequestResult) -> float | None:
    """A request's time per output token after the first (s); None with one output token or none."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def _good(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a successful request meets every objective (ms), as vLLM's goodput counts it: its
    TPOT is 0 where it has one output token or none."""
    tpot = _tpot(r)
    values = {"ttft": r.ttft, "tpot": 0.0 if tpot is None else tpot, "e2el": r.latency}
    return all(slo / 1000.0 >= values[name] for name, slo in slos.items())


def _series(ok: list[RequestResult], max_concurrency: int | None, request_rate: float) -> dict[str, list]:
    """Each metric's values (s) over the successful requests; the queue metrics only where vLLM
    has them: with a concurrency cap, and the queue-inclusive latency at a finite rate too."""
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [tpot for r in ok if (tpot := _tpot(r)) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    if max_concurrency is not None:
        series["client_queue_time"] = [r.client_queue_time for r in ok]
        if request_rate != float("inf"):
            series["e2el_including_client_queue"] = [r.latency + r.client_queue_time for r in ok]
    return series


def compute_metrics(results: list[RequestResult], duration: float, percentiles=(50, 90, 99),
                    selected=METRICS, goodput: dict[str, float] | None = None,
                    max_concurrency: int | None = None, request_rate: float = float("inf")) -> dict:
    """vLLM's ``bench serve`` figures, in its key names (times in ms); ``request_goodput`` (the
    successful requests meeting every ``goodput`` objective, per second) None without objectives.
    A ``selected`` queue metric is left out where vLLM leaves it out (``_series``)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)

    def per_s(count: float) -> float:
        return count / duration if duration else 0.0

    m: dict = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(sum(_good(r, goodput) for r in ok)) if goodput else None,
        "output_throughput": per_s(total_out), "total_token_throughput": per_s(total_in + total_out),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results], "start_times": [r.start_time for r in results],
        "queue_times": [r.client_queue_time for r in results],
        "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results],
    }
    m["max_output_tokens_per_s"], m["max_concurrent_requests"] = _peaks(ok)
    m["rtfx"] = 0.0  # vLLM's inverse real-time factor of audio input: none here
    series = _series(ok, max_concurrency, request_rate)
    for name in (n for n in selected if n in series):
        described = describe([x * 1000.0 for x in series[name]], percentiles)
        for stat in ("mean", "median", "std"):
            m[f"{stat}_{name}_ms"] = described[stat]
        for p in percentiles:
            m[f"p{percentile_label(p)}_{name}_ms"] = described[percentile_label(p)]
    return m


def format_report(m: dict, percentiles=(50, 90, 99), selected=METRICS, max_concurrency=None,
                  request_rate=None) -> str:
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(label, value, fmt="{:<10.2f}"):
        lines.append(f"{label:<40} {fmt.format(value) if not isinstance(value, str) else value}")

    row("Successful requests:", m["completed"], "{:<10}")
    row("Failed requests:", m["failed"], "{:<10}")
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency, "{:<10}")
    if request_rate is not None and request_rate != float("inf"):  # vLLM leaves out an unlimited rate
        row("Request rate configured (RPS):", request_rate)
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    if m.get("request_goodput") is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"])
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for name in (n for n in selected if f"mean_{n}_ms" in m):
        title = METRIC_TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        upper = METRIC_LABELS.get(name, name.upper())
        row(f"Mean {upper} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {upper} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{percentile_label(p)} {upper} (ms):", m[f"p{percentile_label(p)}_{name}_ms"])
    lines.append("=" * w)
    return "\n".join(lines)
