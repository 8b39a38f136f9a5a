"""A secure sum's share: the coordinates are an isometry, the integer share is unbiased, its
noise has the stated scale, and every coordinate stays within the stated bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.points import SEEDS, SHAPES, random_point

from prism_core.discrete import skellam_noise
from prism_core.distributed import (
    FIELD_BITS,
    MU_SHARE_MAX,
    NOISE_BOUND,
    SCALE_BITS,
    UNITS_MAX,
    _bounded_skellam,
    coordinate_bound,
    coordinate_dim,
    coordinate_shapes,
    decode_sum,
    discrete_sensitivity,
    encode_share,
    flatten,
    from_coordinates,
    gamma,
    tangent_coordinates,
    unflatten,
)
from prism_core.errors import PrivacyParameterError
from prism_core.manifold import Frame, Point, Tangent, tangent_norm_sq, tangent_to_dense
from prism_core.mechanism import StepFrames, step_frames, tangent_noise

EXACT = 1e-10
"""Relative tolerance of identities that hold exactly in float64."""

MODULE_SETS = [
    [SHAPES[0]],
    [SHAPES[1], SHAPES[1], SHAPES[1]],  # one stacked group of equal shapes
    [SHAPES[0], SHAPES[1], SHAPES[0], SHAPES[2], SHAPES[3]],  # several groups, interleaved
]

STD_TOLERANCE = 0.02
"""Relative tolerance of a measured noise std. With n samples the sample std has a relative
standard error of ``sqrt((kurtosis - 1) / (4 n))`` (kurtosis ``3 + 1 / (2 mu)`` for Skellam,
at most 4 here), so for the n used below 2% is more than 10 standard errors."""


def _points(shapes, seed, dtype=torch.float64):
    return [
        Point(*random_point(m, n, r, seed + 10 * k, dtype)) for k, (m, n, r) in enumerate(shapes)
    ]


def _tangents(points, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    return [
        Tangent(
            torch.randn(p.A.shape, generator=g, dtype=p.A.dtype),
            torch.randn(p.B.shape, generator=g, dtype=p.B.dtype),
        )
        for p in points
    ]


def _energy(coords):
    return sum(float(X.square().sum() + Y.square().sum()) for X, Y in coords)


# --- coordinates -----------------------------------------------------------------------------


@pytest.mark.parametrize("shapes", MODULE_SETS)
@pytest.mark.parametrize("seed", SEEDS)
def test_coordinates_hold_the_intrinsic_norm_of_every_module(shapes, seed):
    """``||X||^2 + ||Y||^2 = tangent_norm_sq = ||dZ||_F^2`` per module (rel 1e-10)."""
    points = _points(shapes, seed)
    tangents = _tangents(points, seed)
    coords = tangent_coordinates(step_frames(points), tangents)
    for p, t, (X, Y) in zip(points, tangents, coords, strict=True):
        assert X.dtype == Y.dtype == torch.float64
        assert X.shape == p.A.shape and Y.shape == p.B.shape
        energy = float(X.square().sum() + Y.square().sum())
        intrinsic = float(tangent_norm_sq(p.A, p.B, t.dA, t.dB))
        dense = float(tangent_to_dense(p.A, p.B, t.dA, t.dB).square().sum())
        assert energy == pytest.approx(intrinsic, rel=EXACT)
        assert energy == pytest.approx(dense, rel=EXACT)


@pytest.mark.parametrize("shapes", MODULE_SETS)
@pytest.mark.parametrize("seed", SEEDS)
def test_decoding_the_coordinates_gives_back_the_same_tangent_vector(shapes, seed):
    """``from_coordinates(tangent_coordinates(t))`` represents the same dZ (rel 1e-10 of its
    Frobenius norm), though not necessarily with the same factors."""
    points = _points(shapes, seed)
    tangents = _tangents(points, seed)
    frames = step_frames(points)
    back = from_coordinates(frames, tangent_coordinates(frames, tangents))
    for p, t, b in zip(points, tangents, back, strict=True):
        assert b.dA.dtype == b.dB.dtype == torch.float64
        want = tangent_to_dense(p.A, p.B, t.dA, t.dB)
        got = tangent_to_dense(p.A, p.B, b.dA, b.dB)
        assert float(torch.linalg.norm(got - want)) <= EXACT * float(torch.linalg.norm(want))


@pytest.mark.parametrize("seed", SEEDS)
def test_decoding_projects_out_the_coordinates_in_the_column_space_of_A(seed):
    """The part of ``X`` in ``span(A)`` carries no tangent direction: decoding drops it, so a
    second encoding returns ``((I - Pi_A) X, Y)`` (rel 1e-10)."""
    points = _points([SHAPES[1], SHAPES[3]], seed)
    frames = step_frames(points)
    g = torch.Generator().manual_seed(seed)
    raw = [
        (torch.randn(p.A.shape, generator=g), torch.randn(p.B.shape, generator=g)) for p in points
    ]
    again = tangent_coordinates(frames, from_coordinates(frames, raw))
    for p, (X, Y), (X2, Y2) in zip(points, raw, again, strict=True):
        QA, _ = torch.linalg.qr(p.A.to(torch.float64))
        X_perp = X.to(torch.float64) - QA @ (QA.T @ X.to(torch.float64))
        assert float(torch.linalg.norm(X2 - X_perp)) <= EXACT * float(torch.linalg.norm(X))
        assert float(torch.linalg.norm(Y2 - Y.to(torch.float64))) <= EXACT * float(
            torch.linalg.norm(Y)
        )


def _flipped(frames: StepFrames) -> StepFrames:
    """The same frames with the signs of every other QR column flipped (another LAPACK's QR)."""

    def flip(f: Frame) -> Frame:
        r = f.RA.shape[-1]
        s = torch.tensor([(-1.0) ** k for k in range(r)], dtype=f.QA.dtype)
        return f._replace(
            QA=f.QA * s,
            QB=f.QB * -s,
            RA=f.RA * s.unsqueeze(-1),
            RB=f.RB * -s.unsqueeze(-1),
            RA_inv=f.RA_inv * s,
            RB_inv=f.RB_inv * -s,
        )

    stacked = tuple(flip(f) for f in frames.stacked)
    return StepFrames(tuple(flip(f) for f in frames.frames), frames.groups, stacked, frames.points)


@pytest.mark.parametrize("seed", SEEDS)
def test_coordinates_do_not_depend_on_the_sign_convention_of_the_qr(seed):
    """A frame whose QR columns have other signs gives the same coordinates (rel 1e-10): a site
    and the coordinator on different LAPACK builds agree."""
    points = _points(MODULE_SETS[2], seed)
    tangents = _tangents(points, seed)
    frames = step_frames(points)
    ours = tangent_coordinates(frames, tangents)
    theirs = tangent_coordinates(_flipped(frames), tangents)
    for (X, Y), (X2, Y2) in zip(ours, theirs, strict=True):
        assert float(torch.linalg.norm(X2 - X)) <= EXACT * float(torch.linalg.norm(X))
        assert float(torch.linalg.norm(Y2 - Y)) <= EXACT * float(torch.linalg.norm(Y))


def test_float32_points_are_encoded_in_float64():
    """Frames of float32 factors are recomputed in float64: the coordinates equal those of the
    same factors held in float64 (rel 1e-12)."""
    points32 = _points(MODULE_SETS[2], 0, torch.float32)
    points64 = [Point(p.A.double(), p.B.double()) for p in points32]
    tangents = _tangents(points32, 0)
    c32 = tangent_coordinates(step_frames(points32), tangents)
    c64 = tangent_coordinates(step_frames(points64), tangents)
    for (X, Y), (X2, Y2) in zip(c32, c64, strict=True):
        assert X.dtype == torch.float64
        assert float(torch.linalg.norm(X - X2)) <= 1e-12 * float(torch.linalg.norm(X2))
        assert float(torch.linalg.norm(Y - Y2)) <= 1e-12 * float(torch.linalg.norm(Y2))


@pytest.mark.parametrize("seed", SEEDS)
def test_white_noise_in_the_coordinates_is_the_tangent_noise(seed):
    """``tangent_noise`` is ``(I - Pi_A) U QB.T + QA V.T`` with the frame's own QR; with
    ``QA = QA' Da``, ``QB = QB' Db`` for the canonical bases (``Da``, ``Db`` the signs of the
    frame's ``diag(R)``), ``from_coordinates`` of ``(U Db, V Da)``, the draws replayed from the
    same seed (U, then V), gives the same dZ (rel 1e-10). So i.i.d. noise added to the
    coordinates is the tangent noise of eq. (19), scaled."""
    m, n, r = SHAPES[1]
    A, B = random_point(m, n, r, seed)
    stacked = Point(A.expand(4, m, r).clone(), B.expand(4, n, r).clone())
    frames = step_frames([Point(stacked.A[k], stacked.B[k]) for k in range(4)])
    frame = frames.stacked[0]
    generator = torch.Generator().manual_seed(seed)
    xi = tangent_noise(stacked.A, stacked.B, generator, frame=frame)
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(stacked.A.shape, generator=g, dtype=torch.float64)
    V = torch.randn(stacked.B.shape, generator=g, dtype=torch.float64)
    sa = torch.sign(frame.RA.diagonal(dim1=-2, dim2=-1)).unsqueeze(-2)
    sb = torch.sign(frame.RB.diagonal(dim1=-2, dim2=-1)).unsqueeze(-2)
    decoded = from_coordinates(frames, [(U[k] * sb[k], V[k] * sa[k]) for k in range(4)])
    for k in range(4):
        want = tangent_to_dense(A, B, xi.dA[k], xi.dB[k])
        got = tangent_to_dense(A, B, decoded[k].dA, decoded[k].dB)
        assert float(torch.linalg.norm(got - want)) <= EXACT * float(torch.linalg.norm(want))


def test_tangent_noise_in_coordinates_has_energy_r_times_m_plus_n_minus_r():
    """4000 draws of ``tangent_noise`` at one point (a stack of copies): the mean energy of the
    coordinates is ``D = r (m + n - r)`` within 5 standard errors (the energy is chi-square with
    D degrees of freedom, variance 2 D), and every coordinate of Y has variance 1 within 6
    standard errors (``sqrt(2 / draws)``, with a Bonferroni margin over the n r entries)."""
    m, n, r = SHAPES[1]
    draws = 4000
    A, B = random_point(m, n, r, 0)
    stacked = Point(A.expand(draws, m, r).clone(), B.expand(draws, n, r).clone())
    frames = step_frames([Point(stacked.A[k], stacked.B[k]) for k in range(draws)])
    xi = tangent_noise(
        stacked.A, stacked.B, torch.Generator().manual_seed(7), frame=frames.stacked[0]
    )
    coords = tangent_coordinates(frames, [Tangent(xi.dA[k], xi.dB[k]) for k in range(draws)])
    dof = r * (m + n - r)
    energies = torch.tensor([_energy([c]) for c in coords], dtype=torch.float64)
    assert abs(float(energies.mean()) - dof) <= 5 * math.sqrt(2 * dof / draws)
    Y = torch.stack([c.Y for c in coords])
    var_y = Y.square().mean(dim=0)
    assert float((var_y - 1).abs().max()) <= 6 * math.sqrt(2 / draws)


def test_flatten_and_unflatten_round_trip_exactly():
    """The fixed order (modules, X then Y row-major, then the head) and back, bit for bit."""
    points = _points(MODULE_SETS[2], 0)
    frames = step_frames(points)
    coords = tangent_coordinates(frames, _tangents(points, 0))
    g = torch.Generator().manual_seed(3)
    head = [torch.randn(2, 7, generator=g), torch.randn(2, generator=g, dtype=torch.float64)]
    shapes = coordinate_shapes(points, head)
    vector = flatten(coords, head)
    assert vector.dtype == torch.float64 and vector.dim() == 1
    assert (
        vector.numel()
        == coordinate_dim(shapes)
        == sum((m + n) * r for m, n, r in MODULE_SETS[2]) + 16
    )
    m0, _, r0 = MODULE_SETS[2][0]
    assert torch.equal(vector[: m0 * r0], coords[0].X.reshape(-1))  # row-major, X first
    assert torch.equal(vector[-2:], head[1])
    back, head_back = unflatten(vector, shapes)
    for (X, Y), (X2, Y2) in zip(coords, back, strict=True):
        assert torch.equal(X, X2) and torch.equal(Y, Y2)
    for h, h2 in zip(head, head_back, strict=True):
        assert torch.equal(h.double(), h2)
    with pytest.raises(ValueError, match="length"):
        unflatten(vector[:-1], shapes)


def test_a_module_count_or_shape_mismatch_is_refused():
    points = _points(MODULE_SETS[2], 0)
    frames = step_frames(points)
    tangents = _tangents(points, 0)
    with pytest.raises(ValueError, match="modules"):
        tangent_coordinates(frames, tangents[:-1])
    with pytest.raises(ValueError, match="shapes"):
        tangent_coordinates(frames, [Tangent(t.dA.T, t.dB) for t in tangents])


# --- the discrete share ----------------------------------------------------------------------


def test_the_constants_keep_the_sum_exact_and_the_redraw_negligible():
    """``C / gamma = 2^20``; the bound is ``2^45 + 1``; 65 535 shares cannot wrap the centred
    range of the field; at ``mu <= MU_SHARE_MAX`` the Bernstein exponent of a draw past
    ``NOISE_BOUND`` is above 6.8e10 (the figure ``encode_share`` states)."""
    assert 3.0 / gamma(3.0) == 2**SCALE_BITS
    assert coordinate_bound() == 2**45 + 1 == UNITS_MAX * 2**SCALE_BITS + 1 + NOISE_BOUND
    assert 65_535 * coordinate_bound() < 2 ** (FIELD_BITS - 1)
    t = float(NOISE_BOUND)
    assert t * t / (2 * (2 * MU_SHARE_MAX + t / 3)) > 6.8e10
    assert MU_SHARE_MAX + 40 * math.sqrt(MU_SHARE_MAX) < 2.0**53


@pytest.mark.parametrize("dim", [1, 100, 10_000, 2**40])
def test_discrete_sensitivity_is_the_coupled_rounding_bound(dim):
    l2, l1 = discrete_sensitivity(dim)
    assert l2 == 2**SCALE_BITS + math.sqrt(dim)
    assert l1 == min(math.sqrt(dim) * 2**SCALE_BITS + dim, l2 * l2)


def test_one_unit_moves_the_coupled_roundings_within_the_sensitivity():
    """Two neighbouring vectors (one differs by a unit of norm C) encoded with the same seed and
    no noise: the difference of the integer vectors is within ``discrete_sensitivity``."""
    C, d = 0.5, 257
    g = torch.Generator().manual_seed(4)
    base = torch.randn(d, generator=g, dtype=torch.float64)
    unit = torch.randn(d, generator=g, dtype=torch.float64)
    unit = C * unit / torch.linalg.norm(unit)
    l2, l1 = discrete_sensitivity(d)
    for seed in range(20):
        a = encode_share(base, max_norm=C, mu_share=0.0, source=torch.Generator().manual_seed(seed))
        b = encode_share(
            base + unit, max_norm=C, mu_share=0.0, source=torch.Generator().manual_seed(seed)
        )
        diff = (b - a).astype(np.float64)
        assert np.linalg.norm(diff) <= l2
        assert np.abs(diff).sum() <= l1


def test_encoding_then_decoding_is_unbiased():
    """20 000 independent encodings of a 16-coordinate vector (one call on the vector repeated):
    each coordinate's mean is within 5 standard errors of the input, the standard error being
    ``gamma sqrt((2 mu + 1/4) / n)`` (Skellam variance plus at most 1/4 of the rounding)."""
    C, mu, n, d = 2.0, 3.0, 20_000, 16
    step = gamma(C)
    g = torch.Generator().manual_seed(5)
    x = step * (100 * torch.randn(d, generator=g, dtype=torch.float64))  # fractional steps
    share = encode_share(
        x.repeat(n), max_norm=C, mu_share=mu, source=torch.Generator().manual_seed(6)
    )
    decoded = decode_sum(share, max_norm=C).reshape(n, d)
    assert decoded.dtype == torch.float64
    se = step * math.sqrt((2 * mu + 0.25) / n)
    assert float((decoded.mean(dim=0) - x).abs().max()) <= 5 * se


@pytest.mark.parametrize("mu", [3.0, 1e4, 2.0**39])
def test_a_share_adds_noise_of_the_stated_std(mu):
    """200 000 coordinates of a zero vector's share: the decoded std is ``gamma sqrt(2 mu)``
    (``Sk(mu)`` has variance ``2 mu``; docs/design.md §3.3) within ``STD_TOLERANCE`` (over 10
    standard errors of the sample std)."""
    C, n = 0.7, 200_000
    share = encode_share(
        torch.zeros(n, dtype=torch.float64),
        max_norm=C,
        mu_share=mu,
        source=torch.Generator().manual_seed(8),
    )
    measured = float(decode_sum(share, max_norm=C).std())
    want = gamma(C) * math.sqrt(2 * mu)
    assert measured / want == pytest.approx(1.0, abs=STD_TOLERANCE)


@pytest.mark.parametrize("mu", [3.0, 2.0**39])
def test_the_sum_of_h_shares_has_the_stated_std(mu):
    """H = 5 independent shares (one source each) of vectors of whole steps (whose rounding
    adds nothing), summed as integers: the decoded sum minus the summed inputs has std
    ``gamma sqrt(2 mu H)`` (the sum is ``Sk(H mu)``) within ``STD_TOLERANCE`` (100 000
    coordinates)."""
    C, n, sites = 1.5, 100_000, 5
    g = torch.Generator().manual_seed(9)
    inputs = [gamma(C) * torch.randint(-50, 50, (n,), generator=g).double() for _ in range(sites)]
    total = sum(
        encode_share(x, max_norm=C, mu_share=mu, source=torch.Generator().manual_seed(100 + k))
        for k, x in enumerate(inputs)
    )
    noise = decode_sum(np.asarray(total), max_norm=C) - sum(inputs)
    want = gamma(C) * math.sqrt(2 * mu * sites)
    assert float(noise.std()) / want == pytest.approx(1.0, abs=STD_TOLERANCE)


def test_a_vector_above_the_units_bound_is_refused():
    C = 0.25
    limit = UNITS_MAX * C
    ok = torch.tensor([limit, 0.0], dtype=torch.float64)
    share = encode_share(ok, max_norm=C, mu_share=1.0, source=torch.Generator().manual_seed(1))
    assert int(np.abs(share).max()) <= coordinate_bound()
    for too_large in ([limit * (1 + 1e-9), 0.0], [limit, 1.0], [1e300, 1e300]):
        with pytest.raises(ValueError, match="exceeds UNITS_MAX"):
            encode_share(
                torch.tensor(too_large, dtype=torch.float64),
                max_norm=C,
                mu_share=1.0,
                source=torch.Generator().manual_seed(1),
            )


def test_non_finite_entries_are_encoded_as_zero_signal():
    """Without noise the share is exactly the rounding of the finite entries and 0 elsewhere."""
    C = 1.0
    step = gamma(C)
    x = torch.tensor([math.nan, math.inf, -math.inf, 7 * step, -3 * step], dtype=torch.float64)
    share = encode_share(x, max_norm=C, mu_share=0.0, source=torch.Generator().manual_seed(2))
    assert share.dtype == np.int64
    assert share.tolist() == [0, 0, 0, 7, -3]


def test_every_encoded_coordinate_is_within_the_bound():
    """Coordinates at the largest magnitude a site's sum allows, plus the largest-variance noise
    tried (std about 2^25 steps): every coordinate within ``coordinate_bound()``."""
    C = 3.0
    x = torch.zeros(4096, dtype=torch.float64)
    x[0] = UNITS_MAX * C  # the whole norm in one coordinate: |y| = 2^44
    share = encode_share(
        x, max_norm=C, mu_share=MU_SHARE_MAX, source=torch.Generator().manual_seed(3)
    )
    assert int(np.abs(share).max()) <= coordinate_bound()
    assert share[0] >= NOISE_BOUND - 2**32  # the signal is there (noise is ~2^25.5)


def test_noise_draws_past_the_bound_are_redrawn_from_the_conditional_law():
    """With a small bound the redraw path runs: 100 000 draws of ``Sk(5)`` conditioned on
    ``|x| <= 2``: all within it, and each value's frequency within 5 standard errors of the
    conditional pmf (estimated from 10^6 unconditioned draws, whose error is below 1/3 of it)."""
    bound, mu, n = 2, 5.0, 100_000
    drawn = _bounded_skellam(n, mu, source=torch.Generator().manual_seed(11), bound=bound)
    assert int(np.abs(drawn).max()) <= bound
    reference = skellam_noise((1_000_000,), mu, source=torch.Generator().manual_seed(12)).numpy()
    kept = reference[np.abs(reference) <= bound]
    for value in range(-bound, bound + 1):
        p = float(np.mean(kept == value))
        freq = float(np.mean(drawn == value))
        assert abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / n) + 5 * math.sqrt(
            p * (1 - p) / kept.size
        )


def test_bad_parameters_are_refused():
    x = torch.zeros(3, dtype=torch.float64)
    source = torch.Generator().manual_seed(0)
    for mu in (-1.0, math.nan, 2 * MU_SHARE_MAX):
        with pytest.raises(PrivacyParameterError, match="mu_share"):
            encode_share(x, max_norm=1.0, mu_share=mu, source=source)
    for C in (0.0, -1.0, math.inf):
        with pytest.raises(PrivacyParameterError, match="max_norm"):
            gamma(C)
    with pytest.raises(ValueError, match="1-D"):
        encode_share(x.reshape(3, 1), max_norm=1.0, mu_share=1.0, source=source)
    with pytest.raises(ValueError, match="integer"):
        decode_sum(np.zeros(3), max_norm=1.0)
