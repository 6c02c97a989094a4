"""The results database: one row per finished run, with its params, metrics, outputs, manifest
and telemetry, in any SQLAlchemy database (a SQLite file by default; PostgreSQL in CI).

Tables (created on first use):

- ``experiments``: ``name`` (unique), the experiment's resolved spec, created/updated times;
- ``runs``: ``run_key`` (unique: experiment + resolved params + repeat + seed + the checksums of
  the local weights, so a rerun skips it), ``status`` ("finished" or "failed"), ``model``, ``repeat``,
  ``seed``, and JSON columns ``params`` (dotted keys such as ``engine.block_size``), ``metrics``
  (flat scalars), ``manifest``, ``telemetry`` (summary) and ``telemetry_samples``; ``error`` for a
  failed run;
- ``outputs``: one row per prompt of a run (prompt, references, text, token ids, finish reason).

Crash safety: a run is written in ONE transaction when it ends (run row and all its outputs), so
a process killed at any moment leaves either the whole run or nothing; on SQLite each commit is
synced to disk (``synchronous = FULL``), so a stored run survives a power loss or OS crash too.
Concurrency: on SQLite the file is in WAL mode and every write transaction starts with ``BEGIN
IMMEDIATE`` (writers queue up for the lock instead of failing); on every database the unique
``run_key`` makes two processes that finish the same run store it once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pagedlab.lab.manifest import fill_unset_params, flatten, unset_params

DEFAULT_URL = "sqlite:///results.db"
SCHEMA_VERSION = 1
_BASE_COLUMNS = ("run_id", "experiment", "run_key", "status", "model", "repeat", "seed", "started_at",
                 "finished_at", "duration_s", "host")


def resolve_url(url: str | os.PathLike | None) -> str:
    """A SQLAlchemy URL: ``None`` is $PAGEDLAB_DB or ``sqlite:///results.db``; a plain path is a
    SQLite file."""
    if url is None or url == "":
        url = os.environ.get("PAGEDLAB_DB") or DEFAULT_URL
    url = str(url)
    if "://" not in url:
        url = "sqlite:///" + str(Path(url).expanduser().resolve())
    return url


def with_installed_driver(parsed):
    """``parsed`` (a SQLAlchemy URL) with a PostgreSQL driver that is installed: ``postgresql://``
    names none, and SQLAlchemy 2.1 then takes psycopg 3, where the lab installs psycopg2
    (``psycopg2-binary``); so without psycopg 3 the URL means ``postgresql+psycopg2://``."""
    if (parsed.drivername == "postgresql" and importlib.util.find_spec("psycopg") is None
            and importlib.util.find_spec("psycopg2") is not None):
        return parsed.set(drivername="postgresql+psycopg2")
    return parsed


def _require_sqlalchemy():
    try:
        import sqlalchemy
    except ImportError:
        raise ImportError("the results store needs SQLAlchemy 2: pip install 'SQLAlchemy>=2' "
                          "(or pip install 'pagedlab[lab]')") from None
    if int(sqlalchemy.__version__.split(".")[0]) < 2:
        raise ImportError(f"the results store needs SQLAlchemy >= 2, found {sqlalchemy.__version__}")
    return sqlalchemy


@dataclass
class RunRecord:
    """Everything stored about one run."""

    experiment: str
    run_key: str
    params: dict
    metrics: dict
    manifest: dict
    telemetry: dict = field(default_factory=dict)
    telemetry_samples: list = field(default_factory=list)
    # prompt, reference, text, token_ids, finish_reason, ...
    outputs: list[dict] = field(default_factory=list)
    repeat: int = 0
    seed: int | None = None
    model: str | None = None
    status: str = "finished"
    error: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None


def _storable_text(value: str | None) -> str | None:
    """``value`` with each NUL character replaced by U+FFFD: PostgreSQL's text and jsonb reject NUL
    (a byte-level BPE model can sample the token of byte 0; a scraped dataset can hold one), so it
    is replaced on every database alike; the token ids keep the exact output."""
    return value.replace("\x00", "\ufffd") if isinstance(value, str) else value


