"""The DP boundary of PRISM: global intrinsic clipping and tangent Gaussian noise (§3.2).

Per logical step (Algorithm 1, lines 3-12)::

    lifts of every example and module  --clip_and_sum-->  ClippedSum  (may span micro-batches)
    ClippedSum  --privatize-->  DP tangent update per module  +  PrivacyEvent

The clip is global: one coefficient per example over every module (eq. 16) and any Euclidean
tensors (a classification head), or, with ``euclidean_max_norm``, a split of the same
sensitivity C: the tangents clipped to ``sqrt(C^2 - C_e^2)`` and the Euclidean part to ``C_e``
(``split_max_norm``); ``privatize`` then uses C.

``privatize`` divides signal and noise by the EXPECTED batch size ``b = q * N``, never by the
realised Poisson batch size (dividing by the realised size leaks it). The ``PrivacyEvent``
(``prism_core.records``) holds only public mechanism parameters; accounting
(``prism_core.accounting``) composes these events into epsilon and knows nothing about tensors.

What is released: the Gaussian mechanism protects the tangent vector
``dZ = dA B.T + A dB.T`` (eq. 18), not the factor pair that represents it. The sum of lifts
(eq. 14) keeps ``1/2 Pi_A (g_A N^+)`` in ``Pi_A dA`` while the sampler's noise (eq. 19) puts
nothing there, so the factor pair ``(sum + noise) / b`` carries an un-noised component. The
release of ``privatize`` is therefore the minimum-norm lift (App. A.7) of the noisy ``dZ``: a
function of ``dZ`` alone, and every part of it (``Pi_A dA`` and the rest) is noised.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, ParamSpec, TypeVar

import torch
from torch import Tensor

from prism_core.errors import PrivacyParameterError
from prism_core.manifold import (
    TRANSPOSE_MAX_RANK,
    Frame,
    Point,
    Tangent,
    lift,
    lift_moments_stacked,
    lift_norm_sq_from_moments,
    lift_norm_sq_whitened,
    lift_whitened,
    min_norm_lift,
    point_frame,
    retract,
    tangent_norm_sq,
    work_dtype,
)
from prism_core.records import ADJACENCY, PrivacyEvent
from prism_core.rng import NoiseSource, standard_normal

__all__ = [
    "ADJACENCY",
    "ClippedSum",
    "PrivacyEvent",
    "PrivateStep",
    "StepFrames",
    "clip_and_sum",
    "clip_and_sum_grads",
    "clip_and_sum_whitened",
    "clip_coefficients",
    "dp_tangent_update",
    "dropped_together",
    "empty_sum",
    "finite_rows",
    "finite_values",
    "per_example_norms_sq",
    "privatize",
    "retract_modules",
    "split_max_norm",
    "step_frames",
    "tangent_noise",
    "validate_noise_parameters",
    "whiten_rows",
    "without_autocast",
]


_P = ParamSpec("_P")
_R = TypeVar("_R")


def without_autocast(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` with autocast off: the clip's norms, coefficients and sums, and the noise,
    are computed in the dtypes this module chooses (float32 or better), never in the bfloat16
    of a caller's autocast region, whose rounding (about 4e-3) would exceed the clip's safety
    factor ``CLIP_MARGIN_ULPS``."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast("cpu", enabled=False))
            if torch.cuda.is_available():
                stack.enter_context(torch.autocast("cuda", enabled=False))
            return fn(*args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class ClippedSum:
    """Running sum of clipped per-example lifts, one ``Tangent`` per module.

    ``euclidean`` holds the clipped sums of any other trainable tensors (e.g. a classification
    head) that share the global clip. ``count`` (realised examples) and ``clipped`` (examples
    with a clip coefficient ``< 1``, tangent or Euclidean) are private diagnostics: they are
    data-dependent and must never leave the site un-noised.
    """

    sums: tuple[Tangent, ...]
    count: int
    clipped: int
    euclidean: tuple[Tensor, ...] = ()


class PrivateStep(NamedTuple):
    """Output of one privatized step: DP tangent updates, DP Euclidean updates, the record."""

    tangents: list[Tangent]
    euclidean: list[Tensor]
    record: PrivacyEvent


def empty_sum(points: Sequence[Point], euclidean_like: Sequence[Tensor] = ()) -> ClippedSum:
    """A zero ``ClippedSum``: the start of a step, or a Poisson draw of zero examples.

    Implements the empty sum of eq. (17): the noise is still added, divided by b.

    ``euclidean_like`` are tensors (e.g. head parameters) whose shapes the Euclidean sums take.
    """
    sums = tuple(
        Tangent(
            torch.zeros_like(p.A, dtype=work_dtype(p.A)),
            torch.zeros_like(p.B, dtype=work_dtype(p.B)),
        )
        for p in points
    )
    extra = tuple(torch.zeros_like(t, dtype=work_dtype(t)) for t in euclidean_like)
    return ClippedSum(sums, 0, 0, extra)


def validate_noise_parameters(
    *, noise_multiplier: float, max_norm: float, expected_batch_size: float, sample_rate: float
) -> None:
    """Raise ``PrivacyParameterError`` unless sigma >= 0, C > 0, b > 0 and 0 < q <= 1.

    Implements the parameter ranges of eqs. (16)-(18) and Thm 3.4 of PRISM.
    """
    checks = (
        ("noise_multiplier", noise_multiplier, noise_multiplier >= 0, ">= 0"),
        ("max_norm", max_norm, max_norm > 0, "> 0"),
        ("expected_batch_size", expected_batch_size, expected_batch_size > 0, "> 0"),
        ("sample_rate", sample_rate, 0 < sample_rate <= 1, "in (0, 1]"),
    )
    for name, value, ok, allowed in checks:
        if not (ok and math.isfinite(value)):
            raise PrivacyParameterError(
                f"{name}={value!r} is invalid: it must be finite and {allowed}"
            )


CLIP_MARGIN_ULPS = 1024
"""The clip aims at ``C (1 - CLIP_MARGIN_ULPS eps)`` (eps of the norms' dtype: 1.2e-4 in
float32, 2.3e-13 in float64), a safety factor above the rounding of a norm computed from
float32 moments at a point of condition number up to ``prism_runtime.ranges.FACTOR_COND_MAX``
(about ``cond eps``), so that rounding cannot carry a clipped contribution above C."""

ALPHA_MIN = 2.0**-100
"""A clip coefficient below this counts as 0: the example's contribution is dropped, so no
coefficient is near float32's subnormal range, where ``C / s`` would lose its precision."""


