"""FP8 linear kernels: per-token activation quantization in one launch (alone, or fused with the
SiLU-and-mul that produces the activations), and an FP8 GEMV for decode-sized batches, all with
the numerics of ``pagedlab.quantization.fp8`` (whose ``quantize_fp8_per_row`` and
``fp8_linear_torch`` are their references).

- ``quantize_fp8_per_token_triton``: one program per row finds ``max|x|``, divides by 448 for the
  row's float32 scale (``1e-12`` at least), and writes ``fp8(x / scale)`` (or uses a static
  scale); a row of up to 16k values is read once. The plain-torch version takes about seven
  launches and as many round trips of the activations, which at batch 1 cost more than the
  matmul itself.
- ``silu_and_mul_fp8_triton``: the same program on ``silu(gate) * up`` computed from the gate/up
  projection's output as it is read (the down projection's input, never written in 16 bits):
  one launch instead of the SiLU-and-mul and the quantization. Its reference is
  ``silu_and_mul`` then ``quantize_fp8_per_row``. (The RMSNorm fused with the same
  quantization is ``kernels/batch_invariant.py``'s per-row norm kernel.)
- At a few rows on a GPU the SiLU-and-mul + quantization runs split (``split_quant_block``):
  programs of a chunk of a row write its SiLU-and-mul and their ``max|x|``, then programs of a
  chunk quantize it at the scale of its row's maxima. The same values, in two launches over many
  SMs instead of one SM per row (the plain quantization can run split too, when asked).
- ``fp8_gemv_silu_and_mul_triton``: a gate/up projection's FP8 GEMV with the SiLU-and-mul in its
  epilogue, each column tile also writing its rows' maxima, then the split quantization's second
  launch: the down projection's ``QuantizedActivations`` in two launches instead of three.
- ``fp8_gemv_triton``: at most ``GEMV_MAX_ROWS`` rows of FP8 activations times FP8 weights
  ``[N, K]`` (one byte per weight: the decode step reads half of bf16's bytes), accumulated in
  float32 from exact products (E4M3 values are exact in bf16 and fp32; the swapped tensor-core
  tiles sum each ``FP8_PROMOTION_K`` of K in wgmma's accumulator first), then times the row's
  and the output channel's scales. It is the dense GEMV kernel of ``kernels/gemv.py`` with its
  scaled epilogue; it runs the shapes ``gemv_configs.FP8_GEMV_CONFIGS`` lists (by row bucket), and
  ``torch._scaled_mm`` (cuBLASLt) the rest.

This module imports triton when it loads: import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.kernels.gemv import launch_dense_gemv, num_sms
from pagedlab.kernels.gemv_configs import GEMV_MAX_ROWS, TileConfig, default_fp8_gemv_config
from pagedlab.kernels.pdl import pdl_launch
from pagedlab.kernels.pdl_jit import pdl_wait_and_trigger
from pagedlab.kernels.triton_kernels import _round_to_e4m3
from pagedlab.quantization.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX, QuantizedActivations

# The chunk width of the split quantization (``split_quant_block``).
SPLIT_QUANT_BLOCK = 1024


@triton.jit
def _row_chunk(x_row, start, K, offs, GATED: tl.constexpr):
    """Columns ``start + offs`` of the row to quantize, in float32: ``x`` itself, or (GATED) the
    SiLU-and-mul of the row's halves, ``silu(gate) * up``, each product rounded to x's dtype as
    ``layers.activation.silu_and_mul`` rounds them."""
    mask = start + offs < K
    x = tl.load(x_row + start + offs, mask=mask, other=0.0)
    if GATED:
        gate = x.to(tl.float32)
        up = tl.load(x_row + K + start + offs, mask=mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        x = (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    return x.to(tl.float32)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, scale_ptr, static_scale_ptr, out_ptr, K, stride_x, stride_q,
                            stride_out, BLOCK_K: tl.constexpr, STATIC: tl.constexpr, GATED: tl.constexpr,
                            STORE_OUT: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                            PDL: tl.constexpr):
    """Row ``program_id(0)`` of K values (``_row_chunk``: the input row, or GATED the SiLU-and-mul
    of a row of 2K): its scale (``max|x| / FP8_MAX``, or the static one) and its FP8 values;
    STORE_OUT also writes the values before quantization (in the input's dtype). A row of at most
    BLOCK_K values is computed once and kept in registers; a longer one twice. Divisions are IEEE
    (``div_rn``), as torch's, so both round to the same E4M3 values. PDL: waits first (its input
    is the previous kernel's output)."""
    pdl_wait_and_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK_K)
    first = _row_chunk(x_row, 0, K, offs, GATED)
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.abs(first)
        for k_start in range(BLOCK_K, K, BLOCK_K):
            amax = tl.maximum(amax, tl.abs(_row_chunk(x_row, k_start, K, offs, GATED)))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    _store_chunk(first, scale, q_ptr + row * stride_q, out_ptr + row * stride_out, offs, offs < K, STORE_OUT,
                 FP8_MAX)
    for k_start in range(BLOCK_K, K, BLOCK_K):
        _store_chunk(_row_chunk(x_row, k_start, K, offs, GATED), scale, q_ptr + row * stride_q + k_start,
                     out_ptr + row * stride_out + k_start, offs, k_start + offs < K, STORE_OUT, FP8_MAX)


