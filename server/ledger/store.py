"""The ledger: one SQLite file, opened after its checks, written in one transaction per append.

See ``server.ledger`` for the file layout and the rules of confirmed and unconfirmed charges.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from prism_core.accounting import EpsilonReport, PrivacyEvent, history_unit
from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import SKELLAM_MECHANISM, SkellamShare
from prism_runtime.faults import NO_FAULTS, Faults
from server.errors import InvalidEventError, LedgerConflictError, LedgerError
from server.ledger.budget import (
    history_collusion_epsilon,
    history_epsilon,
    within_cap,
)
from server.ledger.checks import connect
from server.ledger.events import LedgerEvent, RunRecord, now, validate_event
from server.ledger.schema import EVENT_COLUMNS, EVENT_SELECT, event_from_row

__all__ = ["Ledger"]

log = logging.getLogger("server.ledger")


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
        faults: Faults = NO_FAULTS,
    ) -> None:
        self._conn = conn
        self._faults = faults
        self._path = path
        self._read_only = read_only
        self._lock = threading.RLock()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        read_only: bool = False,
        faults: Faults = NO_FAULTS,
    ) -> Self:
        """Open the ledger at ``path``, creating an empty one if it is missing and ``create``.

        An existing file is first checked without writing anything: its SQLite header (the
        ``application_id``), then, on a read-only connection, its integrity, ``meta`` table,
        schema version (``SCHEMA_VERSION``), tables, triggers and rows. Only a file that passes
        is opened for writing.

        Args:
            path: the ledger file.
            create: create a new ledger if ``path`` does not exist.
            read_only: open without write access (for reports); appends raise LedgerError.
                SQLite may leave ``-wal``/``-shm`` files beside the ledger: it needs them to
                read a WAL database while a server may be writing it.
            faults: the ``ledger-write`` crash point for tests (inside a write transaction).

        Raises:
            LedgerError: missing file with ``create=False`` (or ``read_only``); an empty,
                truncated, corrupt or foreign file (it is left byte-for-byte unchanged); a
                ledger of another schema version.
        """
        p = Path(path)
        conn = connect(p, create=create, read_only=read_only)
        return cls(conn, p, read_only=read_only, faults=faults)

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
            f"SELECT {', '.join(EVENT_COLUMNS)} FROM events "
            f"WHERE run_id = ? AND round = ? AND site_id = ? AND confirmed = ?{mechanism}",
            params if any_mechanism else (*params, event.mechanism),
        ).fetchone()
        return None if row is None else event_from_row(row)

    def _insert(self, conn: sqlite3.Connection, event: LedgerEvent) -> bool:
        if not isinstance(event, LedgerEvent):
            raise InvalidEventError(f"expected a LedgerEvent, found {type(event).__name__}")
        validate_event(event)  # again: a frozen dataclass can still be altered by force
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
        row = {c: getattr(event, c) for c in EVENT_COLUMNS}
        row["recorded_at"] = now()
        row["confirmed"], row["params_known"] = int(event.confirmed), int(event.params_known)
        names = ", ".join(EVENT_COLUMNS)
        marks = ", ".join(f":{c}" for c in EVENT_COLUMNS)
        try:
            cur = conn.execute(
                f"INSERT INTO events ({names}) VALUES ({marks}) "
                "ON CONFLICT (run_id, round, site_id, mechanism, confirmed) DO NOTHING",
                row,
            )
        except sqlite3.IntegrityError as exc:
            raise InvalidEventError(f"ledger {self._path}: event refused ({exc}).") from exc
        if cur.rowcount == 1:
            self._faults.reach("ledger-write", event.round)  # inside the transaction
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
                (run_id, now(), config_json),
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
            f"WITH ev AS (SELECT {EVENT_SELECT} FROM events) "
            f"SELECT {', '.join(f'e.{c}' for c in EVENT_COLUMNS)} FROM ev e "
            f"WHERE (e.confirmed = 1 OR NOT EXISTS "
            f"(SELECT 1 FROM ev f WHERE f.confirmed = 1 AND {same})){clause} "
            f"ORDER BY (SELECT min(f.id) FROM ev f WHERE {same}), e.id",
            params,
        )
        return [event_from_row(r) for r in rows]

    def records(self, site_id: str | None = None, run_id: str | None = None) -> list[LedgerEvent]:
        """Every stored event, superseded unconfirmed ones included, in insertion order."""
        clause, params = self._where(site_id, run_id)
        rows = self._query(
            f"WITH ev AS (SELECT {EVENT_SELECT} FROM events) "
            f"SELECT {', '.join(f'e.{c}' for c in EVENT_COLUMNS)} FROM ev e "
            f"WHERE 1{clause} ORDER BY e.id",
            params,
        )
        return [event_from_row(r) for r in rows]

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
            prism_core.errors.AccountingError: a history that cannot be accounted (privacy
                units mixed).
        """
        events = self.events(site_id=site_id)
        d = self.site_delta(site_id) if delta is None and events else delta
        if d is None:
            raise LedgerError(
                f"ledger {self._path}: no events of site {site_id!r}; pass delta to get 0."
            )
        return history_epsilon(events, d)

    def collusion_epsilon(self, site_id: str, *, delta: float | None = None) -> float:
        """Epsilon of one site if every other site colluded with the coordinator, recomputed
        from all its events (``budget.history_collusion_epsilon``: a secure-aggregation event
        counts at the sigma of the site's own noise share), at ``delta`` or, as ``epsilon``,
        the site's smallest delta.

        Raises:
            LedgerError: the site has no events and no ``delta`` was given.
            prism_core.errors.AccountingError: an event that cannot be accounted.
        """
        events = self.events(site_id=site_id)
        d = self.site_delta(site_id) if delta is None and events else delta
        if d is None:
            raise LedgerError(
                f"ledger {self._path}: no events of site {site_id!r}; pass delta to get 0."
            )
        return history_collusion_epsilon(events, d)

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

        Composes the site's whole history plus the new steps (of the history's privacy unit,
        ``prism_core.accounting.history_unit``) with the PRV accountant at ``delta`` and
        compares with ``epsilon_cap``. A history that cannot be accounted (privacy units
        mixed) answers False, with a warning: its privacy loss is unknown.

        Args:
            before: ``(run_id, round)``: leave out that run's events of that round and later.
                A coordinator that re-runs an interrupted round asks as it did the first time,
                before that round's events were written (they are the same round, not a new one).

        Raises:
            prism_core.errors.PrivacyParameterError: sigma, q, steps or delta out of range.
        """
        events = self.events(site_id=site_id)
        if before is not None:
            run_id, first = before
            events = [e for e in events if e.run_id != run_id or e.round < first]
        new = PrivacyEvent(sigma, q, steps, unit=history_unit([e.event for e in events]))
        last = events[-1].event if events else None
        if last is not None and last.mechanism == SKELLAM_MECHANISM:  # accounted as its kind
            part = last.secure
            share = SkellamShare(part.honest_sites, min(part.share_sigma, sigma)) if part else None
            new = replace(last, noise_multiplier=sigma, sample_rate=q, steps=steps, secure=share)
        return within_cap(events, new, epsilon_cap=epsilon_cap, delta=delta, site_id=site_id)
