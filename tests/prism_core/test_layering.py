"""A step's record has one definition, outside the tensor code (the import contracts in
pyproject.toml, run by ``make lint``, keep accounting from importing the mechanisms)."""

from __future__ import annotations


def test_the_record_has_one_definition() -> None:
    import prism_core
    import prism_core.accounting
    import prism_core.mechanism
    from prism_core.records import ADJACENCY, NoiseRecord

    assert prism_core.NoiseRecord is prism_core.mechanism.NoiseRecord is NoiseRecord
    assert prism_core.mechanism.ADJACENCY is ADJACENCY
    assert prism_core.accounting.NoiseRecord is NoiseRecord
