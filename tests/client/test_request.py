"""A round's request: the round number is checked first, the broadcast digest is computed once."""

from __future__ import annotations

import logging

import pytest
import torch

import client.request as request_module
from client.reply import broadcast_digest
from client.request import RoundRequest, check_request, valid_round
from prism_runtime.ranges import SERVER_ROUND_MAX

ARRAYS = {"m/A": torch.ones(3, 2), "m/B": torch.arange(8.0).reshape(4, 2)}


@pytest.mark.parametrize("value", [1, 2, SERVER_ROUND_MAX])
def test_an_integer_round_in_range_is_accepted(value):
    assert valid_round(value)
    request = check_request(value, ARRAYS, run_id="run-a", site_id="s")
    assert request is not None
    assert (request.run_id, request.server_round, request.arrays) == ("run-a", value, ARRAYS)


@pytest.mark.parametrize(
    "value", [0, -1, SERVER_ROUND_MAX + 1, True, False, 1.0, "1", None, [1], 2**70]
)
def test_any_other_round_number_is_not_accepted_and_logged(value, caplog):
    assert not valid_round(value)
    with caplog.at_level(logging.WARNING, logger="client.request"):
        assert check_request(value, ARRAYS, run_id="run-a", site_id="s") is None
    (record,) = caplog.records
    assert record.getMessage() == f"site s: round number {value!r:.40} is not accepted"


def test_a_long_round_value_is_logged_cut_short(caplog):
    with caplog.at_level(logging.WARNING, logger="client.request"):
        check_request("x" * 1000, ARRAYS, run_id="", site_id="s")
    assert len(caplog.records[0].getMessage()) < 100


def test_the_digest_is_the_broadcast_digest_computed_once_when_first_read(monkeypatch):
    calls = []

    def counted(arrays):
        calls.append(arrays)
        return broadcast_digest(arrays)

    monkeypatch.setattr(request_module, "broadcast_digest", counted)
    request = check_request(3, ARRAYS, run_id="", site_id="s")
    assert isinstance(request, RoundRequest) and calls == []  # nothing hashed yet
    assert request.digest == broadcast_digest(ARRAYS) == request.digest
    assert len(calls) == 1


def test_the_digest_tells_broadcast_points_apart():
    same = RoundRequest("r", 1, {k: v.clone() for k, v in ARRAYS.items()})
    moved = RoundRequest("r", 1, {**ARRAYS, "m/A": ARRAYS["m/A"] + 1e-3})
    retyped = RoundRequest("r", 1, {**ARRAYS, "m/A": ARRAYS["m/A"].double()})
    base = RoundRequest("r", 1, ARRAYS).digest
    assert same.digest == base
    assert moved.digest != base and retyped.digest != base
