"""``pagedlab bench serve``: load-test an OpenAI-compatible server the way ``vllm bench serve`` does.

Requests go out at ``--request-rate`` per second (Poisson arrivals, or gamma with
``--burstiness``, on vLLM's seeded schedule: ``pagedlab.server.bench_traffic``; ``inf`` sends
them all at once), at most ``--max-concurrency`` in flight, and stream their tokens back. The
report and the ``--json`` file use vLLM's names:

- request throughput (req/s), output and total token throughput (tok/s);
- TTFT: time to the first streamed chunk; TPOT: (latency - TTFT) / (output tokens - 1), per
  request; ITL: the gaps between streamed chunks; E2EL: request latency, all in ms with mean,
  median, std and the ``--metric-percentiles`` (default 50, 90, 99, and E2EL reported too: a
  superset of vLLM's default 99 over TTFT, TPOT and ITL, its keys included with its values);
- goodput (``--goodput``), peaks, and the queue metrics under ``--max-concurrency``
  (``pagedlab.server.bench_metrics``); the result files (``pagedlab.server.bench_results``).

Where pagedlab differs from ``vllm bench serve`` on purpose, docs/server.md says so and why.

Prompts are random token ids (``--input-len``, ``--output-len``, ``--random-range-ratio``,
``--random-prefix-len``: exact lengths, no tokenizer needed; the vocabulary size comes from the
server's ``/v1/models``), or a ``--dataset`` file: JSON/JSONL records with ``prompt`` (text or
token ids) or ``prompt_token_ids``, optional ``output_len``/``max_tokens``; ShareGPT files
(``conversations``) are sampled as vLLM's ShareGPT dataset (``sharegpt_spec``), their turns
tokenized by the server's ``/tokenize`` (``pagedlab.server.bench_prompts``). Input and output
token counts are the server's ``usage``; an output it gives none for is its text's token count
by ``/tokenize`` (``count_unreported_output_tokens``), as vLLM tokenizes it.

A run stopped part-way (Ctrl-C, SIGTERM, an error) still reports the requests that finished,
and writes them to ``--json`` marked ``"partial": true``, with the reason in ``"interrupted"``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

from pagedlab.interrupt import (Terminated, interrupted_exit, run_until_sigterm, sigterm_as_interrupt,
                                stop_reason)
from pagedlab.server.bench_metrics import (METRICS, QUEUE_METRICS, RequestResult, compute_metrics,
                                           format_report, parse_goodput)
from pagedlab.server.bench_results import add_result_args, check_result_paths, save_results
from pagedlab.server.bench_prompts import RequestSpec, check_range_ratio, load_dataset, random_requests
from pagedlab.server.bench_traffic import (RAMP_UP_STRATEGIES, RampUp, RpsChanges, arrival_times,
                                           check_arrivals, ramp_up_from_flags, request_rates, send_times)

@dataclass
class BenchmarkState:
    """A run's results as its requests finish (``run_benchmark(state=...)``), so a run stopped
    part-way (Ctrl-C, an error) still has those that finished: ``results`` in spec order (None
    for a request not finished), ``start`` and ``end`` the perf_counter times of the timed part."""

    results: list[RequestResult | None] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    rps_changes: RpsChanges = field(default_factory=RpsChanges)

    def finished(self) -> list[RequestResult]:
        """The finished requests' results (successes and failures), in spec order."""
        return [r for r in self.results if r is not None]


def _auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---- one request ----------------------------------------------------------------------------
def _payload(spec: RequestSpec, model: str, chat: bool, args) -> dict:
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        if not isinstance(spec.prompt, str):
            raise ValueError("the chat endpoint needs text prompts: use a text --dataset or /v1/completions")
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        body["max_completion_tokens"] = spec.output_len
    else:
        body["prompt"] = spec.prompt
        body["max_tokens"] = spec.output_len
    if args.ignore_eos:
        body["ignore_eos"] = True
    for name in ("temperature", "top_p", "top_k", "min_p"):
        value = getattr(args, name, None)
        if value is not None:
            body[name] = value
    return body


