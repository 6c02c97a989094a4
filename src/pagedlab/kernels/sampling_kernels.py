"""The Triton kernels of Gumbel-max sampling (``kernels/sampling.py`` holds the math, the torch
reference and the dispatch, which imports this module on CUDA only).

``gumbel_argmax_chunk_kernel``: program (row, chunk) walks its chunk of the vocabulary in blocks
of ``BLOCK`` entries laid out ``[BLOCK // 4, 4]``, so one Philox call (``tl.rand4x``) serves the
four entries of a counter; each lane keeps its best score and the first index reaching it, then
the chunk's best (score, index) is stored (or, for a one-chunk launch, the token id itself).
``gumbel_argmax_fold_kernel``: program (row) takes the largest of its chunks' scores, ties to
the lowest index. Every step is an exact max, so the chunking never changes a token.

The chunk count is no specialization of either kernel (the fold's register tile is sized for the
most chunks any batch of the vocabulary takes), so a logits dtype compiles three variants in all:
the chunk kernel with one chunk (FINAL) or more, and the fold. ``sampling.warm_up_sampling``
launches them at an engine's start-up, so that no step pays a compile when it first samples a
new number of rows (a W-seed batch-256 run measured 0.3 s of TTFT on two fold compiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.kernels.gemv import num_sms
from pagedlab.kernels.pdl import pdl_launch
from pagedlab.kernels.pdl_jit import pdl_wait_and_trigger
from pagedlab.kernels.sampling import check_sampling_inputs

SAMPLE_BLOCK = 1024  # vocabulary entries per loop step: 256 Philox counters
_NO_INDEX = tl.constexpr(2147483647)  # above any int32 vocabulary index


@triton.jit
def _keep_best(x, index, best, best_index):
    """A lane's running best: strictly better scores only, so it keeps the first index of its best."""
    better = x > best
    return tl.where(better, x, best), tl.where(better, index, best_index)


@triton.jit(do_not_specialize=["num_chunks"])
def gumbel_argmax_chunk_kernel(logits_ptr, temperature_ptr, seed_ptr, best_value_ptr, best_index_ptr, out_ptr,
                               vocab, stride_row, chunk_size, num_chunks, BLOCK: tl.constexpr,
                               FINAL: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk): the chunk's largest ``x * (1 / T) - log(-log(u))`` (``x`` on greedy
    rows, temperature 0) and its lowest index. Entry ``4c + j`` of a block is output ``j`` of the
    Philox counter ``c``: the block is loaded ``[BLOCK // 4, 4]`` and split into its four columns,
    each lane holding a counter and its four entries, in index order. PDL: waits first."""
    pdl_wait_and_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seed_ptr + row)
    counters = tl.arange(0, BLOCK // 4)
    best = tl.full([BLOCK // 4], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK // 4], _NO_INDEX, tl.int32)
    start = chunk * chunk_size
    # chunk_size is a multiple of BLOCK, so only the vocabulary's end masks (and a vocabulary size
    # divisible by 16, Qwen3's, lets each lane load its four entries in one vector)
    for base in range(start, tl.minimum(start + chunk_size, vocab), BLOCK):
        first = base + counters * 4
        cols = first[:, None] + tl.arange(0, 4)[None, :]
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf"))
        x = x.to(tl.float32)
        even, odd = tl.split(tl.reshape(x, [BLOCK // 4, 2, 2]))
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        if temperature > 0:
            inverse = tl.math.div_rn(1.0, temperature)
            u0, u1, u2, u3 = tl.rand4x(seed, base // 4 + counters)
            x0 = x0 * inverse - tl.log(-tl.log(u0))
            x1 = x1 * inverse - tl.log(-tl.log(u1))
            x2 = x2 * inverse - tl.log(-tl.log(u2))
            x3 = x3 * inverse - tl.log(-tl.log(u3))
        best, best_index = _keep_best(x0, first, best, best_index)
        best, best_index = _keep_best(x1, first + 1, best, best_index)
        best, best_index = _keep_best(x2, first + 2, best, best_index)
        best, best_index = _keep_best(x3, first + 3, best, best_index)
    value = tl.max(best, axis=0)
    index = tl.min(tl.where(best == value, best_index, _NO_INDEX), axis=0)
    index = tl.where(index == _NO_INDEX, start, index)  # every score -inf (or NaN): the chunk's first
    if FINAL:
        tl.store(out_ptr + row, index.to(tl.int64))
    else:
        tl.store(best_value_ptr + row * num_chunks + chunk, value)
        tl.store(best_index_ptr + row * num_chunks + chunk, index)


@triton.jit(do_not_specialize=["num_chunks"])
def gumbel_argmax_fold_kernel(best_value_ptr, best_index_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr,
                              PDL: tl.constexpr):
    """Program (row): the index of the largest chunk score, the lowest index among equal ones.
    PDL: waits first."""
    pdl_wait_and_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    mask = chunks < num_chunks
    values = tl.load(best_value_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    indices = tl.load(best_index_ptr + row * num_chunks + chunks, mask=mask, other=_NO_INDEX)
    value = tl.max(values, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(values == value, indices, _NO_INDEX), axis=0).to(tl.int64))


def default_num_chunks(rows: int, vocab: int, block: int, device: torch.device) -> int:
    """Enough chunks for about four programs per SM, each walking at least four blocks."""
    return max(1, min(-(-4 * num_sms(device) // rows), vocab // (4 * block)))


def sample_tokens_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                         num_chunks: int | None = None, block: int = SAMPLE_BLOCK) -> torch.Tensor:
    """``sample_tokens_torch`` in one pass over the logits (a row-major ``[N, V]`` view, any row
    stride): two launches, one with a single chunk. ``num_chunks`` and ``block`` (a power of two,
    at least 4) change the split, never the tokens. No host sync, so a CUDA graph can hold it."""
    check_sampling_inputs(logits, temperature, seeds)
    if logits.stride(1) != 1:
        raise ValueError(f"logits with strides {logits.stride()}: the vocabulary must be contiguous")
    if block < 4 or block & (block - 1):
        raise ValueError(f"block={block}: a power of two >= 4 is needed")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_chunks = num_chunks or default_num_chunks(rows, vocab, block, logits.device)
    chunk_size = -(-vocab // (num_chunks * block)) * block
    num_chunks = -(-vocab // chunk_size)
    values = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    pdl = pdl_launch(logits.device)
    gumbel_argmax_chunk_kernel[(rows, num_chunks)](
        logits, temperature, seeds, values, indices, out, vocab, logits.stride(0), chunk_size, num_chunks,
        BLOCK=block, FINAL=num_chunks == 1, **pdl, num_warps=4, enable_fp_fusion=False)
    if num_chunks > 1:
        # one fold kernel for every split of this vocabulary (the most chunks: one row's split)
        most = max(num_chunks, default_num_chunks(1, vocab, block, logits.device))
        gumbel_argmax_fold_kernel[(rows,)](values, indices, out, num_chunks,
                                           CHUNKS=triton.next_power_of_2(most), **pdl, num_warps=1)
    return out
