"""Shamir secret sharing of a site's 32-byte secrets among the round's sites, threshold t.

Each secret is one element s of the prime field GF(p), p = 2^521 - 1 (a Mersenne prime; any
secret of at most 64 bytes, read big-endian, is below it). ``split_secret`` draws a polynomial
``f(x) = s + a_1 x + ... + a_(t-1) x^(t-1)`` whose t - 1 higher coefficients are uniform in
GF(p) from the OS CSPRNG (``secrets.randbelow``), and gives the holder at position q (0-based,
holders in the order given: the round's sites sorted) the share ``(q + 1, f(q + 1))``. Any
t - 1 shares are uniform and independent of s (perfect secrecy: for every s exactly one
polynomial of degree below t passes through them and (0, s)); any t recover s by Lagrange
interpolation at 0.

Why not Flower's ``flwr.common.secure_aggregation.crypto.shamir``: it shares each 16-byte
block with pycryptodome's ``Shamir`` over GF(2^128), whose field multiply is Python bit
arithmetic: 10 ms to split a secret among 19 holders at t = 17 and 30 ms to combine it, where
the same in GF(p) with Python's integers takes 0.08 and 0.11 ms (docs/benchmarks.md, "A
thousand sites"). At a thousand sites the coordinator combines one secret per site and a site
splits two among its neighbourhood every round, so that field was the secure sum's largest
cost there.

What a share cannot say is checked here: below t shares interpolation returns a wrong
secret instead of refusing, and a share's index and length are the sender's. ``combine_secret``
therefore counts the shares against t first (``SecureSumAbortedError``), checks every share's
index against its holder's place, its length and that its value is a field element, and
interpolates from exactly t shares; a result too large for the secret's length is a
``ShareError``. A share whose content is wrong but well-formed still yields a wrong secret;
the caller compares the result with the owner's commitment (``keys.seed_commitment`` or the
advertised public key).

A share is ``_INDEX_BYTES`` little-endian bytes of the index, then ``_VALUE_BYTES`` big-endian
bytes of ``f(index)``.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum.errors import SecureSumAbortedError, ShareError

__all__ = ["FIELD_PRIME", "check_threshold", "combine_secret", "share_length", "split_secret"]

FIELD_PRIME = 2**521 - 1
"""p, the Mersenne prime 2^521 - 1: the field of every share."""
_VALUE_BYTES = (FIELD_PRIME.bit_length() + 7) // 8  # 66
_INDEX_BYTES = 4
_MAX_SECRET_BYTES = 64  # 2^512 < p: every secret of this length is a field element


def check_threshold(threshold: int, sites: int) -> None:
    """Raise ``ConfigError`` unless ``sites / 2 < threshold <= sites``.

    A majority threshold means no two disjoint groups of sites can each reach t: a coordinator
    that tells some sites a site dropped and others that it survived cannot collect t shares of
    both its secrets from honest sites (an honest site reveals one kind of share per site,
    ``SiteRound.answer``).
    Against c colluding sites the condition is ``threshold > (sites + c) / 2``.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int):
        raise ConfigError(f"threshold is {threshold!r}: give an int")
    if not (sites / 2 < threshold <= sites):
        raise ConfigError(
            f"threshold {threshold} with {sites} sites: give a threshold above half the sites "
            f"and at most their number (here {sites // 2 + 1}..{sites})"
        )


def share_length(secret_bytes: int) -> int:
    """Bytes of one share of a secret of at most 64 bytes: the index, then one field element."""
    if not 0 < secret_bytes <= _MAX_SECRET_BYTES:
        raise ConfigError(
            f"a secret of {secret_bytes} bytes: shares hold secrets of 1..{_MAX_SECRET_BYTES}"
        )
    return _INDEX_BYTES + _VALUE_BYTES


def split_secret(secret: bytes, *, threshold: int, holders: Sequence[str]) -> dict[str, bytes]:
    """Shares of ``secret`` (at most 64 bytes), one per holder, any ``threshold`` of which
    recover it; the holder at position q gets index q + 1 (module docstring)."""
    check_threshold(threshold, len(holders))
    if len(set(holders)) != len(holders):
        raise ConfigError(f"holders {list(holders)} name a site twice: give distinct site ids")
    share_length(len(secret))
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [secrets.randbelow(FIELD_PRIME) for _ in range(threshold - 1)]
    coefficients.reverse()  # highest degree first, for Horner's rule
    shares = {}
    for index, holder in enumerate(holders, start=1):
        value = 0
        for coefficient in coefficients:
            value = (value * index + coefficient) % FIELD_PRIME
        shares[holder] = index.to_bytes(_INDEX_BYTES, "little") + value.to_bytes(
            _VALUE_BYTES, "big"
        )
    return shares


def _at_zero(points: Sequence[tuple[int, int]]) -> int:
    """The value at 0 of the polynomial of degree below ``len(points)`` through ``points``
    (distinct x), by Lagrange interpolation in GF(p)."""
    xs = [x for x, _ in points]
    total = 0
    for j, (xj, yj) in enumerate(points):
        numerator = denominator = 1
        for m, xm in enumerate(xs):
            if m != j:
                numerator = numerator * xm % FIELD_PRIME
                denominator = denominator * (xm - xj) % FIELD_PRIME
        total = (total + yj * numerator * pow(denominator, -1, FIELD_PRIME)) % FIELD_PRIME
    return total


def combine_secret(
    shares: Mapping[str, bytes],
    *,
    threshold: int,
    holders: Sequence[str],
    secret_bytes: int,
    what: str,
) -> bytes:
    """The secret that ``threshold`` of its shares (keyed by holder) recover.

    Args:
        shares: Share per holder that returned one (holders not in ``holders`` are an error).
        threshold: t; the first t shares in holder order are used.
        holders: All holders in the order ``split_secret`` was given.
        secret_bytes: The secret's length (1 to 64 bytes).
        what: Names the secret in errors (e.g. "the self-mask seed of site 'b'").

    Raises:
        SecureSumAbortedError: Fewer than ``threshold`` shares.
        ShareError: A share is malformed, carries another holder's index, or fails to combine.
        ConfigError: ``secret_bytes`` is outside 1..64.
    """
    if len(shares) < threshold:
        raise SecureSumAbortedError(
            f"secure sum aborted: {len(shares)} shares of {what} were returned and {threshold} "
            "are needed; nothing was unmasked"
        )
    place = {holder: p for p, holder in enumerate(holders)}
    expected = share_length(secret_bytes)
    values = {}
    for holder, share in shares.items():
        if holder not in place:
            raise ShareError(f"site {holder!r} returned a share of {what} but holds none")
        index = int.from_bytes(share[:_INDEX_BYTES], "little")
        if len(share) != expected or index != place[holder] + 1:
            raise ShareError(
                f"the share of {what} returned by site {holder!r} is malformed ({len(share)} "
                f"bytes, index {index}; expected {expected} bytes, index {place[holder] + 1})"
            )
        values[holder] = int.from_bytes(share[_INDEX_BYTES:], "big")
        if values[holder] >= FIELD_PRIME:
            raise ShareError(
                f"the share of {what} returned by site {holder!r} is malformed: its value is "
                "not an element of the field"
            )
    used = sorted(shares, key=place.__getitem__)[:threshold]
    points = [(place[h] + 1, values[h]) for h in used]
    value = _at_zero(points)
    if value >= 256**secret_bytes:
        raise ShareError(
            f"the shares of {what} from sites {used} do not combine to a {secret_bytes}-byte "
            "secret: one of them is wrong"
        )
    return value.to_bytes(secret_bytes, "big")
