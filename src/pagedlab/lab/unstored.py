"""Runs the results store could not take. A run computed but not stored (a full disk, a lock held
past SQLite's busy timeout, a lost PostgreSQL connection) is saved as a JSON file beside the
database (in a SQLite file's directory, else in the working directory), and the sweep stops with
an error naming the file; ``pagedlab results import FILE`` stores it once the database works."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from datetime import datetime
from pathlib import Path

from pagedlab.lab.store import ResultStore, RunRecord, jsonable

KIND = "pagedlab.run"


class UnstoredRunError(RuntimeError):
    """The results store failed to store a run; ``path`` is the file the run was saved in (None
    when saving it failed too)."""

    path: Path | None = None


def save_record(rec: RunRecord, path: str | os.PathLike) -> Path:
    """Write ``rec`` as JSON, as the store would keep it (``load_record`` reads it back)."""
    path = Path(path)
    data = {"kind": KIND, "version": 1, **jsonable(dataclasses.asdict(rec))}
    try:
        path.write_text(json.dumps(data, ensure_ascii=False) + "\n", encoding="utf-8")
    except BaseException:
        path.unlink(missing_ok=True)  # no partial file that reads as a run
        raise
    return path


def load_record(path: str | os.PathLike) -> RunRecord:
    """The run ``save_record`` wrote to ``path``."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.pop("kind", None) != KIND:
        raise ValueError(f"{path} is not a saved pagedlab run (no kind: {KIND})")
    data.pop("version", None)
    for key in ("started_at", "finished_at"):
        if data.get(key) is not None:
            data[key] = datetime.fromisoformat(data[key])
    try:
        return RunRecord(**data)
    except TypeError as e:
        raise ValueError(f"{path} is not a saved pagedlab run: {e}") from None


def unstored_path(store: ResultStore, rec: RunRecord) -> Path:
    """Where a run ``store`` could not take is saved: beside a SQLite file, else in the working
    directory, named by its run key's digest."""
    db = store.engine.url.database if store.is_sqlite else None
    local = db and db != ":memory:" and not db.startswith("file:")
    folder = Path(db).expanduser().resolve().parent if local else Path.cwd()
    return folder / f"unstored-run-{rec.run_key.rsplit(':', 1)[-1][:16]}.json"


def record_or_save(store: ResultStore, rec: RunRecord, label: str) -> int:
    """``store.record_run(rec)``, the run's id; when the store fails, ``rec`` is saved to a file
    (``unstored_path``) and an ``UnstoredRunError`` names it: the store is unusable, so the caller
    stops rather than compute runs it cannot keep."""
    try:
        return store.record_run(rec)
    except Exception as e:
        cause = getattr(e, "orig", None) or e  # a database error's own message, without SQLAlchemy's SQL
        failed = f"storing {label} in {store.safe_url()} failed ({type(e).__name__}: {cause})"
        path = unstored_path(store, rec)
        try:
            save_record(rec, path)
        except Exception as saving:
            raise UnstoredRunError(f"{failed}, and saving it to {path} failed too "
                                   f"({type(saving).__name__}: {saving}): the run is lost") from e
        error = UnstoredRunError(f"{failed}; the run is saved in {path} (on {socket.gethostname()}): store "
                                 f"it with `pagedlab results import {path} --db URL` once the database works")
        error.path = path
        raise error from e
