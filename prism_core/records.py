"""The record of one privatized step: what an accountant needs, nothing private, no tensors.

Shared by the mechanisms (``mechanism``, ``baselines``, ``quantile``), which produce it, and by
``accounting``, which composes it: accounting depends on this record, never on tensor code.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ADJACENCY", "NoiseRecord"]

ADJACENCY = "add-remove"
"""Neighbouring relation of every mechanism here: add or remove one example."""


@dataclass(frozen=True)
class NoiseRecord:
    """What one privatized step ran: the facts an accountant needs, and nothing private.

    Attributes:
        mechanism: ``"prism-tangent-gaussian"`` or a baseline's name.
        noise_multiplier: sigma; the noise std on the summed update is ``sigma * max_norm``.
        max_norm: clip threshold C, the L2 sensitivity of the sum under add/remove adjacency.
        expected_batch_size: ``b = q * N``, the divisor of signal and noise.
        sample_rate: Poisson sampling rate q.
        sampling: how the batch was drawn; only ``"poisson"`` can be accounted as subsampled.
        adjacency: the neighbouring relation, always ``"add-remove"``.
    """

    mechanism: str
    noise_multiplier: float
    max_norm: float
    expected_batch_size: float
    sample_rate: float
    sampling: str = "poisson"
    adjacency: str = ADJACENCY
