"""``pagedlab repro check``: run the reproducibility checks of ``pagedlab.lab.repro`` on a model.

``register(subparsers)`` adds ``repro`` (with its ``check`` subcommand) to the ``pagedlab``
command line. Exit codes: 0 every check ran (with ``--strict``: and every verdict is "same"),
1 with ``--strict`` some check differs, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pagedlab.cli.engine_args import (CommandParser, add_engine_args, check_writable, engine_kwargs,
                                      non_negative, positive_int)
from pagedlab.lab import repro
from pagedlab.lab.lora import adapter_rank
from pagedlab.lab.repro import ALL_CHECKS, DEFAULT_PROMPTS
from pagedlab.sampling_params import SamplingParams

# What each check does, printed as it starts.
_WHAT = {"batch": "greedy at batch 1 vs one batch, shuffled, prefix caching and chunked prefill on/off",
         "seeds": "the sampling params over each seed", "tokenizer": "two tokenizers on the same prompts",
         "hf": "pagedlab vs HF transformers on the same weights",
         "precision": "the weights in each dtype (one model load per dtype)",
         "padding": "HF transformers: a left-padded batch vs one prompt at a time",
         "lora": "pagedlab with the --lora adapter vs PEFT in HF transformers (float32, CPU)",
         "spec": "the same engine with and without --speculative-config (default: n-gram, 4 tokens)"}
# The checks that share one loaded model run first, then those that load their own.
_SHARED_MODEL_CHECKS = ("batch", "seeds", "tokenizer", "hf", "lora", "spec")
_DB_HELP = ("store each check's result with its manifest in this results database "
            "(SQLAlchemy URL or SQLite path)")


def _checks(value: str) -> list[str]:
    names = list(dict.fromkeys(c.strip() for c in value.split(",") if c.strip()))  # each check runs once
    if names == ["all"]:
        return list(ALL_CHECKS)
    bad = [c for c in names if c not in ALL_CHECKS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--checks {value!r}: unknown {bad or 'empty list'}; "
                                         f"choose from {','.join(ALL_CHECKS)} or all")
    return names


def default_checks(tokenizer_b: str | None, lora: str | None,
                   speculative_config: dict | None = None) -> list[str]:
    """The checks run without ``--checks``: all of them, but tokenizer only with a second tokenizer
    (``--tokenizer-b``), lora only with an adapter (``--lora``) and spec only with a
    ``--speculative-config``."""
    given = {"tokenizer": tokenizer_b, "lora": lora, "spec": speculative_config}
    return [c for c in ALL_CHECKS if c not in given or given[c]]


def register(subparsers) -> None:
    """Add ``repro check`` to an argparse subparsers object."""
    p = subparsers.add_parser("repro", help="reproducibility checks: batch invariance, seeds, precision, "
                                            "tokenizer drift, padding masks, HF parity")
    sub = p.add_subparsers(dest="repro_command", metavar="{check}")
    sub.required = True
    c = sub.add_parser("check", help="run the checks on a model and print a verdict for each",
                       description="Each check prints SAME or DIFFERS with its numbers; see docs/repro.md.")
    add_engine_args(c)
    c.add_argument("--prompts", default=None,
                   help="prompt file: one text prompt per line, or .jsonl/.json with 'prompt' (or "
                        "'prompt_token_ids') and optional 'reference' (default: 8 built-in prompts)")
    c.add_argument("--checks", type=_checks, default=None,
                   help=f"comma-separated subset of {','.join(ALL_CHECKS)}, or all (default: all but "
                        "tokenizer, lora and spec, each added when --tokenizer-b, --lora or "
                        "--speculative-config is given)")
    c.add_argument("--db", default=None, help=_DB_HELP)
    c.add_argument("--out", default=None, help="write every result (numbers and details) to this JSON file")
    c.add_argument("--max-tokens", type=positive_int, default=16,
                   help="greedy tokens per prompt (default: 16)")
    c.add_argument("--num-seeds", type=positive_int, default=5,
                   help="seeds for the seeds check, at least 2, and the spec check (default: 5)")
    c.add_argument("--temperature", type=float, default=0.8, help="seeds check temperature (default: 0.8)")
    c.add_argument("--top-p", type=float, default=0.95, help="seeds check top_p (default: 0.95)")
    c.add_argument("--sampling", default=None, metavar="JSON",
                   help='seeds check: the experiment\'s SamplingParams as JSON, e.g. \'{"temperature": 0.7, '
                        '"top_p": 0.9, "max_tokens": 64}\' (overrides '
                        '--temperature/--top-p/--seed-max-tokens)')
    c.add_argument("--experiment", default=None, metavar="YAML",
                   help="seeds check: take the sampling params of this experiment file (its sampling: "
                        "section as its runs sample, SamplingParams' defaults for the fields it leaves out; "
                        "--sampling overrides single fields)")
    c.add_argument("--seed-max-tokens", type=positive_int, default=32,
                   help="seeds check tokens per prompt (default: 32)")
    c.add_argument("--seed-threshold", type=non_negative, default=0.05,
                   help="flag a metric whose std/|mean| over seeds exceeds this (default: 0.05)")
    c.add_argument("--dtypes", default="float32,bfloat16,float16",
                   help="precision check variants, the first is the reference: dtypes, fp8 (FP8 weights "
                        "and activations), awq (4-bit weights), kv-fp8 (FP8 KV cache), or joined by + "
                        "(bfloat16+fp8) (default: "
                        "float32,bfloat16,float16)")
    c.add_argument("--kl-threshold", type=non_negative, default=1e-3,
                   help="precision: mean KL above this differs")
    c.add_argument("--top-k", type=int, default=20,
                   help="logprobs per position for KL / parity (default: 20)")
    c.add_argument("--tokenizer-b", default=None,
                   help="tokenizer check: the second tokenizer (path); the first is --tokenizer or the "
                        "model's")
    c.add_argument("--hf-dtype", default="float32", help="hf check: HF transformers dtype (default: float32)")
    c.add_argument("--padding-mask", choices=("correct", "ones"), default="correct",
                   help="padding check: the attention mask given to HF ('ones' reproduces the common bug)")
    c.add_argument("--logprob-tolerance", type=non_negative, default=1e-3,
                   help="batch/padding/hf: a |Δ logprob| above this differs (default: 1e-3)")
    c.add_argument("--lora", default=None, metavar="DIR",
                   help="lora check: the PEFT adapter directory to compare (loads the model with LoRA on)")
    c.add_argument("--strict", action="store_true", help="exit 1 when any check differs")
    c.add_argument("--no-progress", action="store_true", help="no progress bars (each check is still named "
                                                               "as it starts)")
    c.set_defaults(func=cmd_repro_check)


def _seed_params(args) -> SamplingParams:
    """The seeds check's sampling params: an experiment's ``sampling:`` section as its runs sample
    (SamplingParams' defaults for what it leaves out, not --temperature, --top-p and
    --seed-max-tokens), else those three; --sampling's fields over either. ``logprobs`` is 0
    unless set (the mean token logprob needs it; it changes no token)."""
    if args.experiment:
        from pagedlab.lab.spec import load_experiment

        fields = {"logprobs": 0, **(load_experiment(args.experiment).base.get("sampling") or {})}
    else:
        fields = {"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.seed_max_tokens,
                  "logprobs": 0}
    if args.sampling:
        try:
            extra = json.loads(args.sampling)
        except ValueError as e:
            raise ValueError(f"--sampling {args.sampling!r} is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError(f"--sampling {args.sampling!r} must be a JSON object of SamplingParams fields")
        fields.update(extra)
    fields.pop("seed", None)
    try:
        return SamplingParams(**fields)
    except TypeError as e:
        raise ValueError(f"--sampling {args.sampling!r}: {e}") from None


class CheckAnnouncer:
    """Names each check as it starts ("[2/4] seeds: ...") and gives it a tqdm progress bar on
    stderr, which the check advances (``progress=`` of the ``pagedlab.lab.repro`` checks)."""

    def __init__(self, checks: list[str], bars: bool = True):
        self.order = [c for c in checks if c in _SHARED_MODEL_CHECKS] + [c for c in checks
                                                                         if c not in _SHARED_MODEL_CHECKS]
        self.bars = bars

    def start(self, name: str):
        from tqdm.auto import tqdm

        print(f"[{self.order.index(name) + 1}/{len(self.order)}] {name}: {_WHAT[name]}", flush=True)
        return tqdm(desc=name, unit="step", file=sys.stderr, disable=not self.bars, dynamic_ncols=True)


def cmd_repro_check(args: argparse.Namespace) -> int:
    """Run the chosen checks, print each verdict, store and write the results when asked."""
    from pagedlab.lab.store import ResultStore

    if args.checks is None:
        checks = default_checks(args.tokenizer_b, args.lora, args.speculative_config)
    else:
        checks = args.checks if isinstance(args.checks, list) else _checks(args.checks)
    if args.prompts:
        prompts, references = repro.load_prompts(args.prompts)
    else:
        prompts, references = list(DEFAULT_PROMPTS), None
    if "tokenizer" in checks and not args.tokenizer_b:
        print("error: the tokenizer check needs --tokenizer-b PATH (the tokenizer to compare with)",
              file=sys.stderr)
        return 2
    if "lora" in checks and not args.lora:
        print("error: the lora check needs --lora DIR (a PEFT adapter directory)", file=sys.stderr)
        return 2
    seed_params = _seed_params(args) if "seeds" in checks else None  # bad JSON fails early
    _check_inputs(args, checks)
    store = ResultStore(args.db) if args.db else None
    results: list[repro.CheckResult] = []
    announce = CheckAnnouncer(checks, bars=not args.no_progress)

    def done(result, llm=None):
        print(result.format(), flush=True)
        results.append(result)  # before storing: a database error must not lose it from --out
        if store is not None:
            run_id = repro.store_result(result, None, llm=llm, model=args.model, store=store)
            print(f"    stored as run {run_id} in {store.url}", flush=True)

    error = None
    try:
        _run_llm_checks(args, checks, prompts, references, seed_params, done, announce)
        for name, check in (("precision", _precision_check), ("padding", _padding_check)):
            if name in checks:
                with announce.start(name) as bar:
                    result = check(args, prompts, bar)
                done(result)
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if store is not None:
            store.close()
        _report(args, results, error)
    return 1 if (args.strict and any(not r.same for r in results)) else 0


def _report(args, results: list, error: str | None) -> None:
    """Print the verdicts and write ``--out``: also when a check failed (``error``), so the checks
    that finished before it are kept."""
    from pagedlab.lab.store import jsonable

    print(f"\n{len(results)} checks: " + ", ".join(f"{r.check} {r.verdict}" for r in results))
    if args.out:
        report = {"model": args.model, "checks": [jsonable(r.to_dict()) for r in results]}
        if error is not None:
            report["error"] = error
        try:
            Path(args.out).write_text(json.dumps(report, indent=2))
        except OSError as e:
            raise ValueError(f"--out {args.out}: {e}; the verdicts above are all the results") from None
        print(f"wrote {args.out}" + (" (the checks finished before the error)" if error else ""))


def _check_inputs(args, checks: list[str]) -> None:
    """Refuse bad values of the checks' own options before any model loads (ValueError)."""
    if "seeds" in checks and args.num_seeds < 2:
        raise ValueError(f"--num-seeds {args.num_seeds}: the seeds check needs at least 2 seeds (a spread "
                         "over one seed says nothing)")
    if args.out:  # found at the end, after every check ran, it would lose them all
        check_writable(args.out, "--out")
    if "precision" in checks:
        _precision_variants(args.dtypes)
    if "precision" in checks or "hf" in checks:
        from pagedlab.lab.repro.compare import check_top_k

        try:
            check_top_k(args.top_k)
        except ValueError as e:
            raise ValueError(f"--top-k: {e}") from None
    if "hf" in checks:
        from pagedlab.lab.repro.hf import hf_torch_dtype

        try:
            hf_torch_dtype(args.hf_dtype)
        except ValueError as e:
            raise ValueError(f"--hf-dtype: {e}") from None
    if "tokenizer" in checks:
        from pagedlab.lab.repro.tokenizer import load_tokenizer

        load_tokenizer(args.tokenizer_b)


