"""Person-level batches (docs/design.md §3.2): Poisson sampling of PEOPLE, a random chunk of at
most k records of each, and micro-batches of at most a fixed number of rows whoever is sampled.

Each step includes every person independently with probability ``q = b_u / N_users`` (Opacus'
``UniformWithReplacementSampler`` over people, so the accountant's Poisson assumption holds for
people) and takes, of each sampled person with more than ``k`` records, ``k`` of them chosen
uniformly at random without replacement, afresh at every step (User-wise DP-SGD with random
chunks, Chua et al. 2024, arXiv:2406.14322; Charles et al. 2024, arXiv:2407.07737). Both draws
come from the site's generator only. A batch holds the rows of one person contiguously and a
``unit`` tensor (``UNIT_KEY``): row ``i`` belongs to the batch's person ``unit[i]``, numbered
0, 1, ... in the order of the rows. The trainer sums a person's per-record gradients into one
contribution before the clip (``prism_runtime.trainer.dp.UnitFold``), across micro-batches for a
person with more records than one micro-batch holds (``unit_micro_batches``, ``OPEN_KEY``).

With one record per person, in row order, the batches are those of ``poisson_loader`` with the
same generator, draw for draw.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from prism_runtime.data.batching import _check_empty_collate, _trim_padding, length_groups
from prism_runtime.data.reading import Collate, person_id
from prism_runtime.errors import ConfigError, DataError

__all__ = [
    "OPEN_KEY",
    "UNIT_KEY",
    "UserPoissonSampler",
    "packed_groups",
    "person_records",
    "unit_index",
    "unit_micro_batches",
    "user_poisson_loader",
]

logger = logging.getLogger(__name__)

UNIT_KEY = "unit"
"""The batch key of the per-row person index (0..P-1 within the batch, rows of one person
contiguous). The model never reads it (``prism_runtime.trainer.per_example_loss``)."""
OPEN_KEY = "unit_open"
"""The micro-batch key (``unit_micro_batches``), (B,) bool: True on the rows of the micro-batch's
last person when more of that person's rows follow in the next micro-batch, False elsewhere. The
model never reads it."""


def person_records(units: Sequence[Hashable]) -> list[list[int]]:
    """The row indices of each person: ``units[i]`` is row i's person id; people in the order of
    their first row, each person's rows in row order. Text and integer ids count in their one
    spelling (``prism_runtime.data.reading.person_id``: ``7``, ``"7"`` and ``" 007"`` are one
    person), other hashable ids as they are.

    Raises:
        DataError: a row without a person (``None``, or text that is empty once trimmed), or an
            id that is not hashable.
    """
    rows: dict[Hashable, list[int]] = {}
    missing = 0
    for index, given in enumerate(units):
        unit = _spelt(given)
        if unit is None:
            missing += 1
            continue
        try:
            rows.setdefault(unit, []).append(index)
        except TypeError as err:
            raise DataError(
                f"row {index}: a person id must be hashable (a string or an integer), got "
                f"{type(unit).__name__}"
            ) from err
    if missing:
        raise DataError(
            f"{missing} of {len(units)} rows have no person id: person-level privacy needs the "
            "person of every row"
        )
    return list(rows.values())


def _spelt(unit: Hashable) -> Hashable:
    """``person_id`` of a text or integer id (not a bool); any other id as it is."""
    if isinstance(unit, str) or (isinstance(unit, numbers.Integral) and not isinstance(unit, bool)):
        return person_id(unit if isinstance(unit, str) else int(unit))
    return unit


def unit_index(counts: Sequence[int]) -> Tensor:
    """The ``unit`` tensor of a batch whose consecutive people have ``counts`` rows: (sum,)
    long, ``[0] * counts[0] + [1] * counts[1] + ...``."""
    return torch.repeat_interleave(
        torch.arange(len(counts)), torch.as_tensor(list(counts), dtype=torch.long)
    )


class UserPoissonSampler(Sampler[list[int]]):
    """Batches of rows: Poisson-sampled people, a random chunk of at most ``max_records`` each.

    Every step draws, from ``generator`` only, a Bernoulli(``sample_rate``) inclusion of every
    person (Opacus' ``UniformWithReplacementSampler`` over people: ``torch.rand(N_users) < q``)
    and then, for each included person with more than ``max_records`` rows, a uniformly random
    subset of ``max_records`` of them (``torch.randperm``), a fresh one at every step. A batch
    lists its people in index order, each person's rows contiguous and in row order. One pass
    is ``int(1 / sample_rate)`` batches (Opacus' convention).

    Args:
        records: the row indices of each person (``person_records``), none empty.
        sample_rate: ``q``, each person's inclusion probability, in (0, 1].
        max_records: ``k >= 1``, the most rows one person contributes to a batch.
        generator: the source of every draw.
    """

    def __init__(
        self,
        records: Sequence[Sequence[int]],
        *,
        sample_rate: float,
        max_records: int,
        generator: torch.Generator,
    ) -> None:
        if not records or any(not rows for rows in records):
            raise ConfigError("person-level sampling needs at least one person, each with a row")
        if not 0 < sample_rate <= 1:
            raise ConfigError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if max_records < 1:
            raise ConfigError(f"max_records must be at least 1, got {max_records}")
        self.records = [list(rows) for rows in records]
        self.sample_rate, self.max_records, self.generator = sample_rate, max_records, generator
        self._people = UniformWithReplacementSampler(
            num_samples=len(self.records), sample_rate=sample_rate, generator=generator
        )

    def __len__(self) -> int:
        return len(self._people)

    def __iter__(self) -> Iterator[list[int]]:
        for people in self._people:
            yield [row for person in people for row in self.chunk(person)]

    def chunk(self, person: int) -> list[int]:
        """The rows ``person`` contributes to this batch: all of them if at most ``max_records``,
        else ``max_records`` chosen uniformly without replacement (in row order)."""
        rows = self.records[person]
        if len(rows) <= self.max_records:
            return rows
        chosen = torch.randperm(len(rows), generator=self.generator)[: self.max_records]
        return [rows[i] for i in sorted(chosen.tolist())]


@dataclass(frozen=True)
class _RowsWithPerson(Dataset[tuple[Any, int]]):
    """``dataset``'s item i together with its person's index ``person[i]``."""

    dataset: Dataset[Any]
    person: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.person)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.dataset[index], self.person[index]


@dataclass(frozen=True)
class _UnitCollate:
    """``collate`` of the items plus the ``unit`` tensor of their (contiguous) people."""

    collate: Collate

    def __call__(self, batch: Sequence[tuple[Any, int]]) -> dict[str, Tensor]:
        out = dict(self.collate([item for item, _ in batch]))
        counts: list[int] = []
        previous = None
        for _, person in batch:
            if person != previous:
                counts.append(0)
                previous = person
            counts[-1] += 1
        out[UNIT_KEY] = unit_index(counts)
        return out


def user_poisson_loader(
    dataset: Dataset[Any],
    records: Sequence[Sequence[int]],
    *,
    expected_users: int,
    max_records: int,
    collate_fn: Collate,
    generator: torch.Generator,
    sample_rate: float | None = None,
) -> tuple[DataLoader[Any], float]:
    """Person-level Poisson batches of ``dataset``: rate ``q = expected_users / N_users``.

    A ``torch.utils.data.DataLoader`` over ``UserPoissonSampler`` (in the place of Opacus'
    ``DPDataLoader``, with the same generator for the sampler and the loader): each batch is
    ``collate_fn`` of its rows plus ``batch[UNIT_KEY]``, the person index of every row. A batch
    may be empty (0 rows, a 0-length ``unit``).

    Args:
        dataset: a map-style dataset, e.g. :class:`TokenizedDataset`.
        records: the row indices of each person (``person_records``).
        expected_users: ``b_u``, the expected number of people per batch, in ``[1, N_users]``.
        max_records: ``k``, the most records of one person in a batch.
        collate_fn: batch builder that returns 0-row tensors for an empty list.
        generator: the source of every draw.
        sample_rate: ``q`` itself, in ``(0, 1]`` (one public rate for every site of a
            secure-aggregation run); ``expected_users`` is then not used.

    Returns:
        The loader and ``q``, the sample rate over PEOPLE to record in the privacy ledger.

    Raises:
        ConfigError: no people, ``expected_users`` out of range, ``max_records < 1``, or
            ``collate_fn`` fails on an empty batch.
    """
    users = len(records)
    if users == 0:
        raise ConfigError("The dataset has no people: there is nothing to sample.")
    if sample_rate is not None and not 0 < sample_rate <= 1:
        raise ConfigError(f"the sample rate must be in (0, 1], got {sample_rate}.")
    if sample_rate is None and not 1 <= expected_users <= users:
        raise ConfigError(
            f"the expected number of people per batch must be between 1 and the number of "
            f"people {users}, got {expected_users}. Lower batch_size or give this site more "
            "people."
        )
    person = [-1] * len(dataset)  # type: ignore[arg-type]
    for index, rows in enumerate(records):
        for row in rows:
            person[row] = index
    _check_empty_collate(collate_fn)
    if sample_rate is None:
        sample_rate = expected_users / users
    sampler = UserPoissonSampler(
        records, sample_rate=sample_rate, max_records=max_records, generator=generator
    )
    loader: DataLoader[Any] = DataLoader(
        _RowsWithPerson(dataset, tuple(person)),
        batch_sampler=sampler,
        collate_fn=_UnitCollate(collate_fn),
        generator=generator,
    )
    logger.debug(
        "person-level Poisson loader: N_users=%d, q=%.6g, k=%d, %d batches per pass",
        users,
        sample_rate,
        max_records,
        len(loader),
    )
    return loader, sample_rate


def unit_micro_batches(
    batch: Mapping[str, Tensor],
    micro_batch_size: int,
    *,
    trim_padding: bool = True,
    by_length: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Split a person-level batch into micro-batches of at most ``micro_batch_size`` rows.

    A micro-batch holds consecutive whole people with at most ``micro_batch_size`` rows in all;
    a person with more rows (up to ``max-records-per-user``) is split into consecutive
    micro-batches of their own, ``micro_batch_size`` rows each but the last, each one but the
    last marked open (``OPEN_KEY``): the trainer adds the person's rows up across them before
    the clip. So the memory of a micro-batch is bounded whoever was sampled. Its ``unit`` is
    renumbered 0..P'-1. With ``by_length`` the people are ordered by their longest row and
    grouped by ``length_groups`` (as ``micro_batches`` does with rows): the clipped SUM does
    not depend on the order or grouping of its terms, and each person's terms stay together.

    Args:
        batch: a collated batch with ``batch[UNIT_KEY]`` (``user_poisson_loader``): (B,) long,
            0..P-1, non-decreasing, rows of one person contiguous.
        micro_batch_size: the most rows per micro-batch (a person with more is alone).
        trim_padding: drop trailing all-padding columns of every micro-batch.
        by_length: length-aware grouping of the people.

    Yields:
        Dicts with the keys of ``batch`` and ``OPEN_KEY``; every row in exactly one of them,
        a person's rows in one or in consecutive ones.

    Raises:
        ConfigError: ``micro_batch_size < 1``.
        ValueError: no ``unit``, a ``unit`` that is not 0..P-1 in contiguous runs, or tensors
            that disagree on their first dimension.
    """
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be at least 1, got {micro_batch_size}.")
    if UNIT_KEY not in batch:
        raise ValueError(f"a person-level batch needs its {UNIT_KEY!r} tensor (each row's person)")
    sizes = {key: int(value.shape[0]) for key, value in batch.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"Batch tensors disagree on the batch dimension: {sizes}.")
    unit = batch[UNIT_KEY]
    total = int(unit.shape[0])
    if total == 0:
        return
    counts = _unit_counts(unit)
    people = len(counts)
    mask = batch.get("attention_mask")
    if by_length and people > 1 and mask is not None and mask.ndim >= 2:
        lengths = mask.ne(0).reshape(total, -1, mask.shape[-1]).sum(dim=-1).amax(dim=1)
        longest = torch.zeros(people, dtype=lengths.dtype, device=lengths.device)
        longest = longest.scatter_reduce(0, unit.to(lengths.device), lengths, reduce="amax")
        order = torch.argsort(longest, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(people, device=order.device)
        new_unit = rank[unit.to(rank.device)]
        rows = torch.argsort(new_unit, stable=True)
        batch = {key: value[rows.to(value.device)] for key, value in batch.items()}
        unit = new_unit[rows].to(unit.device)
        counts = [counts[i] for i in order.tolist()]
        groups = length_groups(longest[order].tolist(), micro_batch_size, counts=counts)
    else:
        groups = packed_groups(counts, micro_batch_size)
    start = person = 0
    for size in groups:
        rows_in = sum(counts[person : person + size])
        pieces = range(0, rows_in, micro_batch_size) if rows_in > micro_batch_size else [0]
        for offset in pieces:  # several only for one person with more rows than fit
            end = min(offset + micro_batch_size, rows_in) if rows_in > micro_batch_size else rows_in
            micro = {key: value[start + offset : start + end] for key, value in batch.items()}
            micro[UNIT_KEY] = unit[start + offset : start + end] - person
            micro[OPEN_KEY] = torch.full_like(micro[UNIT_KEY], end < rows_in, dtype=torch.bool)
            yield _trim_padding(micro) if trim_padding else micro
        start, person = start + rows_in, person + size


def _unit_counts(unit: Tensor) -> list[int]:
    """Rows of each person of a ``unit`` tensor; refuses one that is not 0..P-1 in runs."""
    values, counts = torch.unique_consecutive(unit.cpu(), return_counts=True)
    if not torch.equal(values, torch.arange(len(values), dtype=values.dtype)):
        raise ValueError(
            f"{UNIT_KEY!r} must number the people 0..P-1 in order with each person's rows "
            "contiguous (as user_poisson_loader builds it)"
        )
    return [int(c) for c in counts]


def packed_groups(counts: Sequence[int], cap: int) -> list[int]:
    """Items per group, in order: as many consecutive items of ``counts`` rows as fit in ``cap``
    rows together, or one item alone that has more (people per micro-batch here; micro-batches
    per clip in ``PrismTrainer``)."""
    groups: list[int] = []
    rows = 0
    for count in counts:
        if groups and rows + count <= cap:
            groups[-1] += 1
            rows += count
        else:
            groups.append(1)
            rows = count
    return groups
