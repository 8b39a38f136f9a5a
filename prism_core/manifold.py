"""Fixed-rank geometry of LoRA adapters (PRISM §3.1, §3.2, Appendix A).

One LoRA module holds ``Z = A @ B.T`` with ``A`` (m x r) and ``B`` (n x r), both of full column
rank (docs/design.md §1 maps them to peft tensors). Tangent vectors at ``Z`` are written in
factor form ``(dA, dB)`` and stand for ``dZ = dA @ B.T + A @ dB.T``.

Every function here is a pure function on tensors: it never forms an m x n matrix (except
``project_dense``, which exists for tests), it works in float32 or better for every r x r solve,
and it broadcasts over optional leading (example) dimensions of the tangent arguments. The base
point ``(A, B)`` is normally unbatched and shared by all examples.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "GRAM_COND_MAX",
    "TRANSPOSE_MAX_RANK",
    "Frame",
    "LiftMoments",
    "Point",
    "Tangent",
    "check_point",
    "lift",
    "lift_moments",
    "lift_moments_stacked",
    "lift_norm_sq",
    "lift_norm_sq_from_moments",
    "lift_norm_sq_whitened",
    "lift_whitened",
    "min_norm_lift",
    "point_frame",
    "procrustes_gauge",
    "project_dense",
    "retract",
    "tangent_displacement",
    "tangent_norm_sq",
    "tangent_to_dense",
    "transport",
    "work_dtype",
]


class Point(NamedTuple):
    """A point ``Z = A @ B.T`` on the rank-r manifold, in factor form."""

    A: Tensor
    B: Tensor


class Tangent(NamedTuple):
    """A tangent vector ``dZ = dA @ B.T + A @ dB.T`` at some point, in factor form."""

    dA: Tensor
    dB: Tensor


def work_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype PRISM computes in: the promoted input dtype, never below float32.

    Implements the numerics of App. A.14 of PRISM (r x r solves in float32 or better).
    """
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def check_point(A: Tensor, B: Tensor) -> None:
    """Validate a factor pair: shapes (m, r) and (n, r), 1 <= r <= min(m, n), finite values.

    Implements the standing assumption of PRISM §3.1 (eq. 13): ``A`` and ``B`` have full column
    rank r, so ``Z = A B.T`` lies on the rank-r manifold.

    Raises:
        ValueError: if the shapes disagree or the rank is impossible.
    """
    if A.dim() < 2 or B.dim() < 2:
        raise ValueError(f"A and B must be matrices, got shapes {tuple(A.shape)}, {tuple(B.shape)}")
    m, r = A.shape[-2:]
    n, rb = B.shape[-2:]
    if r != rb:
        raise ValueError(f"A is {m} x {r} but B is {n} x {rb}: both need the same rank r")
    if not 1 <= r <= min(m, n):
        raise ValueError(f"rank r={r} must satisfy 1 <= r <= min(m, n) = {min(m, n)}")
    if not (torch.isfinite(A).all() and torch.isfinite(B).all()):
        raise ValueError("A and B must be finite (found NaN or Inf)")


def _qr(X: Tensor) -> tuple[Tensor, Tensor]:
    """Thin QR (App. A.14): ``X = Q R`` with ``Q.T Q = I_r`` and ``R`` upper triangular."""
    Q, R = torch.linalg.qr(X, mode="reduced")
    return Q, R


class Frame(NamedTuple):
    """Thin-QR frame of a point ``(A, B)``: everything a lift, norm or noise draw needs there.

    Build it once per point with ``point_frame`` (once per logical step in training) and pass
    it to every call at that point. ``A = QA @ RA``, ``B = QB @ RB`` (App. A.14), so
    ``M^{-1} = RA_inv @ RA_inv.T`` and ``N^{-1} = RB_inv @ RB_inv.T``; they are applied as the
    two triangular factors, never formed, so that rounding grows with ``cond(R)`` and not with
    ``cond(M) = cond(R)^2`` (as with two triangular solves).

    Attributes:
        QA, QB: (m, r), (n, r) orthonormal bases of the column spaces of ``A`` and ``B``.
        RA, RB: (r, r) upper-triangular QR factors.
        RA_inv, RB_inv: (r, r) their inverses (upper triangular).
        cond_A, cond_B: () float64 2-norm condition numbers of ``RA`` and ``RB``.
    """

    QA: Tensor
    QB: Tensor
    RA: Tensor
    RB: Tensor
    RA_inv: Tensor
    RB_inv: Tensor
    cond_A: Tensor
    cond_B: Tensor