def _run_llm_checks(args, checks: list[str], prompts, references, seed_params, done, announce) -> None:
    """The checks that share one loaded model (batch, seeds, tokenizer, hf, lora, spec), each passed
    to ``done``."""
    main_checks = [c for c in checks if c in _SHARED_MODEL_CHECKS]
    if not main_checks:
        return
    from pagedlab.llm import LLM

    print(f"loading {args.model} for the {', '.join(main_checks)} check(s)", flush=True)
    kwargs = engine_kwargs(args)
    kwargs.pop("speculative_config", None)  # what the spec check compares: the checks decode plainly
    if "lora" in main_checks:
        rank = max(adapter_rank(args.lora), kwargs.get("max_lora_rank", 1))
        kwargs.update(enable_lora=True, max_lora_rank=rank)
    with LLM(**kwargs) as llm:
        if any(isinstance(p, str) for p in prompts) and llm.get_tokenizer() is None:
            raise ValueError(f"model {args.model!r} has no tokenizer: give --prompts with prompt_token_ids")
        for name in main_checks:
            t0 = time.perf_counter()
            with announce.start(name) as bar:
                r = _shared_model_check(name, llm, args, prompts, references, seed_params, bar)
            r.details["seconds"] = time.perf_counter() - t0
            done(r, llm)


