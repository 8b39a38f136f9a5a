"""Exceptions of the secure sum (``prism_runtime.secure_sum``).

Every class derives from ``SecureSumError`` and so from ``prism_runtime.errors.ClientError``.
Each message names the site or the count that was wrong and says what to do. A class that stops
a site's part in a round carries the error code the site replies with (``code``, one of
``prism_runtime.protocol.SECURE_ERRORS``; the message itself goes to the site's log only).
"""

from __future__ import annotations

from typing import ClassVar

from prism_runtime.errors import ClientError

__all__ = [
    "ConsistencyError",
    "KeyBindingError",
    "MasksUsedError",
    "NoiseShareError",
    "SecureSumAbortedError",
    "SecureSumError",
    "ShareError",
    "SumOverflowError",
    "ThresholdError",
]


class SecureSumError(ClientError, ValueError):
    """Base class of the secure sum's errors; raised itself for a malformed vector or roster."""

    code: ClassVar[int] = 4003
    """The site's error reply code (``prism_runtime.protocol.SITE_ERROR_CODES``)."""


class SecureSumAbortedError(SecureSumError):
    """Too few sites (or too few shares of a needed secret) are left to finish the round, or more
    of the round's sites are missing than a site tolerates (its ``max_dropouts``).

    Raised before anything is unmasked or revealed: the round ends without a sum and the sites'
    inputs stay hidden. The message says how many arrived and how many the threshold needs.
    """

    code = 4011


class ThresholdError(SecureSumError):
    """The roster or threshold of a round does not meet a site's threshold condition
    (``trust.RoundTrust.check_threshold``): a coordinator colluding with as many sites as the
    site allows for could reconstruct one site's input. Raised before anything is shared."""

    code = 4010


class ConsistencyError(SecureSumError):
    """The participant and survivor sets a site was given disagree with what it signed, what its
    peers signed (fewer than t valid signatures on exactly its sets), or what it was told
    before: the coordinator told different sites different sets. Nothing is revealed."""

    code = 4012


class MasksUsedError(SecureSumError):
    """A site already masked its one input with this round's masks (a second masked input would
    reveal the difference of the two), or the round's secrets are gone (the site restarted) or
    stale (the node's state is older than the site's durable record). Nothing is masked."""

    code = 4013


class KeyBindingError(SecureSumError):
    """A site's advertised public keys are not bound to its registered identity.

    The signature does not verify against the identity key registered for that site id, the site
    has no registered key, or a key is malformed: the coordinator (or the network) substituted
    the keys. The receiving site must not share secrets with that roster.
    """

    code = 4014


class ShareError(SecureSumError):
    """An encrypted share failed authentication, or a reconstructed secret does not match what
    its owner committed to; the message names the site whose share is wrong."""

    code = 4014


class NoiseShareError(SecureSumError):
    """A roster site signed a noise share larger than the whole noise the receiving site's own
    charge needs: adding it would drown the round. Raised before the site charges anything."""

    code = 4015


class SumOverflowError(SecureSumError):
    """The signed sum of the inputs may not fit in ``b`` bits, or an input exceeds its bound."""
