"""The ledger (``server.ledger.store.Ledger``): appends (duplicates not double counted,
conflicts refused, batches atomic, what the file refuses), run records, unconfirmed
charges (counted once, superseded by a confirmation of any mechanism), a round holding a
private clip estimate beside its training, reads (filters, the last confirmed event),
durability across reopening (a secure-aggregation event's honest sites and share sigma
included), a reader beside a live writer, and its log lines."""

from __future__ import annotations

import re
import sqlite3
import threading
from pathlib import Path

import pytest

from ledger.sample_events import DELTA, TRAIN, eps, epsilon_by_round, estimate, ev, unconfirmed
from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import SKELLAM_MECHANISM
from server.errors import InvalidEventError, LedgerConflictError, LedgerError
from server.ledger import LEDGER_APPLICATION_ID, Ledger, LedgerEvent


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


def test_an_event_altered_by_force_is_refused_by_the_ledger(ledger: Ledger) -> None:
    for name, value, field in [("noise_multiplier", -1.0, "sigma"), ("steps", 0.5, "steps")]:
        bad = ev(0)
        object.__setattr__(bad.event, name, value)
        with pytest.raises(InvalidEventError, match=field):
            ledger.append(bad)
    assert ledger.events() == []


def test_append_refuses_what_is_not_a_ledger_event(ledger: Ledger) -> None:
    with pytest.raises(InvalidEventError, match="expected a LedgerEvent, found dict"):
        ledger.append({"round": 0})  # type: ignore[arg-type]


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


def test_record_run(ledger: Ledger) -> None:
    assert ledger.record_run("run-1", {"rounds": 3, "lr": 0.1})
    assert not ledger.record_run("run-1", {"lr": 0.1, "rounds": 3})  # same config: no-op
    with pytest.raises(LedgerError, match="another config"):
        ledger.record_run("run-1", {"rounds": 4})
    with pytest.raises(InvalidEventError, match="JSON"):
        ledger.record_run("run-2", {"x": object()})
    ledger.append(ev(0, run_id="run-0"))
    assert ledger.run_ids() == ["run-1", "run-0"]


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


def test_a_secure_events_honest_sites_and_share_sigma_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    secure = ev(0, mechanism=SKELLAM_MECHANISM, honest_sites=3, share_sigma=0.45)
    with Ledger.open(path) as led:
        led.append_many([secure, ev(0, "b")])
    for read_only in (False, True):
        with Ledger.open(path, create=False, read_only=read_only) as led:
            a, b = led.events()
            assert a.same_facts(secure) and (a.honest_sites, a.share_sigma) == (3, 0.45)
            assert (b.mechanism, b.honest_sites, b.share_sigma) == (TRAIN, None, None)


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


def test_an_unconfirmed_charge_after_a_confirmed_event_of_another_mechanism_is_not_recorded(
    ledger: Ledger,
) -> None:
    assert ledger.append(ev(0, mechanism=QUANTILE_MECHANISM, steps=1))
    assert not ledger.append(ev(0, confirmed=False, code="no-reply"))
    assert len(ledger.records(site_id="a")) == 1


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
    assert epsilon_by_round(ledger, "a")[-1][1] == pytest.approx(ledger.epsilon("a").prv)


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
    assert epsilon_by_round(ledger, "a") == [
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
