"""A secure-aggregation site's noise: its share of the sum's Skellam noise and its two sigmas."""

from __future__ import annotations

import math

import pytest

from client.site import SecureNoise
from prism_core.distributed import discrete_sensitivity
from prism_core.skellam_accounting import skellam_sigma


@pytest.mark.parametrize(
    ("sigma", "honest", "dim"), [(0.8, 1, 1000), (1.0, 4, 150_000), (2.5, 8, 64)]
)
def test_the_share_is_the_sums_noise_over_h_and_its_sigma_is_the_share_alone(
    sigma: float, honest: int, dim: int
) -> None:
    noise = SecureNoise.for_sigma(sigma, honest=honest, dim=dim)
    l2, l1 = discrete_sensitivity(dim)
    # the charged sigma is the RDP-equivalent sigma of the SUM of H shares: Skellam(mu)
    assert skellam_sigma(mu=noise.mu, l1=l1, l2=l2) == pytest.approx(sigma, rel=1e-9)
    assert noise.mu_share * honest == pytest.approx(noise.mu, rel=1e-12)
    assert noise.share_sigma == pytest.approx(
        skellam_sigma(mu=noise.mu_share, l1=l1, l2=l2), rel=1e-12
    )
    # a share alone carries 1/sqrt(H) of the noise std (the discreteness terms are ~1e-6 here)
    assert noise.share_sigma == pytest.approx(sigma / math.sqrt(honest), rel=1e-3)
    assert noise.share_sigma <= sigma
