"""Command-line entries of the server: ``pagedlab serve`` and ``pagedlab bench serve``.

The top-level CLI calls ``register(subparsers)`` and ``register_bench(bench_subparsers)``; each
subcommand sets ``func(args) -> int``. Both also run standalone:
``python -m pagedlab.server.openai_api ...`` and ``python -m pagedlab.server.bench_serve ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from pagedlab.cli.engine_args import add_engine_args, engine_config_from_args
from pagedlab.lora.request import LoRARequest
from pagedlab.server.limits import ServerLimits
from pagedlab.reasoning_parsers import REASONING_PARSERS
from pagedlab.server.tool_parsers import TOOL_PARSERS, tool_parser_named


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("PAGEDLAB_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDLAB_API_KEY, else none)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    g.add_argument("--disable-metrics", action="store_true", help="no /metrics endpoint")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let requests use tool_choice "auto": the model decides, --tool-call-parser reads '
                        "its tool calls (named and \"required\" tool_choice need neither flag)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read out of the model's text: hermes (Hermes 2 Pro, Qwen2.5, "
                        "Qwen3: <tool_call> blocks) or llama3_json (Llama 3.1/3.2: JSON objects)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split chat output into message.reasoning and content at </think>: deepseek_r1 "
                        "(DeepSeek-R1, QwQ: reasoning until </think>) or qwen3 (reasoning only inside a "
                        "leading <think> block); its tags are thinking_token_budget's markers unless "
                        "--reasoning-config names others")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='keep the tools of a tool_choice "none" request out of the chat template '
                        "(default: the template gets them, as vLLM's)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name each token "token_id:{id}" in place of its text, for every request '
                        "that does not set return_tokens_as_token_ids itself")
    g.add_argument("--response-role", default="assistant",
                   help="the role of a chat reply when the request's add_generation_prompt is true "
                        "(default: assistant); with it false the reply takes the last message's role")
    limits = ServerLimits()
    g.add_argument("--max-waiting-requests", type=int, default=limits.max_waiting_requests,
                   help="sequences waiting to run beyond which requests get 503 with Retry-After "
                        "(default: unbounded)")
    g.add_argument("--max-sequences-per-request", type=int, default=limits.max_sequences_per_request,
                   help=f"prompts x n one request may ask for (default: {limits.max_sequences_per_request})")
    g.add_argument("--max-tokens-per-request", type=int, default=limits.max_tokens_per_request,
                   help="prompt plus max_tokens over all sequences of one request "
                        f"(default: {limits.max_tokens_per_request})")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets running requests finish before aborting them (default: 30)")
    g.add_argument("--max-request-body-bytes", type=int, default=limits.max_request_body_bytes,
                   help=f"bigger bodies get 413 (default: {limits.max_request_body_bytes})")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served under NAME: a request whose model is NAME "
                        "runs with it (repeatable; turns on --enable-lora); or, as in vLLM, JSON "
                        '\'{"name": NAME, "path": PATH, "base_model_name": PARENT}\'. With '
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, POST /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter add and remove adapters while serving (needs --enable-lora)")


def lora_modules_from_args(args: argparse.Namespace) -> list[LoRARequest]:
    """One ``LoRARequest`` per ``--lora-modules`` entry, with ids 1, 2, ... in order."""
    modules = []
    for spec in args.lora_modules:
        name, path, base_model_name = _lora_module_fields(spec)
        if any(m.lora_name == name for m in modules):
            raise ValueError(f"--lora-modules names {name!r} twice: each adapter needs its own name")
        modules.append(LoRARequest(name, len(modules) + 1, path, base_model_name))
    return modules


def _lora_module_fields(spec: str) -> tuple[str, str, str | None]:
    """(name, path, base model name) of one ``--lora-modules`` entry, read as vLLM reads it:
    ``NAME=PATH`` when it has an '=' and no comma, else a JSON object with ``name``, ``path`` and
    optionally ``base_model_name``."""
    usage = ('give NAME=PATH or a JSON object {"name": ..., "path": ..., "base_model_name": ...} '
             "(path: a PEFT adapter directory)")
    if "=" in spec and "," not in spec:
        name, _, path = spec.partition("=")
        fields = {"name": name, "path": path}
    else:
        try:
            fields = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {spec!r} is invalid: not valid JSON ({e}); {usage}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"--lora-modules {spec!r} is invalid: not a JSON object; {usage}")
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {spec!r} is invalid: unknown field {unknown[0]!r}; {usage}")
    name, path, base = fields.get("name"), fields.get("path"), fields.get("base_model_name")
    if not all(isinstance(v, str) and v for v in (name, path)) or not isinstance(base, str | None):
        raise ValueError(f"--lora-modules {spec!r} is invalid: it needs a name and a path; {usage}")
    return name, path, base


def serve_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(levelname)s %(name)s: %(message)s")
    from pagedlab.engine.async_engine import AsyncEngine
    from pagedlab.server.app import run_server

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"error: `pagedlab serve` needs FastAPI and uvicorn ({e}): pip install 'pagedlab[server]'",
              file=sys.stderr)
        return 2
    try:
        chat_template = chat_template_from_arg(args.chat_template)
        check_response_role(args.response_role)
        limits = limits_from_args(args)
        tool_calling = tool_calling_from_args(args)
        lora_modules = lora_modules_from_args(args)
        config = engine_config_from_args(args)
        config.enable_lora = config.enable_lora or bool(lora_modules)
        config.reasoning_config = reasoning_config_from_args(args)
        engine = AsyncEngine.from_engine_config(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # each adapter is read once now, so a bad one stops the server before it listens
        for lora in lora_modules:
            engine.call(lambda llm_engine, lora=lora: llm_engine.validate_lora_request(lora)).result()
    except ValueError as e:
        engine.shutdown()
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = args.served_model_name or [args.model]
    print(f"pagedlab serve: {names[0]} on http://{args.host}:{args.port}/v1 "
          f"(max_model_len {engine.max_model_len}, {engine.get_stats().num_kv_blocks} KV blocks)",
          file=sys.stderr)
    if engine.default_sampling_args:
        print(f"pagedlab serve: a request's unset sampling fields default to the model's generation config: "
              f"{engine.default_sampling_args} (--generation-config vllm ignores it)", file=sys.stderr)
    try:
        run_server(engine, args.host, args.port, served_model_names=names, api_key=args.api_key,
                   chat_template=chat_template, log_level=args.log_level,
                   enable_metrics=not args.disable_metrics, limits=limits,
                   shutdown_timeout_s=args.shutdown_timeout, lora_modules=lora_modules,
                   tool_calling=tool_calling, return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                   response_role=args.response_role)
    finally:
        engine.shutdown()
    return 0


def chat_template_from_arg(value: str | None) -> str | None:
    """``--chat-template``: the text of the file it names, else the value itself as an inline
    Jinja template. A value that opens no file and has no Jinja in it ({, } or a line break) is a
    ValueError: a mistyped path would otherwise be the template, every chat prompt its text."""
    if value is None:
        return None
    try:
        return Path(value).read_text()
    except OSError as e:  # no such file, or a template too long to be a file name
        if any(c in value for c in "{}\n"):
            return value
        raise ValueError(f"--chat-template {value!r} is neither a readable file ({e.strerror}) nor a Jinja "
                         "template: give a template file or the template's text") from None


def check_response_role(role: str) -> None:
    """ValueError unless ``--response-role`` names a role: a blank one would be every reply's."""
    if not role.strip():
        raise ValueError(f"--response-role {role!r} is invalid: give a role name such as assistant")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """The ``ServerLimits`` the serve flags ask for (each must be positive)."""
    limits = ServerLimits(args.max_waiting_requests, args.max_sequences_per_request,
                          args.max_tokens_per_request, args.max_request_body_bytes)
    for flag, value in (("--max-waiting-requests", limits.max_waiting_requests),
                        ("--max-sequences-per-request", limits.max_sequences_per_request),
                        ("--max-tokens-per-request", limits.max_tokens_per_request),
                        ("--max-request-body-bytes", limits.max_request_body_bytes)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} is invalid: it must be at least 1")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout} is invalid: it must be >= 0")
    return limits


