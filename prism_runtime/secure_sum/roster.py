"""The roster of a secure-sum round, committed: every site's view of it in ``O(k log n)`` bytes.

The roster ``U1`` is the advertisements of the ``n`` sites that advertised keys. A site uses
the keys of its neighbourhood only (itself and its ``k`` neighbours of the masking graph, every
site with the complete graph), yet the round's guarantees need all sites to have shared under
ONE roster. So the roster is committed instead of sent whole:

- the roster's site ids, sorted (``ids``: distinct by construction, and what the participant
  and survivor sets are bitmaps over);
- ``root``, the root of a Merkle tree (``merkle``) over the advertisements in id order, a leaf
  the framed advertisement without its signature (``advertisement_leaf``);
- ``largest_share`` L, the largest noise share the coordinator states for the roster. A site
  adds L, not its own share, refuses an L below its own share or above its whole noise
  (``SiteRound.noise_share``), and L is in the transcript its shares are sealed under: every
  input the coordinator can unmask under one transcript added the same L, at least each such
  site's own share.

A site receives its neighbourhood's advertisements and a MULTIPROOF (``merkle``): the tree
nodes it cannot compute from those leaves, in the order ``root_of`` consumes them; about
``(k + 1) log2(n / (k + 1))`` hashes, none with the complete graph. ``root_of`` rebuilds the root
from the leaves and the proof, so a site that holds the true root holds the true advertisement
of every neighbour at its place in id order, whether or not the other advertisements ever
reached it. The masking graph's order is seeded by ``graph_seed`` (threshold, graph and
``roster_digest``: ids and root), never by L, a number the coordinator could vary at will to
draw orders until one suits it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

from prism_runtime.secure_sum._encoding import DOMAIN, frame
from prism_runtime.secure_sum.errors import KeyBindingError
from prism_runtime.secure_sum.keys import AdvertisedKeys, noise_share_bytes
from prism_runtime.secure_sum.merkle import LEAF, MerkleTree, root_of

__all__ = [
    "CommittedRoster",
    "RosterPart",
    "advertisement_leaf",
    "graph_seed",
    "largest_share_of",
    "roster_digest",
    "transcript_of",
]


def advertisement_leaf(keys: AdvertisedKeys) -> bytes:
    """The leaf hash of one advertisement: SHA-256 of ``0x00`` and its framed id, round keys,
    seed commitment, noise share, H and D (what it signed, less the signature)."""
    framed = frame(
        DOMAIN,
        "roster-leaf",
        keys.site_id,
        keys.mask_public,
        keys.share_public,
        keys.seed_commitment,
        noise_share_bytes(keys.noise_share),
        keys.honest_sites,
        keys.max_dropouts,
    )
    return hashlib.sha256(LEAF + framed).digest()


def largest_share_of(roster: Mapping[str, AdvertisedKeys]) -> float:
    """The largest noise share a roster site signed (0 for no site): the L a coordinator
    states."""
    return max((keys.noise_share for keys in roster.values()), default=0.0)


def roster_digest(ids: Sequence[str], root: bytes) -> bytes:
    """SHA-256 of the framed roster size, its sorted ids and the advertisements' root."""
    return hashlib.sha256(frame(DOMAIN, "roster", len(ids), *ids, root)).digest()


def _graph_fields(threshold: int, graph: tuple[int, int] | None) -> list[bytes | str | int]:
    fields: list[bytes | str | int] = [threshold]
    if graph is not None:
        fields += ["sparse-graph", *graph]
    return fields


def graph_seed(threshold: int, graph: tuple[int, int] | None, digest: bytes) -> bytes:
    """What seeds the masking graph's order: the threshold, a sparse graph's degree and
    neighbourhood threshold, and ``roster_digest`` (never the stated largest share)."""
    fields = _graph_fields(threshold, graph)
    return hashlib.sha256(frame(DOMAIN, "graph-seed", *fields, digest)).digest()


