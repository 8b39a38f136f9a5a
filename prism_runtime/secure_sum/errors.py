"""Exceptions of the secure sum (``prism_runtime.secure_sum``).

Every class derives from ``SecureSumError`` and so from ``prism_runtime.errors.ClientError``.
Each message names the site or the count that was wrong and says what to do.
"""

from __future__ import annotations

from prism_runtime.errors import ClientError

__all__ = [
    "KeyBindingError",
    "SecureSumAbortedError",
    "SecureSumError",
    "ShareError",
    "SumOverflowError",
    "UnmaskRefusedError",
]


class SecureSumError(ClientError, ValueError):
    """Base class of the secure sum's errors; raised itself for a malformed vector or roster."""


class SecureSumAbortedError(SecureSumError):
    """Too few sites (or too few shares of a needed secret) are left to finish the round.

    Raised before anything is unmasked or revealed: the round ends without a sum and the sites'
    inputs stay hidden. The message says how many arrived and how many the threshold needs.
    """


class KeyBindingError(SecureSumError):
    """A site's advertised public keys are not bound to its registered identity.

    The signature does not verify against the identity key registered for that site id, the site
    has no registered key, or a key is malformed: the coordinator (or the network) substituted
    the keys. The receiving site must not share secrets with that roster.
    """


class ShareError(SecureSumError):
    """An encrypted share failed authentication, or a reconstructed secret does not match what
    its owner committed to; the message names the site whose share is wrong."""


class UnmaskRefusedError(SecureSumError):
    """A site refuses an unmasking request that would reveal both the self-mask seed share and
    the pairwise-key share of one site (or names a site it holds no share of)."""


class SumOverflowError(SecureSumError):
    """The signed sum of the inputs may not fit in ``b`` bits, or an input exceeds its bound."""
