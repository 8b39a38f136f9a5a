"""A site's share of a secure sum: orthonormal tangent coordinates, rounded, plus Skellam noise.

Under secure aggregation (docs/design.md §3.3) a site releases no Gaussian-noised tangent
update. It writes its clipped sum (``prism_core.mechanism.ClippedSum``: one tangent per module
and the Euclidean head sums) as ONE real vector of a fixed public order, in coordinates in
which the clip's intrinsic norm (eq. 15 of PRISM) is the Euclidean norm, divides it by
``gamma``, rounds it randomly to integers and adds its share of Skellam noise::

    site:         tangent_coordinates -> flatten -> encode_share      (then masked mod 2^62)
    coordinator:  sum of the shares -> decode_sum -> unflatten -> from_coordinates

The coordinates of a tangent vector ``dZ = dA B.T + A dB.T`` at ``(A = QA RA, B = QB RB)`` are
``X = (I - Pi_A) dZ QB`` (m x r) and ``Y = dZ.T QA`` (n x r). The blocks ``(I - Pi_A) dZ`` and
``Pi_A dZ`` of ``dZ`` are orthogonal and ``X``, ``Y`` are their coordinates in orthonormal
bases, so ``||X||^2 + ||Y||^2 = ||dZ||_F^2``: a unit's contribution of intrinsic norm <= C has
Euclidean norm <= C in the vector, the sensitivity the Skellam accountant
(``prism_core.skellam_accounting``) takes. White noise in these coordinates is tangent noise:
``tangent_noise`` (eq. 19) is ``(I - Pi_A) U QB.T + QA V.T``, the tangent vector whose
coordinates are ``((I - Pi_A) U, V)``. Decoding keeps only the component of ``X`` orthogonal to
``QA`` (the r^2 coordinates of ``X`` in ``span(QA)`` carry only noise, which is dropped:
post-processing).

The integer arithmetic (module constants): ``C / gamma = 2^SCALE_BITS``; a site's sum holds at
most ``UNITS_MAX`` units, so its coordinates are at most ``2^44`` in magnitude before noise; a
noise draw is at most ``NOISE_BOUND``; the shares are added modulo ``2^FIELD_BITS``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final, NamedTuple

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from prism_core.discrete import (
    DEFAULT_MAX_TRIES,
    randomized_round,
    rounded_l1_bound,
    rounded_l2_bound,
    skellam_noise,
)
from prism_core.errors import PrivacyParameterError
from prism_core.manifold import Frame, Point, Tangent, point_frame
from prism_core.mechanism import StepFrames
from prism_core.rng import NoiseSource

__all__ = [
    "FIELD_BITS",
    "MU_SHARE_MAX",
    "NOISE_BOUND",
    "SCALE_BITS",
    "UNITS_MAX",
    "CoordinateShapes",
    "Coordinates",
    "coordinate_bound",
    "coordinate_dim",
    "coordinate_shapes",
    "decode_sum",
    "discrete_sensitivity",
    "encode_share",
    "flatten",
    "from_coordinates",
    "gamma",
    "tangent_coordinates",
    "unflatten",
]

SCALE_BITS: Final = 20
"""``C / gamma = 2^20``: one unit's clipped contribution spans 2^20 integer steps, so the
rounding's own error (``sqrt(d)`` steps) is small against the sensitivity for ``d`` up to
about 2^40."""

FIELD_BITS: Final = 62
"""The shares are added modulo ``2^62`` and the sum read in the centred range
``[-2^61, 2^61)``: K shares, each within ``coordinate_bound() = 2^45 + 1``, cannot wrap while
``K (2^45 + 1) < 2^61``, i.e. for up to 65 535 sites (and their int64 sum cannot overflow)."""

UNITS_MAX: Final = 2**24
"""The most sampled units (examples or people) a site's clipped sum can hold: its l2 norm is at
most ``UNITS_MAX * C``, so every coordinate of ``sum / gamma`` is at most ``2^44``."""

NOISE_BOUND: Final = 2**44
"""The largest magnitude of one Skellam draw of a share; a larger draw is redrawn
(``encode_share`` states why this changes nothing that matters)."""

MU_SHARE_MAX: Final = 2.0**50
"""The largest Skellam parameter of a share: its Poisson draws (about ``mu +- 40 sqrt(mu)``)
stay below 2^53, where float64 holds every integer, and a share's standard deviation is at most
``2^25.5`` steps, about 45 C (a noise multiplier of 45 at one honest site)."""

_F64: Final = torch.float64


class Coordinates(NamedTuple):
    """Orthonormal coordinates of one module's tangent vector: ``X`` (m x r), ``Y`` (n x r)."""

    X: Tensor
    Y: Tensor


