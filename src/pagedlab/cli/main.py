"""The ``pagedlab`` command line: generate, chat, and the lab's and server's subcommands.

Building the parser imports no torch, transformers or engine module: ``--help``, ``--version``
and argument errors answer at once; a command imports what it runs when it runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from pagedlab import __version__
from pagedlab.cli.engine_args import (CommandParser, add_engine_args, add_sampling_args, check_writable,
                                      engine_kwargs, given_engine_kwargs, positive_int)
from pagedlab.cli.env_plan import register as register_env_plan
from pagedlab.inputs import chat_prompt, encode_prompt
from pagedlab.interrupt import interrupted_exit, reader_gone_exit, sigterm_as_interrupt, stop_reason

BENCH_DOCS = "docs/benchmarks.md"
WORKLOADS = ("W-seed", "W-nano", "W-lat", "W-prefix", "W-long", "custom")
# pagedlab.workloads.SHAPES, named here so that --help does not import torch
SHAPES = ("llama3-8b", "llama3-70b", "qwen3-0.6b", "qwen3-30b-a3b", "mixtral-8x7b", "gemma2-9b")
# The request-size flags each workload reads (pagedlab.workloads.make_workload); the others have
# fixed lengths, so e.g. --batch-size on W-nano is refused rather than silently ignored.
WORKLOAD_FLAGS = {"W-seed": ("batch_size", "input_len", "output_len", "num_prompts"),
                  "W-lat": ("batch_size", "input_len", "output_len", "num_prompts"),
                  "custom": ("batch_size", "input_len", "output_len", "num_prompts"),
                  "W-nano": ("num_prompts",), "W-prefix": ("num_prompts",), "W-long": ("num_prompts",)}
BENCH_SIZE_DEFAULTS = {"input_len": 512, "output_len": 128}


def sampling_params(args: argparse.Namespace):
    from pagedlab import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedlab import LLM

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin or () if line.strip()]
    if not prompts:
        print("error: give --prompt TEXT (repeatable) or prompts on standard input, one per line",
              file=sys.stderr)
        return 2
    params = sampling_params(args)
    with LLM(**engine_kwargs(args)) as llm:
        inputs = prompts
        if args.chat:
            inputs = [chat_prompt(llm.get_tokenizer(), [{"role": "user", "content": p}], model=args.model)
                      for p in prompts]
        printer = InOrderPrinter(prompts, args.json)
        try:
            for i, out in llm.generate_as_completed(inputs, params, use_tqdm=not args.quiet):
                printer.add(i, out)
        finally:  # interrupted: the outputs finished out of order are kept too
            printer.flush_all()
    return 0


class InOrderPrinter:
    """Prints each finished output as soon as those of every earlier prompt are out."""

    def __init__(self, prompts: list[str], as_json: bool):
        self.prompts, self.as_json = prompts, as_json
        self.held: dict = {}
        self.next = 0

    def add(self, index: int, output) -> None:
        self.held[index] = output
        while self.next in self.held:
            self._print(self.next, self.held.pop(self.next))
            self.next += 1

    def flush_all(self) -> None:
        for index in sorted(self.held):
            self._print(index, self.held.pop(index))

    def _print(self, index: int, out) -> None:
        prompt, completion = self.prompts[index], out.outputs[0]
        if self.as_json:
            m = out.metrics
            print(json.dumps({
                "index": index, "prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                "prompt_token_ids": out.prompt_token_ids, "finish_reason": completion.finish_reason,
                "time_to_first_token_s": m.time_to_first_token,
                "latency_s": m.finished_time - m.arrival_time}), flush=True)
        else:
            print(f"### {prompt}\n{completion.text}\n", flush=True)


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat: each reply streams to the terminal as it is generated."""
    from pagedlab import LLM

    params = sampling_params(args)
    with LLM(**engine_kwargs(args)) as llm:
        tokenizer = llm.get_tokenizer()
        if tokenizer is None or tokenizer.chat_template is None:
            print(f"error: model {args.model!r} has no chat template", file=sys.stderr)
            return 2
        engine = llm.llm_engine
        history = [{"role": "system", "content": args.system}] if args.system else []
        interactive = sys.stdin is not None and sys.stdin.isatty()
        turn = 0
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline() if sys.stdin is not None else ""  # None: standard input closed
            if not line or line.strip() in ("/exit", "/quit"):
                return 0
            if not line.strip():
                continue
            fitted = [*history, {"role": "user", "content": line.strip()}]
            prompt = fitted_chat_prompt(tokenizer, fitted, args.model, engine.max_model_len)
            if prompt is None:  # the conversation so far stays as it was
                print(f"error: that message alone is too long for max_model_len {engine.max_model_len}",
                      file=sys.stderr)
                continue
            if len(fitted) <= len(history):
                print(f"(the {len(history) + 1 - len(fitted)} oldest messages no longer fit max_model_len "
                      f"{engine.max_model_len}: dropped)", file=sys.stderr)
            history = fitted
            request_id = f"chat-{turn}"
            turn += 1
            engine.add_request(request_id, prompt.token_ids, params, prompt=prompt.text)
            shown = ""
            while engine.has_unfinished_requests():
                for out in engine.step():
                    reply = out.outputs[0].text
                    print(reply[len(shown):], end="", flush=True)
                    shown = reply
            print()
            history.append({"role": "assistant", "content": shown})


