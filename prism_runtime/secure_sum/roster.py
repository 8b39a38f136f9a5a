"""The roster of a secure-sum round, committed: every site's view of it in ``O(k log n)`` bytes.

The roster ``U1`` is the advertisements of the ``n`` sites that advertised keys. A site uses
the keys of its neighbourhood only (itself and its ``k`` neighbours of the masking graph, every
site with the complete graph), yet the round's guarantees need all sites to have shared under
ONE roster. So the roster is committed instead of sent whole:

- the roster's site ids, sorted (``ids``: distinct by construction, and what the participant
  and survivor sets are bitmaps over);
- ``root``, the root of a Merkle tree over the advertisements in id order (a leaf is SHA-256 of
  ``0x00`` and the framed advertisement without its signature; an inner node SHA-256 of
  ``0x01`` and its two children; an odd last node is carried up a level unchanged);
- ``largest_share`` L, the largest noise share the coordinator states for the roster. A site
  adds L, not its own share, refuses an L below its own share or above its whole noise
  (``SiteRound.noise_share``), and L is in the transcript its shares are sealed under: every
  input the coordinator can unmask under one transcript added the same L, at least each such
  site's own share.

A site receives its neighbourhood's advertisements and a MULTIPROOF (``multiproof``): the tree
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
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

from prism_runtime.secure_sum._encoding import DOMAIN, frame
from prism_runtime.secure_sum.errors import KeyBindingError
from prism_runtime.secure_sum.keys import AdvertisedKeys, noise_share_bytes

__all__ = [
    "HASH_BYTES",
    "CommittedRoster",
    "RosterPart",
    "advertisement_leaf",
    "graph_seed",
    "multiproof",
    "root_of",
    "roster_digest",
    "transcript_of",
]

HASH_BYTES = 32
"""Bytes of a Merkle node (SHA-256)."""

_LEAF, _NODE = b"\x00", b"\x01"


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
    return hashlib.sha256(_LEAF + framed).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_NODE + left + right).digest()


def _walk(n: int, known: Mapping[int, bytes], sibling: Callable[[int, int], bytes]) -> bytes:
    """The root of a tree of ``n`` leaves from the ``known`` leaf hashes (by position), asking
    ``sibling(level, index)`` for each node it cannot compute, in one fixed order (by level,
    then by index)."""
    level, size, depth = dict(known), n, 0
    while size > 1:
        up: dict[int, bytes] = {}
        for index in sorted(level):
            if index // 2 in up:
                continue  # the right child of a pair already joined
            other = index ^ 1
            if other >= size:  # an odd last node: carried up unchanged
                up[index // 2] = level[index]
                continue
            got = level[other] if other in level else sibling(depth, other)
            pair = (level[index], got) if index % 2 == 0 else (got, level[index])
            up[index // 2] = _node(*pair)
        level, size, depth = up, (size + 1) // 2, depth + 1
    return level[0]


def _levels(leaves: Sequence[bytes]) -> list[list[bytes]]:
    levels = [list(leaves)]
    while len(levels[-1]) > 1:
        below = levels[-1]
        levels.append(
            [
                _node(below[i], below[i + 1]) if i + 1 < len(below) else below[i]
                for i in range(0, len(below), 2)
            ]
        )
    return levels


def multiproof(leaves: Sequence[bytes], positions: Collection[int]) -> tuple[bytes, ...]:
    """The nodes of the tree over ``leaves`` that ``root_of`` needs, besides the leaves at
    ``positions``, to rebuild its root (in the order it asks for them)."""
    return _proof(_levels(leaves), positions)


def _proof(levels: list[list[bytes]], positions: Collection[int]) -> tuple[bytes, ...]:
    leaves = levels[0]
    proof: list[bytes] = []

    def sibling(depth: int, index: int) -> bytes:
        proof.append(levels[depth][index])
        return levels[depth][index]

    _walk(len(leaves), {p: leaves[p] for p in positions}, sibling)
    return tuple(proof)


def root_of(n: int, known: Mapping[int, bytes], proof: Sequence[bytes]) -> bytes:
    """The root of a tree of ``n`` leaves holding the ``known`` leaf hashes (by position) with
    ``proof``'s nodes (``multiproof``).

    Raises:
        KeyBindingError: a position is outside ``[0, n)``, or the proof is too short or too
            long for these positions.
    """
    if not known or any(not 0 <= p < n for p in known):
        raise KeyBindingError(
            f"a roster proof names no leaf, or a place outside the roster of {n}: refuse it"
        )
    nodes = iter(proof)

    def sibling(depth: int, index: int) -> bytes:
        node = next(nodes, None)
        if node is None:
            raise KeyBindingError("the roster proof is too short for its leaves: refuse it")
        return node

    root = _walk(n, known, sibling)
    if next(nodes, None) is not None:
        raise KeyBindingError("the roster proof holds more nodes than its leaves need: refuse it")
    return root


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
        proof: ``multiproof`` of those leaves' places in id order.
    """

    ids: tuple[str, ...]
    largest_share: float
    leaves: Mapping[str, AdvertisedKeys]
    proof: tuple[bytes, ...] = ()

    @classmethod
    def whole(cls, roster: Mapping[str, AdvertisedKeys]) -> RosterPart:
        """The whole roster as a part (every leaf, no proof nodes, L its largest share)."""
        largest = max((keys.noise_share for keys in roster.values()), default=0.0)
        return cls(tuple(sorted(roster)), largest, dict(roster))

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
        self.largest_share = (
            max((keys.noise_share for keys in roster.values()), default=0.0)
            if largest_share is None
            else largest_share
        )
        if not math.isfinite(self.largest_share) or self.largest_share < 0:
            raise KeyBindingError(f"a largest noise share of {self.largest_share!r}: give one >= 0")
        self.leaves = [advertisement_leaf(roster[site]) for site in self.ids]
        self._levels = _levels(self.leaves)
        self.root = self._levels[-1][0] if self.leaves else b""
        self.place = {site: p for p, site in enumerate(self.ids)}
        self.digest = roster_digest(self.ids, self.root)

    def part(self, sites: Iterable[str]) -> RosterPart:
        """The part of the roster for a site whose neighbourhood is ``sites``."""
        chosen = sorted(set(sites))
        proof = _proof(self._levels, [self.place[site] for site in chosen])
        leaves = {site: self.roster[site] for site in chosen}
        return RosterPart(self.ids, self.largest_share, leaves, proof)

    def seed(self, threshold: int, graph: tuple[int, int] | None) -> bytes:
        """``graph_seed`` of this roster."""
        return graph_seed(threshold, graph, self.digest)

    def transcript(self, threshold: int, graph: tuple[int, int] | None) -> bytes:
        """``transcript_of`` this roster and its stated largest share."""
        return transcript_of(threshold, graph, self.digest, self.largest_share)
