"""``StreamingAggregator.num_examples``: a site's shard size for ``aggregation = examples``, from
its checked facts (``N = b / q``, or a stated ``num-examples`` that must agree with it), at the
edges of what it accepts. Written for the strategy's mutation run (issue 17)."""

from __future__ import annotations

import pytest

from prism_runtime.protocol import MAX_EXAMPLES
from server.errors import ReplyError
from server.optimizer import ServerOptimizer, ServerOptimizerConfig
from server.strategy.aggregator import _SIZE_RTOL, StreamingAggregator


def aggregator(expected_batch_size: float | None) -> StreamingAggregator:
    return StreamingAggregator(
        modules=["m"],
        head=[],
        mode="tangent",
        optimizer=ServerOptimizer(ServerOptimizerConfig(), ["m"], []),
        server_lr=1.0,
        lr_schedule="constant",
        num_rounds=1,
        local_lr=0.1,
        local_steps=1,
        aggregation="examples",
        dp=True,
        expected_batch_size=expected_batch_size,
    )


def refused(agg: StreamingAggregator, facts: dict[str, object]) -> str:
    with pytest.raises(ReplyError) as info:
        agg.num_examples(facts)
    assert info.value.code == "facts"
    return str(info.value)


def test_without_a_stated_size_the_shard_is_b_over_q() -> None:
    assert aggregator(8.0).num_examples({"q": 0.02}) == pytest.approx(400.0, rel=1e-15)


def test_a_size_exactly_at_the_limit_is_accepted_and_one_past_it_refused() -> None:
    half = MAX_EXAMPLES / 2
    assert aggregator(half).num_examples({"q": 0.5}) == MAX_EXAMPLES
    message = refused(aggregator(half * 1.001), {"q": 0.5})
    assert "q = 0.5 implies more than 1e+12 examples" in message


def test_without_b_a_reply_must_state_its_size_and_one_that_does_is_taken() -> None:
    message = refused(aggregator(None), {"q": 0.02})
    assert message.startswith("aggregation=examples but the reply has no num-examples")
    assert aggregator(None).num_examples({"q": 0.02, "num-examples": 123}) == 123.0


@pytest.mark.parametrize(
    ("b", "q", "stated"),
    [
        pytest.param(8.0, 1.0, 8.0, id="q1-equal"),
        pytest.param(8.0, 1.0, 3.0, id="q1-smaller-shard"),  # N <= b at q = 1
        pytest.param(8.0, 1.0, 8.0 * (1 + _SIZE_RTOL), id="q1-at-the-tolerance"),
        pytest.param(10.0, 1e-6, 1e7 + 5.0, id="large-shard-within-relative-tolerance"),
        pytest.param(8.0, 8.0 / 100.4, 100.0, id="small-shard-within-half-an-example"),
    ],
)
def test_a_stated_size_that_agrees_with_b_over_q_is_taken(
    b: float, q: float, stated: float
) -> None:
    assert aggregator(b).num_examples({"q": q, "num-examples": stated}) == stated


@pytest.mark.parametrize(
    ("b", "q", "stated"),
    [
        pytest.param(8.0, 1.0, 8.0 * (1 + 2 * _SIZE_RTOL), id="q1-larger-than-b"),
        pytest.param(8.0, 0.5, 10.0, id="smaller-than-b-over-q"),
        pytest.param(8.0, 0.5, 17.0, id="larger-than-b-over-q"),
        pytest.param(10.0, 1e-6, 1e7 + 50.0, id="large-shard-past-relative-tolerance"),
        pytest.param(8.0, 8.0 / 100.6, 100.0, id="small-shard-past-half-an-example"),
    ],
)
def test_a_stated_size_that_disagrees_with_b_over_q_is_refused_naming_both(
    b: float, q: float, stated: float
) -> None:
    message = refused(aggregator(b), {"q": q, "num-examples": stated})
    assert message.startswith(f"num-examples {int(stated)} disagrees with b / q = {b / q:.6g}")
