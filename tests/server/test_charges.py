"""The coordinator's unconfirmed charges (``server.strategy.charges.Charges.unconfirmed``) on a
real SQLite ledger: what is recorded for a site that was asked and gave no valid answer, at
which parameters, when nothing is added, and what is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from ledger_events import ledger_event
from reply_facts import honest_facts

from prism_core.quantile import QUANTILE_MECHANISM
from server.errors import InvalidEventError, LedgerError, ReplyError
from server.ledger import UNKNOWN_Q, UNKNOWN_SIGMA, Ledger, LedgerEvent
from server.strategy.bounds import AutoClip
from server.strategy.charges import Charges
from server.strategy.rounds import RoundSummary

RUN = "run-2"
DELTA = 1e-5
MECHANISM = "ffa-gaussian"  # the run's mechanism: not the record's default
AUTO = AutoClip(low=0.1, high=10.0, steps=3, noise_multiplier=7.5)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger.open(tmp_path / "ledger.sqlite") as led:
        yield led


def charges(ledger: Ledger, auto_clip: AutoClip | None = None, run_id: str = RUN) -> Charges:
    return Charges(
        ledger=ledger,
        run_id=run_id,
        target_epsilon=8.0,
        delta=DELTA,
        mechanism=MECHANISM,
        auto_clip=auto_clip,
    )


def confirmed(site: str, rnd: int, run_id: str = RUN, **kw: object) -> LedgerEvent:
    args: dict[str, object] = dict(
        run_id=run_id,
        round=rnd,
        site_id=site,
        sigma=1.3,
        q=0.02,
        steps=40,
        delta=2e-6,
        epsilon_cap=4.0,
        rng="os-csprng",
        mechanism=MECHANISM,
    )
    args.update(kw)
    return ledger_event(**args)


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "server.strategy"]


def fields(e: LedgerEvent) -> dict[str, object]:
    """Every field but the time the ledger stored it."""
    return {k: v for k, v in vars(e).items() if k != "recorded_at"}


def test_a_site_never_confirmed_is_charged_at_unknown_parameters_and_named_in_the_summary(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    ledger.append(confirmed("b", 1))  # another site's parameters are not this site's
    summary = RoundSummary(server_round=2)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        charges(ledger).unconfirmed(2, "a", "no-reply", 25, summary)
    (event,) = ledger.events(site_id="a")
    expected = ledger_event(
        run_id=RUN,
        round=2,
        site_id="a",
        sigma=UNKNOWN_SIGMA,
        q=UNKNOWN_Q,
        steps=25,
        mechanism=MECHANISM,
        delta=DELTA,
        confirmed=False,
        params_known=False,
        code="no-reply",
    )
    assert fields(event) == fields(expected)
    assert summary.unconfirmed == ["a"]
    (record,) = [r for r in ours(caplog) if r.levelno == logging.WARNING]
    assert record.getMessage() == (
        "round 2: a charged 25 steps as UNCONFIRMED (no-reply), "
        "parameters unknown: epsilon unknown (worst case)"
    )


def test_a_known_site_is_charged_at_its_own_last_confirmed_parameters(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    # the site's last confirmed event is from another run; another site confirmed later
    ledger.append(confirmed("a", 1, run_id="run-1", sigma=0.9))
    ledger.append(confirmed("a", 2, run_id="run-1", sigma=1.1, q=0.03, epsilon_cap=None))
    other = dict(sigma=5.0, q=0.5, delta=1e-7, epsilon_cap=9.0, rng="reproducible")
    ledger.append(confirmed("b", 1, **other))
    summary = RoundSummary(server_round=1)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        charges(ledger).unconfirmed(1, "a", "error-reply-4003", 17, summary)
    event = ledger.events(site_id="a", run_id=RUN)[-1]
    last = ledger.events(site_id="a", run_id="run-1")[-1]
    expected = replace(
        last,
        run_id=RUN,
        round=1,
        event=replace(last.event, steps=17),
        confirmed=False,
        code="error-reply-4003",
    )
    assert fields(event) == fields(expected)
    assert event.epsilon_cap is None and event.delta == 2e-6 and event.rng == "os-csprng"
    assert summary.unconfirmed == ["a"]
    (record,) = [r for r in ours(caplog) if r.levelno == logging.WARNING]
    assert record.getMessage() == (
        "round 1: a charged 17 steps as UNCONFIRMED (error-reply-4003), "
        "at its last confirmed sigma=1.1, q=0.03"
    )


def test_the_cap_and_rng_of_the_last_confirmed_event_are_kept(ledger: Ledger) -> None:
    ledger.append(confirmed("a", 1, epsilon_cap=3.5, rng="reproducible"))
    charges(ledger).unconfirmed(2, "a", "no-reply", 40, RoundSummary(server_round=2))
    event = ledger.events(site_id="a")[-1]
    assert (event.confirmed, event.epsilon_cap, event.rng) == (False, 3.5, "reproducible")
    assert event.params_known


def test_a_re_run_round_already_confirmed_adds_nothing_and_says_so(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    ledger.append(confirmed("a", 3))
    before = [fields(e) for e in ledger.events()]
    summary = RoundSummary(server_round=3)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        charges(ledger).unconfirmed(3, "a", "no-reply", 40, summary)
    assert [fields(e) for e in ledger.events()] == before
    assert summary.unconfirmed == []
    (record,) = ours(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "round 3: a gave no valid answer this time (no-reply), but the ledger already holds "
        "its confirmed charge of this round (a re-run round): nothing to add"
    )


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(dict(site="b", rnd=3, run_id=RUN), id="another-site-same-round"),
        pytest.param(dict(site="a", rnd=3, run_id="run-1"), id="same-round-of-another-run"),
        pytest.param(dict(site="a", rnd=2, run_id=RUN), id="an-earlier-round-of-this-run"),
    ],
)
def test_only_this_sites_confirmed_charge_of_this_round_and_run_counts_as_a_re_run(
    ledger: Ledger, other: dict[str, object]
) -> None:
    site, rnd, run_id = other["site"], other["rnd"], other["run_id"]
    assert isinstance(site, str) and isinstance(rnd, int) and isinstance(run_id, str)
    ledger.append(confirmed(site, rnd, run_id=run_id))
    summary = RoundSummary(server_round=3)
    charges(ledger).unconfirmed(3, "a", "no-reply", 40, summary)
    charged = [e for e in ledger.events(site_id="a", run_id=RUN) if not e.confirmed]
    assert [(e.round, e.steps, e.code) for e in charged] == [(3, 40, "no-reply")]
    assert summary.unconfirmed == ["a"]


def test_a_ledger_that_cannot_write_is_logged_and_does_not_stop_the_round(
    ledger: Ledger, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(events: object) -> int:
        raise LedgerError("disk full")

    monkeypatch.setattr(ledger, "append_many", refuse)
    summary = RoundSummary(server_round=4)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        charges(ledger).unconfirmed(4, "a", "no-reply", 40, summary)
    assert summary.unconfirmed == ["a"]  # charged in the summary: the site was asked
    (record,) = ours(caplog)
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        "round 4: the unconfirmed charge of a could NOT be recorded: disk full"
    )


def test_with_auto_clip_a_site_without_a_confirmed_estimate_is_charged_one_too(
    ledger: Ledger,
) -> None:
    # a confirmed TRAINING row of this run (round 1), an estimate only of another site and of
    # another run: none of these is this site's estimate in this run
    ledger.append(confirmed("a", 1))
    ledger.append(confirmed("b", 1, mechanism=QUANTILE_MECHANISM, steps=3))
    ledger.append(confirmed("a", 1, run_id="run-1", mechanism=QUANTILE_MECHANISM, steps=3))
    charges(ledger, AUTO).unconfirmed(2, "a", "no-reply", 40, RoundSummary(server_round=2))
    new = [e for e in ledger.events(site_id="a", run_id=RUN) if not e.confirmed]
    last = ledger.last_confirmed("a")
    assert last is not None and last.run_id == RUN
    training = replace(
        last, round=2, event=replace(last.event, steps=40), confirmed=False, code="no-reply"
    )
    estimate = replace(
        training,
        event=replace(training.event, mechanism=QUANTILE_MECHANISM, noise_multiplier=7.5, steps=3),
    )
    assert [fields(e) for e in new] == [fields(estimate), fields(training)]
    assert new[0].q == last.q  # the site's last confirmed q


def test_with_auto_clip_a_confirmed_estimate_of_this_run_means_no_estimate_row(
    ledger: Ledger,
) -> None:
    ledger.append(confirmed("a", 1, mechanism=QUANTILE_MECHANISM, steps=3))
    ledger.append(confirmed("a", 1))
    charges(ledger, AUTO).unconfirmed(2, "a", "no-reply", 40, RoundSummary(server_round=2))
    new = [e for e in ledger.events(site_id="a", run_id=RUN) if not e.confirmed]
    assert [(e.mechanism, e.steps) for e in new] == [(MECHANISM, 40)]


def test_with_auto_clip_a_site_of_unknown_parameters_gets_no_estimate_row(
    ledger: Ledger,
) -> None:
    charges(ledger, AUTO).unconfirmed(1, "a", "no-reply", 40, RoundSummary(server_round=1))
    (event,) = ledger.events(site_id="a")
    assert (event.mechanism, event.params_known, event.sigma) == (MECHANISM, False, UNKNOWN_SIGMA)


def test_without_auto_clip_no_estimate_row_is_charged(ledger: Ledger) -> None:
    ledger.append(confirmed("a", 1))
    charges(ledger).unconfirmed(2, "a", "no-reply", 40, RoundSummary(server_round=2))
    new = [e for e in ledger.events(site_id="a") if not e.confirmed]
    assert [e.mechanism for e in new] == [MECHANISM]


# -- Charges.confirmed: a reply's own facts --------------------------------------------------


def reply(site: str = "a", **changes: object) -> dict[str, object]:
    """A checked ok reply's facts: the run's mechanism, and a cap other than the run's 8."""
    return honest_facts(site, None, **{"mechanism": MECHANISM, "epsilon_cap": 4.0, **changes})