def fitted_chat_prompt(tokenizer, history: list[dict], model: str, max_model_len: int):
    """The conversation's prompt, its oldest turns dropped from ``history`` (never a system
    message) until it is shorter than ``max_model_len``; None when the last message alone is not."""
    first = 1 if history and history[0]["role"] == "system" else 0
    while True:
        prompt = encode_prompt(chat_prompt(tokenizer, history), tokenizer, model)
        if len(prompt.token_ids) < max_model_len:
            return prompt
        if len(history) - first <= 1:
            return None
        del history[first:first + 2]  # the oldest user message and its reply


def check_bench_flags(args: argparse.Namespace) -> None:
    """A ValueError naming each size flag given that ``args.workload`` does not read, and
    ``--shape`` given with ``--model``."""
    used = WORKLOAD_FLAGS[args.workload]
    unused = [name for name in ("batch_size", "input_len", "output_len", "num_prompts")
              if getattr(args, name) is not None and name not in used]
    if unused:
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        takes = ", ".join("--" + name.replace("_", "-") for name in used)
        raise ValueError(f"{flags} not used by workload {args.workload}: its request sizes are fixed "
                         f"({BENCH_DOCS}); {args.workload} takes {takes}")
    if args.shape is not None and args.model is not None:
        raise ValueError(f"--shape {args.shape} and --model {args.model} both name the model: give one "
                         "(--shape builds dummy weights of a benchmark shape)")
    if args.json is not None:
        check_writable(args.json, "--json/--output-json")


def cmd_bench(args: argparse.Namespace) -> int:
    check_bench_flags(args)
    from pagedlab import workloads

    given = {k: v for k, v in given_engine_kwargs(args).items() if k != "model"}
    default_sizes = [1] if args.bench_command == "latency" else [1, 16, 64, 256]
    shape = args.shape or workloads.DEFAULT_SHAPES[args.workload]
    lora = bench_lora(args)
    if args.model is None:
        warn_cpu_shape(shape, args.device)
    results: list = []
    try:
        with sigterm_as_interrupt():  # a scheduler's time limit keeps the finished rows too
            workloads.run_bench(  # the size flags are None or >= 1 (positive_int)
                args.workload, args.batch_size or default_sizes,
                args.input_len or BENCH_SIZE_DEFAULTS["input_len"],
                args.output_len or BENCH_SIZE_DEFAULTS["output_len"], args.num_prompts, args.backend,
                model=args.model, shape=shape, repeats=args.repeats, engine_args=given,
                latency=args.bench_command == "latency", profile_dir=args.profile, lora=lora, results=results)
    except BaseException as e:  # out of memory at the last batch size: keep the rows measured before it
        if args.json and results:
            write_bench_json(args, results, e)
        raise
    for row in results:
        if "profile" in row.extra:
            print(f"{row.label}: profile in {row.extra['profile']['dir']} (kernels by kind: "
                  f"{row.extra['profile']['kernel_table']})")
    if args.json:
        write_bench_json(args, results)
    return 0


def write_bench_json(args: argparse.Namespace, results: list, stopped: BaseException | None = None) -> None:
    """``--json``: the rows, the command as typed and, for a run that ``stopped`` early, why."""
    from pagedlab import bench_json

    try:
        bench_json.write_json(args.json, results, shlex.join(["pagedlab", *args.argv]), stopped)
    except OSError as e:
        raise ValueError(f"--json {args.json}: {e}; the rows above are all the results") from None
    if stopped is not None:
        print(f"wrote the {len(results)} finished row(s) to {args.json}, marked partial "
              f"({stop_reason(stopped)})", file=sys.stderr)


def bench_lora(args: argparse.Namespace):
    """The random LoRA adapters ``--num-loras`` asks for (``pagedlab.lora.bench.LoRABench``), or None."""
    given = {key: value for key, value in (("rank", args.lora_rank), ("targets", args.lora_targets))
             if value is not None}
    if args.num_loras is None:
        if given:
            raise ValueError("--lora-rank and --lora-targets shape the random adapters of --num-loras N: "
                             "give --num-loras too")
        return None
    from pagedlab.lora.bench import LoRABench

    return LoRABench(args.num_loras, **given)


def warn_cpu_shape(shape: str, device: str) -> None:
    """Say, before it starts, that building a shape of billions of parameters on the CPU takes
    minutes and much memory."""
    import torch

    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu and shape != "qwen3-0.6b":
        print(f"warning: building the {shape} shape with dummy weights on the CPU: this takes minutes and "
              "tens of GiB of memory (bfloat16 weights); on a CPU try --shape qwen3-0.6b, or give --model "
              "DIR", file=sys.stderr, flush=True)


