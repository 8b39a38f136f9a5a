"""The coordinator's privacy ledger: accounting against Opacus, append-only, durable, refuses
foreign files without touching them."""

from __future__ import annotations

import os
import random
import sqlite3
from pathlib import Path

import pytest
from ledger_events import ledger_event
from opacus.accountants import PRVAccountant, RDPAccountant

from prism_core.accounting import PRV_EPS_ERROR, PrivacyEvent, epsilon
from prism_core.errors import AccountingError, PrivacyParameterError
from server.errors import InvalidEventError, LedgerError
from server.ledger import LEDGER_APPLICATION_ID, Ledger, LedgerEvent

DELTA = 1e-5


def ev(rnd: int, site: str = "a", **kw: object) -> LedgerEvent:
    """A valid event; keyword arguments override the defaults."""
    args: dict[str, object] = dict(
        run_id="run-1", round=rnd, site_id=site, sigma=1.0, q=0.01, steps=100, delta=DELTA
    )
    args.update(kw)
    return ledger_event(**args)


@pytest.fixture
def ledger(tmp_path: Path):
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        yield led


def opacus_epsilon(history: list[tuple[float, float, int]], delta: float, kind: str) -> float:
    acc = PRVAccountant() if kind == "prv" else RDPAccountant()
    acc.history = list(history)
    if kind == "prv":
        return float(acc.get_epsilon(delta=delta, eps_error=PRV_EPS_ERROR))
    return float(acc.get_epsilon(delta=delta))


# --------------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------------


def test_epsilon_equals_accountant_on_same_history(ledger: Ledger) -> None:
    for r in range(3):
        assert ledger.append(ev(r))
    report = ledger.epsilon("a")
    one_event = epsilon([PrivacyEvent(1.0, 0.01, 300)], DELTA)
    assert report.delta == DELTA
    assert report.prv == pytest.approx(one_event, rel=1e-12)
    assert report.prv == pytest.approx(opacus_epsilon([(1.0, 0.01, 300)], DELTA, "prv"), rel=1e-9)
    assert report.rdp == pytest.approx(opacus_epsilon([(1.0, 0.01, 300)], DELTA, "rdp"), rel=1e-9)
    assert report.rdp >= report.prv
    assert 0.5 < report.prv < 2.0  # sanity: a known regime, not a degenerate 0 or inf


@pytest.mark.parametrize(("sigma", "q", "steps"), [(0.8, 0.05, 40), (2.0, 0.1, 60)])
def test_rdp_never_below_prv_and_sites_are_separate(
    ledger: Ledger, sigma: float, q: float, steps: int
) -> None:
    ledger.append_many([ev(0, "a", sigma=sigma, q=q, steps=steps), ev(0, "b", steps=10)])
    a, b = ledger.epsilon("a"), ledger.epsilon("b")
    assert a.rdp >= a.prv > 0
    assert a.prv == pytest.approx(opacus_epsilon([(sigma, q, steps)], DELTA, "prv"), rel=1e-9)
    assert b.prv == pytest.approx(epsilon([PrivacyEvent(1.0, 0.01, 10)], DELTA), rel=1e-12)
    assert ledger.sites() == ["a", "b"]


def test_epsilon_by_round_recomputes_each_prefix(ledger: Ledger) -> None:
    ledger.append_many([ev(0, steps=50), ev(1, steps=0), ev(2, steps=50, sigma=1.2)])
    series = ledger.epsilon_by_round("a")
    assert [r for r, _ in series] == [0, 2]  # round 1 ran no steps
    expected = [
        epsilon([PrivacyEvent(1.0, 0.01, 50)], DELTA),
        epsilon([PrivacyEvent(1.0, 0.01, 50), PrivacyEvent(1.2, 0.01, 50)], DELTA),
    ]
    assert [e for _, e in series] == pytest.approx(expected, rel=1e-12)
    assert series[-1][1] == pytest.approx(ledger.epsilon("a").prv, rel=1e-12)
    assert ledger.epsilon_by_round("nobody") == []


