"""Tensor parallelism at TP=2 over gloo on the CPU.

Two spawned ranks (once per module) check each parallel layer against its unsharded torch
equivalent on fresh random inputs, build models with sizes TP=2 cannot split, and run one prefill
of the tiny Llama (2 KV heads: sharded) and a tiny Qwen3 with one KV head (replicated) loaded from
safetensors and with dummy weights. Here, in the test process, those logits are compared with the
TP=1 model's and with HF transformers'.
"""

from __future__ import annotations

import copy
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import build_tiny_model, random_prompts
from pagedlab.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from pagedlab.layers.attention import AttentionMetadata, BatchLayout, TorchAttentionBackend, forward_context
from pagedlab.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlab.distributed.head_split import HeadSplit, split_attention_heads
from pagedlab.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedlab.loader import load_model, resolve_model_source
from pagedlab.models.registry import build_model

WORLD_SIZE = 2
RANKS_TIMEOUT_S = 120  # the whole two-rank run; a collective gives up after 60 s
PROMPTS = random_prompts(3, min_len=5, max_len=40, seed=7)
BLOCK_SIZE = 16
MAX_POSITION = 512
MODELS = ("llama", "qwen3")
LOAD_FORMATS = ("safetensors", "dummy")
DUMMY_SEED = 5


def load_tiny(path: str, load_format: str) -> torch.nn.Module:
    from transformers import AutoConfig

    source = resolve_model_source(path, load_format)
    hf_config = AutoConfig.from_pretrained(path)
    return load_model(source, hf_config, torch.float32, torch.device("cpu"), MAX_POSITION, seed=DUMMY_SEED)


def prefill_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of every prompt token: one prefill of all prompts through the torch attention
    backend over fresh per-layer KV caches (as ``ModelRunner`` lays them out)."""
    lens = [len(p) for p in prompts]
    blocks_per_seq = -(-max(lens) // BLOCK_SIZE)
    block_tables = torch.arange(len(prompts) * blocks_per_seq, dtype=torch.int32).view(len(prompts), -1)
    for attn in model.attention_layers():
        attn.k_cache = torch.zeros(block_tables.numel(), BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
        attn.v_cache = torch.zeros_like(attn.k_cache)
    slots = [int(block_tables[i, t // BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE
             for i, n in enumerate(lens) for t in range(n)]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, *lens], dtype=torch.int32).cumsum(
            0, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=block_tables,
        max_query_len=max(lens), max_seq_len=MAX_POSITION)
    backend = TorchAttentionBackend()
    backend.plan(metadata, BatchLayout(lens, lens, block_tables.numpy(), BLOCK_SIZE, MAX_POSITION,
                                       allow_cascade=False))
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode(), forward_context(metadata, backend):
        return model.compute_logits(model(input_ids, positions))


# ---- what each rank runs ------------------------------------------------------------------
def layer_errors(rank: int) -> dict[str, float]:
    """Max abs difference of each parallel layer's output on this rank from what the unsharded
    computation gives for its part. Every rank draws the same full weights and inputs."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    errors = {}
    w_gate, w_up, b_gate, b_up, x = randn(48, 32), randn(48, 32), randn(48), randn(48), randn(5, 32)
    gate_up = ColumnParallelLinear(32, [48, 48], bias=True)
    for shard_id, (w, b) in enumerate([(w_gate, b_gate), (w_up, b_up)]):
        gate_up.weight.weight_loader(gate_up.weight, w, shard_id)
        gate_up.bias.weight_loader(gate_up.bias, b, shard_id)
    ours = slice(rank * 24, (rank + 1) * 24)
    expected = torch.cat([F.linear(x, w_gate, b_gate)[:, ours], F.linear(x, w_up, b_up)[:, ours]], -1)
    errors["column_parallel_fused"] = (gate_up(x) - expected).abs().max().item()
    for num_kv_heads in (2, 1):  # one KV head per rank; one KV head replicated on both
        errors[f"qkv_parallel_kv_heads_{num_kv_heads}"] = _qkv_error(rank, num_kv_heads, randn)
    w_down, b_down, x = randn(16, 48), randn(16), randn(5, 48)
    down = RowParallelLinear(48, 16, bias=True)
    down.weight.weight_loader(down.weight, w_down)
    down.bias.data.copy_(b_down)
    x_ours = x[:, rank * 24:(rank + 1) * 24]
    errors["row_parallel"] = (down(x_ours) - F.linear(x, w_down, b_down)).abs().max().item()
    w_vocab, w_head, hidden = randn(101, 16), randn(101, 16), randn(7, 16)  # 101 rows: padded to 102
    ids = torch.tensor([0, 50, 51, 100, 7, 99, 3])
    embedding = VocabParallelEmbedding(101, 16)
    embedding.weight.weight_loader(embedding.weight, w_vocab)
    errors["vocab_parallel_embedding"] = (embedding(ids) - F.embedding(ids, w_vocab)).abs().max().item()
    lm_head = ParallelLMHead(101, 16)
    lm_head.weight.weight_loader(lm_head.weight, w_head)
    errors["parallel_lm_head"] = (lm_head(hidden) - F.linear(hidden, w_head)).abs().max().item()
    tied = ParallelLMHead(101, 16, tie_to=embedding)
    errors["parallel_lm_head_tied"] = (tied(hidden) - F.linear(hidden, w_vocab)).abs().max().item()
    return errors