def jsonable(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become None (PostgreSQL's json rejects them), NUL characters U+FFFD
    (``_storable_text``), tuples become lists, numpy scalars become Python numbers, other objects
    their str()."""
    if isinstance(obj, str):
        return _storable_text(obj)
    if obj is None or isinstance(obj, (bool, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {_storable_text(str(k)): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return jsonable(obj.item())
        except (TypeError, ValueError):
            pass
    if isinstance(obj, datetime):
        return obj.isoformat()
    return _storable_text(str(obj))


_fault_counts: dict[str, int] = {}


def _fault_point(name: str) -> None:
    """Crash-test hook: with PAGEDLAB_FAULT="name:N" the process SIGKILLs itself the N-th time it
    passes ``name`` (e.g. ``store.mid_write``: run and outputs inserted, not yet committed)."""
    spec = os.environ.get("PAGEDLAB_FAULT")
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _fault_counts[name] = _fault_counts.get(name, 0) + 1
    if _fault_counts[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def _tables(sa):
    from sqlalchemy.dialects import postgresql

    md = sa.MetaData()
    json_t = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
    ts = sa.DateTime(timezone=True)
    sa.Table("pagedlab_meta", md,
             sa.Column("key", sa.String(64), primary_key=True),
             sa.Column("value", sa.String(255), nullable=False))
    sa.Table("experiments", md,
             sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
             sa.Column("name", sa.String(255), nullable=False, unique=True),
             sa.Column("spec", json_t),
             sa.Column("created_at", ts, nullable=False),
             sa.Column("updated_at", ts, nullable=False),
             sqlite_autoincrement=True)
    sa.Table("runs", md,
             sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
             sa.Column("experiment_id", sa.Integer, sa.ForeignKey("experiments.id", ondelete="CASCADE"),
                       nullable=False, index=True),
             sa.Column("run_key", sa.String(255), nullable=False, unique=True),
             sa.Column("status", sa.String(16), nullable=False),
             sa.Column("model", sa.Text),
             sa.Column("repeat", sa.Integer, nullable=False, default=0),
             sa.Column("seed", sa.BigInteger),
             sa.Column("params", json_t, nullable=False),
             sa.Column("metrics", json_t, nullable=False),
             sa.Column("manifest", json_t, nullable=False),
             sa.Column("telemetry", json_t),
             sa.Column("telemetry_samples", json_t),
             sa.Column("error", sa.Text),
             sa.Column("host", sa.String(255)),
             sa.Column("started_at", ts),
             sa.Column("finished_at", ts),
             sa.Column("duration_s", sa.Float),
             sqlite_autoincrement=True)  # run ids are never reused, even after a delete
    sa.Table("outputs", md,
             sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
             sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False,
                       index=True),
             sa.Column("idx", sa.Integer, nullable=False),
             sa.Column("prompt", sa.Text),
             sa.Column("prompt_tokens", sa.Integer),
             sa.Column("reference", json_t),
             sa.Column("text", sa.Text),
             sa.Column("token_ids", json_t),
             sa.Column("num_tokens", sa.Integer),
             sa.Column("finish_reason", sa.String(16)),
             sa.Column("extra", json_t))
    return md


class ResultStore:
    """A results database at ``url`` (see ``resolve_url``); tables are created on first use.
    ``create=False`` refuses to create a SQLite file that does not exist (for read-only commands)."""

    def __init__(self, url: str | os.PathLike | None = None, echo: bool = False, create: bool = True):
        sa = _require_sqlalchemy()
        self.sa = sa
        self.url = resolve_url(url)
        try:
            parsed = with_installed_driver(sa.engine.make_url(self.url))
        except Exception as e:
            raise ValueError(f"--db {self.url!r} is not a database URL ({e}): give e.g. sqlite:///results.db "
                             "or postgresql://user:pass@host/db") from None
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        kwargs: dict = {"echo": echo, "future": True}
        if self.is_sqlite:
            db = parsed.database
            if db and db != ":memory:" and not db.startswith("file:"):
                if not create and not Path(db).expanduser().exists():
                    raise FileNotFoundError(f"there is no results database at {db} (give --db URL)")
                Path(db).expanduser().parent.mkdir(parents=True, exist_ok=True)
            kwargs["connect_args"] = {"timeout": 120}
        else:
            kwargs["pool_pre_ping"] = True
        try:
            self.engine = sa.create_engine(parsed, **kwargs)
        except Exception as e:  # e.g. a missing driver such as psycopg2
            raise ValueError(f"cannot open the results database {self.safe_url()}: {e}") from None
        if self.is_sqlite:
            self._setup_sqlite()
        self.metadata = _tables(sa)
        self.t_meta = self.metadata.tables["pagedlab_meta"]
        self.t_exp = self.metadata.tables["experiments"]
        self.t_runs = self.metadata.tables["runs"]
        self.t_out = self.metadata.tables["outputs"]
        self._init_schema()

    def safe_url(self) -> str:
        """The database URL with its password hidden, for messages."""
        try:
            return self.sa.engine.make_url(self.url).render_as_string(hide_password=True)
        except Exception:
            return "<url>"

    # ---- connection handling ----------------------------------------------------------------
    def _setup_sqlite(self) -> None:
        event = self.sa.event

        @event.listens_for(self.engine, "connect")
        def _connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA busy_timeout = 120000")
            cur.execute("PRAGMA foreign_keys = ON")
            # e.g. a read-only or network file system: the rollback journal still works
            with contextlib.suppress(Exception):
                cur.execute("PRAGMA journal_mode = WAL")
            # NORMAL in WAL mode can lose the last commits on a power loss or OS crash; a commit
            # is one whole run, so syncing each costs milliseconds against the run's seconds
            cur.execute("PRAGMA synchronous = FULL")
            cur.close()

        @event.listens_for(self.engine, "begin")
        def _begin(conn):
            # A write transaction takes the write lock up front, so two writers queue on the busy
            # timeout instead of deadlocking when a reader upgrades to a writer.
            write = conn.get_execution_options().get("pagedlab_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    def _write(self):
        """A connection whose ``begin()`` starts a write transaction."""
        return self.engine.connect().execution_options(pagedlab_write=True)

    def _init_schema(self) -> None:
        sa = self.sa
        try:
            with self._write() as conn, conn.begin():
                if conn.dialect.name == "postgresql":  # two processes creating tables at once
                    conn.execute(sa.text("SELECT pg_advisory_xact_lock(724100001)"))
                self.metadata.create_all(conn)
                version = conn.execute(sa.select(self.t_meta.c.value).where(
                    self.t_meta.c.key == "schema_version")).scalar()
                if version is None:
                    conn.execute(self.t_meta.insert().values(key="schema_version", value=str(SCHEMA_VERSION)))
                elif int(version) > SCHEMA_VERSION:
                    raise ValueError(f"the results database {self.safe_url()} has schema version {version}, "
                                     f"newer than this pagedlab's {SCHEMA_VERSION}: upgrade pagedlab")
        except sa.exc.OperationalError as e:
            raise ValueError(f"cannot open the results database {self.safe_url()}: {e.orig}") from None

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- experiments --------------------------------------------------------------------------
    def ensure_experiment(self, name: str, spec: dict | None = None) -> int:
        """The id of experiment ``name``, created (or its spec updated) as needed."""
        with self._write() as conn, conn.begin():
            return self._ensure_experiment(conn, name, spec)

    def _ensure_experiment(self, conn, name: str, spec: dict | None) -> int:
        sa, t = self.sa, self.t_exp
        now = datetime.now(timezone.utc)
        row = conn.execute(sa.select(t.c.id).where(t.c.name == name)).first()
        if row is not None:
            if spec is not None:
                conn.execute(t.update().where(t.c.id == row.id).values(spec=jsonable(spec), updated_at=now))
            return row.id
        try:
            with conn.begin_nested():
                return conn.execute(t.insert().values(name=name, spec=jsonable(spec), created_at=now,
                                                      updated_at=now)).inserted_primary_key[0]
        except sa.exc.IntegrityError:  # another process created it just now
            return conn.execute(sa.select(t.c.id).where(t.c.name == name)).scalar_one()

    def experiments(self) -> list[dict]:
        sa, t, r = self.sa, self.t_exp, self.t_runs
        counts = (sa.select(r.c.experiment_id, r.c.status, sa.func.count().label("n"))
                  .group_by(r.c.experiment_id, r.c.status).subquery())
        with self.engine.connect() as conn:
            exps = conn.execute(sa.select(t).order_by(t.c.id)).mappings().all()
            tally: dict = {}
            for row in conn.execute(sa.select(counts)).mappings():
                tally.setdefault(row["experiment_id"], {})[row["status"]] = row["n"]
        return [{"id": e["id"], "name": e["name"], "spec": e["spec"], "created_at": _iso(e["created_at"]),
                 "updated_at": _iso(e["updated_at"]), "runs": tally.get(e["id"], {})} for e in exps]

    # ---- runs -----------------------------------------------------------------------------------
    def is_finished(self, run_key: str) -> bool:
        r = self.t_runs
        with self.engine.connect() as conn:
            return conn.execute(self.sa.select(r.c.id).where(r.c.run_key == run_key, r.c.status == "finished")
                                ).first() is not None

    def finished_keys(self, experiment: str | None = None) -> set[str]:
        sa, r, e = self.sa, self.t_runs, self.t_exp
        q = sa.select(r.c.run_key).where(r.c.status == "finished")
        if experiment is not None:
            q = q.join(e, e.c.id == r.c.experiment_id).where(e.c.name == experiment)
        with self.engine.connect() as conn:
            return set(conn.execute(q).scalars())

    def rekey_runs(self, renames: dict[str, str]) -> int:
        """Give stored runs new run keys (``{old: new}``, also in their manifests), each unless a
        run already holds its new key; returns how many were renamed. Used when the run key's
        recipe changes, so runs stored under an old key still count as done."""
        sa, r = self.sa, self.t_runs
        if not renames:
            return 0
        with self._write() as conn, conn.begin():
            taken = set(conn.execute(sa.select(r.c.run_key).where(r.c.run_key.in_(list(renames.values()))))
                        .scalars())
            rows = conn.execute(sa.select(r.c.id, r.c.run_key, r.c.manifest)
                                .where(r.c.run_key.in_(list(renames)))).all()
            renamed = 0
            for row in rows:
                new = renames[row.run_key]
                if new in taken:
                    continue
                manifest = row.manifest
                if isinstance(manifest, dict) and isinstance(manifest.get("experiment"), dict):
                    manifest = {**manifest, "experiment": {**manifest["experiment"], "run_key": new}}
                conn.execute(r.update().where(r.c.id == row.id).values(run_key=new, manifest=manifest))
                taken.add(new)
                renamed += 1
        return renamed

    def record_run(self, rec: RunRecord) -> int:
        """Store a run with its outputs in one transaction; returns its id.

        A run whose ``run_key`` is already stored as finished is not stored again (the existing id
        is returned); a failed attempt stored earlier is replaced.
        """
        if rec.status not in ("finished", "failed"):
            raise ValueError(f"status={rec.status!r} is invalid: a stored run is 'finished' or 'failed'")
        sa, r = self.sa, self.t_runs
        finished_at = rec.finished_at or datetime.now(timezone.utc)
        started_at = rec.started_at or finished_at
        host = (rec.manifest.get("host") or {}).get("hostname") if isinstance(rec.manifest, dict) else None
        values = dict(
            run_key=rec.run_key, status=rec.status, model=_storable_text(rec.model), repeat=rec.repeat,
            seed=rec.seed,
            params=jsonable(rec.params), metrics=jsonable(rec.metrics), manifest=jsonable(rec.manifest),
            telemetry=jsonable(rec.telemetry), telemetry_samples=jsonable(rec.telemetry_samples),
            error=_storable_text(rec.error), host=host, started_at=started_at, finished_at=finished_at,
            duration_s=(finished_at - started_at).total_seconds())
        outputs = [self._output_row(i, o) for i, o in enumerate(rec.outputs)]
        try:
            with self._write() as conn, conn.begin():
                existing = conn.execute(sa.select(r.c.id,
                                                  r.c.status).where(r.c.run_key == rec.run_key)).first()
                if existing is not None:
                    if existing.status == "finished":
                        return existing.id
                    # a failed attempt: replaced by this one (one row per run key)
                    conn.execute(self.t_out.delete().where(self.t_out.c.run_id == existing.id))
                    conn.execute(r.delete().where(r.c.id == existing.id))
                values["experiment_id"] = self._ensure_experiment(conn, rec.experiment, None)
                run_id = conn.execute(r.insert().values(**values)).inserted_primary_key[0]
                if outputs:
                    conn.execute(self.t_out.insert(), [dict(o, run_id=run_id) for o in outputs])
                _fault_point("store.mid_write")
                return run_id
        except sa.exc.IntegrityError:  # another process stored the same run_key first
            with self.engine.connect() as conn:
                row = conn.execute(sa.select(r.c.id).where(r.c.run_key == rec.run_key)).first()
            if row is None:
                raise
            return row.id

    @staticmethod
    def _output_row(i: int, o: dict) -> dict:
        known = {"prompt", "prompt_tokens", "reference", "text", "token_ids", "finish_reason"}
        token_ids = o.get("token_ids")
        return {"idx": o.get("idx", i), "prompt": _storable_text(o.get("prompt")),
                "prompt_tokens": o.get("prompt_tokens"), "reference": jsonable(o.get("reference")),
                "text": _storable_text(o.get("text")),
                "token_ids": jsonable(token_ids),
                "num_tokens": len(token_ids) if token_ids is not None else None,
                "finish_reason": o.get("finish_reason"),
                "extra": jsonable({k: v for k, v in o.items() if k not in known and k != "idx"}) or None}

    def runs(self, experiment: str | None = None, status: str | None = None, run_ids=None,
             manifest: bool = True) -> list[dict]:
        """Stored runs (without outputs and telemetry samples), oldest first. A param that other
        runs of its experiment store and a run left at its default reads the value the run used
        (``fill_unset_params``), so every run of an experiment has every varied key."""
        sa, r, e = self.sa, self.t_runs, self.t_exp
        cols = [r.c.id, e.c.name.label("experiment"), r.c.run_key, r.c.status, r.c.model, r.c.repeat,
                r.c.seed,
                r.c.params, r.c.metrics, r.c.telemetry, r.c.error, r.c.host, r.c.started_at, r.c.finished_at,
                r.c.duration_s]
        if manifest:
            cols.append(r.c.manifest)
        q = sa.select(*cols).join(e, e.c.id == r.c.experiment_id).order_by(r.c.id)
        if experiment is not None:
            q = q.where(e.c.name == experiment)
        if status is not None:
            q = q.where(r.c.status == status)
        if run_ids is not None:
            q = q.where(r.c.id.in_(list(run_ids)))
        with self.engine.connect() as conn:
            runs = [_run_dict(row) for row in conn.execute(q).mappings().all()]
            unset = unset_params(runs)
            if unset and manifest:
                fill_unset_params(runs, unset, {run["run_id"]: run["manifest"] for run in runs})
            elif unset:
                fill_unset_params(runs, unset, dict(conn.execute(sa.select(r.c.id, r.c.manifest).where(
                    r.c.id.in_(list(unset)))).all()))
        return runs

    def get_run(self, run_id: int, outputs: bool = True, samples: bool = False) -> dict:
        found = self.runs(run_ids=[run_id])
        if not found:
            raise KeyError(f"run {run_id} is not in {self.safe_url()}")
        run = found[0]
        if outputs:
            run["outputs"] = self.outputs(run_id)
        if samples:
            with self.engine.connect() as conn:
                run["telemetry_samples"] = conn.execute(self.sa.select(self.t_runs.c.telemetry_samples).where(
                    self.t_runs.c.id == run_id)).scalar()
        return run

    def outputs(self, run_id: int) -> list[dict]:
        t = self.t_out
        with self.engine.connect() as conn:
            query = self.sa.select(t).where(t.c.run_id == run_id).order_by(t.c.idx)
            rows = conn.execute(query).mappings().all()
        return [{k: v for k, v in row.items() if k not in ("id", "run_id")} for row in rows]

    def delete_runs(self, experiment: str | None = None, status: str | None = None) -> int:
        sa, r, e = self.sa, self.t_runs, self.t_exp
        with self._write() as conn, conn.begin():
            q = sa.select(r.c.id)
            if experiment is not None:
                q = q.join(e, e.c.id == r.c.experiment_id).where(e.c.name == experiment)
            if status is not None:
                q = q.where(r.c.status == status)
            ids = list(conn.execute(q).scalars())
            if ids:
                conn.execute(self.t_out.delete().where(self.t_out.c.run_id.in_(ids)))
                conn.execute(r.delete().where(r.c.id.in_(ids)))
            return len(ids)

    # ---- tables for analysis ----------------------------------------------------------------------
    def dataframe(self, experiment: str | None = None, status: str | None = "finished",
                  manifest: bool = False):
        """One row per run: the base columns, then one column per param (dotted names such as
        ``engine.block_size``), then one per metric; ``manifest=True`` adds ``manifest.*`` columns."""
        import pandas as pd

        rows = []
        for run in self.runs(experiment=experiment, status=status, manifest=manifest):
            row = {k: run[k] for k in _BASE_COLUMNS}
            row.update(sorted((run["params"] or {}).items()))  # sorted: PostgreSQL's JSONB reorders keys
            for key, value in sorted((run["metrics"] or {}).items()):
                row[key if key not in row else f"metric.{key}"] = value
            if run["status"] == "failed":
                row["error"] = run["error"]
            if manifest:
                row.update({f"manifest.{k}": v for k, v in flatten(run["manifest"] or {}).items()})
            rows.append(row)
        return pd.DataFrame(rows, columns=None if rows else list(_BASE_COLUMNS))

    def export(self, path: str | os.PathLike, fmt: str | None = None, experiment: str | None = None,
               status: str | None = "finished", outputs: bool = False, manifest: bool = False) -> int:
        """Write the runs as csv, jsonl or parquet (from the suffix unless ``fmt``); returns the count.

        csv/parquet: the ``dataframe()`` table; jsonl: one nested object per run (params, metrics,
        manifest, telemetry, and the outputs with ``outputs=True``, which the tables refuse). The
        file is written beside ``path`` and renamed onto it when complete, so an export that stops
        part-way leaves no partial file and an earlier export at ``path`` whole (a link such as
        /dev/stdout, or a pipe, is written as it goes)."""
        path = Path(path)
        fmt = (fmt or path.suffix.lstrip(".")).lower()
        if fmt not in ("csv", "jsonl", "parquet"):
            raise ValueError(f"export format {fmt!r} is invalid: choose csv, jsonl or parquet")
        if outputs and fmt != "jsonl":  # a table has one row per run: nowhere to put the outputs
            raise ValueError(f"outputs (--outputs) are exported as jsonl only, not {fmt}: give a .jsonl file")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or (path.exists() and not path.is_file()):
            return self._write_export(path, fmt, experiment, status, outputs, manifest)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            count = self._write_export(tmp, fmt, experiment, status, outputs, manifest)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return count

    def _write_export(self, path: Path, fmt: str, experiment: str | None, status: str | None, outputs: bool,
                      manifest: bool) -> int:
        if fmt == "jsonl":
            runs = self.runs(experiment=experiment, status=status, manifest=True)
            with open(path, "w", encoding="utf-8") as f:
                for run in runs:
                    if outputs:
                        run["outputs"] = self.outputs(run["run_id"])
                    f.write(json.dumps(jsonable(run), ensure_ascii=False) + "\n")
            return len(runs)
        df = self.dataframe(experiment=experiment, status=status, manifest=manifest)
        for col in df.columns:  # nested values (lists, dicts) as JSON text
            if df[col].map(lambda v: isinstance(v, (list, dict))).any():
                df[col] = df[col].map(lambda v: json.dumps(jsonable(v)) if isinstance(v, (list, dict)) else v)
        if fmt == "csv":
            df.to_csv(path, index=False)
        else:
            try:
                import pyarrow  # noqa: F401
            except ImportError:
                raise ImportError("parquet export needs pyarrow: pip install pyarrow") from None
            for col in df.columns:  # parquet wants one type per column
                if df[col].dtype == object:
                    df[col] = _parquet_column(df[col].tolist())
            df.to_parquet(path, index=False)
        return len(df)


def _parquet_column(values: list) -> list:
    """A column's values for parquet: missing ones (None, or NaN where a run lacks the key) null,
    the others as they are if they share a type (numbers count as one), else as text: a flag
    missing from some runs stays a boolean, not the text "True" beside "nan"."""
    values = [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in values]
    kinds = {float if type(v) is int else type(v) for v in values if v is not None}
    return values if len(kinds) <= 1 else [None if v is None else str(v) for v in values]


def _iso(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if value.tzinfo is None:  # SQLite gives naive datetimes back; they were stored in UTC
        value = value.replace(tzinfo=timezone.utc)
    return value.isoformat()


def _run_dict(row) -> dict:
    d = {"run_id": row["id"], "experiment": row["experiment"], "run_key": row["run_key"],
         "status": row["status"],
         "model": row["model"], "repeat": row["repeat"], "seed": row["seed"], "params": row["params"] or {},
         "metrics": row["metrics"] or {}, "telemetry": row["telemetry"] or {}, "error": row["error"],
         "host": row["host"], "started_at": _iso(row["started_at"]), "finished_at": _iso(row["finished_at"]),
         "duration_s": row["duration_s"]}
    if "manifest" in row:
        d["manifest"] = row["manifest"] or {}
    return d


def load_results(url: str | os.PathLike | None = None, experiment: str | None = None,
                 status: str | None = "finished", manifest: bool = False):
    """``pandas.DataFrame`` with one row per run of the database at ``url``: run_id, experiment,
    run_key, status, model, repeat, seed, times, then the params (``engine.block_size``,
    ``sampling.temperature``, ...) and metrics (``bleu``, ``output_throughput``, ...) as columns."""
    with ResultStore(url, create=False) as store:
        return store.dataframe(experiment=experiment, status=status, manifest=manifest)