@triton.jit
def _store_chunk(x, scale, q_ptr, out_ptr, offs, mask, STORE_OUT: tl.constexpr, FP8_MAX: tl.constexpr):
    """``fp8(x / scale)`` of one chunk (and x itself with STORE_OUT) at ``offs``."""
    q = _round_to_e4m3(tl.math.div_rn(x, scale), FP8_MAX)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    if STORE_OUT:
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_max_kernel(x_ptr, act_ptr, chunk_max_ptr, K, stride_x, stride_act, chunks, BLOCK_K: tl.constexpr,
                      GATED: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk), the first of the split quantization's two launches: ``max|x|`` over
    the chunk's BLOCK_K values (``_row_chunk``) into ``chunk_max[row, chunk]``; GATED also writes
    the values (the SiLU-and-mul) into ``act`` in its dtype, for the second launch to quantize."""
    pdl_wait_and_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK_K
    offs = tl.arange(0, BLOCK_K)
    x = _row_chunk(x_ptr + row * stride_x, start, K, offs, GATED)
    tl.store(chunk_max_ptr + row * chunks + tl.program_id(1), tl.max(tl.abs(x), axis=0))
    if GATED:
        act = act_ptr + row * stride_act + start + offs
        tl.store(act, x.to(act_ptr.dtype.element_ty), mask=start + offs < K)


@triton.jit
def _quantize_chunk_kernel(x_ptr, chunk_max_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, chunks,
                           BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, FP8_MAX: tl.constexpr,
                           MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk), the second launch: the row's scale from its ``chunks`` maxima (any
    number: the first launch's, or a gated GEMV's per column tile; written by chunk 0, the same
    float32 as ``_per_token_quant_kernel``'s: a maximum is exact in any order) and the FP8 values
    of the row's BLOCK_K values from ``program_id(1) * BLOCK_K``."""
    pdl_wait_and_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    amax = tl.max(tl.load(chunk_max_ptr + row * chunks + offs_c, mask=offs_c < chunks, other=0.0), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)
    start = chunk * BLOCK_K
    offs = tl.arange(0, BLOCK_K)
    x = _row_chunk(x_ptr + row * stride_x, start, K, offs, False)
    q_row = q_ptr + row * stride_q + start
    _store_chunk(x, scale, q_row, q_row, offs, start + offs < K, False, FP8_MAX)


def split_quant_block(rows: int, width: int, gated: bool, device: torch.device) -> int:
    """The chunk width of the split quantization of ``rows`` rows of ``width`` values on
    ``device``, or 0 for one program per row. One program works through its row alone, so at a
    few rows all but a few SMs idle: on the H200 the SiLU-and-mul + quantization of 14,336 values
    took 6.2-6.4 us at 1 to 16 rows, split 3.2-3.6. Split: gated rows of at least two chunks, at
    most ``GEMV_MAX_ROWS`` of them (the rows measured). The plain quantization of 4,096 values
    (o_proj's input) stays whole: 1.9 us at 16 warps, split 2.9-3.3. The interpreter never splits
    unasked (the tests ask)."""
    if device.type != "cuda" or not gated or rows > GEMV_MAX_ROWS or width < 2 * SPLIT_QUANT_BLOCK:
        return 0
    return SPLIT_QUANT_BLOCK