def finite_rows(tensors: Sequence[Tensor], *, leading: int = 1) -> Tensor:
    """Which examples have finite values in every tensor: (b,) bool.

    Each tensor has its examples along dimension ``leading - 1`` after ``leading - 1`` module
    dimensions (``leading=1``: (b, ...); ``leading=2``: (L, b, ...)). An example counts as
    non-finite when the sum of its entries is (an infinite or NaN entry, or finite entries so
    large that their float sum overflows): either way its contribution is dropped.
    """
    valid: Tensor | None = None
    for t in tensors:
        sums = t.sum(dim=tuple(range(leading, t.dim()))) if t.dim() > leading else t
        ok = torch.isfinite(sums)
        for _ in range(leading - 1):
            ok = ok.all(0)
        valid = ok if valid is None else valid & ok
    if valid is None:
        raise ValueError("finite_rows needs at least one tensor")
    return valid


def clip_coefficients(
    norms_sq: Sequence[Tensor] | Tensor, max_norm: float, *, valid: Tensor | None = None
) -> Tensor:
    """Per-example global clip coefficients ``alpha_i = min(1, C / s_i)``; 0 for a contribution
    that is not finite.

    Implements eq. (16) of PRISM: ``s_i = sqrt(sum_l ||dZ_{i,l}||_F^2)`` over ALL modules, so
    one coefficient per example bounds the whole LoRA update by C.

    Args:
        norms_sq: a list with one (b,) tensor per module, or a stacked (L, b) tensor.
        max_norm: clip threshold C > 0.
        valid: (b,) bool, False for an example whose inputs are not finite (``finite_rows``).

    Returns:
        (b,) tensor of coefficients in [0, 1], in the norms' work dtype.

    Notes:
        ``s_i`` is summed and divided in float64 (no overflow of a sum of squares, no rounding
        of ``C / s_i`` above C) with the safety factor ``CLIP_MARGIN_ULPS``. An example whose
        ``s_i`` is not finite, or is not ``valid``, or whose coefficient is below ``ALPHA_MIN``
        gets 0: its contribution is the zero vector, inside the C ball, so the sensitivity C
        holds whatever the inputs, and nothing non-finite reaches the sum. An example with
        ``s_i = 0`` gets 1.
    """
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise PrivacyParameterError(f"max_norm={max_norm!r} is invalid: the clip C must be > 0")
    stacked = norms_sq if isinstance(norms_sq, Tensor) else torch.stack(list(norms_sq))
    if stacked.dim() != 2:
        raise ValueError(f"norms_sq must be (L, b), got shape {tuple(stacked.shape)}")
    dtype = work_dtype(stacked)
    norm = stacked.to(torch.float64).sum(dim=0).clamp_min(0.0).sqrt()
    bound = max_norm * (1.0 - CLIP_MARGIN_ULPS * torch.finfo(dtype).eps)
    alpha = (bound / norm.clamp_min(torch.finfo(torch.float64).tiny)).clamp(max=1.0)
    keep = torch.isfinite(norm) & (alpha >= ALPHA_MIN)
    if valid is not None:
        keep = keep & valid.to(keep.device)
    return torch.where(keep, alpha, torch.zeros_like(alpha)).to(dtype)


@dataclass(frozen=True)
class StepFrames:
    """Thin-QR frames of every module at one step, grouped by shape for batched r x r work.

    Build once per logical step with ``step_frames`` and pass to the clip
    (``clip_and_sum_whitened`` or ``clip_and_sum_grads``, every micro-batch) and ``privatize``:
    the factors do not move within a step.

    Attributes:
        frames: one ``Frame`` per module, in module order (views into ``stacked``).
        groups: the module indices of each group of modules with equal shapes and dtype.
        stacked: one ``Frame`` per group, with a leading module dimension.
        points: one stacked ``Point`` per group, (L_g, m, r) and (L_g, n, r).
    """

    frames: tuple[Frame, ...]
    groups: tuple[tuple[int, ...], ...]
    stacked: tuple[Frame, ...]
    points: tuple[Point, ...]