def _triangular_inverse(R: Tensor) -> Tensor:
    """``R^{-1}`` of an upper-triangular r x r ``R``, solved in float64 and cast back."""
    R64 = R.to(torch.float64)
    eye = torch.eye(R.shape[-1], dtype=torch.float64, device=R.device).expand_as(R64)
    inv: Tensor = torch.linalg.solve_triangular(R64, eye, upper=True)
    return inv


def point_frame(A: Tensor, B: Tensor) -> Frame:
    """The thin-QR frame of ``Z = A @ B.T`` (App. A.14 of PRISM), in the work dtype.

    Implements the factorisations behind eqs. (14), (15) and (19) of PRISM: ``Pi_A = QA QA.T``,
    ``M^+ = M^{-1} = RA^{-1} RA^{-T}`` and the same for ``B`` (full column rank, eq. 13).

    Args:
        A: (..., m, r) left factor; B: (..., n, r) right factor (optional common leading
            dimensions, e.g. a stack of modules of equal shape).

    Returns:
        A ``Frame`` in ``work_dtype(A, B)``.

    Notes:
        The triangular inverses are solved in float64 from the QR factors (no damping: the
        factors have full column rank, see ``check_point``; a singular ``R`` gives non-finite
        values) and cast to the work dtype, so lifts are plain GEMMs. Cost
        O((m + n) r^2 + r^3).
    """
    dtype = work_dtype(A, B)
    QA, RA = _qr(A.to(dtype))
    QB, RB = _qr(B.to(dtype))
    return Frame(
        QA=QA,
        QB=QB,
        RA=RA,
        RB=RB,
        RA_inv=_triangular_inverse(RA).to(dtype),
        RB_inv=_triangular_inverse(RB).to(dtype),
        cond_A=torch.linalg.cond(RA.to(torch.float64)),
        cond_B=torch.linalg.cond(RB.to(torch.float64)),
    )


def _project_cols(Q: Tensor, X: Tensor) -> Tensor:
    """``Pi X = Q (Q.T X)`` for an orthonormal basis ``Q``, per example of ``X`` (..., m, k).

    With one (m, r) basis and batched ``X``, the examples are laid side by side as one
    (m, b k) matrix: two plain GEMMs instead of many small batched ones.
    """
    if Q.dim() == 2 and X.dim() > 2:
        cols = X.movedim(-2, 0)
        flat = cols.reshape(Q.shape[0], -1)
        return (Q @ (Q.mT @ flat)).reshape(cols.shape).movedim(0, -2)
    return Q @ (Q.mT @ X)


def lift(A: Tensor, B: Tensor, gA: Tensor, gB: Tensor, *, frame: Frame | None = None) -> Tangent:
    """Canonical horizontal lift of the tangent projection of a gradient.

    Implements eq. (14) of PRISM::

        dA = gA N^+ - 1/2 Pi_A (gA N^+),    dB = gB M^+ - 1/2 Pi_B (gB M^+),

    so that ``dA @ B.T + A @ dB.T = P_{A,B}(G)`` (eq. 13) when ``gA = G @ B`` and
    ``gB = G.T @ A`` are the factor gradients of a loss with gradient ``G`` in ``Z``.

    Args:
        A: (m, r) left factor (peft ``lora_B.weight``).
        B: (n, r) right factor (peft ``lora_A.weight.T``).
        gA: (..., m, r) gradient with respect to ``A``.
        gB: (..., n, r) gradient with respect to ``B``.
        frame: ``point_frame(A, B)`` if already computed (e.g. once per step); else built here.

    Returns:
        ``Tangent(dA, dB)`` with the shapes of ``gA`` and ``gB``.

    Notes:
        ``N^+ = RB^{-1} RB^{-T}`` and ``M^+`` are applied as two GEMMs with the frame's
        triangular inverses (thin QR, App. A.14, float64 then the work dtype);
        ``Pi_A X = QA (QA.T X)``. Cost O((m + n) r^2) per example; no m x n matrix is formed.
        The lift is linear in ``(gA, gB)``, so the lift of a (clipped) sum equals the sum of the
        lifts.
    """
    dtype = work_dtype(A, B, gA, gB)
    if frame is None:
        frame = point_frame(A, B)
    gA, gB = gA.to(dtype), gB.to(dtype)
    RA_inv, RB_inv = frame.RA_inv.to(dtype), frame.RB_inv.to(dtype)
    return lift_whitened(frame, torch.matmul(gA, RB_inv), torch.matmul(gB, RA_inv))


