"""The coordinator's privacy ledger: accounting against Opacus, append-only, durable, refuses
foreign files without touching them."""

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
from ledger_events import ledger_event
from opacus.accountants import PRVAccountant, RDPAccountant

from prism_core.accounting import PRV_EPS_ERROR, PrivacyEvent, epsilon
from prism_core.errors import AccountingError, PrivacyParameterError
from prism_core.quantile import QUANTILE_MECHANISM
from server.errors import InvalidEventError, LedgerError
from server.ledger import LEDGER_APPLICATION_ID, Ledger, LedgerEvent
from server.ledger.checks import check_header
from server.ledger.schema import EVENT_COLUMNS

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
        "tampered-confirmed",
        "dropped-column",
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


# --------------------------------------------------------------------------------------------
# Mutation gaps (`make mutation MUTATION_ARGS=ledger`, docs/testing.md): the cap at its edge,
# a re-run round's history, the filters, the round series, the run records, the field checks
# --------------------------------------------------------------------------------------------


def test_a_round_that_ends_exactly_at_the_cap_may_run(ledger: Ledger) -> None:
    for r in range(3):
        ledger.append(ev(r))
    exact = epsilon([PrivacyEvent(1.0, 0.01, 100)] * 4, DELTA)  # the history plus the round
    kw = dict(sigma=1.0, q=0.01, steps=100, delta=DELTA)
    assert ledger.can_run("a", epsilon_cap=exact, **kw)  # type: ignore[arg-type]
    assert not ledger.can_run("a", epsilon_cap=exact * (1 - 1e-9), **kw)  # type: ignore[arg-type]


def test_a_rerun_round_is_judged_on_the_history_before_it(ledger: Ledger) -> None:
    """``before=(run, round)`` leaves out that run's events of that round and later, and
    keeps every other run's events whatever their round numbers."""
    ledger.append(ev(5, run_id="run-0", steps=30))
    ledger.append_many([ev(0, steps=10), ev(1, steps=20), ev(2, steps=40)])
    new = PrivacyEvent(1.0, 0.01, 50)
    kept = [PrivacyEvent(1.0, 0.01, 30), PrivacyEvent(1.0, 0.01, 10), new]
    exact = epsilon(kept, DELTA)
    kw = dict(sigma=1.0, q=0.01, steps=50, delta=DELTA, before=("run-1", 1))
    assert ledger.can_run("a", epsilon_cap=exact, **kw)  # type: ignore[arg-type]
    assert not ledger.can_run("a", epsilon_cap=exact * (1 - 1e-9), **kw)  # type: ignore[arg-type]


def test_reads_filter_by_site_and_run(ledger: Ledger) -> None:
    ledger.append_many(
        [ev(0, "a"), ev(0, "b"), ev(1, "a", run_id="run-2"), ev(1, "b", run_id="run-2")]
    )
    for read in (ledger.events, ledger.records):
        assert [(e.site_id, e.run_id) for e in read(site_id="a")] == [
            ("a", "run-1"),
            ("a", "run-2"),
        ]
        assert [(e.site_id, e.run_id) for e in read(run_id="run-2")] == [
            ("a", "run-2"),
            ("b", "run-2"),
        ]
        assert [(e.site_id, e.run_id) for e in read(site_id="b", run_id="run-1")] == [
            ("b", "run-1")
        ]


def test_last_confirmed_is_the_sites_last_training_event_that_ran_steps(ledger: Ledger) -> None:
    ledger.append_many(
        [
            ev(0, "a", steps=1, sigma=1.5),  # one step is a step
            ev(1, "a", steps=0, sigma=2.5),  # ran nothing: not "last known" parameters
            ev(1, "a", steps=3, sigma=3.5, mechanism=QUANTILE_MECHANISM),  # a clip estimate
            ev(2, "b", steps=7, sigma=4.5),  # another site, later
        ]
    )
    last = ledger.last_confirmed("a")
    assert last is not None and (last.round, last.sigma, last.steps) == (0, 1.5, 1)
    assert ledger.last_confirmed("nobody") is None