def test_different_deltas_use_the_smallest(ledger: Ledger) -> None:
    ledger.append_many([ev(0, delta=1e-4, steps=50), ev(1, delta=1e-6, steps=50)])
    report = ledger.epsilon("a")
    assert report.delta == 1e-6
    assert report.prv == pytest.approx(epsilon([PrivacyEvent(1.0, 0.01, 100)], 1e-6), rel=1e-12)
    assert ledger.epsilon("a", delta=1e-4).prv < report.prv


def test_unknown_site(ledger: Ledger) -> None:
    with pytest.raises(LedgerError, match="no events of site 'x'"):
        ledger.epsilon("x")
    assert ledger.epsilon("x", delta=DELTA).prv == 0.0


def test_can_run_against_the_cap(ledger: Ledger) -> None:
    for r in range(3):
        ledger.append(ev(r))
    after_next = epsilon([PrivacyEvent(1.0, 0.01, 400)], DELTA)
    kw = dict(sigma=1.0, q=0.01, steps=100, delta=DELTA)
    assert ledger.can_run("a", epsilon_cap=after_next + 1e-3, **kw)  # type: ignore[arg-type]
    assert not ledger.can_run("a", epsilon_cap=after_next - 1e-3, **kw)  # type: ignore[arg-type]
    # already past: even one step is refused; a fresh site is judged on the new round alone
    assert not ledger.can_run("a", epsilon_cap=1.0, sigma=1.0, q=0.01, steps=1, delta=DELTA)
    fresh = epsilon([PrivacyEvent(1.0, 0.01, 100)], DELTA)
    assert ledger.can_run("new", epsilon_cap=fresh + 1e-3, **kw)  # type: ignore[arg-type]
    assert not ledger.can_run("new", epsilon_cap=fresh - 1e-3, **kw)  # type: ignore[arg-type]


def test_unaccountable_history_is_never_runnable(ledger: Ledger) -> None:
    ledger.append(ev(0, sampling="shuffle"))
    with pytest.raises(AccountingError, match="shuffle"):
        ledger.epsilon("a")
    assert not ledger.can_run("a", sigma=5.0, q=0.01, steps=1, epsilon_cap=100.0, delta=DELTA)


# --------------------------------------------------------------------------------------------
# Append-only, duplicates, atomicity, validation
# --------------------------------------------------------------------------------------------


def test_duplicate_record_is_not_double_counted(ledger: Ledger) -> None:
    assert ledger.append(ev(0)) is True
    assert ledger.append(ev(0)) is False  # a replayed reply
    assert ledger.append_many([ev(1), ev(1), ev(0)]) == 1  # duplicates within and across batches
    assert len(ledger.events()) == 2
    assert ledger.epsilon("a").prv == pytest.approx(
        epsilon([PrivacyEvent(1.0, 0.01, 200)], DELTA), rel=1e-12
    )
    # the same round of another run, or of another site, is a different record
    assert ledger.append(ev(0, run_id="run-2")) and ledger.append(ev(0, "b"))


def test_conflicting_duplicate_is_refused_and_the_stored_record_kept(ledger: Ledger) -> None:
    ledger.append(ev(0))
    with pytest.raises(LedgerError, match="already has a different record"):
        ledger.append(ev(0, steps=1))
    (stored,) = ledger.events()
    assert stored.steps == 100 and stored.recorded_at is not None


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