def lift_whitened(frame: Frame, a: Tensor, c: Tensor) -> Tangent:
    """``lift`` of the gradients whose whitened forms are ``a = gA RB^{-1}``, ``c = gB RA^{-1}``.

    Implements eq. (14) of PRISM from the whitened gradients: ``gA N^+ = a RB^{-T}``, so
    ``dA = a RB^{-T} - 1/2 Pi_A (a RB^{-T})`` and likewise ``dB``. ``lift`` whitens and calls
    it; a caller that already holds whitened gradients (``clip_and_sum_whitened``) skips the
    round trip through the raw ones.

    Args:
        frame: ``point_frame(A, B)`` (of one module, or stacked with the gradients' leading
            module dimension).
        a: (..., m, r) and c: (..., n, r) whitened factor gradients.

    Returns:
        ``Tangent(dA, dB)`` with the shapes of ``a`` and ``c``, in their work dtype.
    """
    dtype = work_dtype(frame.QA, a, c)
    a, c = a.to(dtype), c.to(dtype)
    xA = torch.matmul(a, frame.RB_inv.to(dtype).mT)  # gA N^{-1}
    xB = torch.matmul(c, frame.RA_inv.to(dtype).mT)  # gB M^{-1}
    dA = xA - 0.5 * _project_cols(frame.QA.to(dtype), xA)
    dB = xB - 0.5 * _project_cols(frame.QB.to(dtype), xB)
    return Tangent(dA, dB)


class LiftMoments(NamedTuple):
    """Per-example r x r moments of whitened factor gradients: all a lift's norm depends on.

    With ``a = gA RB^{-1}`` (m x r) and ``c = gB RA^{-1}`` (n x r): ``gram_a = a.T a``,
    ``coord_a = a.T QA`` (so ``alpha = QA.T a = coord_a.T``), ``gram_c = c.T c`` and
    ``coord_c = c.T QB``; each of shape (..., r, r) for gradients of shape (..., m, r).
    """

    gram_a: Tensor
    coord_a: Tensor
    gram_c: Tensor
    coord_c: Tensor


GRAM_COND_MAX = 10.0
"""Largest ``cond(R)`` of a factor for which ``lift_moments`` takes the moments of the raw
gradient ``g`` and whitens them afterwards in r x r: one GEMM pass fewer, but the
float32 rounding of the norms grows like ``cond(R)^2 eps`` (below 1e-5 here). Above it the
gradient is whitened first, and the rounding grows like ``cond(R) eps`` only."""

TRANSPOSE_MAX_RANK = 8
"""Largest r for which a row-major (..., m, r) gradient is copied to the (..., r, m) layout
before its raw-moment GEMMs: for r <= 8 the copy costs less than the strided GEMMs it saves;
for larger r the GEMMs on the original layout are faster."""


def _coords(rows: Tensor, Q: Tensor) -> Tensor:
    """``rows @ Q`` for contiguous ``rows`` (..., r, m): one 2-D GEMM per module over all its
    examples. ``Q`` is (m, k), or (L, 1, m, k) per module for ``rows`` of shape (L, b, r, m)."""
    m, k = Q.shape[-2:]
    if Q.dim() == 2:
        return (rows.reshape(-1, m) @ Q).reshape(*rows.shape[:-1], k)
    modules = Q.shape[0]
    flat = rows.reshape(modules, -1, m) @ Q.reshape(modules, m, k)
    return flat.reshape(*rows.shape[:-1], k)


