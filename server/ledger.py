"""The coordinator's durable, append-only privacy ledger (DESIGN.md §3, STYLE.md habit 2).

One SQLite file holds every accounting fact the server configured and the sites reported: per
site and round, the mechanism, neighbouring relation, sampling method, sigma, q, steps and delta
(and the site's epsilon cap). Epsilon is never stored: ``Ledger.epsilon`` recomputes it from the
site's whole history with ``prism_core.accounting`` (PRV, with the RDP cross-check) every time.

File layout (schema version 3):

- ``meta(key, value)``: ``application = "prism-fl-ledger"``, ``schema_version = "3"``,
  ``created_at`` (and ``migrated_from_<v>_at`` on a migrated file); the SQLite header also carries
  ``application_id = LEDGER_APPLICATION_ID`` and ``user_version = SCHEMA_VERSION``, so a foreign
  file is recognised from its first 100 bytes.
- ``events``: append-only (TRIGGERs abort any UPDATE or DELETE). Each row is a charge, either
  *confirmed* (``confirmed = 1``: the site's own accounting facts, cross-checked by the
  coordinator) or *unconfirmed* (``confirmed = 0``: a site that was asked to run a round and gave
  no valid answer, an error reply, a time-out, facts that do not match the configuration; it may
  have charged itself, so the coordinator charges it at the site's last confirmed parameters, or
  with ``params_known = 0`` and sigma 0, i.e. epsilon infinite, when it has none). ``code`` says
  why a charge is unconfirmed (a coordinator code, never site text); ``rng`` is the site's
  ``rng`` fact (``os-csprng`` or ``reproducible``; NULL when not known).
  ``UNIQUE (run_id, round, site_id, mechanism, confirmed)``: at most one confirmed and one
  unconfirmed row per (run, round, site, mechanism), so a replayed record is never counted twice,
  and a round can hold a training row and the row of a private clip estimate
  (``prism_core.quantile.QUANTILE_MECHANISM``) charged in the same round. A confirmed row
  *supersedes* every unconfirmed row of the same (run, round, site), whatever its mechanism (a
  valid reply states everything the site charged that round): ``Ledger.events`` (the history
  every epsilon is computed from) leaves the superseded rows out; ``Ledger.records`` shows all.
- ``runs(run_id, started_at, config_json)``: one row per federated run, append-only too.

Schema versions 1 (before unconfirmed charges and the rng fact) and 2 (one row per (run, round,
site, confirmed), before the private clip estimate) are still read: opened for writing they are
migrated in place, in one transaction (every row kept; a version-1 row as confirmed with rng
unknown); opened read-only they are read as they are.

Durability: WAL journal, ``synchronous = FULL`` (a committed append survives power loss), every
write in one ``BEGIN IMMEDIATE`` transaction. A new ledger is built in a temporary file and
linked into place, so a half-initialised ledger never appears under the real name.

The triggers guard against accidents (a stray ``DELETE``), not against someone with write access
to the file, who can drop them; the trust model is in the README.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from client.protocol import RNG_MODES
from client.testhooks import pause_point
from prism_core.accounting import EpsilonReport, PrivacyEvent, epsilon, epsilon_report
from prism_core.errors import AccountingError
from prism_core.mechanism import ADJACENCY
from prism_core.quantile import QUANTILE_MECHANISM
from server.errors import InvalidEventError, LedgerConflictError, LedgerError

__all__ = [
    "APPLICATION",
    "LEDGER_APPLICATION_ID",
    "OLD_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "UNKNOWN_Q",
    "UNKNOWN_SIGMA",
    "Ledger",
    "LedgerEvent",
    "RunRecord",
    "epsilon_points",
    "epsilon_series",
]

log = logging.getLogger(__name__)

APPLICATION: Final = "prism-fl-ledger"
"""Value of ``meta.application`` in every prism-fl ledger."""
SCHEMA_VERSION: Final = 3
"""Schema version written by this module (versions 1 and 2 are still read, and migrated on
write)."""
OLD_SCHEMA_VERSIONS: Final = (1, 2)
"""Older schema versions this module reads (read-only) and migrates (opened for writing)."""
LEDGER_APPLICATION_ID: Final = 0x50524C47  # "PRLG"
"""``PRAGMA application_id`` of a prism-fl ledger (bytes 68-71 of the SQLite header)."""

SQLITE_MAGIC: Final = b"SQLite format 3\x00"
HEADER_SIZE: Final = 100
BUSY_TIMEOUT_S: Final = 30.0
DEFAULT_MECHANISM: Final = "prism-tangent-gaussian"
UNKNOWN_SIGMA: Final = 0.0
UNKNOWN_Q: Final = 1.0
"""How an unconfirmed charge with unknown parameters is accounted: no noise, every record used
(epsilon infinite, the worst case)."""
_CODE_PATTERN: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")

_EVENTS_BODY: Final = """
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
    CHECK (confirmed = 0 OR (params_known = 1 AND code = '')),
    CHECK (params_known = 1 OR (sigma = 0 AND q = 1)),
    UNIQUE (run_id, round, site_id, mechanism, confirmed)""".strip("\n")
_EVENTS_EXTRAS: Final = """
CREATE INDEX events_by_site ON events (site_id, id);
CREATE TRIGGER events_no_update BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: events are append-only, UPDATE refused'); END;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: events are append-only, DELETE refused'); END;
""".strip()
_META_NO_UPDATE: Final = """
CREATE TRIGGER meta_no_update BEFORE UPDATE ON meta
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: meta is read-only, UPDATE refused'); END;
""".strip()

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
{_EVENTS_BODY}
);
{_EVENTS_EXTRAS}
CREATE TRIGGER runs_no_update BEFORE UPDATE ON runs
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: runs are append-only, UPDATE refused'); END;
CREATE TRIGGER runs_no_delete BEFORE DELETE ON runs
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: runs are append-only, DELETE refused'); END;
{_META_NO_UPDATE}
CREATE TRIGGER meta_no_delete BEFORE DELETE ON meta
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: meta is read-only, DELETE refused'); END;
PRAGMA application_id = {LEDGER_APPLICATION_ID};
PRAGMA user_version = {SCHEMA_VERSION};
"""
_TABLES: Final = frozenset({"meta", "runs", "events"})
_TRIGGERS: Final = frozenset(
    {
        "events_no_update",
        "events_no_delete",
        "runs_no_update",
        "runs_no_delete",
        "meta_no_update",
        "meta_no_delete",
    }
)
_V1_COLUMNS: Final = (
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
)
_V2_DEFAULTS: Final[dict[str, str]] = {
    "confirmed": "1",
    "params_known": "1",
    "rng": "NULL",
    "code": "''",
}
"""Columns added by schema version 2, with the value a version-1 row reads as."""
_EVENT_COLUMNS: Final = (*_V1_COLUMNS, *_V2_DEFAULTS)


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LedgerEvent:
    """What one site ran in one round of one run: the facts the accountant needs.

    Attributes:
        run_id: the federated run.
        round: server round, ``>= 0``.
        site_id: the site, non-empty.
        sigma: noise multiplier of every step, ``>= 0`` (0 means no privacy: epsilon is inf).
        q: Poisson sampling rate, in ``(0, 1]``.
        steps: local DP steps run this round, ``>= 0``.
        delta: the site's delta, in ``(0, 1)``.
        epsilon_cap: the site's epsilon budget, ``> 0``, or None for no cap.
        mechanism: the mechanism that ran (``NoiseRecord.mechanism``).
        adjacency: the neighbouring relation, ``"add-remove"`` for every mechanism here.
        sampling: how batches were drawn; only ``"poisson"`` can be accounted.
        recorded_at: UTC ISO-8601 time the ledger stored the event; set by the ledger (a value
            given to ``Ledger.append`` is ignored).
        confirmed: True for the site's own (cross-checked) facts; False for a charge the
            coordinator records because the site was asked and gave no valid answer.
        params_known: False only for an unconfirmed charge of a site with no confirmed
            parameters: it is accounted with ``UNKNOWN_SIGMA``/``UNKNOWN_Q`` (epsilon inf).
        rng: the site's ``rng`` fact (``client.protocol.RNG_MODES``), None when not known.
        code: why a charge is unconfirmed (the coordinator's code, e.g. ``no-reply``); empty
            for a confirmed one.

    Raises:
        InvalidEventError: on construction, for a value out of its range.
    """

    run_id: str
    round: int
    site_id: str
    sigma: float
    q: float
    steps: int
    delta: float
    epsilon_cap: float | None = None
    mechanism: str = DEFAULT_MECHANISM
    adjacency: str = ADJACENCY
    sampling: str = "poisson"
    recorded_at: str | None = None
    confirmed: bool = True
    params_known: bool = True
    rng: str | None = None
    code: str = ""

    def __post_init__(self) -> None:
        _validate_event(self)

    def privacy_event(self) -> PrivacyEvent:
        """The accountant's view of this event."""
        return PrivacyEvent(self.sigma, self.q, self.steps, self.sampling, self.adjacency)

    def same_facts(self, other: LedgerEvent) -> bool:
        """Equal in every field but ``recorded_at``."""
        return all(
            getattr(self, f.name) == getattr(other, f.name)
            for f in fields(self)
            if f.name != "recorded_at"
        )