def test_append_many_is_atomic(ledger: Ledger) -> None:
    ledger.append(ev(0))
    bad = ev(3)
    object.__setattr__(bad.event, "sample_rate", 1.5)  # forced past the constructor's validation
    with pytest.raises(InvalidEventError, match=r"q=1\.5"):
        ledger.append_many([ev(1), ev(2), bad])
    with pytest.raises(LedgerError, match="different record"):
        ledger.append_many([ev(1), ev(2), ev(0, steps=7)])
    assert [e.round for e in ledger.events()] == [0]
    assert ledger.append_many([ev(1), ev(2)]) == 2  # the ledger is still usable


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("sigma", -0.1, PrivacyParameterError),  # the event's own fields: its one record refuses
        ("sigma", float("nan"), PrivacyParameterError),
        ("q", 0.0, PrivacyParameterError),
        ("q", 1.01, PrivacyParameterError),
        ("steps", -1, PrivacyParameterError),
        ("steps", 1.5, PrivacyParameterError),
        ("mechanism", "", PrivacyParameterError),
        ("delta", 0.0, InvalidEventError),
        ("delta", 1.0, InvalidEventError),
        ("site_id", "", InvalidEventError),
        ("round", -1, InvalidEventError),
        ("run_id", " ", InvalidEventError),
        ("epsilon_cap", 0.0, InvalidEventError),
        ("epsilon_cap", float("inf"), InvalidEventError),
    ],
)
def test_invalid_event_values_are_rejected(field: str, value: object, error: type) -> None:
    with pytest.raises(error, match=field):
        ev(0, **{field: value})


def test_an_event_altered_by_force_is_refused_by_the_ledger(ledger: Ledger) -> None:
    for name, value, field in [("noise_multiplier", -1.0, "sigma"), ("steps", 0.5, "steps")]:
        bad = ev(0)
        object.__setattr__(bad.event, name, value)
        with pytest.raises(InvalidEventError, match=field):
            ledger.append(bad)
    assert ledger.events() == []


def test_record_run(ledger: Ledger) -> None:
    assert ledger.record_run("run-1", {"rounds": 3, "lr": 0.1})
    assert not ledger.record_run("run-1", {"lr": 0.1, "rounds": 3})  # same config: no-op
    with pytest.raises(LedgerError, match="another config"):
        ledger.record_run("run-1", {"rounds": 4})
    with pytest.raises(InvalidEventError, match="JSON"):
        ledger.record_run("run-2", {"x": object()})
    ledger.append(ev(0, run_id="run-0"))
    assert ledger.run_ids() == ["run-1", "run-0"]


# --------------------------------------------------------------------------------------------
# Durability and opening
# --------------------------------------------------------------------------------------------


def test_reopen_gives_same_history_and_epsilon(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append_many([ev(0), ev(0, "b", sigma=0.9), ev(1)])
        before = (led.events(), led.epsilon("a"), led.epsilon("b"))
    assert not Path(f"{path}-wal").exists()  # checkpointed on close
    with Ledger.open(path, create=False) as led:
        assert (led.events(), led.epsilon("a"), led.epsilon("b")) == before
        assert led.events(site_id="a", run_id="run-1") == [before[0][0], before[0][2]]
        mode = led._conn.execute("PRAGMA journal_mode").fetchone()[0]
        sync = led._conn.execute("PRAGMA synchronous").fetchone()[0]
        assert (mode, sync) == ("wal", 2)  # 2 = FULL
    with Ledger.open(path, read_only=True) as led:
        assert led.epsilon("a") == before[1]
        with pytest.raises(LedgerError, match="read-only"):
            led.append(ev(5))
    header = path.read_bytes()[:100]
    assert int.from_bytes(header[68:72], "big") == LEDGER_APPLICATION_ID


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


def _newer_schema(path: Path) -> None:
    with Ledger.open(path):
        pass
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER meta_no_update")
    conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()


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
        (_tampered("UPDATE events SET sigma = -1.0 WHERE round = 3"), "event row 4 is invalid"),
        (_tampered("UPDATE events SET q = 2.0 WHERE round = 0"), "event row 1 is invalid"),
        (_tampered("UPDATE events SET steps = 'many' WHERE round = 7"), "event row 8 is invalid"),
        (_tampered("UPDATE events SET sigma = 'x' WHERE round = 9"), "column types"),
        (_garbled_page, "corrupt|integrity check failed"),
        (_foreign_sqlite, r"application_id 0x0 and tables \['patients'\]"),
        (_spoofed_sqlite, "meta.application is 'something-else'"),
        (_newer_schema, "schema version '4'"),
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
        "tampered-q",
        "tampered-steps-text",
        "tampered-sigma-text",
        "garbled-page",
        "foreign",
        "spoofed",
        "newer",
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
