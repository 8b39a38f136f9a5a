"""Partitions of a data set over simulated sites: IID and Dirichlet(alpha) label skew."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from prism_runtime.errors import ConfigError

logger = logging.getLogger(__name__)


def _check_partition(n: int, num_parts: int, min_size: int = 1) -> None:
    if num_parts < 1:
        raise ConfigError(f"num_parts must be at least 1, got {num_parts}.")
    if min_size < 1:
        raise ConfigError(f"min_size must be at least 1, got {min_size}.")
    if n < num_parts * min_size:
        what = "non-empty parts" if min_size == 1 else f"parts of at least {min_size} examples"
        raise ConfigError(
            f"Cannot split {n} examples into {num_parts} {what}. Use fewer parts"
            + ("." if min_size == 1 else " or a smaller batch-size.")
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
    min_size: int = 1,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided among parts with Dirichlet(alpha) proportions.

    For every class, the shuffled indices of that class are cut according to proportions
    ``p ~ Dirichlet(alpha * 1)`` over the parts (Hsu et al., 2019). Small ``alpha`` gives parts
    dominated by few classes; large ``alpha`` approaches an IID split.

    Every part holds at least ``min_size`` examples (a simulated site needs one expected batch,
    so the simulation asks for ``batch-size``; the rejection rule of common non-IID benchmarks,
    e.g. NIID-Bench's minimum client size): a draw with a smaller part is rejected and redrawn,
    up to ``max_tries`` draws; if all are rejected, the last draw is rebalanced by moving single
    indices from the currently largest part into each part that is short (a warning is logged).
    A draw that already satisfies ``min_size`` is the draw a smaller ``min_size`` would accept
    first too, so raising it changes only the splits that had a part too small.

    Args:
        labels: Integer class label of each example.
        num_parts: Number of parts (sites), ``1 <= num_parts <= len(labels) / min_size``.
        alpha: Dirichlet concentration, ``> 0``.
        seed: Seed; the result is a deterministic function of all arguments.
        min_size: Smallest allowed part, ``>= 1``.
        max_tries: Number of draws before rebalancing.

    Returns:
        ``num_parts`` sorted ``int64`` index arrays; every index appears in exactly one.

    Raises:
        ConfigError: Invalid ``num_parts``, ``min_size``, ``alpha`` or ``max_tries`` (fewer
            than ``num_parts * min_size`` labels), or labels not 1-D.
    """
    label_array = np.asarray(labels)
    if label_array.ndim != 1:
        raise ConfigError(f"labels must be 1-D, got shape {label_array.shape}.")
    _check_partition(len(label_array), num_parts, min_size)
    if not alpha > 0:
        raise ConfigError(f"alpha must be > 0, got {alpha}.")
    if max_tries < 1:
        raise ConfigError(f"max_tries must be at least 1, got {max_tries}.")
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        parts = _dirichlet_draw(label_array, num_parts, alpha, rng)
        if all(len(part) >= min_size for part in parts):
            break
    else:
        logger.warning(
            "No Dirichlet(alpha=%g) draw out of %d left every one of %d parts with at least %d "
            "examples; moving single examples into the short parts.",
            alpha,
            max_tries,
            num_parts,
            min_size,
        )
        _fill_short_parts(parts, min_size)
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


def _fill_short_parts(parts: list[list[int]], min_size: int) -> None:
    # With n >= num_parts * min_size, while a part is short the largest holds more than min_size.
    for part in parts:
        while len(part) < min_size:
            donor = max(parts, key=len)
            part.append(donor.pop())
