"""Every pagedlab Triton kernel of a step compiles for Hopper (sm_90): with PDL off, as every GPU
runs it by default, and with PDL on, its wait and trigger in the PTX and no global write before
the wait (``kernels/pdl.py``'s rule).

The CPU interpreter never runs the ``gdc_*`` code (PDL is off there), so this is the check that
the GPU path compiles. Triton compiles for CUDA without a GPU; the kernels must be decorated
without the interpreter, which this session's conftest turns on, so one subprocess (this file run
as a script) compiles them all, once per session, and writes each kernel's PTX (or its error).
Each kernel compiles in its decode launch's constexprs (Llama-3-8B / Qwen3-30B-A3B shapes, bf16)
and with the alignment such a launch's arguments give (``_launch_alignment``).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

_F, _I = "*fp32", "*i32"
_PARTIALS = dict(partial_acc_ptr=_F, partial_max_ptr=_F, partial_sum_ptr=_F, query_start_loc_ptr=_I,
                 seq_lens_ptr=_I)
_ROUTING = dict(experts_ptr=_I, local_rank_ptr=_I, block_counts_ptr=_I, sorted_pairs_ptr=_I,
                block_experts_ptr=_I)


class Spec(NamedTuple):
    """A kernel and its decode launch: constexprs, pointer types by argument name (others bf16),
    float scalars (others int32), warps, and whether it reads before its wait (constant data, or
    step inputs written before the step: ``kernels/pdl.py``'s rule)."""

    module: str
    kernel: str
    constexprs: dict
    pointers: dict | None = None
    floats: tuple = ()
    num_warps: int = 4
    reads_before_wait: bool = False


_TF32 = dict(DOT_PRECISION="tf32")
_NO_FOLD = dict(NORM=False, NORM_BLOCK=1, RESIDUAL=False, WRITE_NORMED=False)
# an RMSNorm folded in (kernels/norm_fold.py): Llama-3-8B's hidden size, the residual added
_FOLD = dict(NORM=True, NORM_BLOCK=4096, RESIDUAL=True, WRITE_NORMED=False)
_FOLD_SUMS = dict(_FOLD, NORM_SUMS=True)  # the dense one-row GEMV sums the squares in its loop
_GEMV = dict(HAS_BIAS=False, SPLIT=False, SCALED=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, USE_DOT=False,
             ONE_ROW=True, DOT_DTYPE="bf16", PREFETCH=False, SWAP_AB=False, FP8_ACC_CHUNK=None, **_TF32,
             **_NO_FOLD, NORM_SUMS=False, GATED=False, TILE_MAX=False)
# the dot path with the weight tile as A (64 weight rows on wgmma's M), the row padded to 16 as B
_GEMV_SWAP = dict(_GEMV, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, USE_DOT=True, ONE_ROW=False, SPLIT=True,
                  SWAP_AB=True, LORA=False, LORA_BLOCK_S=1, LORA_BLOCK_R=1)
_AWQ_GEMV = dict(GROUP_SIZE=128, HAS_BIAS=False, DOT_DTYPE="bf16", **_TF32, **_NO_FOLD, GATED=False)
_AWQ_POINTERS = dict(qweight_ptr=_I, qzeros_ptr=_I, partial_ptr=_F, counter_ptr=_I)
_AWQ_GEMM = dict(GROUP_SIZE=128, HAS_BIAS=False, SPLIT=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64,
                 DOT_DTYPE="bf16", SWAP_AB=False, **_TF32)
_AWQ_GEMM_DESCRIPTORS = dict(x_desc="tensordesc<bf16[64, 64]>", qweight_desc="tensordesc<i32[128, 8]>",
                             qzeros_ptr=_I, partial_ptr=_F, counter_ptr=_I)
_GEMV_POINTERS = dict(partial_ptr=_F, counter_ptr=_I, row_scale_ptr=_F, col_scale_ptr=_F, lora_h_ptr=_F,
                      lora_slots_ptr=_I)
# the paged attention kernel's decode launch with split-KV (Llama-3-8B's heads); the others vary it
_ATTENTION = dict(HEAD_DIM=128, HEAD_DIM_PADDED=128, GROUP=4, BLOCK_Q=4, BLOCK_M=16, TILE_N=64, BLOCK_SIZE=16,
                  USE_SPLIT=True, SEQ_CHUNK=256, UPCAST=False, PREFIX_ONLY=False, KEY_OFFSET=False,
                  SLIDING=False, SOFTCAP=False, BROADCAST_DOT=False, SEGMENTED=False, TILE_SEGMENTS=False,
                  DECODE=True, ORDERED=True, **_TF32)  # a decode launch takes the step's sequence order
_ATTENTION_POINTERS = dict(_PARTIALS, seq_lens_ptr=_I, block_tables_ptr=_I, key_offset_ptr=_I,
                           seq_order_ptr=_I)
_ATTENTION_FLOATS = ("qk_scale", "v_scale", "softcap_scale", "softcap")
KERNELS = {
    "dense_gemv": Spec("gemv", "_dense_gemv_kernel", dict(_GEMV, LORA=False, LORA_BLOCK_S=1, LORA_BLOCK_R=1),
                       _GEMV_POINTERS, reads_before_wait=True),
    # one row with the next K step's weights and activations read during this one's products
    "dense_gemv_prefetch": Spec("gemv", "_dense_gemv_kernel",
                                dict(_GEMV, PREFETCH=True, LORA=False, LORA_BLOCK_S=1, LORA_BLOCK_R=1),
                                _GEMV_POINTERS, reads_before_wait=True),
    "dense_gemv_fp8_prefetch": Spec("gemv", "_dense_gemv_kernel",
                                    dict(_GEMV, SCALED=True, BLOCK_N=4, PREFETCH=True, LORA=False,
                                         LORA_BLOCK_S=1, LORA_BLOCK_R=1),
                                    dict(_GEMV_POINTERS, x_ptr="*fp8e4nv", w_ptr="*fp8e4nv"),
                                    reads_before_wait=True),
    "dense_gemv_swap": Spec("gemv", "_dense_gemv_kernel", _GEMV_SWAP, _GEMV_POINTERS),
    # gate/up with SiLU-and-mul in the epilogue (Llama-3-8B's one-row tile, 16 columns: 8 pairs)
    "dense_gemv_gated": Spec("gemv", "_dense_gemv_kernel",
                             dict(_GEMV, BLOCK_N=16, BLOCK_K=256, GATED=True, LORA=False, LORA_BLOCK_S=1,
                                  LORA_BLOCK_R=1), _GEMV_POINTERS, reads_before_wait=True),
    # the norm folded in: Llama-3-8B's qkv_proj, and Qwen3-30B-A3B's router writing the normed copy
    "dense_gemv_fold": Spec("gemv", "_dense_gemv_kernel",
                            dict(_GEMV, **_FOLD_SUMS, LORA=False, LORA_BLOCK_S=1, LORA_BLOCK_R=1),
                            _GEMV_POINTERS, floats=("eps",), reads_before_wait=True),
    "dense_gemv_fold_router": Spec("gemv", "_dense_gemv_kernel",
                                   dict(_GEMV, **dict(_FOLD_SUMS, NORM_BLOCK=2048, WRITE_NORMED=True),
                                        BLOCK_N=4, BLOCK_K=1024, LORA=False, LORA_BLOCK_S=1, LORA_BLOCK_R=1),
                                   _GEMV_POINTERS, floats=("eps",), reads_before_wait=True),
    "dense_gemv_fold_swap": Spec("gemv", "_dense_gemv_kernel",
                                 dict(_GEMV_SWAP, **dict(_FOLD, NORM_SUMS=False)), _GEMV_POINTERS,
                                 floats=("eps",)),
    "dense_gemv_fp8_swap": Spec("gemv", "_dense_gemv_kernel",
                                dict(_GEMV_SWAP, SCALED=True, DOT_DTYPE="fp8", FP8_ACC_CHUNK=128),
                                dict(_GEMV_POINTERS, x_ptr="*fp8e4nv", w_ptr="*fp8e4nv")),
    # Llama-3-8B's FP8 gate/up at one row: SiLU-and-mul and each row's maximum per column tile
    "dense_gemv_fp8_swap_gated": Spec("gemv", "_dense_gemv_kernel",
                                      dict(_GEMV_SWAP, SCALED=True, DOT_DTYPE="fp8", FP8_ACC_CHUNK=128,
                                           BLOCK_K=128, SPLIT=False, GATED=True, TILE_MAX=True),
                                      dict(_GEMV_POINTERS, x_ptr="*fp8e4nv", w_ptr="*fp8e4nv",
                                           tile_max_ptr=_F)),
    # with the LoRA expand in the epilogue: batch 1 (one row, 32 shrink splits), and 4 rows on tl.dot
    "dense_gemv_lora": Spec("gemv", "_dense_gemv_kernel",
                            dict(_GEMV, LORA=True, LORA_BLOCK_S=32, LORA_BLOCK_R=16), _GEMV_POINTERS,
                            reads_before_wait=True),
    "dense_gemv_lora_dot": Spec("gemv", "_dense_gemv_kernel",
                                dict(_GEMV, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, USE_DOT=True, ONE_ROW=False,
                                     SPLIT=True, LORA=True, LORA_BLOCK_S=8, LORA_BLOCK_R=16),
                                _GEMV_POINTERS),
    # the one-row GEMV at its default tile (8 columns, K steps of 2048: 16 groups, the next step's
    # weights read during this one's sums), 4 rows on the CUDA cores, and 4 rows on tl.dot
    "awq_gemv": Spec("w4a16", "_awq_gemv_kernel",
                     dict(_AWQ_GEMV, SPLIT=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=2048, STEP_GROUPS=16,
                          USE_DOT=False, PREFETCH=True), _AWQ_POINTERS, reads_before_wait=True),
    "awq_gemv_rows": Spec("w4a16", "_awq_gemv_kernel",
                          dict(_AWQ_GEMV, SPLIT=True, BLOCK_M=4, BLOCK_N=8, BLOCK_K=512, STEP_GROUPS=4,
                               USE_DOT=False, PREFETCH=True), _AWQ_POINTERS, reads_before_wait=True),
    "awq_gemv_dot": Spec("w4a16", "_awq_gemv_kernel",
                         dict(_AWQ_GEMV, SPLIT=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, STEP_GROUPS=1,
                              USE_DOT=True, PREFETCH=False), _AWQ_POINTERS, reads_before_wait=True),
    "awq_gemv_fold": Spec("w4a16", "_awq_gemv_kernel",
                          dict(_AWQ_GEMV, SPLIT=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=2048, STEP_GROUPS=16,
                               USE_DOT=False, PREFETCH=True, **_FOLD), _AWQ_POINTERS, floats=("eps",),
                          reads_before_wait=True),
    "awq_gemv_gated": Spec("w4a16", "_awq_gemv_kernel",
                           dict(_AWQ_GEMV, SPLIT=False, BLOCK_M=1, BLOCK_N=32, BLOCK_K=512, STEP_GROUPS=4,
                                USE_DOT=False, PREFETCH=True, GATED=True), _AWQ_POINTERS,
                           reads_before_wait=True),
    # x and the weight words through TMA descriptors (the launch's 64-row, 128-column, 64-k tiles)
    "awq_gemm": Spec("w4a16", "_awq_gemm_kernel", _AWQ_GEMM, _AWQ_GEMM_DESCRIPTORS),
    # the weight tile as the dot's A operand, the rows its N; K split
    "awq_gemm_swap": Spec("w4a16", "_awq_gemm_kernel", dict(_AWQ_GEMM, SWAP_AB=True, SPLIT=True),
                          _AWQ_GEMM_DESCRIPTORS),
    "awq_dequantize": Spec("w4a16", "_awq_dequantize_kernel", dict(GROUP_SIZE=128, BLOCK_N=32, BLOCK_K=128),
                           dict(qweight_ptr=_I, qzeros_ptr=_I), reads_before_wait=True),
    # decode: its sequence's place in the order, query start and length before the wait
    "paged_attention": Spec("triton_kernels", "paged_attention_kernel", _ATTENTION, _ATTENTION_POINTERS,
                            _ATTENTION_FLOATS, reads_before_wait=True),
    # a decode launch in batch order (cascade attention's launch over each sequence's own keys)
    "paged_attention_batch_order": Spec("triton_kernels", "paged_attention_kernel",
                                        dict(_ATTENTION, ORDERED=False), _ATTENTION_POINTERS,
                                        _ATTENTION_FLOATS, reads_before_wait=True),
    # a large decode batch's launch: one program a sequence and KV head, no split
    "paged_attention_unsplit": Spec("triton_kernels", "paged_attention_kernel",
                                    dict(_ATTENTION, USE_SPLIT=False), _ATTENTION_POINTERS,
                                    _ATTENTION_FLOATS, reads_before_wait=True),
    # batch-invariant mode's in-program fold of one-tile key segments
    "paged_attention_tile_segments": Spec(
        "triton_kernels", "paged_attention_kernel",
        dict(_ATTENTION, BLOCK_Q=16, BLOCK_M=64, USE_SPLIT=False, SEGMENTED=True, TILE_SEGMENTS=True,
             DECODE=False, ORDERED=False),
        _ATTENTION_POINTERS, _ATTENTION_FLOATS),
    # a prefill launch the tuner picks (kernels/attention_tuning.py): Gemma-2's soft-capped local
    # layers, head_dim 256, 128 query rows on 8 warps
    "paged_attention_prefill_gemma": Spec(
        "triton_kernels", "paged_attention_kernel",
        dict(_ATTENTION, HEAD_DIM=256, HEAD_DIM_PADDED=256, GROUP=2, BLOCK_Q=64, BLOCK_M=128, USE_SPLIT=False,
             SLIDING=True, SOFTCAP=True, DECODE=False, ORDERED=False),
        _ATTENTION_POINTERS, _ATTENTION_FLOATS, num_warps=8),
    "split_kv_reduce": Spec("triton_kernels", "split_kv_reduce_kernel",
                            dict(HEAD_DIM=128, HEAD_DIM_PADDED=128, DECODE=True, SEGMENT_CHUNK=16),
                            _PARTIALS, reads_before_wait=True),
    "invariant_split_kv_reduce": Spec("triton_kernels", "invariant_split_kv_reduce_kernel",
                                      dict(HEAD_DIM=128, HEAD_DIM_PADDED=128, DECODE=True), _PARTIALS,
                                      reads_before_wait=True),
    "write_kv": Spec("kv_write_kernels", "write_kv_kernel",
                     dict(NUM_KV_HEADS=8, NUM_KV_HEADS_PADDED=8, HEAD_DIM=128, HEAD_DIM_PADDED=128,
                          BLOCK_SIZE=16, FP8=False, FP8_MAX=448.0),
                     dict(slot_mapping_ptr="*i64"), ("k_scale_inverse", "v_scale_inverse")),
    # Qwen3-30B-A3B's q/k norms into a bf16 cache; Llama-3-8B's plain rotary into an FP8 cache
    "rotate_write_kv": Spec("kv_write_kernels", "rotate_write_kv_kernel",
                            dict(GROUP=8, GROUP_PADDED=8, HEAD_DIM=128, HEAD_DIM_PADDED=128, ROTARY_DIM=128,
                                 BLOCK_SIZE=16, NORM=True, UNIT_OFFSET=False, FP8=False, FP8_MAX=448.0),
                            dict(slot_mapping_ptr="*i64"), ("eps", "k_scale_inverse", "v_scale_inverse"),
                            num_warps=4),
    "rotate_write_kv_fp8": Spec("kv_write_kernels", "rotate_write_kv_kernel",
                                dict(GROUP=4, GROUP_PADDED=4, HEAD_DIM=128, HEAD_DIM_PADDED=128,
                                     ROTARY_DIM=128, BLOCK_SIZE=16, NORM=False, UNIT_OFFSET=False, FP8=True,
                                     FP8_MAX=448.0),
                                dict(slot_mapping_ptr="*i64", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv"),
                                ("eps", "k_scale_inverse", "v_scale_inverse"), num_warps=2),
    "fp8_per_token_quant": Spec("fp8_linear", "_per_token_quant_kernel",
                                dict(BLOCK_K=4096, STATIC=False, GATED=False, STORE_OUT=False, FP8_MAX=448.0,
                                     MIN_SCALE=1e-12),
                                dict(q_ptr="*fp8e4nv", scale_ptr=_F, static_scale_ptr=_F)),
    # the down projection's input: SiLU-and-mul of Llama-3-8B's 2 x 14336 gate/up row, quantized
    "fp8_silu_mul_quant": Spec("fp8_linear", "_per_token_quant_kernel",
                               dict(BLOCK_K=16384, STATIC=False, GATED=True, STORE_OUT=False, FP8_MAX=448.0,
                                    MIN_SCALE=1e-12),
                               dict(q_ptr="*fp8e4nv", scale_ptr=_F, static_scale_ptr=_F), num_warps=16),
    # the same at one row, split (fp8_linear.split_quant_block): chunk maxima and SiLU-and-mul, then
    # each chunk quantized at its row's scale
    "fp8_split_chunk_max": Spec("fp8_linear", "_chunk_max_kernel", dict(BLOCK_K=1024, GATED=True),
                                dict(chunk_max_ptr=_F)),
    "fp8_split_quantize": Spec("fp8_linear", "_quantize_chunk_kernel",
                               dict(BLOCK_K=1024, BLOCK_C=16, FP8_MAX=448.0, MIN_SCALE=1e-12),
                               dict(chunk_max_ptr=_F, q_ptr="*fp8e4nv", scale_ptr=_F)),
    "lora_expand": Spec("lora", "_lora_expand_kernel",
                        dict(SPLITS=8, SPLITS_POW2=8, BLOCK_M=16, BLOCK_N=128, BLOCK_R=16, **_TF32),
                        dict(h_ptr=_F, sorted_ptr=_I, tiles_ptr=_I)),
    "fixed_tile_matmul": Spec("batch_invariant", "_fixed_tile_matmul_kernel",
                              dict(HAS_BIAS=False, SPLIT=True, ONE_SEGMENT=False, PERSISTENT=False,
                                   EVEN_K=True, USE_TMA=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=8,
                                   DOT_DTYPE="bf16", BROADCAST_DOT=False, **_TF32),
                              dict(partial_ptr=_F, counter_ptr=_I)),
    "rows_norm": Spec("batch_invariant", "_norm_kernel",
                      dict(LAYER_NORM=False, HAS_RESIDUAL=True, UNIT_OFFSET=False, BLOCK=4096, STORE_OUT=True,
                           FP8=False, FP8_MAX=448.0, MIN_SCALE=1e-12), {}, ("eps",),
                      num_warps=16, reads_before_wait=True),
    # the residual add and RMSNorm before an FP8 linear, its output quantized per token instead of written
    "rows_norm_fp8": Spec("batch_invariant", "_norm_kernel",
                          dict(LAYER_NORM=False, HAS_RESIDUAL=True, UNIT_OFFSET=False, BLOCK=4096,
                               STORE_OUT=False, FP8=True, FP8_MAX=448.0, MIN_SCALE=1e-12),
                          dict(q_ptr="*fp8e4nv", scale_ptr=_F), ("eps",), num_warps=16,
                          reads_before_wait=True),
    "softmax": Spec("batch_invariant", "_softmax_kernel", dict(LOG=True, BLOCK=4096), dict(out_ptr=_F),
                    num_warps=8),
    # W-nano's sampling: 256 rows of Qwen3's 151,936 bf16 logits in 3 chunks, then their fold
    "gumbel_argmax_chunk": Spec("sampling_kernels", "gumbel_argmax_chunk_kernel",
                                dict(BLOCK=1024, FINAL=False),
                                dict(temperature_ptr=_F, seed_ptr="*i64", best_value_ptr=_F,
                                     best_index_ptr=_I, out_ptr="*i64")),
    "gumbel_argmax_fold": Spec("sampling_kernels", "gumbel_argmax_fold_kernel", dict(CHUNKS=4),
                               dict(best_value_ptr=_F, best_index_ptr=_I, out_ptr="*i64"), num_warps=1),
    "moe_route": Spec("fused_moe_kernels", "moe_route_kernel",
                      dict(TOP_K=8, RENORMALIZE=True, TOKENS_BLOCK=1, EXPERTS_BLOCK=128, TOP_K_BLOCK=8,
                           ALIGN=True, BLOCK_M=16), _ROUTING),
    "moe_align": Spec("fused_moe_kernels", "moe_align_kernel",
                      dict(TOP_K=8, BLOCK_M=16, TOKENS_BLOCK=16, EXPERTS_BLOCK=128, TOP_K_BLOCK=8,
                           COUNT_ROWS=16), _ROUTING),
    "moe_gate_up": Spec("fused_moe_kernels", "moe_gate_up_kernel",
                        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, DOT_DTYPE="bf16", **_TF32),
                        dict(sorted_pairs_ptr=_I, block_experts_ptr=_I)),
    "moe_down": Spec("fused_moe_kernels", "moe_down_kernel",
                     dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, DOT_DTYPE="bf16", **_TF32),
                     dict(partial_ptr=_F, sorted_pairs_ptr=_I, block_experts_ptr=_I)),
    # the GEMV path: gate/up routing its pairs itself (Qwen3-30B-A3B's 128 experts, top-8, bf16
    # logits: int32 keys), down folding each token's pairs through the split-K tickets; prefetching
    # the next K step, bf16 pairs
    "moe_gate_up_gemv": Spec("fused_moe_kernels", "moe_gate_up_gemv_kernel",
                             dict(NUM_EXPERTS=128, TOP_K=8, RENORMALIZE=True, EXPERTS_BLOCK=128, COPIES=4,
                                  BLOCK_N=8, BLOCK_K=512, EVEN_N=True, EVEN_K=True, PREFETCH=True,
                                  PAIRS=True),
                             dict(experts_ptr=_I)),
    "moe_down_gemv": Spec("fused_moe_kernels", "moe_down_gemv_kernel",
                          dict(TOP_K=8, BLOCK_N=8, BLOCK_K=512, EVEN_N=False, EVEN_K=False, PREFETCH=True,
                               PAIRS=True, ALL_PAIRS=False, TOP_K_BLOCK=8),
                          dict(experts_ptr=_I, partial_ptr=_F, counter_ptr=_I)),
    # the down launch by token: a program reads its token's 8 pairs' rows together, one masked K step
    "moe_down_gemv_by_token": Spec("fused_moe_kernels", "moe_down_gemv_kernel",
                                   dict(TOP_K=8, BLOCK_N=16, BLOCK_K=1024, EVEN_N=True, EVEN_K=False,
                                        PREFETCH=False, PAIRS=True, ALL_PAIRS=True, TOP_K_BLOCK=8),
                                   dict(experts_ptr=_I, partial_ptr=_F, counter_ptr=_I)),
    # ... and Qwen3-30B-A3B's 1-token tile (2 x 256: three whole steps of its 768) reading ahead
    "moe_down_gemv_by_token_prefetch": Spec("fused_moe_kernels", "moe_down_gemv_kernel",
                                            dict(TOP_K=8, BLOCK_N=2, BLOCK_K=256, EVEN_N=True, EVEN_K=True,
                                                 PREFETCH=True, PAIRS=True, ALL_PAIRS=True, TOP_K_BLOCK=8),
                                            dict(experts_ptr=_I, partial_ptr=_F, counter_ptr=_I)),
    "moe_reduce": Spec("fused_moe_kernels", "moe_reduce_kernel",
                       dict(SPLIT_K=2, TOP_K=8, TOP_K_BLOCK=8, BLOCK_H=256), dict(partial_ptr=_F)),
}
_WAIT, _TRIGGER = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
# global writes (plain stores and atomics) and global reads, as PTX spells them
_WRITE = re.compile(r"\b(st\.global|atom\.global|red\.global)")
_READ = re.compile(r"\b(ld\.global|cp\.async)")


