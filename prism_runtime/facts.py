"""A reply's accounting facts: one frozen model, built by the site and parsed by the coordinator.

``ReplyFacts`` is the ``ACCOUNTING`` record of a site's reply (``prism_runtime.protocol``). The
site builds it (``client.reply``) and sends ``to_record()``; the coordinator reads a record with
``ReplyFacts.parse``, which checks every type and range before any field is used, and then
matches the facts against what it configured (``server.strategy.replies.RunTerms``). The wire
name of a field is its Python name with hyphens (``site_id`` is ``site-id``), except the two
grouped parts: a private clip estimate (``quantile-sigma``, ``quantile-q``, ``quantile-steps``)
and the Skellam part of a secure-aggregation reply (``honest-sites``, ``share-sigma``), each all
or nothing.

A fact a site did not state is None (and absent from the record): ``parse(r).to_record() == r``
for every record ``parse`` accepts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from prism_core.records import PRIVACY_UNITS, SKELLAM_MECHANISM, PrivacyEvent, SkellamShare
from prism_runtime.protocol import (
    MAX_EXAMPLES,
    MAX_SITE_ID_CHARS,
    SITE_ID,
    STATUS_OK,
    STATUS_REFUSED,
)
from prism_runtime.ranges import SIGMA_MAX, SIGMA_MIN

__all__ = ["ClipEstimate", "FactsError", "ReplyFacts"]


_MAX_TEXT = 1000  # characters of any other text fact
_MAX_STEPS = 10**6  # more local steps than any real round; larger is a garbled fact
_MAX_SCALE = 1e9  # largest C or expected batch a reply may state
_MAX_COUNT_SIGMA = 1e8  # a clip estimate's count noise (sigma_b = noise * b) grows with b
_MAX_HONEST_SITES = 10_000  # more honest sites than any federation here; larger is garbled
_QUANTILE = ("quantile-sigma", "quantile-q", "quantile-steps")
_SECURE = ("honest-sites", "share-sigma")


class FactsError(ValueError):
    """A record is not a reply's accounting facts: the message names the fact and what is wrong
    with it (the coordinator rejects the reply with code ``facts``)."""


@dataclass(frozen=True)
class ClipEstimate:
    """The event of a private clip estimate a reply reports (``prism_core.quantile``): the count's
    noise multiplier, its sample rate and its K steps."""

    noise_multiplier: float
    sample_rate: float
    steps: int


def _fact(kind: type, *, required: bool = False) -> Any:
    """A field of ``ReplyFacts``: its wire type (int, float or str); optional ones default to
    None (not stated)."""
    meta = {"kind": kind, "required": required}
    return field(metadata=meta) if required else field(default=None, metadata=meta)


@dataclass(frozen=True)
class ReplyFacts:
    """What a site's reply states about the round it answered, typed and range-checked.

    Attributes:
        site_id: the site (1-128 printable characters).
        status: ``ok`` or ``refused``.
        sigma: the noise multiplier of the round's steps: 0 (refused, or no noise) or in
            ``[SIGMA_MIN, SIGMA_MAX]``.
        q: the Poisson sample rate, in (0, 1].
        steps: the steps the site ran (0 for a refusal), at most 10^6.
        reason: a refusal's ``REFUSAL_REASONS`` code ("" on an ok reply).
        server_round, round_nonce: the round the reply answers (echoed by the ClientApp).
        rng: where the site's randomness came from (``RNG_MODES``).
        mechanism, adjacency, sampling, unit: the privacy event's kind (``prism_core.records``).
        delta, epsilon_cap, epsilon: the run's delta (0, 1), the site's cap and spend at it
            (the spend may be inf).
        num_examples: N, where the site shares it (1 to ``MAX_EXAMPLES``).
        max_norm, expected_batch_size: C and b of the steps, in (0, 1e9].
        quantile: a private clip estimate charged this round.
        secure: the Skellam part of a secure-aggregation reply (exactly on an ok reply whose
            mechanism is ``SKELLAM_MECHANISM``).
    """

    site_id: str = _fact(str, required=True)
    status: str = _fact(str, required=True)
    sigma: float = _fact(float, required=True)
    q: float = _fact(float, required=True)
    steps: int = _fact(int, required=True)
    server_round: int | None = _fact(int)
    round_nonce: str | None = _fact(str)
    rng: str | None = _fact(str)
    reason: str | None = _fact(str)
    mechanism: str | None = _fact(str)
    adjacency: str | None = _fact(str)
    sampling: str | None = _fact(str)
    delta: float | None = _fact(float)
    epsilon_cap: float | None = _fact(float)
    epsilon: float | None = _fact(float)
    num_examples: int | None = _fact(int)
    max_norm: float | None = _fact(float)
    expected_batch_size: float | None = _fact(float)
    unit: str | None = _fact(str)
    quantile: ClipEstimate | None = None
    secure: SkellamShare | None = None

    def to_record(self) -> dict[str, Any]:
        """The wire record: every stated fact under its wire name, the groups flattened."""
        out = {
            _wire(f.name): getattr(self, f.name)
            for f in fields(self)
            if "kind" in f.metadata and getattr(self, f.name) is not None
        }
        if self.quantile is not None:
            values = (self.quantile.noise_multiplier, self.quantile.sample_rate)
            out.update(zip(_QUANTILE, (*map(float, values), int(self.quantile.steps)), strict=True))
        if self.secure is not None:
            out.update(
                zip(
                    _SECURE,
                    (int(self.secure.honest_sites), float(self.secure.share_sigma)),
                    strict=True,
                )
            )
        return out

    def event(self) -> PrivacyEvent:
        """The privacy event the facts state (``PrivacyEvent.from_columns`` of the record).

        Raises:
            PrivacyParameterError: a value the accountant does not take.
            KeyError: the facts state no mechanism.
        """
        return PrivacyEvent.from_columns(self.to_record())

    @classmethod
    def parse(cls, record: Mapping[str, Any]) -> ReplyFacts:
        """The facts of a wire ``record``, every type and range checked. Raises ``FactsError``.

        Required: ``site-id``, ``status``, ``sigma``, ``q``, ``steps``; every other key must be
        a fact of this model with the right type (an int is a float; a bool is neither; only
        ``epsilon`` may be infinite); values must be in the ranges of the attributes above.
        """
        unknown = sorted(set(record) - set(_WIRE_KINDS))
        if unknown:
            raise FactsError(f"unknown accounting facts {unknown[:3]}")
        for name in _REQUIRED:
            if name not in record:
                raise FactsError(f"accounting facts lack {name!r}")
            _check_type(name, record[name], _WIRE_KINDS[name])
        for name, kind in _WIRE_KINDS.items():
            if name in record and name not in _REQUIRED:
                _check_type(name, record[name], kind)
        given = {
            f.name: record[_wire(f.name)]
            for f in fields(cls)
            if "kind" in f.metadata and _wire(f.name) in record
        }
        facts = cls(**given)
        facts._check_ranges()
        return _with_secure(replace(facts, quantile=_clip_estimate(record)), record)

    def _check_ranges(self) -> None:
        if not self.site_id or len(self.site_id) > MAX_SITE_ID_CHARS:
            raise FactsError(f"site-id {self.site_id[:20]!r} is empty or too long")
        if self.status not in (STATUS_OK, STATUS_REFUSED):
            raise FactsError(f"unknown status {self.status[:20]!r}")
        sigma, q, steps = float(self.sigma), float(self.q), int(self.steps)
        if not (0 <= sigma <= SIGMA_MAX and 0 < q <= 1 and 0 <= steps <= _MAX_STEPS):
            raise FactsError(f"impossible mechanism parameters sigma={sigma}, q={q}, steps={steps}")
        if 0 < sigma < SIGMA_MIN:
            raise FactsError(
                f"sigma={sigma} is neither 0 (no noise) nor in [{SIGMA_MIN:g}, {SIGMA_MAX:g}], "
                "the noise multipliers a site runs"
            )
        if self.delta is not None and not 0 < float(self.delta) < 1:
            raise FactsError(f"delta={self.delta!r} is not in (0, 1)")
        for name in ("max_norm", "expected_batch_size"):
            value = getattr(self, name)
            if value is not None and not 0 < float(value) <= _MAX_SCALE:
                raise FactsError(f"{_wire(name)}={value!r} is not in (0, {_MAX_SCALE:g}]")
        if self.num_examples is not None and not 1 <= self.num_examples <= MAX_EXAMPLES:
            raise FactsError(f"num-examples={self.num_examples!r} is not in [1, 1e12]")
        if self.unit is not None and self.unit not in PRIVACY_UNITS:
            raise FactsError(f"unit {self.unit[:20]!r} is not one of {list(PRIVACY_UNITS)}")
        if self.server_round is not None and self.server_round < 0:
            raise FactsError(f"server-round={self.server_round!r} is negative")


_REQUIRED = (SITE_ID, "status", "sigma", "q", "steps")


def _wire(name: str) -> str:
    return name.replace("_", "-")


_WIRE_KINDS: dict[str, type] = {
    **{_wire(f.name): f.metadata["kind"] for f in fields(ReplyFacts) if "kind" in f.metadata},
    **dict.fromkeys(_QUANTILE[:2], float),
    _QUANTILE[2]: int,
    _SECURE[0]: int,
    _SECURE[1]: float,
}
"""Every fact's wire name and type, from the model (nothing else lists them)."""


