"""The integer mechanism: rounding is unbiased and bounded, Skellam noise has the Skellam law."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from prism_core.discrete import (
    PTRS_MIN_MU,
    conditional_round,
    randomized_round,
    rounded_l1_bound,
    rounded_l2_bound,
    share_mu,
    skellam_noise,
    uniform,
)
from prism_core.errors import PrivacyParameterError
from prism_core.rng import SecureRNG

SKELLAM_MUS = (0.5, 10.0, 1000.0)
"""One mean below ``PTRS_MIN_MU`` (inversion), one at it and one far above (PTRS)."""

CHI2_ALPHA = 1e-6
"""Significance of the goodness-of-fit tests: a correct sampler fails one in a million runs."""


def _source(kind: str, seed: int = 0) -> torch.Generator | SecureRNG:
    return SecureRNG() if kind == "secure" else torch.Generator().manual_seed(seed)


# --- uniforms --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["seeded", "secure"])
def test_uniforms_lie_strictly_inside_the_unit_interval_with_mean_one_half(kind):
    """200 000 uniforms: all in (0, 1); mean within 5 standard errors (sqrt(1/12 / n)) of 1/2."""
    u = uniform(200_000, _source(kind))
    assert u.dtype == np.float64
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean() - 0.5) <= 5 * math.sqrt(1 / 12 / u.size)


# --- randomized rounding ---------------------------------------------------------------------


def test_randomized_rounding_is_floor_or_ceil_and_unbiased():
    """20 000 roundings of a fixed vector whose fractional parts span [0, 1): every coordinate
    is floor or ceil of x / gamma, and each coordinate's mean is within 5 standard errors
    (sqrt(f (1 - f) / n)) of x / gamma; integral coordinates never move."""
    gamma, n = 0.25, 20_000
    fractions = torch.linspace(0.0, 0.96875, 32, dtype=torch.float64)
    integers = torch.arange(-16, 16, dtype=torch.float64)
    y = integers + fractions
    x = (gamma * y).repeat(n, 1)
    rounded = randomized_round(x, gamma, generator=torch.Generator().manual_seed(1))
    assert rounded.dtype == torch.int64 and rounded.shape == x.shape
    low, high = torch.floor(y).to(torch.int64), torch.ceil(y).to(torch.int64)
    assert bool(((rounded == low) | (rounded == high)).all())
    mean = rounded.to(torch.float64).mean(dim=0)
    se = torch.sqrt(fractions * (1 - fractions) / n)
    assert bool((torch.abs(mean - y) <= 5 * se + 1e-12).all())
    assert bool((rounded[:, 0] == integers[0].to(torch.int64)).all())  # fraction 0: exact


def test_randomized_rounding_from_the_os_is_floor_or_ceil_and_leaves_its_input():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    before = x.clone()
    rounded = randomized_round(x, 0.01, generator=SecureRNG())
    y = x.to(torch.float64) / 0.01
    assert bool(((rounded == torch.floor(y)) | (rounded == torch.ceil(y))).all())
    assert torch.equal(x, before)


@pytest.mark.parametrize(
    ("x", "gamma"),
    [
        (torch.tensor([1.0, math.nan]), 0.1),
        (torch.tensor([1.0, math.inf]), 0.1),
        (torch.tensor([1.0]), 0.0),
        (torch.tensor([1.0]), -1.0),
        (torch.tensor([1.0]), math.inf),
        (torch.tensor([1e6]), 1e-12),  # |x / gamma| = 1e18 > 2^53
    ],
)
def test_randomized_rounding_refuses_what_it_cannot_round_exactly(x, gamma):
    with pytest.raises(PrivacyParameterError):
        randomized_round(x, gamma, generator=torch.Generator().manual_seed(0))


def _contribution(dim: int, norm: float, seed: int) -> torch.Tensor:
    v = torch.randn(dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return v * (norm / torch.linalg.vector_norm(v))


def test_every_rounding_meets_the_bound_c_over_gamma_plus_sqrt_d():
    """50 roundings each of 20 contributions of norm C in 500 dimensions: the rounded norm
    is below ``C / gamma + sqrt(d)`` (each coordinate moves by less than 1)."""
    dim, clip, gamma = 500, 1.0, 0.05
    bound = rounded_l2_bound(l2_norm=clip, gamma=gamma, dim=dim)
    assert bound == pytest.approx(clip / gamma + math.sqrt(dim), rel=1e-15)
    g = torch.Generator().manual_seed(3)
    for seed in range(20):
        x = _contribution(dim, clip, seed).repeat(50, 1)
        norms = torch.linalg.vector_norm(randomized_round(x, gamma, generator=g).double(), dim=1)
        assert float(norms.max()) < bound


def test_the_beta_bound_is_tighter_and_grows_as_beta_shrinks():
    """The Kairouz-Liu-Steinke bound is ``sqrt(c^2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2))``
    capped by ``c + sqrt(d)``: checked at one point by hand, monotone in beta."""
    c, d = 20.0, 500
    by_hand = math.sqrt(c * c + d / 4 + math.sqrt(2 * math.log(1e3)) * (c + math.sqrt(d) / 2))
    got = rounded_l2_bound(l2_norm=1.0, gamma=1 / c, dim=d, beta=1e-3)
    assert got == pytest.approx(by_hand, rel=1e-12)
    assert got < c + math.sqrt(d)
    bounds = [rounded_l2_bound(l2_norm=1.0, gamma=1 / c, dim=d, beta=b) for b in (0.1, 1e-3, 1e-9)]
    assert bounds == sorted(bounds)
    # a tiny beta cannot exceed the bound that always holds
    assert rounded_l2_bound(l2_norm=1.0, gamma=1.0, dim=1, beta=1e-300) == pytest.approx(2.0)


def test_conditional_rounding_stays_within_its_bound_by_retrying():
    """The bound is set at the median norm of plain roundings, so about half of them exceed
    it; 100 conditional roundings (fresh seeds) all meet it, and are still floor or ceil."""
    dim, gamma = 400, 0.05
    x = _contribution(dim, 1.0, seed=4)
    g = torch.Generator().manual_seed(5)
    plain = torch.linalg.vector_norm(
        randomized_round(x.repeat(400, 1), gamma, generator=g).double(), dim=1
    )
    bound = float(plain.median())
    assert float((plain > bound).double().mean()) > 0.3  # retries are really needed
    y = x / gamma
    for _ in range(100):
        r = conditional_round(x, gamma, bound=bound, generator=g)
        assert float(torch.linalg.vector_norm(r.double())) <= bound
        assert bool(((r == torch.floor(y)) | (r == torch.ceil(y))).all())


def test_conditional_rounding_with_the_beta_bound_from_the_os_meets_it():
    dim, gamma = 1000, 0.02
    bound = rounded_l2_bound(l2_norm=1.0, gamma=gamma, dim=dim, beta=1e-6)
    for seed in range(10):
        r = conditional_round(
            _contribution(dim, 1.0, seed), gamma, bound=bound, generator=SecureRNG()
        )
        assert float(torch.linalg.vector_norm(r.double())) <= bound


def test_conditional_rounding_raises_after_max_tries_for_an_impossible_bound():
    """x / gamma = 2.5 everywhere: every rounding has norm >= 2 sqrt(d) = 4 > 1."""
    x = torch.full((4,), 0.25, dtype=torch.float64)
    with pytest.raises(PrivacyParameterError, match=r"7 roundings .* above bound=1\.0"):
        conditional_round(
            x, 0.1, bound=1.0, generator=torch.Generator().manual_seed(0), max_tries=7
        )


@pytest.mark.parametrize("max_tries", [0, -1, True])
def test_conditional_rounding_needs_at_least_one_try(max_tries):
    with pytest.raises(PrivacyParameterError):
        conditional_round(
            torch.ones(2), 0.1, bound=100.0, generator=torch.Generator(), max_tries=max_tries
        )


def test_the_l1_bound_holds_for_random_integer_vectors():
    """5000 random integer vectors (small and large entries, 1 to 64 dimensions): l1 norm <=
    ``rounded_l1_bound(l2 norm)`` = min(sqrt(d) l2, l2^2)."""
    rng = np.random.default_rng(6)
    for _ in range(5000):
        d = int(rng.integers(1, 65))
        v = rng.integers(-int(rng.choice([2, 50])), int(rng.choice([2, 50])) + 1, size=d)
        l2 = float(np.linalg.norm(v))
        assert np.abs(v).sum() <= rounded_l1_bound(l2_bound=l2, dim=d) * (1 + 1e-12)
    assert rounded_l1_bound(l2_bound=3.0, dim=100) == 9.0  # l2^2 below sqrt(d) l2
    assert rounded_l1_bound(l2_bound=30.0, dim=4) == 60.0  # sqrt(d) l2 below l2^2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"l2_norm": -1.0, "gamma": 1.0, "dim": 3},
        {"l2_norm": 1.0, "gamma": 0.0, "dim": 3},
        {"l2_norm": 1.0, "gamma": 1.0, "dim": 0},
        {"l2_norm": 1.0, "gamma": 1.0, "dim": 3, "beta": 0.0},
        {"l2_norm": 1.0, "gamma": 1.0, "dim": 3, "beta": 1.0},
    ],
)
def test_the_rounding_bound_refuses_parameters_out_of_range(kwargs):
    with pytest.raises(PrivacyParameterError):
        rounded_l2_bound(**kwargs)


# --- Skellam noise ---------------------------------------------------------------------------


def _moments_ok(samples: np.ndarray, mu: float, z: float) -> None:
    """Mean 0 and variance 2 mu within ``z`` standard errors. The sample variance's standard
    error is sqrt((m4 - s^4) / n) with the Skellam cumulants k2 = k4 = 2 mu, so
    m4 = 2 mu + 12 mu^2 and m4 - s^4 = 2 mu + 8 mu^2."""
    n = samples.size
    x = samples.astype(np.float64)
    assert abs(x.mean()) <= z * math.sqrt(2 * mu / n)
    assert abs(x.var() - 2 * mu) <= z * math.sqrt((2 * mu + 8 * mu * mu) / n)


@pytest.mark.parametrize("mu", SKELLAM_MUS)
@pytest.mark.parametrize("kind", ["seeded", "secure"])
def test_skellam_samples_have_mean_zero_and_variance_two_mu(mu, kind):
    """200 000 samples per mu: mean and variance within 5 standard errors (6 for the OS
    source, which is not reproducible: a false alarm once in ~5e8 runs)."""
    samples = skellam_noise((200_000,), mu, source=_source(kind, seed=7)).numpy()
    _moments_ok(samples, mu, z=5.0 if kind == "seeded" else 6.0)


def _chi2_pvalue(samples: np.ndarray, mu: float) -> float:
    """Pearson's chi-square of the samples against the exact Skellam(mu, mu) pmf: one bin per
    value with expected count >= 5, the two tails pooled into one bin each."""
    n = samples.size
    sd = math.sqrt(2 * mu)
    ks = np.arange(math.floor(-10 * sd - 10), math.ceil(10 * sd + 10) + 1)
    expected = n * stats.skellam.pmf(ks, mu, mu)
    keep = ks[expected >= 5]
    lo, hi = int(keep.min()), int(keep.max())
    inner = np.arange(lo, hi + 1)
    observed = np.array([np.count_nonzero(samples == k) for k in inner], dtype=np.float64)
    expect = n * stats.skellam.pmf(inner, mu, mu)
    observed = np.concatenate(
        [[np.count_nonzero(samples < lo)], observed, [np.count_nonzero(samples > hi)]]
    )
    expect = np.concatenate(
        [[n * stats.skellam.cdf(lo - 1, mu, mu)], expect, [n * stats.skellam.sf(hi, mu, mu)]]
    )
    chi2 = float(((observed - expect) ** 2 / expect).sum())
    return float(stats.chi2.sf(chi2, df=observed.size - 1))


@pytest.mark.parametrize("mu", SKELLAM_MUS)
def test_skellam_samples_fit_the_exact_skellam_pmf(mu):
    """Chi-square goodness of fit of 200 000 seeded samples against scipy's Skellam(mu, mu)
    pmf, rejected only at p < 1e-6 (inversion at mu = 0.5, PTRS at 10 and 1000)."""
    samples = skellam_noise((200_000,), mu, source=torch.Generator().manual_seed(8)).numpy()
    assert _chi2_pvalue(samples, mu) > CHI2_ALPHA


def test_os_skellam_samples_fit_the_exact_skellam_pmf():
    samples = skellam_noise((200_000,), 10.0, source=SecureRNG()).numpy()
    assert _chi2_pvalue(samples, 10.0) > CHI2_ALPHA


@pytest.mark.parametrize(("mu", "honest"), [(10.0, 4), (1000.0, 7)])
def test_the_sum_of_honest_shares_is_skellam_of_the_total(mu, honest):
    """The closure property: the sum of H independent Sk(mu / H) shares has variance 2 mu
    (5 standard errors) and fits the Sk(mu) pmf (chi-square, p > 1e-6), whichever sampler the
    shares use (mu / H = 2.5 by inversion, 1000 / 7 by PTRS)."""
    g = torch.Generator().manual_seed(9)
    share = share_mu(mu, honest)
    assert share == pytest.approx(mu / honest, rel=1e-15)
    total = sum(skellam_noise((100_000,), share, source=g) for _ in range(honest))
    assert isinstance(total, torch.Tensor)
    _moments_ok(total.numpy(), mu, z=5.0)
    assert _chi2_pvalue(total.numpy(), mu) > CHI2_ALPHA


def test_os_draws_differ_between_calls_and_ignore_torch_global_seed():
    torch.manual_seed(0)
    first = skellam_noise((1000,), 10.0, source=SecureRNG())
    torch.manual_seed(0)
    second = skellam_noise((1000,), 10.0, source=SecureRNG())
    assert not torch.equal(first, second)
    x = torch.rand(1000, dtype=torch.float64)
    assert not torch.equal(
        randomized_round(x, 0.1, generator=SecureRNG()),
        randomized_round(x, 0.1, generator=SecureRNG()),
    )


@pytest.mark.parametrize("mu", SKELLAM_MUS)
def test_seeded_draws_reproduce(mu):
    a = skellam_noise((2, 500), mu, source=torch.Generator().manual_seed(11))
    b = skellam_noise((2, 500), mu, source=torch.Generator().manual_seed(11))
    c = skellam_noise((2, 500), mu, source=torch.Generator().manual_seed(12))
    assert torch.equal(a, b) and not torch.equal(a, c)
    x = torch.rand(500, dtype=torch.float64)
    r1 = randomized_round(x, 0.1, generator=torch.Generator().manual_seed(13))
    r2 = randomized_round(x, 0.1, generator=torch.Generator().manual_seed(13))
    assert torch.equal(r1, r2)


def test_skellam_noise_shape_dtype_and_the_zero_mean():
    noise = skellam_noise((3, 4, 5), 2.0, source=torch.Generator().manual_seed(0), device="cpu")
    assert noise.shape == (3, 4, 5) and noise.dtype == torch.int64
    assert torch.equal(
        skellam_noise((7,), 0.0, source=SecureRNG()), torch.zeros(7, dtype=torch.int64)
    )
    assert skellam_noise((0,), 5.0, source=SecureRNG()).numel() == 0
    assert PTRS_MIN_MU == 10.0


@pytest.mark.parametrize("mu", [-1.0, math.nan, math.inf])
def test_skellam_noise_refuses_a_bad_mu(mu):
    with pytest.raises(PrivacyParameterError, match="mu="):
        skellam_noise((3,), mu, source=torch.Generator())


@pytest.mark.parametrize(("mu_total", "honest"), [(10.0, 0), (10.0, -2), (-1.0, 3), (10.0, True)])
def test_share_mu_refuses_bad_parameters(mu_total, honest):
    with pytest.raises(PrivacyParameterError):
        share_mu(mu_total, honest)
