"""Tensor parallelism over processes of one host.

Rank 0 is the engine's own process: the scheduler, the KV cache manager and the sampler live
there, once. Ranks 1..N-1 are worker processes; each holds its shard of the model and its own KV
cache and runs every step rank 0 runs. Per step, rank 0 sends the step's host inputs (positions,
slots, the block table: a few kilobytes) to each worker through a pipe and broadcasts the input
ids over the process group (they may include ids the previous step sampled, still on the
device). Every rank then runs the same forward: the row-parallel layers all-reduce, the LM head
gathers the logits. Plans (KV cache size, CUDA graphs) are configured on every rank together,
and the ranks agree on the smallest block count.

A worker that dies is reported by the driver as an error naming its rank; workers leave when
the driver closes them, exits or dies (their pipe closes), so no process outlives the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import numpy as np
import torch

from pagedlab.config import EngineConfig
from pagedlab.distributed.parallel_state import (destroy_tensor_parallel, enable_peer_all_reduce,
                                                 get_tp_group, init_tensor_parallel)
from pagedlab.distributed.peer_all_reduce import PeerAllReduce
from pagedlab.engine.model_runner import ModelRunner, StepInputs, load_model_runner
from pagedlab.loader import resolve_model_source

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
REPLY_POLL_S = 0.5  # how often a wait for the workers checks that they are alive


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
                         peer_all_reduce: bool = True) -> None:
    """Join the group; on GPUs also set up the one-shot all-reduce over peer memory unless
    ``peer_all_reduce`` is off (``disable_custom_all_reduce``)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_tensor_parallel(world_size, rank, process_group_backend(device), init_method, COLLECTIVE_TIMEOUT)
    if device.type == "cuda" and peer_all_reduce:
        enable_peer_all_reduce(PeerAllReduce.from_cuda_ipc(get_tp_group(), device))


class TensorParallelWorkers:
    """The worker processes of ranks 1..N-1, seen from rank 0."""

    def __init__(self, config: EngineConfig, world_size: int):
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.connections: list[Connection] = []
        for rank in range(1, world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=run_worker, name=f"pagedlab-tp-rank{rank}", daemon=True,
                                      args=(rank, world_size, self.init_method, config, child_end))
            process.start()
            child_end.close()
            self.processes.append(process)
            self.connections.append(parent_end)

    def send(self, kind: str, payload=None) -> None:
        """Send a command to every worker (no reply awaited)."""
        self.check_alive()
        for connection in self.connections:
            try:
                connection.send((kind, payload))
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self.check_alive()
                raise

    def send_step(self, inputs: StepInputs, block_table: np.ndarray, query_lens: list[int]) -> None:
        """This step's host inputs for every worker (Request objects stay on rank 0)."""
        host_inputs = dataclasses.replace(inputs, sampled=[], prompt_chunks={})
        self.send("step", WorkerStep(host_inputs, block_table, query_lens))

    def collect(self) -> list:
        """Every worker's reply to the last command that has one; a worker's error (or death) is
        raised here, naming its rank."""
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
        """The error to raise for ``error`` met in a collective: a worker's death (a collective
        with a dead peer fails with the transport's message, often before the exit is seen)."""
        wait([p.sentinel for p in self.processes], grace_s)
        for rank, process in enumerate(self.processes, 1):
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
        return RuntimeError(f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code "
                            f"{process.exitcode}{reason}; the engine cannot continue: build a new LLM")

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


def run_worker(rank: int, world_size: int, init_method: str, config: EngineConfig,
               connection: Connection) -> None:
    """A worker's whole life: join the group, load its shard, then serve rank 0's commands until
    told to close or until rank 0 is gone (its pipe closes). Ctrl-C is rank 0's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner = None
    try:
        device = rank_device(config.device, rank)
        join_tensor_parallel(world_size, rank, device, init_method, not config.disable_custom_all_reduce)
        runner = load_worker_runner(config, device)
        connection.send(("ok", None))
        _serve(runner, connection)
    except EOFError:
        pass  # rank 0 is gone
    except BaseException as e:  # sent to rank 0, which raises it
        with contextlib.suppress(OSError):
            connection.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if runner is not None:
            runner.close()
        destroy_tensor_parallel()


def load_worker_runner(config: EngineConfig, device: torch.device) -> ModelRunner:
    from transformers import AutoConfig

    source = resolve_model_source(config.model, config.load_format, config.revision, config.download_dir)
    hf_config = AutoConfig.from_pretrained(str(source.path), trust_remote_code=config.trust_remote_code)
    return load_model_runner(config, source, hf_config, device)


def _serve(runner: ModelRunner, connection: Connection) -> None:
    while True:
        kind, payload = connection.recv()
        if kind == "close":
            return
        if kind == "step":
            runner.run_worker_step(payload.inputs, payload.block_table, payload.query_lens)
        elif kind == "configure":
            try:
                connection.send(("ok", runner.configure(payload)))
            except ValueError as e:  # the same on every rank (they agree on the block count)
                connection.send(("error", str(e)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
