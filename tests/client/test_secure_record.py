"""The site's durable record of its secure round's one-shot decisions (client.secure_record)."""

from __future__ import annotations

import json
import stat

import pytest

from client.secure_record import SecureRecord
from prism_runtime.secure_sum import MasksUsedError, RoundDecisions, RoundId

ROUND = RoundId("run-3", 7)


def test_the_record_round_trips_privately_and_names_its_round(tmp_path):
    record = SecureRecord(tmp_path)
    decisions = RoundDecisions("ab" * 32, 3, frozenset({"a", "b", "c"}), frozenset({"a", "c"}))
    record.keep(ROUND, decisions)
    assert record.load() == decisions
    assert stat.S_IMODE(record.path.stat().st_mode) == 0o600
    stored = json.loads(record.path.read_text())
    assert (stored["run-id"], stored["round"]) == ("run-3", 7)
    assert stored["participants"] == ["a", "b", "c"] and stored["survivors"] == ["a", "c"]
    fresh = RoundDecisions("cd" * 32, None, None, None)
    record.keep(RoundId("run-3", 8), fresh)  # a new round replaces the record
    assert record.load() == fresh


@pytest.mark.parametrize(
    "content",
    [
        None,
        b"",
        b"{not json",
        b"[]",
        b'{"masks": "x"}',
        b'{"masks": "x", "threshold": true, "participants": null, "survivors": null}',
    ],
)
def test_a_missing_or_unreadable_record_decides_nothing_more(tmp_path, content):
    record = SecureRecord(tmp_path)
    if content is not None:
        record.path.write_bytes(content)
    with pytest.raises(MasksUsedError, match="no readable record"):
        record.load()