def _shared_model_check(name: str, llm, args, prompts, references, seed_params, bar) -> repro.CheckResult:
    if name == "batch":
        return repro.batch_consistency(llm, prompts, max_tokens=args.max_tokens,
                                       logprob_tolerance=args.logprob_tolerance, progress=bar)
    if name == "seeds":
        return repro.seed_sensitivity(llm, prompts, seed_params, seeds=range(args.num_seeds),
                                      references=references, threshold=args.seed_threshold, progress=bar)
    if name == "tokenizer":
        tok_a = args.tokenizer or str(llm.get_engine_info().model_path)
        return repro.tokenizer_drift(tok_a, args.tokenizer_b, prompts, llm=llm, references=references,
                                     max_tokens=args.max_tokens, progress=bar)
    if name == "lora":
        return repro.lora_parity(llm, args.lora, prompts, max_tokens=args.max_tokens, progress=bar)
    if name == "spec":
        return repro.speculation_parity(llm, args.speculative_config, prompts, max_tokens=args.max_tokens,
                                        seeds=range(args.num_seeds), progress=bar)
    return repro.hf_parity(llm, prompts, max_tokens=args.max_tokens, k=args.top_k, hf_dtype=args.hf_dtype,
                           logprob_tolerance=args.logprob_tolerance, progress=bar)