def _raw_moments(g: Tensor, Q: Tensor) -> tuple[Tensor, Tensor]:
    """``(g.T g, g.T Q)`` per example of ``g`` (..., m, r); ``Q`` as in ``_coords``."""
    rows = g.mT  # (..., r, m)
    if not rows.is_contiguous() and g.shape[-1] <= TRANSPOSE_MAX_RANK:
        rows = rows.contiguous()
    if rows.is_contiguous():  # the Gram, then one 2-D GEMM over all examples
        return rows @ rows.mT, _coords(rows, Q)
    return rows @ g, (Q.mT @ g).mT  # batched GEMMs on g's own layout, no copy


def _whitened_moments(g: Tensor, R_inv: Tensor, Q: Tensor, cond: float) -> tuple[Tensor, Tensor]:
    """``(w.T w, w.T Q)`` per example for ``w = g R^{-1}``, ``g`` (..., m, r), ``Q`` (m, r).

    For ``cond(R) <= GRAM_COND_MAX`` from the raw moments (``R^{-T} (g.T g) R^{-1}``, whose
    rounding, like the raw Gram's, is of order ``cond(R)^2 eps``); else ``w.T = R^{-T} g.T`` is
    formed first, one batched GEMM that also leaves it as a contiguous (..., r, m) tensor, the
    layout in which the two moment GEMMs are fastest. In ``g``'s dtype. For L modules at once
    ``g`` is (L, b, m, r), ``R_inv`` (L, 1, r, r), ``Q`` (L, 1, m, r) and ``cond`` the largest.
    """
    if cond <= GRAM_COND_MAX:
        gram, coords = _raw_moments(g, Q)
        return R_inv.mT @ gram @ R_inv, R_inv.mT @ coords
    rows = torch.matmul(R_inv.mT, g.mT)  # (..., r, m) = (g R^{-1}).T
    return rows @ rows.mT, _coords(rows, Q)


def lift_moments(frame: Frame, gA: Tensor, gB: Tensor) -> LiftMoments:
    """The per-example r x r moments that ``lift_norm_sq_from_moments`` turns into norms.

    Implements the O((m + n) r^2) part of eqs. (14)-(15) of PRISM (see ``lift_norm_sq``).

    Args:
        frame: ``point_frame(A, B)`` of ONE module (``QA`` of shape (m, r)).
        gA: (..., m, r) and gB: (..., n, r) factor gradients.

    Returns:
        ``LiftMoments`` of shape (..., r, r) each, in the work dtype.

    Notes:
        Two GEMM passes over each gradient (r x r Gram and coordinates in the column-space
        basis), whitened afterwards in r x r when the factor is well conditioned
        (``cond(R) <= GRAM_COND_MAX``, the usual case: retraction balances the factors); a
        third pass whitens the gradient first when it is not, so that float32 rounding does
        not grow like ``cond(R)^2``.
    """
    if frame.QA.dim() != 2:
        raise ValueError(
            f"lift_moments needs the frame of one module (QA of shape (m, r)), got QA of shape "
            f"{tuple(frame.QA.shape)}: index a stacked frame first"
        )
    dtype = work_dtype(frame.QA, gA, gB)
    gram_a, coord_a = _whitened_moments(
        gA.to(dtype), frame.RB_inv.to(dtype), frame.QA, float(frame.cond_B)
    )
    gram_c, coord_c = _whitened_moments(
        gB.to(dtype), frame.RA_inv.to(dtype), frame.QB, float(frame.cond_A)
    )
    return LiftMoments(gram_a, coord_a, gram_c, coord_c)


def lift_moments_stacked(frame: Frame, gA: Tensor, gB: Tensor) -> LiftMoments:
    """``lift_moments`` of L modules of equal shape at once: the same moments, fewer calls.

    Args:
        frame: a stacked ``point_frame`` (``QA`` of shape (L, m, r)), e.g. a slice of
            ``StepFrames.stacked``.
        gA: (L, b, m, r) and gB: (L, b, n, r) factor gradients, module by module.

    Returns:
        ``LiftMoments`` of shape (L, b, r, r) each, in the work dtype.

    Notes:
        One moment strategy for all L modules, the one the worst-conditioned needs (the
        whitened-first pass whenever any ``cond(R) > GRAM_COND_MAX``): both give the same
        moments, the second with less rounding, so a module never gets a worse one than alone.
    """
    if frame.QA.dim() != 3 or gA.dim() != 4 or gA.shape[0] != frame.QA.shape[0]:
        raise ValueError(
            f"lift_moments_stacked needs a stacked frame (QA of shape (L, m, r)) and gradients "
            f"(L, b, m, r); got QA {tuple(frame.QA.shape)} and gA {tuple(gA.shape)}"
        )
    dtype = work_dtype(frame.QA, gA, gB)

    def per_module(t: Tensor) -> Tensor:  # (L, x, y) -> (L, 1, x, y), broadcast over examples
        return t.to(dtype).unsqueeze(1)

    gram_a, coord_a = _whitened_moments(
        gA.to(dtype), per_module(frame.RB_inv), per_module(frame.QA), float(frame.cond_B.max())
    )
    gram_c, coord_c = _whitened_moments(
        gB.to(dtype), per_module(frame.RA_inv), per_module(frame.QB), float(frame.cond_A.max())
    )
    return LiftMoments(gram_a, coord_a, gram_c, coord_c)