async def send_request(client, url: str, headers: dict, body: dict, chat: bool, prompt_len: int | None
                       ) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len or 0)
    start = time.perf_counter()
    result.start_time = start
    last = start
    chunks = 0
    usage = None
    texts = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {detail[:500]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:500]
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices")
                if choices:
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                    c = choices[0]
                    texts.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
        result.latency = last - start
        result.generated_text = "".join(texts)
        if usage is not None:  # else 0, for count_unreported_output_tokens after the run, as vLLM
            result.output_tokens = int(usage.get("completion_tokens") or 0)
            result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
        if chunks == 0:
            result.error = "the stream carried no tokens"
            return result
        result.success = True
    except Exception as e:  # every failure is recorded; the run goes on
        result.error = f"{type(e).__name__}: {e}"
    return result


# ---- the run --------------------------------------------------------------------------------
async def _send_all(state: BenchmarkState, times: list[float], rates: list[float], ramp_up: RampUp | None,
                    one) -> None:
    """Start request ``i`` (``one(i, arrival)``) at ``times[i]`` and wait for them all; on a stop (Ctrl-C
    cancels this task; an error would leave the others running) the requests in flight are
    cancelled. ``state`` gets the timed part's start and end, and a ramp's rate changes."""
    state.rps_changes.start(ramp_up)
    state.start = time.perf_counter()
    tasks = []
    try:
        async for i in send_times(times):
            state.rps_changes.sent(rates[i])
            tasks.append(asyncio.create_task(one(i, time.perf_counter())))
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        state.end = time.perf_counter()


async def run_benchmark(base_url: str, specs: list[RequestSpec], *, model: str,
                        endpoint: str = "/v1/completions",
                        request_rate: float = float("inf"), burstiness: float = 1.0,
                        max_concurrency: int | None = None, api_key: str | None = None, num_warmups: int = 0,
                        seed: int = 0, timeout: float = 6 * 3600, disable_tqdm: bool = False, sampling=None,
                        state: BenchmarkState | None = None, ramp_up: RampUp | None = None
                        ) -> tuple[list[RequestResult], float]:
    """Send every request; returns the results (in spec order) and the benchmark duration (s).
    ``state`` (a ``BenchmarkState``) receives each result as its request finishes: what a caller
    has of a run that raised or was cancelled part-way (the requests in flight then are cancelled)."""
    import httpx

    times = arrival_times(len(specs), request_rate, burstiness, seed, ramp_up)
    rates = request_rates(len(specs), request_rate, ramp_up)
    state = state if state is not None else BenchmarkState()
    sampling = sampling or argparse.Namespace(ignore_eos=False)
    url = base_url.rstrip("/") + endpoint
    chat = endpoint.rstrip("/").endswith("chat/completions")
    headers = _auth_headers(api_key)
    bodies = [_payload(s, model, chat, sampling) for s in specs]
    if max_concurrency is not None and max_concurrency < 0:
        raise ValueError(f"--max-concurrency={max_concurrency} is invalid: it must be >= 0 (0 or None: no "
                         "cap)")
    max_concurrency = max_concurrency or None  # 0 caps nothing (a pool of 0 connections hung)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as client:
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def warm_up() -> RequestResult:  # vLLM's: the first request's input, under the cap
            async with semaphore or contextlib.nullcontext():
                return await send_request(client, url, headers, bodies[0], chat, specs[0].prompt_len)

        for r in await asyncio.gather(*(warm_up() for _ in range(num_warmups))):
            if not r.success:
                raise RuntimeError(f"the warm-up request to {url} failed: {r.error}")
        progress = None
        if not disable_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(specs), desc="bench serve", unit="req", dynamic_ncols=True)
        state.results = [None] * len(specs)

        async def one(i: int, arrival: float) -> None:
            async with semaphore or contextlib.nullcontext():
                result = await send_request(client, url, headers, bodies[i], chat, specs[i].prompt_len)
            result.client_queue_time = result.start_time - arrival  # vLLM's: its wait for the cap
            state.results[i] = result
            if progress is not None:
                progress.update(1)

        try:
            await _send_all(state, times, rates, ramp_up, one)
        finally:
            if progress is not None:
                progress.close()
    return state.results, state.end - state.start


