"""Batch inference on a Ray cluster with Ray Data: JSONL prompts in, Parquet completions and the
run's manifest out (see docs/ray.md).

    # on a tiny random model, on this machine's CPUs:
    python -c "from pagedlab.lab.testing import make_tiny_model; make_tiny_model('tiny-model')"
    python examples/ray_batch_inference.py prompts.jsonl out/ --model tiny-model --num-gpus 0 \\
        --concurrency 2 --engine device=cpu --engine kv_cache_memory_bytes=8388608

    # on a GPU cluster (RAY_ADDRESS set, or `--address`), one actor per GPU:
    python examples/ray_batch_inference.py prompts.jsonl out/ --model /models/SmolLM2-135M-Instruct \\
        --concurrency 8 --num-gpus 1 --max-tokens 128

Each input line is a JSON object with a "prompt" field (or --prompt-column); every other field is
kept. The output directory holds the Parquet files (one row per input row, with
generated_text, num_output_tokens and finish_reason) and manifest.json.
"""

from __future__ import annotations

import argparse
import ast


def _engine_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--engine {text!r} is invalid: write KEY=VALUE, e.g. device=cpu")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="JSONL file of prompts")
    parser.add_argument("output", help="output directory (Parquet files and manifest.json)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--address", default=None,
                        help="Ray cluster (default: $RAY_ADDRESS, else a local one)")
    parser.add_argument("--concurrency", type=int, default=1, help="actors, each with its own LLM")
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="GPUs per actor (default: one per tensor-parallel rank; 0: CPUs)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--engine", type=_engine_arg, action="append", default=[], metavar="KEY=VALUE",
                        help="an LLM(...) engine argument, e.g. --engine dtype=bfloat16")
    args = parser.parse_args(argv)

    import ray

    from pagedlab.integrations.ray import run_batch_inference

    if not ray.is_initialized():
        ray.init(address=args.address)
    return run_batch_inference(args.input, args.output, args.model,
                               {"max_tokens": args.max_tokens, "temperature": args.temperature},
                               concurrency=args.concurrency, num_gpus=args.num_gpus,
                               batch_size=args.batch_size, prompt_column=args.prompt_column,
                               **dict(args.engine))


if __name__ == "__main__":
    main()
