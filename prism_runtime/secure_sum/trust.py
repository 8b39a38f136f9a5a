"""What a site counts on in a secure-sum round, and the threshold condition that follows from it.

A site states two numbers, its policy: H, the honest sites of a round it counts on (itself
included), so it allows for a coordinator colluding with up to ``c = n - H`` of the round's
``n`` roster sites (those that advertised keys), and D, the most of those ``n`` sites it
tolerates missing from a sum (sites that advertise keys and then drop out). It accepts a roster
of ``n`` sites and a threshold ``t`` only if

    H <= n,    D < H,    t >= n - D    and    t > c + D,

that is ``n - t <= tolerance = min(D, H - 1 - D)``. The last two add up to ``2 t > n + c``,
the threshold of Bonawitz et al. 2017 (CCS, §6) against an active server colluding with c
clients. Each part, given that every site's shares are sealed under one transcript (the
threshold, graph and every roster advertisement, ``envelope``) and that a site reveals shares
only for exactly its own participant and survivor sets, confirmed by signatures of them
(``views``: t valid, or under a sparse graph a random sample that shows at least
``confirmations(n) = (n + c) // 2 + 1`` genuine ones, c for the smallest H of the roster, but
for ``2^-40``):

- ``2 t > n + c``: a view is revealed only if at least ``(n + c) // 2 + 1 <= t`` sites signed
  it, more than ``(n - c) / 2`` of them honest, and an honest site signs one view per round;
  two revealed views would need more than the ``n - c`` honest sites. So every honest site
  that reveals holds ONE view, and no site's seed and mask key are ever both reconstructed
  (each needs t shares; the colluders hold c < t).
- ``t >= n - D``: a round loses at most D roster sites, and every site refuses a view with
  more than D missing, so a sum holds at least ``n - D - c = H - D`` honest sites' inputs;
  each adds the largest noise share of the roster in the transcript the revealing sites hold
  (an honest input sealed under another transcript keeps its self mask: its seed shares open
  only under its own), this site's own among them: a share of ``mu / (H - D)``
  (``share_divisor``) keeps the site's charge true.
- ``t > c + D``: the honest sites that reveal a site's seed number at least ``t - c > D``, more
  than the D roster sites a coordinator may leave out of that site's participants, so at least
  one of them masked with it and survived in the same view: their pairwise mask is never
  removed, and the site's input is never isolated from the others'.

``tolerance`` is then the most sites a round may lose after the key exchange; the coordinator
picks the least threshold every site of the roster accepts (``least_common_threshold``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum.errors import SecureSumAbortedError, ThresholdError
from prism_runtime.secure_sum.graph import SECURITY_BITS, graph_failure, sparse_parameters

__all__ = ["RoundTrust", "common_graph", "least_common_threshold"]


def _count(value: object, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} is {value!r}: give an int >= {low}")
    return value


@dataclass(frozen=True)
class RoundTrust:
    """A site's H and D for one round (module docstring).

    Attributes:
        honest: H, the honest sites of the round this site counts on, itself included (>= 1).
        dropouts: D, the most roster sites it tolerates missing from a sum (0 <= D < H).
    """

    honest: int
    dropouts: int

    def __post_init__(self) -> None:
        _count(self.honest, "honest (H)", 1)
        _count(self.dropouts, "dropouts (D)", 0)
        if self.dropouts >= self.honest:
            raise ConfigError(
                f"dropouts D = {self.dropouts} with H = {self.honest} honest sites: with D >= H "
                "every honest site but none could drop out; keep D below H"
            )

    @property
    def tolerance(self) -> int:
        """``min(D, H - 1 - D)``: the most roster sites a round this site accepts may lose."""
        return min(self.dropouts, self.honest - 1 - self.dropouts)

    @property
    def share_divisor(self) -> int:
        """``H - D``: the honest inputs every sum this site takes part in holds at least."""
        return self.honest - self.dropouts

    def confirmations(self, sites: int, *, weakest: int | None = None) -> int:
        """``(n + c) // 2 + 1`` with ``c = n - H``: the genuine signatures of one view that a
        second view cannot also gather while each honest site signs one (``views``). With
        ``weakest``, the smallest H a site of its neighbourhood signed, c is the most colluders
        any of them allows for: a site's check protects its neighbourhood's secrets, whose H
        may be lower than its own."""
        n = _count(sites, "sites", 1)
        honest = self.honest if weakest is None else min(self.honest, weakest)
        return (n + max(n - honest, 0)) // 2 + 1

    def least_threshold(self, sites: int) -> int:
        """The least t this site accepts for a roster of ``sites`` sites: ``sites - tolerance``."""
        return _count(sites, "sites", 1) - self.tolerance

    def check_threshold(self, threshold: int, sites: int) -> None:
        """Accept threshold ``threshold`` for a roster of ``sites`` sites, or refuse it.

        Raises:
            ThresholdError: ``sites < H`` (H honest sites cannot be among them) or
                ``threshold < least_threshold(sites)``, or ``threshold > sites``.
        """
        if sites < self.honest:
            raise ThresholdError(
                f"a roster of {sites} sites cannot hold the {self.honest} honest sites this site "
                "counts on: nothing shared"
            )
        if not self.least_threshold(sites) <= threshold <= sites:
            raise ThresholdError(
                f"threshold {threshold} for {sites} roster sites: this site (H = {self.honest}, "
                f"D = {self.dropouts}) needs t >= n - D and t > (n - H) + D, i.e. "
                f"{self.least_threshold(sites)}..{sites}; nothing shared"
            )

    def check_graph(self, sites: int, *, degree: int, threshold: int) -> None:
        """Accept a sparse masking graph of ``degree`` with neighbourhood threshold
        ``threshold`` for a roster of ``sites`` sites, or refuse it (``graph``): its chance of
        breaking this site's guarantee, with ``n - H`` colluders and D dropped sites fixed
        before the round's order is drawn, must be at most ``2^-SECURITY_BITS``.

        Raises:
            ThresholdError: The threshold is not a majority of the ``degree + 1`` holders or
                above ``degree``, or the bound is larger.
        """
        if degree >= sites - 1:
            return
        if not degree // 2 + 1 <= threshold <= degree:
            raise ThresholdError(
                f"neighbourhood threshold {threshold} for degree {degree}: give "
                f"{degree // 2 + 1}..{degree} (a majority of the neighbourhood); nothing shared"
            )
        failure = graph_failure(
            sites,
            degree=degree,
            threshold=threshold,
            corrupt=sites - self.honest,
            dropouts=self.dropouts,
        )
        if failure > 2.0**-SECURITY_BITS:
            raise ThresholdError(
                f"a masking graph of degree {degree} (neighbourhood threshold {threshold}) for "
                f"{sites} sites breaks this site's guarantee (H = {self.honest}, "
                f"D = {self.dropouts}) with probability up to {failure:.3g}, above "
                f"2^-{SECURITY_BITS}: nothing shared"
            )

    def check_present(self, present: int, sites: int, what: str) -> None:
        """Refuse a stage at which more than D of the ``sites`` roster sites are missing.

        Raises:
            SecureSumAbortedError: ``sites - present > D``; ``what`` names the stage's sites.
        """
        if sites - present > self.dropouts:
            raise SecureSumAbortedError(
                f"{present} {what} of {sites} roster sites: this site tolerates at most "
                f"{self.dropouts} missing; nothing further done"
            )


def common_graph(trusts: Iterable[RoundTrust], sites: int) -> tuple[int, int] | None:
    """The sparse masking graph (degree, neighbourhood threshold) every site of a roster of
    ``sites`` sites with ``trusts`` accepts, from the most colluders and dropouts any of them
    allows for (``graph.sparse_parameters``); None: the complete graph."""
    trusts = list(trusts)
    if not trusts:
        return None
    corrupt = max(sites - trust.honest for trust in trusts)
    dropouts = max(trust.dropouts for trust in trusts)
    return sparse_parameters(sites, corrupt=max(corrupt, 0), dropouts=dropouts)


def least_common_threshold(trusts: Iterable[RoundTrust], sites: int) -> int | None:
    """The least threshold every site of a roster of ``sites`` sites with ``trusts`` accepts, or
    None when one of them counts on more honest sites than the roster holds."""
    trusts = list(trusts)
    if any(trust.honest > sites for trust in trusts):
        return None
    return max((trust.least_threshold(sites) for trust in trusts), default=sites)
