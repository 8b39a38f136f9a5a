"""Merkle trees over SHA-256, with multiproofs: a set of leaves shown to belong to one root.

A leaf hash is SHA-256 of ``LEAF`` (``0x00``) and the leaf's framed bytes (made by its user:
``roster.advertisement_leaf``, ``views.signature_leaf``); an inner node is SHA-256 of ``0x01``
and its two children; an odd last node is carried up a level unchanged. The two prefixes keep a
leaf from passing for an inner node. A MULTIPROOF of a set of leaf positions is the list of
nodes the verifier cannot compute from those leaves, in the order ``root_of`` asks for them (by
level, then by position): about ``m log2(n / m)`` hashes for ``m`` of ``n`` leaves, none for all
of them. The tree's size ``n`` is the verifier's to know (it is in what the root is bound to).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence

from prism_runtime.secure_sum.errors import KeyBindingError

__all__ = ["HASH_BYTES", "LEAF", "MerkleTree", "root_of"]

HASH_BYTES = 32
"""Bytes of a Merkle node (SHA-256)."""
LEAF = b"\x00"
"""The prefix of a leaf hash's input."""
_NODE = b"\x01"


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
    """Every level of the tree over ``leaves``, the leaves first and the root last."""
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


class MerkleTree:
    """The tree over ``leaves`` (leaf hashes), every level kept, for many proofs."""

    def __init__(self, leaves: Sequence[bytes]) -> None:
        self.levels = _levels(leaves)

    @property
    def root(self) -> bytes:
        """The root (empty for a tree of no leaves)."""
        return self.levels[-1][0] if self.levels[0] else b""

    def proof(self, positions: Collection[int]) -> tuple[bytes, ...]:
        """The nodes that ``root_of`` needs, besides the leaves at ``positions``, to rebuild the
        root (in the order it asks for them); ``ValueError`` unless they are at least one place
        of the tree."""
        leaves, levels = self.levels[0], self.levels
        if not positions or any(not 0 <= p < len(leaves) for p in positions):
            raise ValueError(f"a proof needs places in [0, {len(leaves)}), at least one")
        proof: list[bytes] = []

        def sibling(depth: int, index: int) -> bytes:
            proof.append(levels[depth][index])
            return levels[depth][index]

        _walk(len(leaves), {p: leaves[p] for p in positions}, sibling)
        return tuple(proof)


def root_of(n: int, known: Mapping[int, bytes], proof: Sequence[bytes]) -> bytes:
    """The root of a tree of ``n`` leaves holding the ``known`` leaf hashes (by position) with
    ``proof``'s nodes (``MerkleTree.proof``).

    Raises:
        KeyBindingError: a position is outside ``[0, n)``, or the proof is too short or too
            long for these positions.
    """
    if not known or any(not 0 <= p < n for p in known):
        raise KeyBindingError(
            f"a Merkle proof names no leaf, or a place outside its tree of {n}: refuse it"
        )
    nodes = iter(proof)

    def sibling(depth: int, index: int) -> bytes:
        node = next(nodes, None)
        if node is None:
            raise KeyBindingError("the Merkle proof is too short for its leaves: refuse it")
        return node

    root = _walk(n, known, sibling)
    if next(nodes, None) is not None:
        raise KeyBindingError("the Merkle proof holds more nodes than its leaves need: refuse it")
    return root
