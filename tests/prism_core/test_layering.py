"""A step's record has one definition, outside the tensor code (the import contracts in
pyproject.toml, run by ``make lint``, keep accounting from importing the mechanisms)."""

from __future__ import annotations

from prism_core import accounting, mechanism, records


def test_the_record_has_one_definition() -> None:
    assert mechanism.PrivacyEvent is records.PrivacyEvent
    assert accounting.PrivacyEvent is records.PrivacyEvent
    assert mechanism.ADJACENCY is records.ADJACENCY
