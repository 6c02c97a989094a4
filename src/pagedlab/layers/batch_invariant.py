"""Batch-invariant mode (``EngineConfig.batch_invariant``): a prompt's logits come out bitwise the
same alone, in any batch, at any place in it, prefilled whole or in chunks, from the prefix cache
or not. Every reduction that makes one token's numbers runs in an order that does not depend on
the other tokens of the step.

The one switch is ``batch_invariant_mode(enabled)``, which the model runner enters around
everything it runs on the model (each step, the memory profile, the CUDA-graph captures). Inside
it the numerics change where a reduction's order could follow the batch:

- linears (the LM head included, ``dense_linear``): on CUDA the fixed-tile Triton matmul of
  ``kernels/batch_invariant.py``; on the CPU one ``[1, K] @ [K, N]`` product per row in one
  batched call (BLAS picks its kernel, and its summation order, from the row count: a batch of 1
  and a batch of 37 round differently);
- RMSNorm/LayerNorm and the sampler's (log-)softmax: one Triton program per row on CUDA (the
  compiled and cuBLAS-side reductions pick split strategies from the shape); the CPU's are
  already per row. Qwen3's and Gemma 3's per-head q/k norms on the Triton attention backend run
  inside its fused rotary KV write, whose programs (one per token and KV head, shapes fixed by
  the model) are per row already, in and out of the mode;
- attention (``layers/attention``): the Triton backend runs one query tile and no split-KV or
  cascade whatever the batch, the torch backend one SDPA per query row over exactly its keys.

The sampler's draw (``kernels/sampling.py``) needs no switch: in and out of the mode a row's token
is an exact max over its own scores, so it follows the row's logits, temperature and seed alone.

Outside the mode nothing changes. A ``ContextVar`` holds it, so each thread sees its own.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

_ENABLED: ContextVar[bool] = ContextVar("pagedlab_batch_invariant", default=False)
# Tests set this to run the Triton kernels on CPU tensors too (under TRITON_INTERPRET=1).
TRITON_ON_CPU = False


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True):
    """Run the model's reductions batch-invariantly inside this block (see the module docstring)."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def batch_invariant_enabled() -> bool:
    """Whether the calling code runs inside ``batch_invariant_mode(True)``."""
    return _ENABLED.get()


def runs_invariant_kernels(x: torch.Tensor) -> bool:
    """The mode is on and ``x`` is where the Triton kernels run (CUDA, or the CPU in tests)."""
    return _ENABLED.get() and (x.is_cuda or TRITON_ON_CPU)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` with each row's sum in an order fixed by the weight alone."""
    if x.is_cuda or TRITON_ON_CPU:
        from pagedlab.kernels.batch_invariant import fixed_tile_matmul_triton

        return fixed_tile_matmul_triton(x, weight.to(x.dtype), bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.bmm(rows.unsqueeze(1), weight.to(x.dtype).t().expand(rows.shape[0], -1, -1)).squeeze(1)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def invariant_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None,
                   unit_offset: bool = False, residual: torch.Tensor | None = None):
    """RMSNorm (LayerNorm with ``bias``), with ``residual`` added first, one program per row:
    the layers' ``forward`` contract (``(norm, x + residual)`` when given a residual)."""
    from pagedlab.kernels.batch_invariant import rows_norm_triton

    return rows_norm_triton(x, weight, eps, bias, unit_offset, residual)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the last dimension; one program per row in the mode."""
    if runs_invariant_kernels(logits):
        from pagedlab.kernels.batch_invariant import softmax_triton

        return softmax_triton(logits, log=True)
    return logits.float().log_softmax(-1)


def softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 softmax over the last dimension; one program per row in the mode."""
    if runs_invariant_kernels(logits):
        from pagedlab.kernels.batch_invariant import softmax_triton

        return softmax_triton(logits, log=False)
    return logits.float().softmax(-1)
