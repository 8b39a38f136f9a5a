"""Authenticated encryption of the Shamir shares one site sends another through the coordinator.

A site's two shares for one receiver (of its self-mask seed and of its mask private key) travel
as one ChaCha20-Poly1305 ciphertext under the pair's share-encryption key
(``keys.pairwise_key`` with ``SHARE_PURPOSE``). Both directions of a pair use the same key, so
the 12-byte nonce is random (``os.urandom``) and sent in front of the ciphertext. The associated
data frames the run id, the round, the sender, the receiver and the round's transcript
(``views.round_transcript``: the threshold, the masking graph's degree and neighbourhood
threshold, the roster's ids, the Merkle root of every roster site's advertisement and the
stated largest noise share): a ciphertext moved to another pair,
direction, round or run, or altered in any bit, fails authentication, and so does one opened by
a site that was told another threshold, graph or roster, or another advertisement of any roster
site. Every site holding a site's shares therefore holds them for the one transcript that site
shared with (and checked its threshold and graph in, ``trust.RoundTrust``).
"""

from __future__ import annotations

import os
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


def _associated(round_id: RoundId, sender: str, receiver: str, transcript: bytes) -> bytes:
    return frame(
        DOMAIN, "shares", round_id.run_id, round_id.server_round, sender, receiver, transcript
    )


def seal_shares(
    key: bytes,
    shares: SharePair,
    *,
    sender: str,
    receiver: str,
    round_id: RoundId,
    transcript: bytes,
) -> bytes:
    """``nonce || ChaCha20-Poly1305(key, nonce, shares, ad = (run, round, sender, receiver,
    transcript))``."""
    nonce = os.urandom(NONCE_BYTES)
    plaintext = frame(shares.seed, shares.mask_key)
    associated = _associated(round_id, sender, receiver, transcript)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def open_shares(
    key: bytes,
    sealed: bytes,
    *,
    sender: str,
    receiver: str,
    round_id: RoundId,
    transcript: bytes,
) -> SharePair:
    """The shares ``sender`` sealed for ``receiver`` in the run of the round ``transcript``
    names.

    Raises:
        ShareError: The ciphertext fails authentication (altered, replayed from another pair,
            direction, round or run, sealed under another key, or under another transcript:
            another threshold, graph, roster or advertisement) or is malformed.
    """
    associated = _associated(round_id, sender, receiver, transcript)
    try:
        plaintext = ChaCha20Poly1305(key).decrypt(
            sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated
        )
        seed, mask_key = unframe(plaintext)
    except (InvalidTag, ValueError):
        raise ShareError(
            f"the encrypted shares from site {sender!r} to site {receiver!r} fail "
            "authentication: they were altered or replayed on the way, or sealed for another "
            "threshold, graph or roster; use nothing from them and abort this site's part in "
            "the round"
        ) from None
    return SharePair(seed, mask_key)
