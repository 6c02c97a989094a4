"""Experiments on a Ray cluster: ``pagedlab run exp.yaml --ray [ADDRESS]``.

The driver (this process) does what the local runner does: it expands the runs, skips those the
store holds as finished (so a killed driver resumes), and groups the rest by weight-level
settings. Each group then runs as one Ray task asking for ``tensor_parallel_size`` GPUs (or that
many CPUs when the group runs on the CPU or the cluster has no GPU), so groups run in parallel on
every free GPU of every node. A task loads the group's model once and stores each run itself, in
one transaction, in the same results store (a database every node reaches: PostgreSQL across
hosts; a SQLite file only when every node is on this host). A task whose worker or node dies is
submitted again (up to ``max_group_retries`` times); its runs stored already, finished or failed,
are skipped, so no run is stored twice and a failed one keeps its own error (its traceback). The
driver shows one progress bar over the stored runs and each group's state. Ray is imported only
here.
"""

from __future__ import annotations

from pagedlab.lab.runner import (ExperimentReport, RunSession, run_experiment, run_group,
                                 run_label, store_failure)
from pagedlab.lab.runs import ResolvedRun
from pagedlab.lab.schema import ExperimentSpec
from pagedlab.lab.store import ResultStore, resolve_url
from pagedlab.llm import LLM

PROGRESS_POLL_S = 1.0