# ---- CLI ----------------------------------------------------------------------------------------
def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None,
                   help="server URL, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token ($OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once (default: inf)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival intervals: 1 = Poisson, < 1 burstier, > 1 steadier, "
                        "inf = a constant 1/rate")
    p.add_argument("--ramp-up-strategy", choices=RAMP_UP_STRATEGIES, default=None,
                   help="move the request rate from --ramp-up-start-rps to --ramp-up-end-rps over the run "
                        "(vLLM's; instead of --request-rate)")
    p.add_argument("--ramp-up-start-rps", type=int, default=None)
    p.add_argument("--ramp-up-end-rps", type=int, default=None)
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default, or 0: no cap; vLLM refuses 0)")
    p.add_argument("--input-len", type=int, default=1024, help="random prompts: input tokens (default: 1024)")
    p.add_argument("--output-len", type=int, default=None,
                   help="output tokens per request, over the dataset's (default: its output_len, else 128)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random prompts: lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--random-prefix-len", type=int, default=0, help="random prompts: shared prefix tokens")
    p.add_argument("--dataset", default=None, help="JSON/JSONL prompts file instead of random prompts")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly the output length (always, as in vLLM, for random prompts)")
    p.add_argument("--temperature", type=float, default=None, help="(default: the server's, 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=0,
                   help="untimed requests sent first, all at once under --max-concurrency, each with the "
                        "first request's input (default: 0, as vLLM's)")
    p.add_argument("--percentile-metrics", default=",".join(METRICS),
                   help="of ttft,tpot,itl,e2el and, with --max-concurrency, client_queue_time and (at a "
                        "finite --request-rate) e2el_including_client_queue (default: the first four)")
    p.add_argument("--metric-percentiles", default="50,90,99",
                   help="percentiles to report (default: 50,90,99)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:VALUE",
                   help="service-level objectives in ms (ttft, tpot, e2el), e.g. ttft:200 tpot:50: report "
                        "request goodput, the requests per second meeting them all (vLLM's)")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="per-request timeout in seconds")
    p.add_argument("--disable-tqdm", action="store_true")
    add_result_args(p)


