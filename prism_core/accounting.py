"""Privacy accounting: epsilon from a history of subsampled Gaussian steps (Thm 3.4, App. A.25).

Thin wrappers over Opacus' accountants and Google's ``dp_accounting``. The history is a list of
``PrivacyEvent``s (``prism_core.records``: sigma, q, steps); epsilon is always recomputed from
the whole history, never summed. PRV (Gopi et al. 2021) is the reported value, raised to
``dp_accounting``'s pessimistic PLD where that is larger (``PLD_VALUE_INTERVAL``); RDP is a
looser cross-check that must never be smaller, and the fallback where PRV cannot run. A history
holding a secure-aggregation (Skellam) event is composed by RDP at integer orders only
(``SKELLAM_ORDERS``), whatever accountant is asked for: the event's sigma is the RDP-equivalent
Gaussian multiplier of the Skellam noise (``prism_core.skellam_accounting.skellam_sigma``),
which bounds the Skellam mechanism's RDP at integer orders but not its privacy-loss
distribution, so PRV at that sigma is no valid bound. Knows nothing about tensors: the
mechanisms emit the same ``PrivacyEvent`` (one per step).
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld
from dp_accounting.privacy_accountant import NeighboringRelation
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.prv import (
    Domain,
    PoissonSubsampledGaussianPRV,
    compute_safe_domain_size,
)
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from prism_core.errors import AccountingError, PrivacyParameterError
from prism_core.records import (
    DEFAULT_UNIT,
    SKELLAM_MECHANISM,
    PrivacyEvent,
    SkellamShare,
)
from prism_core.skellam_accounting import DEFAULT_ORDERS

__all__ = [
    "SKELLAM_ORDERS",
    "EpsilonReport",
    "PrivacyEvent",
    "ReplaceOne",
    "calibrate_noise_multiplier",
    "calibrate_sigma",
    "calibrate_skellam_sigma",
    "collusion_epsilon",
    "compose_events",
    "epsilon",
    "epsilon_report",
    "group_privacy",
    "group_record_budget",
    "history_unit",
    "max_steps",
    "replace_one",
]

Accountant = Literal["prv", "rdp"]
_ACCOUNTANTS: tuple[str, ...] = get_args(Accountant)
_Method = Literal["prv", "prv-alone", "rdp", "rdp-integer"]
"""How ``_epsilon`` composes: an ``Accountant``, PRV without the PLD floor (``_PRV_ALONE``), or
RDP at ``SKELLAM_ORDERS``."""
_PRV_ALONE: _Method = "prv-alone"
"""PRV's value without ``_prv_charge``'s PLD floor: never above what ``epsilon`` reports and
equal to it wherever PRV's own bound holds, at a third of the cost. The searches
(``calibrate_noise_multiplier``, ``max_steps``) narrow with it, then confirm with ``epsilon``
(``_searched``)."""
_RdpMethod = Literal["rdp", "rdp-integer"]
"""What ``_accountant_epsilon`` computes: RDP at Opacus' orders, or at ``SKELLAM_ORDERS``."""
_INTEGER_RDP: _RdpMethod = "rdp-integer"

SKELLAM_ORDERS: tuple[int, ...] = DEFAULT_ORDERS
"""The integer RDP orders 2..256 at which a history holding a Skellam event is composed (the
subsampling bound that makes the Skellam event's sigma valid holds at integer orders only)."""

PRV_EPS_ERROR = 0.01
"""Discretisation error passed to Opacus' PRV accountant; its ``eps_upper`` bound is returned."""

SIGMA_MIN = 0.3
"""Smallest noise multiplier a site runs, calibrates to or accepts (``prism_runtime.ranges``).
Below it the PRV accountant's domain grows without bound (tens of GB) and it understates
epsilon (sigma 0.01: 708 where a PLD accountant gives 5,445); the epsilons there (tens and
more per step) protect nothing anyway."""

PRV_EPSILON_MAX = 64.0
"""PRV is evaluated only where RDP's epsilon is at most this: its memory grows with the
epsilon it must cover. Above, the RDP value (an upper bound) is returned."""

PRV_DELTA_MIN = 1e-12
"""PRV is evaluated only at a delta of at least this (Opacus refuses a delta its floating-point
error would dominate); a smaller delta, as group privacy's conversion asks for, is accounted by
RDP (an upper bound)."""

PRV_STEPS_MAX = 100_000
"""PRV is evaluated only for histories of at most this many steps (memory grows with them);
a longer history is accounted by RDP (an upper bound)."""

PLD_VALUE_INTERVAL = 1e-3
"""``value_discretization_interval`` of the ``dp_accounting`` PLD accountant that bounds PRV
from below (``epsilon``). Its pessimistic (connect-the-dots) discretisation is an upper bound at
any interval; at this one it costs about what PRV costs and lies within 0.001 of the value at
``dp_accounting``'s default 1e-4, about 0.01 (PRV's error) below PRV wherever PRV's own bound
holds, so there it changes nothing."""


@dataclass(frozen=True)
class EpsilonReport:
    """Epsilon of one history at one delta: ``prv``, the reported value (``epsilon``), and
    ``rdp``, the RDP cross-check."""

    delta: float
    prv: float
    rdp: float


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise PrivacyParameterError(f"delta={delta!r} must be in (0, 1), typically << 1/N")


