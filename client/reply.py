"""What a site sends for a round: the reply, the digest that identifies the broadcast it answers,
and the accounting facts read from the mechanism's own records."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from prism_core.accounting import compose_events
from prism_core.records import PrivacyEvent
from prism_runtime.errors import AccountingMismatchError


@dataclass
class RoundReply:
    """A site's answer to one round: arrays to send and accounting facts."""

    arrays: dict[str, Tensor]
    accounting: dict[str, Any]
    nonprivate: dict[str, float] = field(default_factory=dict)


def broadcast_digest(arrays: dict[str, Tensor]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of the broadcast arrays (sorted)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        t = arrays[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def released_event(records: Sequence[PrivacyEvent], mechanism: str) -> PrivacyEvent:
    """The one privacy event a round's mechanism records describe (Thm 3.4: tau equal steps).

    Raises:
        AccountingMismatchError: no records, records of another mechanism, or steps with
            different parameters (a round charges ONE event: sigma, q, tau).
    """
    events = compose_events(records)
    kinds = sorted({r.mechanism for r in records})
    if len(events) != 1 or kinds != [mechanism]:
        raise AccountingMismatchError(
            f"the round's mechanism records are not one {mechanism!r} event: mechanisms {kinds}, "
            f"events {events}"
        )
    return events[0]


def noise_scale_facts(records: Sequence[PrivacyEvent]) -> dict[str, float]:
    """``max-norm`` (C) and ``expected-batch-size`` (b) of a round's records, for the coordinator's
    noise-aware weights ``(b / (sigma C))^2``; empty for a non-private round.

    Raises:
        AccountingMismatchError: the round's steps used different C or b.
    """
    scales = {(r.max_norm, r.expected_batch_size) for r in records}
    if not scales:
        return {}
    if len(scales) != 1:
        raise AccountingMismatchError(f"the round's steps used different (C, b): {sorted(scales)}")
    ((max_norm, expected),) = scales
    if max_norm is None or expected is None:
        raise AccountingMismatchError("the round's mechanism records lack their C or b")
    return {"max-norm": float(max_norm), "expected-batch-size": float(expected)}