def _check_type(name: str, value: Any, kind: type) -> None:
    """Type (and for numbers finiteness) of one fact; the site's own ``epsilon`` may be inf."""
    if kind is float and not (isinstance(value, int | float) and not isinstance(value, bool)):
        raise FactsError(f"accounting fact {name}={value!r} is not a number")
    if kind is float and name != "epsilon" and not math.isfinite(float(value)):
        raise FactsError(f"accounting fact {name}={value!r} is not finite")
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise FactsError(f"accounting fact {name}={value!r} is not an integer")
    if kind is str and not isinstance(value, str):
        raise FactsError(f"accounting fact {name}={value!r} is not a string")
    if kind is str and (len(value) > _MAX_TEXT or not value.isprintable()):
        raise FactsError(f"accounting fact {name} is too long or has control characters")


def _clip_estimate(record: Mapping[str, Any]) -> ClipEstimate | None:
    """A private clip estimate's facts: all three or none, in range (types already checked)."""
    given = [name for name in _QUANTILE if name in record]
    if not given:
        return None
    if len(given) != len(_QUANTILE):
        raise FactsError(f"clip-estimate facts {given} without the others")
    sigma, q, steps = (record[name] for name in _QUANTILE)
    if not (SIGMA_MIN <= sigma <= _MAX_COUNT_SIGMA and 0 < q <= 1 and 1 <= steps <= _MAX_STEPS):
        raise FactsError(
            f"impossible clip-estimate parameters sigma={float(sigma)}, q={float(q)}, "
            f"steps={int(steps)}"
        )
    return ClipEstimate(float(sigma), float(q), int(steps))


