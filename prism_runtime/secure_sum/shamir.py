"""Shamir secret sharing of a site's 32-byte secrets among the round's sites, threshold t.

The field arithmetic is Flower's ``flwr.common.secure_aggregation.crypto.shamir``, which pads
the secret (PKCS#7, to whole 16-byte blocks) and shares each block with pycryptodome's
``Shamir`` over GF(2^128). It is sound for this use, and reused rather than rewritten:

- each block is shared with its own polynomial whose t - 1 higher coefficients are fresh
  16-byte values from ``Crypto.Random.get_random_bytes`` (``os.urandom``), so any t - 1 shares
  are independent of the secret (perfect secrecy per block, hence for the whole secret);
- evaluation points are the nonzero field elements 1..n, recombination is Lagrange
  interpolation at 0 and refuses duplicate points.

What it does not do is checked here: it cannot know t, so below t shares it returns a wrong
secret (or fails on the padding) instead of refusing; it trusts the 4-byte index a share
carries and the shares' lengths. ``combine_secret`` therefore counts the shares against t
first (``SecureSumAbortedError``), checks every share's index against its holder's place and
its length, and interpolates from exactly t shares. A share whose content is wrong but
well-formed still yields a wrong secret; the caller compares the result with the owner's
commitment (``keys.seed_commitment`` or the advertised public key).

Holders are the round's sites in sorted order; the holder at position p (0-based) gets the
share with index p + 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum.errors import SecureSumAbortedError, ShareError

__all__ = ["check_threshold", "combine_secret", "share_length", "split_secret"]

_BLOCK = 16
_INDEX_BYTES = 4


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
    """Bytes of one share of a ``secret_bytes``-byte secret (index, then one block per chunk)."""
    return _INDEX_BYTES + _BLOCK * (secret_bytes // _BLOCK + 1)


def split_secret(secret: bytes, *, threshold: int, holders: Sequence[str]) -> dict[str, bytes]:
    """Shares of ``secret``, one per holder, any ``threshold`` of which recover it."""
    check_threshold(threshold, len(holders))
    if len(set(holders)) != len(holders):
        raise ConfigError(f"holders {list(holders)} name a site twice: give distinct site ids")
    shares = create_shares(bytes(secret), threshold, len(holders))
    return dict(zip(holders, shares, strict=True))


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
        secret_bytes: The secret's length, which fixes the shares' length.
        what: Names the secret in errors (e.g. "the self-mask seed of site 'b'").

    Raises:
        SecureSumAbortedError: Fewer than ``threshold`` shares.
        ShareError: A share is malformed, carries another holder's index, or fails to combine.
    """
    if len(shares) < threshold:
        raise SecureSumAbortedError(
            f"secure sum aborted: {len(shares)} shares of {what} were returned and {threshold} "
            "are needed; nothing was unmasked"
        )
    place = {holder: p for p, holder in enumerate(holders)}
    expected = share_length(secret_bytes)
    for holder, share in shares.items():
        if holder not in place:
            raise ShareError(f"site {holder!r} returned a share of {what} but holds none")
        index = int.from_bytes(share[:_INDEX_BYTES], "little")
        if len(share) != expected or index != place[holder] + 1:
            raise ShareError(
                f"the share of {what} returned by site {holder!r} is malformed ({len(share)} "
                f"bytes, index {index}; expected {expected} bytes, index {place[holder] + 1})"
            )
    used = sorted(shares, key=place.__getitem__)[:threshold]
    try:
        secret = combine_shares([shares[h] for h in used])
    except ValueError:
        raise ShareError(
            f"the shares of {what} from sites {used} do not combine: one of them is wrong"
        ) from None
    if len(secret) != secret_bytes:
        raise ShareError(f"the shares of {what} from sites {used} give a secret of the wrong size")
    return secret
