"""Masks of the secure sum: a ChaCha20 stream keyed by a full 32-byte key, reduced mod 2^b.

``expand_mask`` keys ChaCha20 (RFC 8439, as in ``cryptography``) with all 32 bytes of a derived
key or seed and a fixed public all-zero nonce and initial counter: each key expands into exactly
one mask (a pairwise key is derived per pair, round and run; a self-mask seed is fresh per round),
so the (key, nonce) pair is never reused for different data. The keystream is read as
little-endian uint64 words, 8 bytes per element; reducing a uniform 64-bit word mod 2^b is
exactly uniform because 2^b divides 2^64. No general-purpose RNG (Python's ``random``, numpy's
generators) and no fold of the key to fewer bits is used.

``mask_input`` follows SecAgg (Bonawitz et al. 2017; Bell et al. 2020): site i sends
``x_i + PRG(s_i) + sum_{j > i} PRG(k_ij) - sum_{j < i} PRG(k_ij)`` mod 2^b, with sites ordered
by their id strings. The pairwise masks cancel in the sum over all sites; the self mask
``PRG(s_i)`` keeps a site's masked input uniform even when its pairwise keys are reconstructed
after it is (perhaps wrongly) declared dropped.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum.field import FieldVector, check_field, modulus_mask
from prism_runtime.secure_sum.keys import KEY_BYTES

__all__ = ["CHACHA_NONCE", "expand_mask", "mask_input", "pairwise_sign"]

CHACHA_NONCE = bytes(16)
"""Public, fixed ChaCha20 nonce (4-byte counter || 12-byte nonce, all zero): each key is used
for one mask only."""


def expand_mask(key: bytes, length: int, *, bits: int) -> FieldVector:
    """The mask of ``length`` elements in Z_(2^b) that ``key`` (32 bytes) expands into.

    Element k is bytes ``8k .. 8k+7`` of the ChaCha20 keystream, little-endian, ``& (2^b - 1)``.
    """
    mask = modulus_mask(bits)
    if len(key) != KEY_BYTES:
        raise ConfigError(f"a mask key has {len(key)} bytes: the stream takes a full 32-byte key")
    if length < 0:
        raise ConfigError(f"mask length is {length}: give a non-negative vector length")
    stream = Cipher(algorithms.ChaCha20(bytes(key), CHACHA_NONCE), mode=None).encryptor()
    words = np.frombuffer(stream.update(bytes(8 * length)), dtype="<u8")
    return words.astype(np.uint64) & mask


def pairwise_sign(site: str, peer: str) -> int:
    """+1 when ``site`` adds the pairwise mask it shares with ``peer`` (peer > site), else -1."""
    if site == peer:
        raise ConfigError(f"site {site!r} has no pairwise mask with itself")
    return 1 if peer > site else -1


def mask_input(
    x: FieldVector,
    *,
    site: str,
    self_seed: bytes,
    pairwise_keys: Mapping[str, bytes],
    bits: int,
) -> FieldVector:
    """``x + PRG(self_seed) + sum_{j > site} PRG(k_j) - sum_{j < site} PRG(k_j)`` mod 2^b.

    Args:
        x: The site's input in Z_(2^b) (``field.encode_signed``), a 1-D uint64 vector.
        site: The site's id; peers are ordered against it as strings.
        self_seed: The site's fresh 32-byte self-mask seed.
        pairwise_keys: The pairwise mask key shared with each other participating site.
        bits: The modulus exponent b.

    Returns:
        A new uint64 vector; ``x`` is not modified.
    """
    x = check_field(x, bits=bits, what=f"the input of site {site!r}")
    n = x.shape[0]
    total = x + expand_mask(self_seed, n, bits=bits)
    for peer in sorted(pairwise_keys):
        stream = expand_mask(pairwise_keys[peer], n, bits=bits)
        if pairwise_sign(site, peer) > 0:
            total += stream
        else:
            total -= stream
    return total & modulus_mask(bits)