def _launch_alignment(kernel, signature: dict) -> dict:
    """The alignment a real launch's arguments give the compiler: Triton's launcher specializes a
    pointer that starts on 16 bytes and an integer divisible by 16 (unless the kernel lists it in
    ``do_not_specialize``) as ``tt.divisibility`` 16, and the decode launches' pointers and strides
    (Llama-3-8B / Qwen3-30B-A3B shapes) all are. Without it the compiler cannot vectorize the
    loads, and the software pipeliner, which needs 4-byte asynchronous copies, stages nothing: the
    check would look at code no GPU runs."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
            if signature[name].startswith("*") or (name.startswith("stride") and signature[name] == "i32"
                                                   and name not in kernel.do_not_specialize)}


def _compile_all(out_dir: Path) -> None:
    """Compile every kernel of KERNELS for sm_90 with PDL on and off (the default launch); writes
    ``<id>.ptx``/``<id>-nopdl.ptx`` or ``.error``,
    or only ``unavailable`` when this triton cannot compile for CUDA at all."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for (name, spec), pdl in itertools.product(KERNELS.items(), (True, False)):
        stem = name if pdl else f"{name}-nopdl"
        try:
            kernel = getattr(importlib.import_module(f"pagedlab.kernels.{spec.module}"), spec.kernel)
            const = {**spec.constexprs, "PDL": pdl}
            if "DOT_DTYPE" in const:
                const["DOT_DTYPE"] = {"bf16": tl.bfloat16, "fp8": tl.float8e4nv}[const["DOT_DTYPE"]]
            missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in const]
            if missing:
                raise ValueError(f"no constexpr value given for {missing}")
            signature = {a: "constexpr" if a in const else (spec.pointers or {}).get(a, "*bf16")
                         if a.endswith(("_ptr", "_desc")) else "fp32" if a in spec.floats else "i32"
                         for a in kernel.arg_names}
            source = ASTSource(fn=kernel, signature=signature,
                               constexprs={(kernel.arg_names.index(a),): v for a, v in const.items()},
                               attrs=_launch_alignment(kernel, signature))
            options = dict(num_warps=spec.num_warps, num_stages=3)
            compiled = triton.compile(source, target=target, options=options)
            (out_dir / f"{stem}.ptx").write_text(compiled.asm["ptx"])
        except Exception as e:  # reported per kernel by the test
            if name == "dense_gemv" and "ptxas" in str(e).lower():
                (out_dir / "unavailable").write_text(f"triton cannot compile for CUDA here: {e}")
                return
            (out_dir / f"{stem}.error").write_text(f"{type(e).__name__}: {e}")


