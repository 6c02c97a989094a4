"""Batched multi-LoRA: the low-rank products of many adapters in one launch each (punica's
shrink then expand, as vLLM's sgmv kernels do).

A LoRA linear holds every GPU slot's weights stacked: ``lora_a`` ``[slots, slices, rank, in]``
and ``lora_b`` ``[slots, slices, out, rank]`` (``lora_alpha`` scaling folded into B, ranks below
the maximum zero-padded). A fused linear (q/k/v, gate/up) has one slice per part, each with its
own A and B, written to its own column range of the output (the slices' ranges follow each
other). Each token of a step belongs to one slot, or to none (-1: the base model only).

The kernels run over the row tiles of ``LoRAMapping`` (``pagedlab.lora.ops``): the step's tokens
sorted by slot, cut into tiles of at most ``block_m`` rows that never span two slots, so no
program works for a slot without tokens. Grids depend only on the number of tokens and slots
(``max_tiles``), never on the mapping, so a CUDA graph captures them with the mapping in static
buffers; programs past the table's tile count return at once.

- ``lora_shrink`` (split-K): program (tile, K split, slice) writes the fp32 partial sum
  ``h[split, slice, t] = x[t] @ A[slot(t), slice, :, k range].T`` of each of its tokens ``t``
  (token order; rows of tokens without a slot are left unwritten). Many splits at few tokens, so
  the weights' read spreads over the whole GPU instead of one program walking all of K.
- ``lora_expand``: program (tile, output tile) sums the tile's rows of ``h`` over the splits in
  split order (deterministic), then adds ``h @ B[slot, slice].T`` to its ``block_n`` columns of
  ``y``. Output tiles are numbered across the slices, so none is wasted on a short slice.

``add_lora`` is the two in a row, with ``h`` in a caller's static workspace (``workspace_numel``).

What a LoRA linear runs (``linear_with_lora``): where its base would run the dense 16-bit GEMV
(``kernels/gemv.py``: a ``DENSE_GEMV_CONFIGS`` entry, at most 16 rows, a dense weight, one rank)
and the GEMV's column tiles do not straddle two slices, the shrink and then ONE GEMV whose epilogue
adds each row's delta (``GemvLoRA``): no expand launch. Everywhere else (cuBLAS shapes, FP8 and
AWQ bases, batch-invariant mode, more rows) the base, the shrink and the expand; while a CUDA
graph is captured the shrink runs there on a side stream beside the base.

``pagedlab.lora.ops`` holds the plain-torch references (the CPU path). This module imports triton
when it loads: import it lazily.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedlab.kernels.gemv import GemvLoRA, dense_gemv_triton
from pagedlab.kernels.gemv_configs import TileConfig
from pagedlab.kernels.pdl import pdl_launch
from pagedlab.kernels.pdl_jit import pdl_wait_and_trigger
from pagedlab.lora.ops import TILE_BLOCK_MS, LoRAMapping, max_tiles

# Shrink programs to aim for, and the most K splits: on the H200 at 1-4 tokens the shrink +
# expand pair was fastest near 64-100 programs (qkv: 8 splits of 4 tiles x 3 slices; down: 16).
TARGET_PROGRAMS = 128
MAX_SPLITS = 32
# At decode batches (16-256 tokens) the target alone left qkv one split at 256 tokens (shrink
# 16.6 us against 7.8 with 4): no shrink program walks more than this much of K there.
DECODE_SPLIT_K = 1024
DECODE_MIN_SPLITS_CAP = 8
LARGE_STEP_TOKENS = 1024  # from here tiles of 64 rows: each slot's A and B read by fewer programs
MAX_SLICES = 3


@dataclass(frozen=True)
class LoRAKernelConfig:
    """Launch parameters of one shrink + expand: rows per tile (one of ``TILE_BLOCK_MS``), K
    splits of the shrink, its K step, and the expand's output columns per program."""

    block_m: int = 16
    num_splits: int = 1
    block_k: int = 128
    block_n: int = 128


def block_m_for(num_tokens: int) -> int:
    """Rows per tile for a step of ``num_tokens`` tokens."""
    return TILE_BLOCK_MS[0] if num_tokens < LARGE_STEP_TOKENS else TILE_BLOCK_MS[1]