def transcript_of(
    threshold: int, graph: tuple[int, int] | None, digest: bytes, largest_share: float
) -> bytes:
    """The round's transcript (``views.round_transcript``): SHA-256 of the threshold, a sparse
    graph's parameters, ``roster_digest`` and the stated largest noise share."""
    fields = _graph_fields(threshold, graph)
    return hashlib.sha256(
        frame(DOMAIN, "round-transcript", *fields, digest, noise_share_bytes(largest_share))
    ).digest()


@dataclass(frozen=True)
class RosterPart:
    """What a site receives of the roster (module docstring).

    Attributes:
        ids: The roster's site ids, sorted.
        largest_share: L, the largest noise share stated for the roster.
        leaves: The advertisements the site receives, keyed by site id: its neighbourhood's
            (every site's with the complete graph).
        proof: the Merkle proof of those leaves' places in id order (``MerkleTree.proof``).
    """

    ids: tuple[str, ...]
    largest_share: float
    leaves: Mapping[str, AdvertisedKeys]
    proof: tuple[bytes, ...] = ()

    @classmethod
    def whole(cls, roster: Mapping[str, AdvertisedKeys]) -> RosterPart:
        """The whole roster as a part (every leaf, no proof nodes, L its largest share)."""
        return cls(tuple(sorted(roster)), largest_share_of(roster), dict(roster))

    @cached_property
    def place(self) -> dict[str, int]:
        """Each roster site's place in id order."""
        return {site: p for p, site in enumerate(self.ids)}

    def root(self) -> bytes:
        """The advertisements' root that ``leaves`` and ``proof`` give.

        Raises:
            KeyBindingError: The ids are not sorted and distinct, a leaf is of a site outside
                them or listed under another id, or the proof does not fit the leaves.
        """
        if any(a >= b for a, b in pairwise(self.ids)):
            raise KeyBindingError("the roster's ids are not sorted and distinct: refuse it")
        known: dict[int, bytes] = {}
        for site, keys in self.leaves.items():
            if keys.site_id != site or site not in self.place:
                raise KeyBindingError(
                    f"the roster lists the keys of site {keys.site_id!r} under {site!r}, or a "
                    "site outside its ids: refuse it"
                )
            known[self.place[site]] = advertisement_leaf(keys)
        return root_of(len(self.ids), known, self.proof)

    @property
    def digest(self) -> bytes:
        """``roster_digest`` of the ids and the root (``root``'s errors)."""
        return roster_digest(self.ids, self.root())


class CommittedRoster:
    """The coordinator's roster: every advertisement, the tree over them and each site's part.

    Args:
        roster: The advertisements of ``U1``, keyed by site id.
        largest_share: L to state; default: the largest share of the roster.
    """

    def __init__(
        self, roster: Mapping[str, AdvertisedKeys], *, largest_share: float | None = None
    ) -> None:
        self.roster = dict(roster)
        self.ids = tuple(sorted(roster))
        self.largest_share = largest_share_of(roster) if largest_share is None else largest_share
        if not math.isfinite(self.largest_share) or self.largest_share < 0:
            raise KeyBindingError(f"a largest noise share of {self.largest_share!r}: give one >= 0")
        self.tree = MerkleTree([advertisement_leaf(roster[site]) for site in self.ids])
        self.root = self.tree.root
        self.place = {site: p for p, site in enumerate(self.ids)}
        self.digest = roster_digest(self.ids, self.root)

    def part(self, sites: Iterable[str]) -> RosterPart:
        """The part of the roster for a site whose neighbourhood is ``sites``."""
        chosen = sorted(set(sites))
        proof = self.tree.proof([self.place[site] for site in chosen])
        leaves = {site: self.roster[site] for site in chosen}
        return RosterPart(self.ids, self.largest_share, leaves, proof)

    def seed(self, threshold: int, graph: tuple[int, int] | None) -> bytes:
        """``graph_seed`` of this roster."""
        return graph_seed(threshold, graph, self.digest)

    def transcript(self, threshold: int, graph: tuple[int, int] | None) -> bytes:
        """``transcript_of`` this roster and its stated largest share."""
        return transcript_of(threshold, graph, self.digest, self.largest_share)
