"""The batched multi-LoRA shrink/expand kernels (``pagedlab.kernels.lora``) against their torch
references (``pagedlab.lora.ops``) on random segment layouts: tokens of several slots
interleaved, tokens without a slot, fused outputs of unequal slices, ranks below the maximum.

On a machine without CUDA the kernels run under the Triton interpreter (float32 and float16:
the interpreter's ``tl.dot`` on bf16 is not trustworthy); TRITON_INTERPRET is set here, before
the kernel module is first imported.
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "pagedlab.kernels.lora" in sys.modules:  # built without the interpreter by another module
        importlib.reload(sys.modules["pagedlab.kernels.lora"])

from pagedlab.lora.ops import LoRAMapping, lora_expand_torch, lora_shrink_torch, sort_tokens_by_slot

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    return importlib.import_module("pagedlab.kernels.lora")


def random_mapping(num_tokens: int, num_slots: int, seed: int) -> LoRAMapping:
    """Tokens of random slots (about a quarter without one), in a random interleaving."""
    rng = np.random.default_rng(seed)
    slots = rng.integers(-1, num_slots, num_tokens)
    slots[rng.random(num_tokens) < 0.25] = -1
    mapping = LoRAMapping.empty(num_tokens + 5, num_slots, torch.device(DEVICE))  # larger, as for graphs
    order, counts, starts = sort_tokens_by_slot(slots, num_slots)
    mapping.token_slots[:num_tokens] = torch.as_tensor(slots, dtype=torch.int32)
    mapping.sorted_token_ids[:len(order)] = torch.as_tensor(order)
    mapping.slot_counts.copy_(torch.as_tensor(counts))
    mapping.slot_starts.copy_(torch.as_tensor(starts))
    return mapping


def test_sort_tokens_by_slot_groups_each_slot():
    order, counts, starts = sort_tokens_by_slot([2, -1, 0, 2, 1, -1, 0], 4)
    assert order.tolist() == [2, 6, 4, 0, 3]
    assert counts.tolist() == [2, 1, 2, 0]
    assert starts.tolist() == [0, 2, 3, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,slices,rank,seed", [(1, 1, 8, 0), (37, 3, 16, 1), (70, 2, 24, 2)])
def test_shrink_expand_match_the_torch_reference(kernels, dtype, num_tokens, slices, rank, seed):
    torch.manual_seed(seed)
    num_slots, in_features = 3, 48
    sizes = [40, 24, 24][:slices]
    mapping = random_mapping(num_tokens, num_slots, seed)
    x = torch.randn(num_tokens, in_features, device=DEVICE).to(dtype)
    lora_a = (torch.randn(num_slots, slices, rank, in_features, device=DEVICE) * 0.2).to(dtype)
    lora_b = (torch.randn(num_slots, slices, max(sizes), rank, device=DEVICE) * 0.2).to(dtype)
    offsets = torch.tensor(np.cumsum([0] + sizes[:-1]), dtype=torch.int32, device=DEVICE)
    sizes_t = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    has_slot = mapping.token_slots[:num_tokens] >= 0

    h = kernels.lora_shrink(x, lora_a, mapping)
    h_ref = lora_shrink_torch(x, lora_a, mapping)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(h[:, has_slot], h_ref[:, has_slot], **tol)

    y = torch.randn(num_tokens, sum(sizes), device=DEVICE).to(dtype)
    y_ref = y.clone()
    kernels.lora_expand(h_ref, lora_b, mapping, y, offsets, sizes_t)
    lora_expand_torch(h_ref, lora_b, mapping, y_ref, offsets, sizes_t)
    torch.testing.assert_close(y, y_ref, **tol)
    assert torch.equal(y[~has_slot], y_ref[~has_slot])  # rows without an adapter are untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 8, 256, 2051])
def test_kernels_at_llama_8b_sizes_on_gpu(kernels, dtype, num_tokens):
    """Llama-3-8B's fused q/k/v (4096 -> 4096 + 1024 + 1024), rank 16, eight slots."""
    torch.manual_seed(num_tokens)
    num_slots, rank, in_features, sizes = 8, 16, 4096, [4096, 1024, 1024]
    mapping = random_mapping(num_tokens, num_slots, num_tokens)
    x = torch.randn(num_tokens, in_features, device=DEVICE).to(dtype)
    lora_a = (torch.randn(num_slots, 3, rank, in_features, device=DEVICE) / in_features ** 0.5).to(dtype)
    lora_b = (torch.randn(num_slots, 3, max(sizes), rank, device=DEVICE) / rank ** 0.5).to(dtype)
    offsets = torch.tensor([0, 4096, 5120], dtype=torch.int32, device=DEVICE)
    sizes_t = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    has_slot = mapping.token_slots[:num_tokens] >= 0
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    h = kernels.lora_shrink(x, lora_a, mapping)
    h_ref = lora_shrink_torch(x, lora_a, mapping)
    torch.testing.assert_close(h[:, has_slot], h_ref[:, has_slot], **tol)
    y = torch.randn(num_tokens, sum(sizes), device=DEVICE).to(dtype)
    y_ref = y.clone()
    kernels.lora_expand(h_ref, lora_b, mapping, y, offsets, sizes_t)
    lora_expand_torch(h_ref, lora_b, mapping, y_ref, offsets, sizes_t)
    torch.testing.assert_close(y, y_ref, **tol)
