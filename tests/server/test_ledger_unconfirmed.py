"""Ledger schema 2: unconfirmed charges (idempotent, superseded by a confirmation), the rng fact,
and the migration of a schema-1 ledger (built here with the old CREATE statements)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from ledger_events import ledger_event

from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.quantile import QUANTILE_MECHANISM
from server.errors import InvalidEventError, LedgerConflictError, LedgerError
from server.ledger import (
    LEDGER_APPLICATION_ID,
    SCHEMA_VERSION,
    UNKNOWN_Q,
    UNKNOWN_SIGMA,
    Ledger,
    LedgerEvent,
)

DELTA = 1e-5


def ev(rnd: int, site: str = "a", **kw: object) -> LedgerEvent:
    args: dict[str, object] = dict(
        run_id="run-1", round=rnd, site_id=site, sigma=1.0, q=0.01, steps=100, delta=DELTA
    )
    args.update(kw)
    return ledger_event(**args)


def unconfirmed(rnd: int, site: str = "a", code: str = "no-reply", **kw: object) -> LedgerEvent:
    return ev(rnd, site, confirmed=False, code=code, **kw)


@pytest.fixture
def ledger(tmp_path: Path):
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        yield led


def eps(*steps_sigma: tuple[int, float]) -> float:
    return epsilon([PrivacyEvent(sigma, 0.01, steps) for steps, sigma in steps_sigma], DELTA)


# --------------------------------------------------------------------------------------------
# Unconfirmed charges
# --------------------------------------------------------------------------------------------


def test_unconfirmed_charges_count_once_and_a_confirmation_supersedes_them(ledger: Ledger) -> None:
    assert ledger.append(ev(1, rng="os-csprng"))
    assert ledger.append(unconfirmed(2, code="error-reply-4003"))
    assert ledger.append(ev(3))
    assert ledger.epsilon("a").prv == pytest.approx(eps((300, 1.0)), rel=1e-12)  # counted
    # the same round charged again (a re-run round times out again): the first one stands
    assert not ledger.append(unconfirmed(2, code="no-reply"))
    assert not ledger.append(unconfirmed(2, code="error-reply-4003"))
    # the site's stored reply for round 2 arrives: confirmed, with other parameters
    assert ledger.append(ev(2, sigma=2.0))
    assert not ledger.append(ev(2, sigma=2.0))  # re-delivered: no-op
    assert not ledger.append(unconfirmed(2))  # a later time-out of a confirmed round: no-op
    events = ledger.events("a")
    assert [(e.round, e.confirmed, e.sigma) for e in events] == [
        (1, True, 1.0),
        (2, True, 2.0),  # in its round's place, not appended after round 3
        (3, True, 1.0),
    ]
    expected = eps((100, 1.0), (100, 2.0), (100, 1.0))  # the history in ledger order
    assert ledger.epsilon("a").prv == pytest.approx(expected, rel=1e-12)
    records = ledger.records("a")  # append-only: the superseded charge is still stored
    assert [(e.round, e.confirmed, e.code) for e in records] == [
        (1, True, ""),
        (2, False, "error-reply-4003"),
        (3, True, ""),
        (2, True, ""),
    ]
    assert ledger.last_confirmed("a") == records[-1]
    assert ledger.epsilon_by_round("a")[-1][1] == pytest.approx(ledger.epsilon("a").prv)


def test_a_confirmed_conflict_raises_the_conflict_error_and_keeps_the_stored_record(
    ledger: Ledger,
) -> None:
    ledger.append(ev(1))
    with pytest.raises(LedgerConflictError, match="different record"):
        ledger.append(ev(1, steps=7))
    with pytest.raises(LedgerConflictError):
        ledger.append(ev(1, rng="reproducible"))
    assert [e.steps for e in ledger.records()] == [100]
    assert issubclass(LedgerConflictError, LedgerError)


def test_unknown_parameters_are_accounted_as_infinite_epsilon(ledger: Ledger) -> None:
    ledger.append(
        unconfirmed(1, "node-9", sigma=UNKNOWN_SIGMA, q=UNKNOWN_Q, params_known=False, steps=2)
    )
    assert ledger.epsilon("node-9").prv == float("inf")
    assert ledger.last_confirmed("node-9") is None
    assert not ledger.can_run(
        "node-9", sigma=1.0, q=0.01, steps=1, epsilon_cap=1e9, delta=DELTA
    )  # worst case: no room left


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"confirmed": False}, "needs a code"),
        ({"code": "no-reply"}, "confirmed event has known parameters and no code"),
        ({"params_known": False}, "confirmed event has known parameters"),
        ({"confirmed": False, "code": "x", "params_known": False}, "sigma=0.0, q=1.0"),
        ({"rng": "seeded"}, "rng='seeded'"),
        ({"confirmed": False, "code": "Crashed: see /etc/passwd"}, "short lower-case code"),
        ({"confirmed": 0, "code": "x"}, "must be a bool"),
    ],
)
def test_invalid_confirmation_fields_are_rejected(kw: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidEventError, match=message):
        ev(0, **kw)


# --------------------------------------------------------------------------------------------
# Migration of a schema-1 ledger
# --------------------------------------------------------------------------------------------

_V1_SCHEMA = f"""
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
    UNIQUE (run_id, round, site_id)
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
PRAGMA user_version = 1;
"""
"""The schema-1 CREATE statements, as prism-fl wrote them before unconfirmed charges."""

_V1_ROWS = [
    # run, round, site, mechanism, sigma, q, steps, delta, cap
    ("run-0", 1, "a", "prism-tangent-gaussian", 1.0, 0.01, 100, 1e-5, 8.0),
    ("run-0", 1, "b", "prism-tangent-gaussian", 0.9, 0.02, 100, 1e-6, None),
    ("run-0", 2, "a", "prism-tangent-gaussian", 1.0, 0.01, 100, 1e-5, 8.0),
    ("run-0", 3, "a", "prism-tangent-gaussian", 1.0, 0.01, 0, 1e-5, 8.0),
]


def _v1_ledger(path: Path, rows: list[tuple[object, ...]] = _V1_ROWS) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(_V1_SCHEMA)
    conn.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?)",
        [
            ("application", "prism-fl-ledger"),
            ("schema_version", "1"),
            ("created_at", "2026-01-01T00:00:00+00:00"),
        ],
    )
    conn.execute(
        "INSERT INTO runs VALUES ('run-0', '2026-01-01T00:00:00+00:00', '{\"rounds\": 3}')"
    )
    conn.executemany(
        "INSERT INTO events (run_id, round, site_id, mechanism, adjacency, sampling, sigma, q, "
        "steps, delta, epsilon_cap, recorded_at) "
        "VALUES (?, ?, ?, ?, 'add-remove', 'poisson', ?, ?, ?, ?, ?, '2026-01-01T00:00:01')",
        rows,
    )
    conn.commit()
    conn.close()


def _v1_view(ledger: Ledger) -> list[tuple[object, ...]]:
    return [
        (e.run_id, e.round, e.site_id, e.mechanism, e.sigma, e.q, e.steps, e.delta, e.epsilon_cap)
        for e in ledger.events()
    ]


def test_a_schema_1_ledger_is_read_as_is_read_only_and_migrated_for_writing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.sqlite"
    _v1_ledger(path)
    before = path.read_bytes()
    with Ledger.open(path, read_only=True) as led:  # prism-fl report on an old ledger
        assert _v1_view(led) == _V1_ROWS
        assert led.records() == led.events()  # every row, read with the version-2 defaults
        assert all(e.confirmed and e.params_known and e.rng is None for e in led.events())
        eps_a, eps_b = led.epsilon("a"), led.epsilon("b")
        assert eps_a.prv == pytest.approx(eps((200, 1.0)), rel=1e-12)
    assert path.read_bytes() == before  # read-only: not migrated, not touched

    with Ledger.open(path) as led:  # the coordinator: migrated in place
        assert _v1_view(led) == _V1_ROWS  # nothing lost
        assert (led.epsilon("a"), led.epsilon("b")) == (eps_a, eps_b)
        assert [r.config for r in led.runs()] == [{"rounds": 3}]
        assert [e.recorded_at for e in led.events()] == ["2026-01-01T00:00:01"] * 4
        # the new columns work: an unconfirmed charge, then its confirmation with the rng fact
        assert led.append(unconfirmed(4, "a", run_id="run-0", code="error-reply-4001"))
        assert led.append(ev(4, "a", run_id="run-0", rng="reproducible"))
        assert [(e.round, e.confirmed) for e in led.events("a")][-1] == (4, True)
        # schema 3: a round holds a private clip estimate's row beside its training row
        assert led.append(ev(4, "a", run_id="run-0", mechanism=QUANTILE_MECHANISM, sigma=8.0))
        assert [e.mechanism for e in led.events("a") if e.round == 4] == [
            "prism-tangent-gaussian",
            QUANTILE_MECHANISM,
        ]
    conn = sqlite3.connect(path)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        assert meta["schema_version"] == str(SCHEMA_VERSION) and "migrated_from_1_at" in meta
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        ids = [r[0] for r in conn.execute("SELECT id FROM events ORDER BY id")]
        assert ids[:4] == [1, 2, 3, 4]  # the old rows keep their ids (and their order)
        for sql in (  # the append-only triggers are back
            "UPDATE events SET steps = 0",
            "DELETE FROM events",
            "UPDATE meta SET value = '1' WHERE key = 'schema_version'",
        ):
            with pytest.raises(sqlite3.IntegrityError, match="refused"):
                conn.execute(sql)
        conn.rollback()
    finally:
        conn.close()
    with Ledger.open(path, create=False) as led:  # reopening a migrated ledger: no-op
        assert len(led.records()) == 7 and _v1_view(led)[:4] == _V1_ROWS


def test_a_schema_1_ledger_with_an_invalid_row_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    _v1_ledger(path)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA ignore_check_constraints = ON")
    conn.execute("DROP TRIGGER events_no_update")
    conn.execute("UPDATE events SET q = 2.0 WHERE id = 2")
    conn.execute(
        "CREATE TRIGGER events_no_update BEFORE UPDATE ON events BEGIN SELECT "
        "RAISE(ABORT, 'prism-fl ledger: events are append-only, UPDATE refused'); END"
    )
    conn.commit()
    conn.close()
    before = path.read_bytes()
    for kw in ({}, {"read_only": True}):
        with pytest.raises(LedgerError, match="event row 2 is invalid"):
            Ledger.open(path, **kw)  # type: ignore[arg-type]
    assert path.read_bytes() == before  # not migrated
