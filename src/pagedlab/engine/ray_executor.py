"""The "ray" tensor-parallel backend: ranks 1..N-1 as Ray actors in a placement group.

``LLM(tensor_parallel_size=N, distributed_executor_backend="ray")`` reserves one bundle per rank
(one GPU each, or one CPU each on a CPU cluster) with the PACK strategy, so the ranks share as
few nodes as possible; bundle 0 is pinned to the driver's node, where rank 0 (this process) runs.
Each actor runs the same ``TensorParallelWorker`` as the "mp" backend's processes; commands are
actor calls, which Ray executes in order. The group meets at the driver's node IP (reachable
from the other nodes, unlike 127.0.0.1). Ray is imported only here, when this backend is asked
for; ``ray.init()`` joins the cluster ``RAY_ADDRESS`` names, else starts a local one.
"""

from __future__ import annotations

import os

from pagedlab.config import EngineConfig
from pagedlab.engine.tensor_parallel import (REPLY_POLL_S, TensorParallelExecutor, TensorParallelWorker,
                                             config_for_workers, death_error, free_port, rank_device)

PLACEMENT_TIMEOUT_S = 60.0


class RayWorkerActor:
    """One rank in a Ray actor (wrapped by ``ray.remote`` when the backend starts). On a GPU node
    Ray makes the bundle's GPU the only visible one, so the rank's device is index 0."""

    def start(self, rank: int, world_size: int, init_method: str, config: EngineConfig, hf_config) -> int:
        self.worker = TensorParallelWorker(rank, world_size, init_method, config, hf_config,
                                           rank_device(config.device, 0))
        return os.getpid()

    def execute(self, kind: str, payload):
        return self.worker.execute(kind, payload)

    def close(self) -> None:
        self.worker.close()


class RayWorkers(TensorParallelExecutor):
    """Ranks 1..N-1 as Ray actors, seen from rank 0."""

    def __init__(self, config: EngineConfig, hf_config, world_size: int):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init()
        self.ray = ray
        gpu = rank_device(config.device, 0).type == "cuda"
        bundle = {"GPU": 1} if gpu else {"CPU": 1}
        node_ip = ray.util.get_node_ip_address()
        bundles = [{**bundle, f"node:{node_ip}": 0.001}] + [dict(bundle) for _ in range(world_size - 1)]
        self.placement_group = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self.placement_group)
            raise RuntimeError(f"tensor_parallel_size={world_size} on Ray: the cluster cannot place "
                               f"{world_size} bundles of {bundle} (packed; the first on this node, "
                               f"{node_ip}); it has {ray.available_resources()} free")
        self.init_method = f"tcp://{node_ip}:{free_port()}"
        actor_class = ray.remote(RayWorkerActor)
        self.actors = []
        self.pids: list[int | None] = [None] * (world_size - 1)
        self._replies = []  # (rank, ref) of the last command with a reply
        self._steps = []  # (rank, ref) of steps not yet seen finished
        for rank in range(1, world_size):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group,
                                                        placement_group_bundle_index=rank)
            actor = actor_class.options(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0,
                                        scheduling_strategy=strategy).remote()
            self.actors.append(actor)
            self._replies.append((rank, actor.start.remote(rank, world_size, self.init_method,
                                                           config_for_workers(config), hf_config)))
        self._starting = True

    def send(self, kind: str, payload=None) -> None:
        self.check_alive()
        calls = [(rank, actor.execute.remote(kind, payload)) for rank, actor in enumerate(self.actors, 1)]
        if kind in TensorParallelWorker.REPLIED:
            self._replies = calls
        else:
            self._steps += calls

    def collect(self) -> list:
        replies, self._replies = self._replies, []
        results = [self._get(rank, ref) for rank, ref in replies]
        if self._starting:
            self._starting = False
            self.pids = results
            return [None] * len(results)
        return results

    def _get(self, rank: int, ref):
        ray = self.ray
        while not ray.wait([ref], timeout=REPLY_POLL_S)[0]:
            self.check_alive()
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError:
            raise self._death(rank) from None
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(f"tensor-parallel rank {rank}: {e.cause!r}") from None

    def _death(self, rank: int) -> RuntimeError:
        pid = self.pids[rank - 1]  # known once its start returned
        where = f"Ray actor {self.actors[rank - 1]._actor_id.hex()}" + (f", pid {pid}" if pid else "")
        return death_error(rank, where)

    def check_alive(self) -> None:
        """Finished steps are read back here: a worker that failed or died in one is raised; so is
        one whose start failed (while rank 0 waits for it to join the group)."""
        if self._starting:
            for rank, ref in self._finished(self._replies):  # kept: collect() reads them again
                self._get(rank, ref)
        done = self._finished(self._steps)
        self._steps = [call for call in self._steps if call not in done]
        for rank, ref in done:
            self._get(rank, ref)

    def _finished(self, calls: list) -> list:
        """The (rank, ref) calls whose result is in."""
        if not calls:
            return []
        ready, _ = self.ray.wait([ref for _, ref in calls], num_returns=len(calls), timeout=0)
        finished = set(ready)
        return [call for call in calls if call[1] in finished]

    def explain(self, error: Exception, grace_s: float = 2.0) -> Exception:
        pending = [ref for _, ref in self._steps + self._replies]
        if pending:
            self.ray.wait(pending, num_returns=len(pending), timeout=grace_s)
        try:
            self.check_alive()
        except RuntimeError as death:
            return death
        return error

    def close(self, timeout: float = 10.0) -> None:
        """Ask every actor to leave, then kill it and free the placement group."""
        ray = self.ray
        closing = [actor.close.remote() for actor in self.actors]
        ray.wait(closing, num_returns=len(closing), timeout=timeout)
        for actor in self.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(self.placement_group)
        self.actors = []
        self._steps, self._replies = [], []
