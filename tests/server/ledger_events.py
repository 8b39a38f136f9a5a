"""Test helper: a coordinator ledger event from flat keywords (the ledger's column names).

``sigma``, ``q``, ``steps``, ``mechanism`` and ``unit`` build the event's one ``PrivacyEvent``,
``honest_sites`` and ``share_sigma`` its ``SkellamShare``; every other keyword is a
``LedgerEvent`` field.
"""

from __future__ import annotations

from typing import Any

from prism_core.records import PrivacyEvent, SkellamShare
from server.ledger import LedgerEvent

_EVENT_KEYS = {
    "sigma": "noise_multiplier",
    "q": "sample_rate",
    "steps": "steps",
    "mechanism": "mechanism",
    "unit": "unit",
}
_SECURE_KEYS = ("honest_sites", "share_sigma")


def ledger_event(**kw: Any) -> LedgerEvent:
    """``LedgerEvent`` of ``kw``: the event's keys go to its ``PrivacyEvent``."""
    event = {_EVENT_KEYS[k]: kw.pop(k) for k in list(kw) if k in _EVENT_KEYS}
    if any(k in kw for k in _SECURE_KEYS):
        event["secure"] = SkellamShare(*(kw.pop(k) for k in _SECURE_KEYS))
    return LedgerEvent(event=PrivacyEvent(**event), **kw)
