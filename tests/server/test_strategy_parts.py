"""The strategy's small parts at their edges: the update bound's and the private clip range's
checks (``server.strategy.bounds``), the clip a reply's DP steps are bounded with, the text of an
error reply and the fixed summation order of replies (``server.strategy.replies``), each at
both sides of its threshold.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from pathlib import Path

import pytest
import torch
from conftest import random_point
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import Strategy
from reply_facts import honest_facts
from strategy_helpers import strategy_for

from prism_runtime.protocol import (
    ACCOUNTING,
    CONFIG,
    REFUSAL_REASONS,
    SITE_ERROR_CODES,
    UPDATE,
    key,
)
from server.errors import ConfigError
from server.ledger import Ledger
from server.strategy import PrismStrategy
from server.strategy.bounds import AutoClip, UpdateBound, UpdateChecker
from server.strategy.replies import error_reply, error_reply_text, in_order, unconfirmed_code
from server.strategy.rounds import RoundSummary

pytestmark = pytest.mark.usefixtures("flower_identity")  # Flower messages need a run id

# --------------------------------------------------------------------------------------------
# UpdateBound and AutoClip: what they accept and refuse
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param(dict(lr=1e-12), id="a-tiny-lr"),
        pytest.param(dict(lr=0.1, optimizer="sgd", max_norm=1e-9, expected_batch_size=1e-9)),
        pytest.param(dict(lr=0.1, head_optimizer="sgd", max_norm=0.5, expected_batch_size=0.5)),
        pytest.param(dict(lr=0.1, failure=1e-300), id="a-tiny-failure"),
        pytest.param(dict(lr=0.1, failure=0.999), id="a-failure-just-below-one"),
    ],
)
def test_an_update_bound_accepts_values_just_inside_its_ranges(kw: dict[str, object]) -> None:
    bound = UpdateBound(**kw)  # type: ignore[arg-type]
    assert all(getattr(bound, k) == v for k, v in kw.items())


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(lr=0.1, optimizer="SGD"), "optimizer='SGD': use 'adaptive' or 'sgd'"),
        (dict(lr=0.0), "lr=0.0: the sites' local lr must be finite and > 0"),
        (dict(lr=-1.0), "lr=-1.0: the sites' local lr must be finite and > 0"),
        (dict(lr=math.inf), "lr=inf: the sites' local lr must be finite and > 0"),
        (
            dict(lr=0.1, optimizer="sgd", max_norm=0.0, expected_batch_size=8.0),
            "optimizer='sgd' (or head_optimizer='sgd') needs max_norm > 0 and "
            "expected_batch_size > 0, got 0.0 and 8.0",
        ),
        (
            dict(lr=0.1, optimizer="sgd", max_norm=1.0, expected_batch_size=0.0),
            "needs max_norm > 0 and expected_batch_size > 0, got 1.0 and 0.0",
        ),
        (
            dict(lr=0.1, head_optimizer="momentum", max_norm=0.0, expected_batch_size=8.0),
            "got 0.0 and 8.0",
        ),
        (
            dict(lr=0.1, head_optimizer="sgd", max_norm=1.0, expected_batch_size=0.0),
            "got 1.0 and 0.0",
        ),
        (dict(lr=0.1, failure=0.0), "failure=0.0: must be in (0, 1)"),
        (dict(lr=0.1, failure=1.0), "failure=1.0: must be in (0, 1)"),
        (dict(lr=0.1, failure=1.5), "failure=1.5: must be in (0, 1)"),
    ],
)
def test_an_update_bound_refuses_values_outside_its_ranges_naming_them(
    kw: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        UpdateBound(**kw)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_an_adaptive_update_bound_needs_no_clip_or_batch() -> None:
    bound = UpdateBound(lr=0.1)  # PRISM's adaptive steps with an AdamW head
    assert (bound.max_norm, bound.expected_batch_size) == (0.0, 0.0)


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param(dict(low=0.5, high=0.5, steps=1, noise_multiplier=0.5), id="low-eq-high"),
        pytest.param(dict(low=1e-9, high=1e9, steps=3, noise_multiplier=1e-3), id="wide"),
    ],
)
def test_a_private_clip_range_accepts_its_edges(kw: dict[str, float]) -> None:
    clip = AutoClip(**kw)  # type: ignore[arg-type]
    assert all(getattr(clip, k) == v for k, v in kw.items())


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param(dict(low=0.0, high=1.0, steps=3, noise_multiplier=1.0), id="low-0"),
        pytest.param(dict(low=2.0, high=1.0, steps=3, noise_multiplier=1.0), id="low-above-high"),
        pytest.param(dict(low=0.1, high=math.inf, steps=3, noise_multiplier=1.0), id="high-inf"),
        pytest.param(dict(low=0.1, high=1.0, steps=0, noise_multiplier=1.0), id="steps-0"),
        pytest.param(dict(low=0.1, high=1.0, steps=3, noise_multiplier=0.0), id="sigma-0"),
        pytest.param(dict(low=0.1, high=1.0, steps=0, noise_multiplier=0.0), id="both"),
    ],
)
def test_a_private_clip_range_refuses_what_is_outside_naming_the_rule(
    kw: dict[str, float],
) -> None:
    with pytest.raises(ConfigError) as info:
        AutoClip(**kw)  # type: ignore[arg-type]
    assert "need 0 < low <= high, steps >= 1 and sigma_b > 0" in str(info.value)
    assert f"low={kw['low']}" in str(info.value)  # the values it refused


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        pytest.param({"max-norm": 0.25}, 0.25, id="the-reply-s-own-clip"),
        pytest.param({"max-norm": 4.0}, 2.0, id="never-above-the-bound-s"),
        pytest.param({}, 2.0, id="the-bound-s-when-not-stated"),
    ],
)
def test_a_replys_dp_steps_are_bounded_with_its_clip_never_above_the_runs(
    facts: dict[str, float], expected: float
) -> None:
    checker = UpdateChecker(
        modules=["m"],
        head=[],
        mode="tangent",
        local_steps=1,
        update_bound=UpdateBound(lr=0.1, optimizer="sgd", max_norm=2.0, expected_batch_size=8.0),
    )
    assert checker.clip_of(facts) == expected


# --------------------------------------------------------------------------------------------
# Error replies: a code and its fixed text, never the site's own words
# --------------------------------------------------------------------------------------------


def _request(node: int) -> Message:
    return Message(RecordDict(), dst_node_id=node, message_type="train")


def _error(code: object, node: int = 7) -> Message:
    error = Error(code=code, reason="Traceback: secret-row-17")  # type: ignore[arg-type]
    return Message(error, reply_to=_request(node))


@pytest.mark.parametrize("code", sorted(SITE_ERROR_CODES))
def test_a_site_error_reply_shows_its_code_and_fixed_text(code: int) -> None:
    error = error_reply(_error(code))
    assert str(error) == f"error reply {code}: {SITE_ERROR_CODES[code]}"
    assert error.code == "error-reply"
    assert unconfirmed_code(error, _error(code)) == f"error-reply-{code}"


def test_a_flower_error_reply_shows_flowers_name_and_an_unknown_code_says_so() -> None:
    raised = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert str(error_reply(_error(raised))) == (
        f"error reply {raised}: Flower error CLIENT_APP_RAISED_EXCEPTION "
        "(the site's ClientApp or node failed)"
    )
    assert str(error_reply(_error(777))) == "error reply 777: unknown site error code 777"
    assert "secret-row-17" not in str(error_reply(_error(4003)))


@pytest.mark.parametrize("code", [True, "4003", 4003.0, None])
def test_a_code_that_is_not_an_integer_is_named_so(code: object) -> None:
    assert error_reply_text(code) == "site error code is not an integer"


@pytest.mark.parametrize("code", [True, "4003"])  # a bool is an int to Python, not a code
def test_an_error_reply_whose_code_is_not_an_integer_shows_a_question_mark(code: object) -> None:
    message = _error(code)
    error = error_reply(message)
    assert str(error) == "error reply ?: site error code is not an integer"
    assert unconfirmed_code(error, message) == "error-reply"


# --------------------------------------------------------------------------------------------
# The summation order: by claimed site id, then node, whatever the arrival order
# --------------------------------------------------------------------------------------------


def _ok(node: int, facts: dict[str, str] | None) -> Message:
    content = RecordDict()
    if facts is not None:
        content[ACCOUNTING] = ConfigRecord(facts)
    return Message(content, reply_to=_request(node))


def test_replies_are_summed_in_the_order_of_their_site_id_then_node() -> None:
    replies = [
        _ok(3, {"site-id": "zed"}),
        _error(4003, node=9),
        _ok(7, {"site-id": "Alpha"}),
        _ok(2, {"status": "ok"}),  # facts without a site id: sorted as ""
        _ok(1, None),  # no facts at all: sorted as ""
        _ok(5, {"site-id": "zed"}),
    ]
    for arrival in (replies, replies[::-1], replies[2:] + replies[:2]):
        ordered = in_order(arrival)
        assert [m.metadata.src_node_id for m in ordered] == [1, 2, 9, 7, 3, 5]


# --------------------------------------------------------------------------------------------
# The strategy: a refusal, its log lines, its state across a restart, Flower's start signature
# --------------------------------------------------------------------------------------------

MODULE, M, N, R = "layer.0.q", 12, 10, 3


class _Grid:
    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def _strategy(tmp_path: Path, **kw: object) -> PrismStrategy:
    params: dict[str, object] = dict(sites_per_round=2, server_lr=0.5)
    params.update(kw)
    return strategy_for(modules=[MODULE], ledger=Ledger.open(tmp_path / "ledger.sqlite"), **params)


def _broadcast() -> ArrayRecord:
    A, B = random_point(M, N, R, 0, dtype=torch.float32)
    return ArrayRecord({key(MODULE, "A"): A, key(MODULE, "B"): B})


def _answer(request: Message, **changes: object) -> Message:
    facts = honest_facts(f"site-{request.metadata.dst_node_id}", request.content[CONFIG], **changes)
    update = {key(MODULE, "dA"): torch.full((M, R), 1e-3), key(MODULE, "dB"): torch.zeros(N, R)}
    content = RecordDict({UPDATE: ArrayRecord(update), ACCOUNTING: ConfigRecord(facts)})
    return Message(content=content, reply_to=request)


def test_a_refusal_is_summarised_logged_and_ends_the_sites_rounds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = _strategy(tmp_path)
    requests = list(strategy.configure_train(1, _broadcast(), ConfigRecord(), _Grid([11, 12])))
    by_node = {r.metadata.dst_node_id: r for r in requests}
    refusal = _answer(by_node[11], status="refused", steps=0, reason="cap-exhausted")
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        strategy.aggregate_train(1, [refusal, _answer(by_node[12])])
    summary = strategy.summaries[-1]
    assert (summary.refused, summary.refusal_codes) == (["site-11"], {"site-11": "cap-exhausted"})
    assert strategy.selection.exhausted == {"site-11"}
    lines = [r.getMessage() for r in caplog.records if r.name == "server.strategy"]
    assert (
        f"site site-11 refused round 1: cap-exhausted ({REFUSAL_REASONS['cap-exhausted']})" in lines
    )
    nodes = [
        r.metadata.dst_node_id
        for r in strategy.configure_train(2, _broadcast(), ConfigRecord(), _Grid([11, 12]))
    ]
    assert nodes == [12]  # the refusing site is not asked again


def test_the_strategy_logs_its_settings_once_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = _strategy(tmp_path, lr_schedule="cosine", server_lr=0.25, min_sites=2)
    with caplog.at_level(logging.INFO, logger="server.strategy"):
        strategy.summary()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "server.strategy"]
    assert line == (
        "PrismStrategy(mode=tangent, modules=1, head=0, sites/round=2, min-sites=2, "
        "server-lr=0.25 cosine)"
    )


def test_the_strategys_state_survives_a_restart_through_json(tmp_path: Path) -> None:
    strategy = _strategy(tmp_path)
    for rnd in (1, 2):
        requests = list(
            strategy.configure_train(rnd, _broadcast(), ConfigRecord(), _Grid([11, 12, 13]))
        )
        replies = [_answer(r) for r in requests]
        if rnd == 2:
            replies[0] = _answer(requests[0], status="refused", steps=0, reason="cap-exhausted")
        strategy.aggregate_train(rnd, replies)
    state = json.loads(json.dumps(strategy.state_dict()))  # as a checkpoint stores it
    restarted = _strategy(tmp_path / "restarted")
    restarted.load_state_dict(state)
    assert restarted.state_dict() == strategy.state_dict()
    assert restarted.binding.node_site == strategy.binding.node_site
    assert restarted.selection.site_mechanism == strategy.selection.site_mechanism
    assert restarted.selection.exhausted == strategy.selection.exhausted != set()
    assert [vars(s) for s in restarted.summaries] == [vars(s) for s in strategy.summaries]
    # the selection's random stream goes on where it stopped
    assert restarted.selection.rng.random() == strategy.selection.rng.random()


def test_start_keeps_flowers_signature_and_defaults() -> None:
    ours = inspect.signature(PrismStrategy.start).parameters
    flowers = inspect.signature(Strategy.start).parameters
    assert list(ours)[: len(flowers)] == list(flowers)
    assert {n: ours[n].default for n in flowers} == {n: p.default for n, p in flowers.items()}
    assert (ours["first_round"].default, ours["previous"].default) == (1, None)


def test_a_round_summary_survives_its_checkpoint_form_and_an_old_one_gets_the_defaults() -> None:
    """``from_dict(vars(s))`` gives back every field of a summary in which none is at its
    default; a checkpoint written before the later fields existed reads with those defaults."""
    full = RoundSummary(
        server_round=3,
        sent=4,
        accepted=["site-a"],
        refused=["site-b"],
        rejected=[("site-c", "norm too large")],
        applied=True,
        rejected_by_reason={"norm": 1},
        discarded="non-finite",
        refusal_codes={"site-b": "4003"},
        unconfirmed=["site-d"],
    )
    assert RoundSummary.from_dict(json.loads(json.dumps(vars(full)))) == full
    old = {"server_round": 2, "sent": 1, "accepted": [], "refused": [], "rejected": []}
    assert RoundSummary.from_dict({**old, "applied": False}) == RoundSummary(server_round=2, sent=1)