def step_frames(points: Sequence[Point]) -> StepFrames:
    """Frames (``point_frame``) of all modules, one batched QR per group of equal shapes.

    Implements the per-step factorisations of App. A.14 of PRISM used by eqs. (14)-(19).
    """
    keys: dict[tuple[object, ...], list[int]] = {}
    for index, p in enumerate(points):
        key = (tuple(p.A.shape), tuple(p.B.shape), p.A.dtype, p.B.dtype, p.A.device)
        keys.setdefault(key, []).append(index)
    frames: list[Frame | None] = [None] * len(points)
    groups, stacked, stacked_points = [], [], []
    for indices in keys.values():
        point = Point(
            torch.stack([points[i].A for i in indices]),
            torch.stack([points[i].B for i in indices]),
        )
        group = point_frame(point.A, point.B)
        for j, i in enumerate(indices):
            frames[i] = Frame(*(t[j] for t in group))
        groups.append(tuple(indices))
        stacked.append(group)
        stacked_points.append(point)
    return StepFrames(
        tuple(f for f in frames if f is not None),
        tuple(groups),
        tuple(stacked),
        tuple(stacked_points),
    )


def retract_modules(frames: StepFrames, directions: Sequence[Tangent], step: float) -> list[Point]:
    """Retract every module along its direction, one batched call per group of equal shapes.

    Implements eq. (22) and Prop. 3.2 of PRISM (``prism_core.manifold.retract``) for all
    modules of a step: the thin QRs, 2r x 2r SVDs and Procrustes alignments of a group run as
    batched LAPACK calls on the stacked factors ``frames.points``.

    Args:
        frames: ``step_frames(points)`` of the current points.
        directions: one ``Tangent`` per module, in module order.
        step: signed step length (``-lr`` for a descent step).

    Returns:
        One ``Point`` per module, in module order, in the work dtype.
    """
    if len(directions) != len(frames.frames):
        raise ValueError(f"{len(frames.frames)} modules but {len(directions)} directions")
    out: list[Point | None] = [None] * len(directions)
    for group, point in zip(frames.groups, frames.points, strict=True):
        dA = torch.stack([directions[i].dA for i in group])
        dB = torch.stack([directions[i].dB for i in group])
        new = retract(point.A, point.B, dA, dB, step)
        for j, i in enumerate(group):
            out[i] = Point(new.A[j], new.B[j])
    return [p for p in out if p is not None]


def per_example_norms_sq(points: Sequence[Point], lifts: Sequence[Tangent]) -> Tensor:
    """Stacked (L, b) squared intrinsic norms of per-example lifts.

    Implements eq. (15) of PRISM for every module ``l`` (the terms of ``s_i`` in eq. 16).
    """
    if len(points) != len(lifts):
        raise ValueError(f"{len(points)} modules but {len(lifts)} lifts")
    return torch.stack(
        [tangent_norm_sq(p.A, p.B, t.dA, t.dB) for p, t in zip(points, lifts, strict=True)]
    )


def _with_euclidean(norms_sq: Tensor, euclidean: Sequence[Tensor]) -> Tensor:
    """Append the squared norms of per-example Euclidean gradients (b, ...) as extra rows."""
    if not euclidean:
        return norms_sq
    extra = torch.stack([g.flatten(1).to(norms_sq.dtype).square().sum(1) for g in euclidean])
    return torch.cat([norms_sq, extra])


def split_max_norm(max_norm: float, euclidean_max_norm: float | None) -> tuple[float, float]:
    """Clip thresholds ``(C_tangent, C_euclidean)`` of a global clip with sensitivity ``C``.

    Implements a split of the global clip of eq. (16) of PRISM between the LoRA tangents and
    Euclidean tensors (a classification head)::

        C_tangent = sqrt(C^2 - C_euclidean^2),   so   C_tangent^2 + C_euclidean^2 = C^2

    Each example's tangent part is clipped to ``C_tangent`` and its Euclidean part to
    ``C_euclidean``, so its whole contribution still has norm ``<= C``: the sensitivity of the
    sum, and the ``max_norm`` to give ``privatize``, stay ``C``.

    Args:
        max_norm: the total clip C > 0 (the L2 sensitivity of the sum).
        euclidean_max_norm: the Euclidean share, ``0 < C_euclidean < C``; ``None`` for one
            joint clip of everything at C (returns ``(C, C)``).

    Raises:
        PrivacyParameterError: a threshold outside these ranges.
    """
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise PrivacyParameterError(f"max_norm={max_norm!r} is invalid: the clip C must be > 0")
    if euclidean_max_norm is None:
        return max_norm, max_norm
    if not (0 < euclidean_max_norm < max_norm):
        raise PrivacyParameterError(
            f"euclidean_max_norm={euclidean_max_norm!r} is invalid: the head's share of the "
            f"clip must be > 0 and < max_norm={max_norm} (the total sensitivity C)"
        )
    return math.sqrt(max_norm**2 - euclidean_max_norm**2), euclidean_max_norm