class CoordinateShapes(NamedTuple):
    """What ``unflatten`` needs: each module's ``(X shape, Y shape)`` and each head shape."""

    modules: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    head: tuple[tuple[int, ...], ...]


# --- coordinates -----------------------------------------------------------------------------


def _canonical_frame(frame: Frame, point: Point) -> Frame:
    """The float64 thin-QR frame of ``point`` with ``diag(R) > 0``.

    A full-rank factor has exactly one thin QR with a positive diagonal, so the coordinates are
    a function of the factors alone, whatever sign convention a LAPACK build uses: a site and
    the coordinator that hold the same broadcast factors use the same coordinates. A frame not
    in float64 is recomputed from the points in float64 (``O((m + n) r^2)``).
    """
    if frame.QA.dtype != _F64:
        frame = point_frame(point.A.to(_F64), point.B.to(_F64))
    sa = torch.sign(frame.RA.diagonal(dim1=-2, dim2=-1))
    sb = torch.sign(frame.RB.diagonal(dim1=-2, dim2=-1))
    sa = torch.where(sa == 0, torch.ones_like(sa), sa)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb)
    # A = (QA D)(D RA) and (D RA)^{-1} = RA^{-1} D for D = diag(sa), the same for B.
    return Frame(
        QA=frame.QA * sa.unsqueeze(-2),
        QB=frame.QB * sb.unsqueeze(-2),
        RA=frame.RA * sa.unsqueeze(-1),
        RB=frame.RB * sb.unsqueeze(-1),
        RA_inv=frame.RA_inv * sa.unsqueeze(-2),
        RB_inv=frame.RB_inv * sb.unsqueeze(-2),
        cond_A=frame.cond_A,
        cond_B=frame.cond_B,
    )


def _check_pairs(frames: StepFrames, pairs: Sequence[tuple[Tensor, Tensor]], what: str) -> None:
    """Raise ``ValueError`` unless there is one pair per module, of the module's shapes."""
    if len(pairs) != len(frames.frames):
        raise ValueError(f"{len(frames.frames)} modules but {len(pairs)} {what}")
    for group, point in zip(frames.groups, frames.points, strict=True):
        shapes = (tuple(point.A.shape[1:]), tuple(point.B.shape[1:]))
        for i in group:
            found = (tuple(pairs[i][0].shape), tuple(pairs[i][1].shape))
            if found != shapes:
                raise ValueError(
                    f"module {i}: {what} of shapes {found}, expected {shapes} (the module's "
                    "(m, r) and (n, r)); one unbatched pair per module"
                )


def tangent_coordinates(frames: StepFrames, tangents: Sequence[Tangent]) -> list[Coordinates]:
    """Orthonormal coordinates ``(X, Y)`` of each module's tangent vector, in float64.

    Implements the isometry of docs/design.md §3.3 on the tangent space of eqs. (12)-(13) of
    PRISM, with the thin-QR bases of App. A.14::

        X = (I - Pi_A) dZ QB = (I - Pi_A) dA RB.T,      Y = dZ.T QA = B (QA.T dA).T + dB RA.T

    so that ``||X||^2 + ||Y||^2 = ||dZ||_F^2``, the intrinsic norm of eq. (15). ``tangent_noise``
    (eq. 19) has coordinates ``((I - Pi_A) U, V)``.

    Args:
        frames: ``step_frames(points)`` at the point where the tangents live.
        tangents: one unbatched ``Tangent`` per module, (m, r) and (n, r), in module order.

    Returns:
        One ``Coordinates(X, Y)`` per module, (m, r) and (n, r), float64.

    Notes:
        One batched computation per group of equal shapes, O((m + n) r^2) per module; ``dZ`` is
        never formed. The coordinates depend on the factors ``(A, B)`` (their canonical QR,
        ``diag(R) > 0``), not on ``Z`` alone: encode and decode at the same broadcast factors.
    """
    _check_pairs(frames, tangents, "tangents")
    out: list[Coordinates | None] = [None] * len(tangents)
    for group, stacked, point in zip(frames.groups, frames.stacked, frames.points, strict=True):
        frame = _canonical_frame(stacked, point)
        dA = torch.stack([tangents[i].dA for i in group]).to(_F64)
        dB = torch.stack([tangents[i].dB for i in group]).to(_F64)
        alpha = frame.QA.mT @ dA  # (L, r, r) = QA.T dA
        X = (dA - frame.QA @ alpha) @ frame.RB.mT
        Y = point.B.to(_F64) @ alpha.mT + dB @ frame.RA.mT
        for j, i in enumerate(group):
            out[i] = Coordinates(X[j], Y[j])
    return [c for c in out if c is not None]


