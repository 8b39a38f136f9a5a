"""Opening checks: a file is validated read-only before anything writes to it, and a file that
is not a prism-fl ledger (empty, truncated, corrupt, foreign, altered) is never touched."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Final

from server.errors import InvalidEventError, LedgerError
from server.ledger.schema import (
    APPLICATION,
    BUSY_TIMEOUT_S,
    EVENT_COLUMNS,
    EVENT_SELECT,
    LEDGER_APPLICATION_ID,
    SCHEMA_VERSION,
    TABLES,
    TRIGGERS,
    create_ledger,
    event_from_row,
)

__all__ = ["check_header", "connect", "validate_ledger"]

log = logging.getLogger("server.ledger")

SQLITE_MAGIC: Final = b"SQLite format 3\x00"
HEADER_SIZE: Final = 100


def check_header(path: Path) -> None:
    """Refuse, from its first bytes alone, a file that is not a prism-fl ledger."""
    try:
        with path.open("rb") as f:
            header = f.read(HEADER_SIZE)
        size = path.stat().st_size
    except OSError as exc:
        raise LedgerError(f"ledger {path}: cannot read it ({exc}).") from exc
    if size == 0:
        raise LedgerError(
            f"ledger {path}: the file is empty (0 bytes), not a prism-fl ledger. Point to the "
            "real ledger, or delete the empty file to start a new one."
        )
    if not header.startswith(SQLITE_MAGIC):
        raise LedgerError(
            f"ledger {path}: not an SQLite database (first bytes {header[:16]!r}), so not a "
            "prism-fl ledger. Check the path; the file was not modified."
        )
    if len(header) < HEADER_SIZE:
        raise LedgerError(
            f"ledger {path}: truncated SQLite file ({size} bytes, shorter than its 100-byte "
            "header). Restore the ledger from a backup; the file was not modified."
        )
    app_id = int.from_bytes(header[68:72], "big")
    if app_id != LEDGER_APPLICATION_ID:
        raise LedgerError(
            f"ledger {path}: an SQLite database with application_id {app_id:#x} and tables "
            f"{table_names(path)}, not a prism-fl ledger (application_id "
            f"{LEDGER_APPLICATION_ID:#x}). Check the path; the file was not modified."
        )
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or size % page_size:
        raise LedgerError(
            f"ledger {path}: truncated or corrupt ({size} bytes is not a whole number of "
            f"{page_size}-byte pages). Restore the ledger from a backup; the file was not modified."
        )


def table_names(path: Path) -> list[str] | str:
    """Tables of a foreign SQLite file, read without locks or side files (for messages only)."""
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
        try:
            rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return f"(unreadable: {exc})"
    return sorted(str(r[0]) for r in rows)


def validate_ledger(conn: sqlite3.Connection, path: Path) -> None:
    """Check integrity, meta, schema version, tables, triggers and rows of an open ledger.

    Raises:
        LedgerError: what is wrong, and what to do.
    """
    try:
        check = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
        objects = conn.execute("SELECT type, name FROM sqlite_master").fetchall()
        tables = {str(n) for t, n in objects if t == "table"}
        triggers = {str(n) for t, n in objects if t == "trigger"}
        meta: dict[str, str] = {}
        if "meta" in tables:
            meta = {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}
    except sqlite3.DatabaseError as exc:
        raise LedgerError(
            f"ledger {path}: corrupt SQLite file ({exc}). Restore it from a backup; the file "
            "was not modified."
        ) from exc
    if check != ["ok"]:
        raise LedgerError(
            f"ledger {path}: integrity check failed ({'; '.join(check[:3])}). Restore it from a "
            "backup; the file was not modified."
        )
    if meta.get("application") != APPLICATION:
        raise LedgerError(
            f"ledger {path}: meta.application is {meta.get('application')!r} (tables "
            f"{sorted(tables)}), expected {APPLICATION!r}; not a prism-fl ledger."
        )
    version = meta.get("schema_version")
    if version != str(SCHEMA_VERSION):
        raise LedgerError(
            f"ledger {path}: schema version {version!r}, this prism-fl reads schema version "
            f"{SCHEMA_VERSION} only. Open it with the prism-fl release that wrote it, or point "
            "to another ledger file; the file was not modified."
        )
    missing = sorted((TABLES - tables) | (TRIGGERS - triggers))
    if not missing:  # (a missing events table is named as such, not as all its columns)
        found = {str(r[1]) for r in conn.execute("PRAGMA table_info(events)")}
        missing = sorted(f"events.{c}" for c in {"id", *EVENT_COLUMNS} - found)
    if missing:
        raise LedgerError(
            f"ledger {path}: tables, columns or append-only triggers missing: {missing}. The "
            "ledger was altered outside prism-fl; restore it from a backup."
        )
    validate_rows(conn, path)


def validate_rows(conn: sqlite3.Connection, path: Path) -> None:
    """Every stored event must be a valid ``LedgerEvent`` with the column types it was written with.

    SQLite does not re-check CHECK constraints or column types on read, so a row edited outside
    prism-fl (e.g. with ``ignore_check_constraints``) would otherwise be accounted as found. A
    consistent edit to in-range values by someone with write access is NOT detectable here (no
    MAC over the rows); protect the file with permissions and backups.
    """
    text, number, integer = {"text"}, {"integer", "real"}, {"integer"}
    kinds = dict.fromkeys(EVENT_COLUMNS, text)
    kinds.update(round=integer, steps=integer, sigma=number, q=number, delta=number)
    kinds.update(confirmed=integer, params_known=integer)
    kinds["epsilon_cap"] = number | {"null"}
    kinds["rng"] = text | {"null"}
    kinds["honest_sites"] = integer | {"null"}
    kinds["share_sigma"] = number | {"null"}
    types = ", ".join(f"typeof({c})" for c in EVENT_COLUMNS)
    n = len(EVENT_COLUMNS)
    row_id: object = "?"
    try:
        for row in conn.execute(f"SELECT {EVENT_SELECT}, {types} FROM events"):
            row_id = row[0]
            found = dict(zip(EVENT_COLUMNS, row[1 + n :], strict=True))
            wrong = {c: t for c, t in found.items() if t not in kinds[c]}
            if wrong:
                raise InvalidEventError(f"column types {wrong}")
            event_from_row(row[1 : 1 + n])
    except (InvalidEventError, ValueError, TypeError, sqlite3.DatabaseError) as exc:
        raise LedgerError(
            f"ledger {path}: event row {row_id} is invalid ({exc}); the ledger was altered "
            "outside prism-fl. Restore it from a backup; the file was not modified."
        ) from exc


def connect(p: Path, *, create: bool, read_only: bool) -> sqlite3.Connection:
    """The connection ``Ledger.open`` wraps.

    Creates a missing file (``create``, not ``read_only``); checks an existing one without
    writing (header, then integrity, meta, schema version, tables, triggers and rows on a
    read-only connection); opens it for writing only if it passes.

    Raises:
        LedgerError: what is wrong with the file, and what to do; the file is left unchanged.
    """
    if not p.exists():
        if not create or read_only:
            raise LedgerError(
                f"ledger {p}: no such file. Check the path, or let the server create it."
            )
        create_ledger(p)
    elif p.is_dir():
        raise LedgerError(f"ledger {p}: is a directory, expected a prism-fl ledger file.")
    check_header(p)
    # Without a WAL file every committed page is in the main file and nothing is being
    # written, so read it as immutable: no locks and no -wal/-shm files left beside a
    # rejected file. With one, a read-only connection reads the WAL too.
    wal = Path(f"{p}-wal")
    mode = "ro" if wal.exists() and wal.stat().st_size > 0 else "ro&immutable=1"
    try:
        ro = sqlite3.connect(f"{p.resolve().as_uri()}?mode={mode}", uri=True)
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {p}: cannot open it read-only ({exc}).") from exc
    try:
        validate_ledger(ro, p)
    finally:
        ro.close()
    if read_only:
        return sqlite3.connect(
            f"{p.resolve().as_uri()}?mode=ro",
            uri=True,
            isolation_level=None,
            check_same_thread=False,
            timeout=BUSY_TIMEOUT_S,
        )
    conn = sqlite3.connect(p, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
    try:
        mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        conn.execute("PRAGMA synchronous = FULL")
    except sqlite3.Error as exc:
        conn.close()
        raise LedgerError(f"ledger {p}: cannot open it for writing ({exc}).") from exc
    if mode.lower() != "wal":
        log.warning("ledger %s: WAL journal unavailable, using %s", p, mode)
    return conn