def _precision_variants(value: str) -> list[str]:
    """The precision variants of ``--dtypes``: at least two, each a known dtype or variant."""
    from pagedlab.lab.repro.precision import variant_engine_args

    dtypes = [d.strip() for d in value.split(",") if d.strip()]
    if len(dtypes) < 2:
        raise ValueError(f"--dtypes {value!r}: give at least two precision variants (the first is "
                         "the reference)")
    for name in dtypes:
        try:
            variant_engine_args(name)
        except ValueError as e:
            raise ValueError(f"--dtypes: {e}") from None
    return dtypes


def _precision_check(args, prompts, bar) -> repro.CheckResult:
    """The precision check's variants loaded as the other checks' model is: without the
    --speculative-config, which only the spec check compares."""
    dtypes = _precision_variants(args.dtypes)
    engine_args = engine_kwargs(args)
    engine_args.pop("speculative_config", None)
    return repro.precision_drift(args.model, prompts, dtypes=dtypes, max_tokens=args.max_tokens, k=args.top_k,
                                 kl_threshold=args.kl_threshold, engine_args=engine_args, progress=bar)


def _padding_check(args, prompts, bar) -> repro.CheckResult:
    from pagedlab.loader import resolve_model_source

    hf_prompts = prompts
    if any(isinstance(p, str) for p in prompts) and args.tokenizer:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
        hf_prompts = [tok(p).input_ids if isinstance(p, str) else p for p in prompts]
    source = resolve_model_source(args.model, args.load_format, args.revision, args.download_dir)
    return repro.padding_check(str(source.path), hf_prompts,
                               max_tokens=args.max_tokens, attention_mask=args.padding_mask,
                               logprob_tolerance=args.logprob_tolerance, progress=bar,
                               hf_overrides=args.hf_overrides)


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="pagedlab")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
