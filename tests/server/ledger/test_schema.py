"""The ledger file's schema (``server.ledger.schema``): its append-only triggers, its
creation (folders, WAL mode, a concurrent creator) and the migration of schema-1 to -4
ledgers (``old_schemas``) to the current version, all or nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ledger.old_schemas import (
    V1_ROWS,
    V2_ROWS,
    V3_ROWS,
    V4_ROWS,
    v1_ledger,
    v1_view,
    v2_ledger,
    v2_view,
    v3_ledger,
    v3_view,
    v4_ledger,
    v4_view,
)
from ledger.sample_events import TRAIN, eps, estimate, ev, unconfirmed
from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import SKELLAM_MECHANISM
from server.errors import LedgerError
from server.ledger import SCHEMA_VERSION, Ledger, LedgerEvent
from server.ledger.schema import create_ledger, migrate


def test_triggers_refuse_update_and_delete(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append(ev(0))
        led.record_run("run-1", {"rounds": 3})
    conn = sqlite3.connect(path)
    try:
        for sql in (
            "UPDATE events SET steps = 0",
            "DELETE FROM events",
            "DELETE FROM events WHERE site_id = 'a'",
            "UPDATE runs SET config_json = '{}'",
            "DELETE FROM runs",
            "UPDATE meta SET value = 'x' WHERE key = 'application'",
        ):
            with pytest.raises(sqlite3.IntegrityError, match="refused"):
                conn.execute(sql)
        conn.rollback()
    finally:
        conn.close()
    with Ledger.open(path, create=False) as led:
        (stored,) = led.events()
        assert stored.same_facts(ev(0))
        assert [r.config for r in led.runs()] == [{"rounds": 3}]


def test_a_new_ledger_is_created_with_its_folders_in_wal_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a" / "b" / "ledger.sqlite"
    with caplog.at_level("WARNING", logger="server.ledger"), Ledger.open(path) as led:
        assert led.path == path
        led.append(ev(0))
    assert not [r for r in caplog.records if "WAL" in r.getMessage()]
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_a_ledger_that_cannot_be_created_says_why(tmp_path: Path) -> None:
    """The ledger's folder would have to be made under a regular file."""
    (tmp_path / "state").write_text("not a folder")
    path = tmp_path / "state" / "ledger.sqlite"
    with pytest.raises(LedgerError) as info:
        Ledger.open(path)
    assert str(info.value).startswith(f"ledger {path}: cannot create it ([Errno 17] ")
    assert (tmp_path / "state").read_text() == "not a folder"


def test_a_schema_2_ledger_is_read_as_is_read_only_and_migrated_for_writing(tmp_path, caplog):
    path = tmp_path / "v2.sqlite"
    v2_ledger(path)
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
        assert v2_view(led) == V2_ROWS
        assert {e.unit for e in led.records()} == {"record"}  # an older row is per record
        eps_a, eps_b = led.epsilon("a"), led.epsilon("b")
        assert [e.confirmed for e in led.events("a")] == [True, True]  # round 2 superseded
    assert path.read_bytes() == before  # read-only: not migrated, not touched

    with caplog.at_level("WARNING", logger="server.ledger"):
        led = Ledger.open(path)
    assert [r.getMessage() for r in caplog.records] == [
        f"ledger {path}: migrated from schema version 2 to {SCHEMA_VERSION} "
        f"({len(V2_ROWS)} events kept)"
    ]
    with led:
        assert v2_view(led) == V2_ROWS  # every row kept, with its status
        assert (led.epsilon("a"), led.epsilon("b")) == (eps_a, eps_b)
        assert led.append_many([estimate(3, run_id="run-0"), ev(3, run_id="run-0")]) == 2
        assert [e.mechanism for e in led.events("a") if e.round == 3] == [
            QUANTILE_MECHANISM,
            TRAIN,
        ]
    conn = sqlite3.connect(path)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        assert meta["schema_version"] == str(SCHEMA_VERSION) == "5"
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
    v2_ledger(path)
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
        assert v2_view(led) == V2_ROWS
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


