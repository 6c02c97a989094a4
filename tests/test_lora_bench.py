"""Benchmarks with LoRA adapters: the random-adapter writer against PEFT (float32 greedy on a tiny
random Llama), ``pagedlab bench throughput --num-loras`` spreading the adapters round-robin over
a batch (its output fingerprint equals LLM.generate with the same adapters per request, and
differs from the base model and from one adapter for all), the HF+PEFT peer's mixed batches, and
``LLM.benchmark(lora_requests=...)``."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch

from conftest import KV_BYTES, hf_greedy, random_prompts
from lora_fixtures import ALL_TARGETS
from pagedlab import LLM, LoRARequest, SamplingParams, workloads
from pagedlab.cli import main
from pagedlab.lora.bench import peft_peer, round_robin
from pagedlab.lora.random_adapter import target_shapes, write_random_adapter, write_random_adapters

pytest.importorskip("peft")

BENCH_TARGETS = ("q_proj", "v_proj", "down_proj")


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def bench_adapters(tiny_llama, tmp_path_factory):
    """What ``--num-loras 2 --lora-rank 4 --lora-targets q,v,down`` writes (same seeds), float32."""
    return write_random_adapters(tmp_path_factory.mktemp("bench-lora"), tiny_llama.hf_model.config, 2, 4,
                                 BENCH_TARGETS, torch.float32)


def test_random_adapters_load_in_peft_and_pagedlab_gives_peft_tokens(tiny_llama, tmp_path):
    from peft import PeftConfig, PeftModel

    config = tiny_llama.hf_model.config
    specs = [(ALL_TARGETS, 8, None), (["q_proj", "v_proj", "down_proj"], 4, 4)]  # (targets, rank, alpha)
    paths = [write_random_adapter(tmp_path / f"a{i}", target_shapes(config, targets), rank, i, torch.float32,
                                  lora_alpha=alpha) for i, (targets, rank, alpha) in enumerate(specs)]
    for path, (targets, rank, alpha) in zip(paths, specs):
        peft_config = PeftConfig.from_pretrained(str(path))
        assert (peft_config.r, peft_config.lora_alpha, set(peft_config.target_modules)) == (
            rank, alpha or 2 * rank, set(targets))
    prompts = random_prompts(2, max_len=30, seed=5)
    base = [hf_greedy(tiny_llama.hf_model, p, 8) for p in prompts]
    expected = []
    for path in paths:
        peft_model = PeftModel.from_pretrained(copy.deepcopy(tiny_llama.hf_model), str(path)).eval()
        expected.append([hf_greedy(peft_model, p, 8) for p in prompts])
        assert expected[-1] != base  # B is not zero: the adapter changes the outputs
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(paths)]
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=2,
             max_lora_rank=8) as llm:
        outs = llm.generate(prompts * 2, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False,
                            lora_request=[loras[0], loras[0], loras[1], loras[1]])
    assert tokens(outs) == expected[0] + expected[1]


def test_bench_cli_spreads_adapters_over_the_batch(tiny_llama, bench_adapters, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--model", tiny_llama.path, "--workload", "custom", "--batch-size", "3",
               "--input-len", "12", "--output-len", "6", "--num-loras", "2", "--lora-rank", "4",
               "--lora-targets", "q,v,down", "--json", str(out), "--kv-cache-memory-bytes", str(KV_BYTES),
               "--dtype", "float32"])
    assert rc == 0
    [row] = json.loads(out.read_text())["results"]
    assert row["label"] == "bs=3 loras=2"
    assert row["extra"]["lora"] == {"adapters_in_batch": 2, "names": ["lora-0", "lora-1"], "ranks": [4],
                                    "targets": sorted(BENCH_TARGETS), "max_loras": 2}
    prompts = workloads.make_workload("custom", 1000, 3, 12, 6).prompts
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=2,
             max_lora_rank=4) as llm:
        spread = tokens(llm.generate(prompts, params, use_tqdm=False,
                                     lora_request=round_robin(bench_adapters, 3)))
        first_only = tokens(llm.generate(prompts, params, use_tqdm=False, lora_request=bench_adapters[0]))
        base = tokens(llm.generate(prompts, params, use_tqdm=False))
    # request i ran adapter i mod 2: the bench generated exactly these tokens, which neither the base
    # model nor one adapter for every request gives
    assert row["extra"]["output_tokens_sha256"] == workloads.tokens_sha256(spread)
    assert spread != base and spread[1] != first_only[1] and spread[2] == first_only[2]


def test_hf_peer_runs_each_row_under_its_adapter(tiny_llama, bench_adapters):
    """PEFT's mixed batch (adapter_names) in the HF row: row i equals HF+PEFT greedy of prompt i
    alone under adapter i mod 2."""
    peer = peft_peer(copy.deepcopy(tiny_llama.hf_model), bench_adapters)
    workload = workloads.make_workload("custom", 1000, 3, 10, 5)
    workload.loras = round_robin(bench_adapters, 3)
    row = workloads.run_hf_generate(peer, workload, "bs=3", None)
    assert row.extra["lora"]["peft_mixed_batch"] and row.extra["lora"]["adapters_in_batch"] == 2
    expected = []
    for prompt, lora in zip(workload.prompts, workload.loras):
        peer.set_adapter(lora.lora_name)
        expected.append(hf_greedy(peer, prompt, 5, min_new_tokens=5))
    assert row.extra["output_tokens_sha256"] == workloads.tokens_sha256(expected)
    single = workloads.run_hf_generate(peer, workloads.Workload("custom", workload.prompts[:1], [5],
                                                                loras=workload.loras[:1]), "bs=1", None)
    assert single.extra["lora"]["peft_mixed_batch"] is False
    assert single.extra["output_tokens_sha256"] == workloads.tokens_sha256(expected[:1])


def test_benchmark_spreads_lora_requests_and_records_them(tiny_llama, bench_adapters):
    with LLM(tiny_llama.path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=2,
             max_lora_rank=4) as llm:
        result = llm.benchmark(batch_size=[1, 3], input_len=8, output_len=3, warmup=0,
                               lora_requests=bench_adapters)
        assert sorted(llm.llm_engine.runner.lora.slots) == [1, 2]  # both adapters ran in a step
        with pytest.raises(ValueError, match="lora_requests"):
            llm.benchmark(batch_size=1, input_len=4, output_len=2, lora_requests=[])
    assert [r.lora_adapters for r in result.runs] == [1, 2]
    assert [a["lora_name"] for a in result.settings["lora_requests"]] == ["lora-0", "lora-1"]
    manifest = result.manifest["lora"]
    assert [m["weights_sha256"] for m in manifest] == [
        hashlib.sha256((Path(a.lora_path) / "adapter_model.safetensors").read_bytes()).hexdigest()
        for a in bench_adapters]
    assert "2 LoRA adapter(s) round-robin" in str(result)


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "8"], "give --num-loras too"),
    (["--num-loras", "2", "--lora-targets", "q,lm_head"], "'lm_head' is unknown"),
    (["--num-loras", "0"], "--num-loras 0 is invalid"),
    (["--workload", "W-nano", "--backend", "hf", "--num-loras", "2"], "W-nano"),
])
def test_bench_lora_flags_are_checked(argv, message, capsys):
    assert main(["bench", "throughput", "--model", "unused", *argv]) == 2
    assert message in capsys.readouterr().err