def compose_events(events: Iterable[PrivacyEvent]) -> list[PrivacyEvent]:
    """Merge consecutive events equal in everything but ``steps``; drop zero-step events.

    Implements the composition bookkeeping of Thm 3.4 / App. A.25 of PRISM (T identical steps):
    the per-step events a mechanism emits compose into one event of T steps.
    """
    merged: list[PrivacyEvent] = []
    for e in events:
        if e.steps == 0:
            continue
        if merged and merged[-1].same_but_steps(e):
            merged[-1] = replace(merged[-1], steps=merged[-1].steps + e.steps)
        else:
            merged.append(e)
    return merged


def history_unit(history: Sequence[PrivacyEvent]) -> str:
    """The privacy unit of further steps after ``history``: its last event's (``DEFAULT_UNIT``
    for an empty history), so that they compose with it (``epsilon`` refuses mixed units)."""
    return history[-1].unit if history else DEFAULT_UNIT


def _accountant_key(history: Sequence[PrivacyEvent]) -> tuple[tuple[float, float, int], ...]:
    """``(sigma, q, steps)`` runs of a history, equal neighbours merged whatever their mechanism
    or clip (the accountant sees only sigma and q)."""
    key: list[tuple[float, float, int]] = []
    for e in history:
        if key and key[-1][:2] == (e.noise_multiplier, e.sample_rate):
            key[-1] = (e.noise_multiplier, e.sample_rate, key[-1][2] + e.steps)
        else:
            key.append((e.noise_multiplier, e.sample_rate, e.steps))
    return tuple(key)


_LOG_FLOAT_MAX = math.log(sys.float_info.max)
"""About 709.78: ``e^x`` is past the largest float for any larger x."""