def lift_norm_sq_from_moments(moments: LiftMoments) -> Tensor:
    """Squared intrinsic norms of lifts from their whitened r x r moments (``lift_norm_sq``).

    Implements eqs. (14)-(15) of PRISM, r x r part, in float64:
    ``(tr(a.T a) - ||alpha||^2) + (tr(c.T c) - ||beta||^2) + 1/4 ||alpha + beta.T||^2``.
    Broadcasts over leading dimensions (e.g. a stack of modules and examples).

    Returns:
        Tensor of the leading shape, in the moments' dtype, clamped at 0.
    """
    gram_a, coord_a, gram_c, coord_c = moments
    a_sq = gram_a.to(torch.float64).diagonal(dim1=-2, dim2=-1).sum(-1)
    c_sq = gram_c.to(torch.float64).diagonal(dim1=-2, dim2=-1).sum(-1)
    return _norm_sq(a_sq, coord_a, c_sq, coord_c).to(gram_a.dtype)


def _norm_sq(a_sq: Tensor, coord_a: Tensor, c_sq: Tensor, coord_c: Tensor) -> Tensor:
    """Eq. (15) in float64 from ``||a||^2``, ``a.T QA`` and the same for ``c``, clamped at 0."""
    f64 = torch.float64
    alpha, beta = coord_a.to(f64).mT, coord_c.to(f64).mT  # QA.T a, QB.T c
    alpha_sq = alpha.square().sum(dim=(-2, -1))
    beta_sq = beta.square().sum(dim=(-2, -1))
    core_sq = (alpha + beta.mT).square().sum(dim=(-2, -1))
    total = (a_sq.to(f64) - alpha_sq) + (c_sq.to(f64) - beta_sq) + 0.25 * core_sq
    return total.clamp_min(0.0)


def lift_norm_sq_whitened(frame: Frame, rows_a: Tensor, rows_c: Tensor) -> Tensor:
    """Squared intrinsic norms of lifts from whitened gradient rows (``lift_norm_sq``).

    Implements eqs. (14)-(15) of PRISM for gradients already whitened and laid out row-wise:
    ``rows_a = a.T = (gA RB^{-1}).T`` and ``rows_c = (gB RA^{-1}).T``. ``||a||^2`` is one pass
    of squares over the rows and ``alpha = QA.T a`` one GEMM over all examples; no r x r Gram
    of each example is formed (the norm needs only its trace).

    Args:
        frame: a stacked ``point_frame`` (``QA`` of shape (L, m, r)).
        rows_a: (L, b, r, m) and rows_c: (L, b, r, n), contiguous.

    Returns:
        (L, b) squared norms in the rows' work dtype, clamped at 0 (non-finite where a row is).
    """
    if frame.QA.dim() != 3 or rows_a.dim() != 4 or rows_a.shape[0] != frame.QA.shape[0]:
        raise ValueError(
            f"lift_norm_sq_whitened needs a stacked frame (QA of shape (L, m, r)) and rows "
            f"(L, b, r, m); got QA {tuple(frame.QA.shape)} and rows {tuple(rows_a.shape)}"
        )
    dtype = work_dtype(frame.QA, rows_a, rows_c)
    rows_a, rows_c = rows_a.to(dtype).contiguous(), rows_c.to(dtype).contiguous()
    coord_a = _coords(rows_a, frame.QA.to(dtype).unsqueeze(1))
    coord_c = _coords(rows_c, frame.QB.to(dtype).unsqueeze(1))
    a_sq = torch.linalg.vector_norm(rows_a, dim=(-2, -1)).square()  # no (L, b, r, m) temporary
    c_sq = torch.linalg.vector_norm(rows_c, dim=(-2, -1)).square()
    return _norm_sq(a_sq, coord_a, c_sq, coord_c).to(dtype)


