"""Prometheus metrics of a serving engine, named like vLLM's (``vllm:`` becomes ``pagedlab:``).

Gauges are read from the engine's latest stats at scrape time; counters advance with the engine's
own token counters after every step; latency histograms are observed when a request finishes.

| metric | type | meaning |
|---|---|---|
| pagedlab:num_requests_running | gauge | sequences in the running batch |
| pagedlab:num_requests_waiting | gauge | sequences waiting to be scheduled |
| pagedlab:kv_cache_usage_perc | gauge | used share of the KV cache blocks (0..1) |
| pagedlab:kv_cache_blocks_used / _total | gauge | KV cache blocks in use / in the pool |
| pagedlab:prefix_cache_hit_rate | gauge | prefix-cache hit tokens / queried tokens since the last reset |
| pagedlab:prefix_cache_queries_total / _hits_total | counter | prompt tokens looked up / found in the cache |
| pagedlab:prompt_tokens_total | counter | prompt tokens run through the model (prefill, recompute) |
| pagedlab:generation_tokens_total | counter | tokens generated |
| pagedlab:num_preemptions_total | counter | sequences preempted (recomputed later) |
| pagedlab:spec_decode_num_drafts_total | counter | speculative decoding: proposals verified |
| pagedlab:spec_decode_num_draft_tokens_total | counter | speculative decoding: tokens proposed |
| pagedlab:spec_decode_num_accepted_tokens_total | counter | speculative decoding: tokens accepted |
| pagedlab:spec_decode_num_accepted_tokens_per_pos_total{position} | counter | accepted at each position |
| pagedlab:request_success_total{finished_reason} | counter | requests finished by stop or length |
| pagedlab:request_aborted_total | counter | requests aborted (client gone, error) |
| pagedlab:time_to_first_token_seconds | histogram | arrival to first token |
| pagedlab:time_per_output_token_seconds | histogram | mean gap between output tokens, per request |
| pagedlab:e2e_request_latency_seconds | histogram | arrival to finish |
| pagedlab:request_prompt_tokens / _generation_tokens | histogram | tokens per request |
"""

from __future__ import annotations

import threading
import time

from pagedlab.outputs import EngineStats, RequestOutput

PREFIX = "pagedlab:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    """The metrics of one engine in their own registry; a ``StatsListener`` of the AsyncEngine.

    ``render()`` returns the Prometheus text exposition and its content type.
    """

    def __init__(self, model_name: str = "", registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # no *_created series next to every counter (as vLLM)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._stats: EngineStats | None = None
        self._last: dict[str, int | tuple[int, ...]] = {}
        self._lock = threading.Lock()
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def gauge(name, doc, fn):
            g = Gauge(PREFIX + name, doc, labels, registry=self.registry)
            g.labels(**self._labels).set_function(lambda: float(fn(self._stats)) if self._stats else 0.0)
            return g

        gauge("num_requests_running", "Sequences in the running batch.", lambda s: s.num_running)
        gauge("num_requests_waiting", "Sequences waiting to be scheduled.", lambda s: s.num_waiting)
        gauge("kv_cache_usage_perc", "Used share of the KV cache blocks (1 = full).",
              lambda s: s.kv_cache_usage)
        gauge("kv_cache_blocks_used", "KV cache blocks in use.", lambda s: s.kv_blocks_used)
        gauge("kv_cache_blocks_total", "KV cache blocks in the pool.", lambda s: s.num_kv_blocks)
        gauge("prefix_cache_hit_rate", "Prefix-cache hit tokens over queried tokens since the last reset.",
              lambda s: s.prefix_cache_hit_rate)

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens",
                                     "Prompt tokens run through the model (prefill and recompute).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (to be recomputed).")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative proposals verified.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Speculative tokens accepted at each position of a proposal.",
                                             ["position"])
        self.request_success = counter("request_success",
                                       "Requests finished by a stop condition, length or repetition.",
                                       ["finished_reason"])
        self.request_aborted = counter("request_aborted", "Requests aborted (client disconnected, error).")
        for c in (self.prompt_tokens, self.generation_tokens, self.prefix_queries, self.prefix_hits,
                  self.preemptions, self.request_aborted, self.spec_drafts, self.spec_draft_tokens,
                  self.spec_accepted):
            c.labels(**self._labels)
        for reason in ("stop", "length", "repetition"):
            self.request_success.labels(finished_reason=reason, **self._labels)

        self._add_histograms(Histogram, labels)

    def _add_histograms(self, Histogram, labels: list[str]) -> None:
        def histogram(name, doc, buckets):
            h = Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)
            return h.labels(**self._labels)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.",
                              TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time between output tokens of one request (after the first).",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the end of the request.",
                             E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per request (all n completions).",
                                                   TOKEN_BUCKETS)

    def _counters(self) -> tuple:
        """(EngineStats field, the counter that follows it)."""
        return (("prompt_tokens_computed", self.prompt_tokens), ("generation_tokens", self.generation_tokens),
                ("prefix_cache_queried_tokens", self.prefix_queries),
                ("prefix_cache_hit_tokens", self.prefix_hits), ("num_preemptions", self.preemptions),
                ("spec_decode_num_drafts", self.spec_drafts),
                ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                ("spec_decode_num_accepted_tokens", self.spec_accepted))

    def count_from(self, stats: EngineStats | None) -> None:
        """Count from the engine's state now: what it ran before the server (an ``LLM`` that
        generated offline before ``AsyncEngine.from_llm``) is not the server's."""
        if stats is not None:
            with self._lock:
                self._last.update({key: getattr(stats, key) for key, _ in self._counters()})
                self._last["per_pos"] = stats.spec_decode_num_accepted_tokens_per_pos

    # ---- StatsListener (called from the engine thread) ------------------------------------
    def on_stats(self, stats: EngineStats) -> None:
        with self._lock:
            self._stats = stats
            for key, counter in self._counters():
                value = getattr(stats, key)
                last = self._last.get(key, 0)
                if value < last:  # the engine reset its counters (re-plan, reset_stats)
                    last = 0
                if value > last:
                    counter.labels(**self._labels).inc(value - last)
                self._last[key] = value
            self._count_per_position(stats.spec_decode_num_accepted_tokens_per_pos)

    def _count_per_position(self, counts: tuple[int, ...]) -> None:
        last = self._last.get("per_pos", ())
        if sum(counts) < sum(last):  # the engine reset its counters
            last = ()
        for position, value in enumerate(counts):
            done = last[position] if position < len(last) else 0
            if value > done:
                self.spec_accepted_per_pos.labels(position=str(position), **self._labels).inc(value - done)
        self._last["per_pos"] = counts

    def on_request_finished(self, output: RequestOutput) -> None:
        reasons = [c.finish_reason for c in output.outputs]
        if "abort" in reasons:
            self.request_aborted.labels(**self._labels).inc()
        else:
            reason = next((r for r in ("length", "repetition") if r in reasons), "stop")
            self.request_success.labels(finished_reason=reason, **self._labels).inc()
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            n = m.num_generated_tokens
            if n > 1 and m.last_token_time is not None:
                self.tpot.observe(max(0.0, (m.last_token_time - m.first_token_time) / (n - 1)))
        # now, when its last completion has finished: m holds the times of its first completion only
        self.e2e.observe(max(0.0, time.time() - m.arrival_time))

    # ---- exposition -----------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` from a Prometheus text exposition, plus ``{"name": value}``
    summed over label sets (handy for tests and the benchmark)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values
