"""The one record of a privacy event, from the mechanism to the coordinator's ledger.

A ``PrivacyEvent`` is ``steps`` compositions of one Poisson-subsampled Gaussian mechanism: what
an accountant needs, nothing private, no tensors. The mechanisms (``mechanism``, ``baselines``,
``quantile``) emit one per step (with the clip and the expected batch that scaled the noise);
``accounting`` composes them; a site's ledger (``client.site_ledger.SiteLedgerEntry``) and the
coordinator's (``server.ledger.LedgerEvent``) store one each, with the round, site and run it
belongs to. Every event carries its privacy unit (``PRIVACY_UNITS``): events of different
units never compose (``accounting.epsilon`` refuses a history that mixes them). Accounting
depends on this record, never on tensor code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final, TypeGuard

from prism_core.errors import PrivacyParameterError

__all__ = [
    "ADJACENCY",
    "DEFAULT_MECHANISM",
    "DEFAULT_UNIT",
    "PRIVACY_UNITS",
    "SAMPLING",
    "SKELLAM_MECHANISM",
    "EventColumns",
    "PrivacyEvent",
    "SkellamShare",
]

SAMPLING: Final = "poisson"
"""How every event's batches are drawn: Poisson subsampling at rate q (Opacus' DPDataLoader),
the only sampling the accountants compose as subsampled. A run-level constant, not a field of
an event: a ledger row or reply that states another is refused (``PrivacyEvent.from_columns``)."""
ADJACENCY: Final = "add-remove"
"""Neighbouring relation of every mechanism here: add or remove one example (or one person at
the person level). A run-level constant, refused otherwise as ``SAMPLING`` is."""

DEFAULT_MECHANISM: Final = "prism-tangent-gaussian"
"""The product's mechanism: PRISM's tangent-space Gaussian step (``prism_core.mechanism``)."""

PRIVACY_UNITS: Final = ("record", "user")
"""What one event's epsilon protects (docs/design.md §3.2): one record, or one person (a user
and all of their records)."""
DEFAULT_UNIT: Final = "record"
"""The unit of an event that names none: one record (a site at ``privacy-unit = user`` emits
events per person)."""

SKELLAM_MECHANISM: Final = "prism-tangent-skellam"
"""PRISM's step under secure aggregation (docs/design.md §3.3): the site's rounded clipped sum plus
its Skellam share of the noise, summed over the round's sites. Its ``noise_multiplier`` is the
RDP-equivalent Gaussian multiplier of the noise the SUM carries when at least ``honest_sites``
sites of the round are honest and at most the site's tolerated dropouts D of them are missing
(``prism_core.skellam_accounting.skellam_sigma``; docs/design.md §3.3); its ``SkellamShare``
states H and the multiplier of the site's own share alone. Accounted by RDP at integer orders only
(``prism_core.accounting``)."""

_CONSTANTS: Final = {"sampling": SAMPLING, "adjacency": ADJACENCY}
"""The run-level constants a ledger row or a reply's facts state, under their column names."""
_SECURE_COLUMNS: Final = ("honest_sites", "share_sigma")
"""The ledgers' columns of a ``SkellamShare`` (``honest-sites``, ``share-sigma`` in facts)."""


def _real(x: object) -> TypeGuard[float]:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _secure_text(h: object, share: object) -> str:
    return f"honest_sites={h!r}, share_sigma={share!r}"


@dataclass(frozen=True)
class SkellamShare:
    """The secure-aggregation part of a ``SKELLAM_MECHANISM`` event: what its charge counts on.

    Attributes:
        honest_sites: H, the number of honest sites the charge counts on (the site's own
            ``min-honest-sites``), ``>= 1``.
        share_sigma: the RDP-equivalent multiplier of the site's own noise share alone (the
            guarantee if every other site colluded with the coordinator), ``>= 0`` and at most
            the event's ``noise_multiplier`` (``PrivacyEvent`` checks that bound).

    Raises:
        PrivacyParameterError: on construction, naming every field out of its range.
    """

    honest_sites: int
    share_sigma: float

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise PrivacyParameterError("invalid Skellam share: " + "; ".join(problems))

    def problems(self, sigma: float | None = None) -> list[str]:
        """What is out of range, one phrase per field; ``sigma``: the event's multiplier, the
        share's upper bound."""
        return _share_problems(self.honest_sites, self.share_sigma, sigma)