def cmd_eval(args: argparse.Namespace) -> int:
    from pagedlab.integrations.lm_eval import main as lm_eval_main

    lm_eval_main(args.lm_eval_args)
    return 0


def _add_bench_commands(sub) -> None:
    bench = sub.add_parser("bench", help=f"benchmarks: throughput, latency, serve (workloads: {BENCH_DOCS})",
                           description=f"The fixed workloads, their request sizes and the physical floor "
                                       f"are defined in {BENCH_DOCS}.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, workload, sizes in (("throughput", "W-seed", "1 16 64 256"), ("latency", "W-lat", "1")):
        p = bench_sub.add_parser(
            name, help=f"{name} of a workload of {BENCH_DOCS} (default {workload}) on dummy weights",
            description=f"{name.capitalize()} of one of the fixed workloads defined in {BENCH_DOCS} (request "
                        "sizes, shapes, the physical floor). Without --model the workload's benchmark shape "
                        "is built with dummy weights.")
        add_engine_args(p, model_default=None, model_help=(
            "local HF directory or .gguf file to benchmark (default: none: dummy weights of --shape, or of "
            "the workload's shape: llama3-8b for W-seed/W-lat/W-long/custom, qwen3-0.6b for "
            "W-nano/W-prefix)"))
        p.add_argument("--workload", default=workload, choices=WORKLOADS)
        p.add_argument("--shape", default=None, choices=SHAPES,
                       help="benchmark shape built with dummy weights when no --model is given (default: "
                            "the workload's); pagedlab.workloads.shape_dir(NAME) writes its config.json")
        p.add_argument("--batch-size", type=positive_int, nargs="+", default=None,
                       help=f"W-seed/W-lat/custom: batch sizes (default: {sizes})")
        for flag, what in (("input_len", "prompt tokens"), ("output_len", "output tokens")):
            p.add_argument("--" + flag.replace("_", "-"), type=positive_int, default=None,
                           help=f"W-seed/W-lat/custom: {what} (default: {BENCH_SIZE_DEFAULTS[flag]})")
        p.add_argument("--num-prompts", type=positive_int, default=None,
                       help="prompts per run, at most --batch-size of them at once (default: the batch "
                            "size; 256 for W-nano/W-prefix, 4 for W-long)")
        p.add_argument("--repeats", type=positive_int, default=1 if name == "throughput" else 3)
        p.add_argument("--backend", nargs="+", default=["pagedlab"], help="pagedlab and/or hf")
        p.add_argument("--json", "--output-json", dest="json", default=None, metavar="PATH",
                       help="write every row, versions and GPU name here, each row with the keys of "
                            f"vLLM's bench throughput and latency --output-json too ({BENCH_DOCS})")
        p.add_argument("--num-loras", type=int, default=None, metavar="N",
                       help="LoRA: write N random PEFT adapters for the model's shape and spread them "
                            "round-robin over each batch's requests (pagedlab: enable_lora, max_loras N, "
                            "max_lora_rank R unless given; hf: PEFT, unmerged); rows record them in "
                            "extra.lora")
        p.add_argument("--lora-rank", type=int, default=None, metavar="R",
                       help="rank of the --num-loras adapters (default 16)")
        p.add_argument("--lora-targets", default=None, metavar="q,k,v,o,gate,up,down",
                       help="modules the --num-loras adapters adapt, comma-separated (default: all seven)")
        p.add_argument("--profile", default=None, metavar="DIR",
                       help="profile each pagedlab row (torch profiler) into a directory of its own under "
                            "DIR: a Chrome/Perfetto trace, profile.json and kernels.txt (kernels by kind, "
                            "host-gap share per step kind); profiling slows the run")
        p.set_defaults(func=cmd_bench)
    from pagedlab.server.cli import register_bench

    register_bench(bench_sub)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="pagedlab", description="pagedlab: a PagedAttention LLM inference "
                                                        "engine with a research lab and an OpenAI-compatible "
                                                        "server.")
    parser.add_argument("--version", action="version", version=f"pagedlab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts (the embedded model by default)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for several (else read stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with streamed replies",
                          description="Interactive chat with streamed replies: type a message and press "
                                      "Enter; /exit or /quit (or end of input, Ctrl-D) ends the session.")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.set_defaults(func=cmd_chat)

    _add_bench_commands(sub)
    ev = sub.add_parser("eval", help="lm-evaluation-harness with the pagedlab model registered",
                        description="Runs lm-eval's own command line (`lm_eval run ...`) with "
                                    "`--model pagedlab` available, e.g. pagedlab eval run --model pagedlab "
                                    "--model_args "
                                    "pretrained=DIR,dtype=float32 --tasks TASK")
    ev.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments")
    ev.set_defaults(func=cmd_eval)
    from pagedlab.lab.cli import register as register_lab
    from pagedlab.lab.repro_cli import register as register_repro
    from pagedlab.server.cli import register as register_server

    register_lab(sub)
    register_repro(sub)
    register_env_plan(sub)
    register_server(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: say what and why, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM where a command stops on it as on Ctrl-C
        return interrupted_exit(e)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        return reader_gone_exit()

