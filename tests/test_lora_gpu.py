"""LoRA on the GPU (``pytest -m gpu``): SmolLM2-135M in float32 with the Triton shrink/expand
kernels inside CUDA graphs, against HF transformers + PEFT in float32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from conftest import SMOLLM2_TEXTS, hf_greedy
from lora_fixtures import ALL_TARGETS, make_adapter
from pagedlab import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def smollm2_adapters(smollm2_hf, tmp_path_factory):
    model, _ = smollm2_hf
    root = tmp_path_factory.mktemp("smollm2-lora")
    return [make_adapter(model, root / "all-r16", 0, 16, 32, ALL_TARGETS),
            make_adapter(model, root / "qv-r8-rslora", 1, 8, 16, ["q_proj", "v_proj"], use_rslora=True)]


def test_mixed_adapters_with_cuda_graphs_match_peft(smollm2_dir, smollm2_hf, smollm2_adapters):
    model, tokenizer = smollm2_hf
    prompts = [tokenizer(t).input_ids for t in SMOLLM2_TEXTS[:6]]
    loras = [LoRARequest(f"a{i}", i + 1, a.path) for i, a in enumerate(smollm2_adapters)]
    choice = [None, loras[0], loras[1], loras[0], None, loras[1]]  # base and both adapters interleaved
    expected = [hf_greedy(model if lora is None else smollm2_adapters[lora.lora_int_id - 1].peft_model, p,
                          GREEDY.max_tokens) for p, lora in zip(prompts, choice)]
    with LLM(smollm2_dir, dtype="float32", device="cuda", kv_cache_memory_bytes=256 << 20, enable_lora=True,
             max_loras=2, max_lora_rank=16) as llm:
        assert llm.get_engine_info().cuda_graphs
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choice)
        assert [o.outputs[0].token_ids for o in outs] == expected
        alone = llm.generate(prompts[1:2], GREEDY, use_tqdm=False, lora_request=loras[0])
        assert alone[0].outputs[0].token_ids == expected[1]
