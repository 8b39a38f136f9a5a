"""The DP boundary: global clipping, tangent noise, expected-batch normalisation."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers.points import SEEDS, ill_conditioned, random_point
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_core import mechanism
from prism_core.baselines import factor_norms_sq
from prism_core.errors import PrivacyParameterError
from prism_core.manifold import (
    GRAM_COND_MAX,
    TRANSPOSE_MAX_RANK,
    Point,
    Tangent,
    lift,
    min_norm_lift,
    point_frame,
    project_dense,
    retract,
    tangent_norm_sq,
    tangent_to_dense,
)
from prism_core.mechanism import (
    CLIP_MARGIN_ULPS,
    ClippedSum,
    clip_and_sum,
    clip_and_sum_grads,
    clip_and_sum_whitened,
    clip_coefficients,
    dp_tangent_update,
    empty_sum,
    per_example_norms_sq,
    privatize,
    retract_modules,
    split_max_norm,
    step_frames,
    tangent_noise,
    whiten_rows,
)
from prism_core.records import PrivacyEvent
from prism_core.rng import SecureRNG

# z-score bound for the statistical tests below: two-sided p ~ 6e-7 per check under the null.
Z = 5.0


def _module_points(seed, dims=((10, 8, 2), (14, 6, 3))):
    return [Point(*random_point(m, n, r, seed + i)) for i, (m, n, r) in enumerate(dims)]


def _random_lifts(points, b, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    lifts = []
    for A, B in points:
        G = scale * torch.randn(b, A.shape[0], B.shape[0], generator=g, dtype=torch.float64)
        lifts.append(lift(A, B, G @ B, G.mT @ A))
    return lifts


def _aim(dtype: torch.dtype) -> float:
    """The fraction of C the clip aims at in ``dtype`` (its safety factor)."""
    return 1.0 - CLIP_MARGIN_ULPS * torch.finfo(dtype).eps


def _as_float32_clip(max_norm: float) -> float:
    """The float64 clip that aims where a float32 clip at ``max_norm`` aims."""
    return max_norm * _aim(torch.float32) / _aim(torch.float64)


def test_clip_coefficients_formula():
    norms_sq = [torch.tensor([9.0, 0.25, 0.0]), torch.tensor([16.0, 0.0, 0.0])]  # s = 5, 0.5, 0
    alpha = clip_coefficients(norms_sq, 2.0)
    expected = torch.tensor([0.4 * _aim(torch.float32), 1.0, 1.0])
    torch.testing.assert_close(alpha, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(clip_coefficients(torch.stack(norms_sq), 2.0), alpha)
    with pytest.raises(PrivacyParameterError, match="max_norm"):
        clip_coefficients(norms_sq, 0.0)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 6),
    log_scale=st.floats(-2.0, 4.0),
    max_norm=st.floats(0.05, 5.0),
)
def test_each_example_contributes_at_most_C_over_all_modules(seed, b, log_scale, max_norm):
    """Sensitivity: alpha_i * lift_i has total tangent norm <= C across all modules."""
    points = _module_points(seed % 97)
    lifts = _random_lifts(points, b, seed, scale=10.0**log_scale)
    alpha = clip_coefficients(per_example_norms_sq(points, lifts), max_norm)
    total = sum(
        tangent_norm_sq(p.A, p.B, alpha[:, None, None] * t.dA, alpha[:, None, None] * t.dB)
        for p, t in zip(points, lifts, strict=True)
    )
    assert (total.sqrt() <= max_norm * (1 + 1e-9)).all()
    # adding one example to a batch moves the clipped sum by at most C
    full = clip_and_sum(points, lifts, max_norm=max_norm)
    rest = clip_and_sum(points, [Tangent(t.dA[1:], t.dB[1:]) for t in lifts], max_norm=max_norm)
    diff_sq = sum(
        tangent_norm_sq(p.A, p.B, f.dA - r.dA, f.dB - r.dB)
        for p, f, r in zip(points, full.sums, rest.sums, strict=True)
    )
    assert diff_sq.sqrt().item() <= max_norm * (1 + 1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_coefficients_are_gauge_invariant_but_factor_clipping_is_not(seed):
    points = _module_points(seed)
    b = 8
    g = torch.Generator().manual_seed(seed)
    Gs = [
        torch.randn(b, p.A.shape[0], p.B.shape[0], generator=g, dtype=torch.float64) for p in points
    ]
    Rs = [ill_conditioned(p.A.shape[1], seed + i, 1e2) for i, p in enumerate(points)]
    gauged = [Point(p.A @ R, p.B @ torch.linalg.inv(R).T) for p, R in zip(points, Rs, strict=True)]

    def coefficients(pts):
        lifts = [lift(p.A, p.B, G @ p.B, G.mT @ p.A) for p, G in zip(pts, Gs, strict=True)]
        return clip_coefficients(per_example_norms_sq(pts, lifts), 1.0)

    def factor_coefficients(pts):
        grads = [t for p, G in zip(pts, Gs, strict=True) for t in (G @ p.B, G.mT @ p.A)]
        return clip_coefficients(factor_norms_sq(grads), 1.0)

    a1, a2 = coefficients(points), coefficients(gauged)
    assert ((a1 - a2).abs() / a1).max().item() < 1e-6
    f1, f2 = factor_coefficients(points), factor_coefficients(gauged)
    assert ((f1 - f2).abs() / f1).max().item() > 0.1  # factor-space clipping moves with the gauge


@pytest.mark.parametrize("seed", SEEDS)
def test_noise_energy_matches_r_times_m_plus_n_minus_r(seed):
    """Mean ||xi||^2 over K draws: chi-square with K d degrees of freedom, d = r(m+n-r)."""
    m, n, r, K = 30, 20, 4, 3000
    A, B = random_point(m, n, r, seed)
    A, B = A @ ill_conditioned(r, seed, 1e2), B  # an unbalanced gauge must not matter
    g = torch.Generator().manual_seed(seed)
    energy = torch.stack([tangent_norm_sq(A, B, *tangent_noise(A, B, g)) for _ in range(K)])
    d = r * (m + n - r)
    band = Z * math.sqrt(2 * d / K)  # std of the mean of K chi2_d / 1
    assert abs(energy.mean().item() - d) < band


@pytest.mark.parametrize("generator", ["torch", "secure"])
def test_noise_is_tangent_and_isotropic(generator):
    m, n, r, K = 16, 12, 3, 4000
    A, B = random_point(m, n, r, 3)
    A = A @ ill_conditioned(r, 3, 1e3)
    src = torch.Generator().manual_seed(0) if generator == "torch" else SecureRNG()
    samples = torch.stack([tangent_to_dense(A, B, *tangent_noise(A, B, src)) for _ in range(K)])
    # normal component is zero
    normal = samples - project_dense(A, B, samples)
    assert normal.norm().item() < 1e-9 * samples.norm().item()
    # covariance on k orthonormal tangent directions is the identity
    k = 6
    g = torch.Generator().manual_seed(42)
    dirs = project_dense(A, B, torch.randn(k, m, n, generator=g, dtype=torch.float64)).reshape(
        k, -1
    )
    Q, _ = torch.linalg.qr(dirs.T)  # (mn, k) orthonormal tangent directions
    coords = samples.reshape(K, -1) @ Q
    cov = coords.T @ coords / K
    diag_tol, off_tol = Z * math.sqrt(2 / K), Z / math.sqrt(K)
    assert (cov.diagonal() - 1).abs().max().item() < diag_tol
    assert (cov - torch.diag(cov.diagonal())).abs().max().item() < off_tol
    assert coords.mean(0).abs().max().item() < Z / math.sqrt(K)


def test_secure_rng_differs_between_calls_and_is_standard_normal():
    rng = SecureRNG()
    x = rng.normal((200_000,), torch.float64, torch.device("cpu"))
    y = rng.normal((200_000,), torch.float64, torch.device("cpu"))
    assert not torch.equal(x, y)
    assert abs(x.mean().item()) < Z / math.sqrt(x.numel())
    assert abs(x.var().item() - 1) < Z * math.sqrt(2 / x.numel())


_STEP = {"noise_multiplier": 1.3, "max_norm": 0.7, "expected_batch_size": 32.0, "sample_rate": 0.01}


def _privatize(points, clipped, seed, b=32.0):
    return privatize(
        points,
        clipped,
        generator=torch.Generator().manual_seed(seed),
        **{**_STEP, "expected_batch_size": b},
    )


def test_noise_scale_uses_expected_not_realised_batch_size():
    """Same randomness, different realised batch sizes: identical noise, divided by b."""
    points = _module_points(0)
    small = clip_and_sum(points, _random_lifts(points, 3, 1), max_norm=0.7)
    large = clip_and_sum(points, _random_lifts(points, 60, 2), max_norm=0.7)
    out_small, _, rec = _privatize(points, small, seed=9)
    out_large, _, _ = _privatize(points, large, seed=9)
    # the release is the min-norm lift (linear) of (sum + noise) / b: subtract that of sum / b
    for p, s_small, s_large, o_small, o_large in zip(
        points, small.sums, large.sums, out_small, out_large, strict=True
    ):
        noise_small = o_small.dA - min_norm_lift(p.A, p.B, *s_small).dA / 32.0
        noise_large = o_large.dA - min_norm_lift(p.A, p.B, *s_large).dA / 32.0
        torch.testing.assert_close(noise_small, noise_large, rtol=1e-10, atol=1e-12)
    assert (rec.expected_batch_size, rec.noise_multiplier, rec.max_norm) == (32.0, 1.3, 0.7)
    # and an empty Poisson draw gets exactly the same noise
    out_empty, _, _ = _privatize(points, empty_sum(points), seed=9)
    p0 = points[0]
    signal = min_norm_lift(p0.A, p0.B, *small.sums[0]).dA / 32.0
    torch.testing.assert_close(out_empty[0].dA, out_small[0].dA - signal, rtol=1e-10, atol=1e-12)


def test_micro_batch_accumulation_equals_one_batch():
    points = _module_points(1)
    lifts = _random_lifts(points, 10, 5, scale=3.0)
    whole = clip_and_sum(points, lifts, max_norm=0.5)
    acc = None
    for lo, hi in [(0, 3), (3, 7), (7, 10)]:
        part = [Tangent(t.dA[lo:hi], t.dB[lo:hi]) for t in lifts]
        acc = clip_and_sum(points, part, max_norm=0.5, previous=acc)
    assert acc.count == whole.count == 10 and acc.clipped == whole.clipped
    for a, w in zip(acc.sums, whole.sums, strict=True):
        torch.testing.assert_close(a.dA, w.dA, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.dB, w.dB, rtol=1e-12, atol=1e-12)
    one_shot, _, _ = dp_tangent_update(
        points,
        lifts,
        noise_multiplier=1.0,
        max_norm=0.5,
        expected_batch_size=8.0,
        sample_rate=0.1,
        generator=torch.Generator().manual_seed(3),
    )
    accumulated, _, _ = privatize(
        points,
        acc,
        noise_multiplier=1.0,
        max_norm=0.5,
        expected_batch_size=8.0,
        sample_rate=0.1,
        generator=torch.Generator().manual_seed(3),
    )
    torch.testing.assert_close(one_shot[1].dB, accumulated[1].dB, rtol=1e-12, atol=1e-12)


def test_dp_update_noise_energy_is_sigma_C_over_b_squared():
    """Intrinsic noise energy per module is (sigma C / b)^2 r (m + n - r) (Thm 3.1)."""
    points = _module_points(2)
    sigma, C, b, K = 2.0, 0.3, 16.0, 1500
    zero = empty_sum(points)
    g = torch.Generator().manual_seed(0)
    energies = torch.zeros(len(points), dtype=torch.float64)
    for _ in range(K):
        out, _, _ = privatize(
            points,
            zero,
            noise_multiplier=sigma,
            max_norm=C,
            expected_batch_size=b,
            sample_rate=0.5,
            generator=g,
        )
        energies += torch.stack(
            [tangent_norm_sq(p.A, p.B, *t) for p, t in zip(points, out, strict=True)]
        )
    for (A, B), e in zip(points, energies / K, strict=True):
        m, r = A.shape
        d = r * (m + B.shape[0] - r)
        expected = (sigma * C / b) ** 2 * d
        assert abs(e.item() / expected - 1) < Z * math.sqrt(2 / (d * K))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"max_norm": 0.0}, "max_norm"),
        ({"expected_batch_size": 0.0}, "expected_batch_size"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"noise_multiplier": float("nan")}, "noise_multiplier"),
    ],
)
def test_privatize_rejects_invalid_parameters(kwargs, match):
    points = _module_points(0)
    params = dict(noise_multiplier=1.0, max_norm=1.0, expected_batch_size=4.0, sample_rate=0.1)
    params.update(kwargs)
    with pytest.raises(PrivacyParameterError, match=match):
        privatize(points, empty_sum(points), generator=torch.Generator(), **params)


def test_euclidean_tensors_share_the_global_clip_and_noise():
    """A head's per-example grads join s_i; its noise is iid sigma C / b, like the tangents."""
    points = _module_points(4)
    b = 5
    lifts = _random_lifts(points, b, 8, scale=50.0)
    head = 50.0 * torch.randn(
        b, 3, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    C = 0.4
    clipped = clip_and_sum(points, lifts, max_norm=C, euclidean=[head])
    norms = torch.cat([per_example_norms_sq(points, lifts), head.flatten(1).square().sum(1)[None]])
    alpha = clip_coefficients(norms, C)
    per_example = (alpha.square() * norms.sum(0)).sqrt()
    assert (per_example <= C * (1 + 1e-9)).all()
    torch.testing.assert_close(clipped.euclidean[0], torch.einsum("b,bij->ij", alpha, head))
    zero = empty_sum(points, [torch.zeros(40, 50, dtype=torch.float64)])
    step = privatize(
        points,
        zero,
        noise_multiplier=2.0,
        max_norm=C,
        expected_batch_size=8.0,
        sample_rate=0.1,
        generator=torch.Generator().manual_seed(0),
    )
    noise = step.euclidean[0]
    assert abs(noise.std().item() / (2.0 * C / 8.0) - 1) < Z * math.sqrt(1 / (2 * noise.numel()))


# --------------------------------------------------------------------------- fused path


DIMS_WITH_REPEATS = ((10, 8, 2), (14, 6, 3), (10, 8, 2), (10, 8, 2))  # two shape groups


def _random_grads(points, b, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    grads = []
    for A, B in points:
        G = scale * torch.randn(b, A.shape[0], B.shape[0], generator=g, dtype=torch.float64)
        grads.append((G @ B, G.mT @ A))
    return grads


def _assert_same_sum(got, expected, rtol=1e-10):
    assert (got.count, got.clipped) == (expected.count, expected.clipped)
    for a, e in zip(got.sums, expected.sums, strict=True):
        torch.testing.assert_close(a.dA, e.dA, rtol=rtol, atol=rtol * e.dA.abs().max().item())
        torch.testing.assert_close(a.dB, e.dB, rtol=rtol, atol=rtol * e.dB.abs().max().item())
    for a, e in zip(got.euclidean, expected.euclidean, strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * e.abs().max().item())


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_and_sum_grads_equals_clip_and_sum_of_lifts(seed):
    """Fused path == lift every example, clip by eq. (15) norms, sum (float64, rel 1e-10),
    over micro-batches, with a Euclidean head, on modules of two shape groups, for a batch in
    which some examples are clipped and some are not."""
    points = _module_points(seed, DIMS_WITH_REPEATS)
    b = 9
    scales = torch.logspace(-2.5, 1.0, b, dtype=torch.float64)[:, None, None]
    grads = [(scales * gA, scales * gB) for gA, gB in _random_grads(points, b, seed + 1)]
    head = scales * torch.randn(
        b, 3, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    frames = step_frames(points)
    got = expected = None
    for lo, hi in [(0, 4), (4, 9)]:
        part = [(gA[lo:hi], gB[lo:hi]) for gA, gB in grads]
        lifts = [lift(p.A, p.B, gA, gB) for p, (gA, gB) in zip(points, part, strict=True)]
        kwargs = {"max_norm": 0.8, "euclidean": [head[lo:hi]]}
        got = clip_and_sum_grads(points, part, previous=got, frames=frames, **kwargs)
        expected = clip_and_sum(points, lifts, previous=expected, **kwargs)
    _assert_same_sum(got, expected)
    assert 0 < got.clipped < got.count == b
    # without precomputed frames, in one micro-batch: the same result
    whole = [lift(p.A, p.B, *gr) for p, gr in zip(points, grads, strict=True)]
    _assert_same_sum(
        clip_and_sum_grads(points, grads, max_norm=0.8, euclidean=[head]),
        clip_and_sum(points, whole, max_norm=0.8, euclidean=[head]),
    )


def _fused_sum(points, grads, max_norm, whitened):
    """The fused clipped sum from raw gradients, or from their whitened rows."""
    if not whitened:
        return clip_and_sum_grads(points, grads, max_norm=max_norm)
    frames = step_frames(points)
    rows = whiten_rows(frames, grads)
    return clip_and_sum_whitened(points, rows, frames=frames, max_norm=max_norm)


@pytest.mark.parametrize("whitened", [False, True])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 6), log_scale=st.floats(-2.0, 4.0))
def test_clip_and_sum_grads_sensitivity_is_C(whitened, seed, b, log_scale):
    """Removing one example moves the fused clipped sum by at most C (intrinsic norm), from raw
    gradients and from whitened rows."""
    points = _module_points(seed % 97, DIMS_WITH_REPEATS)
    grads = _random_grads(points, b, seed, scale=10.0**log_scale)
    C = 0.6
    full = _fused_sum(points, grads, C, whitened)
    rest = _fused_sum(points, [(gA[1:], gB[1:]) for gA, gB in grads], C, whitened)
    diff_sq = sum(
        tangent_norm_sq(p.A, p.B, f.dA - r.dA, f.dB - r.dB)
        for p, f, r in zip(points, full.sums, rest.sums, strict=True)
    )
    assert diff_sq.sqrt().item() <= C * (1 + 1e-9)


def test_clip_and_sum_grads_accepts_opacus_layout_in_float32():
    """gB as a transposed view (Opacus' lora_A layout) and float32 give the float64 result."""
    points = _module_points(3, DIMS_WITH_REPEATS)
    grads = _random_grads(points, 7, 4, scale=3.0)
    exact = clip_and_sum_grads(points, grads, max_norm=_as_float32_clip(1.0))
    points32 = [Point(p.A.float(), p.B.float()) for p in points]
    grads32 = [(gA.float(), gB.float().mT.contiguous().mT) for gA, gB in grads]
    assert not grads32[0][1].is_contiguous()
    low = clip_and_sum_grads(points32, grads32, max_norm=1.0)
    assert low.sums[0].dA.dtype == torch.float32
    for a, e in zip(low.sums, exact.sums, strict=True):
        assert ((a.dA.double() - e.dA).norm() / e.dA.norm()).item() < 1e-5
        assert ((a.dB.double() - e.dB).norm() / e.dB.norm()).item() < 1e-5


@pytest.mark.parametrize("stack_bytes", [1, 2_000, None])
def test_clip_and_sum_grads_in_chunks_equals_the_lifts_of_every_example(monkeypatch, stack_bytes):
    """Modules of one shape are stacked in chunks of at most ``STACK_BYTES_MAX`` bytes: one
    module per chunk (1 byte), two per chunk (2,000) or the whole group (default) give the
    explicit lifts' clipped sum (float64, rel 1e-10), with r above ``TRANSPOSE_MAX_RANK`` in
    row-major and Opacus' layouts and an ill-conditioned module inside a group."""
    if stack_bytes is not None:
        monkeypatch.setattr(mechanism, "STACK_BYTES_MAX", stack_bytes)
    r = TRANSPOSE_MAX_RANK + 2
    dims = ((16, 12, r), (16, 12, r), (16, 12, r), (10, 8, 2), (16, 12, r))
    points = _module_points(5, dims)
    A, B = points[1]
    points[1] = Point(torch.linalg.qr(A)[0] @ ill_conditioned(r, 1, 1e3), B)
    assert point_frame(*points[1]).cond_A.item() > GRAM_COND_MAX
    scales = torch.logspace(-3.0, 1.0, 6, dtype=torch.float64)[:, None, None]
    grads = [(scales * gA, scales * gB) for gA, gB in _random_grads(points, 6, 8)]
    grads[0] = (grads[0][0].mT.contiguous().mT, grads[0][1])  # (b, r, m) in memory
    lifts = [lift(p.A, p.B, *gr) for p, gr in zip(points, grads, strict=True)]
    got = clip_and_sum_grads(points, grads, max_norm=0.5)
    _assert_same_sum(got, clip_and_sum(points, lifts, max_norm=0.5))
    assert 0 < got.clipped < got.count


def test_chunks_stay_within_the_stack_budget_and_cover_every_module_once(monkeypatch):
    """``_chunks`` cuts each shape group into consecutive chunks whose stacked gradients (both
    factors, float32 or wider) fit ``STACK_BYTES_MAX``: 2 modules' worth gives chunks of 2, less
    than one module's gives one module per chunk, and each chunk's frame and point are its own
    modules' slices."""
    dims = ((10, 8, 2),) * 5 + ((14, 6, 3),)
    points = _module_points(2, dims)
    frames = step_frames(points)
    cases = []
    for dtype, size in ((torch.float64, 8), (torch.float32, 4), (torch.bfloat16, 4)):
        one = (3 * 10 * 2 + 3 * 8 * 2) * size  # bytes of one module's stacked gradients
        cases += [
            (dtype, 2 * one, [(0, 1), (2, 3), (4,), (5,)]),
            (dtype, 2 * one - 1, [(0,), (1,), (2,), (3,), (4,), (5,)]),
            (dtype, one - 1, [(0,), (1,), (2,), (3,), (4,), (5,)]),
            (dtype, 10**9, [(0, 1, 2, 3, 4), (5,)]),
        ]
    for dtype, budget, want in cases:  # bf16 gradients are cast to float32 for the moments
        grads = [(gA.to(dtype), gB.to(dtype)) for gA, gB in _random_grads(points, 3, 1)]
        monkeypatch.setattr(mechanism, "STACK_BYTES_MAX", budget)
        chunks = list(mechanism._chunks(frames, grads))
        assert [c.indices for c in chunks] == want, (dtype, budget)
        for c in chunks:
            torch.testing.assert_close(c.point.A, torch.stack([points[i].A for i in c.indices]))
            torch.testing.assert_close(
                c.frame.QA, torch.stack([frames.frames[i].QA for i in c.indices])
            )


@pytest.mark.parametrize(
    ("r", "layout", "transposed"),
    [
        (TRANSPOSE_MAX_RANK, "row-major", True),  # copied to the GEMMs' layout
        (TRANSPOSE_MAX_RANK + 1, "row-major", False),  # kept as given
        (TRANSPOSE_MAX_RANK + 1, "transposed", True),  # Opacus' lora_A layout kept
    ],
)
def test_stacked_gradients_take_the_layout_of_the_moment_gemms(r, layout, transposed):
    g = [torch.randn(4, 12, r) for _ in range(3)]
    if layout == "transposed":
        g = [x.mT.contiguous().mT for x in g]
    stacked = mechanism._stack_grads(g)
    torch.testing.assert_close(stacked, torch.stack([x.contiguous() for x in g]), rtol=0, atol=0)
    assert stacked.mT.is_contiguous() == transposed and stacked.is_contiguous() != transposed


def test_clip_and_sum_grads_of_float32_gradients_at_float64_factors_sums_in_float64():
    """Float64 factors with float32 per-example gradients: the moments and alpha are float64,
    the stacked float32 gradients are weighted in float64, and the result is the all-float64
    computation on the same (float32-rounded) gradients (rel 1e-10)."""
    points = _module_points(6, DIMS_WITH_REPEATS)
    grads32 = [(gA.float(), gB.float()) for gA, gB in _random_grads(points, 5, 2, scale=3.0)]
    got = clip_and_sum_grads(points, grads32, max_norm=0.5)
    assert {t.dtype for s in got.sums for t in s} == {torch.float64}
    ref = clip_and_sum_grads(points, [(a.double(), b.double()) for a, b in grads32], max_norm=0.5)
    _assert_same_sum(got, ref)


def test_clip_and_sum_grads_rejects_mismatched_gradients():
    points = _module_points(0)
    grads = _random_grads(points, 3, 0)
    with pytest.raises(ValueError, match="2 modules but 1 gradient pairs"):
        clip_and_sum_grads(points, grads[:1], max_norm=1.0)
    bad = [grads[0], (grads[1][0], grads[1][1][:, :-1])]
    with pytest.raises(ValueError, match=r"module 1: per-example gradients must be \(b, m, r\)"):
        clip_and_sum_grads(points, bad, max_norm=1.0)


def test_step_frames_group_equal_shapes_and_match_point_frame():
    points = _module_points(5, DIMS_WITH_REPEATS)
    frames = step_frames(points)
    assert sorted(frames.groups) == [(0, 2, 3), (1,)]
    for p, f in zip(points, frames.frames, strict=True):
        for got, want in zip(f, point_frame(p.A, p.B), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_noise_with_frames_equals_the_triangular_solve_reference(seed):
    """Same generator state: frame-based noise == the old solve-based sampler (rel 1e-10)."""
    points = _module_points(seed, DIMS_WITH_REPEATS)
    frames = step_frames(points)
    g1, g2 = (torch.Generator().manual_seed(seed) for _ in range(2))
    for p, f in zip(points, frames.frames, strict=True):
        got = tangent_noise(p.A, p.B, g1, frame=f)
        m, r = p.A.shape
        U = torch.randn((m, r), generator=g2, dtype=torch.float64)
        V = torch.randn((p.B.shape[0], r), generator=g2, dtype=torch.float64)
        QA, RA = torch.linalg.qr(p.A)
        RB = torch.linalg.qr(p.B)[1]
        U_perp = U - QA @ (QA.mT @ U)
        Xi_A = torch.linalg.solve_triangular(RB.mT, U_perp, upper=False, left=False)
        Xi_B = torch.linalg.solve_triangular(RA.mT, V, upper=False, left=False)
        torch.testing.assert_close(got.dA, Xi_A, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got.dB, Xi_B, rtol=1e-10, atol=1e-12)
    clipped = clip_and_sum_grads(points, _random_grads(points, 4, seed), max_norm=0.7)
    with_frames = privatize(
        points,
        clipped,
        noise_multiplier=1.3,
        max_norm=0.7,
        expected_batch_size=32.0,
        sample_rate=0.01,
        generator=torch.Generator().manual_seed(seed),
        frames=frames,
    )
    without = _privatize(points, clipped, seed)
    for a, e in zip(with_frames.tangents, without.tangents, strict=True):
        torch.testing.assert_close(a.dA, e.dA, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a.dB, e.dB, rtol=1e-12, atol=1e-14)


def test_retract_modules_equals_retract_of_each_module():
    points = _module_points(6, DIMS_WITH_REPEATS)
    frames = step_frames(points)
    g = torch.Generator().manual_seed(6)
    directions = [
        Tangent(
            torch.randn(p.A.shape, generator=g, dtype=torch.float64),
            torch.randn(p.B.shape, generator=g, dtype=torch.float64),
        )
        for p in points
    ]
    batched = retract_modules(frames, directions, -0.2)
    for p, d, got in zip(points, directions, batched, strict=True):
        want = retract(p.A, p.B, d.dA, d.dB, -0.2)
        torch.testing.assert_close(got.A, want.A, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got.B, want.B, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="4 modules but 3 directions"):
        retract_modules(frames, directions[:3], -0.2)


def test_noise_of_a_shape_group_is_independent_per_module():
    """One stacked draw per group: each module still gets energy r (m + n - r) (Thm 3.1) and
    the noise of two modules of the same shape is uncorrelated (|corr| < Z / sqrt(K))."""
    points = _module_points(7, DIMS_WITH_REPEATS)
    frames = step_frames(points)
    g = torch.Generator().manual_seed(7)
    K = 1500
    zero = empty_sum(points)
    energy = torch.zeros(len(points), dtype=torch.float64)
    cross = torch.zeros(K, dtype=torch.float64)
    for k in range(K):
        out = privatize(
            points,
            zero,
            noise_multiplier=1.0,
            max_norm=1.0,
            expected_batch_size=1.0,
            sample_rate=0.1,
            generator=g,
            frames=frames,
        ).tangents
        dense = [tangent_to_dense(p.A, p.B, *t) for p, t in zip(points, out, strict=True)]
        energy += torch.stack([d.square().sum() for d in dense])
        cross[k] = (dense[0] * dense[2]).sum()  # modules 0 and 2 share a shape group
    for (A, B), e in zip(points, energy / K, strict=True):
        d = A.shape[1] * (A.shape[0] + B.shape[0] - A.shape[1])
        assert abs(e.item() / d - 1) < Z * math.sqrt(2 / (d * K))
    (m, r), n = points[0].A.shape, points[0].B.shape[0]
    d0 = r * (m + n - r)
    corr = cross.mean().item() / d0  # E<Xi_0, Xi_2> = 0, Var <Xi_0, Xi_2> <= d0
    assert abs(corr) < Z / math.sqrt(K * d0)


# --------------------------------------------------------------------------- what is released


def _projector(X):
    Q, _ = torch.linalg.qr(X)
    return Q @ Q.mT


def _release(points, clipped, seed, sigma=1.3):
    return privatize(
        points,
        clipped,
        noise_multiplier=sigma,
        max_norm=0.7,
        expected_batch_size=16.0,
        sample_rate=0.05,
        generator=torch.Generator().manual_seed(seed),
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_every_component_of_the_release_changes_with_the_noise_draw(seed):
    """Same clipped sum, two noise draws: Pi_A dA, (I - Pi_A) dA, Pi_B dB and (I - Pi_B) dB
    all differ, by at least 5 % of the whole difference in every module. (The plain sum of
    lifts plus noise keeps Pi_A dA = 1/2 Pi_A g_A N^+ un-noised: identical in both draws.)"""
    points = _module_points(seed, DIMS_WITH_REPEATS)
    clipped = clip_and_sum_grads(points, _random_grads(points, 6, seed), max_norm=0.7)
    one, two = (_release(points, clipped, seed + k).tangents for k in (100, 200))
    for p, a, b in zip(points, one, two, strict=True):
        dA, dB = a.dA - b.dA, a.dB - b.dB
        PA, PB = _projector(p.A), _projector(p.B)
        total = math.sqrt(float(dA.square().sum() + dB.square().sum()))
        parts = {
            "Pi_A dA": PA @ dA,
            "(I - Pi_A) dA": dA - PA @ dA,
            "Pi_B dB": PB @ dB,
            "(I - Pi_B) dB": dB - PB @ dB,
        }
        for name, part in parts.items():
            assert float(part.norm()) > 0.05 * total, name


@pytest.mark.parametrize("seed", SEEDS)
def test_the_release_is_a_function_of_dZ_alone(seed):
    """Two factor representatives of the same clipped dZ (a gauge shift (A W, -B W.T)) give
    the same release for the same noise draw (rel 1e-9, float64)."""
    points = _module_points(seed, DIMS_WITH_REPEATS)
    clipped = clip_and_sum_grads(points, _random_grads(points, 5, seed), max_norm=0.7)
    g = torch.Generator().manual_seed(seed)
    shifted = []
    for p, s in zip(points, clipped.sums, strict=True):
        W = torch.randn(p.A.shape[1], p.A.shape[1], generator=g, dtype=torch.float64)
        shifted.append(Tangent(s.dA + p.A @ W, s.dB - p.B @ W.mT))
        torch.testing.assert_close(  # the same tangent vector
            tangent_to_dense(p.A, p.B, *shifted[-1]), tangent_to_dense(p.A, p.B, *s)
        )
    other = type(clipped)(tuple(shifted), clipped.count, clipped.clipped, clipped.euclidean)
    first, second = _release(points, clipped, seed), _release(points, other, seed)
    for a, b in zip(first.tangents, second.tangents, strict=True):
        scale = float(a.dA.norm() + a.dB.norm())
        torch.testing.assert_close(a.dA, b.dA, rtol=1e-9, atol=1e-9 * scale)
        torch.testing.assert_close(a.dB, b.dB, rtol=1e-9, atol=1e-9 * scale)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_release_is_the_min_norm_lift_of_the_noisy_dZ(seed):
    """Float64: the released (dA, dB) is a fixed point of min_norm_lift, satisfies the
    optimality condition A.T dA = dB.T B (eq. 39 with W = 0), and represents exactly the dZ of
    the plain lift (sum + sigma C Xi) / b with the same noise draw (eqs. 17-19)."""
    points = _module_points(seed)  # distinct shapes: one noise draw per module, in order
    clipped = clip_and_sum_grads(points, _random_grads(points, 6, seed), max_norm=0.7)
    released = _release(points, clipped, seed).tangents
    g = torch.Generator().manual_seed(seed)
    for p, s, t in zip(points, clipped.sums, released, strict=True):
        fixed = min_norm_lift(p.A, p.B, *t)
        scale = float(t.dA.abs().max() + t.dB.abs().max())
        torch.testing.assert_close(fixed.dA, t.dA, rtol=1e-10, atol=1e-12 * scale)
        torch.testing.assert_close(fixed.dB, t.dB, rtol=1e-10, atol=1e-12 * scale)
        torch.testing.assert_close(
            p.A.mT @ t.dA, t.dB.mT @ p.B, rtol=1e-10, atol=1e-12 * scale * scale
        )
        xi = tangent_noise(p.A, p.B, g)
        plain = Tangent((s.dA + 1.3 * 0.7 * xi.dA) / 16.0, (s.dB + 1.3 * 0.7 * xi.dB) / 16.0)
        dense = tangent_to_dense(p.A, p.B, *plain)
        torch.testing.assert_close(
            tangent_to_dense(p.A, p.B, *t), dense, rtol=1e-10, atol=1e-12 * float(dense.norm())
        )
        # the intrinsic norm (hence the noise energy of Thm 3.1) is unchanged by the re-lift
        assert float(tangent_norm_sq(p.A, p.B, *t)) == pytest.approx(
            float(tangent_norm_sq(p.A, p.B, *plain)), rel=1e-10
        )


# --------------------------------------------------------------------------- split clip


def _split_parts(points, full, rest):
    """(tangent part, Euclidean part) of the difference of two clipped sums (float64)."""
    tangent_sq = sum(
        tangent_norm_sq(p.A, p.B, f.dA - r.dA, f.dB - r.dB)
        for p, f, r in zip(points, full.sums, rest.sums, strict=True)
    )
    euclid_sq = sum(
        (f - r).square().sum() for f, r in zip(full.euclidean, rest.euclidean, strict=True)
    )
    return tangent_sq.sqrt().item(), float(euclid_sq) ** 0.5


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 6),
    log_scale=st.floats(-2.0, 3.0),
    share=st.floats(0.05, 0.95),
)
def test_split_clip_joint_sensitivity_is_at_most_C(seed, b, log_scale, share):
    """Add/remove one example (float64): LoRA part <= sqrt(C^2 - C_h^2), head part <= C_h, so
    the whole release moves by <= C = sqrt(C_lora^2 + C_head^2), on both clip paths."""
    points = _module_points(seed % 97, DIMS_WITH_REPEATS)
    scale = 10.0**log_scale
    grads = _random_grads(points, b, seed, scale=scale)
    g = torch.Generator().manual_seed(seed)
    head = [
        scale * torch.randn(b, 3, 5, generator=g, dtype=torch.float64),
        scale * torch.randn(b, 3, generator=g, dtype=torch.float64),
    ]
    C = 0.6
    C_head = share * C
    C_lora = math.sqrt(C**2 - C_head**2)
    kwargs = {"max_norm": C, "euclidean_max_norm": C_head}
    full = clip_and_sum_grads(points, grads, euclidean=head, **kwargs)
    rest = clip_and_sum_grads(
        points, [(gA[1:], gB[1:]) for gA, gB in grads], euclidean=[h[1:] for h in head], **kwargs
    )
    lora_part, head_part = _split_parts(points, full, rest)
    assert lora_part <= C_lora * (1 + 1e-9)
    assert head_part <= C_head * (1 + 1e-9)
    assert math.hypot(lora_part, head_part) <= C * (1 + 1e-9)
    lifts = [lift(p.A, p.B, *gr) for p, gr in zip(points, grads, strict=True)]
    _assert_same_sum(full, clip_and_sum(points, lifts, euclidean=head, **kwargs))


@pytest.mark.parametrize("seed", SEEDS)
def test_split_clip_bound_is_tight_and_each_part_is_clipped_on_its_own(seed):
    """Large gradients: the removed example contributes exactly C_lora and C_head (total C);
    a small head gradient is not scaled down by a large LoRA one (unlike the joint clip)."""
    points = _module_points(seed, DIMS_WITH_REPEATS)
    grads = _random_grads(points, 3, seed, scale=1e3)
    g = torch.Generator().manual_seed(seed)
    head = [1e3 * torch.randn(3, 4, generator=g, dtype=torch.float64)]
    C, C_head = 0.5, 0.3
    kwargs = {"max_norm": C, "euclidean_max_norm": C_head}
    full = clip_and_sum_grads(points, grads, euclidean=head, **kwargs)
    rest = clip_and_sum_grads(
        points, [(gA[1:], gB[1:]) for gA, gB in grads], euclidean=[head[0][1:]], **kwargs
    )
    lora_part, head_part = _split_parts(points, full, rest)
    assert lora_part == pytest.approx(0.4, rel=1e-9) and head_part == pytest.approx(0.3, rel=1e-9)
    assert full.clipped == full.count == 3
    tiny_head = [1e-6 * head[0]]
    split = clip_and_sum_grads(points, grads, euclidean=tiny_head, **kwargs)
    joint = clip_and_sum_grads(points, grads, euclidean=tiny_head, max_norm=C)
    torch.testing.assert_close(split.euclidean[0], tiny_head[0].sum(0), rtol=1e-12, atol=0)
    assert joint.euclidean[0].norm() < 1e-3 * split.euclidean[0].norm()


def test_split_clip_rejects_bad_shares():
    points = _module_points(0)
    grads = _random_grads(points, 2, 0)
    head = [torch.ones(2, 3, dtype=torch.float64)]
    for bad in (0.0, -0.1, 0.6, 0.7, math.nan):
        with pytest.raises(PrivacyParameterError, match="euclidean_max_norm"):
            clip_and_sum_grads(points, grads, max_norm=0.6, euclidean=head, euclidean_max_norm=bad)
    with pytest.raises(ValueError, match="no Euclidean tensors"):
        clip_and_sum_grads(points, grads, max_norm=0.6, euclidean_max_norm=0.3)
    assert split_max_norm(0.5, 0.3) == pytest.approx((0.4, 0.3), rel=1e-12)
    assert split_max_norm(0.5, None) == (0.5, 0.5)


# --------------------------------------------------------------------------- edges
# The record a step emits, the parameter ranges at their edges, the head's
# sums across micro-batches, the clipped-example count, the dtype rules and the error texts.


def test_a_step_records_exactly_its_parameters_and_one_step():
    points = _module_points(0)
    lifts = _random_lifts(points, 4, 1)
    expected = PrivacyEvent(
        mechanism="prism-tangent-gaussian", noise_multiplier=1.3, max_norm=0.7,
        expected_batch_size=32.0, sample_rate=0.01, steps=1,
    )  # fmt: skip
    rng = torch.Generator().manual_seed(0)
    assert privatize(points, empty_sum(points), generator=rng, **_STEP).record == expected
    assert dp_tangent_update(points, lifts, generator=rng, **_STEP).record == expected


def test_dp_tangent_update_clips_and_noises_the_head_like_the_two_calls():
    points = _module_points(3)
    lifts = _random_lifts(points, 5, 2, scale=10.0)
    head = [
        10.0 * torch.randn(5, 3, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ]
    one_shot = dp_tangent_update(
        points, lifts, euclidean=head, generator=torch.Generator().manual_seed(7), **_STEP
    )
    clipped = clip_and_sum(points, lifts, max_norm=0.7, euclidean=head)
    two_calls = privatize(points, clipped, generator=torch.Generator().manual_seed(7), **_STEP)
    assert len(one_shot.euclidean) == 1
    torch.testing.assert_close(one_shot.euclidean[0], two_calls.euclidean[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(
        one_shot.tangents[0].dA, two_calls.tangents[0].dA, rtol=1e-12, atol=0
    )


@pytest.mark.parametrize(
    ("name", "value", "valid"),
    [
        ("noise_multiplier", 0.0, True),  # no noise is a valid (non-private) setting
        ("noise_multiplier", 0.5, True),
        ("noise_multiplier", math.inf, False),
        ("max_norm", 1e-9, True),
        ("max_norm", 0.0, False),
        ("max_norm", -0.1, False),
        ("max_norm", math.inf, False),
        ("expected_batch_size", 1e-9, True),
        ("expected_batch_size", 0.0, False),
        ("expected_batch_size", -1.0, False),
        ("expected_batch_size", math.inf, False),
        ("sample_rate", 1.0, True),  # every example in every batch
        ("sample_rate", 1e-9, True),
        ("sample_rate", 0.0, False),
        ("sample_rate", 1.0 + 1e-9, False),
        ("sample_rate", 2.0, False),
        ("sample_rate", -0.5, False),
    ],
)
def test_privatize_accepts_exactly_its_parameter_ranges(name, value, valid):
    points = _module_points(0)
    params = {**_STEP, name: value}
    call = lambda: privatize(  # noqa: E731
        points, empty_sum(points), generator=torch.Generator().manual_seed(0), **params
    )
    if valid:
        assert call().record.steps == 1
    else:
        with pytest.raises(PrivacyParameterError, match=re.escape(f"{name}={value!r} is invalid")):
            call()


def test_split_max_norm_refuses_a_clip_that_is_not_positive_and_finite():
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(PrivacyParameterError, match=re.escape(f"max_norm={bad!r} is invalid")):
            split_max_norm(bad, None)


def test_head_sums_accumulate_over_micro_batches():
    """The head's clipped sum of a step is that of all its micro-batches, not of the last."""
    points = _module_points(1)
    lifts = _random_lifts(points, 9, 5, scale=3.0)
    head = 3.0 * torch.randn(
        9, 4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    for kwargs in ({"max_norm": 0.5}, {"max_norm": 0.5, "euclidean_max_norm": 0.2}):
        whole = clip_and_sum(points, lifts, euclidean=[head], **kwargs)
        acc = None
        for lo, hi in [(0, 2), (2, 6), (6, 9)]:
            part = [Tangent(t.dA[lo:hi], t.dB[lo:hi]) for t in lifts]
            acc = clip_and_sum(points, part, euclidean=[head[lo:hi]], previous=acc, **kwargs)
        _assert_same_sum(acc, whole, rtol=1e-12)


def test_a_previous_sum_of_other_modules_is_refused():
    points = _module_points(1)
    lifts = _random_lifts(points, 3, 5)
    other = clip_and_sum(points[:1], lifts[:1], max_norm=0.5)
    with pytest.raises(ValueError, match="zip"):
        clip_and_sum(points, lifts, max_norm=0.5, previous=other)


def test_clipped_counts_every_example_whose_coefficient_is_below_one():
    points = _module_points(2)
    lifts = _random_lifts(points, 6, 3)
    norms = per_example_norms_sq(points, lifts).sum(0).sqrt()
    C = norms.median().item()  # half of them above C
    expected = int((norms > C * _aim(torch.float64)).sum())  # the one AT C is clipped too
    assert 0 < expected < 6
    got = clip_and_sum(points, lifts, max_norm=C)
    assert (got.count, got.clipped) == (6, expected)
    # split clip: an example clipped only in its head part counts as clipped
    small = _random_lifts(points, 6, 3, scale=1e-6)  # no tangent part is clipped
    head = torch.zeros(6, 2, dtype=torch.float64)
    head[[1, 4], 0] = 5.0  # two examples whose head part exceeds C_head
    split = clip_and_sum(points, small, max_norm=1.0, euclidean=[head], euclidean_max_norm=0.5)
    assert (split.count, split.clipped) == (6, 2)


def _bf16(points):
    return [Point(p.A.to(torch.bfloat16), p.B.to(torch.bfloat16)) for p in points]


def _upcast(points):
    return [Point(p.A.float(), p.B.float()) for p in points]


def test_an_empty_sum_counts_nothing_and_works_in_float32_or_better():
    points = _module_points(0)
    zero = empty_sum(_bf16(points), [torch.zeros(3, 2, dtype=torch.bfloat16)])
    assert (zero.count, zero.clipped) == (0, 0)
    assert {t.dtype for s in zero.sums for t in s} | {zero.euclidean[0].dtype} == {torch.float32}
    lifts = _random_lifts(points, 4, 1)
    after = clip_and_sum(points, lifts, max_norm=1e-3, previous=empty_sum(points))
    assert (after.count, after.clipped) == (4, 4)


def test_low_precision_inputs_are_computed_in_float32():
    """bf16 factors and per-example gradients (a bf16 base model): every sum, coefficient and
    noise draw is computed in float32 from the same values, as if they had been given as float32."""
    low = _bf16(_module_points(4, DIMS_WITH_REPEATS))
    high = _upcast(low)
    grads = [
        (gA.to(torch.bfloat16), gB.to(torch.bfloat16))
        for gA, gB in _random_grads(_module_points(4, DIMS_WITH_REPEATS), 5, 1, 4.0)
    ]
    head = [torch.randn(5, 3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)]
    grads_hi = [(gA.float(), gB.float()) for gA, gB in grads]
    for split in (None, 0.3):
        got = clip_and_sum_grads(low, grads, max_norm=0.6, euclidean=head, euclidean_max_norm=split)
        ref = clip_and_sum_grads(
            high, grads_hi, max_norm=0.6, euclidean=[head[0].float()], euclidean_max_norm=split
        )
        assert {t.dtype for s in got.sums for t in s} | {got.euclidean[0].dtype} == {torch.float32}
        _assert_same_sum(got, ref, rtol=1e-5)
    lifts = [
        Tangent(t.dA.to(torch.bfloat16), t.dB.to(torch.bfloat16))
        for t in _random_lifts(_module_points(4, DIMS_WITH_REPEATS), 5, 3)
    ]
    got = clip_and_sum(low, lifts, max_norm=0.6, euclidean=head)
    ref = clip_and_sum(high, [Tangent(t.dA.float(), t.dB.float()) for t in lifts], max_norm=0.6,
                       euclidean=[head[0].float()])  # fmt: skip
    assert {t.dtype for s in got.sums for t in s} == {torch.float32}
    _assert_same_sum(got, ref, rtol=1e-5)
    norms = per_example_norms_sq(high, [Tangent(t.dA.float(), t.dB.float()) for t in lifts])
    alpha = clip_coefficients(norms.to(torch.bfloat16), 0.6)
    assert alpha.dtype == torch.float32
    torch.testing.assert_close(alpha, clip_coefficients(norms.to(torch.bfloat16).float(), 0.6),
                               rtol=1e-6, atol=0)  # fmt: skip
    A, B = low[1]
    noise = tangent_noise(A, B, torch.Generator().manual_seed(5))
    ref_noise = tangent_noise(A.float(), B.float(), torch.Generator().manual_seed(5))
    assert (noise.dA.dtype, noise.dB.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(noise.dA, ref_noise.dA, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(noise.dB, ref_noise.dB, rtol=1e-5, atol=1e-6)


def test_mixed_precision_inputs_are_computed_in_the_widest_dtype():
    points = _module_points(5)  # float64 factors
    lifts32 = [Tangent(t.dA.float(), t.dB.float()) for t in _random_lifts(points, 4, 1)]
    lifts64 = [Tangent(t.dA.double(), t.dB.double()) for t in lifts32]
    got = clip_and_sum(points, lifts32, max_norm=0.5)
    assert {t.dtype for s in got.sums for t in s} == {torch.float64}
    _assert_same_sum(got, clip_and_sum(points, lifts64, max_norm=0.5), rtol=1e-12)
    # a float64 head beside float32 LoRA factors: its sum stays float64
    head = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    low = _upcast(points)
    mixed = clip_and_sum(low, lifts32, max_norm=0.5, euclidean=[head])
    assert mixed.euclidean[0].dtype == torch.float64
    ref = clip_and_sum(points, lifts64, max_norm=_as_float32_clip(0.5), euclidean=[head])
    torch.testing.assert_close(mixed.euclidean[0], ref.euclidean[0], rtol=1e-5, atol=1e-6)
    A, B = points[0]
    for a, b in ((A, B.float()), (A.float(), B)):
        xi = tangent_noise(a, b, torch.Generator().manual_seed(1))
        assert (xi.dA.dtype, xi.dB.dtype) == (torch.float64, torch.float64)


def test_the_release_has_the_dtype_of_the_sum_it_noises():
    """float32 sums at float64 factors: the release (and its noise) stays float32."""
    points = _module_points(6)
    lifts = [Tangent(t.dA.float(), t.dB.float()) for t in _random_lifts(points, 4, 1)]
    clipped = clip_and_sum(_upcast(points), lifts, max_norm=0.5)
    step = privatize(points, clipped, generator=torch.Generator().manual_seed(2), **_STEP)
    assert {t.dtype for t_ in step.tangents for t in t_} == {torch.float32}


def test_head_noise_comes_from_the_given_generator_at_the_head_precision():
    """The head's noise is drawn from the site's generator (not torch's global one) and at the
    precision of its sum (float64 here), like the tangent noise."""
    points = _module_points(7)
    zero = empty_sum(points, [torch.zeros(20, 30, dtype=torch.float64)])
    releases = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        step = privatize(points, zero, generator=torch.Generator().manual_seed(3), **_STEP)
        releases.append(step.euclidean[0])
    torch.testing.assert_close(releases[0], releases[1], rtol=0, atol=0)
    assert releases[0].dtype == torch.float64
    assert (releases[0].float().double() != releases[0]).float().mean() > 0.9  # not float32 values


def test_shape_errors_name_what_was_wrong():
    points = _module_points(0)
    lifts = _random_lifts(points, 3, 1)
    with pytest.raises(ValueError, match=re.escape("2 modules but 1 lifts")):
        per_example_norms_sq(points, lifts[:1])
    with pytest.raises(ValueError, match=re.escape("norms_sq must be (L, b), got shape (3,)")):
        clip_coefficients(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match=re.escape("2 modules but the clipped sum has 1")):
        privatize(points, empty_sum(points[:1]), generator=torch.Generator(), **_STEP)
    # a wrong (m, r) of gA alone, with a right gB, is refused and named
    grads = _random_grads(points, 3, 1)
    gA, gB = grads[0]
    bad = [(torch.zeros(3, gA.shape[1] + 1, gA.shape[2], dtype=gA.dtype), gB), grads[1]]
    with pytest.raises(ValueError, match=re.escape("module 0: per-example gradients")):
        clip_and_sum_grads(points, bad, max_norm=1.0)


# -- whitened rows (what the LoRA layers write on PRISM's step) -------------------------------


@pytest.mark.parametrize("split", [None, 0.4])
def test_clip_and_sum_whitened_equals_clip_and_sum_grads(split):
    """Whitened rows give the fused clipped sum of the raw gradients (float64, rel 1e-10):
    two shape groups, one module ill-conditioned, a head in the joint or the split clip, over
    two micro-batches, some examples clipped and some not; the rows are not modified."""
    points = _module_points(5, DIMS_WITH_REPEATS)
    A, B = points[2]
    points[2] = Point(torch.linalg.qr(A)[0] @ ill_conditioned(2, 1, 1e3), B)
    b = 9
    scales = torch.logspace(-2.5, 1.0, b, dtype=torch.float64)[:, None, None]
    grads = [(scales * gA, scales * gB) for gA, gB in _random_grads(points, b, 6)]
    head = scales * torch.randn(
        b, 3, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    frames = step_frames(points)
    got = want = None
    for lo, hi in [(0, 4), (4, 9)]:
        part = [(gA[lo:hi], gB[lo:hi]) for gA, gB in grads]
        rows = whiten_rows(frames, part)
        before = [t.clone() for pair in rows for t in pair]
        kw = {"max_norm": 0.8, "euclidean": [head[lo:hi]], "euclidean_max_norm": split}
        got = clip_and_sum_whitened(points, rows, frames=frames, previous=got, **kw)
        want = clip_and_sum_grads(points, part, frames=frames, previous=want, **kw)
        assert all(
            torch.equal(t, u) for t, u in zip((t for p in rows for t in p), before, strict=True)
        )
    _assert_same_sum(got, want)
    assert 0 < got.clipped < got.count == b


def test_clip_and_sum_whitened_rejects_rows_of_the_wrong_shape():
    points = _module_points(1, DIMS_WITH_REPEATS)
    frames = step_frames(points)
    rows = whiten_rows(frames, _random_grads(points, 3, 1))
    with pytest.raises(ValueError, match="module groups"):
        clip_and_sum_whitened(points, rows[:1], frames=frames, max_norm=1.0)
    bad = [rows[0], (rows[1][0], rows[1][1][:, :2])]  # another b in the second factor
    with pytest.raises(ValueError, match=re.escape("group 1: whitened rows must be")):
        clip_and_sum_whitened(points, bad, frames=frames, max_norm=1.0)


# -- numbers from the coordinator: non-finite contributions and the clip in low precision ------

_BAD_VALUES = [math.inf, -math.inf, math.nan, 3e38]


def _spoil(t: torch.Tensor, value: float) -> torch.Tensor:
    """A copy of per-example ``t`` (b, ...) whose example 0 holds ``value`` in one entry (and
    3e38 everywhere for the huge-finite case, so its float sums overflow)."""
    out = t.clone()
    if value == 3e38:
        out[0] = value
    else:
        out[0].view(-1)[0] = value
    return out


@pytest.mark.parametrize("value", _BAD_VALUES)
@pytest.mark.parametrize("where", ["lora", "head"])
@pytest.mark.parametrize("split", [None, 0.3])
@pytest.mark.parametrize("whitened", [False, True])
def test_a_non_finite_example_contributes_zero_to_the_fused_sum(value, where, split, whitened):
    """An example whose gradient is infinite, NaN or overflows counts as zero: the clipped sum is
    that of the other examples (finite), in the tangents and the head alike; from raw gradients
    (``clip_and_sum_grads``) and from whitened rows (``clip_and_sum_whitened``)."""
    points = _module_points(11, DIMS_WITH_REPEATS)
    grads = [(gA.float(), gB.float()) for gA, gB in _random_grads(points, 5, 3, scale=2.0)]
    head = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(4))
    if where == "lora":
        grads[1] = (_spoil(grads[1][0], value), grads[1][1])
    else:
        head = _spoil(head, value)
    low = [Point(p.A.float(), p.B.float()) for p in points]
    kw = {"max_norm": 1.0, "euclidean_max_norm": split}
    frames = step_frames(low)
    if whitened:
        rows = whiten_rows(frames, grads)
        got = clip_and_sum_whitened(low, rows, frames=frames, euclidean=[head], **kw)
        rest_rows = [(a[:, 1:], c[:, 1:]) for a, c in rows]
        rest = clip_and_sum_whitened(low, rest_rows, frames=frames, euclidean=[head[1:]], **kw)
    else:
        got = clip_and_sum_grads(low, grads, euclidean=[head], **kw)
        rest_grads = [(a[1:], b[1:]) for a, b in grads]
        rest = clip_and_sum_grads(low, rest_grads, euclidean=[head[1:]], **kw)
    for s, e in zip(got.sums, rest.sums, strict=True):
        assert torch.isfinite(s.dA).all() and torch.isfinite(s.dB).all()
        torch.testing.assert_close(s.dA, e.dA, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(s.dB, e.dB, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.euclidean[0], rest.euclidean[0], rtol=1e-5, atol=1e-7)
    assert got.count - got.clipped == rest.count - rest.clipped  # not counted below C


@pytest.mark.parametrize("value", _BAD_VALUES)
def test_a_non_finite_lift_contributes_zero_to_the_sum(value):
    """The same for ``clip_and_sum`` on per-example lifts."""
    points = _module_points(12)
    lifts = _random_lifts(points, 4, 5)
    spoiled = [Tangent(_spoil(lifts[0].dA, value), lifts[0].dB), *lifts[1:]]
    got = clip_and_sum(points, spoiled, max_norm=0.5)
    rest = clip_and_sum(points, [Tangent(t.dA[1:], t.dB[1:]) for t in lifts], max_norm=0.5)
    for s, e in zip(got.sums, rest.sums, strict=True):
        torch.testing.assert_close(s.dA, e.dA, rtol=1e-12, atol=0)
        torch.testing.assert_close(s.dB, e.dB, rtol=1e-12, atol=0)


def _conditioned_factor(rows, r, cond, generator):
    Q, _ = torch.linalg.qr(torch.randn(rows, r, generator=generator, dtype=torch.float64))
    return Q @ torch.diag(torch.logspace(0, -math.log10(cond), r, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [1e-6, 1e-2, 1.0])
@pytest.mark.parametrize("scale", [1e-20, 1.0, 1e20])
@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("whitened", [False, True])
def test_one_clipped_contribution_has_norm_at_most_c_in_low_precision(
    dtype, max_norm, scale, head, whitened
):
    """One example's clipped contribution, its exact norm taken in float64 at the (rounded)
    point, is at most C: in float32 and bfloat16, for C down to the smallest a site runs
    (``prism_runtime.ranges.MAX_NORM_MIN``), gradients from 1e-20 to 1e20 and factors of
    condition number up to ``FACTOR_COND_MAX`` (the safety factor covers the rounding); from
    raw gradients and from whitened rows alike."""
    from prism_runtime.ranges import FACTOR_COND_MAX, MAX_NORM_MIN

    assert MAX_NORM_MIN == 1e-6  # the smallest case above is the lower bound
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        m, n, r = 40, 24, 4
        A, B = (_conditioned_factor(k, r, FACTOR_COND_MAX, g) for k in (m, n))
        G = scale * torch.randn(1, m, n, generator=g, dtype=torch.float64)
        point = Point(A.to(dtype), B.to(dtype))
        extra = [(scale * torch.randn(1, 5, generator=g)).to(dtype)] if head else []
        grads = [((G @ B).to(dtype), (G.mT @ A).to(dtype))]
        if whitened:
            frames = step_frames([point])
            rows = [(r.to(dtype), c.to(dtype)) for r, c in whiten_rows(frames, grads)]
            got = clip_and_sum_whitened(
                [point], rows, frames=frames, max_norm=max_norm, euclidean=extra
            )
        else:
            got = clip_and_sum_grads([point], grads, max_norm=max_norm, euclidean=extra)
        t = got.sums[0]
        norm_sq = tangent_norm_sq(point.A.double(), point.B.double(), t.dA.double(), t.dB.double())
        if head:
            norm_sq = norm_sq + got.euclidean[0].double().square().sum()
        assert norm_sq.sqrt().item() <= max_norm


@pytest.mark.parametrize("cond", [1.0, 1e3])
def test_the_release_hardly_depends_on_the_gauge_part_at_accepted_conditioning(cond):
    """The release is the min-norm lift of the noisy dZ, a function of dZ alone: adding a gauge
    direction ``(A X, -B X.T)`` (no change of dZ) to the clipped sum moves the float32 release
    by rounding only, below 1e-5 of its norm, at condition numbers up to FACTOR_COND_MAX."""
    from prism_runtime.ranges import FACTOR_COND_MAX

    assert cond <= FACTOR_COND_MAX
    kw = {"noise_multiplier": 1.0, "max_norm": 1.0, "expected_batch_size": 8.0}
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        A, B = (_conditioned_factor(k, 4, cond, g).float() for k in (64, 48))
        dA, dB = torch.randn(64, 4, generator=g), torch.randn(48, 4, generator=g)
        X = 10 * torch.randn(4, 4, generator=g)
        releases = []
        for s in (Tangent(dA, dB), Tangent(dA + A @ X, dB - B @ X.T)):
            step = privatize(
                [Point(A, B)],
                ClippedSum((s,), 1, 0),
                sample_rate=0.25,
                generator=torch.Generator().manual_seed(9),
                **kw,
            )
            releases.append(
                torch.cat([step.tangents[0].dA.flatten(), step.tangents[0].dB.flatten()])
            )
        assert (releases[0] - releases[1]).norm() <= 1e-5 * releases[0].norm()


def test_the_clip_ignores_a_callers_bfloat16_autocast():
    """A trainer runs its step under bfloat16 autocast (on CUDA): the clip and the noise still
    compute in their own dtypes, so the result is the one without autocast, bit for bit (in
    bfloat16 the norms' rounding would exceed the clip's safety factor)."""
    exact = _module_points(13, DIMS_WITH_REPEATS)
    points = [Point(p.A.float(), p.B.float()) for p in exact]
    grads = [(gA.float(), gB.float()) for gA, gB in _random_grads(exact, 6, 2, scale=3.0)]
    head = [torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(5))]
    kw = {"max_norm": 0.7, "euclidean": head, "euclidean_max_norm": 0.3}
    plain = clip_and_sum_grads(points, grads, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (points[0].A @ points[0].A.mT).dtype == torch.bfloat16  # autocast is on here
        cast = clip_and_sum_grads(points, grads, **kw)
        noisy = privatize(points, cast, generator=torch.Generator().manual_seed(3), **_STEP)
    for a, b in zip(plain.sums, cast.sums, strict=True):
        assert torch.equal(a.dA, b.dA) and torch.equal(a.dB, b.dB)
    assert torch.equal(plain.euclidean[0], cast.euclidean[0])
    reference = privatize(points, plain, generator=torch.Generator().manual_seed(3), **_STEP)
    for a, b in zip(reference.tangents, noisy.tangents, strict=True):
        assert torch.equal(a.dA, b.dA) and torch.equal(a.dB, b.dB)
