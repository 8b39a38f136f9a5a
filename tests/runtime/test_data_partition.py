"""prism_runtime.data.partition with a person id per row: every person's rows land in one part,
deterministically in the seed; without person ids the splits are the record-level ones."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from conftest import shared_data_file

from prism_runtime.data import dirichlet_partition, iid_partition, load_examples
from prism_runtime.errors import ConfigError, DataError

SEEDS = (0, 1, 2, 3, 4)


def _digest(parts: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(np.asarray(part, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def _assert_people_whole(parts: list[np.ndarray], units: Sequence[object]) -> None:
    joined = np.concatenate(parts)
    assert np.array_equal(np.sort(joined), np.arange(len(units)))  # every row exactly once
    assert all(len(part) > 0 for part in parts)
    owner: dict[object, int] = {}
    for k, part in enumerate(parts):
        for row in part.tolist():
            assert owner.setdefault(units[row], k) == k, f"person {units[row]} split"


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _heavy_tailed(seed: int, people: int = 60) -> tuple[list[int], list[int]]:
    """Labels and person ids of rows whose counts per person are Zipf(1.6), capped at 200, the
    rows of the people interleaved at random."""
    rng = np.random.default_rng(seed)
    counts = np.minimum(rng.zipf(1.6, people), 200)
    units = rng.permutation(np.repeat(np.arange(people), counts)).tolist()
    labels = rng.integers(0, 4, len(units)).tolist()
    return labels, units


# ------------------------------------------------------------------- unchanged without person ids


def test_without_person_ids_the_splits_are_the_record_level_ones() -> None:
    """Digests of the record-level splits as the partitioners give them without ``units``."""
    labels = np.random.default_rng(7).integers(0, 4, 500)
    iid = {0: "b271abc74d3c3766", 1: "b61eb87fa185715d", 2: "9b82f2738f712168"}
    dirichlet = {0: "9862e2bd55e5cb0b", 1: "4e707122524f71da", 2: "da578db0a0ec99c5"}
    for seed in iid:
        assert _digest(iid_partition(500, 7, seed)) == iid[seed]
        assert _digest(dirichlet_partition(labels, 5, 0.3, seed, min_size=20)) == dirichlet[seed]
    filled = dirichlet_partition(labels, 8, 0.01, 3, min_size=30, max_tries=2)
    assert _digest(filled) == "40efcca10984d7bb"


@pytest.mark.parametrize("seed", SEEDS)
def test_one_row_per_person_in_row_order_is_the_record_level_split(seed: int) -> None:
    labels = np.random.default_rng(seed).integers(0, 3, 120)
    singles = list(range(120))
    assert _same(iid_partition(120, 5, seed, units=singles), iid_partition(120, 5, seed))
    for min_size, tries in [(1, 100), (20, 100), (22, 1)]:  # the last one rebalances
        assert _same(
            dirichlet_partition(labels, 5, 0.05, seed, min_size=min_size, max_tries=tries),
            dirichlet_partition(
                labels, 5, 0.05, seed, min_size=min_size, max_tries=tries, units=singles
            ),
        )


# ------------------------------------------------------------------------ people are never split


@pytest.fixture(scope="module")
def medical_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The medical question pairs, each row with its doctor ``dr_id`` as the person."""
    path = shared_data_file("medical_questions_pairs/train.jsonl")
    return load_examples(path, "seq-cls", user_field="dr_id")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_a_doctor_of_the_medical_pairs_is_never_split(
    medical_rows: list[dict[str, Any]], seed: int, parts: int
) -> None:
    units = [row["user"] for row in medical_rows]
    labels = [int(row["label"]) for row in medical_rows]
    assert len(set(units)) > parts
    iid = iid_partition(len(units), parts, seed, units=units)
    _assert_people_whole(iid, units)
    people = sorted(len({units[i] for i in part.tolist()}) for part in iid)
    assert people[-1] - people[0] <= 1  # the people, not the rows, are spread evenly
    assert _same(iid, iid_partition(len(units), parts, seed, units=units))
    skewed = dirichlet_partition(labels, parts, 0.3, seed, min_size=32, units=units)
    _assert_people_whole(skewed, units)
    assert min(map(len, skewed)) >= 32
    assert _same(skewed, dirichlet_partition(labels, parts, 0.3, seed, min_size=32, units=units))


@pytest.mark.parametrize("seed", SEEDS)
def test_heavy_tailed_people_are_never_split(seed: int) -> None:
    labels, units = _heavy_tailed(seed)
    for parts in (2, 4, 8):
        _assert_people_whole(iid_partition(len(units), parts, seed, units=units), units)
        # (0.05, 40) with one draw: the short parts are filled by moving whole people.
        for alpha, min_size, tries in [(0.05, 1, 3), (0.5, 1, 3), (100.0, 8, 3), (0.05, 40, 1)]:
            try:
                result = dirichlet_partition(
                    labels, parts, alpha, seed, min_size=min_size, max_tries=tries, units=units
                )
            except ConfigError as err:  # only a split that whole people cannot mend
                assert "keeping every person's rows in one part" in str(err)
                continue
            _assert_people_whole(result, units)
            assert min(map(len, result)) >= min_size


def test_a_persons_class_is_their_majority_label() -> None:
    """Each person's first row disagrees with their majority label: the split follows the
    majority (the smallest label on a tie), so it equals the split of majority-labelled rows."""
    units = [p for p in range(30) for _ in range(5)]
    majority = [p % 3 for p in units]
    labels = [(y + 1) % 3 if i % 5 == 0 else y for i, y in enumerate(majority)]
    tie_units = [0, 0, 1, 1, *units]
    for seed in SEEDS:
        assert _same(
            dirichlet_partition(labels, 4, 0.1, seed, units=units),
            dirichlet_partition(majority, 4, 0.1, seed, units=units),
        )
        assert _same(  # persons 0 and 1 hold labels {2, 1} and {1, 2}: both count as class 1
            dirichlet_partition([2, 1, 1, 2, *labels], 4, 0.1, seed, units=tie_units),
            dirichlet_partition([1, 1, 1, 1, *labels], 4, 0.1, seed, units=tie_units),
        )


def test_person_partitions_refuse_what_they_cannot_split() -> None:
    with pytest.raises(ConfigError, match="Cannot split 2 people into 3 non-empty parts"):
        iid_partition(6, 3, 0, units=[0, 0, 0, 1, 1, 1])
    with pytest.raises(ConfigError, match="Cannot split 2 people into 3"):
        dirichlet_partition([0] * 6, 3, 1.0, 0, units=["a"] * 3 + ["b"] * 3)
    with pytest.raises(ConfigError, match="one person id per row: 2 ids, 3 rows"):
        iid_partition(3, 1, 0, units=[0, 1])
    with pytest.raises(DataError):
        iid_partition(3, 1, 0, units=[0, None, 1])
    # One person holds 20 of 24 rows: no move of whole people gives 3 parts 6 rows each.
    units = [0] * 20 + [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="at least 6 rows while keeping every person's"):
        dirichlet_partition([0] * 24, 3, 1.0, 0, min_size=6, max_tries=2, units=units)


def test_the_medical_pairs_file_groups_its_rows_by_doctor() -> None:
    """The fixture's premise: ``dr_id`` is an integer on every row, shared by many rows."""
    with shared_data_file("medical_questions_pairs/train.jsonl").open(encoding="utf-8") as f:
        ids = [json.loads(line)["dr_id"] for line in f]
    assert all(isinstance(i, int) for i in ids)
    assert len(set(ids)) < len(ids) / 50
