"""Factor-space DP-LoRA, FFA and non-DP baselines."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.points import random_point

from prism_core.baselines import (
    factor_clip_and_sum,
    factor_dp_gradient,
    factor_norms_sq,
)
from prism_core.manifold import tangent_to_dense


def _per_example(seed, b=12, m=10, n=7, r=3, scale=5.0):
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(b, m, r, generator=g), scale * torch.randn(b, n, r, generator=g)]


def test_factor_clipping_bounds_concatenated_norm():
    grads = _per_example(0)
    sums, alpha = factor_clip_and_sum(grads, max_norm=1.5)
    clipped_norms = (alpha.square() * factor_norms_sq(grads).sum(0)).sqrt()
    assert (clipped_norms <= 1.5 * (1 + 1e-5)).all()
    expected = [torch.einsum("b,b...->...", alpha, g) for g in grads]
    for s, e in zip(sums, expected, strict=True):
        torch.testing.assert_close(s, e)


def test_factor_noise_is_iid_with_sigma_C_over_b():
    grads = [torch.zeros(4, 200, 8), torch.zeros(4, 150, 8)]
    out, rec = factor_dp_gradient(
        grads,
        noise_multiplier=2.0,
        max_norm=0.5,
        expected_batch_size=10.0,
        sample_rate=0.1,
        generator=torch.Generator().manual_seed(0),
    )
    noise = torch.cat([o.flatten() for o in out])
    std = 2.0 * 0.5 / 10.0
    assert abs(noise.std().item() / std - 1) < 5 * math.sqrt(1 / (2 * noise.numel()))
    assert rec.mechanism == "factor-gaussian" and rec.expected_batch_size == 10.0


def test_factor_noise_intrinsic_energy_depends_on_gauge():
    """Prop. 2.2: the induced noise on Z scales with the factor norms (unlike PRISM)."""
    A, B = random_point(30, 20, 4, 0, dtype=torch.float32)
    energies = []
    for c in (1.0, 4.0):
        Ac, Bc = c * A, B / c
        e = 0.0
        g = torch.Generator().manual_seed(1)
        for _ in range(200):
            (nA, nB), _ = factor_dp_gradient(
                [torch.zeros(1, 30, 4), torch.zeros(1, 20, 4)],
                noise_multiplier=1.0,
                max_norm=1.0,
                expected_batch_size=1.0,
                sample_rate=0.5,
                generator=g,
            )
            e += tangent_to_dense(Ac, Bc, nA, nB).square().sum().item() / 200
        energies.append(e)
    assert energies[0] / energies[1] > 5.0 or energies[1] / energies[0] > 5.0


def test_ffa_uses_only_trainable_factor():
    grads = _per_example(1)
    out, rec = factor_dp_gradient(
        grads[:1],
        noise_multiplier=0.0,
        max_norm=100.0,
        expected_batch_size=12.0,
        sample_rate=0.1,
        generator=torch.Generator(),
        mechanism="ffa-gaussian",
    )
    assert len(out) == 1 and rec.mechanism == "ffa-gaussian"
    torch.testing.assert_close(out[0], grads[0].sum(0) / 12.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_factor_split_clip_bounds_each_part_and_the_whole_by_C(seed):
    """Add/remove one example (float64): factors move <= sqrt(C^2 - C_h^2), head <= C_h."""
    g = torch.Generator().manual_seed(seed)
    grads = [100.0 * torch.randn(5, 10, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    head = [100.0 * torch.randn(5, 2, 7, generator=g, dtype=torch.float64)]
    C, C_head = 0.5, 0.3
    full, alpha = factor_clip_and_sum(grads, max_norm=C, euclidean=head, euclidean_max_norm=C_head)
    rest, _ = factor_clip_and_sum(
        [x[1:] for x in grads], max_norm=C, euclidean=[head[0][1:]], euclidean_max_norm=C_head
    )
    moved = [(f - r).square().sum().item() for f, r in zip(full, rest, strict=True)]
    factor_part, head_part = math.sqrt(sum(moved[:2])), math.sqrt(moved[2])
    assert factor_part == pytest.approx(0.4, rel=1e-9) and head_part == pytest.approx(0.3, rel=1e-9)
    assert math.hypot(factor_part, head_part) <= C * (1 + 1e-9)
    assert alpha.shape == (5,) and (alpha < 1).all()
    joint, _ = factor_clip_and_sum(grads, max_norm=C, euclidean=head)
    together, _ = factor_clip_and_sum([*grads, *head], max_norm=C)
    for a, b in zip(joint, together, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


@pytest.mark.parametrize("value", [math.inf, math.nan, 3e38])
@pytest.mark.parametrize("split", [None, 0.3])
def test_a_non_finite_example_contributes_zero_to_the_factor_sum(value, split):
    """Factor-space clip: an example with an infinite, NaN or overflowing entry (in a factor or
    the head) counts as zero; the sums are those of the other examples, finite."""
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(4, 6, 2, generator=g), torch.randn(4, 5, 2, generator=g)]
    head = [torch.randn(4, 3, generator=g)]
    for spoiled_head in (False, True):
        bad_grads, bad_head = [t.clone() for t in grads], [t.clone() for t in head]
        target = bad_head[0] if spoiled_head else bad_grads[1]
        if value == 3e38:
            target[0] = value
        else:
            target[0].view(-1)[0] = value
        kw = {"max_norm": 1.0, "euclidean_max_norm": split}
        got, alpha = factor_clip_and_sum(bad_grads, euclidean=bad_head, **kw)
        rest, _ = factor_clip_and_sum([t[1:] for t in grads], euclidean=[head[0][1:]], **kw)
        assert alpha[0] == 0
        for s, e in zip(got, rest, strict=True):
            assert torch.isfinite(s).all()
            torch.testing.assert_close(s, e, rtol=1e-6, atol=1e-7)


def test_the_factor_clip_ignores_a_callers_bfloat16_autocast():
    """The factor-space clip and noise compute in their own dtypes under a caller's autocast."""
    g = torch.Generator().manual_seed(8)
    grads = [torch.randn(5, 6, 2, generator=g), torch.randn(5, 4, 2, generator=g)]
    plain, _ = factor_clip_and_sum(grads, max_norm=0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast, _ = factor_clip_and_sum(grads, max_norm=0.5)
    for a, b in zip(plain, cast, strict=True):
        assert torch.equal(a, b)
