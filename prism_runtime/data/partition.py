"""Partitions of a data set over simulated sites: IID and Dirichlet(alpha) label skew."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from prism_runtime.errors import ConfigError

logger = logging.getLogger(__name__)


def _check_partition(n: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ConfigError(f"num_parts must be at least 1, got {num_parts}.")
    if n < num_parts:
        raise ConfigError(
            f"Cannot split {n} examples into {num_parts} non-empty parts. Use fewer parts."
        )


def iid_partition(n: int, num_parts: int, seed: int) -> list[np.ndarray]:
    """Split ``range(n)`` uniformly at random into parts whose sizes differ by at most one.

    Args:
        n: Number of examples.
        num_parts: Number of parts (sites), ``1 <= num_parts <= n``.
        seed: Seed of the permutation; the result is a deterministic function of it.

    Returns:
        ``num_parts`` sorted ``int64`` index arrays; every index appears in exactly one.

    Raises:
        ConfigError: ``num_parts < 1`` or ``n < num_parts``.
    """
    _check_partition(n, num_parts)
    permutation = np.random.default_rng(seed).permutation(n)
    return [np.sort(part).astype(np.int64) for part in np.array_split(permutation, num_parts)]


def dirichlet_partition(
    labels: Sequence[int] | np.ndarray,
    num_parts: int,
    alpha: float,
    seed: int,
    *,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided among parts with Dirichlet(alpha) proportions.

    For every class, the shuffled indices of that class are cut according to proportions
    ``p ~ Dirichlet(alpha * 1)`` over the parts (Hsu et al., 2019). Small ``alpha`` gives parts
    dominated by few classes; large ``alpha`` approaches an IID split.

    Every part is non-empty: a draw with an empty part is rejected and redrawn, up to
    ``max_tries`` draws; if all are rejected, the last draw is rebalanced by moving one index
    from the currently largest part into each empty part (a warning is logged).

    Args:
        labels: Integer class label of each example.
        num_parts: Number of parts (sites), ``1 <= num_parts <= len(labels)``.
        alpha: Dirichlet concentration, ``> 0``.
        seed: Seed; the result is a deterministic function of all arguments.
        max_tries: Number of draws before rebalancing.

    Returns:
        ``num_parts`` sorted ``int64`` index arrays; every index appears in exactly one.

    Raises:
        ConfigError: Invalid ``num_parts``, ``alpha`` or ``max_tries``, or labels not 1-D.
    """
    label_array = np.asarray(labels)
    if label_array.ndim != 1:
        raise ConfigError(f"labels must be 1-D, got shape {label_array.shape}.")
    _check_partition(len(label_array), num_parts)
    if not alpha > 0:
        raise ConfigError(f"alpha must be > 0, got {alpha}.")
    if max_tries < 1:
        raise ConfigError(f"max_tries must be at least 1, got {max_tries}.")
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        parts = _dirichlet_draw(label_array, num_parts, alpha, rng)
        if all(parts):
            break
    else:
        logger.warning(
            "No Dirichlet(alpha=%g) draw out of %d left every one of %d parts non-empty; "
            "moving single examples into the empty parts.",
            alpha,
            max_tries,
            num_parts,
        )
        _fill_empty_parts(parts)
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


def _dirichlet_draw(
    labels: np.ndarray, num_parts: int, alpha: float, rng: np.random.Generator
) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for cls in np.unique(labels):
        indices = rng.permutation(np.flatnonzero(labels == cls))
        proportions = rng.dirichlet(np.full(num_parts, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(indices)).astype(np.int64)
        for part, chunk in zip(parts, np.split(indices, cuts), strict=True):
            part.extend(chunk.tolist())
    return parts


def _fill_empty_parts(parts: list[list[int]]) -> None:
    # With n >= num_parts, while a part is empty some other part holds at least two indices.
    for part in parts:
        if not part:
            donor = max(parts, key=len)
            part.append(donor.pop())