def _with_secure(facts: ReplyFacts, record: Mapping[str, Any]) -> ReplyFacts:
    """``facts`` with the Skellam part of ``record``: both of its facts or neither; present on an
    ``ok`` reply exactly when the mechanism is ``SKELLAM_MECHANISM`` (a refusal of such a run may
    state neither: nothing ran), never on a reply of another mechanism;
    ``1 <= honest-sites <= 10000`` and ``0 <= share-sigma <= sigma``."""
    given = [name for name in _SECURE if name in record]
    secure = facts.mechanism == SKELLAM_MECHANISM
    if not given:
        if secure and facts.status != STATUS_REFUSED:
            raise FactsError(f"a {SKELLAM_MECHANISM} reply without its facts {list(_SECURE)}")
        return facts
    if not secure:
        raise FactsError(
            f"secure-aggregation facts {given} on a reply whose mechanism is not "
            f"{SKELLAM_MECHANISM}"
        )
    if len(given) != len(_SECURE):
        raise FactsError(f"secure-aggregation facts {given} without the others")
    honest, share = int(record[_SECURE[0]]), float(record[_SECURE[1]])
    if not 1 <= honest <= _MAX_HONEST_SITES:
        raise FactsError(f"honest-sites={honest} is not in [1, {_MAX_HONEST_SITES}]")
    sigma = float(facts.sigma)
    if not 0 <= share <= sigma:
        raise FactsError(f"share-sigma={share} is not in [0, sigma={sigma}]")
    return replace(facts, secure=SkellamShare(honest, share))
