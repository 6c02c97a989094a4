"""``pagedlab plan`` against the engine (``pytest -m gpu`` on a CUDA machine): the KV cache the plan
predicts from config.json alone is within 5% of the blocks the engine allocates after measuring
(Llama-3-8B shape, dummy bf16 weights, gpu_memory_utilization 0.9)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedlab import LLM
from pagedlab.lab.plan import plan_memory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE_8B = Path(__file__).resolve().parent.parent / "examples" / "shapes" / "llama3-8b"


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_plan_predicts_the_kv_blocks_the_engine_allocates(enforce_eager):
    with LLM(str(SHAPE_8B), load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.9,
             enforce_eager=enforce_eager) as llm:
        info = llm.get_engine_info()
        block_size = info.config.block_size
        total = torch.cuda.mem_get_info(info.device)[1]
        plan = plan_memory(info.hf_config, total, dtype="bfloat16", max_model_len=info.max_model_len,
                           gpu_memory_utilization=0.9, max_num_batched_tokens=info.max_num_batched_tokens,
                           block_size=block_size)
        allocated_blocks = info.num_kv_blocks
        assert llm.get_stats().weight_bytes == pytest.approx(plan.weight_bytes, rel=0.01)
    planned_blocks = plan.kv_tokens // block_size
    print(f"plan {planned_blocks} blocks, engine {allocated_blocks} blocks "
          f"({planned_blocks / allocated_blocks - 1:+.2%})")
    assert planned_blocks == pytest.approx(allocated_blocks, rel=0.05)
