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
from typing import Any, Final

from prism_core.errors import PrivacyParameterError

__all__ = [
    "ADJACENCY",
    "DEFAULT_MECHANISM",
    "DEFAULT_UNIT",
    "PRIVACY_UNITS",
    "SKELLAM_MECHANISM",
    "EventColumns",
    "PrivacyEvent",
]

ADJACENCY: Final = "add-remove"
"""Neighbouring relation of every mechanism here: add or remove one example."""

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
sites are honest (``prism_core.skellam_accounting.skellam_sigma``); ``share_sigma`` is that of the
site's own share alone. Accounted by RDP at integer orders only (``prism_core.accounting``)."""

_TEXT_FIELDS: Final = ("mechanism", "sampling", "adjacency")


def _real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class PrivacyEvent:
    """``steps`` compositions of a Poisson-subsampled Gaussian mechanism.

    Attributes:
        noise_multiplier: sigma; the noise std on the summed update is ``sigma * max_norm``
            (0 means no privacy: epsilon is infinite).
        sample_rate: Poisson rate q, in ``(0, 1]``.
        steps: number of steps with these parameters, ``>= 0``.
        sampling: how the batches were drawn; only ``"poisson"`` can be accounted as subsampled.
        adjacency: the neighbouring relation, always ``"add-remove"``.
        mechanism: what ran: ``"prism-tangent-gaussian"``, a baseline's name or the private
            clip's quantile count.
        max_norm: clip threshold C (the L2 sensitivity of the sum under add/remove), as the
            mechanism emits it; None where it is not recorded (a ledger keeps sigma, q, steps).
        expected_batch_size: ``b = q * N``, the divisor of signal and noise; None where not
            recorded.
        unit: what the event's epsilon protects, one of ``PRIVACY_UNITS``: ``"record"`` (q
            samples records) or ``"user"`` (q samples people, each clipped once).
        honest_sites: H, for a ``SKELLAM_MECHANISM`` event only: the number of honest sites the
            charge counts on (the site's own ``min-honest-sites``); None otherwise.
        share_sigma: for a ``SKELLAM_MECHANISM`` event only: the RDP-equivalent multiplier of
            the site's own noise share alone (the guarantee if every other site colluded with
            the coordinator), ``<= noise_multiplier``; None otherwise.

    Raises:
        PrivacyParameterError: on construction, naming every field out of its range.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int
    sampling: str = "poisson"
    adjacency: str = ADJACENCY
    mechanism: str = DEFAULT_MECHANISM
    max_norm: float | None = None
    expected_batch_size: float | None = None
    unit: str = DEFAULT_UNIT
    honest_sites: int | None = None
    share_sigma: float | None = None

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
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                problems.append(f"{name}={value!r} must be a non-empty string")
        for name in ("max_norm", "expected_batch_size"):
            value = getattr(self, name)
            if value is not None and not (_real(value) and value > 0):
                problems.append(f"{name}={value!r} must be a finite number > 0 or None")
        if self.unit not in PRIVACY_UNITS:
            problems.append(f"unit={self.unit!r} must be one of {list(PRIVACY_UNITS)}")
        problems += self._secure_problems()
        return problems

    def _secure_problems(self) -> list[str]:
        """The secure-aggregation fields: both set exactly for a Skellam event."""
        h, share = self.honest_sites, self.share_sigma
        if self.mechanism != SKELLAM_MECHANISM:
            if h is not None or share is not None:
                return [
                    f"honest_sites={h!r}, share_sigma={share!r}: only a {SKELLAM_MECHANISM!r} "
                    "event has them"
                ]
            return []
        problems = []
        if not (isinstance(h, int) and not isinstance(h, bool) and h >= 1):
            problems.append(f"honest_sites={h!r} must be an integer >= 1 for a Skellam event")
        sigma = self.noise_multiplier
        if not (_real(share) and share is not None and 0 <= share <= sigma):
            problems.append(
                f"share_sigma={share!r} must be a finite number in [0, noise_multiplier={sigma!r}]"
            )
        return problems

    @classmethod
    def from_columns(cls, row: Mapping[str, Any]) -> PrivacyEvent:
        """The event of a ledger row or a reply's facts, under the ledgers' column names
        (``sigma``, ``q``, ``steps``, ``mechanism``; ``sampling``, ``adjacency`` and ``unit``
        where the row has them, else the defaults), the inverse of ``EventColumns``. The numbers are
        converted as the ledgers store them; the texts are taken as they are (and checked)."""
        optional: dict[str, Any] = {
            k: row[k] for k in ("sampling", "adjacency", "unit") if k in row
        }
        for name, convert in (("honest_sites", int), ("share_sigma", float)):
            value = row.get(name, row.get(name.replace("_", "-")))
            if value is not None:
                optional[name] = convert(value)
        return cls(
            float(row["sigma"]),
            float(row["q"]),
            int(row["steps"]),
            mechanism=row["mechanism"],
            **optional,
        )

    def accounted(
        self,
    ) -> tuple[float, float, int, str, str, str, str, int | None, float | None]:
        """The facts a charge commits to: sigma, q, steps, mechanism, sampling, adjacency,
        unit, and a Skellam event's honest sites and share sigma."""
        return (
            self.noise_multiplier,
            self.sample_rate,
            self.steps,
            self.mechanism,
            self.sampling,
            self.adjacency,
            self.unit,
            self.honest_sites,
            self.share_sigma,
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
    ``q``, ``steps``, ``mechanism``, ``sampling``, ``adjacency``, ``unit``): a record that adds
    the round, site or run to a ``PrivacyEvent`` holds it, never copies its fields."""

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
        return self.event.sampling

    @property
    def adjacency(self) -> str:
        return self.event.adjacency

    @property
    def unit(self) -> str:
        return self.event.unit

    @property
    def honest_sites(self) -> int | None:
        return self.event.honest_sites

    @property
    def share_sigma(self) -> float | None:
        return self.event.share_sigma
