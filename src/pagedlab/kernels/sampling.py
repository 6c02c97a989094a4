"""Gumbel-max sampling: each row of a batch of logits to one token id, in one read of the logits.

A row of temperature ``T > 0`` draws ``argmax_i(x_i * (1 / T) + g_i)``, with Gumbel noise
``g_i = -log(-log(u_i))`` from uniforms ``u_i`` in [0, 1): the index of the largest perturbed
logit follows ``softmax(x / T)`` exactly (the Gumbel-max trick; the same draw as the exponential
race ``argmax(p_i / q_i)``, ``q_i ~ Exp(1)``), with no softmax, no normalisation and no float32
copy of the logits. A row of temperature 0 is greedy, ``argmax_i(x_i)``. Ties go to the lowest
index (``torch.argmax``'s rule); a NaN score is never chosen.

The uniforms are counter-based: ``u_i`` is output ``i % 4`` of Philox4x32-10 (Triton's
``tl.rand4x``) at counter ``i // 4``, keyed by the row's 64-bit seed, through Triton's uint32 to
float conversion. A row's noise therefore depends on its seed and the vocabulary index alone: not
on the other rows, their number or order, nor on how the kernel splits the vocabulary.

``sample_tokens_triton`` (``kernels/sampling_kernels.py``) is the kernel: a grid of (rows,
vocabulary chunks), each program writing its chunk's best (score, index), then a fold per row
(the largest score, ties to the lowest index). The fold is exact, so the chunking never changes a
token. ``sample_tokens_torch`` here is the same function in torch integer and float ops, Philox
included: the same bits (``1 / T`` and ``x * (1 / T) - log(-log(u))`` rounded the same way, the
kernel compiled without FMA contraction), up to the last-ulp rounding of the device's ``log``,
which can only matter where two scores tie to within an ulp. The CPU engine samples through it.
"""

from __future__ import annotations

import torch

# Triton's Philox4x32 constants (triton/language/random.py)
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_ROUNDS = 10
# Triton's uint32 -> float scale: the largest float32 with (2**31 - 1) * scale < 1
UNIFORM_SCALE = 4.6566127342e-10
_LOW32 = 0xFFFFFFFF
LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def philox4x32(counter: torch.Tensor, seed: torch.Tensor) -> list[torch.Tensor]:
    """Triton's ``randint4x``: Philox4x32-10 of the counter ``(counter, 0, 0, 0)`` under the key
    ``(seed & 0xFFFFFFFF, seed >> 32)`` of the 64-bit ``seed``. int64 tensors (broadcast against
    each other) holding uint32 values in; four such tensors out. A round's 32 x 32-bit products
    are int64 products, which wrap modulo 2**64 and so keep every bit of the unsigned ones."""
    k0, k1 = seed & _LOW32, (seed >> 32) & _LOW32
    shape = torch.broadcast_shapes(counter.shape, seed.shape)
    c0 = counter.expand(shape)
    c1 = c2 = c3 = torch.zeros(shape, dtype=torch.int64, device=counter.device)
    for _ in range(PHILOX_ROUNDS):
        product_b, product_a = c2 * PHILOX_ROUND_B, c0 * PHILOX_ROUND_A
        c0 = (product_b >> 32).bitwise_and_(_LOW32).bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = (product_a >> 32).bitwise_and_(_LOW32).bitwise_xor_(c3).bitwise_xor_(k1)
        c1, c3 = product_b.bitwise_and_(_LOW32), product_a.bitwise_and_(_LOW32)
        k0, k1 = (k0 + PHILOX_KEY_A) & _LOW32, (k1 + PHILOX_KEY_B) & _LOW32
    return [c0, c1, c2, c3]


def uniform_from_uint32(bits: torch.Tensor) -> torch.Tensor:
    """Triton's ``uint_to_uniform_float``: the bits read as an int32, a negative one complemented,
    converted to float32 and times ``UNIFORM_SCALE`` (in float32): a float32 in [0, 1)."""
    bits = torch.where(bits > 0x7FFFFFFF, _LOW32 - bits, bits)
    return bits.float() * torch.tensor(UNIFORM_SCALE, dtype=torch.float32)


def philox_uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, vocab]`` float32 uniforms of rows seeded by ``seeds`` ``[R]`` int64: entry ``i`` is
    output ``i % 4`` of counter ``i // 4``."""
    counters = torch.arange((vocab + 3) // 4, dtype=torch.int64, device=seeds.device)
    bits = torch.stack(philox4x32(counters, seeds.unsqueeze(1)), dim=-1).flatten(1)[:, :vocab]
    return uniform_from_uint32(bits)


def gumbel_scores_torch(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, V]`` scores whose argmax ``sample_tokens`` takes: ``x * (1 / T) + g`` on
    rows of temperature ``T > 0``, the logits on greedy rows, NaN as -inf."""
    scores = logits.to(torch.float32, copy=True)
    rows = (temperature > 0).nonzero().squeeze(1)
    if rows.numel():
        noise = -torch.log(-torch.log(philox_uniforms(seeds[rows], logits.shape[1])))
        scores[rows] = scores[rows] * temperature[rows].reciprocal().unsqueeze(1) + noise
    return scores.masked_fill_(scores.isnan(), float("-inf"))


def sample_tokens_torch(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Reference of ``sample_tokens_triton``: ``[N]`` int64 token ids."""
    check_sampling_inputs(logits, temperature, seeds)
    return gumbel_scores_torch(logits, temperature, seeds).argmax(dim=-1)


def check_sampling_inputs(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> None:
    """``logits`` ``[N, V]`` (float32/16, bfloat16), ``temperature`` ``[N]`` float32 (0: greedy),
    ``seeds`` ``[N]`` int64, all on one device; a ValueError names what is wrong."""
    if logits.dim() != 2 or logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits of shape {tuple(logits.shape)} and dtype {logits.dtype}: a 2-D tensor "
                         f"of {', '.join(str(d) for d in LOGITS_DTYPES)} is needed")
    rows = logits.shape[0]
    for name, tensor, dtype in (("temperature", temperature, torch.float32), ("seeds", seeds, torch.int64)):
        if tensor.shape != (rows,) or tensor.dtype != dtype or tensor.device != logits.device:
            raise ValueError(f"{name} of shape {tuple(tensor.shape)}, dtype {tensor.dtype} on "
                             f"{tensor.device}: [{rows}] {dtype} on {logits.device} (the logits' rows and "
                             "device) is needed")


def warm_up_sampling(logits: torch.Tensor) -> None:
    """Greedy-sample ``logits`` (``[max_rows, V]`` as the model makes them) at one row and at all
    of them, in their dtype and in float32 (the sampler's copy when it rewrites logits): on CUDA
    this compiles (or loads from Triton's cache) every kernel variant a batch of 1 to ``max_rows``
    rows can launch (``kernels/sampling_kernels.py``), so that an engine pays it at start-up rather
    than in a step. Nothing to do elsewhere."""
    if not logits.is_cuda:
        return
    rows = logits.shape[0]
    temperature = torch.zeros(rows, dtype=torch.float32, device=logits.device)
    seeds = torch.zeros(rows, dtype=torch.int64, device=logits.device)
    for values in (logits, logits.float()):
        for count in sorted({1, rows}):
            sample_tokens(values[:count], temperature[:count], seeds[:count])


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token id per row (see the module docstring): the Triton kernel on CUDA, the torch
    reference elsewhere."""
    if logits.is_cuda:
        from pagedlab.kernels.sampling_kernels import sample_tokens_triton

        return sample_tokens_triton(logits, temperature, seeds)
    return sample_tokens_torch(logits, temperature, seeds)
