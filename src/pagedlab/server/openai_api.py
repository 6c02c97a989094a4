"""``python -m pagedlab.server.openai_api --model DIR [engine args]``: the OpenAI-compatible
server without the top-level CLI (the same as ``pagedlab serve``).

The server itself is ``pagedlab.server.app`` (``build_app``, ``run_server``, ``ServerThread``),
its bodies ``pagedlab.server.protocol``, its endpoints ``serving_completion`` and ``serving_chat``.
"""

import argparse

from pagedlab.server.cli import add_serve_args, serve_command


def main(argv: list[str] | None = None) -> int:
    """Parse the serve arguments and serve until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m pagedlab.server.openai_api",
                                     description="OpenAI-compatible server (same as `pagedlab serve`)")
    add_serve_args(parser)
    return serve_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
