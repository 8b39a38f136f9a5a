"""The private quantile estimate of Andrew et al. (2021): noisy count, record, geometric update."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_core.errors import PrivacyParameterError
from prism_core.quantile import (
    QUANTILE_MECHANISM,
    clip_range,
    count_noise_multiplier,
    geometric_clip_update,
    noisy_fraction_below,
)
from prism_core.rng import SecureRNG


def test_the_noisy_fraction_is_the_count_over_the_expected_batch_with_its_record():
    g = torch.Generator().manual_seed(0)
    fraction, record = noisy_fraction_below(
        30, noise_multiplier=1e-9, expected_batch_size=100.0, sample_rate=0.1, generator=g
    )
    assert fraction == pytest.approx(0.3, abs=1e-9)  # 30 / b, whatever the realised batch
    assert record.mechanism == QUANTILE_MECHANISM
    assert (record.noise_multiplier, record.max_norm) == (1e-9, 1.0)  # sensitivity 1
    assert (record.expected_batch_size, record.sample_rate) == (100.0, 0.1)


@pytest.mark.parametrize("source", ["seeded", "secure"])
def test_the_count_noise_has_std_sigma_b_over_b(source):
    """4000 draws: the sample std of f~ is within 6 % of sigma_b / b (about 4.5 standard
    errors of a std estimate, sqrt(1 / (2 n)) = 1.1 %)."""
    sigma_b, b, n = count_noise_multiplier(0.05, 200.0), 200.0, 4000
    g = torch.Generator().manual_seed(1) if source == "seeded" else SecureRNG()
    draws = torch.tensor(
        [
            noisy_fraction_below(
                50, noise_multiplier=sigma_b, expected_batch_size=b, sample_rate=0.2, generator=g
            )[0]
            for _ in range(n)
        ],
        dtype=torch.float64,
    )
    assert sigma_b == pytest.approx(10.0)
    assert float(draws.mean()) == pytest.approx(0.25, abs=4 * 0.05 / math.sqrt(n))
    assert float(draws.std()) == pytest.approx(0.05, rel=0.06)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"noise_multiplier": 0.0},
        {"noise_multiplier": -1.0},
        {"expected_batch_size": 0.0},
        {"sample_rate": 0.0},
        {"sample_rate": 1.5},
    ],
)
def test_an_unnoised_or_malformed_count_is_refused(kwargs):
    args = {"noise_multiplier": 1.0, "expected_batch_size": 10.0, "sample_rate": 0.1}
    args.update(kwargs)
    with pytest.raises(PrivacyParameterError):
        noisy_fraction_below(3, generator=torch.Generator().manual_seed(0), **args)


def test_the_geometric_step_moves_toward_the_quantile():
    up = geometric_clip_update(1.0, 0.2, target_quantile=0.5, lr=0.2)  # too few below: grow
    down = geometric_clip_update(1.0, 0.9, target_quantile=0.5, lr=0.2)
    assert up == pytest.approx(math.exp(0.2 * 0.3)) and down == pytest.approx(math.exp(-0.2 * 0.4))
    assert geometric_clip_update(1.0, 0.5, target_quantile=0.5, lr=0.2) == 1.0
    with pytest.raises(PrivacyParameterError):
        geometric_clip_update(1.0, 0.5, target_quantile=1.0, lr=0.2)


@settings(max_examples=50, deadline=None)
@given(
    fractions=st.lists(st.floats(-50, 50), min_size=1, max_size=40),
    gamma=st.floats(0.05, 0.95),
    lr=st.floats(0.01, 1.0),
)
def test_every_estimate_stays_in_the_public_range(fractions, gamma, lr):
    """Whatever the data and the noise, K steps end in ``clip_range`` (float slack 1e-9)."""
    clip = 0.1
    for f in fractions:
        clip = geometric_clip_update(clip, f, target_quantile=gamma, lr=lr)
    low, high = clip_range(0.1, target_quantile=gamma, lr=lr, steps=len(fractions))
    assert low * (1 - 1e-9) <= clip <= high * (1 + 1e-9)
    # the ends are reached by all-above (f <= 0) and all-below (f >= 1) batches
    ends = [0.1, 0.1]
    for _ in fractions:
        ends = [
            geometric_clip_update(ends[0], 1.0, target_quantile=gamma, lr=lr),
            geometric_clip_update(ends[1], 0.0, target_quantile=gamma, lr=lr),
        ]
    assert ends == [pytest.approx(low, rel=1e-9), pytest.approx(high, rel=1e-9)]
