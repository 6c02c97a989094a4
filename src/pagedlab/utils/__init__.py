"""vLLM's ``vllm.utils`` names that scripts import: ``FlexibleArgumentParser``."""

from pagedlab.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
