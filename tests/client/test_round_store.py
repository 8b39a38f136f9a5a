"""The site's last released reply: resent for the same request only, stored atomically."""

from __future__ import annotations

import logging

import pytest
import torch

from client.reply import RoundReply
from client.request import RoundRequest
from client.round_store import RoundStore
from prism_runtime.errors import ConfigError
from prism_runtime.facts import ReplyFacts

ARRAYS = {"m/A": torch.ones(3, 2), "m/B": torch.full((4, 2), 2.0)}
FACTS = ReplyFacts.parse({"site-id": "s", "status": "ok", "sigma": 1.0, "q": 0.05, "steps": 2})
REPLY = RoundReply({"m/dA": torch.zeros(3, 2)}, FACTS, {"x": 1.0})
MOMENTS = {"states": [{"step": 3}], "points": [(torch.ones(3, 2), torch.ones(4, 2))]}


def _stored(tmp_path, request, moments=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = RoundStore(tmp_path, site_id="s")
    store.store(request, REPLY, moments)
    return store


def test_the_same_request_gets_the_stored_reply(tmp_path, caplog):
    store = _stored(tmp_path, RoundRequest("run-a", 2, ARRAYS))
    with caplog.at_level(logging.INFO, logger="client.round_store"):
        again = RoundStore(tmp_path, site_id="s").resend(RoundRequest("run-a", 2, dict(ARRAYS)))
    assert again is not None
    assert again.arrays.keys() == REPLY.arrays.keys()
    assert all(again.arrays[k].equal(REPLY.arrays[k]) for k in REPLY.arrays)
    assert (again.accounting, again.nonprivate) == (REPLY.accounting, REPLY.nonprivate)
    assert "round 2 of run run-a already answered" in caplog.text
    assert store.path == tmp_path / "last-round.pt"


@pytest.mark.parametrize(
    "request_",
    [
        RoundRequest("run-b", 2, ARRAYS),  # another run
        RoundRequest("run-a", 3, ARRAYS),  # another round
        RoundRequest("run-a", 2, {**ARRAYS, "m/A": ARRAYS["m/A"] * 2}),  # another point
        RoundRequest("", 2, ARRAYS),  # no run id: the run cannot be told apart
    ],
)
def test_any_other_request_is_not_answered_from_the_store(tmp_path, request_):
    store = _stored(tmp_path, RoundRequest("run-a", 2, ARRAYS))
    assert store.resend(request_) is None


def test_nothing_stored_nothing_resent(tmp_path):
    store = RoundStore(tmp_path, site_id="s")
    assert store.load() is None and store.moments() is None
    assert store.resend(RoundRequest("run-a", 1, ARRAYS)) is None


def test_moments_come_from_the_last_round_else_from_their_own_file(tmp_path):
    assert _stored(tmp_path / "none", RoundRequest("r", 1, ARRAYS)).moments() is None
    kept = _stored(tmp_path / "kept", RoundRequest("r", 1, ARRAYS), MOMENTS).moments()
    assert kept is not None and kept["states"] == MOMENTS["states"]
    alone = tmp_path / "alone"
    alone.mkdir()
    torch.save(MOMENTS, alone / RoundStore.MOMENTS_FILE)
    from_file = RoundStore(alone, site_id="s").moments()
    assert from_file is not None and from_file["states"] == MOMENTS["states"]


def test_a_damaged_file_stops_the_site_and_is_left_as_it_is(tmp_path):
    store = _stored(tmp_path, RoundRequest("run-a", 2, ARRAYS))
    store.path.write_bytes(b"not a torch file")
    for read in (store.load, store.moments, lambda: store.resend(RoundRequest("", 2, ARRAYS))):
        with pytest.raises(ConfigError, match="unreadable site round state") as info:
            read()
        assert str(store.path) in str(info.value) and "move it away" in str(info.value)
    assert store.path.read_bytes() == b"not a torch file"


def test_a_stored_reply_whose_facts_do_not_parse_is_not_resent_and_is_left_as_it_is(tmp_path):
    request = RoundRequest("run-a", 2, ARRAYS)
    store = _stored(tmp_path, request)
    saved = torch.load(store.path, weights_only=True)
    saved["accounting"] = {**saved["accounting"], "sigma": -1.0}  # no mechanism has sigma < 0
    torch.save(saved, store.path)
    before = store.path.read_bytes()
    with pytest.raises(ConfigError, match="accounting facts are not valid") as info:
        store.resend(request)
    assert str(store.path) in str(info.value) and "Move the file away" in str(info.value)
    assert store.path.read_bytes() == before
