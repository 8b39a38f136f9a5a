"""Which node speaks for which site, and whether a reply belongs to this round.

A site is bound to the node it first answered from; a reply must come from a node asked this
round, carry this round's number and nonce, and match the node's site. The binding is part of
the coordinator's checkpoint (``PrismStrategy.state_dict``).
"""

from __future__ import annotations

import logging
import secrets

from prism_runtime.facts import ReplyFacts
from server.errors import ReplyError

__all__ = ["SiteBinding"]

log = logging.getLogger("server.strategy")


class SiteBinding:
    """Node <-> site binding, and the nodes asked in the current round with its nonce."""

    def __init__(self) -> None:
        self.node_site: dict[int, str] = {}
        self.sent_to: dict[int, int] = {}  # node -> the round it was last asked
        self.nonce = ""
        self.connected: set[int] = set()

    def site_of(self, node: int) -> str:
        """The node's bound site, or ``node-<id>`` for a node never bound."""
        return self.node_site.get(node, f"node-{node}")

    def ask(self, server_round: int, chosen: list[int], connected: list[int]) -> str:
        """Record the nodes asked this round; return the round's fresh nonce (a replayed reply of
        any earlier round lacks it)."""
        self.connected = set(connected)
        self.nonce = secrets.token_hex(16)
        self.sent_to = {n: server_round for n in chosen}
        return self.nonce

    def asked(self, server_round: int) -> list[int]:
        """The nodes asked in ``server_round``, sorted."""
        return sorted(n for n, r in self.sent_to.items() if r == server_round)

    @property
    def site_node(self) -> dict[str, int]:
        """The node each bound site answers from (the inverse of ``node_site``)."""
        return {site: node for node, site in self.node_site.items()}

    def check_origin(self, server_round: int, node: int, facts: ReplyFacts) -> str:
        """Round, nonce, node<->site binding and one reply per site; returns the site id.

        A reply failing here is NOT charged to the ledger: a stale or replayed reply's facts
        belong to (and were recorded in) another round, a reply from a node that was not asked
        carries no steps this round asked for, and facts claiming another node's site cannot be
        attributed. Sites keep their own durable ledger, which is the authority on their spend.
        """
        site = facts.site_id
        if self.sent_to.get(node) != server_round:
            raise ReplyError(f"node {node} was not asked in round {server_round}", "not-asked")
        claimed = facts.server_round
        if claimed != server_round:
            raise ReplyError(
                f"reply is for round {claimed!r}, the current round is {server_round} "
                "(stale or replayed)",
                "stale-round",
            )
        if facts.round_nonce != self.nonce:
            raise ReplyError("reply does not echo this round's nonce (replayed)", "replay")
        bound = self.node_site.get(node)
        if bound is not None and bound != site:
            raise ReplyError(f"node {node} is {bound!r} but claims to be {site!r}", "site-binding")
        owner = self.site_node.get(site)
        if owner is not None and owner != node and owner in self.connected:
            raise ReplyError(
                f"site {site!r} belongs to node {owner}, still connected; node {node} claims it",
                "site-binding",
            )
        if owner is not None and owner != node:
            log.warning("site %s moved from node %d to node %d", site, owner, node)
            del self.node_site[owner]  # a bound node: site_node is node_site inverted
        self.node_site[node] = site
        return site