def _coefficients(
    norms_sq: Tensor,
    euclidean: Sequence[Tensor],
    max_norm: float,
    euclidean_max_norm: float | None,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-example clip coefficients ``(alpha_tangent, alpha_euclidean)``, each (b,).

    Joint clip (``euclidean_max_norm=None``): one coefficient for everything, eq. (16).
    Split clip: the tangent part to ``C_tangent``, the Euclidean part to ``C_euclidean``.
    ``valid``: examples with finite inputs; the others get 0 in both (``clip_coefficients``).
    """
    if euclidean_max_norm is None:
        alpha = clip_coefficients(_with_euclidean(norms_sq, euclidean), max_norm, valid=valid)
        return alpha, alpha
    if not euclidean:
        raise ValueError(
            "euclidean_max_norm is set but there are no Euclidean tensors to clip with it: "
            "leave it None (joint clip) when no head is trained"
        )
    c_tangent, c_euclidean = split_max_norm(max_norm, euclidean_max_norm)
    extra = _with_euclidean(norms_sq[:0], euclidean)
    alpha = clip_coefficients(norms_sq, c_tangent, valid=valid)
    alpha_euclidean = clip_coefficients(extra, c_euclidean, valid=valid)
    return dropped_together(alpha, alpha_euclidean)


def dropped_together(alpha: Tensor, alpha_euclidean: Tensor) -> tuple[Tensor, Tensor]:
    """The (b,) coefficients of a split clip with an example dropped (coefficient 0) in one
    part dropped in both: its whole contribution is zero, never half of it."""
    both = (alpha > 0) & (alpha_euclidean > 0)
    return alpha * both.to(alpha.dtype), alpha_euclidean * both.to(alpha_euclidean.dtype)


def finite_values(t: Tensor) -> Tensor:
    """``t`` with every non-finite entry set to 0 (a copy): the rows ``finite_rows`` rejects
    get coefficient 0, and ``0 * inf`` would be NaN."""
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


def _accumulate(
    parts: Sequence[Tangent],
    alphas: tuple[Tensor, Tensor],
    euclidean: Sequence[Tensor],
    previous: ClippedSum | None,
) -> ClippedSum:
    """Add this micro-batch's clipped sums (tangents and Euclidean) to ``previous``.

    ``alphas`` are the (tangent, Euclidean) coefficients; an example counts as clipped when
    either is below 1.
    """
    alpha, alpha_euclidean = alphas
    sums = list(parts)
    if previous is not None:
        sums = [
            Tangent(prev.dA + part.dA, prev.dB + part.dB)
            for prev, part in zip(previous.sums, parts, strict=True)
        ]
    extra_sums = []
    for index, g in enumerate(euclidean):
        weights = alpha_euclidean.to(work_dtype(g))
        total = torch.einsum("b,b...->...", weights, g.to(work_dtype(g)))
        extra_sums.append(total if previous is None else previous.euclidean[index] + total)
    count = int(alpha.shape[0]) + (previous.count if previous else 0)
    engaged = (alpha < 1.0) | (alpha_euclidean < 1.0) if euclidean else alpha < 1.0
    clipped = int(engaged.sum()) + (previous.clipped if previous else 0)
    return ClippedSum(tuple(sums), count, clipped, tuple(extra_sums))


@without_autocast
def clip_and_sum(
    points: Sequence[Point],
    lifts: Sequence[Tangent],
    *,
    max_norm: float,
    previous: ClippedSum | None = None,
    euclidean: Sequence[Tensor] = (),
    euclidean_max_norm: float | None = None,
) -> ClippedSum:
    """Globally clip per-example lifts and add them to a running sum.

    Implements eqs. (15)-(16) and the sum of Algorithm 1 (line 10, before dividing by b).
    Call it once per micro-batch with ``previous`` set to the last result: the noise is added
    once per logical step by ``privatize``. ``clip_and_sum_grads`` computes the same from the
    factor gradients without forming the per-example lifts (faster).

    Args:
        points: one ``Point(A, B)`` per module (unbatched).
        lifts: one ``Tangent`` per module with a leading example dimension (b, m, r), (b, n, r).
        max_norm: the total clip C, the L2 sensitivity of the sum (give ``privatize`` the same).
        previous: the running sum of earlier micro-batches of the same step, if any.
        euclidean: per-example gradients (b, ...) of other trainable tensors (e.g. a
            classification head); their squared norms join the same global norm ``s_i``.
        euclidean_max_norm: ``None`` (default): one joint clip of tangents and Euclidean
            tensors at C. Else the Euclidean share ``C_e < C`` of a split clip: tangents are
            clipped to ``sqrt(C^2 - C_e^2)`` and Euclidean tensors to ``C_e`` (``split_max_norm``).

    Returns:
        A new ``ClippedSum``; inputs are not modified.

    Notes:
        Each example contributes ``alpha_i (dA_i, dB_i)`` (and ``alpha_i g_i`` for Euclidean
        tensors; ``alpha'_i g_i`` with its own coefficient in a split clip) with total norm
        ``<= C`` over all modules and tensors together: the L2 sensitivity of the sum under
        add/remove adjacency.
    """
    valid = finite_rows([t for lifted in lifts for t in lifted] + list(euclidean))
    lifts = [Tangent(finite_values(t.dA), finite_values(t.dB)) for t in lifts]
    euclidean = [finite_values(g) for g in euclidean]
    alphas = _coefficients(
        per_example_norms_sq(points, lifts), euclidean, max_norm, euclidean_max_norm, valid
    )
    alpha = alphas[0]
    parts = []
    for t in lifts:
        dtype = work_dtype(t.dA, t.dB, alpha)
        a = alpha.to(dtype)
        parts.append(
            Tangent(
                torch.einsum("b,bmr->mr", a, t.dA.to(dtype)),
                torch.einsum("b,bnr->nr", a, t.dB.to(dtype)),
            )
        )
    return _accumulate(parts, alphas, euclidean, previous)


STACK_BYTES_MAX = 128 * 2**20
"""Largest stack of per-example gradients ``clip_and_sum_grads`` builds at once (bytes, both
factors of a chunk of modules): modules of one shape are stacked, up to this size, so that
their moments and weighted sums take one batched call instead of one per module (MiniLM at a
micro-batch of 64: all 24 modules, 38 MiB; a Gemma-sized down projection: one per chunk)."""


def _stack_grads(grads: Sequence[Tensor]) -> Tensor:
    """Per-module (b, m, r) gradients stacked to (L, b, m, r). The copy is made in the
    (b, r, m) memory layout where the moment GEMMs are fastest (``TRANSPOSE_MAX_RANK``) or
    that the gradient already has (Opacus' ``lora_A`` gradients); else row-major."""
    first = grads[0]
    if first.shape[-1] <= TRANSPOSE_MAX_RANK or first.mT.is_contiguous():
        return torch.stack([g.mT for g in grads]).mT
    return torch.stack(list(grads))


def _weighted_sums(alpha: Tensor, g: Tensor) -> Tensor:
    """``sum_i alpha_i g[l, i]`` for (b,) and (L, b, m, r): one GEMV per module on ``g``'s own
    memory layout, (L, m, r)."""
    L, b, m, r = g.shape
    if g.mT.is_contiguous():  # (L, b, r, m) in memory
        return (alpha @ g.mT.reshape(L, b, r * m)).reshape(L, r, m).mT
    return (alpha @ g.reshape(L, b, m * r)).reshape(L, m, r)


class _Chunk(NamedTuple):
    indices: tuple[int, ...]  # module indices
    frame: Frame  # stacked, (L, m, r)
    point: Point  # stacked, (L, m, r) and (L, n, r)


def _chunks(frames: StepFrames, grads: Sequence[tuple[Tensor, Tensor]]) -> Iterator[_Chunk]:
    """The modules of each shape group in chunks of at most ``STACK_BYTES_MAX`` stacked bytes."""
    for group, stacked, point in zip(frames.groups, frames.stacked, frames.points, strict=True):
        gA, gB = grads[group[0]]
        size = (gA.numel() + gB.numel()) * max(gA.element_size(), 4)
        width = max(1, STACK_BYTES_MAX // max(size, 1))
        for lo in range(0, len(group), width):
            hi = min(lo + width, len(group))
            yield _Chunk(
                group[lo:hi],
                Frame(*(t[lo:hi] for t in stacked)),
                Point(point.A[lo:hi], point.B[lo:hi]),
            )


def _check_grads(points: Sequence[Point], grads: Sequence[tuple[Tensor, Tensor]]) -> None:
    if len(points) != len(grads):
        raise ValueError(f"{len(points)} modules but {len(grads)} gradient pairs")
    for index, (p, (gA, gB)) in enumerate(zip(points, grads, strict=True)):
        if gA.dim() != 3 or gA.shape[1:] != p.A.shape or gB.shape != (gA.shape[0], *p.B.shape):
            raise ValueError(
                f"module {index}: per-example gradients must be (b, m, r), (b, n, r) = "
                f"(b, {tuple(p.A.shape)}), (b, {tuple(p.B.shape)}); got {tuple(gA.shape)}, "
                f"{tuple(gB.shape)}"
            )


@without_autocast
def clip_and_sum_grads(
    points: Sequence[Point],
    grads: Sequence[tuple[Tensor, Tensor]],
    *,
    max_norm: float,
    previous: ClippedSum | None = None,
    euclidean: Sequence[Tensor] = (),
    frames: StepFrames | None = None,
    euclidean_max_norm: float | None = None,
) -> ClippedSum:
    """Lift, globally clip and sum per-example factor gradients, without per-example lifts.

    Implements eqs. (14)-(16) and Algorithm 1 of PRISM, lines 3-10 (lift, global clip, sum;
    before dividing by b):
    the same ``ClippedSum`` as ``clip_and_sum(points, [lift(A, B, gA, gB), ...])``. The norm
    of each example's lift comes from r x r moments of its gradients (``lift_norm_sq``), and
    since the lift is linear, ``sum_i alpha_i lift(gA_i, gB_i) = lift(sum_i alpha_i gA_i,
    sum_i alpha_i gB_i)``: the clip coefficient uses the norm of exactly the lift that is
    summed.

    Args:
        points: one ``Point(A, B)`` per module (unbatched).
        grads: one ``(gA, gB)`` per module, shapes (b, m, r) and (b, n, r).
        max_norm: the total clip C, the L2 sensitivity of the sum (give ``privatize`` the same).
        previous: the running sum of earlier micro-batches of the same step, if any.
        euclidean: per-example gradients (b, ...) of other trainable tensors sharing the clip.
        frames: ``step_frames(points)``, computed once per step; built here if omitted.
        euclidean_max_norm: the Euclidean share of a split clip, see ``clip_and_sum``.

    Returns:
        A new ``ClippedSum``; inputs are not modified.

    Notes:
        Per module: at most three GEMM passes over each gradient (whitening, r x r Gram,
        coordinates; ``lift_moments``) and one weighted sum. Modules of equal shape are stacked
        (chunks of at most ``STACK_BYTES_MAX`` bytes) so that their moments, weighted sums and
        lifts are one batched call per chunk, not one per module (no Python loop over
        modules). An example with an infinite or NaN entry (or entries whose squares overflow)
        has a non-finite norm from its moments: it gets coefficient 0 and its rows, alone, are
        zeroed in the stacked copies before the weighted sum, so no pass over every example's
        gradients checks them.
        Cost O((m + n) r^2) per example and module.
    """
    _check_grads(points, grads)
    if frames is None:
        frames = step_frames(points)
    stacks = []
    for chunk in _chunks(frames, grads):
        gA = _stack_grads([grads[i][0] for i in chunk.indices])
        gB = _stack_grads([grads[i][1] for i in chunk.indices])
        norms = lift_norm_sq_from_moments(lift_moments_stacked(chunk.frame, gA, gB))
        stacks.append(
            _Stack(
                chunk.indices,
                norms,
                gA,
                gB,
                functools.partial(lift, chunk.point.A, chunk.point.B, frame=chunk.frame),
                owned=True,
            )
        )
    return _clip_stacks(len(points), stacks, max_norm, previous, euclidean, euclidean_max_norm)


class _Stack(NamedTuple):
    """One stack of modules' per-example rows for ``_clip_stacks``: the modules' indices, their
    squared norms (L, b), the two factors' rows as (L, b, k, r) tensors (any memory layout),
    the lift of their weighted sums (L, k, r) to tangents, and whether the rows are the clip's
    own copy (zeroed in place: ``owned=True`` only for copies made inside the clip) or the
    caller's (zeroed in a copy)."""

    indices: tuple[int, ...]
    norms: Tensor
    first: Tensor
    second: Tensor
    lift: Callable[[Tensor, Tensor], Tangent]
    owned: bool


def _clip_stacks(
    modules: int,
    stacks: Sequence[_Stack],
    max_norm: float,
    previous: ClippedSum | None,
    euclidean: Sequence[Tensor],
    euclidean_max_norm: float | None,
) -> ClippedSum:
    """The clip and sum shared by ``clip_and_sum_grads`` and ``clip_and_sum_whitened``, from
    each example's squared norm per module.

    An example is valid when every module's norm is finite and its Euclidean rows have a finite
    sum (``finite_rows``); an invalid one gets coefficient 0 in both parts and its rows are
    zeroed before the weighted sums (0 * inf would be NaN). The weighted sums are lifted by each
    stack's ``lift``, which is linear, so each example contributes exactly the lift whose norm
    was clipped.
    """
    rows: list[Tensor | None] = [None] * modules
    valid = finite_rows(euclidean) if euclidean else None
    for stack in stacks:
        ok = torch.isfinite(stack.norms).all(0)  # a non-finite entry gives a non-finite norm
        valid = ok if valid is None else valid & ok
        for j, i in enumerate(stack.indices):
            rows[i] = stack.norms[j]
    assert valid is not None  # at least one module
    norms_sq = torch.stack([r for r in rows if r is not None]).nan_to_num(0.0, 0.0, 0.0)
    euclidean = [finite_values(g) for g in euclidean]
    alphas = _coefficients(norms_sq, euclidean, max_norm, euclidean_max_norm, valid)
    alpha = alphas[0]
    dropped = (~valid).nonzero().flatten()  # usually empty: zero only the dropped rows
    parts: list[Tangent | None] = [None] * modules
    for stack in stacks:  # alpha's dtype is the widest: the norms' or the head's
        first, second = stack.first, stack.second
        if dropped.numel():
            if stack.owned:
                first.index_fill_(1, dropped, 0.0)
                second.index_fill_(1, dropped, 0.0)
            else:
                first, second = (
                    first.index_fill(1, dropped, 0.0),
                    second.index_fill(1, dropped, 0.0),
                )
        lifted = stack.lift(
            _weighted_sums(alpha, first.to(alpha.dtype)),
            _weighted_sums(alpha, second.to(alpha.dtype)),
        )
        for j, i in enumerate(stack.indices):
            parts[i] = Tangent(lifted.dA[j], lifted.dB[j])
    return _accumulate([p for p in parts if p is not None], alphas, euclidean, previous)


def whiten_rows(
    frames: StepFrames, grads: Sequence[tuple[Tensor, Tensor]]
) -> list[tuple[Tensor, Tensor]]:
    """The rows ``clip_and_sum_whitened`` takes, from per-example factor gradients: per group of
    ``frames``, ``(gA_i RB^{-1}).T`` and ``(gB_i RA^{-1}).T`` stacked, (L, b, r, m) and
    (L, b, r, n), in the frames' dtype. (The trainer's layers write them directly.)"""
    out = []
    for group, stacked in zip(frames.groups, frames.stacked, strict=True):
        dtype = stacked.RB_inv.dtype
        ra = torch.stack([grads[i][0].to(dtype) @ stacked.RB_inv[j] for j, i in enumerate(group)])
        rc = torch.stack([grads[i][1].to(dtype) @ stacked.RA_inv[j] for j, i in enumerate(group)])
        out.append((ra.mT.contiguous(), rc.mT.contiguous()))
    return out


def _check_rows(frames: StepFrames, rows: Sequence[tuple[Tensor, Tensor]]) -> None:
    """Whitened group rows must have the shapes of ``frames``' groups, one b for all."""
    if len(rows) != len(frames.groups) or not rows:
        raise ValueError(f"{len(frames.groups)} module groups but {len(rows)} pairs of rows")
    b = int(rows[0][0].shape[1]) if rows[0][0].dim() == 4 else -1
    for index, (point, (ra, rc)) in enumerate(zip(frames.points, rows, strict=True)):
        L, m, r = point.A.shape
        n = point.B.shape[1]
        if ra.shape != (L, b, r, m) or rc.shape != (L, b, r, n):
            raise ValueError(
                f"group {index}: whitened rows must be (L, b, r, m), (L, b, r, n) = "
                f"({L}, b, {r}, {m}), ({L}, b, {r}, {n}) with one b for all; got "
                f"{tuple(ra.shape)}, {tuple(rc.shape)}"
            )


@without_autocast
def clip_and_sum_whitened(
    points: Sequence[Point],
    rows: Sequence[tuple[Tensor, Tensor]],
    *,
    frames: StepFrames,
    max_norm: float,
    previous: ClippedSum | None = None,
    euclidean: Sequence[Tensor] = (),
    euclidean_max_norm: float | None = None,
) -> ClippedSum:
    """``clip_and_sum_grads`` from whitened per-example gradient rows, stacked by shape group.

    Implements eqs. (14)-(16) and Algorithm 1 of PRISM, lines 3-10, as ``clip_and_sum_grads``
    does, for gradients that arrive whitened and stacked: for the group of modules
    ``frames.groups[k]`` (in that order), ``rows[k] = (RA_rows, RC_rows)`` with
    ``RA_rows[l, i] = (gA_i RB^{-1}).T`` (r x m) and ``RC_rows[l, i] = (gB_i RA^{-1}).T``
    (r x n) of module l at this step's frames. ``prism_runtime.per_example`` writes them so in
    the layers' backward: the whitening is a GEMM on the layer's r-wide operand before the
    per-example product, and nothing is stacked or copied afterwards.

    The norms need only the trace of each example's whitened Gram, one pass of squares
    (``lift_norm_sq_whitened``); the weighted sums are of the whitened rows, lifted by
    ``lift_whitened``. Each example's contribution is computed from the same whitened rows as
    its norm, so the clip bounds exactly what is summed.

    Args:
        points: one ``Point(A, B)`` per module (unbatched).
        rows: one pair per group of ``frames``, (L_k, b, r, m) and (L_k, b, r, n).
        frames: ``step_frames(points)``, the frames the rows were whitened with.
        max_norm, previous, euclidean, euclidean_max_norm: as ``clip_and_sum_grads``.

    Returns:
        A new ``ClippedSum``; the rows are read, not modified.

    Notes:
        An example with a non-finite entry gets a non-finite norm, coefficient 0, and its rows
        are zeroed in a copy before the weighted sums (only when there is one). Cost per
        example and module: one pass of squares, one GEMM pass (coordinates), one weighted sum.
    """
    _check_rows(frames, rows)
    stacks = [
        _Stack(
            group,
            lift_norm_sq_whitened(stacked, ra, rc),
            ra.mT,
            rc.mT,
            functools.partial(lift_whitened, stacked),
            owned=False,
        )
        for group, stacked, (ra, rc) in zip(frames.groups, frames.stacked, rows, strict=True)
    ]
    return _clip_stacks(len(points), stacks, max_norm, previous, euclidean, euclidean_max_norm)


def tangent_noise(
    A: Tensor, B: Tensor, generator: NoiseSource, *, frame: Frame | None = None
) -> Tangent:
    """Unit-scale isotropic Gaussian on the tangent space, sampled in O((m + n) r).

    Implements eq. (19) / App. A.13 of PRISM with the thin-QR bases of App. A.14::

        Xi_A = (I - Pi_A) U R_B^{-T},  Xi_B = V R_A^{-T},  U ~ N(0, I_{m x r}),  V ~ N(0, I_{n x r})

    so ``Xi_A B.T + A Xi_B.T = (I - Pi_A) U Q_B.T + Q_A V.T``, which is distributed exactly as
    ``P_{A,B}(Xi)`` for a dense standard Gaussian ``Xi`` (Thm 3.1, Lemma A.18): expected
    energy ``r (m + n - r)``, zero normal component, gauge invariant. ``R^{-T}`` plays the role
    of ``N^{-1/2}`` / ``M^{-1/2}`` (both satisfy ``W W.T = N^{-1}``).

    Args:
        A: (..., m, r); B: (..., n, r) the current point, or a stack of points of equal shape
            (independent noise for each).
        generator: a seeded ``torch.Generator`` (reproducible) or ``prism_core.rng.SecureRNG``
            (OS CSPRNG, for production).
        frame: ``point_frame(A, B)`` if already computed (once per step); else built here.

    Returns:
        ``Tangent(Xi_A, Xi_B)`` in the work dtype (float32 or better).

    Notes:
        ``R^{-T}`` is applied as a GEMM with the frame's explicit triangular inverse (float64,
        then the work dtype). Draws all of ``U`` (shape of ``A``), then all of ``V``.
    """
    dtype = work_dtype(A, B)
    if frame is None:
        frame = point_frame(A, B)
    U = standard_normal(tuple(A.shape), generator, dtype=dtype, device=A.device)
    V = standard_normal(tuple(B.shape), generator, dtype=dtype, device=A.device)
    QA = frame.QA.to(dtype)
    U_perp = U - QA @ (QA.mT @ U)
    Xi_A = U_perp @ frame.RB_inv.to(dtype).mT  # U_perp R_B^{-T}
    Xi_B = V @ frame.RA_inv.to(dtype).mT  # V R_A^{-T}
    return Tangent(Xi_A, Xi_B)


def _module_noise(
    points: Sequence[Point], generator: NoiseSource, frames: StepFrames
) -> list[Tangent]:
    """Unit tangent noise for every module: one ``tangent_noise`` call per shape group."""
    out: list[Tangent | None] = [None] * len(points)
    for group, stacked, point in zip(frames.groups, frames.stacked, frames.points, strict=True):
        xi = tangent_noise(point.A, point.B, generator, frame=stacked)
        for j, i in enumerate(group):
            out[i] = Tangent(xi.dA[j], xi.dB[j])
    return [t for t in out if t is not None]


def _min_norm_modules(frames: StepFrames, tangents: Sequence[Tangent]) -> list[Tangent]:
    """``min_norm_lift`` of every module's tangent, one batched call per shape group."""
    out: list[Tangent | None] = [None] * len(tangents)
    for group, point in zip(frames.groups, frames.points, strict=True):
        dA = torch.stack([tangents[i].dA for i in group])
        dB = torch.stack([tangents[i].dB for i in group])
        lifted = min_norm_lift(point.A, point.B, dA, dB)
        for j, i in enumerate(group):
            out[i] = Tangent(lifted.dA[j].to(dA.dtype), lifted.dB[j].to(dB.dtype))
    return [t for t in out if t is not None]


@without_autocast
def privatize(
    points: Sequence[Point],
    clipped: ClippedSum,
    *,
    noise_multiplier: float,
    max_norm: float,
    expected_batch_size: float,
    sample_rate: float,
    generator: NoiseSource,
    frames: StepFrames | None = None,
) -> PrivateStep:
    """Add Gaussian noise once to a clipped sum, normalise by b, release the min-norm lift.

    Implements eqs. (17)-(18) of PRISM, then the minimum-norm lift of App. A.7::

        dZ_dp = (sum_i alpha_i dZ_i + sigma C (Xi_A B.T + A Xi_B.T)) / b,        b = q N,
        (dA_dp, dB_dp) = min_norm_lift(A, B, dZ_dp)

    with ``(Xi_A, Xi_B)`` from ``tangent_noise``. THE released object is ``dZ_dp``; the
    factor pair is its unique minimum-norm representative (``A.T dA_dp = dB_dp.T B``), a
    function of ``dZ_dp`` alone, so every component of it, including ``Pi_A dA_dp``, carries
    noise. (The plain sum of lifts plus noise does not: its ``Pi_A dA`` part is the un-noised
    ``1/2 Pi_A g_A N^+`` of eq. 14, see the module docstring.) Euclidean sums (tensors sharing
    the global clip, see ``clip_and_sum``) get i.i.d. ``N(0, sigma^2 C^2)`` noise and the same
    divisor, so the whole release is one Gaussian mechanism with sensitivity C on (tangent
    spaces x Euclidean spaces), followed by post-processing.

    Args:
        points: one ``Point`` per module, the same as given to ``clip_and_sum``.
        clipped: the clipped sum of this logical step (all micro-batches).
        noise_multiplier: sigma >= 0 (0 disables noise and is accounted as infinite epsilon).
        max_norm: clip threshold C used by ``clip_and_sum``.
        expected_batch_size: b = q * N. The realised batch size is never used.
        sample_rate: Poisson rate q, recorded for accounting.
        generator: noise source, see ``tangent_noise``.
        frames: ``step_frames(points)`` if already computed for this step.

    Returns:
        ``PrivateStep(tangents, euclidean, record)``; ``tangents`` are min-norm lifts.

    Notes:
        The intrinsic norm (eq. 15) of each released tangent, hence the noise energy
        ``(sigma C / b)^2 r (m + n - r)`` of Thm 3.1, is that of ``dZ_dp``: the re-lift changes
        the factors, not the tangent vector. Extra cost O((m + n) r^2 + r^3) per module.
    """
    validate_noise_parameters(
        noise_multiplier=noise_multiplier,
        max_norm=max_norm,
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
    )
    if len(points) != len(clipped.sums):
        raise ValueError(f"{len(points)} modules but the clipped sum has {len(clipped.sums)}")
    if frames is None:
        frames = step_frames(points)
    scale = noise_multiplier * max_norm
    module_noise = _module_noise(points, generator, frames) if scale > 0 else None
    noisy = []
    for index, s in enumerate(clipped.sums):
        dA, dB = s.dA, s.dB
        if module_noise is not None:
            xi = module_noise[index]
            dA, dB = dA + scale * xi.dA.to(dA.dtype), dB + scale * xi.dB.to(dB.dtype)
        noisy.append(Tangent(dA / expected_batch_size, dB / expected_batch_size))
    tangents = _min_norm_modules(frames, noisy)
    euclidean = []
    for total in clipped.euclidean:
        if scale > 0:
            shape = tuple(total.shape)
            noise = standard_normal(shape, generator, dtype=total.dtype, device=total.device)
            total = total + scale * noise
        euclidean.append(total / expected_batch_size)
    record = PrivacyEvent(
        mechanism="prism-tangent-gaussian",
        noise_multiplier=float(noise_multiplier),
        max_norm=float(max_norm),
        expected_batch_size=float(expected_batch_size),
        sample_rate=float(sample_rate),
        steps=1,
    )
    return PrivateStep(tangents, euclidean, record)


def dp_tangent_update(
    points: Sequence[Point],
    lifts: Sequence[Tangent],
    *,
    noise_multiplier: float,
    max_norm: float,
    expected_batch_size: float,
    sample_rate: float,
    generator: NoiseSource,
    euclidean: Sequence[Tensor] = (),
) -> PrivateStep:
    """One-shot PRISM step for a batch that fits in memory: ``clip_and_sum`` then ``privatize``.

    Implements eqs. (15)-(18) of PRISM (Algorithm 1, lines 3-12). See ``privatize``: the
    release is the min-norm lift (App. A.7) of the noisy tangent vector.
    """
    clipped = clip_and_sum(points, lifts, max_norm=max_norm, euclidean=euclidean)
    return privatize(
        points,
        clipped,
        noise_multiplier=noise_multiplier,
        max_norm=max_norm,
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
        generator=generator,
    )
