"""prism_runtime.data.labels: the classes a file's labels make, and the rows outside them."""

from __future__ import annotations

import pytest

from prism_runtime.data.labels import ROWS_NAMED, check_labels, class_count, derived_class_count
from prism_runtime.errors import DataError


@pytest.mark.parametrize(
    ("labels", "k"),
    [
        ([0, 1, 1, 0], 2),
        ([1, 1], 2),  # binary data that lack a class stay binary
        ([0], 2),
        ([0, 1, 2], 3),
        ([2, 0, 1, 3, 3], 4),
        ([0, 2], 2),  # 2 lies above the gap at 1: a stray, not a class
        ([0, 1, 7], 2),
    ],
)
def test_the_classes_are_the_labels_up_to_the_first_gap(labels: list[int], k: int) -> None:
    assert class_count(labels) == k


def test_a_stray_label_is_refused_naming_rows_not_labels() -> None:
    labels = [0, 1, 0, 7, 1, 9]
    where = [f"line {i + 1}" for i in range(len(labels))]
    with pytest.raises(DataError) as info:
        derived_class_count("d.jsonl", labels, where, fix="set --num-labels.")
    message = str(info.value)
    assert message.startswith("d.jsonl: 2 rows hold a label outside 0..1 (line 4, line 6).")
    assert "classes 0..1 without a gap" in message and message.endswith("set --num-labels.")
    assert "7" not in message and "9" not in message
    assert derived_class_count("d.jsonl", [0, 2, 1], ["", "", ""], fix="") == 3


def test_many_rows_outside_are_counted_not_all_listed() -> None:
    labels = [5] * (ROWS_NAMED + 3)
    where = [f"row {i + 1}" for i in range(len(labels))]
    with pytest.raises(DataError) as info:
        check_labels("ds", labels, where, 2, fix="Fix them.")
    assert f"row {ROWS_NAMED} and 3 more)" in str(info.value)
    assert f"row {ROWS_NAMED + 1}" not in str(info.value)
    check_labels("ds", [0, 1, 1], ["", "", ""], 2, fix="")  # nothing outside: no error
