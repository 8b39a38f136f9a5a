"""Opening checks (``server.ledger.checks``): a file that is not a sound prism-fl ledger
(missing, a directory, empty, truncated, corrupt, foreign, spoofed, of another schema version,
tampered with, damaged in its write-ahead log) is refused with the reason and never touched; a
ledger of the smallest or largest page size opens; a connection waits for another process's
lock past sqlite's default busy time."""

from __future__ import annotations

import contextlib
import os
import random
import re
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.sample_events import ev
from server.errors import LedgerError
from server.ledger import LEDGER_APPLICATION_ID, SCHEMA_VERSION, Ledger
from server.ledger.checks import check_header
from server.ledger.schema import EVENT_COLUMNS


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.sqlite"
    with pytest.raises(LedgerError, match="no such file"):
        Ledger.open(path, create=False)
    with pytest.raises(LedgerError, match="no such file"):
        Ledger.open(path, read_only=True)
    assert not path.exists()
    Ledger.open(path).close()
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == ["nope.sqlite"]


def _foreign_sqlite(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE patients (id INTEGER, name TEXT)")
    conn.execute("INSERT INTO patients VALUES (1, 'x')")
    conn.commit()
    conn.close()


def _spoofed_sqlite(path: Path) -> None:
    """Our application_id in the header, but no ledger inside."""
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA application_id = {LEDGER_APPLICATION_ID}")
    conn.execute("CREATE TABLE meta (key TEXT, value TEXT)")
    conn.execute("INSERT INTO meta VALUES ('application', 'something-else')")
    conn.commit()
    conn.close()


def _schema_version(version: str) -> object:
    """A real ledger whose ``meta.schema_version`` reads ``version``."""

    def make(path: Path) -> None:
        with Ledger.open(path):
            pass
        conn = sqlite3.connect(path)
        conn.execute("DROP TRIGGER meta_no_update")
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))
        conn.commit()
        conn.close()

    return make


