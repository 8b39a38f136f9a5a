"""Noise sources for the DP mechanism: a seeded ``torch.Generator`` or a secure source.

Every sampler in ``prism_core`` takes an explicit ``generator`` argument (no global RNG).
Pass a seeded ``torch.Generator`` for reproducible experiments, or ``SecureRNG()`` in
production: it draws from the operating system's CSPRNG (``os.urandom``) so the noise cannot
be predicted or replayed from a seed, the idea of Opacus' ``secure_mode``.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch import Tensor

__all__ = ["NoiseSource", "SecureRNG", "standard_normal"]


class SecureRNG:
    """Standard Gaussian samples from the OS CSPRNG (``os.urandom``).

    Uniforms with 53 random bits are turned into Gaussians by the Box-Muller transform in
    float64, then cast to the requested dtype. Like Opacus' secure mode, the result is the
    average of two independent draws scaled by ``sqrt(2)`` (still exactly N(0, 1)), which
    blunts floating-point attacks on the low-order bits of a single sample.
    """

    def normal(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """I.i.d. N(0, 1) samples with the given shape, dtype and device (eq. 19's ``U``, ``V``)."""
        count = math.prod(shape)
        draws = [self._box_muller(count) for _ in range(2)]
        z = (draws[0] + draws[1]) / math.sqrt(2.0)
        return torch.from_numpy(z.reshape(shape)).to(device=device, dtype=dtype)

    @staticmethod
    def _box_muller(count: int) -> np.ndarray:
        pairs = (count + 1) // 2
        bits = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64) >> np.uint64(11)
        u = (bits.astype(np.float64) + 0.5) * 2.0**-53  # in (0, 1), never 0
        u1, u2 = u[:pairs], u[pairs:]
        radius = np.sqrt(-2.0 * np.log(u1))
        z = np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])
        return z[:count]


NoiseSource = torch.Generator | SecureRNG


def standard_normal(
    shape: tuple[int, ...], generator: NoiseSource, *, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """I.i.d. N(0, 1) samples drawn from ``generator`` (seeded torch or ``SecureRNG``).

    Implements the Gaussian draws ``U``, ``V`` of eq. (19) / App. A.13 of PRISM.
    """
    if isinstance(generator, SecureRNG):
        return generator.normal(shape, dtype, device)
    return torch.randn(shape, generator=generator, dtype=dtype, device=device)