def _share_problems(h: object, share: object, sigma: float | None) -> list[str]:
    problems = []
    if not (isinstance(h, int) and not isinstance(h, bool) and h >= 1):
        problems.append(f"honest_sites={h!r} must be an integer >= 1 for a Skellam event")
    if sigma is None and not (_real(share) and share >= 0):
        problems.append(f"share_sigma={share!r} must be a finite number >= 0")
    elif sigma is not None and not (_real(share) and 0 <= share <= sigma):
        problems.append(
            f"share_sigma={share!r} must be a finite number in [0, noise_multiplier={sigma!r}]"
        )
    return problems


@dataclass(frozen=True)
class PrivacyEvent:
    """``steps`` compositions of a Poisson-subsampled Gaussian mechanism.

    Attributes:
        noise_multiplier: sigma; the noise std on the summed update is ``sigma * max_norm``
            (0 means no privacy: epsilon is infinite).
        sample_rate: Poisson rate q, in ``(0, 1]``.
        steps: number of steps with these parameters, ``>= 0``.
        mechanism: what ran: ``"prism-tangent-gaussian"``, a baseline's name or the private
            clip's quantile count.
        max_norm: clip threshold C (the L2 sensitivity of the sum under add/remove), as the
            mechanism emits it; None where it is not recorded (a ledger keeps sigma, q, steps).
        expected_batch_size: ``b = q * N``, the divisor of signal and noise; None where not
            recorded.
        unit: what the event's epsilon protects, one of ``PRIVACY_UNITS``: ``"record"`` (q
            samples records) or ``"user"`` (q samples people, each clipped once).
        secure: the ``SkellamShare`` of a ``SKELLAM_MECHANISM`` event (which needs one); None
            for any other mechanism.

    Raises:
        PrivacyParameterError: on construction, naming every field out of its range.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int
    mechanism: str = DEFAULT_MECHANISM
    max_norm: float | None = None
    expected_batch_size: float | None = None
    unit: str = DEFAULT_UNIT
    secure: SkellamShare | None = None

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise PrivacyParameterError("invalid privacy event: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """What is out of range, one phrase per field (empty for a valid event)."""
        problems = []
        sigma, q, steps = self.noise_multiplier, self.sample_rate, self.steps
        if not (_real(sigma) and sigma >= 0):
            problems.append(f"noise_multiplier sigma={sigma!r} must be a finite number >= 0")
        if not (_real(q) and 0 < q <= 1):
            problems.append(f"sample_rate q={q!r} must be in (0, 1]")
        if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
            problems.append(f"steps={steps!r} must be an integer >= 0")
        mechanism = self.mechanism
        if not isinstance(mechanism, str) or not mechanism.strip():
            problems.append(f"mechanism={mechanism!r} must be a non-empty string")
        for name in ("max_norm", "expected_batch_size"):
            value = getattr(self, name)
            if value is not None and not (_real(value) and value > 0):
                problems.append(f"{name}={value!r} must be a finite number > 0 or None")
        if self.unit not in PRIVACY_UNITS:
            problems.append(f"unit={self.unit!r} must be one of {list(PRIVACY_UNITS)}")
        problems += self._secure_problems()
        return problems

    def _secure_problems(self) -> list[str]:
        """The secure-aggregation part: present exactly on a Skellam event, its share at most
        the event's sigma."""
        part = self.secure
        if self.mechanism != SKELLAM_MECHANISM:
            if part is None:
                return []
            return [
                f"{_secure_text(part.honest_sites, part.share_sigma)}: only a "
                f"{SKELLAM_MECHANISM!r} event has them"
            ]
        if not isinstance(part, SkellamShare):
            return [
                f"secure={part!r}: a {SKELLAM_MECHANISM!r} event needs its SkellamShare "
                "(honest_sites, share_sigma)"
            ]
        return part.problems(self.noise_multiplier)

    @classmethod
    def from_columns(cls, row: Mapping[str, Any]) -> PrivacyEvent:
        """The event of a ledger row or a reply's facts, under the ledgers' column names
        (``sigma``, ``q``, ``steps``, ``mechanism``; ``unit`` where the row has it, else the
        default; ``honest_sites`` and ``share_sigma``, or ``honest-sites`` and ``share-sigma``,
        the ``SkellamShare`` where the row states either), the inverse of ``EventColumns``. The
        numbers are converted as the ledgers store them; the texts are taken as they are (and
        checked).

        Raises:
            PrivacyParameterError: a value out of its range, or a ``sampling`` or ``adjacency``
                the row states that is not ``SAMPLING`` or ``ADJACENCY`` (a foreign or corrupt
                record: no event of another sampling or relation is accounted).
        """
        for name, constant in _CONSTANTS.items():
            if name in row and row[name] != constant:
                raise PrivacyParameterError(
                    f"invalid privacy event: {name}={row[name]!r} is not {constant!r}, the only "
                    f"{name} accounted"
                )
        optional: dict[str, Any] = {"unit": row["unit"]} if "unit" in row else {}
        h, share = (row.get(name, row.get(name.replace("_", "-"))) for name in _SECURE_COLUMNS)
        if h is not None or share is not None:
            h, share = (None if h is None else int(h)), (None if share is None else float(share))
            problems = _share_problems(h, share, None)
            if problems or h is None or share is None:
                raise PrivacyParameterError("invalid Skellam share: " + "; ".join(problems))
            optional["secure"] = SkellamShare(h, share)
        return cls(
            float(row["sigma"]),
            float(row["q"]),
            int(row["steps"]),
            mechanism=row["mechanism"],
            **optional,
        )

    def accounted(
        self,
    ) -> tuple[float, float, int, str, str, int | None, float | None]:
        """The facts a charge commits to: sigma, q, steps, mechanism, unit, and a Skellam
        event's honest sites and share sigma."""
        return (
            self.noise_multiplier,
            self.sample_rate,
            self.steps,
            self.mechanism,
            self.unit,
            *_secure_columns(self.secure),
        )

    def same_but_steps(self, other: PrivacyEvent) -> bool:
        """Equal in every field but ``steps`` (the two compose into one event)."""
        return all(
            getattr(self, f.name) == getattr(other, f.name)
            for f in fields(self)
            if f.name != "steps"
        )


