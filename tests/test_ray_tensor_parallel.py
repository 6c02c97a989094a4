"""``distributed_executor_backend="ray"`` on the CPU: rank 1 as a Ray actor in a placement group
of one CPU bundle per rank, over gloo. The same greedy tokens as one process, as the "mp"
backend and as HF transformers; a killed actor is an error naming its rank; close() leaves no
actor and no placement group."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from conftest import hf_greedy, random_prompts
from pagedlab import LLM, SamplingParams

ray = pytest.importorskip("ray")

# Under pytest-xdist (CI: -n 2 --dist loadgroup) the modules that start Ray or share the
# PostgreSQL database run on one worker, one after another.
pytestmark = pytest.mark.xdist_group("ray-and-postgres")
KV_BYTES = 16 << 20
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def local_ray():
    """One Ray instance for the module (start-up is slow): two CPUs, one per rank. Its temp dir is
    short: Ray's unix socket paths (at most 107 bytes) live under it, and pytest's numbered tmp
    paths pushed them past that."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp,
             runtime_env={"env_vars": {"PYTHONPATH": SRC}})  # the actors import this checkout
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def _tokens(path, prompts, params, **engine_args):
    with LLM(path, dtype="float32", device="cpu", kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=16,
             **engine_args) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_ray_workers_give_one_process_mp_and_hf_tokens(local_ray, tiny_llama):
    prefix = random_prompts(1, min_len=40, max_len=40, seed=7)[0]
    prompts = [prefix + p for p in random_prompts(3, max_len=20, seed=8)] + random_prompts(2, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    on_ray = _tokens(tiny_llama.path, prompts, params, tensor_parallel_size=2,
                     distributed_executor_backend="ray")
    assert on_ray == [hf_greedy(tiny_llama.hf_model, p, 8, eos_token_id=None) for p in prompts]
    assert on_ray == _tokens(tiny_llama.path, prompts, params)
    assert on_ray == _tokens(tiny_llama.path, prompts, params, tensor_parallel_size=2)
    assert ray.util.placement_group_table() and all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_ray_workers_build_the_overridden_model(local_ray, tiny_llama):
    """hf_overrides reach the actor's shard (rank 0's changed config goes to it): the tokens of one
    process with the same overrides (HF's: test_hf_overrides), not the checkpoint's."""
    prompts = random_prompts(2, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cut = {"num_hidden_layers": 1}
    on_ray = _tokens(tiny_llama.path, prompts, params, tensor_parallel_size=2,
                     distributed_executor_backend="ray", hf_overrides=cut)
    assert on_ray == _tokens(tiny_llama.path, prompts, params, hf_overrides=cut)
    assert on_ray != _tokens(tiny_llama.path, prompts, params)


def test_a_killed_ray_worker_is_an_error_naming_it_and_close_leaves_no_actor(local_ray, tiny_llama):
    llm = LLM(tiny_llama.path, device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES,
              distributed_executor_backend="ray")
    (pid,) = llm.llm_engine.runner.workers.pids
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    named = rf"tensor-parallel worker rank 1 \(Ray actor \w+, pid {pid}\) exited"
    with pytest.raises(RuntimeError, match=named):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.close()
    with LLM(tiny_llama.path, device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES,
             distributed_executor_backend="ray") as llm:
        (pid,) = llm.llm_engine.runner.workers.pids
    deadline = time.monotonic() + 10
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_unknown_backend_is_named(tiny_llama):
    with pytest.raises(ValueError, match=r"distributed_executor_backend='dask' is invalid: .* one of"):
        LLM(tiny_llama.path, distributed_executor_backend="dask")


def test_a_ray_worker_that_dies_before_the_rendezvous_is_an_error_naming_it(local_ray, tiny_llama,
                                                                           monkeypatch):
    """An actor gone before it joins the group is raised at once, not after rank 0 waited out the
    rendezvous timeout for it."""
    from pagedlab.engine import engine

    start_workers = engine.start_tensor_parallel_workers

    def start_then_kill_rank1(config, hf_config, device):
        workers = start_workers(config, hf_config, device)
        ray.kill(workers.actors[0])
        return workers

    monkeypatch.setattr(engine, "start_tensor_parallel_workers", start_then_kill_rank1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 \(Ray actor \w+\) exited"):
        LLM(tiny_llama.path, device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES,
            distributed_executor_backend="ray")
    assert time.monotonic() - start < 30