def _qkv_error(rank: int, num_kv_heads: int, randn) -> float:
    head_dim = 8
    kv_size = num_kv_heads * head_dim
    w_q, w_k, w_v = randn(4 * head_dim, 32), randn(kv_size, 32), randn(kv_size, 32)
    biases = randn(4 * head_dim), randn(kv_size), randn(kv_size)
    qkv = QKVParallelLinear(32, head_dim, 4, num_kv_heads, bias=True)
    for shard_id, (w, b) in enumerate(zip((w_q, w_k, w_v), biases)):
        qkv.weight.weight_loader(qkv.weight, w, shard_id)
        qkv.bias.weight_loader(qkv.bias, b, shard_id)
    x = randn(5, 32)
    kv_head = rank if num_kv_heads == 2 else 0
    q_cols, kv_cols = slice(rank * 16, (rank + 1) * 16), slice(kv_head * head_dim, (kv_head + 1) * head_dim)
    expected = torch.cat([F.linear(x, w_q, biases[0])[:, q_cols], F.linear(x, w_k, biases[1])[:, kv_cols],
                          F.linear(x, w_v, biases[2])[:, kv_cols]], -1)
    assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
    return (qkv(x) - expected).abs().max().item()


def unsplittable_model_errors(llama_path: str) -> dict[str, str]:
    """The error each config TP=2 cannot split gives when the model is built."""
    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(llama_path)
    messages = {}
    for name, changes in {"heads": {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16},
                          "kv_heads": {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16},
                          "intermediate": {"intermediate_size": 129}}.items():
        hf_config = copy.deepcopy(base)
        for key, value in changes.items():
            setattr(hf_config, key, value)
        try:
            build_model(hf_config, MAX_POSITION)
        except ValueError as e:
            messages[name] = str(e)
    return messages


