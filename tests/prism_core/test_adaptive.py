"""DP-aware adaptive transform: gauge equivariance, bounded noise amplification, purity."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.points import SEEDS, random_point

from prism_core.adaptive import (
    AdaptiveConfig,
    adaptive_direction,
    adaptive_directions,
    init_state,
)
from prism_core.manifold import Point, Tangent, tangent_to_dense


def _updates(m, n, r, steps, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [
        Tangent(
            scale * torch.randn(m, r, generator=g, dtype=torch.float64),
            scale * torch.randn(n, r, generator=g, dtype=torch.float64),
        )
        for _ in range(steps)
    ]


@pytest.mark.parametrize("seed", SEEDS)
def test_orthogonal_gauge_equivariance(seed):
    """(A R, B R) with moments transformed alongside gives U R and the same tangent (Prop. A.30)."""
    m, n, r = 14, 10, 3
    A, B = random_point(m, n, r, seed)
    R, _ = torch.linalg.qr(
        torch.randn(r, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    )
    config = AdaptiveConfig()
    s1, s2 = init_state(A, B), init_state(A @ R, B @ R)
    for upd in _updates(m, n, r, 4, seed):
        u1, s1 = adaptive_direction(Point(A, B), upd, s1, noise_std=0.3, config=config)
        u2, s2 = adaptive_direction(
            Point(A @ R, B @ R), Tangent(upd.dA @ R, upd.dB @ R), s2, noise_std=0.3, config=config
        )
        torch.testing.assert_close(u2.dA, u1.dA @ R, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(
            tangent_to_dense(A @ R, B @ R, *u2), tangent_to_dense(A, B, *u1), rtol=1e-8, atol=1e-10
        )


def test_floor_bounds_noise_amplification():
    """||m_hat (V + lambda I)^{-1/2}||_F <= ||m_hat||_F / sqrt(lambda) (Thm 3.5)."""
    m, n, r = 20, 16, 4
    A, B = random_point(m, n, r, 0)
    tau = 0.05
    config = AdaptiveConfig(relift_direction=False, bias_correction=False)
    state = init_state(A, B)
    lam = config.floor_scale * tau**2
    for upd in _updates(m, n, r, 5, 1, scale=tau):
        direction, state = adaptive_direction(Point(A, B), upd, state, noise_std=tau, config=config)
        assert direction.dA.norm() <= state.mA.norm() / math.sqrt(lam) * (1 + 1e-9)
        assert direction.dB.norm() <= state.mB.norm() / math.sqrt(lam) * (1 + 1e-9)


def test_condition_number_clamp():
    m, n, r = 12, 9, 3
    A, B = random_point(m, n, r, 1)
    upd = Tangent(torch.zeros(m, r, dtype=torch.float64), torch.zeros(n, r, dtype=torch.float64))
    upd.dA[:, 0] = 1e3  # a rank-one second moment: condition number would be huge
    config = AdaptiveConfig(relift_direction=False, cond_max=10.0)
    direction, state = adaptive_direction(
        Point(A, B), upd, init_state(A, B), noise_std=0.0, config=config
    )
    # with the clamp the preconditioner gain is at most sqrt(cond_max / lambda_max)
    lam_max = torch.linalg.eigvalsh(state.VA / (1 - config.beta2)).max()
    gain = direction.dA.norm() / (state.mA / (1 - config.beta1)).norm()
    assert gain.item() <= math.sqrt(10.0 / lam_max.item()) * (1 + 1e-6)


def test_inputs_are_not_mutated_and_state_advances():
    m, n, r = 10, 8, 2
    A, B = random_point(m, n, r, 2)
    state = init_state(A, B)
    upd = _updates(m, n, r, 1, 3)[0]
    before = [t.clone() for t in (A, B, upd.dA, upd.dB, state.mA, state.VA)]
    _, new_state = adaptive_direction(
        Point(A, B), upd, state, noise_std=0.1, config=AdaptiveConfig()
    )
    for t, ref in zip((A, B, upd.dA, upd.dB, state.mA, state.VA), before, strict=True):
        assert torch.equal(t, ref)
    assert new_state.step == 1 and state.step == 0


def test_invalid_config_is_rejected():
    with pytest.raises(ValueError, match="beta1"):
        AdaptiveConfig(beta1=1.0)
    with pytest.raises(ValueError, match="cond_max"):
        AdaptiveConfig(cond_max=0.5)


def test_realign_state_follows_an_orthogonal_gauge_change():
    from prism_core.adaptive import realign_state

    m, n, r = 12, 9, 3
    A, B = random_point(m, n, r, 5)
    R, _ = torch.linalg.qr(
        torch.randn(r, r, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    )
    state = init_state(A, B)
    for upd in _updates(m, n, r, 3, 6):
        _, state = adaptive_direction(
            Point(A, B), upd, state, noise_std=0.1, config=AdaptiveConfig()
        )
    moved = realign_state(state, Point(A, B), Point(A @ R, B @ R))
    torch.testing.assert_close(moved.mA, state.mA @ R, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(moved.VB, R.T @ state.VB @ R, rtol=1e-9, atol=1e-12)


def test_the_update_is_used_as_released_with_no_option_to_re_lift_it():
    """The gradient re-lift option is gone (privatize releases the min-norm lift already):
    the first moment after one step is exactly (1 - beta1) times the update given."""
    m, n, r = 11, 8, 3
    A, B = random_point(m, n, r, 4)
    upd = _updates(m, n, r, 1, 9)[0]
    config = AdaptiveConfig()
    _, state = adaptive_direction(Point(A, B), upd, init_state(A, B), noise_std=0.1, config=config)
    torch.testing.assert_close(state.mA, (1 - config.beta1) * upd.dA, rtol=1e-12, atol=0)
    torch.testing.assert_close(state.mB, (1 - config.beta1) * upd.dB, rtol=1e-12, atol=0)
    with pytest.raises(TypeError, match="relift_gradient"):
        AdaptiveConfig(relift_gradient=False)  # type: ignore[call-arg]


def test_batched_directions_equal_each_modules_own_with_its_own_condition_clamp():
    """``adaptive_directions`` over shape groups gives every module the direction and state
    ``adaptive_direction`` gives it alone, over several steps. The modules' updates differ in
    scale by 1e6, so a condition clamp taken over the whole stack instead of per matrix would
    floor the small modules' eigenvalues by the large one's and change their directions."""
    shapes = [(14, 10), (14, 10), (9, 12), (14, 10), (9, 12)]
    r, config = 3, AdaptiveConfig(min_floor=1e-30, floor_scale=0.0, cond_max=1e3)
    points = [Point(*random_point(m, n, r, seed)) for seed, (m, n) in enumerate(shapes)]
    scales = [1e-3, 1e3, 1.0, 1e-3, 1e3]
    groups = [[0, 1, 3], [2, 4]]
    alone = [init_state(p.A, p.B) for p in points]
    batched = list(alone)
    for step in range(3):
        updates = [
            _updates(m, n, r, 1, 100 * step + i, scale=scales[i])[0]
            for i, (m, n) in enumerate(shapes)
        ]
        expected = []
        for i, point in enumerate(points):
            direction, alone[i] = adaptive_direction(
                point, updates[i], alone[i], noise_std=0.0, config=config
            )
            expected.append(direction)
        got, batched = adaptive_directions(
            points, updates, batched, groups=groups, noise_std=0.0, config=config
        )
        for i in range(len(points)):
            for a, b in [
                (got[i].dA, expected[i].dA),
                (got[i].dB, expected[i].dB),
                (batched[i].mA, alone[i].mA),
                (batched[i].VB, alone[i].VB),
            ]:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12 * float(b.abs().max()))
            assert batched[i].step == alone[i].step == step + 1


def test_batched_directions_refuse_groups_that_miss_a_module_or_mix_steps():
    points = [Point(*random_point(8, 6, 2, seed)) for seed in range(3)]
    states = [init_state(p.A, p.B) for p in points]
    updates = [_updates(8, 6, 2, 1, seed)[0] for seed in range(3)]
    kwargs = {"noise_std": 0.1, "config": AdaptiveConfig()}
    with pytest.raises(ValueError, match="do not name each of the 3 modules once"):
        adaptive_directions(points, updates, states, groups=[[0, 1]], **kwargs)
    _, later = adaptive_direction(points[2], updates[2], states[2], **kwargs)
    with pytest.raises(ValueError, match=r"modules \[0, 1, 2\] are at different steps \[0, 1\]"):
        adaptive_directions(points, updates, [*states[:2], later], groups=[[0, 1, 2]], **kwargs)
