"""The ledger file's schema: tables, append-only triggers, row conversion and creation (the
layout is described in ``server.ledger``)."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from prism_core.errors import PrivacyParameterError
from prism_core.records import PrivacyEvent
from prism_runtime.durable import fsync_dir
from server.errors import InvalidEventError, LedgerError
from server.ledger.events import LedgerEvent, now

__all__ = [
    "APPLICATION",
    "BUSY_TIMEOUT_S",
    "EVENT_COLUMNS",
    "EVENT_SELECT",
    "LEDGER_APPLICATION_ID",
    "SCHEMA_VERSION",
    "TABLES",
    "TRIGGERS",
    "create_ledger",
    "event_from_row",
]

log = logging.getLogger("server.ledger")

APPLICATION: Final = "prism-fl-ledger"
"""Value of ``meta.application`` in every prism-fl ledger."""
SCHEMA_VERSION: Final = 1
"""Schema version written, and the only one read, by this module."""
LEDGER_APPLICATION_ID: Final = 0x50524C47  # "PRLG"
"""``PRAGMA application_id`` of a prism-fl ledger (bytes 68-71 of the SQLite header)."""

BUSY_TIMEOUT_S: Final = 30.0

_SCHEMA: Final = f"""
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY CHECK (length(run_id) > 0),
    started_at TEXT NOT NULL,
    config_json TEXT NOT NULL
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL CHECK (length(run_id) > 0),
    round INTEGER NOT NULL CHECK (round >= 0),
    site_id TEXT NOT NULL CHECK (length(site_id) > 0),
    mechanism TEXT NOT NULL CHECK (length(mechanism) > 0),
    adjacency TEXT NOT NULL CHECK (length(adjacency) > 0),
    sampling TEXT NOT NULL CHECK (length(sampling) > 0),
    sigma REAL NOT NULL CHECK (sigma >= 0),
    q REAL NOT NULL CHECK (q > 0 AND q <= 1),
    steps INTEGER NOT NULL CHECK (steps >= 0),
    delta REAL NOT NULL CHECK (delta > 0 AND delta < 1),
    epsilon_cap REAL CHECK (epsilon_cap IS NULL OR epsilon_cap > 0),
    recorded_at TEXT NOT NULL,
    confirmed INTEGER NOT NULL DEFAULT 1 CHECK (confirmed IN (0, 1)),
    params_known INTEGER NOT NULL DEFAULT 1 CHECK (params_known IN (0, 1)),
    rng TEXT CHECK (rng IS NULL OR length(rng) > 0),
    code TEXT NOT NULL DEFAULT '',
    unit TEXT NOT NULL DEFAULT 'record' CHECK (length(unit) > 0),
    honest_sites INTEGER CHECK (honest_sites IS NULL OR honest_sites >= 1),
    share_sigma REAL CHECK (share_sigma IS NULL OR share_sigma >= 0),
    CHECK ((honest_sites IS NULL) = (share_sigma IS NULL)),
    CHECK (share_sigma IS NULL OR share_sigma <= sigma),
    CHECK (confirmed = 0 OR (params_known = 1 AND code = '')),
    CHECK (params_known = 1 OR (sigma = 0 AND q = 1)),
    UNIQUE (run_id, round, site_id, mechanism, confirmed)
);
CREATE INDEX events_by_site ON events (site_id, id);
CREATE TRIGGER events_no_update BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: events are append-only, UPDATE refused'); END;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: events are append-only, DELETE refused'); END;
CREATE TRIGGER runs_no_update BEFORE UPDATE ON runs
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: runs are append-only, UPDATE refused'); END;
CREATE TRIGGER runs_no_delete BEFORE DELETE ON runs
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: runs are append-only, DELETE refused'); END;
CREATE TRIGGER meta_no_update BEFORE UPDATE ON meta
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: meta is read-only, UPDATE refused'); END;
CREATE TRIGGER meta_no_delete BEFORE DELETE ON meta
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: meta is read-only, DELETE refused'); END;
PRAGMA application_id = {LEDGER_APPLICATION_ID};
PRAGMA user_version = {SCHEMA_VERSION};
"""
TABLES: Final = frozenset({"meta", "runs", "events"})
TRIGGERS: Final = frozenset(
    {
        "events_no_update",
        "events_no_delete",
        "runs_no_update",
        "runs_no_delete",
        "meta_no_update",
        "meta_no_delete",
    }
)
EVENT_COLUMNS: Final = (
    "run_id",
    "round",
    "site_id",
    "mechanism",
    "adjacency",
    "sampling",
    "sigma",
    "q",
    "steps",
    "delta",
    "epsilon_cap",
    "recorded_at",
    "confirmed",
    "params_known",
    "rng",
    "code",
    "unit",
    "honest_sites",
    "share_sigma",
)
"""The stored columns of an event, ``id`` aside."""
EVENT_SELECT: Final = ", ".join(("id", *EVENT_COLUMNS))
"""SQL select list of a stored event row: ``id``, then ``EVENT_COLUMNS``."""


def event_from_row(row: Sequence[Any]) -> LedgerEvent:
    """The event of a row of ``EVENT_COLUMNS``."""
    values = dict(zip(EVENT_COLUMNS, row, strict=True))
    for name in ("confirmed", "params_known"):
        if values[name] not in (0, 1):
            raise InvalidEventError(f"{name}={values[name]!r} must be 0 or 1")
    try:
        event = PrivacyEvent.from_columns(values)
    except PrivacyParameterError as exc:
        raise InvalidEventError(f"stored event of site {values['site_id']!r}: {exc}") from exc
    return LedgerEvent(
        run_id=values["run_id"],
        round=int(values["round"]),
        site_id=values["site_id"],
        event=event,
        delta=float(values["delta"]),
        epsilon_cap=None if values["epsilon_cap"] is None else float(values["epsilon_cap"]),
        recorded_at=values["recorded_at"],
        confirmed=bool(values["confirmed"]),
        params_known=bool(values["params_known"]),
        rng=values["rng"],
        code=values["code"],
    )


def create_ledger(path: Path) -> None:
    """Build an empty ledger in a temporary file and link it to ``path`` (no clobbering)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("BEGIN IMMEDIATE")
            for statement in statements(_SCHEMA):
                conn.execute(statement)
            conn.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)",
                [
                    ("application", APPLICATION),
                    ("schema_version", str(SCHEMA_VERSION)),
                    ("created_at", now()),
                ],
            )
            conn.execute("COMMIT")
        finally:
            conn.close()
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic; fails if another process created the ledger meanwhile
        except FileExistsError:
            log.info("ledger %s was created concurrently; using that one", path)
        fsync_dir(path.parent)
    except (OSError, sqlite3.Error) as exc:
        raise LedgerError(f"ledger {path}: cannot create it ({exc}).") from exc
    finally:
        for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # none was made
                p.unlink()


def statements(script: str) -> list[str]:
    """Split the schema into statements (triggers contain ``;`` inside BEGIN ... END)."""
    out: list[str] = []
    buf = ""
    for line in script.strip().splitlines():
        buf += line + "\n"
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    return out