def _server_model(client_url: str, api_key: str | None) -> tuple[str, dict]:
    import httpx

    headers = _auth_headers(api_key)
    resp = httpx.get(client_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    resp.raise_for_status()
    data = resp.json()["data"]
    if not data:
        raise RuntimeError("the server lists no models")
    return data[0]["id"], data[0]


@contextlib.contextmanager
def _server_token_counter(base_url: str, model: str, api_key: str | None, add_special_tokens: bool = True):
    """``count_tokens(text)``: the token count of ``text`` by the server's ``/tokenize`` (its
    model's tokenizer; with special tokens added, as vLLM's ShareGPT sampling counts a prompt, or
    without, as vLLM counts an output); a ValueError when ``/tokenize`` fails."""
    import httpx

    headers = _auth_headers(api_key)
    with httpx.Client(base_url=base_url, headers=headers, timeout=30.0) as client:
        def count_tokens(text: str) -> int:
            try:
                resp = client.post("/tokenize", json={"model": model, "prompt": text,
                                                      "add_special_tokens": add_special_tokens})
                resp.raise_for_status()
                return int(resp.json()["count"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"the server's /tokenize (which sizes ShareGPT turns, and outputs "
                                 f"it gave no usage for) failed: {e}") from None

        yield count_tokens


def count_unreported_output_tokens(results: list[RequestResult], count_tokens) -> int:
    """Give each successful request whose server reported no output tokens (no ``usage``, or 0)
    the token count of its text, ``count_tokens(text)``, as vLLM's calculate_metrics tokenizes
    ``generated_text`` without special tokens; where that fails (a server without ``/tokenize``),
    its number of streamed chunks. Returns how many requests were counted by chunks."""
    by_chunks = 0
    for r in results:
        if r.success and not r.output_tokens:
            try:
                r.output_tokens = count_tokens(r.generated_text)
            except ValueError:
                r.output_tokens, by_chunks = len(r.itl) + 1, by_chunks + 1
    return by_chunks


def _count_outputs_without_usage(results: list[RequestResult], base_url: str, model: str,
                                 api_key: str | None) -> None:
    """``count_unreported_output_tokens`` by the server's ``/tokenize``, saying so on stderr."""
    missing = sum(r.success and not r.output_tokens for r in results)
    if not missing:
        return
    with _server_token_counter(base_url, model, api_key, add_special_tokens=False) as count_tokens:
        by_chunks = count_unreported_output_tokens(results, count_tokens)
    print(f"bench serve: the server reported no output tokens (usage) for {missing} requests: counted "
          + (f"their streamed chunks ({by_chunks}), as /tokenize failed" if by_chunks else
             "their text by its /tokenize"), file=sys.stderr)


@dataclass
class _Checked:
    """What the flags ask for, checked: the percentiles and metrics to report, and the ramp."""

    percentiles: list[float]
    selected: list[str]
    ramp_up: RampUp | None
    goodput: dict[str, float]


def _checked_flags(args: argparse.Namespace) -> _Checked:
    """What the flags ask for; a ValueError naming a bad flag before any request (a --json path
    that cannot be written too: its folder is made, the file written after the run)."""
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in selected if m not in METRICS + QUEUE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics has unknown {unknown}: choose from "
                         f"{list(METRICS + QUEUE_METRICS)}")
    if any(not 0 <= p <= 100 for p in percentiles):  # 0 and 100: the least and the most, as numpy's
        raise ValueError("--metric-percentiles must lie in [0, 100]")
    for flag, value, least in (("--num-prompts", args.num_prompts, 1), ("--input-len", args.input_len, 1),
                               ("--output-len", args.output_len, 1), ("--num-warmups", args.num_warmups, 0),
                               ("--max-concurrency", args.max_concurrency, 0),
                               ("--random-prefix-len", args.random_prefix_len, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} {value} is invalid: it must be at least {least}")
    check_arrivals(args.request_rate, args.burstiness)
    ramp_up = ramp_up_from_flags(args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps,
                                 args.request_rate)
    check_range_ratio(args.random_range_ratio)
    check_result_paths(args)
    return _Checked(percentiles, selected, ramp_up, parse_goodput(args.goodput))


def _requests(args: argparse.Namespace, base_url: str) -> tuple[str, str, list[RequestSpec]]:
    """The model to name in requests, the model id to record (vLLM's: ``--model``, else the
    server's first model's root) and the requests to send; a ValueError says why there are none."""
    try:
        served, card = _server_model(base_url, args.api_key)
    except Exception as e:
        raise ValueError(f"could not reach {base_url}/v1/models: {e}") from None
    model = args.model or served
    model_id = args.model or card.get("root") or served
    if args.dataset:
        with _server_token_counter(base_url, model, args.api_key) as count_tokens:
            return model, model_id, load_dataset(args.dataset, args.num_prompts, args.output_len, args.seed,
                                                 count_tokens=count_tokens)
    args.ignore_eos = True  # as vLLM's random dataset: each request runs to its length
    vocab = card.get("vocab_size")
    if not vocab:
        raise ValueError("random prompts need the vocabulary size, and the server's /v1/models does "
                         "not give 'vocab_size': use --dataset")
    return model, model_id, random_requests(args.num_prompts, args.input_len,
                                            128 if args.output_len is None else args.output_len, int(vocab),
                                            args.random_range_ratio, args.random_prefix_len, args.seed)


def bench_serve_command(args: argparse.Namespace) -> int:
    """Run, report and save (``--json``, ``--save-result``) a serving benchmark. A run stopped
    part-way (Ctrl-C, SIGTERM, an error) reports and saves the requests that finished, marked
    partial. Exit code: 0, 1 when no request succeeded or an error stopped the run, 2 for bad
    input or an unreachable server, 130 on Ctrl-C, 143 on SIGTERM."""
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if base_url.endswith("/v1") and args.endpoint.startswith("/v1/"):
        base_url = base_url[:-3]
    state = BenchmarkState()
    stopped = None
    try:
        with sigterm_as_interrupt():
            checked = _checked_flags(args)
            model, model_id, specs = _requests(args, base_url)
            ramp = checked.ramp_up
            rate = f"{ramp.strategy} ramp {ramp.start_rps}-{ramp.end_rps}" if ramp else args.request_rate
            print(f"bench serve: {len(specs)} requests to {base_url}{args.endpoint} (model {model!r}), "
                  f"rate {rate}, max concurrency {args.max_concurrency}", file=sys.stderr)
            if asyncio.run(run_until_sigterm(run_benchmark(
                    base_url, specs, model=model, endpoint=args.endpoint, request_rate=args.request_rate,
                    burstiness=args.burstiness, max_concurrency=args.max_concurrency, api_key=args.api_key,
                    num_warmups=args.num_warmups, seed=args.seed, timeout=args.timeout,
                    disable_tqdm=args.disable_tqdm, sampling=args, state=state, ramp_up=checked.ramp_up))):
                raise Terminated("SIGTERM")
    except (Exception, KeyboardInterrupt) as e:
        if state.finished():
            stopped = e
        elif isinstance(e, KeyboardInterrupt):
            print(f"bench serve: interrupted before any request finished ({stop_reason(e)}): nothing to "
                  "report", file=sys.stderr)
            return interrupted_exit(e)
        elif isinstance(e, (ValueError, RuntimeError, OSError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        else:
            raise
    return _report(args, checked, state, len(specs), stopped, base_url, model, model_id)


def _report(args: argparse.Namespace, checked: _Checked, state: BenchmarkState, num_requests: int,
            stopped: BaseException | None, base_url: str, model: str, model_id: str) -> int:
    """Figure, print and save the finished requests of a run (``stopped`` part-way, or not);
    returns the command's exit code."""
    _count_outputs_without_usage(state.finished(), base_url, model, args.api_key)
    percentiles, selected = checked.percentiles, checked.selected
    metrics = compute_metrics(state.finished(), state.end - state.start, percentiles, selected,
                              checked.goodput, args.max_concurrency or None, args.request_rate)
    if stopped is not None:
        if not isinstance(stopped, KeyboardInterrupt):
            traceback.print_exception(stopped, file=sys.stderr)
        print(f"bench serve stopped ({stop_reason(stopped)}): the figures below cover the "
              f"{len(state.finished())} of {num_requests} requests that finished", flush=True)
    print(format_report(metrics, percentiles, selected, args.max_concurrency, args.request_rate))
    failures = [e for e in metrics["errors"] if e]
    if failures:
        print(f"{len(failures)} requests failed; first error: {failures[0]}", file=sys.stderr)
    for path in save_results(args, base_url, model_id, metrics, stopped, state.rps_changes.events):
        print(f"{'partial ' if stopped is not None else ''}results written to {path}", file=sys.stderr)
    if stopped is not None:
        return interrupted_exit(stopped) if isinstance(stopped, KeyboardInterrupt) else 1
    return 0 if metrics["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedlab.server.bench_serve",
                                     description="Benchmark an OpenAI-compatible server "
                                                 "(= `pagedlab bench serve`)")
    add_bench_serve_args(parser)
    return bench_serve_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["BenchmarkState", "RequestResult", "RequestSpec", "add_bench_serve_args", "bench_serve_command",
           "compute_metrics", "format_report", "load_dataset", "random_requests", "run_benchmark"]