@pytest.fixture(scope="module")
def ptx_dir(tmp_path_factory) -> Path:
    pytest.importorskip("triton")
    out_dir = tmp_path_factory.mktemp("hopper_ptx")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__, str(out_dir)], env=env, capture_output=True,
                            text=True, timeout=600)
    if result.returncode:
        pytest.fail(f"the compile subprocess failed:\n{result.stderr[-4000:]}")
    if (out_dir / "unavailable").exists():
        pytest.skip((out_dir / "unavailable").read_text()[:500])
    return out_dir


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_hopper_without_pdl(ptx_dir, name):
    """The launch with ``PAGEDLAB_PDL=0`` (and on GPUs before Hopper) compiles, and waits for nothing."""
    error = ptx_dir / f"{name}-nopdl.error"
    assert not error.exists(), error.read_text()
    ptx = (ptx_dir / f"{name}-nopdl.ptx").read_text()
    assert _WAIT not in ptx and _TRIGGER not in ptx


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_hopper_with_its_pdl_wait_before_any_global_write(ptx_dir, name):
    error = ptx_dir / f"{name}.error"
    assert not error.exists(), error.read_text()
    ptx = (ptx_dir / f"{name}.ptx").read_text()
    assert _WAIT in ptx and _TRIGGER in ptx
    wait = ptx.index(_WAIT)
    assert wait < ptx.index(_TRIGGER)
    first_write = _WRITE.search(ptx)
    assert first_write is not None and wait < first_write.start(), f"{name} writes before its wait"
    if not KERNELS[name].reads_before_wait:  # a kernel that waits first reads nothing before it either
        first_read = _READ.search(ptx)
        assert first_read is None or wait < first_read.start(), f"{name} reads before its wait"


