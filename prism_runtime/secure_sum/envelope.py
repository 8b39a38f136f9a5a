"""Authenticated encryption of the Shamir shares one site sends another through the coordinator.

A site's two shares for one receiver (of its self-mask seed and of its mask private key) travel
as one ChaCha20-Poly1305 ciphertext under the pair's share-encryption key
(``keys.pairwise_key`` with ``SHARE_PURPOSE``). Both directions of a pair use the same key, so
the 12-byte nonce is random (``os.urandom``) and sent in front of the ciphertext. The associated
data frames the run id, the round, the sender, the receiver, the threshold t and the roster the
shares were split among: a ciphertext moved to another pair, direction, round or run, or altered
in any bit, fails authentication, and so does one opened by a site that was told another
threshold or roster. Every site holding a site's shares therefore holds them for the one t and
roster that site checked (``trust.RoundTrust.check_threshold``).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from prism_runtime.secure_sum._encoding import DOMAIN, frame, unframe
from prism_runtime.secure_sum.errors import ShareError
from prism_runtime.secure_sum.keys import RoundId

__all__ = ["NONCE_BYTES", "SharePair", "open_shares", "seal_shares"]

NONCE_BYTES = 12


class SharePair(NamedTuple):
    """The two shares a sender gives one receiver."""

    seed: bytes
    """Share of the sender's self-mask seed."""
    mask_key: bytes
    """Share of the sender's mask private key (raw X25519 bytes)."""


def _associated(
    round_id: RoundId,
    sender: str,
    receiver: str,
    threshold: int,
    roster: Collection[str],
    degree: int | None,
) -> bytes:
    holders = sorted(roster)
    graph: tuple[str | int, ...] = () if degree is None else ("degree", degree)
    return frame(
        DOMAIN,
        "shares",
        round_id.run_id,
        round_id.server_round,
        sender,
        receiver,
        threshold,
        len(holders),
        *holders,
        *graph,
    )


def seal_shares(
    key: bytes,
    shares: SharePair,
    *,
    sender: str,
    receiver: str,
    round_id: RoundId,
    threshold: int,
    roster: Collection[str],
    degree: int | None = None,
) -> bytes:
    """``nonce || ChaCha20-Poly1305(key, nonce, shares, ad = (run, round, sender, receiver,
    threshold, roster[, degree]))``; ``degree``: a sparse masking graph's (``graph``), whose
    threshold ``threshold`` then is."""
    nonce = os.urandom(NONCE_BYTES)
    plaintext = frame(shares.seed, shares.mask_key)
    associated = _associated(round_id, sender, receiver, threshold, roster, degree)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def open_shares(
    key: bytes,
    sealed: bytes,
    *,
    sender: str,
    receiver: str,
    round_id: RoundId,
    threshold: int,
    roster: Collection[str],
    degree: int | None = None,
) -> SharePair:
    """The shares ``sender`` sealed for ``receiver`` with ``threshold`` among ``roster``.

    Raises:
        ShareError: The ciphertext fails authentication (altered, replayed from another pair,
            direction, round or run, sealed under another key, or for another threshold or
            roster) or is malformed.
    """
    associated = _associated(round_id, sender, receiver, threshold, roster, degree)
    try:
        plaintext = ChaCha20Poly1305(key).decrypt(
            sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated
        )
        seed, mask_key = unframe(plaintext)
    except (InvalidTag, ValueError):
        raise ShareError(
            f"the encrypted shares from site {sender!r} to site {receiver!r} fail "
            "authentication: they were altered or replayed on the way, or sealed for another "
            "threshold or roster; use nothing from them and abort this site's part in the round"
        ) from None
    return SharePair(seed, mask_key)
