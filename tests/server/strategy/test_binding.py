"""``SiteBinding`` (``server/strategy/binding.py``): which node speaks for which site, and whether
a reply belongs to this round. Each refusal with its code and message; a site that moves from
a node that left, and one claimed by a node while its own is still connected (a hijack).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from reply_facts import honest_reply_facts

from prism_runtime.facts import ReplyFacts
from prism_runtime.protocol import ROUND_NONCE, SERVER_ROUND
from server.errors import ReplyError
from server.strategy.binding import SiteBinding


def facts(binding: SiteBinding, site: str, server_round: int, **changes: Any) -> ReplyFacts:
    """The facts of an honest reply of ``site`` to ``server_round``, echoing its round and the
    binding's nonce."""
    config = {SERVER_ROUND: server_round, ROUND_NONCE: binding.nonce}
    return honest_reply_facts(site, config, **changes)


def refused(binding: SiteBinding, server_round: int, node: int, f: ReplyFacts) -> ReplyError:
    with pytest.raises(ReplyError) as info:
        binding.check_origin(server_round, node, f)
    return info.value


def test_a_fresh_binding_has_asked_nobody() -> None:
    binding = SiteBinding()
    assert binding.asked(1) == []
    assert binding.site_of(5) == "node-5"
    error = refused(binding, 1, 5, facts(binding, "a", 1))
    assert (error.code, str(error)) == ("not-asked", "node 5 was not asked in round 1")


def test_each_round_gets_a_fresh_128_bit_nonce_and_records_whom_it_asked() -> None:
    binding = SiteBinding()
    nonces = {binding.ask(r, [3, 1], [1, 2, 3]) for r in range(1, 6)}
    assert len(nonces) == 5
    assert all(re.fullmatch(r"[0-9a-f]{32}", n) for n in nonces)
    assert binding.nonce in nonces
    assert binding.asked(5) == [1, 3] and binding.asked(4) == []
    assert binding.connected == {1, 2, 3}


def test_a_node_not_asked_this_round_is_refused() -> None:
    binding = SiteBinding()
    binding.ask(1, [1], [1, 2])
    binding.ask(2, [2], [1, 2])  # node 1 was asked in round 1, not in round 2
    error = refused(binding, 2, 1, facts(binding, "a", 2))
    assert (error.code, str(error)) == ("not-asked", "node 1 was not asked in round 2")


def test_a_reply_for_another_round_is_refused_as_stale() -> None:
    binding = SiteBinding()
    binding.ask(3, [1], [1])
    error = refused(binding, 3, 1, facts(binding, "a", 3, **{SERVER_ROUND: 2}))
    assert error.code == "stale-round"
    assert str(error) == "reply is for round 2, the current round is 3 (stale or replayed)"


def test_a_reply_without_this_rounds_nonce_is_refused_as_replayed() -> None:
    binding = SiteBinding()
    old = binding.ask(1, [1], [1])
    binding.ask(2, [1], [1])
    error = refused(binding, 2, 1, facts(binding, "a", 2, **{ROUND_NONCE: old}))
    assert (error.code, str(error)) == (
        "replay",
        "reply does not echo this round's nonce (replayed)",
    )


def test_a_node_bound_to_one_site_cannot_speak_for_another() -> None:
    binding = SiteBinding()
    binding.ask(1, [1], [1])
    assert binding.check_origin(1, 1, facts(binding, "a", 1)) == "a"
    binding.ask(2, [1], [1])
    error = refused(binding, 2, 1, facts(binding, "b", 2))
    assert (error.code, str(error)) == ("site-binding", "node 1 is 'a' but claims to be 'b'")
    assert binding.node_site == {1: "a"}


def test_a_site_whose_node_is_still_connected_cannot_be_claimed_by_another_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    binding = SiteBinding()
    binding.ask(1, [1], [1, 2])
    binding.check_origin(1, 1, facts(binding, "a", 1))
    binding.ask(2, [1, 2], [1, 2])  # both asked; node 1 (site a) is still connected
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        error = refused(binding, 2, 2, facts(binding, "a", 2))
    assert error.code == "site-binding"
    assert str(error) == "site 'a' belongs to node 1, still connected; node 2 claims it"
    assert binding.node_site == {1: "a"}
    assert caplog.records == []


def test_a_site_moves_to_a_new_node_once_its_old_node_has_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    binding = SiteBinding()
    binding.ask(1, [1, 3], [1, 3])
    binding.check_origin(1, 1, facts(binding, "a", 1))
    binding.check_origin(1, 3, facts(binding, "c", 1))
    binding.ask(2, [2], [2, 3])  # node 1 left; site a restarted as node 2
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        assert binding.check_origin(2, 2, facts(binding, "a", 2)) == "a"
    assert binding.node_site == {2: "a", 3: "c"}  # node 1 is unbound, node 3 untouched
    assert binding.site_of(1) == "node-1"
    assert [r.getMessage() for r in caplog.records] == ["site a moved from node 1 to node 2"]
    assert caplog.records[0].levelno == logging.WARNING


def test_the_same_node_answering_again_keeps_its_binding_silently(
    caplog: pytest.LogCaptureFixture,
) -> None:
    binding = SiteBinding()
    for server_round in (1, 2):
        binding.ask(server_round, [1], [1])
        with caplog.at_level(logging.INFO, logger="server.strategy"):
            assert binding.check_origin(server_round, 1, facts(binding, "a", server_round)) == "a"
    assert binding.node_site == {1: "a"}
    assert caplog.records == []
