"""A ledger event (``server.ledger.events``): the ranges and kinds of its fields and the
rules of confirmation, each refusal naming the site, round and field."""

from __future__ import annotations

import re

import pytest

from ledger.sample_events import DELTA, ev
from prism_core.errors import PrivacyParameterError
from server.errors import InvalidEventError, LedgerError
from server.ledger import Ledger, LedgerEvent


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
