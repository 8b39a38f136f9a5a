"""The ring Z_(2^b) the secure sum adds in: encoding signed inputs, centring the sum, the bound.

Values are numpy ``uint64`` arrays reduced with ``& (2^b - 1)``, ``1 <= b <= 62``. Because 2^b
divides 2^64, uint64 arithmetic that wraps mod 2^64 and is reduced at the end is exact mod 2^b.
A signed integer x is encoded as x mod 2^b (two's complement, then reduced). The sum of K inputs
with ``|x| <= M`` per coordinate lies in ``[-K M, K M]``; when ``K M < 2^(b-1)`` that interval
fits in the centred range ``[-2^(b-1), 2^(b-1))`` and ``centre`` (values ``>= 2^(b-1)`` minus
``2^b``) recovers it exactly; docs/design.md §3.3 sizes gamma and b for this.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum.errors import SecureSumError, SumOverflowError

__all__ = [
    "MAX_BITS",
    "FieldVector",
    "centre",
    "check_bits",
    "check_field",
    "check_sum_fits",
    "encode_signed",
    "modulus_mask",
    "sum_fits",
]

MAX_BITS = 62
"""Largest ``b``: a centred value and 2^b itself still fit in int64."""

FieldVector = npt.NDArray[np.uint64]
"""A vector of Z_(2^b): 1-D, uint64, every value below 2^b."""


def check_bits(bits: int) -> None:
    """Raise ``ConfigError`` unless ``bits`` is an int in ``[1, MAX_BITS]``."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ConfigError(f"bits is {bits!r}: give an int modulus exponent b in [1, {MAX_BITS}]")


def modulus_mask(bits: int) -> np.uint64:
    """``2^b - 1`` as a uint64, the reduction mask of Z_(2^b)."""
    check_bits(bits)
    return np.uint64((1 << bits) - 1)


def check_field(x: object, *, bits: int, what: str) -> FieldVector:
    """``x`` as a 1-D uint64 array of values in ``[0, 2^b)``, or ``SecureSumError`` naming it."""
    mask = modulus_mask(bits)
    if not isinstance(x, np.ndarray) or x.dtype != np.uint64 or x.ndim != 1:
        kind = f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}".strip()
        raise SecureSumError(
            f"{what} is a {kind}: give a 1-D numpy uint64 vector (encode_signed makes one)"
        )
    if x.size and int(x.max()) > int(mask):
        raise SecureSumError(f"{what} has a value >= 2^{bits}: reduce it mod 2^{bits} first")
    return x


def sum_fits(*, sites: int, bound: int, bits: int) -> bool:
    """Whether the sum of ``sites`` inputs with ``|x| <= bound`` is exact after ``centre``.

    True iff ``sites * bound < 2^(bits - 1)``.
    """
    check_bits(bits)
    if sites < 1 or bound < 0:
        raise ConfigError(f"sites={sites}, bound={bound}: give sites >= 1 and bound >= 0")
    return sites * bound < 1 << (bits - 1)


def check_sum_fits(*, sites: int, bound: int, bits: int) -> None:
    """Raise ``SumOverflowError`` unless ``sum_fits(sites=..., bound=..., bits=...)``."""
    if not sum_fits(sites=sites, bound=bound, bits=bits):
        raise SumOverflowError(
            f"{sites} sites x bound {bound} = {sites * bound} >= 2^{bits - 1}: the signed sum "
            f"could wrap mod 2^{bits}; raise bits, lower the per-coordinate bound (a larger "
            "gamma) or sum over fewer sites"
        )


def encode_signed(
    x: npt.NDArray[np.integer] | torch.Tensor, *, bits: int, bound: int
) -> FieldVector:
    """Signed integers with ``|x| <= bound`` as a uint64 vector in Z_(2^b) (flattened).

    Raises:
        SumOverflowError: A value exceeds ``bound``, or ``bound >= 2^(b-1)`` (not decodable).
        SecureSumError: ``x`` is not an integer array or tensor.
    """
    check_bits(bits)
    if bound < 0 or bound >= 1 << (bits - 1):
        raise SumOverflowError(
            f"bound {bound} is outside [0, 2^{bits - 1}): values could not be decoded; raise "
            "bits or lower the bound"
        )
    array = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if not np.issubdtype(array.dtype, np.integer) or array.dtype == np.uint64:
        raise SecureSumError(
            f"the input has dtype {array.dtype}: give signed integers (int64), e.g. after "
            "stochastic rounding"
        )
    signed = array.astype(np.int64).reshape(-1)
    if signed.size and int(np.abs(signed).max()) > bound:
        raise SumOverflowError(
            f"an input coordinate has |x| = {int(np.abs(signed).max())} > bound {bound}: clip "
            "or scale the input before encoding"
        )
    return signed.view(np.uint64) & modulus_mask(bits)


def centre(total: FieldVector, *, bits: int) -> npt.NDArray[np.int64]:
    """The signed integers in ``[-2^(b-1), 2^(b-1))`` congruent to ``total`` mod 2^b."""
    total = check_field(total, bits=bits, what="the modular sum")
    signed = total.astype(np.int64)
    return np.where(signed >= 1 << (bits - 1), signed - (1 << bits), signed)
