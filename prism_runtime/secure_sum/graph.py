"""The masking graph of a secure-sum round: whom each site masks with and shares its secrets to.

With the complete graph (every site a neighbour of every other, the default) a site expands
``n - 1`` pairwise masks of ``d`` words and Shamir-shares its two secrets to ``n - 1`` peers:
work ``O(n d)`` per site. SecAgg+ (Bell et al. 2020, CCS) replaces it by a sparse random graph of
degree ``k = O(log n)``: a site masks only with its ``k`` neighbours and shares its secrets only
among its NEIGHBOURHOOD (itself and its neighbours, ``k + 1`` holders) with a neighbourhood
threshold; the coordinator removes a dropped site's masks from its ``k`` neighbours only. Work
per site is ``O(k d)``.

The graph is Bell et al.'s: the Harary graph ``H(n, k)`` (``k`` even: the sites on a ring, each
joined to the ``k / 2`` nearest on either side) over a random ORDER of the roster. The order is
public and checkable: a Fisher-Yates shuffle of the sorted site ids driven by a ChaCha20 stream
keyed with SHA-256 of the round's graph seed (``roster.graph_seed``: threshold, degree, the
roster's ids and the Merkle root of every roster site's fresh round keys), so every site that
shared in one run of a round derives the same graph, and a site told another roster, threshold
or degree derives another graph and another transcript, which the consistency stage catches
before anything is revealed (each survivor signs the transcript with its view).
``degree >= n - 1`` is the complete graph, exactly the protocol without a graph.

What a sparse graph costs in guarantees (docs/design.md §3.3, docs/security.md): the complete
graph's conditions hold for every roster and every set of colluders; a sparse one's hold except
with a probability over the random order, for colluders and dropped sites that are FIXED before
the order is known (Bell et al.'s model). ``graph_failure`` bounds that probability by a union
bound on two events, either of which a guarantee needs to exclude:

- some site has at least ``t`` colluding neighbours (they could rebuild both its secrets):
  ``n P[Hyp(n - 1, c, k) >= t]``;
- the sites that are neither colluding nor dropped split into two parts with no pairwise mask
  between them: on the ring that needs two disjoint runs of ``k / 2`` consecutive removed sites,
  ``k`` fixed positions out of ``c + D`` removed: ``C(n, 2) prod_{j<k} (c + D - j) / (n - j)``.
  Without it the honest survivors are connected by pairwise masks no share removes, so the
  coordinator learns their inputs only as one sum, exactly as with the complete graph.

``sparse_parameters`` picks the least even ``k`` (and least ``t``) for which that bound is below
``2^-SECURITY_BITS`` and a round with ``D`` random dropouts aborts with probability below
``2^-CORRECTNESS_BITS`` (some site keeps fewer than ``t`` surviving neighbours, ``graph_abort``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from scipy.stats import hypergeom

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum._encoding import DOMAIN, frame

__all__ = [
    "CORRECTNESS_BITS",
    "SECURITY_BITS",
    "MaskingGraph",
    "graph_abort",
    "graph_failure",
    "sparse_parameters",
]

SECURITY_BITS = 40
"""A sparse graph is accepted only if it breaks a site's guarantee with probability at most
``2^-40`` per round (for colluders and dropouts fixed before the round's order is drawn)."""

CORRECTNESS_BITS = 20
"""``sparse_parameters`` keeps the chance that random dropouts abort a round below ``2^-20``."""


def _uniform_below(stream: bytes, bound: int, offset: int) -> tuple[int, int]:
    """A uniform integer in ``[0, bound)`` from the 64-bit words of ``stream`` at ``offset``
    (rejection sampling), and the next offset."""
    limit = (2**64 // bound) * bound
    while True:
        word = int.from_bytes(stream[offset : offset + 8], "little")
        offset += 8
        if word < limit:
            return word % bound, offset


def _order(sites: Sequence[str], seed: bytes) -> tuple[str, ...]:
    key = hashlib.sha256(frame(DOMAIN, "masking-graph", seed)).digest()
    order = sorted(sites)
    # 8 bytes per draw, rejection below 2^-63 per draw for n < 2^32: 4x is ample headroom.
    stream = (
        Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None)  # one stream per key
        .encryptor()
        .update(bytes(32 * max(len(order), 1)))
    )
    offset = 0
    for i in range(len(order) - 1, 0, -1):
        j, offset = _uniform_below(stream, i + 1, offset)
        order[i], order[j] = order[j], order[i]
    return tuple(order)


@dataclass(frozen=True)
class MaskingGraph:
    """A round's masking graph: the Harary graph ``H(n, degree)`` over ``order``.

    Attributes:
        order: The roster in ring order (``derive``).
        degree: k, each site's number of neighbours (``>= n - 1``: the complete graph).
    """

    order: tuple[str, ...]
    degree: int

    def __post_init__(self) -> None:
        n = len(self.order)
        if len(set(self.order)) != n:
            raise ConfigError("a masking graph names a site twice: give distinct site ids")
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 0:
            raise ConfigError(f"graph degree is {self.degree!r}: give an int >= 0")
        if not self.complete and (self.degree % 2 or self.degree < 2):
            raise ConfigError(
                f"graph degree {self.degree} for {n} sites: a sparse Harary graph takes an even "
                f"degree (or {n - 1} and above: the complete graph)"
            )

    @classmethod
    def derive(cls, sites: Collection[str], *, degree: int, seed: bytes) -> MaskingGraph:
        """The graph every site of a round derives from its roster's ids and the round's
        ``seed`` (``roster.graph_seed``)."""
        if len(sites) - 1 <= degree:
            return cls(tuple(sorted(sites)), degree)
        return cls(_order(list(sites), seed), degree)

    @property
    def complete(self) -> bool:
        """Whether every site is every other's neighbour."""
        return self.degree >= len(self.order) - 1

    @cached_property
    def _place(self) -> dict[str, int]:
        return {site: p for p, site in enumerate(self.order)}

    def neighbours(self, site: str) -> frozenset[str]:
        """The sites ``site`` masks with and shares its secrets to (itself excluded)."""
        p = self._place.get(site)
        if p is None:
            raise ConfigError(f"site {site!r} is not in the masking graph's roster")
        if self.complete:
            return frozenset(self.order) - {site}
        n, half = len(self.order), self.degree // 2
        return frozenset(self.order[(p + s) % n] for s in range(-half, half + 1) if s)

    def neighbourhood(self, site: str) -> list[str]:
        """``site`` and its neighbours, sorted: the holders of its secrets' shares."""
        return sorted(self.neighbours(site) | {site})

    def edges(self) -> int:
        """The number of pairwise masks in the round (``n k / 2``)."""
        n = len(self.order)
        return n * (n - 1) // 2 if self.complete else n * self.degree // 2


def _log2(p: float) -> float:
    return -math.inf if p <= 0 else math.log2(p)


def graph_failure(n: int, *, degree: int, threshold: int, corrupt: int, dropouts: int) -> float:
    """An upper bound on the chance that a random order breaks a site's guarantee (module
    docstring): some site with ``threshold`` colluding neighbours, or the sites neither colluding
    nor dropped split in two; 0 for the complete graph."""
    if degree >= n - 1:
        return 0.0
    k = degree
    colluding = n * float(hypergeom.sf(threshold - 1, n - 1, corrupt, k))
    removed = min(corrupt + dropouts, n)
    cut = 0.0
    if removed >= k:
        log_runs = math.log(math.comb(n, 2)) + sum(
            math.log((removed - j) / (n - j)) for j in range(k)
        )
        cut = math.exp(log_runs)
    return min(1.0, colluding + cut)


def graph_abort(n: int, *, degree: int, threshold: int, dropouts: int) -> float:
    """An upper bound on the chance that ``dropouts`` random dropped sites leave some site with
    fewer than ``threshold`` surviving neighbours (its secret then cannot be rebuilt)."""
    if degree >= n - 1:
        return 0.0 if n - dropouts >= threshold else 1.0
    return min(1.0, n * float(hypergeom.sf(degree - threshold, n - 1, dropouts, degree)))


def sparse_parameters(
    n: int,
    *,
    corrupt: int,
    dropouts: int,
    security_bits: int = SECURITY_BITS,
    correctness_bits: int = CORRECTNESS_BITS,
) -> tuple[int, int] | None:
    """The least even degree k, and the least neighbourhood threshold t for it (a majority of
    the ``k + 1`` holders, as Shamir sharing here requires), whose
    ``graph_failure`` is at most ``2^-security_bits`` and ``graph_abort`` at most
    ``2^-correctness_bits``; None when only the complete graph meets them (small rosters).
    """
    for k in range(2, n - 1, 2):
        # graph_failure falls as t grows and graph_abort rises: the least t that meets the
        # first is the one with the best chance to meet the second.
        t = next(
            (
                t
                for t in range(k // 2 + 1, k + 1)
                if _log2(
                    graph_failure(n, degree=k, threshold=t, corrupt=corrupt, dropouts=dropouts)
                )
                <= -security_bits
            ),
            None,
        )
        if t is None:
            continue
        if _log2(graph_abort(n, degree=k, threshold=t, dropouts=dropouts)) <= -correctness_bits:
            return k, t
    return None
