"""bench/people.py: the person-level study's training files (synthetic Zipf people, askers of
medical question pairs, the group baseline's cap of k records per person)."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers.bench import bench_module


@pytest.fixture(scope="module")
def people():
    yield from bench_module("people")


def _rows(n):
    return [{"text": f"t{i}", "label": i % 2} for i in range(n)]


def test_zipf_people_cover_every_row_once_with_sizes_in_range(people):
    rows = _rows(5000)
    out = people.zipf_people(rows, exponent=2.0, max_records=50, seed=3)
    assert sorted(r["text"] for r in out) == sorted(r["text"] for r in rows)
    sizes = Counter(r["patient_id"] for r in out).values()
    assert max(sizes) <= 50 and min(sizes) >= 1
    singles = sum(1 for s in sizes if s == 1) / len(sizes)
    # P(c = 1) = 1 / sum_{c <= 50} c^-2 = 0.620: within 4 standard errors of the draw
    assert singles == pytest.approx(0.620, abs=4 * (0.62 * 0.38 / len(sizes)) ** 0.5)
    assert people.zipf_people(rows, exponent=2.0, max_records=50, seed=3) == out  # seeded


def test_askers_group_pairs_by_their_first_question(people):
    rows = [
        {"text_a": "q1", "text_b": "x", "label": 1},
        {"text_a": "q1", "text_b": "y", "label": 0},
        {"text_a": "q2", "text_b": "z", "label": 1},
    ]
    ids = [r["patient_id"] for r in people.askers(rows)]
    assert ids[0] == ids[1] != ids[2]


def test_the_cap_keeps_at_most_k_records_of_each_person_and_everyone(people):
    rows = people.zipf_people(_rows(3000), exponent=1.5, max_records=50, seed=0)
    capped = people.cap_records(rows, 4, seed=0)
    before, after = Counter(r["patient_id"] for r in rows), Counter(r["patient_id"] for r in capped)
    assert set(after) == set(before)
    assert all(after[p] == min(before[p], 4) for p in before)
