"""The engine at tensor_parallel_size=2 on the CPU (two processes over gloo): the same greedy
tokens as one process and as HF transformers, through prefix caching, chunked prefill and
preemption; logprobs as one process's; a killed worker is an error naming it, and no worker
outlives the engine."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from conftest import build_tiny_model, hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams

KV_BYTES = 16 << 20


def _generate(path, prompts, params, **engine_args):
    with LLM(path, dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=16,
             **engine_args) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
    return outputs, stats


TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two GPUs")
MODELS = pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen3", {"num_key_value_heads": 1})],
                                 ids=["llama-kv2", "qwen3-kv1-replicated"])


def _check_two_ranks_give_one_rank_and_hf_tokens(path, hf_model, **engine_args):
    """Shared prefixes (prefix-cache hits) and a 16-token budget (chunked prefill): the same
    tokens and logprobs at TP=2 as at TP=1, and HF's tokens."""
    prefix = random_prompts(1, min_len=40, max_len=40, seed=7)[0]
    prompts = [prefix + p for p in random_prompts(4, max_len=20, seed=8)] + random_prompts(3, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    one, _ = _generate(path, prompts, params, **engine_args)
    two, stats = _generate(path, prompts, params, tensor_parallel_size=2, **engine_args)
    expected = [hf_greedy(hf_model, p, 8, eos_token_id=None) for p in prompts]
    assert [o.outputs[0].token_ids for o in two] == expected
    assert [o.outputs[0].token_ids for o in one] == expected
    assert stats.prefix_cache_hit_tokens > 0
    for a, b in zip(one, two, strict=True):
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs) == 8
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def _check_preemption_keeps_the_tokens(path, hf_model, **engine_args):
    """Ten blocks per rank for six sequences growing to 60-90 tokens: running ones are preempted
    and recomputed on both ranks."""
    prompts = random_prompts(6, min_len=30, max_len=60, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    bytes_per_block = 2 * 2 * 16 * 1 * 16 * 4  # K and V, 2 layers, 16 slots, 1 KV head a rank, dim 16, fp32
    with LLM(path, dtype="float32", tensor_parallel_size=2, max_model_len=128, max_num_batched_tokens=16,
             kv_cache_memory_bytes=10 * bytes_per_block, **engine_args) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.get_stats().num_preemptions > 0
    assert got == [hf_greedy(hf_model, p, 30, eos_token_id=None) for p in prompts]


@MODELS
def test_two_ranks_give_one_rank_and_hf_tokens(tmp_path, arch, overrides):
    tiny = build_tiny_model(tmp_path / arch, arch, **overrides)
    _check_two_ranks_give_one_rank_and_hf_tokens(tiny.path, tiny.hf_model, device="cpu")


def test_preemption_at_two_ranks_keeps_the_tokens(tiny_llama):
    _check_preemption_keeps_the_tokens(tiny_llama.path, tiny_llama.hf_model, device="cpu")


@pytest.mark.gpu
@TWO_GPUS
@MODELS
@pytest.mark.parametrize("all_reduce", ["one-shot", "nccl"])
def test_two_gpus_through_cuda_graphs_give_one_gpu_and_hf_tokens(tmp_path, arch, overrides, all_reduce):
    """float32 on two GPUs, decode steps replayed in CUDA graphs, small all-reduces through the
    one-shot kernel or all through NCCL."""
    tiny = build_tiny_model(tmp_path / arch, arch, **overrides)
    _check_two_ranks_give_one_rank_and_hf_tokens(tiny.path, tiny.hf_model, device="cuda",
                                                 disable_custom_all_reduce=all_reduce == "nccl")


@pytest.mark.gpu
@TWO_GPUS
def test_preemption_on_two_gpus_keeps_the_tokens(tiny_llama):
    _check_preemption_keeps_the_tokens(tiny_llama.path, tiny_llama.hf_model, device="cuda")


def test_a_killed_worker_is_an_error_naming_it_and_nothing_is_left(tiny_llama):
    llm = LLM(tiny_llama.path, tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES)
    workers = [p for p in multiprocessing.active_children() if p.name.startswith("pagedlab-tp-rank")]
    assert len(workers) == 1
    os.kill(workers[0].pid, signal.SIGKILL)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 .* exited"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        llm.close()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedlab-tp-rank")]


