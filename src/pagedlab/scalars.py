"""numpy numbers as the Python numbers they hold, where values enter the public API.

A sweep over a pandas table or ``np.arange`` hands ``np.int64(64)`` for ``max_num_seqs`` and
``np.float32(0.7)`` for a temperature; the checks (``isinstance(value, int)``) and the JSON
manifests the lab writes expect Python numbers. ``SamplingParams``, ``EngineConfig``, the prompt
parser and ``LLM.benchmark`` pass their inputs through here first, so numpy values (and token ids
or batch sizes as arrays) behave as Python ones do.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable


def python_scalar(value):
    """``value`` as the Python number it holds where it is a numpy scalar (``np.int64``,
    ``np.float32``, ``np.bool_``), a 0-d array or tensor, or another integral or real number;
    Python numbers and everything else as given, for the caller's checks to judge."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def is_1d_array(value) -> bool:
    """A 1-D numpy array or torch tensor (token ids, batch sizes)."""
    return hasattr(value, "tolist") and getattr(value, "ndim", None) == 1


def is_value_list(value) -> bool:
    """An iterable of values (a list, tuple, set, 1-D array or tensor), not a string or a mapping."""
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes, dict))


def python_numbers(values) -> list:
    """A list of ``python_scalar`` values from any iterable of numbers (numpy's too) or a 1-D array
    (``is_1d_array``); elements that are not numbers stay as given, for the caller's check to name."""
    return [python_scalar(v) for v in (values.tolist() if is_1d_array(values) else values)]
