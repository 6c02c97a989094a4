"""Tensor parallelism over processes of one host.

Rank 0 is the engine's own process: the scheduler, the KV cache manager and the sampler live
there, once. Ranks 1..N-1 are worker processes; each holds its shard of the model and its own KV
cache and runs every step rank 0 runs. Per step, rank 0 sends the step's host inputs (positions,
slots, the block table: a few kilobytes) to each worker through a pipe and broadcasts the input
ids over the process group (they may include ids the previous step sampled, still on the
device). Every rank then runs the same forward: the row-parallel layers all-reduce, the LM head
gathers the logits. Plans (KV cache size, CUDA graphs) are configured on every rank together,
and the ranks agree on the smallest block count.

The workers run under an executor: "mp" (the default) spawns them as processes of this host
behind pipes; "ray" (``pagedlab.engine.ray_executor``) places them as Ray actors, possibly on
other nodes. Both run the same ``TensorParallelWorker``. A worker that dies is reported by the
driver as an error naming its rank; workers leave when the driver closes them, exits or dies
(their pipe closes, or Ray reaps the driver's actors), so no worker outlives the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import signal
import socket
import time
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import numpy as np
import torch
import torch.distributed as dist

from pagedlab.config import EngineConfig
from pagedlab.distributed.parallel_state import (destroy_tensor_parallel, enable_peer_all_reduce,
                                                 get_tp_group, init_tensor_parallel)
from pagedlab.distributed.peer_all_reduce import PeerAllReduce
from pagedlab.engine.gpu_memory import MemoryBaseline, take_memory_baseline
from pagedlab.engine.model_runner import ModelRunner, load_model_runner
from pagedlab.engine.sleep_mode import RankSleep
from pagedlab.engine.step_inputs import StepInputs
from pagedlab.loader import resolve_model_source

# Bounds the ranks' rendezvous and every collective. A worker that dies is seen at once (its
# sockets close, and the executor polls the processes); this only ends a wait on a rank that is
# alive but stuck, or still starting: on two busy CPU cores a spawned worker's imports took over
# 60 s, and every tensor-parallel CI test timed out at the rendezvous.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
REPLY_POLL_S = 0.5  # how often a wait for the workers checks that they are alive
ARRIVAL_POLL_S = 0.05  # how often rank 0 looks for the workers at the rendezvous


@dataclass
class WorkerStep:
    """What a worker needs of a step: its host inputs (no Request objects), the block table and
    each sequence's new-token count."""

    inputs: StepInputs
    block_table: np.ndarray
    query_lens: list[int]


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r runs on GPU r (``device`` "auto"/"cuda" with CUDA), or on the CPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", rank)


def process_group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_tensor_parallel(world_size: int, rank: int, device: torch.device, init_method: str,
                         peer_all_reduce: bool = True,
                         workers: TensorParallelExecutor | None = None) -> MemoryBaseline | None:
    """Join the group; on GPUs also set up the one-shot all-reduce over peer memory unless
    ``peer_all_reduce`` is off (``disable_custom_all_reduce``). Rank 0 passes its ``workers``
    (see ``meet``). Returns the GPU's memory before the group's buffers, which are the engine's
    (``gpu_memory``; None off CUDA)."""
    baseline = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        baseline = take_memory_baseline(device)
    store = meet(world_size, rank, init_method, workers)
    init_tensor_parallel(world_size, rank, process_group_backend(device), timeout=COLLECTIVE_TIMEOUT,
                         store=store)
    if device.type == "cuda" and peer_all_reduce:
        enable_peer_all_reduce(PeerAllReduce.from_cuda_ipc(get_tp_group(), device))
    return baseline