class _ExitingProcess:
    """A worker between closing its pipes and being reaped: its sentinel is ready, yet is_alive()
    says yes until it is joined (the window a loaded machine stretches)."""

    def __init__(self):
        read_end, write_end = os.pipe()
        os.close(write_end)
        self.sentinel, self.pid, self.exitcode, self.joined = read_end, 4242, None, False

    def join(self, timeout=None):
        self.joined, self.exitcode = True, -9

    def is_alive(self):
        return not self.joined


def test_a_transport_error_while_a_worker_exits_names_the_worker():
    from multiprocessing import Pipe

    from pagedlab.engine.tensor_parallel import TensorParallelWorkers

    workers = TensorParallelWorkers.__new__(TensorParallelWorkers)
    process, (parent_end, child_end) = _ExitingProcess(), Pipe()
    workers.processes, workers.connections = [process], [parent_end]
    try:
        error = workers.explain(RuntimeError("Connection reset by peer"), grace_s=0.5)
    finally:
        os.close(process.sentinel)
        parent_end.close()
        child_end.close()
    assert isinstance(error, RuntimeError)
    assert str(error).startswith("tensor-parallel worker rank 1 (pid 4242) exited with code -9")


def test_close_stops_the_workers_and_bad_sizes_are_named(tiny_llama):
    with LLM(tiny_llama.path, tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES) as llm:
        assert llm.get_engine_info().config.tensor_parallel_size == 2
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedlab-tp-rank")]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        LLM(tiny_llama.path, tensor_parallel_size=3, kv_cache_memory_bytes=KV_BYTES)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedlab-tp-rank")]


_DRIVER = """
import multiprocessing, os, signal, sys, time
from pagedlab import LLM

if __name__ == "__main__":  # workers are spawned: they import this file, which must not build an LLM
    llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20)
    print(next(p.pid for p in multiprocessing.active_children()), flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif sys.argv[2] == "interrupt":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
"""


@pytest.mark.parametrize("how", ["exit", "interrupt", "kill"])
def test_no_worker_outlives_its_driver(tiny_llama, tmp_path, how):
    """The driver exits without close(), is interrupted (Ctrl-C), or is killed: its worker goes too."""
    import subprocess
    import sys

    import psutil

    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    proc = subprocess.run([sys.executable, str(script), tiny_llama.path, how], capture_output=True, text=True,
                          timeout=120)
    worker_pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 15
    while psutil.pid_exists(worker_pid) and psutil.Process(worker_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"worker {worker_pid} outlived its driver ({how})"
        time.sleep(0.2)


def test_a_worker_that_dies_before_the_rendezvous_is_an_error_naming_it(tiny_llama, monkeypatch):
    """A worker gone before it joins the group (its imports failed: e.g. a script that builds the
    LLM without an ``if __name__ == "__main__":`` guard, which spawn re-runs) is raised at once,
    not after rank 0 waited out the rendezvous timeout for it; the next engine starts."""
    from pagedlab.engine import engine

    start_workers = engine.start_tensor_parallel_workers

    def start_then_kill_rank1(config, hf_config, device):
        workers = start_workers(config, hf_config, device)
        os.kill(workers.processes[0].pid, signal.SIGKILL)
        workers.processes[0].join()
        return workers

    monkeypatch.setattr(engine, "start_tensor_parallel_workers", start_then_kill_rank1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 \(pid \d+\) exited with code -9"):
        LLM(tiny_llama.path, tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES)
    assert time.monotonic() - start < 30
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedlab-tp-rank")]
    monkeypatch.undo()
    with LLM(tiny_llama.path, tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES) as llm:
        assert llm.get_engine_info().config.tensor_parallel_size == 2


def test_cleanup_after_del_lets_a_new_tensor_parallel_engine_start(tiny_llama):
    """vLLM's prefix_caching.py: ``del llm``, then ``cleanup_dist_env_and_memory()`` (vLLM's, from
    ``vllm.distributed``) before a second LLM, which starts at TP=2 too and gives the same tokens."""
    from pagedlab.distributed import cleanup_dist_env_and_memory

    prompts = random_prompts(2, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(tiny_llama.path, tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    cleanup_dist_env_and_memory()
    with LLM(tiny_llama.path, tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == first