def lift_norm_sq(frame: Frame, gA: Tensor, gB: Tensor) -> Tensor:
    """Squared intrinsic norm of ``lift(A, B, gA, gB)``, without forming the lift.

    Implements eqs. (14)-(15) of PRISM fused. With ``a = gA RB^{-1}``, ``c = gB RA^{-1}`` and
    their r x r coordinates ``alpha = QA.T a``, ``beta = QB.T c``, the lift's tangent vector is
    ``(I - Pi_A) a QB.T + QA c.T (I - Pi_B) + 1/2 QA (alpha + beta.T) QB.T``, three mutually
    orthogonal blocks, so::

        ||dZ||^2 = (||a||^2 - ||alpha||^2) + (||c||^2 - ||beta||^2) + 1/4 ||alpha + beta.T||^2

    with every term read off the r x r moments of ``a`` and ``c``. This equals
    ``tangent_norm_sq`` of the lift for any ``(gA, gB)``, not only for ``gA = G B``,
    ``gB = G.T A``.

    Args:
        frame: ``point_frame(A, B)`` of one module.
        gA: (..., m, r) and gB: (..., n, r) factor gradients (e.g. one per example).

    Returns:
        Tensor of shape ``(...)`` in the work dtype.

    Notes:
        ``lift_moments`` (work dtype) then ``lift_norm_sq_from_moments`` (float64). The
        differences ``||a||^2 - ||alpha||^2 = ||(I - Pi_A) a||^2 >= 0`` lose absolute
        accuracy of about ``eps * ||a||^2`` when ``gA`` lies almost in the span of ``A`` (the
        order of the cross term of eq. 15 in ``tangent_norm_sq``); the result is clamped at 0.
        Cost O((m + n) r^2); no lift and no m x n matrix is formed.
    """
    return lift_norm_sq_from_moments(lift_moments(frame, gA, gB))


def tangent_norm_sq(
    A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, *, frame: Frame | None = None
) -> Tensor:
    """Squared Frobenius norm of ``dA @ B.T + A @ dB.T`` from r x r products.

    Implements eq. (15) of PRISM (App. A.10)::

        ||dZ||_F^2 = tr(dA.T dA N) + tr(dB.T dB M) + 2 tr((A.T dA)(B.T dB)).

    Args:
        A: (m, r); B: (n, r); dA: (..., m, r); dB: (..., n, r).
        frame: ``point_frame(A, B)`` if already computed; else the QR factors are built here.

    Returns:
        Tensor of shape ``(...)`` (a 0-dim tensor for unbatched input).

    Notes:
        The first two terms are evaluated as ``||dA R_B.T||^2`` and ``||dB R_A.T||^2`` with the
        triangular QR factors, which equals the trace form and stays non-negative in floating
        point. Cost O((m + n) r^2) per example.
    """
    dtype = work_dtype(A, B, dA, dB)
    A, B, dA, dB = (t.to(dtype) for t in (A, B, dA, dB))
    if frame is None:
        RA = torch.linalg.qr(A, mode="r")[1]
        RB = torch.linalg.qr(B, mode="r")[1]
    else:
        RA, RB = frame.RA.to(dtype), frame.RB.to(dtype)
    term_a = (dA @ RB.mT).square().sum(dim=(-2, -1))
    term_b = (dB @ RA.mT).square().sum(dim=(-2, -1))
    cross = ((A.mT @ dA) * (dB.mT @ B)).sum(dim=(-2, -1))  # tr((A.T dA)(B.T dB))
    total: Tensor = term_a + term_b + 2.0 * cross
    return total


