"""LoRA on the GPU (``pytest -m gpu``): a small random Llama in float32 with the Triton
shrink/expand kernels inside CUDA graphs, against HF transformers + PEFT in float32 on the CPU,
in ``generate`` and in the benchmark with random adapters spread over the batch. A random model
rather than the embedded SmolLM2, whose GGUF packages the GPU image may lack."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import build_tiny_model, hf_greedy, random_prompts
from lora_fixtures import ALL_TARGETS, make_adapter
from pagedlab import LLM, LoRARequest, SamplingParams, workloads
from pagedlab.lora.bench import LoRABench, peft_peer
from pagedlab.lora.random_adapter import write_random_adapters

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    """Wider and deeper than the CPU tests' tiny model, so the kernels run several tiles per slice."""
    return build_tiny_model(tmp_path_factory.mktemp("lora-gpu-llama"), "llama", hidden_size=256,
                            intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def small_adapters(small_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("small-lora")
    return [make_adapter(small_llama.hf_model, root / "all-r16", 0, 16, 32, ALL_TARGETS),
            make_adapter(small_llama.hf_model, root / "qv-r8-rslora", 1, 8, 16, ["q_proj", "v_proj"],
                         use_rslora=True)]


def test_mixed_adapters_with_cuda_graphs_match_peft(small_llama, small_adapters):
    prompts = random_prompts(6, max_len=48, seed=11)
    loras = [LoRARequest(f"a{i}", i + 1, a.path) for i, a in enumerate(small_adapters)]
    choice = [None, loras[0], loras[1], loras[0], None, loras[1]]  # base and both adapters interleaved
    models = [small_llama.hf_model] + [a.peft_model for a in small_adapters]  # by lora_int_id
    expected = [hf_greedy(models[lora.lora_int_id if lora else 0], p, GREEDY.max_tokens)
                for p, lora in zip(prompts, choice)]
    assert expected[1] != hf_greedy(small_llama.hf_model, prompts[1], GREEDY.max_tokens)  # adapters matter
    with LLM(small_llama.path, dtype="float32", device="cuda", kv_cache_memory_bytes=256 << 20,
             enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        assert llm.get_engine_info().cuda_graphs
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choice)
        assert [o.outputs[0].token_ids for o in outs] == expected
        alone = llm.generate(prompts[1:2], GREEDY, use_tqdm=False, lora_request=loras[0])
        assert alone[0].outputs[0].token_ids == expected[1]


def test_adapters_in_the_gemv_epilogue_match_peft(small_llama, small_adapters, monkeypatch):
    """With GEMV table entries for the small model's linears (one row on the CUDA cores; 2-16 rows
    split-K and through tl.dot), every LoRA linear of a decode step of at most 16 tokens runs the
    GEMV that adds the deltas itself: the tokens are still PEFT's, alone and mixed with the base."""
    from pagedlab.kernels import gemv_configs, lora
    from pagedlab.kernels.gemv_configs import TileConfig

    shapes = [(384, 256), (256, 256), (1024, 256), (256, 512)]  # qkv, o, gate_up, down (N, K)
    for n, k in shapes:
        monkeypatch.setitem(gemv_configs.DENSE_GEMV_CONFIGS, (1, n, k), TileConfig(block_n=16, block_k=128))
        for bucket in (2, 4, 8, 16):
            monkeypatch.setitem(gemv_configs.DENSE_GEMV_CONFIGS, (bucket, n, k),
                                TileConfig(block_n=32, block_k=64, split_k=2, block_m=16))
    fused, kernel = [], lora.dense_gemv_triton
    monkeypatch.setattr(lora, "dense_gemv_triton",
                        lambda *args: fused.append(args[0].shape[0]) or kernel(*args))
    prompts = random_prompts(5, max_len=40, seed=12)
    loras = [LoRARequest(f"a{i}", i + 1, a.path) for i, a in enumerate(small_adapters)]
    choice = [loras[0], None, loras[1], loras[0], loras[1]]
    models = [small_llama.hf_model] + [a.peft_model for a in small_adapters]
    expected = [hf_greedy(models[request.lora_int_id if request else 0], p, GREEDY.max_tokens)
                for p, request in zip(prompts, choice)]
    with LLM(small_llama.path, dtype="float32", device="cuda", kv_cache_memory_bytes=256 << 20,
             enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        alone = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=choice[0])
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choice)
    assert {1, 8} <= set(fused), "the decode graphs of 1 and 5 (padded to 8) sequences take the fused GEMV"
    assert alone[0].outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_bench_with_random_adapters_gives_peft_tokens(small_llama, tmp_path):
    """``pagedlab bench --num-loras 2 --lora-rank 8`` on the GPU (graphs, both adapters in slots
    from the warm-up): each request's tokens are HF+PEFT's under adapter ``i mod 2``."""
    lora = LoRABench(2, rank=8)
    [row] = workloads.run_bench("custom", [4], 16, 8, None, ["pagedlab"], model=small_llama.path,
                                engine_args={"dtype": "float32", "kv_cache_memory_bytes": 256 << 20},
                                progress=lambda _: None, lora=lora)
    assert row.extra["lora"]["adapters_in_batch"] == 2 and row.label == "bs=4 loras=2"
    adapters = write_random_adapters(tmp_path, small_llama.hf_model.config, 2, 8, lora.targets, torch.float32)
    peer = peft_peer(copy.deepcopy(small_llama.hf_model), adapters)
    expected = []
    for i, prompt in enumerate(workloads.make_workload("custom", 1000, 4, 16, 8).prompts):
        peer.set_adapter(adapters[i % 2].lora_name)
        expected.append(hf_greedy(peer, prompt, 8, min_new_tokens=8))
    assert row.extra["output_tokens_sha256"] == workloads.tokens_sha256(expected)
