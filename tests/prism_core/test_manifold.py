"""Geometric identities of prism_core.manifold, in float64 over several seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.points import SEEDS, SHAPES, ill_conditioned, random_point

from prism_core.manifold import (
    GRAM_COND_MAX,
    TRANSPOSE_MAX_RANK,
    check_point,
    lift,
    lift_moments,
    lift_moments_stacked,
    lift_norm_sq,
    lift_norm_sq_whitened,
    lift_whitened,
    min_norm_lift,
    point_frame,
    project_dense,
    retract,
    tangent_displacement,
    tangent_norm_sq,
    tangent_to_dense,
)

RTOL = 1e-9


def _grads(A, B, G):
    return G @ B, G.mT @ A


def _rel(x, y):
    return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("m", "n", "r"), SHAPES)
def test_lift_reproduces_dense_projection(seed, m, n, r):
    A, B = random_point(m, n, r, seed)
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    dA, dB = lift(A, B, *_grads(A, B, G))
    assert _rel(tangent_to_dense(A, B, dA, dB), project_dense(A, B, G)) < RTOL


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("m", "n", "r"), SHAPES)
def test_projection_is_idempotent_and_orthogonal(seed, m, n, r):
    A, B = random_point(m, n, r, seed)
    g = torch.Generator().manual_seed(seed + 7)
    G, H = (torch.randn(m, n, generator=g, dtype=torch.float64) for _ in range(2))
    P = project_dense(A, B, G)
    assert _rel(project_dense(A, B, P), P) < RTOL
    # symmetric: <P(G), H> == <G, P(H)>
    lhs, rhs = (P * H).sum(), (G * project_dense(A, B, H)).sum()
    assert abs((lhs - rhs).item()) < 1e-9 * G.norm().item() * H.norm().item()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("m", "n", "r"), SHAPES)
def test_tangent_norm_matches_dense_frobenius(seed, m, n, r):
    A, B = random_point(m, n, r, seed)
    g = torch.Generator().manual_seed(seed + 3)
    dA = torch.randn(m, r, generator=g, dtype=torch.float64)
    dB = torch.randn(n, r, generator=g, dtype=torch.float64)
    dense = tangent_to_dense(A, B, dA, dB).square().sum()
    assert abs(tangent_norm_sq(A, B, dA, dB).item() - dense.item()) < RTOL * dense.item()


@pytest.mark.parametrize("seed", SEEDS)
def test_batched_equals_unbatched(seed):
    m, n, r, b = 14, 11, 3, 6
    A, B = random_point(m, n, r, seed)
    G = torch.randn(b, m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    gA, gB = _grads(A, B, G)
    dA, dB = lift(A, B, gA, gB)
    norms = tangent_norm_sq(A, B, dA, dB)
    assert dA.shape == (b, m, r) and dB.shape == (b, n, r) and norms.shape == (b,)
    for i in range(b):
        dAi, dBi = lift(A, B, gA[i], gB[i])
        torch.testing.assert_close(dA[i], dAi, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dB[i], dBi, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(norms[i], tangent_norm_sq(A, B, dAi, dBi), rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cond", [1.0, 1e3])
def test_lift_is_gauge_invariant(seed, cond):
    """(A R, B R^{-T}) gives the same tangent vector and intrinsic norm (rel 1e-6)."""
    m, n, r, b = 18, 13, 4, 5
    A, B = random_point(m, n, r, seed)
    R = ill_conditioned(r, seed, cond)
    A2, B2 = A @ R, B @ torch.linalg.inv(R).T
    G = torch.randn(b, m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    t1 = lift(A, B, *_grads(A, B, G))
    t2 = lift(A2, B2, *_grads(A2, B2, G))
    assert _rel(tangent_to_dense(A2, B2, *t2), tangent_to_dense(A, B, *t1)) < 1e-6
    n1, n2 = tangent_norm_sq(A, B, *t1), tangent_norm_sq(A2, B2, *t2)
    assert ((n1 - n2).abs() / n1).max().item() < 1e-6


@pytest.mark.parametrize("seed", SEEDS)
def test_min_norm_lift_same_vector_smaller_factors(seed):
    m, n, r = 15, 10, 3
    A, B = random_point(m, n, r, seed)
    g = torch.Generator().manual_seed(seed + 11)
    dA = torch.randn(m, r, generator=g, dtype=torch.float64)
    dB = torch.randn(n, r, generator=g, dtype=torch.float64)
    mA, mB = min_norm_lift(A, B, dA, dB)
    assert _rel(tangent_to_dense(A, B, mA, mB), tangent_to_dense(A, B, dA, dB)) < RTOL
    best = (mA.square().sum() + mB.square().sum()).item()
    for _ in range(20):  # every other representative (mA + A W, mB - B W.T) is longer
        W = 0.1 * torch.randn(r, r, generator=g, dtype=torch.float64)
        other = ((mA + A @ W).square().sum() + (mB - B @ W.T).square().sum()).item()
        assert other >= best * (1 - 1e-12)
    again = min_norm_lift(A, B, mA, mB)
    torch.testing.assert_close(again.dA, mA, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("m", "n", "r"), SHAPES)
def test_retraction_exact_rank_and_balanced(seed, m, n, r):
    A, B = random_point(m, n, r, seed)
    g = torch.Generator().manual_seed(seed + 5)
    dA = torch.randn(m, r, generator=g, dtype=torch.float64)
    dB = torch.randn(n, r, generator=g, dtype=torch.float64)
    A1, B1 = retract(A, B, dA, dB, 0.3)
    s = torch.linalg.svdvals(A1 @ B1.T)
    assert s[r - 1] > 1e-6 * s[0]
    if r < min(m, n):
        assert s[r] < 1e-10 * s[0]
    torch.testing.assert_close(A1.T @ A1, B1.T @ B1, rtol=1e-9, atol=1e-9)
    # best rank-r approximation of the exact (no t^2 term) update Z + t dZ
    target = A @ B.T + 0.3 * tangent_to_dense(A, B, dA, dB)
    U, S, Vh = torch.linalg.svd(target)
    best = (U[:, :r] * S[:r]) @ Vh[:r]
    assert _rel(A1 @ B1.T, best) < 1e-9


@pytest.mark.parametrize("seed", SEEDS)
def test_retraction_first_order_exact(seed):
    """||Retr(Z + tV) - (Z + tV)|| = O(t^2): fitted log-log slope ~ 2."""
    m, n, r = 20, 14, 4
    A, B = random_point(m, n, r, seed)
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    dA, dB = lift(A, B, *_grads(A, B, G))
    V = tangent_to_dense(A, B, dA, dB)
    ts = np.logspace(-4, -1, 7)
    errs = []
    for t in ts:
        A1, B1 = retract(A, B, dA, dB, float(t))
        errs.append((A1 @ B1.T - (A @ B.T + t * V)).norm().item())
    slope = np.polyfit(np.log(ts), np.log(errs), 1)[0]
    assert 1.9 < slope < 2.1, slope


@pytest.mark.parametrize("seed", SEEDS)
def test_retraction_step_zero_is_gauge_alignment_only(seed):
    m, n, r = 12, 10, 3
    A, B = random_point(m, n, r, seed)
    zero = (torch.zeros(m, r, dtype=torch.float64), torch.zeros(n, r, dtype=torch.float64))
    A1, B1 = retract(A, B, *zero, 0.5)  # balances the factors, keeps Z
    assert _rel(A1 @ B1.T, A @ B.T) < 1e-12
    A2, B2 = retract(A1, B1, *zero, 0.5)  # already balanced: Procrustes returns the same factors
    torch.testing.assert_close(A2, A1, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(B2, B1, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("seed", SEEDS)
def test_tangent_displacement_recovers_step_to_first_order(seed):
    m, n, r = 22, 15, 4
    A, B = random_point(m, n, r, seed)
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    dA, dB = lift(A, B, *_grads(A, B, G))
    V = tangent_to_dense(A, B, dA, dB)
    ts = np.logspace(-4, -1, 7)
    rel_errs = []
    for t in ts:
        A1, B1 = retract(A, B, dA, dB, float(t))
        d = tangent_displacement(A, B, A1, B1)
        rel_errs.append(((tangent_to_dense(A, B, *d) - t * V).norm() / (t * V.norm())).item())
    assert max(rel_errs[:3]) < 1e-3
    slope = np.polyfit(np.log(ts), np.log(rel_errs), 1)[0]
    assert slope > 0.9, slope  # relative error -> 0 at least linearly in t


def test_tangent_displacement_equals_projection_of_difference():
    m, n, r = 13, 9, 2
    A, B = random_point(m, n, r, 0)
    A1, B1 = random_point(m, n, r, 1)
    d = tangent_displacement(A, B, A1, B1)
    expected = project_dense(A, B, A1 @ B1.T - A @ B.T)
    assert _rel(tangent_to_dense(A, B, *d), expected) < RTOL


def test_low_precision_inputs_are_computed_in_float32():
    A, B = random_point(16, 12, 3, 0, dtype=torch.bfloat16)
    gA, gB = torch.ones(16, 3, dtype=torch.bfloat16), torch.ones(12, 3, dtype=torch.bfloat16)
    dA, dB = lift(A, B, gA, gB)
    assert dA.dtype == torch.float32 and dB.dtype == torch.float32
    assert retract(A, B, dA, dB, 0.1).A.dtype == torch.float32


@pytest.mark.parametrize(
    ("shapes", "match"),
    [(((5, 3), (4, 2)), "same rank"), (((2, 3), (4, 3)), "1 <= r"), (((5,), (4, 2)), "matrices")],
)
def test_check_point_rejects_bad_factors(shapes, match):
    with pytest.raises(ValueError, match=match):
        check_point(torch.zeros(shapes[0]), torch.zeros(shapes[1]))
    A = torch.ones(4, 2)
    A[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        check_point(A, torch.ones(3, 2))


# --------------------------------------------------------------------------- frames, fused norms


def _solve_lift(A, B, gA, gB):
    """Eq. (14) by two triangular solves per factor: the pre-frame implementation (29247da)."""
    QA, RA = torch.linalg.qr(A)
    QB, RB = torch.linalg.qr(B)

    def gram_inv(X, R):
        Y = torch.linalg.solve_triangular(R, X, upper=True, left=False)
        return torch.linalg.solve_triangular(R.mT, Y, upper=False, left=False)

    xA, xB = gram_inv(gA, RB), gram_inv(gB, RA)
    return xA - 0.5 * QA @ (QA.mT @ xA), xB - 0.5 * QB @ (QB.mT @ xB)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("m", "n", "r"), SHAPES)
def test_point_frame_factorises_the_point(seed, m, n, r):
    A, B = random_point(m, n, r, seed)
    A = A @ ill_conditioned(r, seed, 1e2)
    f = point_frame(A, B)
    eye = torch.eye(r, dtype=torch.float64)
    for X, Q, R, R_inv in ((A, f.QA, f.RA, f.RA_inv), (B, f.QB, f.RB, f.RB_inv)):
        G_inv = R_inv @ R_inv.mT
        assert _rel(Q @ R, X) < RTOL
        torch.testing.assert_close(Q.mT @ Q, eye, rtol=0, atol=1e-12)
        torch.testing.assert_close(R_inv @ R, eye, rtol=0, atol=1e-9)
        torch.testing.assert_close(G_inv @ (X.mT @ X), eye, rtol=0, atol=1e-9)
        assert torch.equal(R_inv, R_inv.triu())


def test_point_frame_of_a_stack_is_the_stack_of_frames():
    pairs = [random_point(11, 7, 3, seed) for seed in SEEDS]
    stacked = point_frame(torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs]))
    for j, (A, B) in enumerate(pairs):
        single = point_frame(A, B)
        for s, t in zip(stacked, single, strict=True):
            torch.testing.assert_close(s[j], t, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("m", "n", "r"), SHAPES)
def test_lift_matches_the_triangular_solve_reference(seed, m, n, r):
    """Explicit r x r inverses (frame) give the same lift as the old solves (rel 1e-10)."""
    A, B = random_point(m, n, r, seed)
    g = torch.Generator().manual_seed(seed + 20)
    gA = torch.randn(4, m, r, generator=g, dtype=torch.float64)
    gB = torch.randn(4, n, r, generator=g, dtype=torch.float64)
    expected = _solve_lift(A, B, gA, gB)
    for frame in (None, point_frame(A, B)):
        got = lift(A, B, gA, gB, frame=frame)
        assert _rel(got.dA, expected[0]) < 1e-10 and _rel(got.dB, expected[1]) < 1e-10


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("m", "n", "r"), SHAPES)
@pytest.mark.parametrize("common_G", [True, False])
@pytest.mark.parametrize("cond", [1.0, 1e2])
def test_lift_norm_sq_equals_the_norm_of_the_lift(seed, m, n, r, common_G, cond):
    """Fused eqs. (14)-(15) == tangent_norm_sq(lift) == dense Frobenius, for any (gA, gB);
    cond(RA) = ``cond``, cond(RB) = 1, so both moment strategies of ``lift_moments`` run."""
    A, B = random_point(m, n, r, seed)
    A = torch.linalg.qr(A)[0] @ ill_conditioned(r, seed, cond)
    B = torch.linalg.qr(B)[0]
    frame = point_frame(A, B)
    assert frame.cond_B.item() <= GRAM_COND_MAX
    if r > 1:  # a 1 x 1 factor is perfectly conditioned
        assert (frame.cond_A.item() > GRAM_COND_MAX) == (cond > GRAM_COND_MAX)
    g = torch.Generator().manual_seed(seed + 30)
    b = 5
    if common_G:
        gA, gB = _grads(A, B, torch.randn(b, m, n, generator=g, dtype=torch.float64))
    else:  # independent factor gradients: alpha != beta.T, the cross block matters
        gA = torch.randn(b, m, r, generator=g, dtype=torch.float64)
        gB = torch.randn(b, n, r, generator=g, dtype=torch.float64)
    fused = lift_norm_sq(frame, gA, gB)
    dA, dB = lift(A, B, gA, gB)
    dense = tangent_to_dense(A, B, dA, dB).square().sum(dim=(-2, -1))
    assert fused.shape == (b,)
    assert ((fused - dense).abs() / dense).max().item() < 1e-9
    assert ((fused - tangent_norm_sq(A, B, dA, dB)).abs() / dense).max().item() < 1e-9


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("cond", "tol"), [(1.0, 1e-6), (1e3, 1e-4)])
def test_lift_norm_sq_float32_tracks_float64(seed, cond, tol):
    """Float32 moments against float64: relative error <= 1e-6 for a balanced gauge and
    <= 1e-4 for one with cond(R) = 1e3 (rounding grows like cond(R), not cond(R)^2 as it would
    for Grams of the raw gradients: about 2e-3 there), also for gradients that lie almost in
    span(A) x span(B), where ||a||^2 - ||alpha||^2 cancels."""
    m, n, r, b = 64, 48, 4, 6
    A, B = random_point(m, n, r, seed)
    R = ill_conditioned(r, seed, cond)
    A, B = A @ R, B @ torch.linalg.inv(R).T
    G = torch.randn(
        b, m, n, generator=torch.Generator().manual_seed(seed + 40), dtype=torch.float64
    )
    QA, QB = torch.linalg.qr(A)[0], torch.linalg.qr(B)[0]
    for eps in (1.0, 1e-3):  # eps: weight of the generic part of the gradient
        H = QA @ (QA.mT @ G @ QB) @ QB.mT + eps * G
        hA, hB = _grads(A, B, H)
        exact = lift_norm_sq(point_frame(A, B), hA, hB)
        low = lift_norm_sq(point_frame(A.float(), B.float()), hA.float(), hB.float())
        assert low.dtype == torch.float32
        assert ((low.double() - exact).abs() / exact).max().item() < tol


def test_lift_moments_needs_the_frame_of_one_module():
    A, B = random_point(9, 7, 2, 0)
    stacked = point_frame(torch.stack([A, A]), torch.stack([B, B]))
    with pytest.raises(ValueError, match="frame of one module"):
        lift_moments(stacked, torch.zeros(3, 9, 2), torch.zeros(3, 7, 2))


@pytest.mark.parametrize("r", [2, TRANSPOSE_MAX_RANK + 2])
@pytest.mark.parametrize("layout", ["row-major", "transposed"])
def test_lift_moments_stacked_equals_lift_moments_module_by_module(r, layout):
    """L modules at once == one call per module (float64, rel 1e-12), in both memory layouts,
    for a stack where one module is ill-conditioned (the whitened-first strategy for all)."""
    m, n, b = 12, 10, 4
    points = [random_point(m, n, r, seed) for seed in range(3)]
    A2, B2 = points[2]
    points[2] = (torch.linalg.qr(A2)[0] @ ill_conditioned(r, 2, 1e3), B2)
    frames = [point_frame(A, B) for A, B in points]
    assert frames[2].cond_A.item() > GRAM_COND_MAX >= frames[0].cond_A.item()
    g = torch.Generator().manual_seed(7)
    gA = torch.randn(3, b, m, r, generator=g, dtype=torch.float64)
    gB = torch.randn(3, b, n, r, generator=g, dtype=torch.float64)
    if layout == "transposed":  # Opacus' lora_A layout: (b, r, m) in memory
        gA, gB = gA.mT.contiguous().mT, gB.mT.contiguous().mT
    stacked = point_frame(torch.stack([p[0] for p in points]), torch.stack([p[1] for p in points]))
    together = lift_moments_stacked(stacked, gA, gB)
    for part in together:
        assert part.shape == (3, b, r, r)
    for i, frame in enumerate(frames):
        alone = lift_moments(frame, gA[i], gB[i])
        for got, want in zip(together, alone, strict=True):
            torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12 * want.abs().max())


@pytest.mark.parametrize("cond", [1.0, 1e3])
def test_whitened_lift_and_norm_equal_the_lift_and_norm_of_the_raw_gradients(cond):
    """From whitened rows ``(g R^{-1}).T`` of a stack of modules (one ill-conditioned), the
    norm (eq. 15 from a pass of squares, no Gram) and the lift (eq. 14) equal ``lift_norm_sq``
    and ``lift`` of the raw gradients module by module (float64, rel 1e-10)."""
    m, n, r, b = 12, 10, 3, 5
    points = [random_point(m, n, r, seed) for seed in range(3)]
    A2, B2 = points[2]
    points[2] = (torch.linalg.qr(A2)[0] @ ill_conditioned(r, 2, cond), B2)
    stacked = point_frame(torch.stack([p[0] for p in points]), torch.stack([p[1] for p in points]))
    g = torch.Generator().manual_seed(9)
    gA = torch.randn(3, b, m, r, generator=g, dtype=torch.float64)
    gB = torch.randn(3, b, n, r, generator=g, dtype=torch.float64)
    rows_a = (gA @ stacked.RB_inv.unsqueeze(1)).mT.contiguous()
    rows_c = (gB @ stacked.RA_inv.unsqueeze(1)).mT.contiguous()
    norms = lift_norm_sq_whitened(stacked, rows_a, rows_c)
    assert norms.shape == (3, b)
    for i, (A, B) in enumerate(points):
        want = lift_norm_sq(point_frame(A, B), gA[i], gB[i])
        assert ((norms[i] - want).abs() / want).max().item() < 1e-10
        got = lift_whitened(point_frame(A, B), rows_a[i].mT, rows_c[i].mT)
        dA, dB = lift(A, B, gA[i], gB[i])
        assert _rel(got.dA, dA) < 1e-10 and _rel(got.dB, dB) < 1e-10
    with pytest.raises(ValueError, match="stacked frame"):
        lift_norm_sq_whitened(point_frame(*points[0]), rows_a[0], rows_c[0])


def test_lift_moments_stacked_needs_a_stacked_frame():
    A, B = random_point(9, 7, 2, 0)
    with pytest.raises(ValueError, match="stacked frame"):
        lift_moments_stacked(point_frame(A, B), torch.zeros(1, 3, 9, 2), torch.zeros(1, 3, 7, 2))
    stacked = point_frame(torch.stack([A, A]), torch.stack([B, B]))
    with pytest.raises(ValueError, match="stacked frame"):
        lift_moments_stacked(stacked, torch.zeros(3, 9, 2), torch.zeros(3, 7, 2))


@pytest.mark.parametrize("r", [2, TRANSPOSE_MAX_RANK, TRANSPOSE_MAX_RANK + 2])
@pytest.mark.parametrize("layout", ["row-major", "transposed"])
def test_lift_norm_sq_is_independent_of_memory_layout(r, layout):
    """Row-major (b, m, r) and Opacus' transposed (b, r, m) gradients, with and without the
    transposing copy, give the same norms (well-conditioned factors: raw moments)."""
    m, n, b = 30, 25, 4
    A, B = (torch.linalg.qr(X)[0] for X in random_point(m, n, r, r))
    g = torch.Generator().manual_seed(r)
    gA = torch.randn(b, m, r, generator=g, dtype=torch.float64)
    gB = torch.randn(b, n, r, generator=g, dtype=torch.float64)
    if layout == "transposed":
        gA, gB = gA.mT.contiguous().mT, gB.mT.contiguous().mT
    fused = lift_norm_sq(point_frame(A, B), gA, gB)
    expected = tangent_norm_sq(A, B, *lift(A, B, gA.contiguous(), gB.contiguous()))
    assert ((fused - expected).abs() / expected).max().item() < 1e-10