def tangent_to_dense(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> Tensor:
    """``dA @ B.T + A @ dB.T`` as a dense (..., m, n) matrix. For tests and diagnostics only.

    Implements the tangent-space parametrisation of eq. (12)/(36) of PRISM (App. A.6).
    """
    return dA @ B.mT + A @ dB.mT


def project_dense(A: Tensor, B: Tensor, G: Tensor) -> Tensor:
    """Dense orthogonal projection onto the tangent space at ``Z = A @ B.T``. Tests only.

    Implements eq. (13) of PRISM: ``P_{A,B}(G) = Pi_A G + G Pi_B - Pi_A G Pi_B``.

    Args:
        A: (m, r); B: (n, r); G: (..., m, n).

    Notes:
        Forms m x n matrices: use ``lift`` in any code path that runs during training.
    """
    dtype = work_dtype(A, B, G)
    A, B, G = (t.to(dtype) for t in (A, B, G))
    QA, _ = _qr(A)
    QB, _ = _qr(B)
    PaG = QA @ (QA.mT @ G)
    GPb = (G @ QB) @ QB.mT
    PaGPb = QA @ ((QA.mT @ G @ QB) @ QB.mT)
    return PaG + GPb - PaGPb


def tangent_displacement(A: Tensor, B: Tensor, A1: Tensor, B1: Tensor) -> Tangent:
    """Tangent update at ``(A, B)`` that moves toward ``Z1 = A1 @ B1.T``.

    Implements eq. (14) applied to ``G = Z1 - Z`` (the displacement a federated site sends,
    docs/design.md §3): the lift of ``P_{A,B}(A1 B1.T - A B.T)``. The factor gradients of that
    ``G`` are ``G B = A1 (B1.T B) - A N`` and ``G.T A = B1 (A1.T A) - B M``, so only r x r
    products are needed.

    Args:
        A, B: (m, r), (n, r) the base point (the round's global factors).
        A1, B1: (..., m, r), (..., n, r) the end point(s).

    Returns:
        ``Tangent(dA, dB)`` at ``(A, B)``.

    Notes:
        The normal component of ``Z1 - Z`` is second order in the step and is dropped. Cost
        O((m + n) r^2); no m x n matrix is formed.
    """
    dtype = work_dtype(A, B, A1, B1)
    A, B, A1, B1 = (t.to(dtype) for t in (A, B, A1, B1))
    gA = A1 @ (B1.mT @ B) - A @ (B.mT @ B)
    gB = B1 @ (A1.mT @ A) - B @ (A.mT @ A)
    return lift(A, B, gA, gB)


def transport(A: Tensor, B: Tensor, A1: Tensor, B1: Tensor, dA: Tensor, dB: Tensor) -> Tangent:
    """Vector transport by projection of a tangent vector at ``(A, B)`` to ``(A1, B1)``.

    Implements ``P_{A1,B1}(dA B.T + A dB.T)`` lifted at the new point (eqs. 13-14 of PRISM
    applied to the dense tangent vector; the projection transport of App. A on fixed-rank
    manifolds, as in pymanopt's ``FixedRankEmbedded.transport``). The factor gradients of
    ``G = dZ`` at the new point are ``G B1 = dA (B.T B1) + A (dB.T B1)`` and
    ``G.T A1 = B (dA.T A1) + dB (A.T A1)``: only r x r products.

    Args:
        A, B: (m, r), (n, r) the point where ``(dA, dB)`` lives.
        A1, B1: (m, r), (n, r) the new point.
        dA, dB: (m, r), (n, r) the tangent vector.

    Returns:
        ``Tangent`` at ``(A1, B1)``; the identity (up to the lift's gauge) when the points agree.

    Notes:
        Cost O((m + n) r^2); no m x n matrix is formed. Used to carry a server momentum from
        one round's base point to the next.
    """
    dtype = work_dtype(A, B, A1, B1, dA, dB)
    A, B, A1, B1, dA, dB = (t.to(dtype) for t in (A, B, A1, B1, dA, dB))
    gA = dA @ (B.mT @ B1) + A @ (dB.mT @ B1)
    gB = B @ (dA.mT @ A1) + dB @ (A.mT @ A1)
    return lift(A1, B1, gA, gB)


def min_norm_lift(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> Tangent:
    """Minimum-factor-norm representative of the tangent vector ``dA B.T + A dB.T``.

    Implements App. A.7 of PRISM: among ``(dA + A W, dB - B W.T)`` (all of which represent
    the same ``dZ``, eq. 38) pick the one minimising ``||dA'||_F^2 + ||dB'||_F^2``. The
    optimality condition is the r x r Sylvester equation (eq. 39)::

        M W + W N = dB.T B - A.T dA,

    solved exactly in the eigenbases of ``M = A.T A`` and ``N = B.T B`` (both SPD).

    Args:
        A: (m, r); B: (n, r); dA: (..., m, r); dB: (..., n, r).

    Returns:
        ``Tangent(dA', dB')`` representing the same tangent vector.

    Notes:
        Float32 or better; cost O((m + n) r^2 + r^3).
    """
    dtype = work_dtype(A, B, dA, dB)
    A, B, dA, dB = (t.to(dtype) for t in (A, B, dA, dB))
    mu, UM = torch.linalg.eigh(A.mT @ A)
    nu, UN = torch.linalg.eigh(B.mT @ B)
    rhs = dB.mT @ B - A.mT @ dA
    rhs_eig = UM.mT @ rhs @ UN
    denom = mu.unsqueeze(-1) + nu.unsqueeze(-2)  # mu_i + nu_j > 0 for full-rank factors
    W = UM @ (rhs_eig / denom) @ UN.mT
    return Tangent(dA + A @ W, dB - B @ W.mT)


def procrustes_gauge(source: Point, target: Point) -> Tensor:
    """Orthogonal ``O`` minimising ``||A_s O - A_t||^2 + ||B_s O - B_t||^2``.

    Implements the Procrustes alignment of App. A.24 of PRISM: ``O`` is the polar factor of
    ``A_s.T A_t + B_s.T B_t``, and ``(A_s O, B_s O)`` is a gauge transform of ``source``.
    """
    dtype = work_dtype(source.A, target.A)
    cross = source.A.to(dtype).mT @ target.A.to(dtype) + source.B.to(dtype).mT @ target.B.to(dtype)
    P, _, Qh = torch.linalg.svd(cross)
    O: Tensor = P @ Qh
    return O


def retract(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, step: float) -> Point:
    """Rank-r truncated-SVD retraction of ``Z + step * (dA B.T + A dB.T)``.

    Implements eq. (22) and Prop. 3.2 of PRISM. With ``X = [A, dA]`` and ``Y = [B, dB]``,
    ``Z + t dZ = X K Y.T`` exactly, where ``K = [[I, t I], [t I, 0]]`` (no ``t^2 dA dB.T``
    term). Thin QR of ``X`` and ``Y`` and the SVD of the 2r x 2r core ``R_X K R_Y.T`` give the
    best rank-r approximation (Eckart-Young, App. A.20).

    The new factors are balanced (``sqrt`` of the singular values on both sides) and then
    Procrustes-aligned to ``(A, B)``: the orthogonal ``O`` minimising
    ``||A' O - A||^2 + ||B' O - B||^2`` is applied to both, a gauge transform (App. A.24), so
    factor-space optimizer moments stay meaningful across steps.

    Args:
        A, B: (m, r), (n, r) current factors (unbatched).
        dA, dB: (m, r), (n, r) tangent direction.
        step: signed step length ``t`` (use ``-lr`` for a descent step).

    Returns:
        ``Point(A_new, B_new)`` in the work dtype.

    Notes:
        Cost O((m + n) r^2 + r^3). The result has exact rank r unless the step annihilates a
        singular direction, which has probability zero under DP noise.
    """
    dtype = work_dtype(A, B, dA, dB)
    A, B, dA, dB = (t.to(dtype) for t in (A, B, dA, dB))
    r = A.shape[-1]
    QX, RX = _qr(torch.cat([A, dA], dim=-1))
    QY, RY = _qr(torch.cat([B, dB], dim=-1))
    eye = torch.eye(r, dtype=dtype, device=A.device)
    K = torch.cat(
        [torch.cat([eye, step * eye], dim=-1), torch.cat([step * eye, 0.0 * eye], dim=-1)],
        dim=-2,
    )
    core = RX @ K @ RY.mT
    U, S, Vh = torch.linalg.svd(core)
    root = S[..., :r].clamp_min(0.0).sqrt()
    A_new = (QX @ U[..., :r]) * root.unsqueeze(-2)
    B_new = (QY @ Vh[..., :r, :].mT) * root.unsqueeze(-2)
    O = procrustes_gauge(Point(A_new, B_new), Point(A, B))
    return Point(A_new @ O, B_new @ O)
