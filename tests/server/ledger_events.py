"""Test helper: a coordinator ledger event from flat keywords (the ledger's column names).

``sigma``, ``q``, ``steps``, ``mechanism``, ``sampling``, ``adjacency``, ``unit``,
``honest_sites`` and ``share_sigma`` build the event's one ``PrivacyEvent``; every other keyword
is a ``LedgerEvent`` field.
"""

from __future__ import annotations

from typing import Any

from prism_core.records import PrivacyEvent
from server.ledger import LedgerEvent

_EVENT_KEYS = {
    "sigma": "noise_multiplier",
    "q": "sample_rate",
    "steps": "steps",
    "mechanism": "mechanism",
    "sampling": "sampling",
    "adjacency": "adjacency",
    "unit": "unit",
    "honest_sites": "honest_sites",
    "share_sigma": "share_sigma",
}


def ledger_event(**kw: Any) -> LedgerEvent:
    """``LedgerEvent`` of ``kw``: the event's keys go to its ``PrivacyEvent``."""
    event = {_EVENT_KEYS[k]: kw.pop(k) for k in list(kw) if k in _EVENT_KEYS}
    return LedgerEvent(event=PrivacyEvent(**event), **kw)
