"""Comparison mechanisms on the same per-example inputs as PRISM (§2, docs/design.md §2).

- Factor-space DP-LoRA (Yu et al. 2022; "DP-AdamW" in the paper): clip the concatenated
  per-example factor gradients ``(gA, gB)`` of every module to C with one coefficient per
  example, add i.i.d. Gaussian noise ``N(0, sigma^2 C^2)`` to every factor entry, divide by
  the expected batch size, then step with AdamW.
- FFA-LoRA (Sun et al. 2024): the randomly initialised down-projection is frozen and DP-SGD
  runs on the up-projection only. In peft terms ``lora_A`` is frozen and ``lora_B`` trained,
  which in PRISM notation (docs/design.md §1) means ``B`` frozen and DP on ``A`` only: pass just
  the ``gA`` tensors to ``factor_dp_gradient``.
- Non-DP LoRA: the plain mean gradient of the realised batch.

The optimizer step itself is ``torch.optim.AdamW`` on the factors (the trainer owns it); this
module only produces the privatized gradients and a ``PrivacyEvent`` for the accountant.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from prism_core.manifold import work_dtype
from prism_core.mechanism import (
    PrivacyEvent,
    clip_coefficients,
    dropped_together,
    finite_rows,
    finite_values,
    split_max_norm,
    validate_noise_parameters,
    without_autocast,
)
from prism_core.rng import NoiseSource, standard_normal

__all__ = [
    "factor_clip_and_sum",
    "factor_dp_gradient",
    "factor_norms_sq",
    "factor_privatize",
]


def factor_norms_sq(per_example_grads: Sequence[Tensor]) -> Tensor:
    """(T, b) squared Frobenius norms of per-example gradients, one row per tensor.

    Implements the factor norm of eq. (3): ``||g_i||^2 = sum ||gA_i||_F^2 + ||gB_i||_F^2``
    once the rows are summed (``clip_coefficients`` does that).
    """
    dtype = work_dtype(*per_example_grads)  # float32 or better: float64 inputs stay exact
    return torch.stack([g.flatten(1).to(dtype).square().sum(dim=1) for g in per_example_grads])


@without_autocast
def factor_clip_and_sum(
    per_example_grads: Sequence[Tensor],
    *,
    max_norm: float,
    previous: Sequence[Tensor] | None = None,
    euclidean: Sequence[Tensor] = (),
    euclidean_max_norm: float | None = None,
) -> tuple[list[Tensor], Tensor]:
    """Clip concatenated per-example factor gradients to C (one coefficient each) and sum.

    Implements the clipping of eq. (3) (factor-space DP-SGD), with the same optional split as
    ``prism_core.mechanism.clip_and_sum``: ``euclidean`` tensors (a classification head) join
    the one clip at C, or with ``euclidean_max_norm = C_e < C`` are clipped to ``C_e`` and the
    factors to ``sqrt(C^2 - C_e^2)`` (``split_max_norm``); either way each example contributes
    at most C, the sensitivity to give ``factor_privatize``.

    Args:
        per_example_grads: factor tensors with a leading example dimension b.
        max_norm: the total clip C.
        previous: running sums of earlier micro-batches of the same step, in the order of the
            returned sums.
        euclidean: per-example gradients (b, ...) of other trainable tensors.
        euclidean_max_norm: the Euclidean share of a split clip; ``None`` for a joint clip.

    Returns:
        (summed clipped gradients of ``[*per_example_grads, *euclidean]``, the (b,) clip
        coefficients of the factor gradients).

    Notes:
        An example with a non-finite entry (or norm) anywhere contributes zero
        (``prism_core.mechanism.clip_coefficients``): the sums are finite whatever the inputs.
    """
    c_factor, c_euclidean = split_max_norm(max_norm, euclidean_max_norm)
    valid = finite_rows([*per_example_grads, *euclidean])
    per_example_grads = [finite_values(g) for g in per_example_grads]
    euclidean = [finite_values(g) for g in euclidean]
    if euclidean_max_norm is None:
        alpha = clip_coefficients(
            factor_norms_sq([*per_example_grads, *euclidean]), max_norm, valid=valid
        )
        alpha_euclidean = alpha
    elif not euclidean:
        raise ValueError(
            "euclidean_max_norm is set but there are no Euclidean tensors: leave it None"
        )
    else:
        alpha = clip_coefficients(factor_norms_sq(per_example_grads), c_factor, valid=valid)
        alpha_euclidean = clip_coefficients(factor_norms_sq(euclidean), c_euclidean, valid=valid)
        alpha, alpha_euclidean = dropped_together(alpha, alpha_euclidean)
    weighted = [(alpha, g) for g in per_example_grads] + [(alpha_euclidean, g) for g in euclidean]
    sums = []
    for index, (a, g) in enumerate(weighted):
        s = torch.einsum("b,b...->...", a.to(g.dtype), g)
        sums.append(s if previous is None else previous[index] + s)
    return sums, alpha


@without_autocast
def factor_privatize(
    summed: Sequence[Tensor],
    *,
    noise_multiplier: float,
    max_norm: float,
    expected_batch_size: float,
    sample_rate: float,
    generator: NoiseSource,
    mechanism: str = "factor-gaussian",
) -> tuple[list[Tensor], PrivacyEvent]:
    """Add i.i.d. ``N(0, sigma^2 C^2)`` noise to every summed factor entry, divide by b.

    Implements eq. (3) of PRISM (the factor-space baseline). ``b`` is the expected batch size.
    """
    validate_noise_parameters(
        noise_multiplier=noise_multiplier,
        max_norm=max_norm,
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
    )
    scale = noise_multiplier * max_norm
    out = []
    for s in summed:
        noise = standard_normal(tuple(s.shape), generator, dtype=s.dtype, device=s.device)
        out.append(
            (s + scale * noise) / expected_batch_size if scale > 0 else s / expected_batch_size
        )
    record = PrivacyEvent(
        mechanism=mechanism,
        noise_multiplier=float(noise_multiplier),
        max_norm=float(max_norm),
        expected_batch_size=float(expected_batch_size),
        sample_rate=float(sample_rate),
        steps=1,
    )
    return out, record


def factor_dp_gradient(
    per_example_grads: Sequence[Tensor],
    *,
    noise_multiplier: float,
    max_norm: float,
    expected_batch_size: float,
    sample_rate: float,
    generator: NoiseSource,
    mechanism: str = "factor-gaussian",
) -> tuple[list[Tensor], PrivacyEvent]:
    """Factor-space DP gradient for a batch in memory: clip, sum, noise, divide by b.

    Implements eq. (3) of PRISM. For FFA-LoRA pass only the trainable factor's gradients and
    ``mechanism="ffa-gaussian"``.
    """
    summed, _ = factor_clip_and_sum(per_example_grads, max_norm=max_norm)
    return factor_privatize(
        summed,
        noise_multiplier=noise_multiplier,
        max_norm=max_norm,
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
        generator=generator,
        mechanism=mechanism,
    )