def meet(world_size: int, rank: int, init_method: str,
         workers: TensorParallelExecutor | None = None) -> dist.TCPStore:
    """The group's store at ``init_method`` ("tcp://host:port"), hosted by rank 0, once every rank
    is there: each worker says it arrived, and rank 0 waits for them while checking that
    ``workers`` live. A worker whose start failed before it joined (its imports, e.g. a script
    without an ``if __name__ == "__main__":`` guard, which spawn re-runs) is so raised at once,
    naming it, instead of being waited for until COLLECTIVE_TIMEOUT as a store timeout."""
    address = urllib.parse.urlsplit(init_method)
    store = dist.TCPStore(address.hostname, address.port, world_size, is_master=rank == 0,
                          timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    if rank:
        store.set(f"pagedlab/arrived/{rank}", "1")
        return store
    arrivals = {r: f"pagedlab/arrived/{r}" for r in range(1, world_size)}
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    # polled with check(), not wait(timeout): each timed-out wait logs a c10d warning
    while not store.check(list(arrivals.values())):
        if workers is not None:
            workers.check_alive()
        if time.monotonic() > deadline:
            missing = [r for r, key in arrivals.items() if not store.check([key])]
            raise RuntimeError(f"tensor-parallel ranks {missing} did not join the group at {init_method} "
                               f"within {COLLECTIVE_TIMEOUT.total_seconds():.0f} s")
        time.sleep(ARRIVAL_POLL_S)
    return store


class TensorParallelExecutor:
    """Ranks 1..N-1 seen from rank 0, whatever runs them (processes of this host, or Ray actors):
    the interface the engine and the model runner drive. ``init_method`` is the group's
    rendezvous address; ``send`` queues a command on every worker (in order), ``collect`` waits
    for every worker's reply to the last command that has one (start-up and ``configure``)."""

    init_method: str

    def send(self, kind: str, payload=None) -> None:
        raise NotImplementedError

    def send_step(self, inputs: StepInputs, block_table: np.ndarray, query_lens: list[int]) -> None:
        """This step's host inputs for every worker (Request objects stay on rank 0)."""
        host_inputs = dataclasses.replace(inputs, sampled=[], prompt_chunks={})
        self.send("step", WorkerStep(host_inputs, block_table, query_lens))

    def collect(self) -> list:
        """Every worker's reply; a worker's error (or death) is raised here, naming its rank."""
        raise NotImplementedError

    def explain(self, error: Exception, grace_s: float = 2.0) -> Exception:
        """The error to raise for ``error`` met in a collective: a worker's death (a collective
        with a dead peer fails with the transport's message, often before the exit is seen)."""
        raise NotImplementedError

    def check_alive(self) -> None:
        raise NotImplementedError

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker; nothing of them is left afterwards."""
        raise NotImplementedError


def death_error(rank: int, where: str, reason: str = "") -> RuntimeError:
    return RuntimeError(f"tensor-parallel worker rank {rank} ({where}) exited{reason}; the engine cannot "
                        "continue: build a new LLM")


class TensorParallelWorkers(TensorParallelExecutor):
    """The "mp" backend: ranks 1..N-1 as spawned processes of this host, each behind a pipe."""

    def __init__(self, config: EngineConfig, hf_config, world_size: int):
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        config = config_for_workers(config)
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.connections: list[Connection] = []
        for rank in range(1, world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=run_worker, name=f"pagedlab-tp-rank{rank}", daemon=True,
                                      args=(rank, world_size, self.init_method, config, hf_config, child_end))
            process.start()
            child_end.close()
            self.processes.append(process)
            self.connections.append(parent_end)

    def send(self, kind: str, payload=None) -> None:
        self.check_alive()
        for connection in self.connections:
            try:
                connection.send((kind, payload))
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self.check_alive()
                raise

    def collect(self) -> list:
        results = []
        for rank, (process, connection) in enumerate(zip(self.processes, self.connections), 1):
            while not connection.poll(REPLY_POLL_S):
                if not process.is_alive():
                    raise self._death(rank, process)
            try:
                status, value = connection.recv()
            except (EOFError, ConnectionResetError):
                raise self._death(rank, process) from None
            if status == "error":
                raise RuntimeError(f"tensor-parallel rank {rank}: {value}")
            results.append(value)
        return results

    def explain(self, error: Exception, grace_s: float = 2.0) -> Exception:
        ready = wait([p.sentinel for p in self.processes], grace_s)
        for rank, process in enumerate(self.processes, 1):
            if process.sentinel in ready:
                # A dying process closes its pipes and sockets before it can be reaped: until the
                # join, is_alive() may still say yes (seen under load, the transport error raised raw)
                process.join(grace_s)
            if not process.is_alive():
                return self._death(rank, process)
        return error

    def check_alive(self) -> None:
        for rank, process in enumerate(self.processes, 1):
            if not process.is_alive():
                raise self._death(rank, process)

    def _death(self, rank: int, process) -> RuntimeError:
        reason = ""
        connection = self.connections[rank - 1]
        with contextlib.suppress(OSError, EOFError):
            if connection.poll(0):
                status, value = connection.recv()
                reason = f": {value}" if status == "error" else ""
        return death_error(rank, f"pid {process.pid}", f" with code {process.exitcode}{reason}")

    def close(self, timeout: float = 10.0) -> None:
        """Ask every worker to leave, then make sure it has (terminate, then kill)."""
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.send(("close", None))
        wait([p.sentinel for p in self.processes], timeout)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self.connections:
            connection.close()


class TensorParallelWorker:
    """Rank r >= 1 of a tensor-parallel model, under any executor: it joins the group, loads its
    shard, then executes rank 0's commands in order."""

    # the commands whose result rank 0 collects
    REPLIED = frozenset({"configure", "load_weights", "sleep", "wake_weights"})

    def __init__(self, rank: int, world_size: int, init_method: str, config: EngineConfig, hf_config,
                 device: torch.device):
        baseline = join_tensor_parallel(world_size, rank, device, init_method,
                                        not config.disable_custom_all_reduce)
        try:
            self.runner = load_worker_runner(config, hf_config, device, baseline)
        except BaseException:
            destroy_tensor_parallel()
            raise
        self.sleeping = RankSleep()

    def execute(self, kind: str, payload):
        """Run one command: "step" (no reply), "configure" (the block count), "load_weights"
        ((name, tensor) pairs that rank 0 has loaded: this rank loads its part), "sleep" (a level)
        or "wake_weights" (sleep mode, as rank 0)."""
        if kind == "step":
            return self.runner.run_worker_step(payload.inputs, payload.block_table, payload.query_lens)
        if kind == "configure":  # a ValueError is the same on every rank (they agree on the block count)
            return self.runner.configure(payload)
        if kind == "load_weights":
            return self.runner.load_weights(payload)
        if kind == "sleep":
            return self.sleeping.sleep(self.runner, payload)
        if kind == "wake_weights":
            return self.sleeping.wake_weights()
        raise ValueError(f"unknown tensor-parallel command {kind!r}: commands are step, configure, "
                         "load_weights, sleep and wake_weights")

    def close(self) -> None:
        self.runner.close()
        destroy_tensor_parallel()


def run_worker(rank: int, world_size: int, init_method: str, config: EngineConfig, hf_config,
               connection: Connection) -> None:
    """A worker process's whole life: start, then serve rank 0's commands until told to close or
    until rank 0 is gone (its pipe closes). Ctrl-C is rank 0's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = None
    try:
        worker = TensorParallelWorker(rank, world_size, init_method, config, hf_config,
                                      rank_device(config.device, rank))
        connection.send(("ok", None))
        _serve(worker, connection)
    except EOFError:
        pass  # rank 0 is gone
    except BaseException as e:  # sent to rank 0, which raises it
        with contextlib.suppress(OSError):
            connection.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if worker is not None:
            worker.close()


def load_worker_runner(config: EngineConfig, hf_config, device: torch.device,
                       memory_baseline: MemoryBaseline | None = None) -> ModelRunner:
    """This rank's shard, built from rank 0's ``hf_config`` (so every rank builds the same model)."""
    source = resolve_model_source(config.model, config.load_format, config.revision, config.download_dir)
    return load_model_runner(config, source, hf_config, device, memory_baseline)


def config_for_workers(config: EngineConfig) -> EngineConfig:
    """``config`` as the workers get it: its ``hf_overrides`` are already in the HF config they get
    with it (rank 0's), and a callable one (a lambda) could not be pickled to them."""
    return dataclasses.replace(config, hf_overrides=None)


def _serve(worker: TensorParallelWorker, connection: Connection) -> None:
    while True:
        kind, payload = connection.recv()
        if kind == "close":
            return
        if kind not in worker.REPLIED:
            worker.execute(kind, payload)
            continue
        try:
            connection.send(("ok", worker.execute(kind, payload)))
        except ValueError as e:
            connection.send(("error", str(e)))
        except Exception as e:  # out of memory waking the weights: rank 0 may retry, so this rank lives on
            connection.send(("error", f"{type(e).__name__}: {e}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