def rank_work(rank: int, model_paths: dict[str, str]) -> dict:
    results = {"layer_errors": layer_errors(rank),
               "model_errors": unsplittable_model_errors(model_paths["llama"]),
               "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    for arch, path in model_paths.items():
        for load_format in LOAD_FORMATS:
            results[arch, load_format] = prefill_logits(load_tiny(path, load_format), PROMPTS)
    return results


def _rank_main(rank: int, init_method: str, out_dir: Path, model_paths: dict[str, str]) -> None:
    torch.set_num_threads(1)
    try:
        init_tensor_parallel(WORLD_SIZE, rank, "gloo", init_method, timeout=timedelta(seconds=60))
        torch.save(rank_work(rank, model_paths), out_dir / f"rank{rank}.pt")
        # both ranks done before either tears gloo down: rank 0 leaving while rank 1 still had a
        # collective in flight aborted it once in CI ("terminate called without an active exception")
        torch.distributed.barrier()
    except BaseException:
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        destroy_tensor_parallel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(out_dir: Path, model_paths: dict[str, str]) -> list[dict]:
    """Each rank's results; the processes are always joined (or killed at the timeout)."""
    context = torch.multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    processes = [context.Process(target=_rank_main, args=(rank, init_method, out_dir, model_paths))
                 for rank in range(WORLD_SIZE)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    try:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    failures = [(out_dir / f"rank{r}.err").read_text() for r in range(WORLD_SIZE)
                if (out_dir / f"rank{r}.err").exists()]
    assert not failures, "a rank failed:\n" + "\n".join(failures)
    exit_codes = [p.exitcode for p in processes]
    assert exit_codes == [0] * WORLD_SIZE, f"ranks exited with {exit_codes} (-9: killed at the timeout)"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


# ---- the tests ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models_for_tp(tiny_llama, tmp_path_factory):
    qwen3 = build_tiny_model(tmp_path_factory.mktemp("qwen3_kv1"), "qwen3", num_key_value_heads=1)
    return {"llama": tiny_llama, "qwen3": qwen3}


@pytest.fixture(scope="module")
def tp2_results(tiny_models_for_tp, tmp_path_factory):
    paths = {arch: tiny.path for arch, tiny in tiny_models_for_tp.items()}
    return run_ranks(tmp_path_factory.mktemp("tp2_ranks"), paths)


@pytest.mark.parametrize("layer", [
    "column_parallel_fused", "qkv_parallel_kv_heads_2", "qkv_parallel_kv_heads_1", "row_parallel",
    "vocab_parallel_embedding", "parallel_lm_head", "parallel_lm_head_tied"])
def test_parallel_layer_matches_unsharded(tp2_results, layer):
    for rank, results in enumerate(tp2_results):
        assert results["layer_errors"][layer] < 1e-5, f"rank {rank}"


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("load_format", LOAD_FORMATS)
def test_tp2_logits_equal_tp1(tp2_results, tiny_models_for_tp, arch, load_format):
    tp1 = prefill_logits(load_tiny(tiny_models_for_tp[arch].path, load_format), PROMPTS)
    for rank, results in enumerate(tp2_results):  # every rank ends with the full vocabulary's logits
        torch.testing.assert_close(results[arch, load_format], tp1, atol=1e-4, rtol=0, msg=f"rank {rank}")
    assert tp2_results[0][arch, load_format].argmax(-1).tolist() == tp1.argmax(-1).tolist()


@pytest.mark.parametrize("arch", MODELS)
def test_tp2_logits_equal_hf(tp2_results, tiny_models_for_tp, arch):
    hf_model = tiny_models_for_tp[arch].hf_model
    with torch.no_grad():
        hf_logits = torch.cat([hf_model(torch.tensor([p])).logits[0] for p in PROMPTS])
    torch.testing.assert_close(tp2_results[0][arch, "safetensors"], hf_logits, atol=1e-4, rtol=0)


def test_process_group_creation_keeps_nvlink_multicast_off(tp2_results):
    assert all(results["nccl_nvls_enable"] == "0" for results in tp2_results)


def test_tp1_makes_no_torch_distributed_call(tiny_llama, monkeypatch):
    import torch.distributed as dist

    def no_collective(*args, **kwargs):
        raise AssertionError("TP=1 called torch.distributed")

    for name in ("all_reduce", "all_gather_into_tensor", "init_process_group"):
        monkeypatch.setattr(dist, name, no_collective)
    init_tensor_parallel(1, 0)
    logits = prefill_logits(load_tiny(tiny_llama.path, "safetensors"), PROMPTS)
    destroy_tensor_parallel()
    assert logits.shape == (sum(map(len, PROMPTS)), 1000)


@pytest.mark.parametrize("world_size, rank", [(0, 0), (2, 2), (2, -1)])
def test_invalid_rank_or_world_size(world_size, rank):
    with pytest.raises(ValueError, match=rf"rank={rank} of world_size={world_size} is invalid"):
        init_tensor_parallel(world_size, rank)


def test_unsplittable_model_sizes_name_both_numbers(tp2_results):
    messages = tp2_results[0]["model_errors"]
    assert messages == {
        "heads": "tensor_parallel_size=2 must divide num_attention_heads=3",
        "kv_heads": "tensor_parallel_size=2 must divide num_key_value_heads=3",
        "intermediate": "tensor_parallel_size=2 must divide intermediate_size=129"}


@pytest.mark.parametrize("heads, kv_heads, tp_size, rank, split", [
    (32, 8, 2, 1, HeadSplit(16, 16, 4, 4)),
    (64, 8, 8, 3, HeadSplit(8, 24, 1, 3)),
    (16, 4, 8, 5, HeadSplit(2, 10, 1, 2)),  # 4 KV heads on 8 ranks: rank 5 holds head 5 * 4 // 8
    (16, 1, 4, 3, HeadSplit(4, 12, 1, 0)),
])
def test_attention_heads_split_by_rank(heads, kv_heads, tp_size, rank, split):
    assert split_attention_heads(heads, kv_heads, tp_size, rank) == split


@pytest.mark.parametrize("heads, kv_heads, tp_size, message", [
    (12, 4, 8, "tensor_parallel_size=8 must divide num_attention_heads=12"),
    (24, 12, 8, "tensor_parallel_size=8 must divide num_key_value_heads=12"),
    (12, 3, 4, "tensor_parallel_size=4 must be a multiple of num_key_value_heads=3 when it is larger"),
])
def test_attention_heads_that_do_not_split_name_both_numbers(heads, kv_heads, tp_size, message):
    with pytest.raises(ValueError, match=message):
        split_attention_heads(heads, kv_heads, tp_size, 0)
