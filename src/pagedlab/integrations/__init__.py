"""Integrations with other tools. Each submodule imports its tool only when it is itself imported:

- ``pagedlab.integrations.lm_eval``: the lm-evaluation-harness model ``pagedlab``.
"""
