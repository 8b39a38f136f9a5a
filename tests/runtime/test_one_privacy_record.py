"""A privacy event has one record type, ``prism_core.records.PrivacyEvent``, from the mechanism
to the coordinator's ledger: the mechanisms return it, the trainer keeps it, both ledgers store
it."""

from __future__ import annotations

import typing

from client.site_ledger import SiteLedgerEntry
from prism_core import baselines, mechanism, quantile, records
from prism_runtime import trainer
from server.ledger import LedgerEvent


def test_every_mechanism_the_trainer_and_both_ledgers_hold_the_one_record() -> None:
    returned = [
        typing.get_type_hints(mechanism.PrivateStep)["record"],
        typing.get_type_hints(baselines.factor_privatize)["return"],
        typing.get_type_hints(quantile.noisy_fraction_below)["return"],
        typing.get_type_hints(trainer.StepResult)["record"],
    ]
    assert all(records.PrivacyEvent in (hint, *typing.get_args(hint)) for hint in returned)
    assert typing.get_type_hints(SiteLedgerEntry)["event"] is records.PrivacyEvent
    assert typing.get_type_hints(LedgerEvent)["event"] is records.PrivacyEvent
