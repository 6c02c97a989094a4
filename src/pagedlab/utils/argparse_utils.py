"""vLLM's ``vllm.utils.argparse_utils``: ``FlexibleArgumentParser``."""

from pagedlab.cli.engine_args import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