def _truncated_ledger(keep: int | None) -> object:
    def make(path: Path) -> None:
        with Ledger.open(path) as led:
            led.append_many([ev(r) for r in range(20)])
        data = path.read_bytes()
        path.write_bytes(data[: keep if keep is not None else len(data) // 2])

    return make


_NO_UPDATE = (
    "CREATE TRIGGER events_no_update BEFORE UPDATE ON events BEGIN SELECT "
    "RAISE(ABORT, 'prism-fl ledger: events are append-only, UPDATE refused'); END"
)


def _tampered(*statements: str, restore_trigger: bool = True) -> object:
    """A real ledger edited outside prism-fl: trigger dropped, a row changed, trigger restored."""

    def make(path: Path) -> None:
        with Ledger.open(path) as led:
            led.append_many([ev(r) for r in range(20)])
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA ignore_check_constraints = ON")
        conn.execute("DROP TRIGGER events_no_update")
        for statement in statements:
            conn.execute(statement)
        if restore_trigger:
            conn.execute(_NO_UPDATE)
        conn.commit()
        conn.close()

    return make


def _garbled_page(path: Path) -> None:
    """Bytes overwritten at the start of the second page (a b-tree page header)."""
    with Ledger.open(path) as led:
        led.append_many([ev(r) for r in range(20)])
    data = bytearray(path.read_bytes())
    data[4096 : 4096 + 8] = bytes(b ^ 0xFF for b in data[4096 : 4096 + 8])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_tampered("UPDATE events SET sigma = 5.0", restore_trigger=False), "triggers missing"),
        (
            _tampered("UPDATE events SET sigma = -1.0 WHERE round = 3"),
            r"event row 4 is invalid \(stored event of site 'a': invalid privacy event: "
            r"noise_multiplier sigma=-1.0 must be",
        ),
        (
            _tampered("UPDATE events SET confirmed = 2 WHERE round = 1"),
            r"event row 2 is invalid \(confirmed=2 must be 0 or 1\)",
        ),
        (
            _tampered("ALTER TABLE events DROP COLUMN epsilon_cap"),
            re.escape("columns or append-only triggers missing: ['events.epsilon_cap']"),
        ),
        (_tampered("UPDATE events SET q = 2.0 WHERE round = 0"), "event row 1 is invalid"),
        (_tampered("UPDATE events SET steps = 'many' WHERE round = 7"), "event row 8 is invalid"),
        (
            _tampered("UPDATE events SET unit = 'household' WHERE round = 5"),
            r"event row 6 is invalid \(stored event of site 'a': invalid privacy event: "
            r"unit='household' must be one of \['record', 'user'\]",
        ),
        (_tampered("UPDATE events SET unit = 2 WHERE round = 6"), "event row 7 is invalid"),
        (_tampered("UPDATE events SET sigma = 'x' WHERE round = 9"), "column types"),
        (
            _tampered("UPDATE events SET sampling = 'shuffle' WHERE round = 8"),
            r"event row 9 is invalid \(stored event of site 'a': invalid privacy event: "
            r"sampling='shuffle' is not 'poisson', the only sampling accounted",
        ),
        (
            _tampered("UPDATE events SET adjacency = 'replace-one' WHERE round = 8"),
            r"event row 9 is invalid \(stored event of site 'a': invalid privacy event: "
            r"adjacency='replace-one' is not 'add-remove', the only adjacency accounted",
        ),
        (
            _tampered("UPDATE events SET honest_sites = 2, share_sigma = 0.5 WHERE round = 4"),
            r"event row 5 is invalid \(stored event of site 'a': invalid privacy event: "
            r"honest_sites=2, share_sigma=0.5: only a 'prism-tangent-skellam' event has them",
        ),
        (
            _tampered(
                "UPDATE events SET mechanism = 'prism-tangent-skellam', honest_sites = 3, "
                "share_sigma = 'x' WHERE round = 2"
            ),
            re.escape("event row 3 is invalid (column types {'share_sigma': 'text'})"),
        ),
        (_garbled_page, "corrupt|integrity check failed"),
        (_foreign_sqlite, r"application_id 0x0 and tables \['patients'\]"),
        (_spoofed_sqlite, "meta.application is 'something-else'"),
        (
            _schema_version(str(SCHEMA_VERSION + 1)),
            re.escape(
                f"schema version '{SCHEMA_VERSION + 1}', this prism-fl reads schema version "
                f"{SCHEMA_VERSION} only. Open it with the prism-fl release that wrote it, or "
                "point to another ledger file; the file was not modified."
            ),
        ),
        (_schema_version("0"), "schema version '0', this prism-fl reads schema version 1 only"),
        (lambda p: p.write_bytes(random.Random(0).randbytes(5000)), "not an SQLite database"),
        (lambda p: p.write_text("site,epsilon\na,1.0\n"), "not an SQLite database"),
        (lambda p: p.write_bytes(b""), "empty"),
        (_truncated_ledger(None), "corrupt"),
        (_truncated_ledger(4096 + 10), "whole number"),
        (_truncated_ledger(60), "truncated"),
    ],
    ids=[
        "tampered-no-trigger",
        "tampered-sigma",
        "tampered-confirmed",
        "dropped-column",
        "tampered-q",
        "tampered-steps-text",
        "tampered-unit",
        "tampered-unit-number",
        "tampered-sigma-text",
        "tampered-sampling",
        "tampered-adjacency",
        "tampered-honest-sites-of-a-gaussian-event",
        "tampered-share-sigma-text",
        "garbled-page",
        "foreign",
        "spoofed",
        "newer",
        "older",
        "random",
        "text",
        "empty",
        "truncated",
        "partial-page",
        "header",
    ],
)
def test_foreign_or_corrupt_file_is_refused_untouched(
    tmp_path: Path, make: object, message: str
) -> None:
    path = tmp_path / "ledger.sqlite"
    make(path)  # type: ignore[operator]
    before = path.read_bytes()
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    siblings = sorted(p.name for p in tmp_path.iterdir())
    for kw in ({}, {"create": False}, {"read_only": True}):
        with pytest.raises(LedgerError, match=message) as info:
            Ledger.open(path, **kw)  # type: ignore[arg-type]
        assert str(path) in str(info.value)
    assert path.read_bytes() == before
    assert path.stat().st_mtime_ns == 1_000_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == siblings  # no -wal/-shm left behind


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="directory"):
        Ledger.open(tmp_path)


