"""Norm bounds on an honest site's round (prism_core.bounds): each inequality, checked directly."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.points import SEEDS, random_point

from prism_core.adaptive import AdaptiveConfig, adaptive_direction, init_state
from prism_core.bounds import (
    adam_gain,
    chernoff_batch_quantile,
    chi_norm_quantile,
    dp_step_norm_bound,
    round_update_norm_bound,
    tangent_dimension,
)
from prism_core.manifold import (
    Point,
    Tangent,
    retract,
    tangent_displacement,
    tangent_norm_sq,
)
from prism_core.mechanism import dp_tangent_update

REL = 1e-6  # float64 round-off allowance of the checks below


def _scales(g: torch.Generator, steps: int) -> list[float]:
    """Adversarial update sizes: exponential growth and decay, jumps, and exact zeros."""
    out = []
    for t in range(steps):
        kind = t % 4
        if kind == 0:
            out.append(10.0 ** (6 * torch.rand(1, generator=g).item() - 3))
        elif kind == 1:
            out.append(10.0 ** (t % 9 - 4))
        elif kind == 2:
            out.append(0.0 if t % 8 == 2 else 1e3)
        else:
            out.append(1e-6)
    return out


def test_adam_gain_closed_values():
    assert adam_gain(beta1=0.9, beta2=0.999, max_step=1) == pytest.approx(1.0, abs=1e-12)
    assert adam_gain(beta1=0.0, beta2=0.0) == pytest.approx(1.0, abs=1e-12)  # RMS-normalised
    assert math.isinf(adam_gain(beta1=0.99, beta2=0.9))  # b1^2 > b2: no bound without a horizon
    assert math.isfinite(adam_gain(beta1=0.99, beta2=0.9, max_step=50))
    g = [adam_gain(beta1=0.9, beta2=0.999, max_step=t) for t in (1, 10, 100, 1000)]
    assert g == sorted(g) and g[-1] <= adam_gain(beta1=0.9, beta2=0.999)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("relift", [False, True])
def test_prism_adaptive_direction_never_exceeds_the_gain(seed, relift):
    m, n, r = 9, 7, 3
    A, B = random_point(m, n, r, seed)
    config = AdaptiveConfig(relift_direction=relift)
    state = init_state(A, B)
    g = torch.Generator().manual_seed(seed)
    norm_a, norm_b = (float(torch.linalg.matrix_norm(X, ord=2)) for X in (A, B))
    for t, scale in enumerate(_scales(g, 60), start=1):
        update = Tangent(
            scale * torch.randn(m, r, generator=g, dtype=A.dtype),
            scale * torch.randn(n, r, generator=g, dtype=A.dtype),
        )
        noise_std = [0.0, 1e-3, 1.0][t % 3]
        U, state = adaptive_direction(
            Point(A, B), update, state, noise_std=noise_std, config=config
        )
        gain = adam_gain(beta1=config.beta1, beta2=config.beta2, max_step=t)
        intrinsic = math.sqrt(float(tangent_norm_sq(A, B, U.dA, U.dB)))
        allowed = gain * (math.sqrt(m * r) * norm_b + math.sqrt(n * r) * norm_a)
        assert intrinsic <= allowed * (1 + REL)
        if not relift:  # the factor norms themselves obey the rank-space bound
            assert float(U.dA.norm()) <= gain * math.sqrt(m * r) * (1 + REL)
            assert float(U.dB.norm()) <= gain * math.sqrt(n * r) * (1 + REL)


def test_the_gain_is_attained_at_the_first_step():
    """Not vacuous: at t = 1 without a floor, ||U_A||^2 = m r exactly (the bound with G = 1)."""
    m, n, r = 9, 7, 3
    A, B = random_point(m, n, r, 5)
    g = torch.Generator().manual_seed(5)
    update = Tangent(torch.randn(m, r, generator=g, dtype=A.dtype), torch.zeros(n, r).double())
    config = AdaptiveConfig(relift_direction=False)
    U, _ = adaptive_direction(Point(A, B), update, init_state(A, B), noise_std=0.0, config=config)
    assert float(U.dA.norm()) ** 2 == pytest.approx(m * r, rel=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_torch_adam_per_coordinate_step_is_bounded(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(50, generator=g, dtype=torch.float64))
    lr = 0.01
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
    for t, scale in enumerate(_scales(g, 80), start=1):
        before = p.detach().clone()
        p.grad = scale * torch.randn(50, generator=g, dtype=torch.float64)
        opt.step()
        gain = adam_gain(beta1=0.9, beta2=0.999, max_step=t)
        assert float((p.detach() - before).abs().max()) <= lr * gain * (1 + REL)


@pytest.mark.parametrize("failure", [1e-2, 1e-3])
def test_batch_and_chi_quantiles_hold_empirically(failure):
    """Both tails exceed their quantile in at most a ``failure`` fraction of 20,000 draws."""
    draws = 20_000
    g = torch.Generator().manual_seed(7)
    N, q = 2_000, 0.03
    batches = torch.binomial(torch.full((draws,), float(N)), torch.full((draws,), q), generator=g)
    assert int((batches > chernoff_batch_quantile(q * N, q, failure)).sum()) <= failure * draws
    D = 300
    norms = torch.randn(draws, D, generator=g).norm(dim=1)
    assert int((norms > chi_norm_quantile(D, failure)).sum()) <= failure * draws
    assert chernoff_batch_quantile(q * N, q, 1e-300) <= N  # never more than the whole shard


def test_dp_step_bound_holds_on_the_real_mechanism_in_the_worst_case_direction():
    """Aligned, fully clipped examples make the clipped sum exactly C X: the tail is exercised."""
    shapes = [(10, 8, 2), (6, 12, 3)]
    points = [Point(*random_point(m, n, r, i)) for i, (m, n, r) in enumerate(shapes)]
    g = torch.Generator().manual_seed(11)
    directions = [
        Tangent(torch.randn(m, r, generator=g).double(), torch.randn(n, r, generator=g).double())
        for m, n, r in shapes
    ]
    N, q, C, sigma, failure, trials = 400, 0.05, 0.7, 1.3, 1e-2, 300
    b = q * N
    bound = dp_step_norm_bound(
        max_norm=C,
        noise_multiplier=sigma,
        expected_batch_size=b,
        sample_rate=q,
        dimension=tangent_dimension(shapes),
        failure=failure,
    )
    exceed = 0
    for _ in range(trials):
        k = int(torch.binomial(torch.tensor(float(N)), torch.tensor(q), generator=g))
        lifts = [
            Tangent(1e3 * d.dA.expand(k, -1, -1), 1e3 * d.dB.expand(k, -1, -1)) for d in directions
        ]
        step = dp_tangent_update(
            points,
            lifts,
            noise_multiplier=sigma,
            max_norm=C,
            expected_batch_size=b,
            sample_rate=q,
            generator=g,
        )
        norm = sum(
            float(tangent_norm_sq(p.A, p.B, t.dA, t.dB))
            for p, t in zip(points, step.tangents, strict=True)
        )
        exceed += math.sqrt(norm) > bound
    assert exceed <= failure * trials


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("lr", [1e-3, 0.3])
def test_retraction_moves_at_most_twice_the_step(seed, lr):
    m, n, r = 12, 9, 3
    A, B = random_point(m, n, r, seed)
    g = torch.Generator().manual_seed(seed + 100)
    dA, dB = torch.randn(m, r, generator=g).double(), torch.randn(n, r, generator=g).double()
    A1, B1 = retract(A, B, dA, dB, -lr)
    step = float(tangent_norm_sq(A, B, dA, dB)) ** 0.5
    Z, Z1 = A @ B.T, A1 @ B1.T
    assert float((Z1 - Z).norm()) <= 2 * lr * step * (1 + REL)
    s1 = float(torch.linalg.matrix_norm(Z, ord=2))
    assert float(torch.linalg.matrix_norm(Z1, ord=2)) <= (s1 + lr * step) * (1 + REL)
    # balanced output: both factors carry sqrt(s1(Z1)) as spectral norm
    s1_new = float(torch.linalg.matrix_norm(Z1, ord=2))
    for X in (A1, B1):
        assert float(torch.linalg.matrix_norm(X, ord=2)) == pytest.approx(s1_new**0.5, rel=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("lr", [0.02, 0.5])
def test_round_bound_holds_for_a_full_local_prism_round(seed, lr):
    """tau steps of clip -> noise -> adaptive -> retract, then the sent displacement."""
    shapes = [(10, 8, 2), (7, 11, 3)]
    start = [Point(*random_point(m, n, r, seed + i)) for i, (m, n, r) in enumerate(shapes)]
    g = torch.Generator().manual_seed(seed)
    config = AdaptiveConfig()
    tau, C, sigma, b = 6, 0.5, 1.0, 8.0
    states = [init_state(p.A, p.B) for p in start]
    points = list(start)
    for _ in range(tau):
        k = 8 + int(torch.randint(-3, 4, (1,), generator=g))
        lifts = [
            Tangent(
                torch.randn(k, m, r, generator=g).double(),
                torch.randn(k, n, r, generator=g).double(),
            )
            for m, n, r in shapes
        ]
        step = dp_tangent_update(
            points,
            lifts,
            noise_multiplier=sigma,
            max_norm=C,
            expected_batch_size=b,
            sample_rate=0.1,
            generator=g,
        )
        new = []
        for i, (p, u) in enumerate(zip(points, step.tangents, strict=True)):
            d, states[i] = adaptive_direction(
                p, u, states[i], noise_std=sigma * C / b, config=config
            )
            new.append(retract(p.A, p.B, d.dA, d.dB, -lr))
        points = new
    sent = 0.0
    for s, e in zip(start, points, strict=True):
        d = tangent_displacement(s.A, s.B, e.A, e.B)
        sent += float(tangent_norm_sq(s.A, s.B, d.dA, d.dB))
    gain = adam_gain(beta1=config.beta1, beta2=config.beta2, max_step=tau)
    bound = round_update_norm_bound(start, lr=lr, local_steps=tau, gain=gain)
    assert math.sqrt(sent) <= bound * (1 + REL)
    assert math.sqrt(sent) > 1e-3 * bound  # the round did move: the check is not trivially met