def group_privacy(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """The ``(epsilon, delta)`` guarantee of a group of ``group_size`` units under a mechanism
    that is ``(epsilon, delta)``-DP per unit: ``(k epsilon, k e^((k-1) epsilon) delta)``
    (Dwork and Roth 2014, Lemma 2.2 generalised; Vadhan 2017, Lemma 2.3). A person with at
    most k records in a record-level run is protected at this level. A delta of 1 or more is
    no guarantee and is returned as 1 (also where ``e^((k-1) epsilon)`` is past any float)."""
    if group_size < 1:
        raise PrivacyParameterError(f"group_size={group_size!r} must be >= 1")
    k = group_size
    if math.isinf(epsilon):
        return math.inf, min(1.0, k * delta) if delta > 0 else 0.0
    if (k - 1) * epsilon > _LOG_FLOAT_MAX:  # e^((k-1) eps) is past any float: delta is 1
        return k * epsilon, 1.0 if delta > 0 else 0.0
    return k * epsilon, min(1.0, k * math.exp((k - 1) * epsilon) * delta)


def group_record_budget(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """The per-record ``(epsilon, delta)`` whose ``group_privacy`` at ``group_size`` is the
    per-person ``(epsilon, delta)``: ``(epsilon / k, delta / (k e^((k-1) epsilon / k)))``. The
    group-privacy baseline trains per record at this budget, each person capped at k records."""
    if group_size < 1:
        raise PrivacyParameterError(f"group_size={group_size!r} must be >= 1")
    k = group_size
    per_record = epsilon / k
    if (k - 1) * per_record > _LOG_FLOAT_MAX:  # the per-record delta underflows to 0
        return per_record, 0.0
    return per_record, delta / (k * math.exp((k - 1) * per_record))


GROUP_DELTA_SHARE = 0.5
"""At the person level, the share of delta given to the record-level events converted by
group privacy (``epsilon(..., group_size=k)``); the person-level events get the rest."""


def _per_person(
    events: Sequence[PrivacyEvent], delta: float, group_size: int, method: _Method
) -> float:
    """Epsilon per person of a history whose record-level events count by group privacy with
    ``group_size`` records per person, composed (basic composition: epsilons and deltas add)
    with the person-level events accounted together (conservative, never tighter).

    The per-record delta_r is the largest with ``k e^((k-1) eps_r(delta_r)) delta_r <= share
    delta``, found as the limit of a decreasing sequence from ``share delta / k`` along which
    eps_r grows. Where ``(k-1) eps_r`` passes ``_LOG_FLOAT_MAX`` on the way (a person with many
    records after an expensive record-level history: sigma 1, q 0.01, 100 steps and k = 10
    already), every delta_r that meets the condition costs ``k eps_r > 709 k / (k-1)`` per
    person, beyond what a float's ``e^epsilon`` can state: inf, no finite guarantee (a site
    then refuses every further charge, ``cap-exhausted``)."""
    records = [e for e in events if e.unit == "record"]
    people = [e for e in events if e.unit != "record"]
    share = GROUP_DELTA_SHARE if people else 1.0
    target = share * delta  # the converted events' delta: k e^((k-1) eps_r) delta_r <= target
    k = group_size
    delta_r = target / k
    eps_r = _unit_epsilon(records, delta_r, method)
    for _ in range(200):  # eps_r grows as delta_r shrinks: a fixed point from above
        if math.isinf(eps_r) or (k - 1) * eps_r > _LOG_FLOAT_MAX:
            return math.inf
        allowed = target / (k * math.exp((k - 1) * eps_r))
        if delta_r <= allowed * (1 + 1e-12):
            break
        delta_r = allowed
        eps_r = _unit_epsilon(records, delta_r, method)
    else:  # pragma: no cover - (k-1) eps_r grows without a fixed point only past any budget
        return math.inf
    rest = _unit_epsilon(people, delta - target, method) if people else 0.0
    return k * eps_r + rest


def _holds_skellam(events: Iterable[PrivacyEvent]) -> bool:
    """Whether a step of ``events`` ran the Skellam mechanism (secure aggregation)."""
    return any(e.mechanism == SKELLAM_MECHANISM and e.steps > 0 for e in events)


def epsilon(
    events: Sequence[PrivacyEvent],
    delta: float,
    *,
    accountant: Accountant = "prv",
    group_size: int | None = None,
) -> float:
    """Epsilon after composing every event, at the given delta.

    Implements the composition of Thm 3.4 with Opacus' PRV (default) or RDP accountant. PRV's
    value is raised to ``dp_accounting``'s pessimistic PLD where that is larger, and replaced
    by RDP's where PRV cannot run or Opacus refuses the history (``_prv_charge``).

    A history holding a step of ``SKELLAM_MECHANISM`` (secure aggregation) is composed WHOLE
    (its Gaussian events too) by RDP at the integer orders ``SKELLAM_ORDERS``
    (``opacus.accountants.analysis.rdp.compute_rdp`` and ``get_privacy_spent``), whatever
    ``accountant`` asks: a Skellam event's sigma is the RDP-equivalent Gaussian multiplier
    (``prism_core.skellam_accounting.skellam_sigma``), whose sampled-Gaussian RDP bounds the
    Poisson-subsampled Skellam mechanism's at integer orders only; PRV at that sigma accounts a
    Gaussian privacy-loss distribution the Skellam mechanism does not have, so it is no valid
    bound. Both accountants then give the same value.

    Args:
        events: the history.
        delta: the delta of the guarantee.
        accountant: ``"prv"`` (reported, with its PLD floor and RDP fallback) or ``"rdp"``
            (the cross-check).
        group_size: epsilon PER PERSON of a history that holds record-level events, a person
            having at most this many records: the record-level events count by group privacy
            (``group_privacy``, with ``GROUP_DELTA_SHARE`` of delta when person-level events
            follow them) and compose with the person-level events by adding epsilons (a site
            switched from ``record`` to ``user``; docs/design.md §3.2). None: the history must
            hold one unit.

    Returns:
        0.0 for an empty history, ``inf`` if any step ran without noise.

    Raises:
        AccountingError: for a history that mixes privacy units without ``group_size``
            (record-level events convert to a person-level guarantee only by group privacy,
            never silently), or an accountant other than ``"prv"`` and ``"rdp"``.
    """
    _check_delta(delta)
    if accountant not in _ACCOUNTANTS:
        raise AccountingError(f"accountant={accountant!r}: use 'prv' (reported) or 'rdp'")
    method: _Method = _INTEGER_RDP if _holds_skellam(events) else accountant
    return _epsilon(events, delta, method, group_size)


def _epsilon(
    events: Sequence[PrivacyEvent], delta: float, method: _Method, group_size: int | None
) -> float:
    """``epsilon`` by ``method``, its arguments checked."""
    if group_size is not None and any(e.unit == "record" and e.steps > 0 for e in events):
        return _per_person(events, delta, group_size, method)
    return _unit_epsilon(events, delta, method)


def _unit_epsilon(events: Sequence[PrivacyEvent], delta: float, method: _Method) -> float:
    """Epsilon of a history of one privacy unit by ``method`` (``epsilon``'s checks)."""
    history = [e for e in events if e.steps > 0]  # _accountant_key merges equal neighbours
    units = sorted({e.unit for e in history})
    if len(units) > 1:
        raise AccountingError(
            f"cannot compose events of privacy units {units} into one epsilon: an epsilon per "
            "record and one per user are different guarantees"
        )
    if not history:
        return 0.0
    if any(e.noise_multiplier == 0 for e in history):
        return math.inf
    key = _accountant_key(history)
    if method == "prv":
        return _prv_charge(key, delta)
    if method == _PRV_ALONE:
        return _prv_charge(key, delta, floor=False)
    return _accountant_epsilon(key, delta, method)


def _search_epsilon(
    events: Sequence[PrivacyEvent], delta: float, group_size: int | None = None
) -> float:
    """``epsilon`` (PRV) of ``events`` without the PLD floor (``_PRV_ALONE``): a lower bound of
    it that the searches narrow with before they confirm with ``epsilon``."""
    method: _Method = _INTEGER_RDP if _holds_skellam(events) else _PRV_ALONE
    return _epsilon(events, delta, method, group_size)


def _prv_charge(
    history: tuple[tuple[float, float, int], ...], delta: float, *, floor: bool = True
) -> float:
    """The epsilon ``epsilon`` reports for ``history`` when PRV is asked.

    PRV's ``eps_upper`` where it fits (``_prv_fits``), or ``dp_accounting``'s pessimistic PLD
    (add/remove, ``PLD_VALUE_INTERVAL``) where that is LARGER: Opacus derives PRV's domain from
    an RDP bound by a rule its own source marks as not always matching the theory, and at small
    sigma, small q, many steps and a small delta its truncation loses mass; there PRV's
    ``eps_upper`` falls below a pessimistic PLD (sigma 0.4, q 1e-3, 30,000 steps, delta 1e-10:
    PRV 33.67, PLD 33.69; sigma 0.5, q 1e-3, 100,000 steps: PRV 20.88, PLD 20.96), by more
    than PRV's stated error. The pessimistic PLD is an upper bound by construction, so the
    larger of the two is one as well. RDP (an upper bound) where PRV does not fit or Opacus
    refuses the history (``_prv_epsilon``). Each value is memoised per process. ``floor=False``:
    PRV alone where it runs (``_PRV_ALONE``).
    """
    if _prv_fits(history, delta):
        prv = _prv_epsilon(history, delta)
        if prv is not None:
            return max(prv, _pld_epsilon(history, delta, _ADD_REMOVE)) if floor else prv
    return _accountant_epsilon(history, delta, "rdp")


ReplaceOneMethod = Literal["pld", "group-privacy"]
"""How ``replace_one`` reached its guarantee."""


@dataclass(frozen=True)
class ReplaceOne:
    """An ``(epsilon, delta)`` guarantee under REPLACE-ONE adjacency (two datasets of the same
    size that differ in one unit) and how it was reached (``replace_one``)."""

    epsilon: float
    delta: float
    method: ReplaceOneMethod


def replace_one(events: Sequence[PrivacyEvent], delta: float) -> ReplaceOne:
    """The replace-one guarantee of a history: what a party that knows the shard size N learns.

    Implements the composition of Thm 3.4 of PRISM under replace-one adjacency. Each event is
    ``steps`` Poisson-subsampled Gaussian steps whose units contribute at most C each (a clip,
    or a count): replacing one unit moves the sum by its contribution and that of its
    replacement, both present exactly when the slot is sampled. ``dp_accounting``'s PLD
    accountant under ``NeighboringRelation.REPLACE_ONE`` accounts exactly that pair
    (``(1-q) N(0) + q N(-C)`` against ``(1-q) N(0) + q N(C)``; q = 1: a Gaussian of
    sensitivity 2C), pessimistically at ``PLD_VALUE_INTERVAL``: method ``"pld"``, at ``delta``
    itself. This is 1.8-2x tighter than group privacy at the same delta (SST-2-like: q 0.0076,
    30 steps, sigma 0.58: 3.02 against 5.98; docs/security.md).

    Group privacy of two (``(2 eps, (1 + e^eps) delta)`` with eps the add/remove epsilon,
    ``epsilon``: remove the unit, then add another) where no direct accountant applies: a
    history holding a Skellam (secure-aggregation) event, whose RDP-equivalent sigma bounds
    RDP and not a privacy-loss distribution, or one outside the bounds within which PRV and
    the PLD are used (``SIGMA_MIN``, ``PRV_STEPS_MAX``, ``PRV_EPSILON_MAX``): method
    ``"group-privacy"``.

    Returns:
        ``ReplaceOne(0, delta, "pld")`` for an empty history; ``(inf, 1, "pld")`` if a step
        ran without noise.

    Raises:
        AccountingError: a history that mixes privacy units (as ``epsilon``).
        PrivacyParameterError: delta outside (0, 1).
    """
    _check_delta(delta)
    history = [e for e in events if e.steps > 0]
    units = sorted({e.unit for e in history})
    if len(units) > 1:
        raise AccountingError(
            f"cannot compose events of privacy units {units} into one epsilon: an epsilon per "
            "record and one per user are different guarantees"
        )
    if not history:
        return ReplaceOne(0.0, delta, "pld")
    if any(e.noise_multiplier == 0 for e in history):
        return ReplaceOne(math.inf, 1.0, "pld")
    key = _accountant_key(history)
    if not _holds_skellam(history) and _pld_fits(key, delta):
        return ReplaceOne(_pld_epsilon(key, delta, _REPLACE_ONE), delta, "pld")
    eps = epsilon(history, delta)
    if not math.isfinite(eps):
        return ReplaceOne(math.inf, 1.0, "group-privacy")
    if eps > _LOG_FLOAT_MAX:
        return ReplaceOne(2.0 * eps, 1.0, "group-privacy")
    return ReplaceOne(2.0 * eps, min(1.0, (1.0 + math.exp(eps)) * delta), "group-privacy")


def _pld_fits(history: tuple[tuple[float, float, int], ...], delta: float) -> bool:
    """Whether the replace-one PLD runs in bounded memory: the bounds of ``_prv_fits`` that
    keep its domain small (every sigma at least ``SIGMA_MIN``, at most ``PRV_STEPS_MAX``
    steps, RDP's add/remove epsilon at most ``PRV_EPSILON_MAX``; replace-one's is at most
    twice that)."""
    if any(sigma < SIGMA_MIN for sigma, _, _ in history):
        return False
    if sum(steps for _, _, steps in history) > PRV_STEPS_MAX:
        return False
    return _accountant_epsilon(history, delta, "rdp") <= PRV_EPSILON_MAX


def collusion_epsilon(
    events: Sequence[PrivacyEvent], delta: float, *, group_size: int | None = None
) -> float:
    """Epsilon if every other site colluded with the coordinator: each Skellam event counts
    only the site's own noise share.

    Implements the secure-aggregation guarantee of docs/design.md §3.3 without its honesty
    assumption: ``epsilon`` of the history with every ``SKELLAM_MECHANISM`` event's
    ``noise_multiplier`` replaced by its ``secure.share_sigma`` (the RDP-equivalent multiplier
    of the site's share alone), composed like ``epsilon`` (integer-order RDP). At least
    ``epsilon(events, delta)`` (``share_sigma <= noise_multiplier``); equal to it for a history
    without Skellam events.

    Raises:
        AccountingError, PrivacyParameterError: as ``epsilon``.
    """
    alone = [
        replace(e, noise_multiplier=e.secure.share_sigma) if e.secure is not None else e
        for e in events
    ]
    return epsilon(alone, delta, group_size=group_size)


def _prv_fits(history: tuple[tuple[float, float, int], ...], delta: float) -> bool:
    """Whether PRV can account ``history`` in bounded memory and time, and validly.

    PRV's domain (and its FFT arrays) grow with the epsilon it must cover and the number of
    steps: it is used only when every sigma is at least ``SIGMA_MIN``, the steps are at most
    ``PRV_STEPS_MAX``, delta is at least ``PRV_DELTA_MIN``, RDP's epsilon (an upper bound,
    cheap at any size) is at most ``PRV_EPSILON_MAX``, and Opacus accepts the discretisation
    at this delta (``_prv_domain_fits``). Everywhere else ``epsilon`` returns RDP's value:
    larger, never wrong.
    """
    if delta < PRV_DELTA_MIN or any(sigma < SIGMA_MIN for sigma, _, _ in history):
        return False
    if sum(steps for _, _, steps in history) > PRV_STEPS_MAX:
        return False
    if _accountant_epsilon(history, delta, "rdp") > PRV_EPSILON_MAX:
        return False
    return _prv_domain_fits(history, delta)


def _prv_delta_error(delta: float) -> float:
    """The delta error Opacus' ``PRVAccountant.get_epsilon`` uses by default: delta / 1000."""
    return delta / 1000


@functools.lru_cache(maxsize=4096)
def _prv_domain_fits(history: tuple[tuple[float, float, int], ...], delta: float) -> bool:
    """Whether Opacus' PRV accountant accepts ``history`` at ``delta``: it refuses (``Floating
    point errors will dominate``) when its discretisation has so many points ``n`` that
    ``n eps_longdouble > delta - delta_error`` (e.g. sigma 1, q 0.01, 100,000 steps at delta
    1e-12: 12.6 million points). ``n`` follows Opacus' own rule (its public
    ``compute_safe_domain_size`` and ``Domain``, with the mesh of ``PRVAccountant``) in a few
    milliseconds, where building the PRV before the refusal takes seconds."""
    delta_error = _prv_delta_error(delta)
    prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
    steps = [s for _, _, s in history]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Opacus' "optimal order" warnings
        half_width = compute_safe_domain_size(
            prvs, steps, eps_error=PRV_EPS_ERROR, delta_error=delta_error
        )
    mesh = PRV_EPS_ERROR / math.sqrt(sum(steps) * math.log(12 / delta_error) / 2)
    size = Domain.create_aligned(-half_width, half_width, mesh).size
    return bool(np.finfo(np.longdouble).eps * size <= delta - delta_error)


@functools.lru_cache(maxsize=4096)
def _prv_epsilon(history: tuple[tuple[float, float, int], ...], delta: float) -> float | None:
    """Opacus' PRV ``eps_upper`` for a composed history, or None where Opacus refuses it (a
    ``ValueError`` or ``RuntimeError`` from its discretisation); memoised, the refusal too.

    A PRV evaluation costs about 0.1 s (its safe domain comes from an RDP sweep), and a site or
    the coordinator asks for the same history several times per round (budget check, ledger,
    report), so equal questions are answered once per process.
    """
    prv = PRVAccountant()
    prv.history = list(history)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Opacus' "optimal order" warnings
            value = float(prv.get_epsilon(delta=delta, eps_error=PRV_EPS_ERROR))
    except (ValueError, RuntimeError):
        return None
    return max(0.0, value)  # as _accountant_epsilon: a negative epsilon holds at 0


_ADD_REMOVE = "add-remove"
_REPLACE_ONE = "replace-one"
_PLD_RELATIONS = {
    _ADD_REMOVE: NeighboringRelation.ADD_OR_REMOVE_ONE,
    _REPLACE_ONE: NeighboringRelation.REPLACE_ONE,
}
"""The neighbouring relations ``_pld_epsilon`` accounts, by name."""


@functools.lru_cache(maxsize=64)
def _step_pld(sigma: float, q: float, relation: str) -> pld.PrivacyLossDistribution:
    """``dp_accounting``'s pessimistic PLD of ONE Poisson-subsampled Gaussian step (sigma, q)
    under ``relation`` at ``PLD_VALUE_INTERVAL``, as its ``PLDAccountant`` builds it; memoised
    (building it is about half the cost of an epsilon, and a ledger repeats its pairs)."""
    return pld.from_gaussian_mechanism(
        standard_deviation=sigma,
        sampling_prob=q,
        value_discretization_interval=PLD_VALUE_INTERVAL,
        neighboring_relation=_PLD_RELATIONS[relation],
    )


@functools.lru_cache(maxsize=4096)
def _pld_epsilon(
    history: tuple[tuple[float, float, int], ...], delta: float, relation: str
) -> float:
    """``dp_accounting``'s epsilon of a composed history of Poisson-subsampled Gaussian steps
    (a Gaussian step at q = 1) under ``relation`` (``_PLD_RELATIONS``), at
    ``PLD_VALUE_INTERVAL`` with its pessimistic estimate (an upper bound); memoised.

    Composed as ``dp_accounting``'s ``PLDAccountant`` composes: a run of T steps at q < 1 is
    the one-step PLD (``_step_pld``) self-composed T times, at q = 1 the Gaussian of
    multiplier sigma / sqrt(T). Equal ``(sigma, q)`` runs are composed together wherever they
    stand (composition commutes), so there is one PLD per distinct pair.
    """
    runs: dict[tuple[float, float], int] = {}
    for sigma, q, steps in history:
        runs[(sigma, q)] = runs.get((sigma, q), 0) + steps
    total = pld.identity(value_discretization_interval=PLD_VALUE_INTERVAL)
    for (sigma, q), steps in runs.items():
        if q == 1.0:
            part = pld.from_gaussian_mechanism(
                standard_deviation=sigma / math.sqrt(steps),
                value_discretization_interval=PLD_VALUE_INTERVAL,
                neighboring_relation=_PLD_RELATIONS[relation],
            )
        else:
            part = _step_pld(sigma, q, relation).self_compose(steps)
        total = total.compose(part)
    return max(0.0, float(total.get_epsilon_for_delta(delta)))


@functools.lru_cache(maxsize=4096)
def _integer_rdp_step(sigma: float, q: float) -> tuple[float, ...]:
    """Opacus' RDP of one sampled-Gaussian step at each of ``SKELLAM_ORDERS``; memoised (about
    0.05 s per pair, and a history repeats its pairs)."""
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(SKELLAM_ORDERS))
    return tuple(float(r) for r in rdp)


def _integer_rdp_epsilon(history: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """Epsilon of a composed history by RDP at the integer orders ``SKELLAM_ORDERS``: the runs'
    curves added order by order, converted by Opacus' ``get_privacy_spent`` (Balle et al.
    2020, Thm 21)."""
    total = [0.0] * len(SKELLAM_ORDERS)
    for sigma, q, steps in history:
        total = [t + steps * r for t, r in zip(total, _integer_rdp_step(sigma, q), strict=True)]
    eps, _ = get_privacy_spent(orders=list(SKELLAM_ORDERS), rdp=total, delta=delta)
    return float(eps)


@functools.lru_cache(maxsize=4096)
@functools.lru_cache(maxsize=4096)
def _accountant_epsilon(
    history: tuple[tuple[float, float, int], ...], delta: float, accountant: _RdpMethod
) -> float:
    """Opacus' RDP epsilon for a composed history (``"rdp"``, or ``_INTEGER_RDP`` at
    ``SKELLAM_ORDERS``); memoised (a pure function of its arguments). PRV: ``_prv_epsilon``.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Opacus' "optimal order" warnings
        if accountant == _INTEGER_RDP:
            value = _integer_rdp_epsilon(history, delta)
        else:
            rdp = RDPAccountant()
            rdp.history = list(history)
            value = float(rdp.get_epsilon(delta=delta))
    # At a large delta both accountants can return a NEGATIVE epsilon (e.g. -0.69 at delta 0.5,
    # from their conversion terms); a guarantee at epsilon < 0 holds at 0, which is what is meant.
    return max(0.0, value)


def epsilon_report(
    events: Sequence[PrivacyEvent], delta: float, *, group_size: int | None = None
) -> EpsilonReport:
    """PRV epsilon with the RDP cross-check; raises if RDP is smaller than PRV.

    Implements the accounting of Thm 3.4 / App. A.25 of PRISM with two accountants.

    ``prv`` is the reported value (``epsilon``: PRV, raised to the pessimistic PLD where that is
    larger). RDP is an upper bound on the true epsilon and PRV a tight (upper) estimate, so
    ``rdp >= prv`` must hold (up to PRV's discretisation error ``PRV_EPS_ERROR``). For a history
    holding a Skellam event both fields hold the integer-order RDP value (``epsilon``).

    Raises:
        AccountingError: if the two accountants disagree in the impossible direction.
    """
    prv = epsilon(events, delta, accountant="prv", group_size=group_size)
    rdp = epsilon(events, delta, accountant="rdp", group_size=group_size)
    if rdp + PRV_EPS_ERROR < prv:
        raise AccountingError(f"RDP epsilon {rdp:.4f} < PRV epsilon {prv:.4f}: accountant failure")
    return EpsilonReport(delta=delta, prv=prv, rdp=rdp)


def _check_calibration(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, relative_tolerance: float
) -> None:
    """The arguments every calibration shares, each in its range."""
    _check_target(target_epsilon, relative_tolerance)
    if steps < 1:
        raise PrivacyParameterError(f"steps={steps!r} must be >= 1 to calibrate a noise multiplier")
    if not 0 < sample_rate <= 1:
        raise PrivacyParameterError(f"sample_rate={sample_rate!r} must be in (0, 1]")
    _check_delta(delta)


def _check_target(target_epsilon: float, relative_tolerance: float) -> None:
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise PrivacyParameterError(
            f"target_epsilon={target_epsilon!r} must be a finite number > 0"
        )
    if not 0 < relative_tolerance < 1:  # 0 would never end the bisection
        raise PrivacyParameterError(
            f"relative_tolerance={relative_tolerance!r} must be in (0, 1), e.g. 0.005"
        )


_SIGMA_SEARCH_MAX = 1e6
"""The largest sigma the calibration tries before it calls the budget too small."""


def calibrate_sigma(
    epsilon_at: Callable[[float], float],
    *,
    target_epsilon: float,
    relative_tolerance: float = 0.005,
    low: float = 0.0,
    first: float | None = None,
    what: str = "the target",
) -> float:
    """Smallest sigma (to a tolerance) with ``epsilon_at(sigma) <= target_epsilon``, never below
    ``SIGMA_MIN``.

    Implements the calibration side of Thm 3.4 of PRISM (sigma for a target epsilon) for any
    mechanism whose epsilon decreases in sigma: ``epsilon_at`` builds the events of one sigma
    (on top of any history) and accounts them. The search is Opacus' ``get_noise_multiplier``:
    ``max(low, SIGMA_MIN)`` is returned when it meets the target; otherwise sigma doubles from
    ``first`` (default ``2 max(10, low)``) until its epsilon is below the target, then
    bisection from ``low`` (a sigma at or below the answer) narrows the two ends until the
    upper end's epsilon lies in ``[(1 - relative_tolerance) target, target]``, or, where
    epsilon jumps over that band (PRV is a discretised estimate), until the ends meet to 1e-9
    relative. The upper end is returned.

    Args:
        epsilon_at: epsilon of the events at one sigma, decreasing in sigma.
        target_epsilon: the epsilon not to exceed.
        relative_tolerance: the width of the band below the target, relative to it.
        low: a sigma whose epsilon is at or above the target (or 0).
        first: the first upper end tried, for a search that knows the answer is near ``low``.
        what: the target in words, for the error.

    Raises:
        PrivacyParameterError: a target or tolerance out of range, or no sigma up to 10^6
            meets the target.
    """
    _check_target(target_epsilon, relative_tolerance)
    floor = max(low, SIGMA_MIN)
    if epsilon_at(floor) <= target_epsilon:
        return floor
    tolerance = relative_tolerance * target_epsilon
    sigma_low, sigma_high, eps_high = low, first / 2 if first else max(10.0, low), math.inf
    while eps_high > target_epsilon:
        sigma_high *= 2
        eps_high = epsilon_at(sigma_high)
        if sigma_high > _SIGMA_SEARCH_MAX:
            raise PrivacyParameterError(
                f"cannot reach {what}: the privacy budget is too low. Raise the budget or lower "
                "the steps or the sampling rate."
            )
    while target_epsilon - eps_high > tolerance and sigma_high - sigma_low > 1e-9 * sigma_high:
        sigma = (sigma_low + sigma_high) / 2
        eps = epsilon_at(sigma)
        if eps < target_epsilon:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    return sigma_high


def _check_room(spent: float, *, target_epsilon: float, delta: float, steps: int) -> None:
    """Refuse a history whose epsilon ``spent`` (with its accountant) reaches the target."""
    if not spent < target_epsilon:
        raise PrivacyParameterError(
            f"the earlier events alone spend epsilon={spent:.4f} of the target {target_epsilon} "
            f"at delta={delta}: no noise multiplier leaves room for {steps} more steps. Raise "
            "the budget or make the earlier events cheaper."
        )


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    relative_tolerance: float = 0.005,
    history: Sequence[PrivacyEvent] = (),
) -> float:
    """Smallest sigma (to a tolerance) whose PRV epsilon after ``history`` and ``steps``
    Poisson-subsampled Gaussian steps at rate ``sample_rate`` stays below the target.

    ``calibrate_sigma`` through ``epsilon`` (PRV, the accountant that reports epsilon, within
    its memory bounds), so the epsilon lies in ``[(1 - relative_tolerance) target, target]``,
    unless the history alone comes that close. With a ``history`` (events that run before these
    steps, e.g. a private clip estimate), the search starts from the sigma without it (a lower
    end: the history only adds to epsilon).

    Raises:
        PrivacyParameterError: for a non-positive target or steps, a budget too small, or a
            history that alone spends the target.
    """
    _check_calibration(target_epsilon, delta, sample_rate, steps, relative_tolerance)
    earlier = list(history) if compose_events(history) else []
    low = 0.0
    if earlier:
        spent = epsilon(earlier, delta)
        _check_room(spent, target_epsilon=target_epsilon, delta=delta, steps=steps)
        low = calibrate_noise_multiplier(
            target_epsilon=target_epsilon,
            delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            relative_tolerance=relative_tolerance,
        )
    unit = history_unit(earlier)

    def events_at(sigma: float) -> list[PrivacyEvent]:
        return [*earlier, PrivacyEvent(sigma, sample_rate, steps, unit=unit)]

    search = functools.partial(
        calibrate_sigma,
        target_epsilon=target_epsilon,
        relative_tolerance=relative_tolerance,
        what=(
            f"epsilon={target_epsilon} at delta={delta} with q={sample_rate}, {steps} steps"
            + (f" after {len(earlier)} earlier events" if earlier else "")
        ),
    )
    # Narrow with PRV alone (never above epsilon), then confirm with epsilon: where the PLD
    # floor is larger the answer needs more noise, and the search goes on from there.
    sigma = search(
        lambda s: _search_epsilon(events_at(s), delta),
        low=low,
        first=2 * low if earlier else None,
    )
    if epsilon(events_at(sigma), delta) <= target_epsilon:
        return sigma
    return search(lambda s: epsilon(events_at(s), delta), low=sigma, first=2 * sigma)


def calibrate_skellam_sigma(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    history: Sequence[PrivacyEvent] = (),
    relative_tolerance: float = 0.005,
) -> float:
    """Smallest RDP-equivalent sigma (to a tolerance) of ``steps`` Skellam steps at rate
    ``sample_rate`` whose epsilon after ``history`` stays below the target.

    The calibration for the secure sum of docs/design.md §3.3: ``calibrate_sigma`` from
    ``SIGMA_MIN`` over ``history`` plus the ``steps`` (``SKELLAM_MECHANISM`` events at sigma
    and q) composed as ``epsilon`` composes a history holding a Skellam event, by RDP at the
    integer orders ``SKELLAM_ORDERS``. The sites' Skellam parameter for the sigma returned is
    ``prism_core.skellam_accounting.skellam_mu``.

    Raises:
        PrivacyParameterError: for a non-positive target or steps, a budget too small, or a
            history that alone spends the target.
        AccountingError: for a history ``epsilon`` refuses.
    """
    _check_calibration(target_epsilon, delta, sample_rate, steps, relative_tolerance)
    earlier = list(history)
    spent = _epsilon(earlier, delta, _INTEGER_RDP, None)  # as epsilon composes Skellam
    _check_room(spent, target_epsilon=target_epsilon, delta=delta, steps=steps)
    unit = history_unit(earlier)

    def eps_at(sigma: float) -> float:
        # epsilon reads sigma alone; the share stated is that of one honest site (all of it)
        alone = SkellamShare(honest_sites=1, share_sigma=sigma)
        more = PrivacyEvent(
            sigma, sample_rate, steps, mechanism=SKELLAM_MECHANISM, unit=unit, secure=alone
        )
        return epsilon([*earlier, more], delta)

    return calibrate_sigma(
        eps_at,
        target_epsilon=target_epsilon,
        relative_tolerance=relative_tolerance,
        low=SIGMA_MIN,
        what=(
            f"epsilon={target_epsilon} at delta={delta} with {steps} Skellam steps at "
            f"q={sample_rate} after {len(earlier)} earlier events"
        ),
    )


def max_steps(
    history: Sequence[PrivacyEvent],
    *,
    noise_multiplier: float,
    sample_rate: float,
    delta: float,
    target_epsilon: float,
    limit: int,
    unit: str | None = None,
    group_size: int | None = None,
) -> int:
    """Largest ``k <= limit`` such that ``history`` plus ``k`` more steps stays within the target.

    Implements the budget check of Thm 3.4 of PRISM (composition of T steps).

    The steps are Poisson-subsampled Gaussian steps with the given sigma and q (of the
    history's unit, ``history_unit``), composed with
    the whole history by ``epsilon`` (PRV, with its PLD floor); found by bisection, since
    epsilon grows with k: first with PRV alone (never above ``epsilon``, so no larger k fits),
    then confirmed with ``epsilon`` and, where its PLD floor is larger, narrowed below. Returns
    0 when not even one more step fits. ``unit``: the steps' privacy unit (default the
    history's); ``group_size`` as in ``epsilon``.
    """
    step_unit = unit if unit is not None else history_unit(history)
    if limit < 0:
        raise PrivacyParameterError(f"limit={limit!r} must be >= 0")

    def fits(k: int, measure: Callable[..., float] = epsilon) -> bool:
        extra = [PrivacyEvent(noise_multiplier, sample_rate, k, unit=step_unit)]
        return measure([*history, *extra], delta, group_size=group_size) <= target_epsilon

    found = _largest_fitting(functools.partial(fits, measure=_search_epsilon), limit)
    if found == 0 or fits(found):
        return found
    return _largest_fitting(fits, found - 1)


def _largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest ``k <= limit`` with ``fits(k)`` (0 if not even 1), ``fits`` monotone: by
    bisection."""
    if limit == 0 or not fits(1):
        return 0
    if fits(limit):
        return limit
    lo, hi = 1, limit  # fits(lo) and not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