@pytest.mark.parametrize("page_size", [512, 65536])
def test_a_ledger_with_the_smallest_or_largest_page_size_opens(
    tmp_path: Path, page_size: int
) -> None:
    """SQLite stores a 65536-byte page size as 1 in the header; 512 is the smallest."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append(ev(0))
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = DELETE")  # the page size of a WAL file cannot change
    conn.execute(f"PRAGMA page_size = {page_size}")
    conn.execute("VACUUM")
    assert conn.execute("PRAGMA page_size").fetchone()[0] == page_size
    conn.close()
    with Ledger.open(path, read_only=True) as led:
        assert [e.round for e in led.events()] == [0]


def test_a_file_with_the_ledgers_id_but_no_meta_table_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA application_id = {LEDGER_APPLICATION_ID}")
    conn.execute("CREATE TABLE events (id INTEGER)")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(
        LedgerError, match=re.escape("meta.application is None (tables ['events'])")
    ):
        Ledger.open(path)
    assert path.read_bytes() == before


@contextlib.contextmanager
def _lock_held(path: Path, begin: str) -> Iterator[None]:
    """Another connection takes the lock (``begin``), writes a run and holds the lock 6 s,
    past sqlite's default 5 s busy time-out, then commits; the body runs meanwhile."""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute(begin)
    holder.execute("INSERT INTO runs VALUES ('run-held', '2026-01-01T00:00:00+00:00', '{}')")
    released = threading.Event()

    def release() -> None:
        released.wait(6.0)
        holder.execute("COMMIT")
        holder.close()

    thread = threading.Thread(target=release)
    thread.start()
    try:
        yield
    finally:
        released.set()
        thread.join()


def test_a_write_waits_for_another_writer_longer_than_sqlites_default_busy_time(tmp_path):
    """Another connection (a second coordinator process, an operator's tool) holds the write
    lock for 6 s, past sqlite's default 5 s busy time-out: the append waits (``BUSY_TIMEOUT_S``)
    and lands instead of failing with "database is locked"."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append(ev(1))
        with _lock_held(path, "BEGIN IMMEDIATE"):
            led.append(ev(2))  # blocks until the holder commits, about 6 s
        assert [e.round for e in led.events()] == [1, 2]


def test_a_report_waits_for_a_writer_that_holds_a_rollback_journal_lock(tmp_path: Path) -> None:
    """A ledger in rollback-journal mode (as an older prism-fl left it) read by ``prism-fl
    report`` while a writer holds its exclusive lock for 6 s, past sqlite's default 5 s: the
    read-only connection waits (``BUSY_TIMEOUT_S``) and reads the committed rows."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append(ev(1))
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode = DELETE").fetchone() == ("delete",)
    conn.close()
    with Ledger.open(path, read_only=True) as report, _lock_held(path, "BEGIN EXCLUSIVE"):
        assert [e.round for e in report.records()] == [1]  # waits about 6 s