def from_coordinates(frames: StepFrames, coords: Sequence[tuple[Tensor, Tensor]]) -> list[Tangent]:
    """Tangent vectors, in factor form, from their orthonormal coordinates, in float64.

    Implements the inverse of ``tangent_coordinates``::

        dA = (I - Pi_A) X RB^{-T},      dB = Y RA^{-T},

    which represents ``dZ = (I - Pi_A) X QB.T + QA Y.T``: the identity on coordinates of a
    tangent vector, and the orthogonal projection onto them of any other ``(X, Y)`` (the part
    of ``X`` in ``span(QA)``, noise only in a secure sum, is dropped).

    Args:
        frames: ``step_frames(points)``, the same as for the encoding.
        coords: one ``(X, Y)`` per module, (m, r) and (n, r).

    Returns:
        One ``Tangent`` per module, float64 (not the minimum-norm lift: apply
        ``prism_core.manifold.min_norm_lift`` for that).

    Notes:
        O((m + n) r^2) per module, batched per group of equal shapes. White noise ``(U, V)``
        in the coordinates maps to ``tangent_noise``'s law (eq. 19).
    """
    _check_pairs(frames, coords, "coordinate pairs")
    out: list[Tangent | None] = [None] * len(coords)
    for group, stacked, point in zip(frames.groups, frames.stacked, frames.points, strict=True):
        frame = _canonical_frame(stacked, point)
        X = torch.stack([coords[i][0] for i in group]).to(_F64)
        Y = torch.stack([coords[i][1] for i in group]).to(_F64)
        dA = (X - frame.QA @ (frame.QA.mT @ X)) @ frame.RB_inv.mT
        dB = Y @ frame.RA_inv.mT
        for j, i in enumerate(group):
            out[i] = Tangent(dA[j], dB[j])
    return [t for t in out if t is not None]


def coordinate_shapes(
    points: Sequence[Point], head_like: Sequence[Tensor] = ()
) -> CoordinateShapes:
    """The shapes of a release's coordinates: ``(m, r)`` and ``(n, r)`` per module, then the
    head tensors' shapes (docs/design.md §3.3, the fixed public order)."""
    modules = tuple((tuple(p.A.shape), tuple(p.B.shape)) for p in points)
    return CoordinateShapes(modules, tuple(tuple(t.shape) for t in head_like))


def coordinate_dim(shapes: CoordinateShapes) -> int:
    """The length d of the flat vector: ``sum (m + n) r`` over modules plus the head sizes."""
    blocks = [s for pair in shapes.modules for s in pair] + list(shapes.head)
    return sum(math.prod(s) for s in blocks)


def flatten(coords: Sequence[tuple[Tensor, Tensor]], head: Sequence[Tensor] = ()) -> Tensor:
    """One 1-D float64 vector in the fixed public order of docs/design.md §3.3.

    Modules in order, each ``X`` then ``Y`` row-major, then the head tensors in order, each
    row-major. The map is an isometry: the vector's norm is the release's (intrinsic plus
    Euclidean) norm.
    """
    parts = [t.reshape(-1).to(_F64) for pair in coords for t in pair]
    parts += [t.reshape(-1).to(_F64) for t in head]
    if not parts:
        return torch.zeros(0, dtype=_F64)
    return torch.cat(parts)


def unflatten(vector: Tensor, shapes: CoordinateShapes) -> tuple[list[Coordinates], list[Tensor]]:
    """The inverse of ``flatten``: ``(coordinates per module, head tensors)``, float64.

    Raises:
        ValueError: unless ``vector`` is 1-D of length ``coordinate_dim(shapes)``.
    """
    d = coordinate_dim(shapes)
    if vector.dim() != 1 or vector.numel() != d:
        raise ValueError(
            f"expected a 1-D vector of length {d} (coordinate_dim of the shapes), got shape "
            f"{tuple(vector.shape)}"
        )
    flat = vector.to(_F64)
    offset = 0

    def take(shape: tuple[int, ...]) -> Tensor:
        nonlocal offset
        size = math.prod(shape)
        block = flat[offset : offset + size].reshape(shape)
        offset += size
        return block

    coords = [Coordinates(take(x), take(y)) for x, y in shapes.modules]
    head = [take(s) for s in shapes.head]
    return coords, head


