"""Ledger schema 3: a round holds one row per mechanism (the training steps and a private clip
estimate, ``QUANTILE_MECHANISM``), and the migration of a schema-2 ledger (built here with the
old CREATE statements) to it. Schema 1 -> 3: ``test_ledger_unconfirmed``."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from ledger_events import ledger_event

from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.quantile import QUANTILE_MECHANISM
from server.errors import LedgerConflictError, LedgerError
from server.ledger import LEDGER_APPLICATION_ID, SCHEMA_VERSION, Ledger, LedgerEvent
from server.ledger.schema import create_ledger, migrate

DELTA = 1e-5
TRAIN = "prism-tangent-gaussian"


def ev(rnd: int, site: str = "a", **kw: object) -> LedgerEvent:
    args: dict[str, object] = dict(
        run_id="run-1", round=rnd, site_id=site, sigma=1.0, q=0.01, steps=100, delta=DELTA
    )
    args.update(kw)
    return ledger_event(**args)


def estimate(rnd: int, site: str = "a", **kw: object) -> LedgerEvent:
    return ev(rnd, site, **{"mechanism": QUANTILE_MECHANISM, "sigma": 6.4, "steps": 30, **kw})


@pytest.fixture
def ledger(tmp_path: Path):
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        yield led


def test_a_round_holds_a_clip_estimate_and_its_training_and_epsilon_composes_both(ledger):
    assert ledger.append_many([estimate(1), ev(1)]) == 2
    assert ledger.append(ev(2))
    assert [(e.round, e.mechanism) for e in ledger.events("a")] == [
        (1, QUANTILE_MECHANISM),
        (1, TRAIN),
        (2, TRAIN),
    ]
    both = epsilon([PrivacyEvent(6.4, 0.01, 30), PrivacyEvent(1.0, 0.01, 200)], DELTA)
    assert ledger.epsilon("a").prv == pytest.approx(both, rel=1e-12)
    assert both > epsilon([PrivacyEvent(1.0, 0.01, 200)], DELTA)  # the estimate is counted
    assert ledger.epsilon_by_round("a") == [
        (
            1,
            pytest.approx(
                epsilon([PrivacyEvent(6.4, 0.01, 30), PrivacyEvent(1.0, 0.01, 100)], DELTA)
            ),
        ),
        (2, pytest.approx(both)),
    ]  # one point per round, after all of its events
    # a replayed reply is a no-op for each row; a different estimate of the round conflicts
    assert ledger.append_many([estimate(1), ev(1)]) == 0
    with pytest.raises(LedgerConflictError):
        ledger.append(estimate(1, sigma=3.0))
    assert len(ledger.records()) == 3
    last = ledger.last_confirmed("a")
    assert last is not None and last.mechanism == TRAIN  # an estimate is not a training event
    ledger.append(estimate(3))
    assert ledger.last_confirmed("a").mechanism == TRAIN  # type: ignore[union-attr]


def test_a_confirmation_supersedes_the_unconfirmed_rows_of_every_mechanism(ledger):
    ledger.append(ev(1))
    unconfirmed = {"confirmed": False, "code": "no-reply"}
    assert ledger.append_many([estimate(2, **unconfirmed), ev(2, **unconfirmed)]) == 2
    assert len(ledger.events("a")) == 3  # counted (worst case)
    assert ledger.append(ev(2))  # the site's stored reply arrives: it reused its clip
    assert [(e.round, e.mechanism, e.confirmed) for e in ledger.events("a")] == [
        (1, TRAIN, True),
        (2, TRAIN, True),
    ]
    assert not ledger.append(estimate(2, **unconfirmed))  # confirmed round: not charged again
    assert len(ledger.records()) == 4


_V2_SCHEMA = f"""
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
    CHECK (confirmed = 0 OR (params_known = 1 AND code = '')),
    CHECK (params_known = 1 OR (sigma = 0 AND q = 1)),
    UNIQUE (run_id, round, site_id, confirmed)
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
PRAGMA user_version = 2;
"""
"""The schema-2 CREATE statements, as prism-fl wrote them before the private clip estimate."""

_V2_ROWS = [
    # run, round, site, sigma, q, steps, confirmed, params_known, rng, code
    ("run-0", 1, "a", 1.0, 0.01, 100, 1, 1, "os-csprng", ""),
    ("run-0", 1, "b", 0.9, 0.02, 100, 1, 1, "reproducible", ""),
    ("run-0", 2, "a", 1.0, 0.01, 100, 0, 1, "os-csprng", "no-reply"),
    ("run-0", 2, "b", 0.0, 1.0, 100, 0, 0, None, "error-reply-4003"),
    ("run-0", 2, "a", 1.0, 0.01, 100, 1, 1, "os-csprng", ""),
]


def _v2_ledger(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(_V2_SCHEMA)
    conn.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?)",
        [
            ("application", "prism-fl-ledger"),
            ("schema_version", "2"),
            ("created_at", "2026-01-01T00:00:00+00:00"),
        ],
    )
    conn.execute("INSERT INTO runs VALUES ('run-0', '2026-01-01T00:00:00+00:00', '{}')")
    conn.executemany(
        "INSERT INTO events (run_id, round, site_id, mechanism, adjacency, sampling, sigma, q, "
        "steps, delta, epsilon_cap, recorded_at, confirmed, params_known, rng, code) VALUES "
        "(?, ?, ?, 'prism-tangent-gaussian', 'add-remove', 'poisson', ?, ?, ?, 1e-5, 8.0, "
        "'2026-01-01T00:00:01', ?, ?, ?, ?)",
        _V2_ROWS,
    )
    conn.commit()
    conn.close()


def _view(ledger: Ledger) -> list[tuple[object, ...]]:
    return [
        (e.run_id, e.round, e.site_id, e.sigma, e.q, e.steps, int(e.confirmed),
         int(e.params_known), e.rng, e.code)
        for e in ledger.records()
    ]  # fmt: skip


def test_a_schema_2_ledger_is_read_as_is_read_only_and_migrated_for_writing(tmp_path, caplog):
    path = tmp_path / "v2.sqlite"
    _v2_ledger(path)
    conn = sqlite3.connect(path)
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):  # why schema 3 exists
        conn.execute(
            "INSERT INTO events (run_id, round, site_id, mechanism, adjacency, sampling, sigma, "
            "q, steps, delta, recorded_at) VALUES ('run-0', 1, 'a', 'quantile-gaussian', "
            "'add-remove', 'poisson', 6.4, 0.01, 30, 1e-5, 'now')"
        )
    conn.close()
    before = path.read_bytes()
    with Ledger.open(path, read_only=True) as led:
        assert _view(led) == _V2_ROWS
        eps_a, eps_b = led.epsilon("a"), led.epsilon("b")
        assert [e.confirmed for e in led.events("a")] == [True, True]  # round 2 superseded
    assert path.read_bytes() == before  # read-only: not migrated, not touched

    with caplog.at_level("WARNING", logger="server.ledger"):
        led = Ledger.open(path)
    assert [r.getMessage() for r in caplog.records] == [
        f"ledger {path}: migrated from schema version 2 to {SCHEMA_VERSION} "
        f"({len(_V2_ROWS)} events kept)"
    ]
    with led:
        assert _view(led) == _V2_ROWS  # every row kept, with its status
        assert (led.epsilon("a"), led.epsilon("b")) == (eps_a, eps_b)
        assert led.append_many([estimate(3, run_id="run-0"), ev(3, run_id="run-0")]) == 2
        assert [e.mechanism for e in led.events("a") if e.round == 3] == [
            QUANTILE_MECHANISM,
            TRAIN,
        ]
    conn = sqlite3.connect(path)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        assert meta["schema_version"] == str(SCHEMA_VERSION) == "3"
        assert "migrated_from_2_at" in meta
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        ids = [r[0] for r in conn.execute("SELECT id FROM events ORDER BY id")]
        assert ids == [1, 2, 3, 4, 5, 6, 7]  # the old rows keep their ids and order
        for sql in ("UPDATE events SET steps = 0", "DELETE FROM events"):
            with pytest.raises(sqlite3.IntegrityError, match="refused"):
                conn.execute(sql)
        conn.rollback()
    finally:
        conn.close()
    with Ledger.open(path, create=False) as led:  # reopening: no second migration
        assert len(led.records()) == 7


@pytest.mark.parametrize("action", ["ABORT", "ROLLBACK"])
def test_a_migration_that_fails_midway_leaves_the_old_ledger_as_it_was(tmp_path, caplog, action):
    """A schema-2 ledger holding a trigger of its own that refuses the migration's last step
    (the ``migrated_from_2_at`` meta row): the coordinator refuses to open it, saying from and
    to which version it could not migrate and why, and the one transaction is rolled back: the
    file still reads as schema 2 with every row, no half-built ``events_new`` table left. With
    ``RAISE(ROLLBACK)`` SQLite has already rolled back, so the migration's own ROLLBACK finds
    no transaction; SQLite's reason is still the one reported."""
    path = tmp_path / "v2.sqlite"
    _v2_ledger(path)
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TRIGGER operator_guard BEFORE INSERT ON meta BEGIN "
        f"SELECT RAISE({action}, 'operator guard: meta is frozen'); END"
    )
    conn.commit()
    conn.close()
    with caplog.at_level("WARNING", logger="server.ledger"), pytest.raises(LedgerError) as info:
        Ledger.open(path)
    assert str(info.value) == (
        f"ledger {path}: cannot migrate it from schema version 2 to {SCHEMA_VERSION} "
        "(operator guard: meta is frozen); the file was left as it was."
    )
    assert not [r for r in caplog.records if "migrated" in r.getMessage()]
    with Ledger.open(path, read_only=True) as led:
        assert _view(led) == _V2_ROWS
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            "2",
        )
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert tables == {"meta", "runs", "events"}
        assert not conn.in_transaction
    finally:
        conn.close()


def test_migrating_a_ledger_another_process_has_migrated_is_a_no_op(tmp_path, caplog):
    """Two coordinators open the same old ledger; the second's ``migrate`` finds the current
    version (the first migrated it meanwhile): it changes nothing, logs nothing and leaves no
    transaction open on its connection."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append(ev(0))
    before = path.read_bytes()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        with caplog.at_level("INFO", logger="server.ledger"):
            migrate(conn, path)
        assert not conn.in_transaction
        assert not caplog.records
    finally:
        conn.close()
    assert path.read_bytes() == before


def test_a_ledger_created_concurrently_is_kept_and_used(tmp_path, caplog):
    """Between ``Ledger.open`` finding no file and linking its new empty ledger in place,
    another coordinator created the ledger and wrote to it: the link does not clobber it, the
    log says so, and no temporary file is left."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:  # the other coordinator
        led.append(ev(0))
    before = path.read_bytes()
    with caplog.at_level("INFO", logger="server.ledger"):
        create_ledger(path)  # this one, having seen no file
    assert [r.getMessage() for r in caplog.records] == [
        f"ledger {path} was created concurrently; using that one"
    ]
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite"]
    with Ledger.open(path) as led:
        assert [e.round for e in led.events()] == [0]
