"""The ``pagedlab`` command line: generate, chat, and the lab's and server's subcommands."""

from __future__ import annotations

import argparse
import json
import sys

from pagedlab.cli.engine_args import add_engine_args, add_sampling_args, changed_engine_kwargs, engine_kwargs
from pagedlab.cli.env_plan import register as register_env_plan
from pagedlab.inputs import chat_prompt, encode_prompt


def sampling_params(args: argparse.Namespace):
    from pagedlab import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedlab import LLM

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: give --prompt TEXT (repeatable) or prompts on standard input, one per line",
              file=sys.stderr)
        return 2
    params = sampling_params(args)
    with LLM(**engine_kwargs(args)) as llm:
        if args.chat:
            conversations = [[{"role": "user", "content": p}] for p in prompts]
            outputs = llm.chat(conversations, params, use_tqdm=not args.quiet)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        if args.json:
            m = out.metrics
            print(json.dumps({
                "prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                "prompt_token_ids": out.prompt_token_ids, "finish_reason": completion.finish_reason,
                "time_to_first_token_s": m.time_to_first_token,
                "latency_s": m.finished_time - m.arrival_time}))
        else:
            print(f"### {prompt}\n{completion.text}\n")
    return 0


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
        interactive = sys.stdin.isatty()
        turn = 0
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() in ("/exit", "/quit"):
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line.strip()})
            prompt = encode_prompt(chat_prompt(tokenizer, history), tokenizer, args.model)
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


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedlab import workloads

    changed = {k: v for k, v in changed_engine_kwargs(args).items() if k != "model"}
    results = workloads.run_bench(
        args.workload, args.batch_size, args.input_len, args.output_len, args.num_prompts, args.backend,
        model=args.model, shape=args.shape, repeats=args.repeats, engine_args=changed,
        latency=args.bench_command == "latency")
    if args.json:
        workloads.write_json(args.json, results, " ".join(sys.argv))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pagedlab.integrations.lm_eval import main as lm_eval_main

    lm_eval_main(args.lm_eval_args)
    return 0


def _add_bench_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, workload, sizes in (("throughput", "W-seed", [1, 16, 64, 256]), ("latency", "W-lat", [1])):
        p = bench_sub.add_parser(
            name, help=f"{name} of a DESIGN.md workload (default {workload}) on dummy weights")
        add_engine_args(p)
        p.set_defaults(model=None)
        p.add_argument("--workload", default=workload,
                       choices=["W-seed", "W-nano", "W-lat", "W-prefix", "W-long", "custom"])
        p.add_argument("--shape", default=None,
                       help="llama3-8b, llama3-70b or qwen3-0.6b (default: the workload's)")
        p.add_argument("--batch-size", type=int, nargs="+", default=sizes)
        p.add_argument("--input-len", type=int, default=512)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--num-prompts", type=int, default=None)
        p.add_argument("--repeats", type=int, default=1 if name == "throughput" else 3)
        p.add_argument("--backend", nargs="+", default=["pagedlab"], help="pagedlab and/or hf")
        p.add_argument("--json", default=None, help="write every row, versions and GPU name here")
        p.set_defaults(func=cmd_bench)
    from pagedlab.server.cli import register_bench

    register_bench(bench_sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts (the embedded model by default)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for several (else read stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with streamed replies")
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
    try:
        return args.func(args)
    except ValueError as e:  # bad input: say what and why, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

