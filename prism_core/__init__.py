"""PRISM: private Riemannian fine-tuning of LoRA adapters on the fixed-rank manifold.

Pure functions on tensors (no Flower, no I/O):

- ``manifold``: lift, tangent norm, retraction, displacement, min-norm lift (eqs. 13-15, 22).
- ``mechanism``: global intrinsic clipping and tangent Gaussian noise (eqs. 16-19).
- ``adaptive``: DP-aware gauge-invariant adaptive transform (eqs. 24-26).
- ``baselines``: factor-space DP-LoRA, FFA-LoRA and non-DP gradients for comparison.
- ``records``: ``PrivacyEvent``, the one record of a privacy event, from the mechanism to the
  ledgers.
- ``accounting``: epsilon from mechanism histories with Opacus' PRV (RDP cross-check).
- ``quantile``: a private clip norm, the DP quantile estimate of Andrew et al. (2021).
- ``rng``: seeded or secure (OS CSPRNG) noise sources.
- ``discrete``: randomized rounding and Skellam noise shares, for a secure sum.
- ``distributed``: a site's secure-sum share in tangent coordinates and its decoding.
- ``skellam_accounting``: epsilon of the Poisson-subsampled Skellam mechanism (RDP).
"""

from prism_core.manifold import Point, Tangent
from prism_core.records import PrivacyEvent

__all__ = ["Point", "PrivacyEvent", "Tangent"]