def _launch_split_quant(x: torch.Tensor, width: int, gated: bool, out: torch.Tensor | None, block: int,
                        values: torch.Tensor, scales: torch.Tensor) -> None:
    """The split quantization (``split_quant_block``) of the rows of ``x`` into ``values`` and
    ``scales``; gated, the SiLU-and-mul goes through ``out`` (a scratch row when not given)."""
    rows, chunks = x.shape[0], triton.cdiv(width, block)
    chunk_max = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    if gated and out is None:
        out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    source = out if gated else x  # what the second launch quantizes
    _chunk_max_kernel[(rows, chunks)](x, source, chunk_max, width, x.stride(0), source.stride(0), chunks,
                                      BLOCK_K=block, GATED=gated, **pdl_launch(x.device),
                                      num_warps=max(1, min(8, block // 256)))
    _launch_quantize_chunks(source, width, chunk_max, block, values, scales)


def _launch_quantize_chunks(source: torch.Tensor, width: int, maxima: torch.Tensor, block: int,
                            values: torch.Tensor, scales: torch.Tensor) -> None:
    """The split quantization's second launch: each row of ``source`` in chunks of ``block``, at
    the scale of the row's ``maxima`` (``[rows, any number]``, contiguous)."""
    rows, count = maxima.shape
    _quantize_chunk_kernel[(rows, triton.cdiv(width, block))](
        source, maxima, values, scales, width, source.stride(0), values.stride(0), count, BLOCK_K=block,
        BLOCK_C=triton.next_power_of_2(count), FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE,
        **pdl_launch(source.device), num_warps=max(1, min(8, block // 256)))


def _launch_per_token_quant(x: torch.Tensor, width: int, static_scale: torch.Tensor | None, gated: bool,
                            out: torch.Tensor | None, split_block: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantization of the 2-D ``x`` (contiguous rows), ``width`` values a row, per token
    (``_per_token_quant_kernel``) or split (``split_block``, by default ``split_quant_block``'s;
    dynamic scales only); returns ``(values, scales)``."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x of shape {tuple(x.shape)} must be 2-D with contiguous rows")
    rows = x.shape[0]
    values = torch.empty(rows, width, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if split_block is None:
        split_block = split_quant_block(rows, width, gated, x.device)
    if split_block and static_scale is None and rows:
        _launch_split_quant(x, width, gated, out, split_block, values, scales)
        return values, scales
    # whole rows in registers up to 16k values (Llama's widest K is 14336), 16 per thread, or
    # 16 warps where each row has an SM to itself (the H200, 4,096 values: 1.9 us, 2.9 with 4)
    block_k = min(1 << 14, triton.next_power_of_2(width)) if x.is_cuda else 256
    few_rows = x.is_cuda and rows < num_sms(x.device)
    if rows:
        _per_token_quant_kernel[(rows,)](
            x, values, scales, scales if static_scale is None else static_scale,
            values if out is None else out, width, x.stride(0), values.stride(0),
            width if out is None else out.stride(0),
            BLOCK_K=block_k, STATIC=static_scale is not None, GATED=gated, STORE_OUT=out is not None,
            FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, **pdl_launch(x.device),
            num_warps=16 if few_rows else max(4, min(16, block_k // 1024)))
    return values, scales


def quantize_fp8_per_token_triton(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                                  split_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``quantize_fp8_per_row`` (per-token dynamic scales) or, with
    ``static_scale`` (one float32 value), of ``quantize_fp8`` at that scale: the 2-D ``x``
    (contiguous rows) -> ``(values float8_e4m3fn [rows, K], scales float32 [rows, 1])``.
    ``split_block``: the chunk width of the split form (0: one program per row; by default
    ``split_quant_block``'s choice), the same values either way."""
    return _launch_per_token_quant(x, x.shape[-1], static_scale, False, None, split_block)


def silu_and_mul_fp8_triton(x: torch.Tensor, act_out: torch.Tensor | None = None,
                            split_block: int | None = None) -> QuantizedActivations:
    """``layers.activation.silu_and_mul`` of the 2-D ``x`` ``[rows, 2K]`` (gate, then up) quantized
    per row in the same launch: ``QuantizedActivations`` of ``[rows, K]``, the values
    ``quantize_fp8_per_row`` gives for the kernel's own SiLU-and-mul, which is written only into
    ``act_out`` (``[rows, K]``, contiguous, x's dtype; the tests' view of it) when given.
    ``split_block`` as in ``quantize_fp8_per_token_triton``."""
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"x of shape {tuple(x.shape)} must be 2-D [rows, 2 * K] (gate, then up)")
    width = x.shape[-1] // 2
    if act_out is not None and (act_out.shape != (x.shape[0], width) or not act_out.is_contiguous()):
        raise ValueError(f"act_out of shape {tuple(act_out.shape)} must be contiguous "
                         f"({x.shape[0]}, {width})")
    values, scales = _launch_per_token_quant(x if x.stride(-1) == 1 else x.contiguous(), width, None, True,
                                             act_out, split_block)
    return QuantizedActivations(values, scales, x.dtype)


def fp8_gemv_silu_and_mul_triton(x: QuantizedActivations, weight: torch.Tensor, weight_scale: torch.Tensor,
                                 config: TileConfig, act_out: torch.Tensor | None = None
                                 ) -> QuantizedActivations:
    """``silu_and_mul_fp8_triton(fp8_gemv_triton(...))`` of a gate/up projection (``weight``
    ``[2N, K]``, gate rows then up rows) in two launches instead of three: the gated GEMV writes
    ``silu(gate) * up`` (each half first rounded to ``x.dtype``, as the GEMV writes them) and each
    row's ``max|.|`` per column tile (``launch_dense_gemv``'s ``tile_max``), then the split
    quantization's second launch quantizes the row at the maximum of its tiles' maxima. The FP8
    values are ``quantize_fp8_per_row`` of that SiLU-and-mul (``act_out``: where it is written,
    ``[rows, N]`` contiguous, x's dtype; scratch when None)."""
    rows, width = x.values.shape[0], weight.shape[0] // 2
    if rows > GEMV_MAX_ROWS or weight.dtype != FP8_DTYPE or x.values.shape[1] != weight.shape[1]:
        raise ValueError(f"FP8 values {tuple(x.values.shape)} and weight {tuple(weight.shape)} "
                         f"{weight.dtype}: at most {GEMV_MAX_ROWS} rows of one K, float8_e4m3fn weights")
    device = weight.device
    if act_out is None:
        act_out = torch.empty(rows, width, dtype=x.dtype, device=device)
    tile_max = torch.empty(rows, triton.cdiv(weight.shape[0], config.block_n), dtype=torch.float32,
                           device=device)
    values = torch.empty(rows, width, dtype=FP8_DTYPE, device=device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=device)
    if rows:
        launch_dense_gemv(x.values, weight, None, act_out, config, row_scales=x.scales.reshape(-1),
                          col_scales=weight_scale.reshape(-1), gated=True, tile_max=tile_max)
        _launch_quantize_chunks(act_out, width, tile_max, SPLIT_QUANT_BLOCK, values, scales)
    return QuantizedActivations(values, scales, x.dtype)


def fp8_gemv_triton(values: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                    config: TileConfig | None = None) -> torch.Tensor:
    """``(values * scales) @ (weight * weight_scale).T + bias`` for at most ``GEMV_MAX_ROWS`` rows:
    FP8 ``values`` ``[rows, K]`` with float32 ``scales`` ``[rows, 1]`` (from
    ``quantize_fp8_per_token_triton``), FP8 ``weight`` ``[N, K]`` with float32 ``weight_scale``
    ``[N, 1]``; the output in ``out_dtype``. ``config`` defaults to ``default_fp8_gemv_config``."""
    rows, in_features = values.shape
    out_features = weight.shape[0]
    if weight.shape[1] != in_features or weight.dtype != FP8_DTYPE or values.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 values {tuple(values.shape)} {values.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype}: both float8_e4m3fn, with one K")
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"{rows} rows is over the GEMV's {GEMV_MAX_ROWS}: use torch._scaled_mm")
    config = config or default_fp8_gemv_config(rows, out_features, in_features, num_sms(values.device))
    out = torch.empty(rows, out_features, dtype=out_dtype, device=values.device)
    if rows:
        launch_dense_gemv(values, weight, bias, out, config, row_scales=scales.reshape(-1),
                          col_scales=weight_scale.reshape(-1))
    return out