class EventColumns:
    """Read-through of a ledger record's ``event`` under the ledgers' column names (``sigma``,
    ``q``, ``steps``, ``mechanism``, ``unit``, ``honest_sites`` and ``share_sigma``, its
    ``SkellamShare``'s or None; ``sampling`` and ``adjacency``, the constants): a record that
    adds the round, site or run to a ``PrivacyEvent`` holds it, never copies its fields."""

    event: PrivacyEvent

    @property
    def sigma(self) -> float:
        return self.event.noise_multiplier

    @property
    def q(self) -> float:
        return self.event.sample_rate

    @property
    def steps(self) -> int:
        return self.event.steps

    @property
    def mechanism(self) -> str:
        return self.event.mechanism

    @property
    def sampling(self) -> str:
        return SAMPLING

    @property
    def adjacency(self) -> str:
        return ADJACENCY

    @property
    def unit(self) -> str:
        return self.event.unit

    @property
    def honest_sites(self) -> int | None:
        return _secure_columns(self.event.secure)[0]

    @property
    def share_sigma(self) -> float | None:
        return _secure_columns(self.event.secure)[1]


def _secure_columns(part: SkellamShare | None) -> tuple[int | None, float | None]:
    """``honest_sites`` and ``share_sigma`` of the columns of ``part`` (None and None)."""
    return (None, None) if part is None else (part.honest_sites, part.share_sigma)
