"""The batch-invariant matmul's config table (``gemv_configs.BATCH_INVARIANT_CONFIGS``): which
config a batch takes, the table's own check (one block_k and split_k per shape), and a table
that gives small batches other tiles than large ones still computing every row bitwise as the
full batch does (under the interpreter on a machine without CUDA)."""

from __future__ import annotations

import pytest
import torch

from pagedlab.kernels import gemv_configs
from pagedlab.kernels.gemv_configs import (BATCH_INVARIANT_CONFIGS, BATCH_INVARIANT_SPLIT_LAUNCH,
                                           BATCH_INVARIANT_TILE, TileConfig, batch_invariant_config,
                                           batch_invariant_split_launch, batch_invariant_splits,
                                           check_batch_invariant_table)
from test_batch_invariant import DEVICE, kernels  # noqa: F401 (kernels: the interpreted module's fixture)

SMALL_ROWS = TileConfig(block_n=32, block_k=16, split_k=3, block_m=16)
LARGE_ROWS = TileConfig(block_n=64, block_k=16, split_k=3, block_m=32, num_warps=8, num_stages=3)


def test_a_batch_takes_its_buckets_config_else_the_nearest_listed_else_the_default():
    table = {(1, 72, 80): SMALL_ROWS, (8, 72, 80): SMALL_ROWS, (256, 72, 80): LARGE_ROWS}
    chosen = {rows: batch_invariant_config(rows, 72, 80, 132, table)
              for rows in (1, 5, 8, 40, 200, 256, 5000)}
    assert chosen == {1: SMALL_ROWS, 5: SMALL_ROWS, 8: SMALL_ROWS, 40: SMALL_ROWS, 200: LARGE_ROWS,
                      256: LARGE_ROWS, 5000: LARGE_ROWS}
    default = batch_invariant_config(3, 4096, 4096, 132, table)
    assert default.split_k == batch_invariant_splits(4096, 4096, BATCH_INVARIANT_TILE, 132) == 5
    assert (default.block_m, default.block_n, default.block_k) == (128, 128, 64)
    # The launch: as listed for the batch's bucket (or the nearest listed); unlisted shapes split
    # when their tiles fill less than half the SMs.
    split = {(8, 72, 80)}
    launches = [batch_invariant_split_launch(m, 72, 80, 1000, 132, table, split) for m in (1, 5, 40, 300)]
    assert launches == [False, True, True, False]
    assert batch_invariant_split_launch(1, 4096, 4096, 66, 132, table, split)
    assert not batch_invariant_split_launch(1, 4096, 4096, 67, 132, table, split)


def test_the_table_check_rejects_a_shape_with_two_reduction_orders():
    check_batch_invariant_table(BATCH_INVARIANT_CONFIGS, BATCH_INVARIANT_SPLIT_LAUNCH)
    with pytest.raises(ValueError, match=r"split launches \[\(8, 72, 80\)\] have no config"):
        check_batch_invariant_table({(1, 72, 80): SMALL_ROWS}, {(8, 72, 80)})
    check_batch_invariant_table({(1, 72, 80): SMALL_ROWS, (1024, 72, 80): LARGE_ROWS})
    other_segments = TileConfig(block_n=64, block_k=16, split_k=2, block_m=32)
    with pytest.raises(ValueError, match=r"\(block_k, split_k\) \(16, 3\) and \(16, 2\)"):
        check_batch_invariant_table({(1, 72, 80): SMALL_ROWS, (256, 72, 80): other_segments})
    with pytest.raises(ValueError, match="row bucket 2"):
        check_batch_invariant_table({(2, 72, 80): SMALL_ROWS})
    with pytest.raises(ValueError, match="block_m >= 16"):
        check_batch_invariant_table({(1, 72, 80): TileConfig(block_n=32, block_k=16)})


def test_a_mixed_table_keeps_every_row_bitwise_the_full_batchs(kernels, monkeypatch):  # noqa: F811
    """Small batches on 16-row tiles of 32 columns, large ones on 32 x 64 tiles, one block_k and
    split_k, some launches splitting K across programs: a row alone or in any batch equals the
    40-row batch's (which takes the large tiles), and matches the torch reference."""
    table = {(1, 72, 80): SMALL_ROWS, (8, 72, 80): SMALL_ROWS, (64, 72, 80): LARGE_ROWS}
    monkeypatch.setattr(gemv_configs, "BATCH_INVARIANT_CONFIGS", table)
    monkeypatch.setattr(gemv_configs, "BATCH_INVARIANT_SPLIT_LAUNCH", {(8, 72, 80)})  # 6 rows: K split
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 80, generator=g).to(DEVICE)
    weight, bias = torch.randn(72, 80, generator=g).to(DEVICE), torch.randn(72, generator=g).to(DEVICE)
    full = kernels.fixed_tile_matmul_triton(x, weight, bias)
    torch.testing.assert_close(full, kernels.fixed_tile_matmul_torch(x, weight, bias), atol=1e-4, rtol=1e-4)
    for rows in (1, 6, 17):
        assert torch.equal(kernels.fixed_tile_matmul_triton(x[-rows:], weight, bias), full[-rows:]), rows
