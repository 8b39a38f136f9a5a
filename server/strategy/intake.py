"""The reply intake: what every round kind does with a site's reply before its own ending.

One ``ReplyIntake`` per round, built by ``PrismStrategy.intake``. Per reply (``take``), in
order: an error reply is rejected (shown by its code's fixed text, never its reason); the
accounting facts are type- and range-checked (``ReplyFacts.parse``); the reply must come from a
node asked this round, carry this round's number and nonce, match the node's bound site id, and
be the site's first reply this round (``SiteBinding.check_origin``); its facts must match what
the coordinator configured (``RunTerms.check``). Only then are they charged to the ledger as
CONFIRMED (``Charges.confirmed``), so a reply whose content is bad is still charged: the site
spent that budget. A valid refusal charges nothing and ends the site's selection. The round
kind's handler then checks the content (the plain round's update, the secure round's masked
input) and returns what adds it; a ``ReplyError`` it raises rejects the reply. A ledger
conflict (a different confirmed record of the same round) rejects the reply, never the round.

After the last reply, ``charge_unanswered`` charges every node asked this round without a valid
answer (no reply, an error reply, or only rejected ones before its facts were confirmed) as
UNCONFIRMED (``Charges.unconfirmed``): it may have charged itself before failing.

Nothing of a reply is kept once ``take`` returns: the intake holds node ids and codes only, so a
round's memory does not grow with its replies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flwr.app import Message, MetricRecord

from prism_runtime.facts import ReplyFacts
from prism_runtime.protocol import REFUSAL_REASONS, STATUS_REFUSED
from server.errors import ReplyError
from server.strategy.binding import SiteBinding
from server.strategy.charges import Charges
from server.strategy.replies import RunTerms, error_reply, facts_of, unconfirmed_code
from server.strategy.rounds import RoundSummary
from server.strategy.selection import Selection

__all__ = ["ReplyHandler", "ReplyIntake"]

log = logging.getLogger("server.strategy")

ReplyHandler = Callable[[str, ReplyFacts, Message], Callable[[], None]]
"""A round kind's part of a reply: ``handle(site, facts, msg)`` checks what the reply carries
after its facts were checked and charged, and returns the call that adds it to the round (made
once the reply is accepted); it raises ``ReplyError`` to reject the reply."""


class ReplyIntake:
    """One round's replies: check, charge, hand on to the round kind (module docstring).

    Args:
        server_round: the round.
        summary: the round's summary (what was accepted, refused, rejected, charged).
        binding, terms, charges, selection: the strategy's parts (``server.strategy.core``).
    """

    def __init__(
        self,
        *,
        server_round: int,
        summary: RoundSummary,
        binding: SiteBinding,
        terms: RunTerms,
        charges: Charges,
        selection: Selection,
    ) -> None:
        self.server_round, self.summary = server_round, summary
        self.binding, self.terms, self.charges, self.selection = binding, terms, charges, selection
        self.seen: set[str] = set()  # sites with a reply past the origin check
        self.answered: set[int] = set()  # nodes whose facts were confirmed or refused
        self.pending: dict[int, tuple[str, int]] = {}  # node -> (unconfirmed code, steps)
        self.replied: set[int] = set()  # nodes with any reply

    def take(self, msg: Message, handle: ReplyHandler) -> None:
        """Check and charge one reply, then hand it to ``handle``; a bad one is logged, counted
        and skipped. Nothing of the reply is kept once it returns."""
        server_round, summary = self.server_round, self.summary
        node = msg.metadata.src_node_id
        self.replied.add(node)
        who = self.binding.site_of(node)
        steps = self.terms.local_steps  # what an unconfirmed charge of this node counts
        try:
            if msg.has_error():
                raise error_reply(msg)
            facts = facts_of(msg)
            site = self.binding.check_origin(server_round, node, facts)
            who = site
            if site in self.seen:
                raise ReplyError(f"second reply of {site!r} in round {server_round}", "duplicate")
            self.seen.add(site)
            steps = max(steps, facts.steps)  # a site claiming more is charged more
            self.terms.check(facts)
            self.charges.confirmed(server_round, facts)
            self.answered.add(node)
            if facts.status == STATUS_REFUSED:  # exhausted: its mechanism is not kept
                self._refused(site, str(facts.reason))
                return
            cap = self.charges.target_epsilon if facts.epsilon_cap is None else facts.epsilon_cap
            delta = self.terms.delta if facts.delta is None else facts.delta  # ok: stated
            self.selection.site_mechanism[site] = (facts.sigma, facts.q, cap, delta)
            add = handle(site, facts, msg)
        except (ReplyError, KeyError, TypeError, ValueError) as exc:
            error = exc if isinstance(exc, ReplyError) else ReplyError(repr(exc))  # code "invalid"
            summary.reject(who, error)
            log.warning("round %d: rejected reply from %s: %s", server_round, who, error)
            if error.code == "ledger-conflict":
                self.answered.add(node)  # the round's confirmed record is in the ledger already
            else:  # read by charge_unanswered for the nodes asked and not answered only
                code, before = self.pending.get(node, (unconfirmed_code(error, msg), steps))
                self.pending[node] = (code, max(before, steps))
            return
        add()
        summary.accepted.append(site)

    def _refused(self, site: str, code: str) -> None:
        """A valid refusal (its code checked by ``RunTerms.check``): no charge, no more rounds."""
        self.summary.refused.append(site)
        self.summary.refusal_codes[site] = code
        self.selection.exhausted.add(site)
        log.info(
            "site %s refused round %d: %s (%s)",
            site,
            self.server_round,
            code,
            REFUSAL_REASONS[code],
        )

    def charge_unanswered(self) -> None:
        """Charge every node asked this round without a valid answer as UNCONFIRMED."""
        server_round, summary = self.server_round, self.summary
        for node in self.binding.asked(server_round):
            if node in self.answered:
                continue
            who = self.binding.site_of(node)
            if node not in self.replied:
                error = ReplyError("no reply before the round timeout", "no-reply")
                summary.reject(who, error)
                log.warning(
                    "round %d: no reply from %s before the timeout; the round goes on without it",
                    server_round,
                    who,
                )
            code, steps = self.pending.get(node, ("no-reply", self.terms.local_steps))
            self.charges.unconfirmed(server_round, who, code, steps, summary)

    def metrics(self) -> MetricRecord:
        """The round's counts, as the run's train metrics record them."""
        summary = self.summary
        return MetricRecord(
            {
                "sites-sent": summary.sent,
                "sites-accepted": len(summary.accepted),
                "sites-refused": len(summary.refused),
                "replies-rejected": len(summary.rejected),
                "sites-unconfirmed": len(summary.unconfirmed),
                "applied": int(summary.applied),
                **{f"rejected-{code}": n for code, n in sorted(summary.rejected_by_reason.items())},
            }
        )