def test_a_one_step_reply_is_charged_as_confirmed_with_its_own_facts(ledger: Ledger) -> None:
    charges(ledger).confirmed(3, reply(steps=1, sigma=1.3, q=0.02, delta=2e-6))
    (event,) = ledger.events(site_id="a")
    expected = ledger_event(
        run_id=RUN,
        round=3,
        site_id="a",
        sigma=1.3,
        q=0.02,
        steps=1,
        mechanism=MECHANISM,
        delta=2e-6,
        epsilon_cap=4.0,
        rng="os-csprng",
    )
    assert fields(event) == fields(expected)


def test_a_reply_that_ran_no_steps_is_not_charged(ledger: Ledger) -> None:
    charges(ledger).confirmed(3, reply(steps=0, status="refused", reason="cap-exhausted"))
    assert ledger.events() == []


@pytest.mark.parametrize(("stated", "stored"), [(4.0, 4.0), (0.5, 0.5), (None, 8.0), (0.0, None)])
def test_the_cap_stored_is_the_replys_the_runs_when_it_states_none_and_none_for_0(
    ledger: Ledger, stated: float | None, stored: float | None
) -> None:
    charges(ledger).confirmed(3, reply(epsilon_cap=stated))
    (event,) = ledger.events(site_id="a")
    assert event.epsilon_cap == stored