# a wgmma's accumulator registers, then its A operand: registers ({...}) or a shared-memory descriptor
_WGMMA_A = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16\s+\{[^}]*\},\s*([{%])")
_WGMMA_FP8_A = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n16k32\.f32\.e4m3\.e4m3\s+"
                          r"\{[^}]*\},\s*([{%])")


def test_awq_gemm_swapped_form_feeds_wgmma_the_weights_from_registers(ptx_dir):
    """Both forms of the AWQ GEMM read x and the weight words by TMA and multiply on wgmma; the
    plain one reads its A operand (the activations) from shared memory, the swapped one takes A
    (the dequantized weight tile) from registers."""
    plain, swapped = ((ptx_dir / f"{name}-nopdl.ptx").read_text() for name in ("awq_gemm", "awq_gemm_swap"))
    assert "mma.sync" not in plain + swapped
    assert "cp.async.bulk.tensor.2d" in plain and "cp.async.bulk.tensor.2d" in swapped
    assert set(_WGMMA_A.findall(plain)) == {"%"} and set(_WGMMA_A.findall(swapped)) == {"{"}


def test_decode_attention_stages_its_keys_and_values_asynchronously(ptx_dir):
    """Compiled with a launch's alignment (``_launch_alignment``), the software pipeliner stages
    the decode attention's key and value tiles through shared memory with asynchronous copies,
    gathered through the block table; without the alignment it staged nothing."""
    ptx = (ptx_dir / "paged_attention-nopdl.ptx").read_text()
    assert "cp.async.cg.shared.global" in ptx or "cp.async.ca.shared.global" in ptx