def test_the_round_series_has_one_point_per_round_that_ran_steps(ledger: Ledger) -> None:
    ledger.append_many(
        [
            ev(0, steps=0),  # the first round ran nothing: no point
            ev(1, steps=1),  # one step: a point
            ev(2, steps=2, mechanism=QUANTILE_MECHANISM),  # a clip estimate and the training of the
            ev(2, steps=40),  # same round: one point, after both
        ]
    )
    series = ledger.epsilon_by_round("a")
    assert [r for r, _ in series] == [1, 2]
    history = [PrivacyEvent(1.0, 0.01, 1), PrivacyEvent(1.0, 0.01, 2), PrivacyEvent(1.0, 0.01, 40)]
    assert series[-1][1] == pytest.approx(epsilon(history, DELTA), rel=1e-12)
    # an explicit delta is used, not the site's own
    at = ledger.epsilon_by_round("a", delta=1e-3)
    assert at[-1][1] == pytest.approx(epsilon(history, 1e-3), rel=1e-12)
    assert at[-1][1] < series[-1][1]


def test_an_unconfirmed_charge_after_a_confirmed_event_of_another_mechanism_is_not_recorded(
    ledger: Ledger,
) -> None:
    assert ledger.append(ev(0, mechanism=QUANTILE_MECHANISM, steps=1))
    assert not ledger.append(ev(0, confirmed=False, code="no-reply"))
    assert len(ledger.records(site_id="a")) == 1


def test_the_ledgers_log_lines_name_the_site_round_and_mechanism(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    who = "site 'a', run 'run-1', round 0, mechanism 'prism-tangent-gaussian'"
    with caplog.at_level("INFO", logger="server.ledger"):
        ledger.append(ev(0, site="b"))  # confirmed, nothing to supersede: no such line
        ledger.append(ev(0, confirmed=False, code="no-reply"))
        ledger.append(ev(0))
        ledger.append(ev(0))
        ledger.append(ev(0, confirmed=False, code="no-reply"))
    messages = [r.getMessage() for r in caplog.records]
    assert f"ledger: {who} confirmed; its unconfirmed charge is superseded" in messages
    assert f"ledger: duplicate record of {who} ignored" in messages
    assert f"ledger: {who} is already confirmed; unconfirmed charge not recorded" in messages
    assert not [m for m in messages if "site 'b'" in m]


def test_a_closed_ledger_refuses_reads(tmp_path: Path) -> None:
    led = Ledger.open(tmp_path / "ledger.sqlite")
    led.append(ev(0))
    led.close()
    with pytest.raises(LedgerError, match=r"ledger .*ledger\.sqlite: closed\."):
        led.events()


def test_run_records_keep_their_time_and_refuse_bad_ids_and_nan(ledger: Ledger) -> None:
    from datetime import datetime

    assert ledger.record_run("run-1", {"rounds": 3})
    ledger.append_many([ev(0), ev(0, run_id="run-2")])
    (run,) = ledger.runs()
    assert datetime.fromisoformat(run.started_at).tzinfo is not None
    assert ledger.run_ids() == ["run-1", "run-2"]  # recorded first, each id once
    for bad in (5, None, "  "):
        with pytest.raises(InvalidEventError, match=re.escape(f"run_id={bad!r} must be")):
            ledger.record_run(bad, {})  # type: ignore[arg-type]
    with pytest.raises(InvalidEventError, match="not JSON-serialisable"):
        ledger.record_run("run-3", {"lr": float("nan")})


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"round": True}, "round=True must be an integer"),
        ({"round": 1.5}, "round=1.5 must be an integer"),
        ({"epsilon_cap": True}, "epsilon_cap=True must be a finite number"),
        (
            {"confirmed": False, "code": "no-reply", "params_known": False, "sigma": 0.0, "q": 0.5},
            "unknown parameters are recorded as sigma=0.0, q=1.0",
        ),
    ],
)
def test_a_field_of_the_wrong_kind_is_refused(changes: dict[str, object], problem: str) -> None:
    with pytest.raises(InvalidEventError, match=re.escape(problem)):
        ev(0, **changes)


def test_a_small_cap_is_a_valid_cap() -> None:
    assert ev(0, epsilon_cap=0.5).epsilon_cap == 0.5


def test_append_refuses_what_is_not_a_ledger_event(ledger: Ledger) -> None:
    with pytest.raises(InvalidEventError, match="expected a LedgerEvent, found dict"):
        ledger.append({"round": 0})  # type: ignore[arg-type]


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