# --- the discrete share ----------------------------------------------------------------------


def _check_max_norm(max_norm: float) -> None:
    if not (isinstance(max_norm, int | float) and math.isfinite(max_norm) and max_norm > 0):
        raise PrivacyParameterError(
            f"max_norm={max_norm!r} is invalid: the clip C must be a finite number > 0"
        )


def gamma(max_norm: float) -> float:
    """The value of one integer step: ``C / 2^SCALE_BITS`` (docs/design.md §3.3).

    Raises:
        PrivacyParameterError: for a ``max_norm`` not finite and positive.
    """
    _check_max_norm(max_norm)
    return max_norm / 2**SCALE_BITS


def discrete_sensitivity(dim: int) -> tuple[float, float]:
    """``(l2, l1)``: the sensitivity of a site's ROUNDED vector to one unit, in integer steps.

    Implements the rounding's sensitivity of Kairouz, Liu, Steinke 2021 (arXiv:2102.06387,
    Sec. 4.1) for the sum of docs/design.md §3.3::

        l2 = 2^SCALE_BITS + sqrt(d),        l1 = min(sqrt(d) 2^SCALE_BITS + d, l2^2)

    One unit's clipped contribution ``c`` has norm <= C, i.e. ``||c / gamma|| <= 2^SCALE_BITS``
    (the coordinates are an isometry). Couple the roundings of two neighbouring sums through the
    same uniforms (``round(y) = floor(y + u')``): each coordinate of their difference is within
    1 of ``c_i / gamma``, so the difference has l2 norm below ``2^SCALE_BITS + sqrt(d)`` and l1
    norm below ``||c / gamma||_1 + d <= sqrt(d) 2^SCALE_BITS + d``; an integer vector also has
    ``||v||_1 <= ||v||_2^2`` (``|k| <= k^2``). Rényi divergence is jointly quasi-convex, so the
    rounded sum costs no more than a shift of these norms (``rounded_l2_bound`` with
    ``beta=None``, ``rounded_l1_bound``).

    Args:
        dim: the vector's length d (``coordinate_dim``), >= 1.
    """
    l2 = rounded_l2_bound(l2_norm=1.0, gamma=2.0**-SCALE_BITS, dim=dim)
    return l2, rounded_l1_bound(l2_bound=l2, dim=dim)


def coordinate_bound() -> int:
    """The largest magnitude of a share's coordinate: ``UNITS_MAX 2^SCALE_BITS + 1 +
    NOISE_BOUND = 2^45 + 1`` (a coordinate of ``sum / gamma`` is at most ``2^44``, its rounding
    moves it by less than 1, and a noise draw is at most ``NOISE_BOUND``)."""
    return UNITS_MAX * 2**SCALE_BITS + 1 + NOISE_BOUND


def _check_mu_share(mu_share: float) -> None:
    ok = isinstance(mu_share, int | float) and math.isfinite(mu_share)
    if not (ok and 0 <= mu_share <= MU_SHARE_MAX):
        raise PrivacyParameterError(
            f"mu_share={mu_share!r} is invalid: a share's Skellam parameter must be finite and "
            f"in [0, MU_SHARE_MAX = 2^50] (larger draws stop being exact integers in float64); "
            "compute it with prism_core.discrete.share_mu"
        )


def _bounded_skellam(
    count: int, mu: float, *, source: NoiseSource, bound: int, max_rounds: int = DEFAULT_MAX_TRIES
) -> NDArray[np.int64]:
    """``count`` i.i.d. ``Sk(mu)`` draws, each redrawn while its magnitude exceeds ``bound``:
    the law of ``Sk(mu)`` conditioned on ``|x| <= bound``."""
    noise: NDArray[np.int64] = skellam_noise((count,), mu, source=source).numpy().copy()
    far = np.flatnonzero(np.abs(noise) > bound)
    for _ in range(max_rounds):
        if far.size == 0:
            return noise
        noise[far] = skellam_noise((far.size,), mu, source=source).numpy()
        far = far[np.abs(noise[far]) > bound]
    raise PrivacyParameterError(
        f"{far.size} Skellam draws (mu={mu!r}) stayed above {bound} in magnitude for "
        f"{max_rounds} rounds: the bound is far below the noise's scale"
    )


