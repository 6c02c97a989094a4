"""Batch-invariant mode on the GPU (``pytest -m gpu``): the Llama-3-8B shape (4 of its 32 layers,
dummy weights, bfloat16, CUDA graphs) gives bitwise-equal logprobs alone and in batches, with
prefix caching and chunked prefill; the default mode does not (the control); the fixed-tile
matmul's rows at the 8B linears' shapes do not depend on the row count or the launch."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts, shape_config_dir
from pagedlab import LLM
from test_batch_invariant import _any_differs, _differing_runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (out, in) of Llama-3-8B's qkv, o, gate_up and down projections and its LM head
LINEARS_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.fixture(scope="module")
def llama8b_layers4(tmp_path_factory) -> str:
    return shape_config_dir(tmp_path_factory.mktemp("llama3_8b_4_layers"), "llama3-8b", 4)


@pytest.mark.parametrize("out_features, in_features", LINEARS_8B)
def test_fixed_tile_matmul_rows_are_invariant_at_8b_shapes(out_features, in_features):
    """Through the dispatch, so each row count takes its bucket's config of BATCH_INVARIANT_CONFIGS
    (the full batch the largest bucket's): a pasted table whose tiles round differently fails here.
    Every config the table lists for the shape, run on all rows, gives the same bits too."""
    from pagedlab.kernels.batch_invariant import fixed_tile_matmul_torch, fixed_tile_matmul_triton
    from pagedlab.kernels.gemv_configs import BATCH_INVARIANT_CONFIGS

    g = torch.Generator(device="cuda").manual_seed(out_features)
    x = torch.randn(700, in_features, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(out_features, in_features, device="cuda", generator=g) * 0.02).bfloat16()
    full = fixed_tile_matmul_triton(x, weight, split_across_programs=False)
    torch.testing.assert_close(full.float(), fixed_tile_matmul_torch(x, weight).float(), atol=0.05, rtol=0.02)
    for rows in (1, 3, 8, 9, 64, 65, 129, 256, 300):
        for split in (None, True, False):
            got = fixed_tile_matmul_triton(x[-rows:], weight, split_across_programs=split)
            assert torch.equal(got, full[-rows:]), (rows, split)
    for (bucket, n, k), config in BATCH_INVARIANT_CONFIGS.items():
        if (n, k) == (out_features, in_features):
            assert torch.equal(fixed_tile_matmul_triton(x, weight, config=config), full), (bucket, config)


@pytest.mark.parametrize("out_features, in_features", LINEARS_8B[:4])
def test_persistent_prefill_launch_is_bitwise_the_in_program_launch_at_8b_shapes(out_features, in_features):
    """At 1,024 and 4,096 rows the dispatch takes the persistent TMA launch (128 x 256 tiles) on a
    Hopper GPU where the table's block_k is the persistent tile's (elsewhere the in-program launch:
    a longer block_k would leave it too few stages), and its output is bitwise the in-program
    launch's with the table's tiles; the first 1, 8 and 256 rows, run alone (other launches),
    equal the same rows; a CUDA graph of it replays on new input to the eager output (the TMA
    descriptors are captured by value)."""
    from pagedlab.kernels import batch_invariant as kernels
    from pagedlab.kernels.gemv_configs import BATCH_INVARIANT_PERSISTENT_TILE, batch_invariant_config

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the persistent launch needs TMA (Hopper or later)")
    g = torch.Generator(device="cuda").manual_seed(out_features + 1)
    x = torch.randn(4096, in_features, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(out_features, in_features, device="cuda", generator=g) * 0.02).bfloat16()
    table_config = batch_invariant_config(1024, out_features, in_features, kernels.num_sms(x.device))
    if table_config.block_k != BATCH_INVARIANT_PERSISTENT_TILE.block_k:
        assert kernels.fixed_tile_matmul_launch(x[:1024], weight)[2] is False
        pytest.skip(f"the table's block_k {table_config.block_k} runs the in-program launch")
    for rows in (1024, 4096):
        config, split, persistent = kernels.fixed_tile_matmul_launch(x[:rows], weight)
        assert persistent and not split, rows
        assert (config.block_m, config.block_n) == (BATCH_INVARIANT_PERSISTENT_TILE.block_m,
                                                    BATCH_INVARIANT_PERSISTENT_TILE.block_n)
        got = kernels.fixed_tile_matmul_triton(x[:rows], weight)
        in_program = kernels.fixed_tile_matmul_triton(x[:rows], weight, split_across_programs=False,
                                                      persistent=False)
        assert torch.equal(got, in_program), rows
    torch.testing.assert_close(got.float(), kernels.fixed_tile_matmul_torch(x, weight).float(), atol=0.05,
                               rtol=0.02)
    for rows in (1, 8, 256):
        assert torch.equal(kernels.fixed_tile_matmul_triton(x[:rows], weight), got[:rows]), rows
    static = x[:1024].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = kernels.fixed_tile_matmul_triton(static, weight)
    static.copy_(x[-1024:])
    graph.replay()
    assert torch.equal(replayed, got[-1024:])


def test_8b_shape_bf16_logprobs_are_bitwise_batch_invariant_with_cuda_graphs(llama8b_layers4):
    prefix = random_prompts(1, vocab=128256, min_len=300, max_len=300, seed=21)[0]
    prompts = ([prefix + tail for tail in random_prompts(5, vocab=128256, min_len=10, max_len=80, seed=22)]
               + random_prompts(19, vocab=128256, min_len=20, max_len=600, seed=23))
    with LLM(llama8b_layers4, load_format="dummy", dtype="bfloat16", max_model_len=2048,
             gpu_memory_utilization=0.6, batch_invariant=True) as llm:
        info = llm.get_engine_info()
        assert info.cuda_graphs and info.attention_backend == "triton" and not info.cascade_attention
        assert list(_differing_runs(llm, prompts, chunk_tokens=256)) == []
        llm.set_model_args(batch_invariant=False)
        assert _any_differs(llm, prompts, chunk_tokens=256)