def tool_calling_from_args(args: argparse.Namespace) -> dict:
    """``OpenAIServingChat``'s tool and reasoning keywords from the serve flags; a ValueError naming
    the flag when --enable-auto-tool-choice lacks --tool-call-parser."""
    tool_parser_named(args.tool_call_parser, args.enable_auto_tool_choice)
    return {"tool_call_parser": args.tool_call_parser,
            "enable_auto_tool_choice": args.enable_auto_tool_choice,
            "exclude_tools_when_tool_choice_none": args.exclude_tools_when_tool_choice_none,
            "reasoning_parser": args.reasoning_parser}


def reasoning_config_from_args(args: argparse.Namespace) -> dict | None:
    """``--reasoning-config``, with ``--reasoning-parser`` as its ``reasoning_parser`` where it names
    none: as in vLLM, the parser alone gives ``thinking_token_budget`` its markers."""
    if args.reasoning_parser is None:
        return args.reasoning_config
    return {"reasoning_parser": args.reasoning_parser, **(args.reasoning_config or {})}


def register(subparsers) -> None:
    """Add ``serve`` to the top-level ``pagedlab`` subcommands."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible API server",
                              description="Serve a model over an OpenAI-compatible HTTP API with streaming, "
                                          "online continuous batching and Prometheus metrics.")
    add_serve_args(p)
    p.set_defaults(func=serve_command)


def register_bench(bench_subparsers) -> None:
    """Add ``serve`` under ``pagedlab bench``."""
    from pagedlab.server.bench_serve import add_bench_serve_args, bench_serve_command

    p = bench_subparsers.add_parser("serve", help="benchmark a running OpenAI-compatible server",
                                    description="Send requests to a server at a given rate and report "
                                                "throughput, TTFT, TPOT, ITL and end-to-end latency, named "
                                                "like `vllm bench serve`.")
    add_bench_serve_args(p)
    p.set_defaults(func=bench_serve_command)