def test_a_private_clip_estimate_is_charged_as_its_own_row_before_the_steps(
    ledger: Ledger,
) -> None:
    facts = reply(steps=2, quantile_sigma=7.5, quantile_q=0.03, quantile_steps=3)
    charges(ledger, AUTO).confirmed(3, facts)
    estimate, training = ledger.events(site_id="a")
    assert (training.mechanism, training.sigma, training.q, training.steps) == (
        MECHANISM,
        1.0,
        0.05,
        2,
    )
    assert fields(estimate) == fields(
        replace(
            training,
            event=replace(
                training.event,
                mechanism=QUANTILE_MECHANISM,
                noise_multiplier=7.5,
                sample_rate=0.03,
                steps=3,
            ),
        )
    )
    assert estimate.confirmed and training.confirmed


def test_facts_the_ledger_refuses_are_a_facts_error_and_nothing_is_charged(
    ledger: Ledger,
) -> None:
    with pytest.raises(ReplyError, match=r"^accounting facts refused by the ledger: .*q") as info:
        charges(ledger).confirmed(3, reply(q=1.5))
    assert info.value.code == "facts"
    # an estimate the ledger refuses takes the round's steps with it: all or nothing
    facts = reply(quantile_sigma=7.5, quantile_q=2.0, quantile_steps=3)
    with pytest.raises(ReplyError) as info:
        charges(ledger, AUTO).confirmed(3, facts)
    assert info.value.code == "facts"
    assert ledger.events() == []


def test_a_row_the_ledger_refuses_when_writing_is_a_facts_error(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(events: object) -> int:
        raise InvalidEventError("bad row")

    monkeypatch.setattr(ledger, "append_many", refuse)
    with pytest.raises(ReplyError) as info:
        charges(ledger).confirmed(3, reply())
    assert (info.value.code, str(info.value)) == (
        "facts",
        "accounting facts refused by the ledger: bad row",
    )


def test_a_ledger_that_cannot_write_a_confirmed_charge_is_a_ledger_error_and_logged(
    ledger: Ledger, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(events: object) -> int:
        raise LedgerError("disk full")

    monkeypatch.setattr(ledger, "append_many", refuse)
    with (
        caplog.at_level(logging.INFO, logger="server.strategy"),
        pytest.raises(ReplyError) as info,
    ):
        charges(ledger).confirmed(3, reply())
    assert (info.value.code, str(info.value)) == (
        "ledger-error",
        "the ledger cannot record the charge (disk full)",
    )
    (record,) = ours(caplog)
    assert (record.levelno, record.getMessage()) == (
        logging.ERROR,
        "round 3: ledger write failed: disk full",
    )