def test_only_the_split_decode_launch_asks_l2_for_its_first_tile_before_the_wait(ptx_dir):
    """A split decode program (small batches) asks L2 for its first key tile's K and V rows
    before its PDL wait; the unsplit launch of a large batch, which lost with it, asks for
    nothing, nor does any launch without PDL."""
    split, unsplit = ((ptx_dir / f"{name}.ptx").read_text() for name in ("paged_attention",
                                                                          "paged_attention_unsplit"))
    assert "prefetch.global.L2" in split and split.index("prefetch.global.L2") < split.index(_WAIT)
    assert "prefetch.global.L2" not in unsplit
    assert all("prefetch.global.L2" not in (ptx_dir / f"{name}-nopdl.ptx").read_text()
               for name in ("paged_attention", "paged_attention_unsplit"))


def test_swapped_gemv_feeds_wgmma_the_weight_tile_from_shared_memory(ptx_dir):
    """The dense and FP8 GEMVs' swapped dot tiles multiply on wgmma (M = the tile's 64 weight rows,
    N = the 16 padded rows), the weight tile read by wgmma from shared memory; the FP8 tile as E4M3
    operands, without converting a single FP8 value."""
    dense, fp8 = ((ptx_dir / f"{name}-nopdl.ptx").read_text()
                  for name in ("dense_gemv_swap", "dense_gemv_fp8_swap"))
    assert "mma.sync" not in dense + fp8
    assert set(_WGMMA_A.findall(dense)) == {"%"} and "m64n16k16" in dense
    assert set(_WGMMA_FP8_A.findall(fp8)) == {"%"}
    assert "e4m3x2" not in fp8


