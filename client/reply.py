"""What a site sends for a round: the reply, the digest that identifies the broadcast it answers,
its facts (``prism_runtime.facts.ReplyFacts``: a release or a refusal), and what the facts read
from the mechanism's own records."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from flwr.app import ConfigRecord
from torch import Tensor

from client.site_ledger import SiteLedger
from prism_core.accounting import compose_events
from prism_core.records import ADJACENCY, DEFAULT_UNIT, SAMPLING, PrivacyEvent
from prism_runtime.errors import AccountingMismatchError
from prism_runtime.facts import ClipEstimate, ReplyFacts
from prism_runtime.protocol import REFUSAL_REASONS, STATUS_OK, STATUS_REFUSED

__all__ = [
    "RoundReply",
    "SiteFacts",
    "broadcast_digest",
    "facts_record",
    "noise_scales",
    "refuse",
    "released_event",
]

log = logging.getLogger(__name__)


def facts_record(facts: ReplyFacts, nonce: str) -> ConfigRecord:
    """``facts`` as a reply's record, with the nonce of the message it answers: the coordinator
    tells a fresh answer (also a stored reply the site resends) from a replay of an earlier
    round's by it."""
    return ConfigRecord(replace(facts, round_nonce=nonce).to_record())


@dataclass
class RoundReply:
    """A site's answer to one round: arrays to send and accounting facts."""

    arrays: dict[str, Tensor]
    accounting: ReplyFacts
    nonprivate: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SiteFacts:
    """What every reply of a site states about it for one run, fixed when the site starts.

    Attributes:
        site_id: the site.
        delta: the delta this run spends at (the site's own when it refuses the run).
        epsilon_cap: the epsilon this run may spend (the site's own when it refuses the run).
        rng: where the site's randomness comes from (``client.policy.SitePolicy.rng``).
        num_examples: N in the site's unit (records, or people), or None when the site does not
            share it.
        mechanism: the ``PrivacyEvent.mechanism`` of the site's method.
        sigma: the noise multiplier of the run's steps (0 for a refused or non-private run).
        sample_rate: q of the site's Poisson sampler.
        unit: the privacy unit of the site's guarantee for this run (``record`` or ``user``;
            a site refusing a run's unit states its own policy's).
    """

    site_id: str
    delta: float
    epsilon_cap: float
    rng: str
    num_examples: int | None
    mechanism: str
    sigma: float
    sample_rate: float
    unit: str = DEFAULT_UNIT

    def released(
        self,
        server_round: int,
        event: PrivacyEvent,
        *,
        spent: float,
        scales: tuple[float, float] | None = None,
        quantile: PrivacyEvent | None = None,
    ) -> ReplyFacts:
        """The facts of an ``ok`` reply that released ``event`` (its Skellam part included).

        Args:
            server_round: the round answered.
            event: the round's released event (``released_event``).
            spent: epsilon on the site's ledger at ``delta``, this round's charges included.
            scales: C and b of the steps (``noise_scales``); None for a non-private round.
            quantile: the event of a private clip estimate charged this round.
        """
        max_norm, batch = (None, None) if scales is None else scales
        estimate = None
        if quantile is not None:
            estimate = ClipEstimate(
                float(quantile.noise_multiplier), float(quantile.sample_rate), int(quantile.steps)
            )
        return self._facts(
            server_round,
            STATUS_OK,
            "",
            spent=spent,
            mechanism=event.mechanism,
            unit=event.unit,
            sigma=float(event.noise_multiplier),
            q=float(event.sample_rate),
            steps=int(event.steps),
            max_norm=max_norm,
            expected_batch_size=batch,
            quantile=estimate,
            secure=event.secure,
        )

    def refused(self, server_round: int, reason: str, *, spent: float) -> ReplyFacts:
        """The facts of a refusal with the ``REFUSAL_REASONS`` code ``reason``: nothing ran
        (0 steps), the mechanism the site would have run."""
        return self._facts(
            server_round,
            STATUS_REFUSED,
            reason,
            spent=spent,
            mechanism=self.mechanism,
            unit=self.unit,
            sigma=float(self.sigma),
            q=float(min(self.sample_rate, 1.0)),
            steps=0,
        )

    def _facts(
        self, server_round: int, status: str, reason: str, *, spent: float, **event: Any
    ) -> ReplyFacts:
        """Facts every reply carries: who, what happened, the budget, where randomness came
        from; ``event``: the facts of what ran."""
        return ReplyFacts(
            site_id=self.site_id,
            status=status,
            reason=reason,
            server_round=server_round,
            delta=float(self.delta),
            epsilon_cap=float(self.epsilon_cap),
            epsilon=float(spent),
            rng=self.rng,
            num_examples=self.num_examples,
            adjacency=ADJACENCY,
            sampling=SAMPLING,
            **event,
        )


def refuse(facts: SiteFacts, ledger: SiteLedger, server_round: int, reason: str) -> RoundReply:
    """A refusal with its ``REFUSAL_REASONS`` code: nothing was charged, nothing is sent; the
    facts report the site's current spend (the ledger is read again)."""
    log.warning(
        "site %s refuses round %d (%s): %s",
        facts.site_id,
        server_round,
        reason,
        REFUSAL_REASONS[reason],
    )
    ledger.reload()
    return RoundReply({}, facts.refused(server_round, reason, spent=ledger.epsilon(facts.delta)))


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


def noise_scales(records: Sequence[PrivacyEvent]) -> tuple[float, float] | None:
    """C (``max-norm``) and b (``expected-batch-size``) of a round's records, for the
    coordinator's noise-aware weights ``(b / (sigma C))^2``; None for a non-private round.

    Raises:
        AccountingMismatchError: the round's steps used different C or b.
    """
    scales = {(r.max_norm, r.expected_batch_size) for r in records}
    if not scales:
        return None
    if len(scales) != 1:
        raise AccountingMismatchError(f"the round's steps used different (C, b): {sorted(scales)}")
    ((max_norm, expected),) = scales
    if max_norm is None or expected is None:
        raise AccountingMismatchError("the round's mechanism records lack their C or b")
    return float(max_norm), float(expected)