@dataclass(frozen=True)
class RunRecord:
    """One federated run: its id, when it was recorded and its configuration."""

    run_id: str
    started_at: str
    config: dict[str, Any]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and not math.isnan(x)


def _validate_event(e: LedgerEvent) -> None:
    """Raise InvalidEventError naming every out-of-range field of ``e``."""
    problems = []
    for name in ("run_id", "site_id", "mechanism", "adjacency", "sampling"):
        value = getattr(e, name)
        if not isinstance(value, str) or not value.strip():
            problems.append(f"{name}={value!r} must be a non-empty string")
    if not (_is_int(e.round) and e.round >= 0):
        problems.append(f"round={e.round!r} must be an integer >= 0")
    if not (_is_real(e.sigma) and 0 <= e.sigma < math.inf):
        problems.append(f"sigma={e.sigma!r} must be a finite number >= 0")
    if not (_is_real(e.q) and 0 < e.q <= 1):
        problems.append(f"q={e.q!r} must be in (0, 1]")
    if not (_is_int(e.steps) and e.steps >= 0):
        problems.append(f"steps={e.steps!r} must be an integer >= 0")
    if not (_is_real(e.delta) and 0 < e.delta < 1):
        problems.append(f"delta={e.delta!r} must be in (0, 1)")
    if e.epsilon_cap is not None and not (_is_real(e.epsilon_cap) and 0 < e.epsilon_cap < math.inf):
        problems.append(f"epsilon_cap={e.epsilon_cap!r} must be a finite number > 0 or None")
    problems += _status_problems(e)
    if problems:
        who = f"site {e.site_id!r}, run {e.run_id!r}, round {e.round!r}"
        raise InvalidEventError(f"invalid ledger event ({who}): " + "; ".join(problems))


