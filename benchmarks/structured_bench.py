"""What structured outputs cost: W-nano with a fraction of its requests under a JSON schema,
against the same requests with none, in one engine (issue 18's target: half the requests under a
schema at most 10% slower).

Every request keeps W-nano's lengths, sampling (temperature 0.6) and ``ignore_eos``, so both runs
generate the same number of tokens; a schema's grammar constrains a request until its JSON is
complete. The report gives, per run, output tokens/s, and for the constrained requests how many
produced valid JSON and the share of their text the grammar spanned.

    PYTHONPATH=src python3 benchmarks/structured_bench.py --tokenizer DIR --json out.json

The default model is W-nano's shape with dummy weights, which has no tokenizer: ``--tokenizer``
names one (e.g. a directory with a tokenizer.json). The grammar's vocabulary is that tokenizer's;
prompts are random ids from it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagedlab import LLM, SamplingParams
from pagedlab.sampling_params import StructuredOutputsParams
from pagedlab.bench_json import environment
from pagedlab.workloads import DEFAULT_SHAPES, make_workload, shape_dir

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                   "authors": {"type": "array", "items": {"type": "string"}},
                   "abstract": {"type": "string"}},
    "required": ["title", "year", "authors", "abstract"],
}


def request_params(out_lens: list[int], fraction: float, schema: dict) -> list[SamplingParams]:
    """One SamplingParams per request; every ``1 / fraction``-th request (spread evenly) carries
    the schema."""
    structured = StructuredOutputsParams(json=schema)
    chosen = {round(i / fraction) for i in range(round(len(out_lens) * fraction))} if fraction else set()
    return [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, seed=None,
                           structured_outputs=structured if i in chosen else None)
            for i, n in enumerate(out_lens)]


def json_span(text: str) -> tuple[bool, float]:
    """(whether ``text`` starts with a complete JSON value, the share of the text it spans)."""
    stripped = text.lstrip()
    try:
        _, end = json.JSONDecoder().raw_decode(stripped)
    except json.JSONDecodeError:
        return False, 1.0
    return True, (end + len(text) - len(stripped)) / max(len(text), 1)


def timed_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], label: str) -> dict:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    structured = [o for o, p in zip(outputs, params) if p.structured_outputs is not None]
    spans = [json_span(o.outputs[0].text) for o in structured]
    row = {"label": label, "requests": len(prompts), "structured_requests": len(structured),
           "output_tokens": tokens, "elapsed_s": elapsed, "output_tok_s": tokens / elapsed,
           "valid_json": sum(ok for ok, _ in spans),
           "grammar_text_share": sum(s for _, s in spans) / len(spans) if spans else None}
    print(json.dumps(row), flush=True)
    return row


def profile_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], directory: str) -> dict:
    """A short profiled stretch of ``params`` (48 tokens each): the engine's step summary, with the
    host time of each step phase."""
    import dataclasses

    short = [dataclasses.replace(p, max_tokens=48) for p in params]
    llm.start_profile(directory)
    llm.generate([{"prompt_token_ids": p} for p in prompts], short, use_tqdm=False)
    summary = llm.stop_profile()
    print(summary.format(), flush=True)
    return summary.to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: W-nano's shape with dummy weights")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--fraction", type=float, default=0.5, help="share of requests under the schema")
    parser.add_argument("--schema", default=None, help="a JSON schema file (default: a paper record)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", metavar="DIR", help="also profile a short run of each kind into DIR")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not 0 < args.fraction <= 1:
        parser.error(f"--fraction {args.fraction} must be in (0, 1]")
    schema = DEFAULT_SCHEMA if args.schema is None else json.loads(Path(args.schema).read_text())
    dummy = args.model is None
    model = shape_dir(DEFAULT_SHAPES["W-nano"]) if dummy else args.model
    engine_args = {"load_format": "dummy"} if dummy else {}
    with LLM(model, tokenizer=args.tokenizer, dtype="bfloat16", max_model_len=2112, max_num_seqs=256,
             **engine_args) as llm:
        vocab = len(llm.get_tokenizer())
        workload = make_workload("W-nano", vocab, num_prompts=args.num_prompts)
        plain = request_params(workload.output_lens, 0.0, schema)
        constrained = request_params(workload.output_lens, args.fraction, schema)
        llm.generate([{"prompt_token_ids": p} for p in workload.prompts[:4]], constrained[:4], use_tqdm=False)
        rows = []
        for r in range(args.repeats):
            rows.append(timed_run(llm, workload.prompts, plain, f"no schema #{r + 1}"))
            rows.append(timed_run(llm, workload.prompts, constrained,
                                  f"{args.fraction:.0%} under a JSON schema #{r + 1}"))
        profiles = {label: profile_run(llm, workload.prompts, p, args.profile)
                    for label, p in (("plain", plain), ("structured", constrained))} if args.profile else None
    best = {kind: max(x["output_tok_s"] for x in rows if x["label"].startswith(kind))
            for kind in ("no schema", f"{args.fraction:.0%}")}
    ratio = best[f"{args.fraction:.0%}"] / best["no schema"]
    print(f"structured / plain output tok/s (best of {args.repeats}): {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "model": model, "tokenizer": args.tokenizer,
                       "schema": schema, "rows": rows, "ratio_best": ratio,
                       "profiles": profiles}, f, indent=1)


if __name__ == "__main__":
    main()