@pytest.mark.parametrize("name", ["fp8_per_token_quant", "fp8_silu_mul_quant", "fp8_split_quantize"])
def test_compiled_fp8_quantization_leaves_the_e4m3_rounding_to_the_cast(ptx_dir, name):
    """``_round_to_e4m3`` rounds in software only under the interpreter: compiled, the values go
    to sm_90's round-to-nearest-even, saturating convert, and no mantissa mask of the software
    rounding (``0xFFF00000``) is left."""
    ptx = (ptx_dir / f"{name}-nopdl.ptx").read_text()
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "-1048576" not in ptx and "0xFFF00000" not in ptx.upper()


def test_every_pdl_kernel_of_the_package_is_checked_and_needs_its_flag():
    """A kernel given a PDL parameter later must get an entry here too; no PDL parameter has a
    default (a launch without ``**pdl_launch(device)`` fails with a TypeError)."""
    source = Path(__file__).resolve().parents[1] / "src" / "pagedlab" / "kernels"
    with_pdl = set()
    for path in source.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"\bPDL: tl\.constexpr\s*=", text), f"{path.name}: PDL with a default"
        for match in re.finditer(r"@triton\.jit[^\n]*\ndef (\w+)\(([^)]*)\)", text):
            takes_pdl = re.search(r"\bPDL: tl\.constexpr", match.group(2))
            if takes_pdl and match.group(1) != "pdl_wait_and_trigger":
                with_pdl.add(match.group(1))
    assert with_pdl == {spec.kernel for spec in KERNELS.values()}


if __name__ == "__main__":
    _compile_all(Path(sys.argv[1]))