def _status_problems(e: LedgerEvent) -> list[str]:
    """What is wrong with the confirmation fields of ``e`` (see ``LedgerEvent``)."""
    problems = []
    for name in ("confirmed", "params_known"):
        if not isinstance(getattr(e, name), bool):
            problems.append(f"{name}={getattr(e, name)!r} must be a bool")
    if e.rng is not None and e.rng not in RNG_MODES:
        problems.append(f"rng={e.rng!r} must be one of {list(RNG_MODES)} or None")
    if not isinstance(e.code, str) or (e.code and not _CODE_PATTERN.fullmatch(e.code)):
        problems.append(f"code={e.code!r} must be empty or a short lower-case code")
    if e.confirmed and (e.code or not e.params_known):
        problems.append("a confirmed event has known parameters and no code")
    if not e.confirmed and not e.code:
        problems.append("an unconfirmed event needs a code saying why")
    if not e.params_known and (e.sigma != UNKNOWN_SIGMA or e.q != UNKNOWN_Q):
        problems.append(
            f"unknown parameters are recorded as sigma={UNKNOWN_SIGMA}, q={UNKNOWN_Q} "
            f"(found sigma={e.sigma!r}, q={e.q!r})"
        )
    return problems


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _event_from_row(row: Sequence[Any]) -> LedgerEvent:
    """The event of a row of ``_EVENT_COLUMNS`` (a version-1 row reads with the defaults)."""
    values = dict(zip(_EVENT_COLUMNS, row, strict=True))
    for name in ("confirmed", "params_known"):
        if values[name] not in (0, 1):
            raise InvalidEventError(f"{name}={values[name]!r} must be 0 or 1")
    return LedgerEvent(
        run_id=values["run_id"],
        round=int(values["round"]),
        site_id=values["site_id"],
        sigma=float(values["sigma"]),
        q=float(values["q"]),
        steps=int(values["steps"]),
        delta=float(values["delta"]),
        epsilon_cap=None if values["epsilon_cap"] is None else float(values["epsilon_cap"]),
        mechanism=values["mechanism"],
        adjacency=values["adjacency"],
        sampling=values["sampling"],
        recorded_at=values["recorded_at"],
        confirmed=bool(values["confirmed"]),
        params_known=bool(values["params_known"]),
        rng=values["rng"],
        code=values["code"],
    )


def epsilon_points(events: Sequence[LedgerEvent], delta: float) -> list[tuple[str, int, float]]:
    """``(run_id, round, PRV epsilon so far)`` after each round that ran steps > 0.

    The events are composed in the given order (one site's history, in ledger order); the
    consecutive events of one (run, round), e.g. a private clip estimate and the training
    steps charged in the same round, give one point, after the last of them.
    """
    out: list[tuple[str, int, float]] = []
    history: list[PrivacyEvent] = []
    ran = False  # the current (run, round) ran steps
    for index, e in enumerate(events):
        history.append(e.privacy_event())
        ran = ran or e.steps > 0
        following = events[index + 1] if index + 1 < len(events) else None
        if following is None or (following.run_id, following.round) != (e.run_id, e.round):
            if ran:
                out.append((e.run_id, e.round, epsilon(history, delta)))
            ran = False
    return out