def run_experiment_on_ray(spec: ExperimentSpec, db: str | None = None, address: str | None = None,
                          quiet: bool = False, max_group_retries: int = 2,
                          runtime_env: dict | None = None) -> ExperimentReport:
    """``run_experiment`` with each group of runs as a Ray task. ``address``: the cluster to join
    (None: the one ``RAY_ADDRESS`` names, else a new local one, as ``ray.init()`` does); an
    already initialised Ray is used as it is. ``runtime_env`` is given to every task."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address)
    url = resolve_url(db)
    check_store_reachable(url, ray.nodes())
    groups = RayGroups(url, max_group_retries, runtime_env)
    return run_experiment(spec, db=url, quiet=quiet, run_groups=groups)


def check_store_reachable(url: str, nodes: list[dict]) -> None:
    """A SQLite file is on one host's disk: refuse it when the cluster's live nodes span hosts."""
    hosts = sorted({n["NodeManagerAddress"] for n in nodes if n.get("Alive", True)})
    if url.startswith("sqlite") and len(hosts) > 1:
        raise ValueError(f"the results store {url} is a local SQLite file, but the Ray cluster spans "
                         f"{len(hosts)} hosts ({', '.join(hosts)}): workers on other hosts cannot write "
                         "it; give --db a database every node reaches, e.g. "
                         "postgresql://USER:PASSWORD@HOST/DB")


def group_resources(run: ResolvedRun, cluster_has_gpus: bool) -> dict:
    """What one group's task asks for: a GPU per tensor-parallel rank, or a CPU per rank on the
    CPU (the group's ``engine.device`` is cpu, or the cluster has no GPU). The task holds its
    ranks itself, so a group may not ask Ray for them again."""
    engine = run.config["engine"]
    if engine.get("distributed_executor_backend", "mp") == "ray":
        raise ValueError("engine.distributed_executor_backend='ray' inside `pagedlab run --ray` would wait "
                         "forever for a second set of GPUs: the sweep already places each group's ranks; "
                         "use 'mp' (the default)")
    ranks = int(engine.get("tensor_parallel_size", 1))
    if engine.get("device", "auto") == "cpu" or not cluster_has_gpus:
        return {"num_cpus": ranks, "num_gpus": 0}
    return {"num_cpus": 1, "num_gpus": ranks}


def unplaceable(ask: dict, nodes: list[dict]) -> str | None:
    """Why no node (given by its resources) can run a task asking ``ask``, or None when one can. A
    group's ranks share one host, so one node must hold them all; Ray would keep the task pending
    until such a node joins, and the sweep would wait forever."""
    need = {"CPU": ask["num_cpus"], "GPU": ask["num_gpus"]}
    if any(all(node.get(k, 0) >= v for k, v in need.items()) for node in nodes):
        return None
    have = ", ".join(sorted({f"{node.get('CPU', 0):g} CPU(s) and {node.get('GPU', 0):g} GPU(s)"
                                for node in nodes})) or "none alive"
    return (f"the group asks for {need['CPU']} CPU(s) and {need['GPU']} GPU(s) on one node (a rank each), "
            f"but no node of the cluster has {need['CPU']} CPU(s) and {need['GPU']} GPU(s) (its nodes: "
            f"{have}); lower engine.tensor_parallel_size or add such a node")


def run_group_task(spec: ExperimentSpec, url: str, group_runs: list[ResolvedRun]) -> ExperimentReport:
    """One group, in a Ray worker: load the model once, store each run; what it did, as a report."""
    report = ExperimentReport(spec.name, len(group_runs))
    with ResultStore(url) as store:
        run_group(RunSession(spec, store, report, quiet=True), group_runs, LLM)
    return report


class RayGroups:
    """The ``run_groups`` of ``run_experiment`` on Ray: submit every group, follow them, resubmit
    a group whose worker died, and merge the groups' reports into the session's."""

    def __init__(self, url: str, max_group_retries: int, runtime_env: dict | None):
        self.url, self.max_group_retries, self.runtime_env = url, max_group_retries, runtime_env

    def __call__(self, session: RunSession, groups: list[list[ResolvedRun]]) -> None:
        import ray

        task = ray.remote(run_group_task)
        groups = list(groups)
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        resources = [group_resources(group[0], has_gpus) for group in groups]  # bad settings fail first
        pending: dict = {}  # task ref -> (group index, attempt)
        state = ["submitted"] * len(groups)
        # the failed rows stored before the sweep: a row not among them was stored by a group's task
        failed_before = {r["run_key"]: r["run_id"] for r in session.store.runs(
            experiment=session.spec.name, status="failed", manifest=False)}

        def submit(index: int, attempt: int) -> None:
            options = dict(resources[index], max_retries=0)
            if self.runtime_env:
                options["runtime_env"] = self.runtime_env
            pending[task.options(**options).remote(session.spec, self.url, groups[index])] = (index, attempt)

        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive", True)]
        for index in range(len(groups)):
            reason = unplaceable(resources[index], nodes)
            if reason is None:
                submit(index, 0)
                continue
            for run in groups[index]:
                store_failure(session, run, reason, None)
            state[index] = "failed"
        progress = _Progress(session, groups)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=PROGRESS_POLL_S)
            for ref in ready:
                index, attempt = pending.pop(ref)
                state[index] = self._finish(session, ray, ref, groups, index, attempt, failed_before)
                if state[index] == "retry":
                    submit(index, attempt + 1)
                    state[index] = f"retry {attempt + 1}"
            progress.update(state)
        progress.update(state)

    def _finish(self, session: RunSession, ray, ref, groups: list[list[ResolvedRun]], index: int,
                attempt: int, failed_before: dict[str, int]) -> str:
        """Merge a finished task's report; "retry" when its worker died and retries are left (the
        group then keeps only its runs not stored yet). A run the task stored failed keeps its own
        error (a bad prompt's traceback), neither overwritten by the worker's death nor retried."""
        try:
            _merge(session.report, ray.get(ref))
            return "done"
        except ray.exceptions.RayTaskError as e:  # an error the group's code did not handle
            reason = f"the group's task failed: {e.cause!r}"
        except ray.exceptions.RayError as e:  # the worker process or its node died
            reason = f"the group's worker died {attempt + 1} time(s) ({type(e).__name__})"
        rows = {r["run_key"]: r for r in session.store.runs(experiment=session.spec.name, manifest=False)}
        stored = {key for key, r in rows.items() if r["status"] == "finished"
                  or r["run_id"] != failed_before.get(key)}  # finished, or failed in this task
        for run in [r for r in groups[index] if r.run_key in stored]:
            row = rows[run.run_key]
            if row["status"] == "finished":
                session.report.finished.append(row["run_id"])
            else:
                session.report.failed.append((run_label(run), (row["error"] or "").partition("\n\n")[0]))
        groups[index] = [r for r in groups[index] if r.run_key not in stored]
        if not groups[index]:
            return "done"
        if reason.startswith("the group's worker died") and attempt < self.max_group_retries:
            session.log(f"{reason}; retrying its {len(groups[index])} unfinished run(s)")
            return "retry"
        for run in groups[index]:
            store_failure(session, run, reason, None)
        return "failed"


def _merge(report: ExperimentReport, part: ExperimentReport) -> None:
    report.finished += part.finished
    report.failed += part.failed
    report.skipped += part.skipped
    report.model_loads += part.model_loads
    report.replans += part.replans
    report.replan_s += part.replan_s


class _Progress:
    """The driver's bar: advanced by the runs the store holds as finished (whichever worker stored
    them), with the groups' states as its postfix."""

    def __init__(self, session: RunSession, groups: list[list[ResolvedRun]]):
        self.session = session
        self.keys = {run.run_key for group in groups for run in group}
        self.seen: set[str] = set()

    def update(self, state: list[str]) -> None:
        bar = self.session.bar
        if bar is None:
            return
        stored = self.session.store.finished_keys(self.session.spec.name) & self.keys
        bar.update(len(stored - self.seen))
        self.seen |= stored
        counts: dict[str, int] = {}
        for s in state:
            counts[s] = counts.get(s, 0) + 1
        bar.set_postfix_str(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + " group(s)")