def test_a_reader_sees_a_live_writers_events_from_other_threads(tmp_path: Path) -> None:
    """A report (read-only) while the coordinator writes: it reads the WAL too, and both
    connections may be used from any thread (the ledger serialises them with its lock)."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as writer:
        writer.append(ev(0))
        assert Path(f"{path}-wal").stat().st_size > 0  # not yet checkpointed
        with Ledger.open(path, read_only=True) as reader:
            seen: list[LedgerEvent] = []
            written: list[bool] = []

            def elsewhere() -> None:
                seen.extend(reader.events())
                written.append(writer.append(ev(1)))

            thread = threading.Thread(target=elsewhere)
            thread.start()
            thread.join()
            assert [e.round for e in seen] == [0] and written == [True]
            assert [e.round for e in reader.events()] == [0, 1]
            with pytest.raises(LedgerError, match="opened read-only, write refused"):
                reader.append(ev(2))


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


def test_refusals_name_the_site_round_and_field(ledger: Ledger) -> None:
    with pytest.raises(LedgerError, match=r"ledger .*: no events of site 'x'\."):
        ledger.site_delta("x")
    good = ev(0)
    with pytest.raises(
        InvalidEventError,
        match=re.escape("invalid ledger event (site 'a', run 'run-1', round 0): event='x' must be"),
    ):
        LedgerEvent(run_id="run-1", round=0, site_id="a", event="x", delta=DELTA)  # type: ignore[arg-type]
    assert ledger.append(good)


def test_an_unaccountable_site_is_named_in_the_warning(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    ledger.append(ev(0, site="site-7", sampling="shuffle"))
    with caplog.at_level("WARNING", logger="server.ledger"):
        assert not ledger.can_run(
            "site-7", sigma=5.0, q=0.01, steps=1, epsilon_cap=100.0, delta=DELTA
        )
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("ledger: site site-7 cannot be accounted (")
    assert "shuffle" in message and message.endswith("); not selected")


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
    and lands instead of failing with "database is locked". Written for the ledger's mutation
    run (the time-out dropped survived)."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append(ev(1))
        with _lock_held(path, "BEGIN IMMEDIATE"):
            led.append(ev(2))  # blocks until the holder commits, about 6 s
        assert [e.round for e in led.events()] == [1, 2]


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


def test_a_confirmation_logs_the_superseded_charge_of_another_mechanism(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """The unconfirmed charge a time-out left (the training mechanism) is superseded by the
    site's confirmed reply even when that reply is of another mechanism (its clip estimate)."""
    who = f"site 'a', run 'run-1', round 0, mechanism {QUANTILE_MECHANISM!r}"
    with caplog.at_level("INFO", logger="server.ledger"):
        ledger.append(ev(0, confirmed=False, code="no-reply"))
        ledger.append(ev(0, mechanism=QUANTILE_MECHANISM, steps=1))
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"ledger: {who} confirmed; its unconfirmed charge is superseded"]


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


def test_a_ledger_that_cannot_be_created_says_why(tmp_path: Path) -> None:
    """The ledger's folder would have to be made under a regular file."""
    (tmp_path / "state").write_text("not a folder")
    path = tmp_path / "state" / "ledger.sqlite"
    with pytest.raises(LedgerError) as info:
        Ledger.open(path)
    assert str(info.value).startswith(f"ledger {path}: cannot create it ([Errno 17] ")
    assert (tmp_path / "state").read_text() == "not a folder"


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


def test_a_read_that_sqlite_refuses_is_a_ledger_error(tmp_path: Path) -> None:
    """An operator renames the events table while a report holds the ledger open."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append(ev(1))
    with Ledger.open(path, read_only=True) as report:
        conn = sqlite3.connect(path)
        conn.execute("ALTER TABLE events RENAME TO events_kept")
        conn.commit()
        conn.close()
        with pytest.raises(LedgerError) as info:
            report.records()
    assert str(info.value) == f"ledger {path}: read failed (no such table: events)."


def test_an_event_the_database_refuses_is_an_invalid_event_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    """A valid event that the file refuses (here an operator's own trigger freezing the
    ledger): ``append`` raises ``InvalidEventError`` naming the file and SQLite's reason."""
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append(ev(0))
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TRIGGER operator_freeze BEFORE INSERT ON events BEGIN "
        "SELECT RAISE(ABORT, 'ledger frozen for the audit'); END"
    )
    conn.commit()
    conn.close()
    with Ledger.open(path) as led:
        with pytest.raises(InvalidEventError) as info:
            led.append(ev(1))
        assert str(info.value) == f"ledger {path}: event refused (ledger frozen for the audit)."
        assert [e.round for e in led.records()] == [0]