def epsilon_series(events: Sequence[LedgerEvent], delta: float) -> list[tuple[int, float]]:
    """``(round, PRV epsilon)`` of ``epsilon_points``: after each round that ran steps > 0."""
    return [(rnd, eps) for _, rnd, eps in epsilon_points(events, delta)]


# --------------------------------------------------------------------------------------------
# Opening: validate read-only, never touch a file that is not a ledger
# --------------------------------------------------------------------------------------------


def _check_header(path: Path) -> None:
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
            f"{_table_names(path)}, not a prism-fl ledger (application_id "
            f"{LEDGER_APPLICATION_ID:#x}). Check the path; the file was not modified."
        )
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or size % page_size:
        raise LedgerError(
            f"ledger {path}: truncated or corrupt ({size} bytes is not a whole number of "
            f"{page_size}-byte pages). Restore the ledger from a backup; the file was not modified."
        )


def _table_names(path: Path) -> list[str] | str:
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


def _validate_ledger(conn: sqlite3.Connection, path: Path) -> int:
    """Check integrity, meta, tables and triggers of an open ledger; return its schema version.

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
    readable = [str(v) for v in (*OLD_SCHEMA_VERSIONS, SCHEMA_VERSION)]
    if version not in readable:
        raise LedgerError(
            f"ledger {path}: schema version {version!r}, this prism-fl reads versions "
            f"{', '.join(readable)}. Use the prism-fl release that wrote it."
        )
    missing = sorted((_TABLES - tables) | (_TRIGGERS - triggers))
    if missing:
        raise LedgerError(
            f"ledger {path}: tables or append-only triggers missing: {missing}. The ledger was "
            "altered outside prism-fl; restore it from a backup."
        )
    _validate_rows(conn, path, int(version))
    return int(version)


def _columns(version: int) -> tuple[str, ...]:
    """The event columns stored by a schema version (version 3 changed only the UNIQUE key)."""
    return _V1_COLUMNS if version == 1 else _EVENT_COLUMNS


def _event_select(version: int) -> str:
    """SQL select list giving ``_EVENT_COLUMNS`` of a stored row of ``version`` (with ``id``)."""
    stored = _columns(version)
    return ", ".join(
        ["id", *(c if c in stored else f"{_V2_DEFAULTS[c]} AS {c}" for c in _EVENT_COLUMNS)]
    )


def _validate_rows(conn: sqlite3.Connection, path: Path, version: int) -> None:
    """Every stored event must be a valid ``LedgerEvent`` with the column types it was written with.

    SQLite does not re-check CHECK constraints or column types on read, so a row edited outside
    prism-fl (e.g. with ``ignore_check_constraints``) would otherwise be accounted as found. A
    consistent edit to in-range values by someone with write access is NOT detectable here (no
    MAC over the rows); protect the file with permissions and backups.
    """
    text, number, integer = {"text"}, {"integer", "real"}, {"integer"}
    kinds = dict.fromkeys(_EVENT_COLUMNS, text)
    kinds.update(round=integer, steps=integer, sigma=number, q=number, delta=number)
    kinds.update(confirmed=integer, params_known=integer)
    kinds["epsilon_cap"] = number | {"null"}
    kinds["rng"] = text | {"null"}
    stored = _columns(version)
    types = ", ".join(f"typeof({c})" for c in stored)
    n = len(_EVENT_COLUMNS)
    row_id: object = "?"
    try:
        for row in conn.execute(f"SELECT {_event_select(version)}, {types} FROM events"):
            row_id = row[0]
            found = dict(zip(stored, row[1 + n :], strict=True))
            wrong = {c: t for c, t in found.items() if t not in kinds[c]}
            if wrong:
                raise InvalidEventError(f"column types {wrong}")
            _event_from_row(row[1 : 1 + n])
    except (InvalidEventError, ValueError, TypeError, sqlite3.DatabaseError) as exc:
        raise LedgerError(
            f"ledger {path}: event row {row_id} is invalid ({exc}); the ledger was altered "
            "outside prism-fl. Restore it from a backup; the file was not modified."
        ) from exc


def _create(path: Path) -> None:
    """Build an empty ledger in a temporary file and link it to ``path`` (no clobbering)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("BEGIN IMMEDIATE")
            for statement in _statements(_SCHEMA):
                conn.execute(statement)
            conn.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)",
                [
                    ("application", APPLICATION),
                    ("schema_version", str(SCHEMA_VERSION)),
                    ("created_at", _now()),
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
        _fsync_dir(path.parent)
    except (OSError, sqlite3.Error) as exc:
        raise LedgerError(f"ledger {path}: cannot create it ({exc}).") from exc
    finally:
        for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def _statements(script: str) -> list[str]:
    """Split the schema into statements (triggers contain ``;`` inside BEGIN ... END)."""
    out: list[str] = []
    buf = ""
    for line in script.strip().splitlines():
        buf += line + "\n"
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    return out


def _migrate(conn: sqlite3.Connection, path: Path) -> bool:
    """Migrate a version-1 or -2 ledger to ``SCHEMA_VERSION`` in place, in ONE transaction.

    The events table is rebuilt with the new UNIQUE key (and, from version 1, the new columns;
    SQLite cannot change a UNIQUE constraint in place): every row is copied with its id (a
    version-1 row as a confirmed charge with the rng fact unknown), then the append-only
    triggers are restored and ``meta`` records the new version and when it was migrated. A crash
    leaves the file as it was before or as it is after, never between.

    Returns:
        True if this call migrated the file, False if it already had the current version (another
        process migrated it meanwhile).
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        (version,) = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if version == str(SCHEMA_VERSION):
            conn.execute("ROLLBACK")
            return False
        (before,) = conn.execute("SELECT count(*) FROM events").fetchone()
        old = ", ".join(("id", *_columns(int(version))))
        for statement in (
            "DROP TRIGGER events_no_update",
            "DROP TRIGGER events_no_delete",
            "DROP TRIGGER meta_no_update",
            f"CREATE TABLE events_new (\n{_EVENTS_BODY}\n)",
            f"INSERT INTO events_new ({old}) SELECT {old} FROM events ORDER BY id",
            "DROP TABLE events",
            "ALTER TABLE events_new RENAME TO events",
            *_statements(_EVENTS_EXTRAS),
        ):
            conn.execute(statement)
        (after,) = conn.execute("SELECT count(*) FROM events").fetchone()
        if after != before:
            raise LedgerError(f"ledger {path}: migration copied {after} of {before} events.")
        conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
        )
        conn.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?)", (f"migrated_from_{version}_at", _now())
        )
        conn.execute(_META_NO_UPDATE)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    log.warning(
        "ledger %s: migrated from schema version %s to %d (%d events kept)",
        path,
        version,
        SCHEMA_VERSION,
        before,
    )
    return True


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not supported everywhere (e.g. some network FS)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------------
# The ledger
# --------------------------------------------------------------------------------------------


class Ledger:
    """Append-only per-site privacy ledger over one SQLite file. Open it with ``Ledger.open``.

    Thread-safe (one connection behind a lock). Use as a context manager or call ``close``.
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        *,
        read_only: bool,
        version: int = SCHEMA_VERSION,
    ) -> None:
        self._conn = conn
        self._path = path
        self._read_only = read_only
        self._version = version
        self._lock = threading.RLock()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, create: bool = True, read_only: bool = False
    ) -> Self:
        """Open the ledger at ``path``, creating an empty one if it is missing and ``create``.

        An existing file is first checked without writing anything: its SQLite header (the
        ``application_id``), then, on a read-only connection, its integrity, ``meta`` table,
        schema version, tables and triggers. Only a file that passes is opened for writing. A
        version-1 or -2 ledger opened for writing is migrated to version 3 (one transaction,
        every event kept); opened read-only it is read as it is.

        Args:
            path: the ledger file.
            create: create a new ledger if ``path`` does not exist.
            read_only: open without write access (for reports); appends raise LedgerError.
                SQLite may leave ``-wal``/``-shm`` files beside the ledger: it needs them to
                read a WAL database while a server may be writing it.

        Raises:
            LedgerError: missing file with ``create=False`` (or ``read_only``); an empty,
                truncated, corrupt or foreign file (it is left byte-for-byte unchanged); a
                ledger of another schema version.
        """
        p = Path(path)
        if not p.exists():
            if not create or read_only:
                raise LedgerError(
                    f"ledger {p}: no such file. Check the path, or let the server create it."
                )
            _create(p)
        elif p.is_dir():
            raise LedgerError(f"ledger {p}: is a directory, expected a prism-fl ledger file.")
        _check_header(p)
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
            version = _validate_ledger(ro, p)
        finally:
            ro.close()
        if read_only:
            conn = sqlite3.connect(
                f"{p.resolve().as_uri()}?mode=ro",
                uri=True,
                isolation_level=None,
                check_same_thread=False,
                timeout=BUSY_TIMEOUT_S,
            )
            return cls(conn, p, read_only=True, version=version)
        conn = sqlite3.connect(
            p, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S
        )
        try:
            mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            conn.execute("PRAGMA synchronous = FULL")
        except sqlite3.Error as exc:
            conn.close()
            raise LedgerError(f"ledger {p}: cannot open it for writing ({exc}).") from exc
        if mode.lower() != "wal":
            log.warning("ledger %s: WAL journal unavailable, using %s", p, mode)
        if version != SCHEMA_VERSION:
            try:
                _migrate(conn, p)
            except (sqlite3.Error, LedgerError) as exc:
                conn.close()
                raise LedgerError(
                    f"ledger {p}: cannot migrate it from schema version {version} to "
                    f"{SCHEMA_VERSION} ({exc}); the file was left as it was."
                ) from exc
        return cls(conn, p, read_only=False)

    @property
    def path(self) -> Path:
        """The ledger file."""
        return self._path

    def close(self) -> None:
        """Close the connection (checkpoints the WAL into the file). Idempotent."""
        with self._lock:
            if not self._closed:
                self._conn.close()
                self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- writing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed on success, rolled back on any exception."""
        with self._lock:
            if self._closed:
                raise LedgerError(f"ledger {self._path}: closed.")
            if self._read_only:
                raise LedgerError(f"ledger {self._path}: opened read-only, write refused.")
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise LedgerError(f"ledger {self._path}: cannot start a write ({exc}).") from exc
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            try:
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
                raise LedgerError(f"ledger {self._path}: commit failed ({exc}).") from exc

    def _stored(
        self,
        conn: sqlite3.Connection,
        event: LedgerEvent,
        *,
        confirmed: bool,
        any_mechanism: bool = False,
    ) -> LedgerEvent | None:
        """The stored event of ``event``'s (run, round, site, mechanism) with the given
        confirmation; with ``any_mechanism``, of its (run, round, site) with any mechanism."""
        mechanism = "" if any_mechanism else " AND mechanism = ?"
        params: tuple[Any, ...] = (event.run_id, event.round, event.site_id, int(confirmed))
        row = conn.execute(
            f"SELECT {', '.join(_EVENT_COLUMNS)} FROM events "
            f"WHERE run_id = ? AND round = ? AND site_id = ? AND confirmed = ?{mechanism}",
            params if any_mechanism else (*params, event.mechanism),
        ).fetchone()
        return None if row is None else _event_from_row(row)

    def _insert(self, conn: sqlite3.Connection, event: LedgerEvent) -> bool:
        if not isinstance(event, LedgerEvent):
            raise InvalidEventError(f"expected a LedgerEvent, found {type(event).__name__}")
        _validate_event(event)  # again: a frozen dataclass can still be altered by force
        who = (
            f"site {event.site_id!r}, run {event.run_id!r}, round {event.round}, "
            f"mechanism {event.mechanism!r}"
        )
        if (
            not event.confirmed
            and self._stored(conn, event, confirmed=True, any_mechanism=True) is not None
        ):
            log.info("ledger: %s is already confirmed; unconfirmed charge not recorded", who)
            return False
        row = {c: getattr(event, c) for c in _EVENT_COLUMNS}
        row["recorded_at"] = _now()
        row["confirmed"], row["params_known"] = int(event.confirmed), int(event.params_known)
        names = ", ".join(_EVENT_COLUMNS)
        marks = ", ".join(f":{c}" for c in _EVENT_COLUMNS)
        try:
            cur = conn.execute(
                f"INSERT INTO events ({names}) VALUES ({marks}) "
                "ON CONFLICT (run_id, round, site_id, mechanism, confirmed) DO NOTHING",
                row,
            )
        except sqlite3.IntegrityError as exc:
            raise InvalidEventError(f"ledger {self._path}: event refused ({exc}).") from exc
        if cur.rowcount == 1:
            pause_point("ledger-write", event.round)  # crash tests: inside the transaction
            superseded = self._stored(conn, event, confirmed=False, any_mechanism=True)
            if event.confirmed and superseded is not None:
                log.info("ledger: %s confirmed; its unconfirmed charge is superseded", who)
            return True
        existing = self._stored(conn, event, confirmed=event.confirmed)
        assert existing is not None  # the insert conflicted with it
        if not event.confirmed or existing.same_facts(event):
            # a re-run round records its time-out again: the first unconfirmed charge stands
            log.info("ledger: duplicate record of %s ignored", who)
            return False
        raise LedgerConflictError(
            f"ledger {self._path}: {who} already has a different record (stored {existing}, "
            f"new {event}). The stored record is kept; a site runs at most once per round. "
            "Investigate the site's replies."
        )

    def append(self, event: LedgerEvent) -> bool:
        """Durably record one event.

        Duplicates: a (run, round, site, mechanism) holds at most one confirmed and one
        unconfirmed event. Re-recording an identical confirmed event (a replayed or re-delivered
        reply) is a no-op that returns False, so it is never counted twice; a *different*
        confirmed event under the same key raises LedgerConflictError and keeps the stored one.
        An unconfirmed event is a no-op when its (run, round, site) already has a confirmed
        event (any mechanism) or its key an unconfirmed one (the first stands). A confirmed event
        recorded after unconfirmed ones of its (run, round, site) supersedes them (``events``
        then leaves them out): the charge is counted once.

        Returns:
            True if the event was written, False if it was not (see duplicates).

        Raises:
            InvalidEventError: a value out of range (nothing written).
            LedgerConflictError: a different confirmed record for the same key.
            LedgerError: a read-only or closed ledger, or a failed write.
        """
        with self._write() as conn:
            return self._insert(conn, event)

    def append_many(self, events: Iterable[LedgerEvent]) -> int:
        """Record several events in ONE transaction: all are written or none.

        Identical duplicates (of stored events or within the batch) are skipped as in ``append``;
        an invalid or conflicting event aborts the whole batch.

        Returns:
            The number of events written.
        """
        batch = list(events)
        with self._write() as conn:
            return sum(self._insert(conn, e) for e in batch)

    def record_run(self, run_id: str, config: Mapping[str, Any]) -> bool:
        """Record a federated run and its configuration (JSON).

        Returns:
            True if recorded, False if the run was already recorded with the same config.

        Raises:
            InvalidEventError: empty ``run_id`` or a config that is not JSON-serialisable.
            LedgerError: the run was already recorded with a different config (use a new id).
        """
        if not isinstance(run_id, str) or not run_id.strip():
            raise InvalidEventError(f"run_id={run_id!r} must be a non-empty string")
        try:
            config_json = json.dumps(dict(config), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidEventError(
                f"config of run {run_id!r} is not JSON-serialisable ({exc})"
            ) from exc
        with self._write() as conn:
            cur = conn.execute(
                "INSERT INTO runs (run_id, started_at, config_json) VALUES (?, ?, ?) "
                "ON CONFLICT (run_id) DO NOTHING",
                (run_id, _now(), config_json),
            )
            if cur.rowcount == 1:
                return True
            (stored,) = conn.execute(
                "SELECT config_json FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            if stored == config_json:
                return False
            raise LedgerError(
                f"ledger {self._path}: run {run_id!r} is already recorded with another config. "
                "Start a new run id for a new configuration."
            )

    # -- reading -----------------------------------------------------------------------------

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._lock:
            if self._closed:
                raise LedgerError(f"ledger {self._path}: closed.")
            try:
                return self._conn.execute(sql, params).fetchall()
            except sqlite3.DatabaseError as exc:
                raise LedgerError(f"ledger {self._path}: read failed ({exc}).") from exc

    def _where(self, site_id: str | None, run_id: str | None) -> tuple[str, list[Any]]:
        where: list[str] = []
        params: list[Any] = []
        if site_id is not None:
            where.append("e.site_id = ?")
            params.append(site_id)
        if run_id is not None:
            where.append("e.run_id = ?")
            params.append(run_id)
        return "".join(f" AND {w}" for w in where), params

    def events(self, site_id: str | None = None, run_id: str | None = None) -> list[LedgerEvent]:
        """The accounted history, optionally of one site and/or run.

        Every confirmed event, and every unconfirmed one whose (run, round, site) has no
        confirmed event: each (run, round, site) counts once. In order of the first record of
        each (run, round, site), so a later confirmation keeps its round's place.
        """
        clause, params = self._where(site_id, run_id)
        same = "f.run_id = e.run_id AND f.round = e.round AND f.site_id = e.site_id"
        rows = self._query(
            f"WITH ev AS (SELECT {_event_select(self._version)} FROM events) "
            f"SELECT {', '.join(f'e.{c}' for c in _EVENT_COLUMNS)} FROM ev e "
            f"WHERE (e.confirmed = 1 OR NOT EXISTS "
            f"(SELECT 1 FROM ev f WHERE f.confirmed = 1 AND {same})){clause} "
            f"ORDER BY (SELECT min(f.id) FROM ev f WHERE {same}), e.id",
            params,
        )
        return [_event_from_row(r) for r in rows]

    def records(self, site_id: str | None = None, run_id: str | None = None) -> list[LedgerEvent]:
        """Every stored event, superseded unconfirmed ones included, in insertion order."""
        clause, params = self._where(site_id, run_id)
        rows = self._query(
            f"WITH ev AS (SELECT {_event_select(self._version)} FROM events) "
            f"SELECT {', '.join(f'e.{c}' for c in _EVENT_COLUMNS)} FROM ev e "
            f"WHERE 1{clause} ORDER BY e.id",
            params,
        )
        return [_event_from_row(r) for r in rows]

    def last_confirmed(self, site_id: str) -> LedgerEvent | None:
        """The site's last confirmed TRAINING event that ran steps (any run), or None.

        Its parameters are the site's "last known" ones, at which the coordinator records an
        unconfirmed charge (``server.strategy``). A private clip estimate's event
        (``QUANTILE_MECHANISM``) is not a training event and is skipped.
        """
        confirmed = [
            e
            for e in self.records(site_id=site_id)
            if e.confirmed and e.steps > 0 and e.mechanism != QUANTILE_MECHANISM
        ]
        return confirmed[-1] if confirmed else None

    def sites(self) -> list[str]:
        """Sites with at least one event, in order of their first event."""
        rows = self._query("SELECT site_id FROM events GROUP BY site_id ORDER BY min(id)")
        return [str(r[0]) for r in rows]

    def runs(self) -> list[RunRecord]:
        """Runs recorded with ``record_run``, in order."""
        rows = self._query("SELECT run_id, started_at, config_json FROM runs ORDER BY rowid")
        return [RunRecord(str(r), str(s), json.loads(c)) for r, s, c in rows]

    def run_ids(self) -> list[str]:
        """Ids of recorded runs and of runs that have events, in order of first appearance."""
        ids = [r.run_id for r in self.runs()]
        rows = self._query("SELECT run_id FROM events GROUP BY run_id ORDER BY min(id)")
        ids += [str(r[0]) for r in rows if str(r[0]) not in ids]
        return ids

    # -- accounting --------------------------------------------------------------------------

    def site_delta(self, site_id: str) -> float:
        """The delta a site is accounted at: the smallest delta among its events.

        Raises:
            LedgerError: the site has no events.
        """
        events = self.events(site_id=site_id)
        if not events:
            raise LedgerError(f"ledger {self._path}: no events of site {site_id!r}.")
        return min(e.delta for e in events)

    def epsilon(self, site_id: str, *, delta: float | None = None) -> EpsilonReport:
        """Epsilon spent by one site, recomputed from all its events (PRV, RDP cross-check).

        Composes every event of the site (all runs) with ``prism_core.accounting.epsilon_report``.
        Nothing is stored or summed. If the site's events carry different deltas and ``delta``
        is not given, the SMALLEST delta is used (the strictest: the largest epsilon); the
        report's ``delta`` says which.

        Raises:
            LedgerError: the site has no events and no ``delta`` was given.
            prism_core.errors.AccountingError: an event that cannot be accounted (non-Poisson
                sampling or another adjacency).
        """
        history = [e.privacy_event() for e in self.events(site_id=site_id)]
        d = self.site_delta(site_id) if delta is None and history else delta
        if d is None:
            raise LedgerError(
                f"ledger {self._path}: no events of site {site_id!r}; pass delta to get 0."
            )
        return epsilon_report(history, d)

    def epsilon_by_round(
        self, site_id: str, *, delta: float | None = None
    ) -> list[tuple[int, float]]:
        """PRV epsilon of a site after each round it took part in (ran steps > 0), in order.

        Each value composes the site's whole history up to and including that round (all runs,
        in insertion order); ``delta`` defaults to the site's smallest delta as in ``epsilon``.
        With several runs the round numbers restart; the list stays in ledger order.
        """
        events = self.events(site_id=site_id)
        if not events:
            return []
        return epsilon_series(events, min(e.delta for e in events) if delta is None else delta)

    def can_run(
        self,
        site_id: str,
        *,
        sigma: float,
        q: float,
        steps: int,
        epsilon_cap: float,
        delta: float,
        before: tuple[str, int] | None = None,
    ) -> bool:
        """Would one more round of ``steps`` steps at (sigma, q) keep the site within its cap?

        Composes the site's whole history plus the new steps with the PRV accountant at
        ``delta`` and compares with ``epsilon_cap``. A history that cannot be accounted (e.g.
        non-Poisson sampling) answers False, with a warning: its privacy loss is unknown.

        Args:
            before: ``(run_id, round)``: leave out that run's events of that round and later.
                A coordinator that re-runs an interrupted round asks as it did the first time,
                before that round's events were written (they are the same round, not a new one).

        Raises:
            prism_core.errors.PrivacyParameterError: sigma, q, steps or delta out of range.
        """
        new = PrivacyEvent(sigma, q, steps)
        events = self.events(site_id=site_id)
        if before is not None:
            run_id, first = before
            events = [e for e in events if e.run_id != run_id or e.round < first]
        history = [e.privacy_event() for e in events]
        try:
            return epsilon([*history, new], delta) <= epsilon_cap
        except AccountingError as exc:
            log.warning("ledger: site %s cannot be accounted (%s); not selected", site_id, exc)
            return False