def encode_share(
    vector: Tensor, *, max_norm: float, mu_share: float, source: NoiseSource
) -> NDArray[np.int64]:
    """A site's integer share of a secure sum: ``round(vector / gamma) + Sk(mu_share)``.

    Implements the site's arithmetic of docs/design.md §3.3 (Kairouz, Liu, Steinke 2021,
    arXiv:2102.06387; Agarwal, Kairouz, Liu 2021, arXiv:2110.04995): non-finite entries count as
    zero; ``y = vector / gamma(max_norm)`` is randomly rounded (``randomized_round``, unbiased)
    and each coordinate gets independent ``Sk(mu_share)`` noise (``skellam_noise``), both drawn
    from ``source``.

    A noise draw of magnitude above ``NOISE_BOUND = 2^44`` is redrawn, so every coordinate is
    within ``coordinate_bound()``. This changes the law of a coordinate's noise by at most
    ``p = P(|Sk(mu)| > 2^44)`` in total variation. ``Sk(mu)`` is a limit of sums of independent
    centred variables bounded by 1 with variance ``2 mu``, so by Bernstein's inequality
    ``p <= 2 exp(-t^2 / (2 (2 mu + t / 3)))`` with ``t = 2^44``; for ``mu <= MU_SHARE_MAX =
    2^50`` that is ``<= 2 exp(-6.85e10)``, and for a whole share of d < 2^40 coordinates (or the
    sum of up to 2^16 shares) below ``exp(-6.8e10)``: negligible against any delta.

    Args:
        vector: the site's 1-D flat release (``flatten``), l2 norm <= ``UNITS_MAX * max_norm``.
        max_norm: the clip C (the sensitivity of one unit).
        mu_share: the share's Skellam parameter in [0, ``MU_SHARE_MAX``]
            (``prism_core.discrete.share_mu``; variance ``2 mu_share`` steps).
        source: a seeded ``torch.Generator`` or ``prism_core.rng.SecureRNG``.

    Returns:
        A numpy int64 array of the vector's length, every entry within ``coordinate_bound()``.

    Raises:
        ValueError: for a vector that is not 1-D or whose l2 norm (non-finite entries as zero)
            exceeds ``UNITS_MAX * max_norm``, or a coordinate past ``coordinate_bound()``.
        PrivacyParameterError: for a bad ``max_norm`` or ``mu_share``.
    """
    step = gamma(max_norm)
    _check_mu_share(mu_share)
    if vector.dim() != 1:
        raise ValueError(f"encode_share needs a 1-D vector (flatten), got {tuple(vector.shape)}")
    v = vector.detach().to(_F64)
    v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    norm = float(torch.linalg.vector_norm(v))
    limit = UNITS_MAX * max_norm
    if not norm <= limit:
        raise ValueError(
            f"the vector's l2 norm {norm:.6g} exceeds UNITS_MAX * max_norm = {limit:.6g}: a "
            f"site's clipped sum holds at most 2^24 units of norm <= max_norm={max_norm!r}; "
            "encode the clipped sum with the clip it was clipped to"
        )
    rounded = randomized_round(v, step, generator=source).cpu().numpy()
    share: NDArray[np.int64] = rounded + _bounded_skellam(
        rounded.size, float(mu_share), source=source, bound=NOISE_BOUND
    )
    largest = int(np.abs(share).max()) if share.size else 0
    if largest > coordinate_bound():
        raise ValueError(
            f"a share coordinate reached {largest}, past coordinate_bound() = "
            f"{coordinate_bound()}: the secure sum could wrap; check the vector's norm"
        )
    return share


def decode_sum(total: NDArray[np.int64], *, max_norm: float) -> Tensor:
    """The real vector of an (unmasked, centred) sum of shares: ``gamma * total``, float64.

    Implements the coordinator's decoding of docs/design.md §3.3; ``unflatten`` and
    ``from_coordinates`` then give the tangents and head sums (post-processing).

    Notes:
        int64 to float64 is exact up to 2^53 in magnitude and rounds by less than 2^-52
        relatively above (a sum of more than 256 shares at the largest norm).

    Raises:
        ValueError: unless ``total`` is a 1-D integer array.
    """
    step = gamma(max_norm)
    array = np.asarray(total)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"decode_sum needs the 1-D integer sum of the shares, got dtype {array.dtype} and "
            f"shape {array.shape}"
        )
    return torch.from_numpy(array.astype(np.float64)) * step
