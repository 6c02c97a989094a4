"""The ``pagedlab`` command line; ``main`` is the console script."""

from pagedlab.cli.main import main

__all__ = ["main"]
