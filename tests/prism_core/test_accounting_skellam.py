"""Accounting of secure-aggregation (Skellam) events: integer-order RDP for the whole history,
the collusion guarantee, and the calibration of the RDP-equivalent sigma."""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import replace

import pytest
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from prism_core.accounting import (
    SKELLAM_ORDERS,
    PrivacyEvent,
    calibrate_skellam_sigma,
    collusion_epsilon,
    epsilon,
    epsilon_report,
)
from prism_core.errors import PrivacyParameterError
from prism_core.records import SKELLAM_MECHANISM, SkellamShare

DELTA = 1e-5


def _skellam(sigma: float, q: float, steps: int, *, share: float | None = None, **kw):
    return PrivacyEvent(
        sigma,
        q,
        steps,
        mechanism=SKELLAM_MECHANISM,
        secure=SkellamShare(honest_sites=2, share_sigma=sigma if share is None else share),
        **kw,
    )


def _integer_rdp_epsilon(runs: list[tuple[float, float, int]], delta: float) -> float:
    """Opacus' ``compute_rdp`` at the integer orders 2..256, the runs added, converted by
    ``get_privacy_spent``: the value a history holding a Skellam event must get."""
    orders = list(range(2, 257))
    total = [0.0] * len(orders)
    for sigma, q, steps in runs:
        rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
        total = [t + r for t, r in zip(total, rdp, strict=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = get_privacy_spent(orders=orders, rdp=total, delta=delta)
    return float(eps)


def test_the_skellam_orders_are_the_integers_two_to_256():
    assert tuple(range(2, 257)) == SKELLAM_ORDERS


@pytest.mark.parametrize(("sigma", "q", "steps"), [(1.0, 0.01, 1000), (0.8, 0.05, 200)])
def test_a_skellam_history_is_integer_order_rdp_and_above_the_gaussian_prv(sigma, q, steps):
    """sigma = 1, q = 0.01, 1000 steps, delta 1e-5: the Skellam history's epsilon is the
    integer-order RDP value computed here (rel. 1e-9; 2.108), above the Gaussian history's PRV
    epsilon (1.838) at the same (sigma, q, steps), whichever accountant is asked."""
    history = [_skellam(sigma, q, steps)]
    expected = _integer_rdp_epsilon([(sigma, q, steps)], DELTA)
    gaussian_prv = epsilon([PrivacyEvent(sigma, q, steps)], DELTA)
    for accountant in ("prv", "rdp"):
        assert epsilon(history, DELTA, accountant=accountant) == pytest.approx(expected, rel=1e-9)
    assert epsilon(history, DELTA) >= gaussian_prv
    report = epsilon_report(history, DELTA)
    assert report.prv == pytest.approx(expected, rel=1e-9)
    assert report.rdp == pytest.approx(expected, rel=1e-9)
    if (sigma, q, steps) == (1.0, 0.01, 1000):
        assert (round(expected, 3), round(gaussian_prv, 3)) == (2.108, 1.838)


def test_a_mixed_gaussian_and_skellam_history_composes_at_integer_orders():
    """A Gaussian prefix (a clip estimate) then Skellam steps: the whole history is composed by
    integer-order RDP (rel. 1e-9), above either part alone, and a zero-step Skellam event
    changes nothing (the Gaussian history keeps its PRV value)."""
    gauss = PrivacyEvent(2.0, 0.02, 50)
    secure = _skellam(1.2, 0.01, 500)
    expected = _integer_rdp_epsilon([(2.0, 0.02, 50), (1.2, 0.01, 500)], DELTA)
    mixed = epsilon([gauss, secure], DELTA)
    assert mixed == pytest.approx(expected, rel=1e-9)
    assert mixed > epsilon([secure], DELTA)
    assert mixed > _integer_rdp_epsilon([(2.0, 0.02, 50)], DELTA)
    idle = replace(secure, steps=0)
    assert epsilon([gauss, idle], DELTA) == epsilon([gauss], DELTA)


def test_a_person_level_skellam_history_keeps_the_group_privacy_path():
    """Record-level Gaussian events then person-level Skellam events, ``group_size`` 3: finite,
    above the person-level part alone, and every part composed at integer orders (equal by
    either accountant, rel. 1e-12)."""
    history = [PrivacyEvent(1.5, 0.01, 100), _skellam(1.0, 0.01, 200, unit="user")]
    prv = epsilon(history, DELTA, group_size=3)
    rdp = epsilon(history, DELTA, accountant="rdp", group_size=3)
    assert math.isfinite(prv)
    assert prv == pytest.approx(rdp, rel=1e-12)
    assert prv > epsilon(history[1:], DELTA)


def test_collusion_epsilon_counts_only_the_share():
    """``collusion_epsilon`` is ``epsilon`` at ``share_sigma`` (rel. 1e-9), above ``epsilon``
    when the share is smaller, equal when ``share_sigma == noise_multiplier``, and equal to
    ``epsilon`` for a Gaussian history."""
    honest = _skellam(1.0, 0.01, 300, share=0.6)
    worst = collusion_epsilon([honest], DELTA)
    assert worst > epsilon([honest], DELTA)
    assert worst == pytest.approx(_integer_rdp_epsilon([(0.6, 0.01, 300)], DELTA), rel=1e-9)
    alone = _skellam(1.0, 0.01, 300, share=1.0)
    assert collusion_epsilon([alone], DELTA) == epsilon([alone], DELTA)
    gauss = [PrivacyEvent(1.0, 0.01, 300)]
    assert collusion_epsilon(gauss, DELTA) == epsilon(gauss, DELTA)
    assert collusion_epsilon([_skellam(1.0, 0.01, 3, share=0.0)], DELTA) == math.inf


@pytest.mark.parametrize(
    ("target", "q", "steps", "history"),
    [
        (2.0, 0.01, 1000, ()),
        (4.0, 0.05, 300, (PrivacyEvent(3.0, 0.02, 40),)),
    ],
)
def test_the_calibrated_skellam_sigma_hits_its_target(target, q, steps, history):
    """The history plus ``steps`` Skellam steps at the calibrated sigma spend at most the
    target and within 1 % of it (the default tolerance is 0.5 %)."""
    sigma = calibrate_skellam_sigma(
        target_epsilon=target, delta=DELTA, sample_rate=q, steps=steps, history=history
    )
    spent = epsilon([*history, _skellam(sigma, q, steps)], DELTA)
    assert 0.99 * target <= spent <= target


def test_the_skellam_calibration_refuses_a_spent_budget():
    with pytest.raises(PrivacyParameterError, match="earlier events alone spend"):
        calibrate_skellam_sigma(
            target_epsilon=0.5,
            delta=DELTA,
            sample_rate=0.01,
            steps=10,
            history=[PrivacyEvent(0.5, 0.5, 100)],
        )
    with pytest.raises(PrivacyParameterError, match="steps"):
        calibrate_skellam_sigma(target_epsilon=1.0, delta=DELTA, sample_rate=0.01, steps=0)


def test_a_skellam_event_carries_its_share_and_no_other_event_does():
    """The ``SkellamShare`` (H >= 1, 0 <= share sigma <= sigma) exists exactly on a Skellam
    event; the ledgers' columns read through to it and back."""
    event = _skellam(1.0, 0.01, 10, share=0.4)
    assert event.secure == SkellamShare(2, 0.4)
    columns = {"sigma": 1.0, "q": 0.01, "steps": 10, "mechanism": SKELLAM_MECHANISM}
    assert PrivacyEvent.from_columns({**columns, "honest_sites": 2, "share_sigma": 0.4}) == event
    with pytest.raises(PrivacyParameterError, match="needs its SkellamShare"):
        PrivacyEvent(1.0, 0.01, 10, mechanism=SKELLAM_MECHANISM)
    with pytest.raises(PrivacyParameterError, match="only a 'prism-tangent-skellam' event"):
        PrivacyEvent(1.0, 0.01, 10, secure=SkellamShare(2, 0.4))
    with pytest.raises(PrivacyParameterError, match=r"share_sigma=1.5 must be .* in \[0, noise"):
        _skellam(1.0, 0.01, 10, share=1.5)
    for h, share, what in ((0, 0.4, "honest_sites=0"), (2, -0.1, "share_sigma=-0.1")):
        with pytest.raises(PrivacyParameterError, match=re.escape(what)):
            SkellamShare(h, share)
    with pytest.raises(PrivacyParameterError, match=re.escape("share_sigma=None")):
        PrivacyEvent.from_columns({**columns, "honest_sites": 2})
