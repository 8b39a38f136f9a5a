"""The ledger file's schema (``server.ledger.schema``): its layout, its append-only triggers and
its creation (folders, WAL mode, a concurrent creator)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ledger.sample_events import ev
from prism_core.records import SKELLAM_MECHANISM
from server.errors import LedgerError
from server.ledger import LEDGER_APPLICATION_ID, SCHEMA_VERSION, Ledger, LedgerEvent
from server.ledger.schema import EVENT_COLUMNS, create_ledger


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


def _secure(rnd: int, site: str, honest: int, share: float) -> LedgerEvent:
    return ev(rnd, site, mechanism=SKELLAM_MECHANISM, honest_sites=honest, share_sigma=share)


def test_a_new_ledger_has_schema_version_1_and_the_event_columns(tmp_path: Path) -> None:
    """The header and ``meta`` name the schema version and the application; ``events`` holds
    ``id`` and ``EVENT_COLUMNS`` with their types, NOT NULL flags and defaults (the privacy unit
    NOT NULL with default ``record``; ``honest_sites`` and ``share_sigma`` nullable)."""
    path = tmp_path / "ledger.sqlite"
    Ledger.open(path).close()
    conn = sqlite3.connect(path)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        assert (meta["application"], meta["schema_version"]) == ("prism-fl-ledger", "1")
        assert SCHEMA_VERSION == 1
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA application_id").fetchone()[0] == LEDGER_APPLICATION_ID
        info = {r[1]: (r[2], r[3], r[4]) for r in conn.execute("PRAGMA table_info(events)")}
        assert tuple(info) == ("id", *EVENT_COLUMNS)
        assert info["unit"] == ("TEXT", 1, "'record'")
        assert info["honest_sites"] == ("INTEGER", 0, None)
        assert info["share_sigma"] == ("REAL", 0, None)
    finally:
        conn.close()


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