def test_a_schema_1_ledger_is_read_as_is_read_only_and_migrated_for_writing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.sqlite"
    v1_ledger(path)
    before = path.read_bytes()
    with Ledger.open(path, read_only=True) as led:  # prism-fl report on an old ledger
        assert v1_view(led) == V1_ROWS
        assert led.records() == led.events()  # every row, read with the version-2 defaults
        assert all(e.confirmed and e.params_known and e.rng is None for e in led.events())
        assert {e.unit for e in led.events()} == {"record"}
        eps_a, eps_b = led.epsilon("a"), led.epsilon("b")
        assert eps_a.prv == pytest.approx(eps((200, 1.0)), rel=1e-12)
    assert path.read_bytes() == before  # read-only: not migrated, not touched

    with Ledger.open(path) as led:  # the coordinator: migrated in place
        assert v1_view(led) == V1_ROWS  # nothing lost
        assert {e.unit for e in led.events()} == {"record"}
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
        assert len(led.records()) == 7 and v1_view(led)[:4] == V1_ROWS


def test_a_schema_3_ledger_reads_as_record_level_and_migrates_to_the_unit_column(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every row of a schema-3 ledger (written before the privacy unit) is a record-level
    event, read-only as it is and after the migration, which adds ``unit`` (NOT NULL, default
    ``record``) and keeps every row, its id and its epsilon; the unit then round-trips."""
    path = tmp_path / "v3.sqlite"
    v3_ledger(path)
    before = path.read_bytes()
    with Ledger.open(path, read_only=True) as led:
        assert v3_view(led) == V3_ROWS
        assert {e.unit for e in led.records()} == {"record"}
        eps_a, eps_b = led.epsilon("a"), led.epsilon("b")
    assert path.read_bytes() == before  # read-only: not migrated, not touched

    with caplog.at_level("WARNING", logger="server.ledger"):
        led = Ledger.open(path)
    assert [r.getMessage() for r in caplog.records] == [
        f"ledger {path}: migrated from schema version 3 to {SCHEMA_VERSION} "
        f"({len(V3_ROWS)} events kept)"
    ]
    with led:
        assert v3_view(led) == V3_ROWS
        assert {e.unit for e in led.records()} == {"record"}
        assert (led.epsilon("a"), led.epsilon("b")) == (eps_a, eps_b)
        assert led.append(ev(0, "c", unit="user"))
        assert led.append(ev(0, "d"))
        assert [e.unit for e in led.events("c")] == ["user"]
        assert [e.unit for e in led.events("d")] == ["record"]
    conn = sqlite3.connect(path)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        assert meta["schema_version"] == str(SCHEMA_VERSION) and "migrated_from_3_at" in meta
        column = [r for r in conn.execute("PRAGMA table_info(events)") if r[1] == "unit"]
        assert [(r[2], r[3], r[4]) for r in column] == [("TEXT", 1, "'record'")]
        ids = [r[0] for r in conn.execute("SELECT id FROM events ORDER BY id")]
        assert ids == [1, 2, 3, 4, 5, 6]
        assert conn.execute("SELECT unit FROM events ORDER BY id").fetchall() == [
            ("record",),
            ("record",),
            ("record",),
            ("record",),
            ("user",),
            ("record",),
        ]
        with pytest.raises(sqlite3.IntegrityError, match="refused"):
            conn.execute("UPDATE events SET unit = 'user'")
        conn.rollback()
    finally:
        conn.close()
    with Ledger.open(path, create=False, read_only=True) as led:  # reopened: the unit is kept
        assert [e.unit for e in led.events("c")] == ["user"]


def _secure(rnd: int, site: str, honest: int, share: float) -> LedgerEvent:
    return ev(rnd, site, mechanism=SKELLAM_MECHANISM, honest_sites=honest, share_sigma=share)


def test_a_schema_4_ledger_reads_none_for_the_secure_columns_and_migrates_to_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every row of a schema-4 ledger (written before secure aggregation) reads with
    ``honest_sites`` and ``share_sigma`` None, read-only as it is and after the migration,
    which adds both (nullable, with their CHECKs) and keeps every row, its id, its unit and its
    epsilon; a secure-aggregation event then round-trips both."""
    path = tmp_path / "v4.sqlite"
    v4_ledger(path)
    before = path.read_bytes()
    with Ledger.open(path, read_only=True) as led:
        assert v4_view(led) == V4_ROWS
        assert {(e.honest_sites, e.share_sigma) for e in led.records()} == {(None, None)}
        eps_a, eps_b = led.epsilon("a"), led.epsilon("b")
    assert path.read_bytes() == before  # read-only: not migrated, not touched

    with caplog.at_level("WARNING", logger="server.ledger"):
        led = Ledger.open(path)
    assert [r.getMessage() for r in caplog.records] == [
        f"ledger {path}: migrated from schema version 4 to {SCHEMA_VERSION} "
        f"({len(V4_ROWS)} events kept)"
    ]
    with led:
        assert v4_view(led) == V4_ROWS  # every row kept, with its unit and status
        assert {(e.honest_sites, e.share_sigma) for e in led.records()} == {(None, None)}
        assert (led.epsilon("a"), led.epsilon("b")) == (eps_a, eps_b)
        assert led.append(_secure(0, "c", 3, 0.5))
        (stored,) = led.events("c")
        assert (stored.mechanism, stored.honest_sites, stored.share_sigma) == (
            SKELLAM_MECHANISM,
            3,
            0.5,
        )
        assert stored.same_facts(_secure(0, "c", 3, 0.5))
    conn = sqlite3.connect(path)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        assert meta["schema_version"] == str(SCHEMA_VERSION) and "migrated_from_4_at" in meta
        info = {r[1]: (r[2], r[3], r[4]) for r in conn.execute("PRAGMA table_info(events)")}
        assert info["honest_sites"] == ("INTEGER", 0, None)
        assert info["share_sigma"] == ("REAL", 0, None)
        ids = [r[0] for r in conn.execute("SELECT id FROM events ORDER BY id")]
        assert ids == [1, 2, 3, 4, 5]
        assert conn.execute(
            "SELECT honest_sites, share_sigma FROM events ORDER BY id"
        ).fetchall() == [(None, None)] * 4 + [(3, 0.5)]
        with pytest.raises(sqlite3.IntegrityError, match="refused"):
            conn.execute("UPDATE events SET honest_sites = 1")
        conn.rollback()
    finally:
        conn.close()
    with Ledger.open(path, create=False, read_only=True) as led:  # reopened: both are kept
        assert [(e.honest_sites, e.share_sigma) for e in led.events("c")] == [(3, 0.5)]


@pytest.mark.parametrize(
    ("honest", "share"),
    [(0, 0.5), (3, -0.1), (3, 1.5), (3, None), (None, 0.5)],
    ids=["no-honest-site", "negative-share", "share-above-sigma", "share-missing", "h-missing"],
)
def test_the_secure_columns_checks_refuse_what_the_event_would(
    tmp_path: Path, honest: int | None, share: float | None
) -> None:
    """The schema's CHECKs on ``honest_sites`` and ``share_sigma`` hold without the event's own
    validation: an insert outside prism-fl of H < 1, a negative share, a share above sigma, or
    one of the two without the other is refused by SQLite."""
    path = tmp_path / "ledger.sqlite"
    Ledger.open(path).close()
    conn = sqlite3.connect(path)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
            conn.execute(
                "INSERT INTO events (run_id, round, site_id, mechanism, adjacency, sampling, "
                "sigma, q, steps, delta, recorded_at, honest_sites, share_sigma) VALUES "
                f"('run-0', 1, 'a', '{SKELLAM_MECHANISM}', 'add-remove', 'poisson', 1.0, 0.01, "
                "10, 1e-5, 'now', ?, ?)",
                (honest, share),
            )
    finally:
        conn.close()