def choose_config(num_tokens: int, num_slots: int, slices: int, k: int) -> LoRAKernelConfig:
    """The config for ``num_tokens`` tokens (a captured graph's token count: the grids must not
    depend on the mapping): K split until the shrink has about ``TARGET_PROGRAMS`` programs, each
    split at least one K step, a power of two (few compiled variants of the expand). Below
    ``LARGE_STEP_TOKENS`` no program walks more than about ``DECODE_SPLIT_K`` of K (up to
    ``DECODE_MIN_SPLITS_CAP`` splits), however many tiles the batch has."""
    config = LoRAKernelConfig(block_m=block_m_for(num_tokens))
    wanted = min(TARGET_PROGRAMS // (max_tiles(num_tokens, num_slots, config.block_m) * slices),
                 k // config.block_k, MAX_SPLITS)
    if num_tokens < LARGE_STEP_TOKENS:
        wanted = max(wanted, min(k // DECODE_SPLIT_K, DECODE_MIN_SPLITS_CAP))
    return LoRAKernelConfig(block_m=config.block_m, num_splits=1 << (max(wanted, 1).bit_length() - 1))


def workspace_numel(max_tokens: int, max_slices: int, rank: int) -> int:
    """fp32 elements of ``h`` that ``choose_config``'s split count needs for up to ``max_tokens``
    tokens: splits x slices x tiles <= TARGET_PROGRAMS and tokens <= tiles x block_m, or at most
    ``DECODE_MIN_SPLITS_CAP`` splits below ``LARGE_STEP_TOKENS`` tokens, or one split."""
    decode_tokens = min(max_tokens, LARGE_STEP_TOKENS - 1)
    return max(TARGET_PROGRAMS * max(TILE_BLOCK_MS), DECODE_MIN_SPLITS_CAP * max_slices * decode_tokens,
               max_slices * max_tokens) * rank


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_rank(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


@triton.jit
def _tile_rows(tiles_ptr, sorted_ptr, tile, BLOCK_M: tl.constexpr):
    """Tile ``tile`` of the table: its slot, which of its ``BLOCK_M`` rows are real, and their
    token indices."""
    entry = tiles_ptr + 1 + 3 * tile
    slot = tl.load(entry).to(tl.int64)
    start = tl.load(entry + 1)
    offs_m = tl.arange(0, BLOCK_M)
    valid = offs_m < tl.load(entry + 2)
    tokens = tl.load(sorted_ptr + start + offs_m, mask=valid, other=0).to(tl.int64)
    return slot, valid, tokens


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, h_ptr, sorted_ptr, tiles_ptr, K, R, k_per_split,
                        stride_x, stride_a_slot, stride_a_slice, stride_a_rank,
                        stride_h_split, stride_h_slice, stride_h_row,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Program (tile, split, slice): the tile's rows times its slot's A over one K range. Launched
    without PDL, which measured slower here (``kernels/pdl.py``)."""
    tile = tl.program_id(0)
    if tile >= tl.load(tiles_ptr):
        return
    split = tl.program_id(1)
    part = tl.program_id(2)
    slot, valid, tokens = _tile_rows(tiles_ptr, sorted_ptr, tile, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    r_valid = offs_r < R
    a_base = a_ptr + slot * stride_a_slot + part * stride_a_slice
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # tl.full, not tl.zeros: the standard library's jit functions cannot be interpreted when triton
    # was imported before TRITON_INTERPRET was set (as in a test session that loaded peft first).
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < k_end
        x = tl.load(x_ptr + tokens[:, None] * stride_x + offs_k[None, :],
                    mask=valid[:, None] & k_valid[None, :], other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_a_rank + offs_k[:, None],
                    mask=r_valid[None, :] & k_valid[:, None], other=0.0)
        acc = tl.dot(x, a.to(x.dtype), acc, input_precision=DOT_PRECISION)
    out = h_ptr + split * stride_h_split + part * stride_h_slice + tokens[:, None] * stride_h_row
    tl.store(out + offs_r[None, :], acc, mask=valid[:, None] & r_valid[None, :])


@triton.jit
def _lora_expand_kernel(h_ptr, b_ptr, y_ptr, sorted_ptr, tiles_ptr, R, SIZE0, SIZE1, SIZE2,
                        stride_h_split, stride_h_slice, stride_h_row, stride_b_slot, stride_b_slice,
                        stride_b_row, stride_y, SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (tile, output tile): adds ``h @ B.T`` into ``BLOCK_N`` columns of one slice for
    the tile's rows. Output tiles run over slice 0's columns, then slice 1's, then slice 2's.
    Each output element has exactly one program: no atomics. PDL: waits first."""
    pdl_wait_and_trigger(PDL)
    tile = tl.program_id(0)
    if tile >= tl.load(tiles_ptr):
        return
    pid_n = tl.program_id(1)
    tiles0 = (SIZE0 + BLOCK_N - 1) // BLOCK_N
    tiles1 = (SIZE1 + BLOCK_N - 1) // BLOCK_N
    in1 = pid_n >= tiles0
    in2 = pid_n >= tiles0 + tiles1
    part = in1.to(tl.int32) + in2.to(tl.int32)
    first = tl.where(in2, tiles0 + tiles1, tl.where(in1, tiles0, 0))
    offset = tl.where(in2, SIZE0 + SIZE1, tl.where(in1, SIZE0, 0))
    size = tl.where(in2, SIZE2, tl.where(in1, SIZE1, SIZE0))
    slot, valid, tokens = _tile_rows(tiles_ptr, sorted_ptr, tile, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    r_valid = offs_r < R
    h_rows = h_ptr + part * stride_h_slice + tokens[:, None] * stride_h_row + offs_r[None, :]
    # All splits' partial sums in one load, then one reduction over the split axis (a fixed tree
    # order): loaded one by one, each ~0.3 us L2 round trip waited for the previous add.
    offs_s = tl.arange(0, SPLITS_POW2)
    row_mask = valid[:, None] & r_valid[None, :]
    partials = tl.load(h_rows[None, :, :] + offs_s[:, None, None] * stride_h_split,
                       mask=(offs_s < SPLITS)[:, None, None] & row_mask[None, :, :], other=0.0)
    h = tl.sum(partials, axis=0)
    offs_n = (pid_n - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < size
    b = tl.load(b_ptr + slot * stride_b_slot + part * stride_b_slice + offs_n[None, :] * stride_b_row
                + offs_r[:, None], mask=n_valid[None, :] & r_valid[:, None], other=0.0)
    delta = tl.dot(h.to(b.dtype), b, input_precision=DOT_PRECISION)
    out = y_ptr + tokens[:, None] * stride_y + offset + offs_n[None, :]
    mask = valid[:, None] & n_valid[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping,
                config: LoRAKernelConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[splits, slices, tokens, rank]`` fp32 partial sums (token order; rows of tokens without a
    slot are left unwritten) of each token's input times its slot's A of every slice; their sum
    over the splits is ``lora_shrink_torch``'s ``h``. In a view of ``out`` (fp32, at least
    ``workspace_numel`` elements) when given."""
    x = x.contiguous()
    slots, slices, rank, k = lora_a.shape
    if mapping.num_slots != slots:
        raise ValueError(f"the LoRA mapping has {mapping.num_slots} slots, the weights {slots}")
    num_tokens = x.shape[0]
    config = config or choose_config(num_tokens, slots, slices, k)
    shape = (config.num_splits, slices, num_tokens, rank)
    needed = config.num_splits * slices * num_tokens * rank
    if out is None:
        h = torch.empty(shape, dtype=torch.float32, device=x.device)
    elif out.numel() < needed:
        raise ValueError(f"the LoRA workspace holds {out.numel()} values; {config} for {num_tokens} tokens "
                         f"and {slices} slices of rank {rank} needs {needed}")
    else:
        h = out[:needed].view(shape)
    k_per_split = triton.cdiv(triton.cdiv(k, config.num_splits), config.block_k) * config.block_k
    grid = (max_tiles(num_tokens, mapping.num_slots, config.block_m), config.num_splits, slices)
    _lora_shrink_kernel[grid](
        x, lora_a, h, mapping.sorted_token_ids, mapping.tiles(config.block_m), k, rank, k_per_split,
        x.stride(0), *lora_a.stride()[:3], *h.stride()[:3], BLOCK_M=config.block_m, BLOCK_R=_block_rank(rank),
        BLOCK_K=config.block_k, DOT_PRECISION=_dot_precision(x.dtype))
    return h


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping, y: torch.Tensor,
                slice_sizes: Sequence[int], config: LoRAKernelConfig | None = None) -> None:
    """``y[t, offset_j:offset_j + size_j] += (sum of h[:, j, t]) @ B[slot(t), j].T`` for every
    slice ``j`` (``h``: ``lora_shrink``'s partial sums; ``offset_j`` the sum of the sizes before),
    in place. ``config.block_m`` must be the shrink's."""
    _, slices, max_out, rank = lora_b.shape
    if len(slice_sizes) != slices or not 1 <= slices <= MAX_SLICES or max(slice_sizes) > max_out:
        raise ValueError(f"slice_sizes {list(slice_sizes)} do not fit LoRA B of shape {tuple(lora_b.shape)} "
                         f"(1 to {MAX_SLICES} slices, each at most {max_out} outputs)")
    num_tokens = y.shape[0]
    config = config or LoRAKernelConfig(block_m=block_m_for(num_tokens))
    sizes = [*slice_sizes, 0, 0][:MAX_SLICES]
    grid = (max_tiles(num_tokens, mapping.num_slots, config.block_m),
            sum(triton.cdiv(size, config.block_n) for size in slice_sizes))
    _lora_expand_kernel[grid](
        h, lora_b, y, mapping.sorted_token_ids, mapping.tiles(config.block_m), rank, *sizes,
        *h.stride()[:3], *lora_b.stride()[:3], y.stride(0), SPLITS=h.shape[0],
        SPLITS_POW2=triton.next_power_of_2(h.shape[0]), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_R=_block_rank(rank), DOT_PRECISION=_dot_precision(lora_b.dtype), **pdl_launch(y.device))


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             mapping: LoRAMapping, slice_sizes: Sequence[int], workspace: torch.Tensor | None = None,
             config: LoRAKernelConfig | None = None) -> None:
    """``y += `` each token's adapter delta: ``lora_shrink`` into ``workspace``, then ``lora_expand``."""
    slots, slices, _, k = lora_a.shape
    config = config or choose_config(x.shape[0], slots, slices, k)
    h = lora_shrink(x, lora_a, mapping, config, workspace)
    lora_expand(h, lora_b, mapping, y, slice_sizes, config)


def fused_gemv_config(base, x: torch.Tensor, slice_sizes: Sequence[int]) -> TileConfig | None:
    """The dense GEMV config ``base(x)`` runs with (``base.gemv_config``, the linear layers'), when
    its column tiles each lie in one slice (the GEMV's LoRA epilogue needs that); else None."""
    choose = getattr(base, "gemv_config", None)
    config = choose(x) if choose is not None and x.dim() == 2 else None
    if config is None or any(size % config.block_n for size in slice_sizes[:-1]):
        return None
    return config


def linear_with_lora(base, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping,
                     slice_sizes: Sequence[int], workspace: torch.Tensor | None = None,
                     side_stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """``base(x)`` plus each token's adapter delta. Where ``base`` runs the dense GEMV
    (``fused_gemv_config``): the shrink, then that GEMV adding the deltas in its epilogue. Else
    ``base`` and ``add_lora``; while a CUDA graph is captured with a ``side_stream``, the shrink
    runs on it beside ``base`` (a parallel branch of the graph), the expand after both."""
    slots, slices, _, k = lora_a.shape
    config = choose_config(x.shape[0], slots, slices, k)
    gemv = fused_gemv_config(base, x, slice_sizes)
    if gemv is not None:
        h = lora_shrink(x, lora_a, mapping, config, workspace)
        return dense_gemv_triton(x, base.weight, base.bias, gemv,
                                 GemvLoRA(h, lora_b, mapping.token_slots, tuple(slice_sizes)))
    if side_stream is None or not torch.cuda.is_current_stream_capturing():
        y = base(x)
        add_lora(x, y, lora_a, lora_b, mapping, slice_sizes, workspace, config)
        return y
    main = torch.cuda.current_stream()
    side_stream.wait_stream(main)
    with torch.cuda.stream(side_stream):
        h = lora_shrink(x, lora_a, mapping, config, workspace)
    y = base(x)
    main.wait_stream(side_stream)
    lora_expand(h, lora_b, mapping, y, slice_sizes, config)
    return y
