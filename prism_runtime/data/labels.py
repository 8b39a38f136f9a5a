"""The classes of ``seq-cls`` data: how many a file's labels make, and which rows lie outside them.

One rule for the coordinator (``num-labels = auto``) and ``prism-train`` (no ``--num-labels``):
the classes are 0..K-1 where K is the first label no row holds (at least 2, so binary data in
which one class is missing stays binary). A label above that gap is a stray, never a new class:
one stray ``7`` in a two-class file must not train an eight-class model. Errors name the rows
by their place in the file, never by their label.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from prism_runtime.errors import DataError

__all__ = ["check_labels", "class_count", "derived_class_count"]

MIN_CLASSES = 2
"""The fewest classes a ``seq-cls`` model has (``num-labels >= 2``)."""
ROWS_NAMED = 10
"""How many offending rows an error names before it says how many more there are."""


def class_count(labels: Sequence[int]) -> int:
    """K: the classes 0..K-1 the labels cover without a gap, at least ``MIN_CLASSES``."""
    present = set(labels)
    k = 0
    while k in present:
        k += 1
    return max(MIN_CLASSES, k)


def _rows(where: Sequence[str], indices: Sequence[int]) -> str:
    named = ", ".join(where[i] for i in indices[:ROWS_NAMED])
    more = len(indices) - ROWS_NAMED
    return named + (f" and {more} more" if more > 0 else "")


def check_labels(
    source: Path | str,
    labels: Sequence[int],
    where: Sequence[str],
    num_labels: int,
    *,
    fix: str,
) -> None:
    """Refuse labels outside 0..``num_labels`` - 1, naming their rows (``where``), not the labels.

    Raises:
        DataError: ``<source>: N row(s) hold a label outside 0..K-1 (line 3, ...). <fix>``.
    """
    outside = [i for i, label in enumerate(labels) if not 0 <= label < num_labels]
    if outside:
        count = f"{len(outside)} row holds" if len(outside) == 1 else f"{len(outside)} rows hold"
        raise DataError(
            f"{source}: {count} a label outside 0..{num_labels - 1} "
            f"({_rows(where, outside)}). {fix}"
        )


def derived_class_count(
    source: Path | str, labels: Sequence[int], where: Sequence[str], *, fix: str
) -> int:
    """``class_count`` of the labels, refusing any row above the classes (a stray label).

    Raises:
        DataError: rows hold a label above the gap after 0..K-1 (named by ``where``); ``fix``
            says which setting fixes the number of classes instead.
    """
    k = class_count(labels)
    check_labels(
        source,
        labels,
        where,
        k,
        fix=f"The other rows' labels are the classes 0..{k - 1} without a gap; a label above a "
        f"gap is taken for a mistake, not for a new class. Fix those rows' labels, or {fix}",
    )
    return k