def test_a_damaged_row_that_only_the_write_ahead_log_holds_is_found(tmp_path: Path) -> None:
    """A live writer (another coordinator process) has committed a row to the WAL that is not
    yet checkpointed into the main file. The read-only validation must read the WAL too: read
    as immutable (the main file alone) the damaged row would pass and then be accounted."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append_many([ev(r) for r in range(3)])
    writer = sqlite3.connect(path)
    try:
        writer.execute("PRAGMA wal_autocheckpoint = 0")
        writer.execute("PRAGMA ignore_check_constraints = ON")
        names = (*EVENT_COLUMNS, "recorded_at")
        copied = ", ".join({"round": "7", "sigma": "-1.0"}.get(c, c) for c in names)
        writer.execute(
            f"INSERT INTO events ({', '.join(names)}) SELECT {copied} FROM events WHERE round = 0"
        )
        writer.commit()
        assert Path(f"{path}-wal").stat().st_size > 0  # the row is in the WAL only
        for kw in ({}, {"read_only": True}):
            with pytest.raises(LedgerError, match="event row 4 is invalid"):
                Ledger.open(path, **kw)  # type: ignore[arg-type]
    finally:
        writer.close()


def test_a_file_that_is_not_sqlite_is_named_by_its_first_sixteen_bytes(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"0123456789abcdefGHIJ" * 10)
    with pytest.raises(LedgerError) as info:
        Ledger.open(path)
    assert "(first bytes b'0123456789abcdef'), so not a prism-fl ledger" in str(info.value)


def test_a_header_that_cannot_be_read_is_refused_with_the_reason(tmp_path: Path) -> None:
    """``check_header`` of a path the OS will not open for reading (here a directory, which
    fails for every user, root included) names the path and the OS error."""
    with pytest.raises(LedgerError) as info:
        check_header(tmp_path)
    assert str(info.value).startswith(f"ledger {tmp_path}: cannot read it ([Errno 21] ")


def _rewrite_events_schema(path: Path, sql: str) -> None:
    """Replace the events table's CREATE statement in place, as an editor with
    ``writable_schema`` can (the rows are not checked against it)."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute("UPDATE sqlite_master SET sql = ? WHERE name = 'events'", (sql,))
    conn.commit()
    conn.close()


def _null_timestamps(path: Path) -> None:
    """A ledger whose NOT NULL ``recorded_at`` was emptied in five rows by an editor that
    loosened the schema for the edit and restored it: the file is sound, ``quick_check``
    reports one violation per row."""
    with Ledger.open(path) as led:
        led.append_many([ev(r) for r in range(20)])
    conn = sqlite3.connect(path)
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'events'").fetchone()
    conn.close()
    loose = sql.replace("recorded_at TEXT NOT NULL", "recorded_at TEXT")
    assert loose != sql
    _rewrite_events_schema(path, loose)
    conn = sqlite3.connect(path)  # a new connection reads the loosened schema
    conn.execute("DROP TRIGGER events_no_update")
    conn.execute("UPDATE events SET recorded_at = NULL WHERE round < 5")
    conn.execute(_NO_UPDATE)
    conn.commit()
    conn.close()
    _rewrite_events_schema(path, sql)


def test_a_failed_integrity_check_names_its_first_three_findings(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    _null_timestamps(path)
    before = path.read_bytes()
    finding = "NULL value in events.recorded_at"
    for kw in ({}, {"read_only": True}):
        with pytest.raises(LedgerError) as info:
            Ledger.open(path, **kw)  # type: ignore[arg-type]
        assert str(info.value) == (
            f"ledger {path}: integrity check failed ({'; '.join([finding] * 3)}). Restore it "
            "from a backup; the file was not modified."
        )
    assert path.read_bytes() == before


def test_a_ledger_sqlite_cannot_open_is_refused_with_the_reason(tmp_path: Path) -> None:
    """A real ledger at a path of about 4,000 characters: Python reads it (Linux allows 4,095),
    SQLite cannot open it (its Unix VFS allows 512 here, 1,024 or 4,096 in other builds)."""
    folder = tmp_path.joinpath(*["d" * 250] * ((4000 - len(str(tmp_path))) // 251))
    folder.mkdir(parents=True)
    path = folder / "ledger.sqlite"
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        led.append(ev(0))
    path.write_bytes((tmp_path / "ledger.sqlite").read_bytes())
    with pytest.raises(LedgerError) as info:
        Ledger.open(path, read_only=True)
    assert str(info.value) == (
        f"ledger {path}: cannot open it read-only (unable to open database file)."
    )
