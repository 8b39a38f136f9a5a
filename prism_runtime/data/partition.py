"""Partitions of a data set over simulated sites: IID and Dirichlet(alpha) label skew.

Both partitioners take an optional person id per row (``units``, docs/design.md §3.2): then they
partition PEOPLE, so every row of a person lands in the same part. Without ``units`` every row
is its own unit and the split is the record-level one.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np

from prism_runtime.data.units import person_records
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


def _people(units: Sequence[Hashable], n: int) -> list[list[int]]:
    """The row indices of each person, people in the order of their first row."""
    if len(units) != n:
        raise ConfigError(f"units must give one person id per row: {len(units)} ids, {n} rows.")
    return person_records(units)


def _check_people(people: int, num_parts: int) -> None:
    if people < num_parts:
        raise ConfigError(
            f"Cannot split {people} people into {num_parts} non-empty parts (all rows of a "
            "person stay in one part). Use fewer parts."
        )


def _rows_of(people: list[list[int]], parts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Each part of person indices as the sorted ``int64`` array of their rows."""
    return [
        np.sort(np.asarray([row for p in part for row in people[p]], dtype=np.int64))
        for part in parts
    ]


def iid_partition(
    n: int, num_parts: int, seed: int, *, units: Sequence[Hashable] | None = None
) -> list[np.ndarray]:
    """Split ``range(n)`` uniformly at random into parts whose sizes differ by at most one.

    With ``units``, the PEOPLE are split so: a uniformly random permutation of the people (in the
    order of their first row) is cut into parts whose numbers of people differ by at most one,
    and each part holds all rows of its people (its number of rows follows their counts). With
    one row per person in row order this is the record-level split, index for index.

    Args:
        n: Number of examples.
        num_parts: Number of parts (sites), ``1 <= num_parts <= n`` (``<=`` the number of
            people with ``units``).
        seed: Seed of the permutation; the result is a deterministic function of it.
        units: Optional person id of each row (``len(units) == n``); None: each row its own.

    Returns:
        ``num_parts`` sorted ``int64`` index arrays; every index appears in exactly one, and all
        rows of a person in the same one.

    Raises:
        ConfigError: ``num_parts < 1``, ``n < num_parts``, fewer people than parts, or
            ``units`` of the wrong length.
        DataError: a row of ``units`` without a person (None).
    """
    _check_partition(n, num_parts)
    if units is None:
        permutation = np.random.default_rng(seed).permutation(n)
        return [np.sort(part).astype(np.int64) for part in np.array_split(permutation, num_parts)]
    people = _people(units, n)
    _check_people(len(people), num_parts)
    permutation = np.random.default_rng(seed).permutation(len(people))
    return _rows_of(people, [part.tolist() for part in np.array_split(permutation, num_parts)])


def dirichlet_partition(
    labels: Sequence[int] | np.ndarray,
    num_parts: int,
    alpha: float,
    seed: int,
    *,
    min_size: int = 1,
    max_tries: int = 100,
    units: Sequence[Hashable] | None = None,
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

    With ``units`` the draw splits PEOPLE: each person counts once, under their majority label
    (the smallest of the tied labels on a tie), the people of each class are cut by the same
    Dirichlet proportions, and each part holds all rows of its people. ``min_size`` still counts
    rows; the rebalancing moves whole people, each time the person with the fewest rows (the
    last of them on a tie) of the part with the most rows, and refuses a split it cannot mend
    that way. With one row per person in row order this is the record-level split, index for
    index.

    Args:
        labels: Integer class label of each example.
        num_parts: Number of parts (sites), ``1 <= num_parts <= len(labels) / min_size``.
        alpha: Dirichlet concentration, ``> 0``.
        seed: Seed; the result is a deterministic function of all arguments.
        min_size: Smallest allowed part, ``>= 1``.
        max_tries: Number of draws before rebalancing.
        units: Optional person id of each row (same length as ``labels``); None: each row its
            own.

    Returns:
        ``num_parts`` sorted ``int64`` index arrays; every index appears in exactly one, and all
        rows of a person in the same one.

    Raises:
        ConfigError: Invalid ``num_parts``, ``min_size``, ``alpha`` or ``max_tries`` (fewer
            than ``num_parts * min_size`` labels), labels not 1-D; with ``units``: fewer people
            than parts, ``units`` of the wrong length, or no way found to give every part
            ``min_size`` rows by moving whole people.
        DataError: a row of ``units`` without a person (None).
    """
    label_array = np.asarray(labels)
    if label_array.ndim != 1:
        raise ConfigError(f"labels must be 1-D, got shape {label_array.shape}.")
    _check_partition(len(label_array), num_parts, min_size)
    if not alpha > 0:
        raise ConfigError(f"alpha must be > 0, got {alpha}.")
    if max_tries < 1:
        raise ConfigError(f"max_tries must be at least 1, got {max_tries}.")
    if units is not None:
        return _dirichlet_people(label_array, units, num_parts, alpha, seed, min_size, max_tries)
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


def _dirichlet_people(
    labels: np.ndarray,
    units: Sequence[Hashable],
    num_parts: int,
    alpha: float,
    seed: int,
    min_size: int,
    max_tries: int,
) -> list[np.ndarray]:
    people = _people(units, len(labels))
    _check_people(len(people), num_parts)
    person_labels = np.asarray([_majority(labels[rows]) for rows in people])
    sizes = [len(rows) for rows in people]
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        parts = _dirichlet_draw(person_labels, num_parts, alpha, rng)
        if all(sum(sizes[p] for p in part) >= min_size for part in parts):
            break
    else:
        logger.warning(
            "No Dirichlet(alpha=%g) draw out of %d left every one of %d parts with at least %d "
            "rows; moving whole people into the short parts.",
            alpha,
            max_tries,
            num_parts,
            min_size,
        )
        _fill_short_parts_with_people(parts, sizes, min_size)
    return _rows_of(people, parts)


def _majority(labels: np.ndarray) -> int:
    """The most frequent label, the smallest of the tied ones on a tie."""
    counts = Counter(labels.tolist())
    return int(min(counts, key=lambda label: (-counts[label], label)))


def _fill_short_parts_with_people(
    parts: list[list[int]], sizes: Sequence[int], min_size: int
) -> None:
    def rows(part: list[int]) -> int:
        return sum(sizes[p] for p in part)

    for part in parts:
        while rows(part) < min_size:
            donor = max(parts, key=rows)
            smallest = min(sizes[p] for p in donor)
            position = max(i for i, p in enumerate(donor) if sizes[p] == smallest)
            if donor is part or rows(donor) - smallest < min_size:
                raise ConfigError(
                    f"Cannot give each of {len(parts)} parts at least {min_size} rows while "
                    "keeping every person's rows in one part. Use fewer parts, a smaller "
                    "batch-size, or a larger dirichlet-alpha."
                )
            part.append(donor.pop(position))
