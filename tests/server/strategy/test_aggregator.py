"""``StreamingAggregator``: a site's shard size for ``aggregation = examples``, from its checked
facts (``N = b / q``, or a stated ``num-examples`` that must agree with it), at the edges of what
it accepts; the factor-average and tangent steps, a site's noise std, and the guards that discard
a round (non-finite, overflow, lost rank)."""

from __future__ import annotations

import pytest
import torch
from reply_facts import honest_reply_facts

import server.strategy.aggregator as aggregator_module
from prism_runtime.facts import ReplyFacts
from prism_runtime.protocol import MAX_EXAMPLES
from server.errors import ReplyError
from server.strategy.aggregator import _SIZE_RTOL, StreamingAggregator
from server.strategy.rounds import RoundSummary


def aggregator(expected_batch_size: float | None) -> StreamingAggregator:
    return stepper(mode="tangent", aggregation="examples", expected_batch_size=expected_batch_size)


def refused(agg: StreamingAggregator, facts: ReplyFacts) -> str:
    with pytest.raises(ReplyError) as info:
        agg.num_examples(facts)
    assert info.value.code == "facts"
    return str(info.value)


def test_without_a_stated_size_the_shard_is_b_over_q() -> None:
    assert aggregator(8.0).num_examples(honest_reply_facts(q=0.02)) == pytest.approx(
        400.0, rel=1e-15
    )


def test_a_size_exactly_at_the_limit_is_accepted_and_one_past_it_refused() -> None:
    half = MAX_EXAMPLES / 2
    assert aggregator(half).num_examples(honest_reply_facts(q=0.5)) == MAX_EXAMPLES
    message = refused(aggregator(half * 1.001), honest_reply_facts(q=0.5))
    assert "q = 0.5 implies more than 1e+12 examples" in message


def test_without_b_a_reply_must_state_its_size_and_one_that_does_is_taken() -> None:
    message = refused(aggregator(None), honest_reply_facts(q=0.02))
    assert message.startswith("aggregation=examples but the reply has no num-examples")
    stated = honest_reply_facts(q=0.02, num_examples=123)
    assert aggregator(None).num_examples(stated) == 123.0


# A stated size is a whole number of examples (``num-examples`` is an integer fact): at q = 1 the
# tolerance's edge is tested at b = 5e6, where b (1 + _SIZE_RTOL) is a whole number in float64.
EDGE_B = 5e6


@pytest.mark.parametrize(
    ("b", "q", "stated"),
    [
        pytest.param(8.0, 1.0, 8, id="q1-equal"),
        pytest.param(8.0, 1.0, 3, id="q1-smaller-shard"),  # N <= b at q = 1
        pytest.param(EDGE_B, 1.0, int(EDGE_B * (1 + _SIZE_RTOL)), id="q1-at-the-tolerance"),
        pytest.param(10.0, 1e-6, 10**7 + 5, id="large-shard-within-relative-tolerance"),
        pytest.param(8.0, 8.0 / 100.4, 100, id="small-shard-within-half-an-example"),
    ],
)
def test_a_stated_size_that_agrees_with_b_over_q_is_taken(b: float, q: float, stated: int) -> None:
    facts = honest_reply_facts(q=q, num_examples=stated)
    assert aggregator(b).num_examples(facts) == stated


@pytest.mark.parametrize(
    ("b", "q", "stated"),
    [
        pytest.param(EDGE_B, 1.0, int(EDGE_B * (1 + 2 * _SIZE_RTOL)), id="q1-larger-than-b"),
        pytest.param(8.0, 0.5, 10, id="smaller-than-b-over-q"),
        pytest.param(8.0, 0.5, 17, id="larger-than-b-over-q"),
        pytest.param(10.0, 1e-6, 10**7 + 50, id="large-shard-past-relative-tolerance"),
        pytest.param(8.0, 8.0 / 100.6, 100, id="small-shard-past-half-an-example"),
    ],
)
def test_a_stated_size_that_disagrees_with_b_over_q_is_refused_naming_both(
    b: float, q: float, stated: int
) -> None:
    message = refused(aggregator(b), honest_reply_facts(q=q, num_examples=stated))
    assert message.startswith(f"num-examples {stated} disagrees with b / q = {b / q:.6g}")


# -- the round's sums, the server step and its guards -----------------------------------------

M, N, R = 6, 5, 3


def stepper(
    mode: str = "factor-average",
    head: tuple[str, ...] = (),
    dp: bool = True,
    server_lr: float = 0.5,
    aggregation: str = "inverse-noise",
    expected_batch_size: float | None = 16.0,
) -> StreamingAggregator:
    return StreamingAggregator(
        modules=["m"],
        head=list(head),
        mode=mode,  # type: ignore[arg-type]
        server_lr=server_lr,
        lr_schedule="constant",
        num_rounds=3,
        aggregation=aggregation,  # type: ignore[arg-type]
        dp=dp,
        expected_batch_size=expected_batch_size,
    )


def point(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "m/A": torch.randn(M, R, generator=g).to(dtype),
        "m/B": torch.randn(N, R, generator=g).to(dtype),
        "head/w": torch.randn(2, 3, generator=g).to(dtype),
    }


def dp_facts(sigma: float) -> ReplyFacts:
    return honest_reply_facts(sigma=sigma, max_norm=0.05, expected_batch_size=16.0)


def test_a_fresh_aggregator_holds_no_weight() -> None:
    agg = stepper()
    assert agg.total_weight == 0.0
    agg.begin_round(point())
    assert agg.total_weight == 0.0


def test_the_factor_average_step_moves_each_factor_and_the_head_toward_the_mean() -> None:
    """``X + lr (mean - X)`` for A, B and the head; the factors in float32 whatever the inputs'
    dtype (the head keeps the broadcast's, float32 in a run)."""
    agg = stepper(head=("w",))
    broadcast, means = point(0, torch.float64), point(1, torch.float64)
    agg.begin_round(broadcast)
    new = agg.apply(means, 0.5)
    for name in ("m/A", "m/B", "head/w"):
        want = broadcast[name] + 0.5 * (means[name] - broadcast[name])
        assert new[name].dtype == (torch.float64 if name == "head/w" else torch.float32)
        torch.testing.assert_close(new[name].double(), want, rtol=0, atol=1e-6)


def test_the_tangent_step_returns_float32_arrays_whatever_the_inputs_dtype() -> None:
    agg = stepper(mode="tangent", head=("w",))
    broadcast = point(0, torch.float64)
    agg.begin_round(broadcast)
    g = torch.Generator().manual_seed(3)
    means = {
        "m/dA": 0.01 * torch.randn(M, R, generator=g, dtype=torch.float64),
        "m/dB": 0.01 * torch.randn(N, R, generator=g, dtype=torch.float64),
        "head/w": 0.01 * torch.randn(2, 3, generator=g, dtype=torch.float64),
    }
    new = agg.apply(means, 0.5)
    assert {name: t.dtype for name, t in new.items()} == dict.fromkeys(new, torch.float32)
    assert set(new) == {"m/A", "m/B", "head/w"}


def test_a_private_sites_noise_std_is_sigma_c_over_b_and_a_non_private_ones_is_0() -> None:
    assert stepper().noise_std(dp_facts(2.0)) == pytest.approx(2.0 * 0.05 / 16.0, rel=1e-15)
    assert stepper(dp=False).noise_std(dp_facts(2.0)) == 0.0


def test_a_non_finite_mean_is_discarded_with_its_reason() -> None:
    agg = stepper()
    agg.begin_round(point())
    bad = point(1)
    bad["m/A"][0, 0] = float("nan")
    summary = RoundSummary(server_round=1)
    assert agg._apply_checked({k: v for k, v in bad.items() if k != "head/w"}, summary) is None
    assert summary.discarded == "the aggregated update is not finite"


def test_a_step_whose_result_is_not_finite_is_discarded_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server step that returns a non-finite adapter (as an overflow would): the round is
    discarded, saying why."""
    agg = stepper(mode="tangent")
    agg.begin_round(point())
    update = {"m/dA": torch.full((M, R), 1e-2), "m/dB": torch.full((N, R), 1e-2)}
    assert agg._apply_checked(update, RoundSummary(server_round=1)) is not None
    step = aggregator_module.server_step

    def overflowing(*args, **kw):
        moved, head = step(*args, **kw)
        return {m: type(p)(p.A * float("inf"), p.B) for m, p in moved.items()}, head

    monkeypatch.setattr(aggregator_module, "server_step", overflowing)
    summary = RoundSummary(server_round=2)
    assert agg._apply_checked(update, summary) is None
    assert summary.discarded == "the retracted adapter is not finite"


def test_a_step_that_loses_the_last_rank_is_discarded_even_when_the_others_are_kept() -> None:
    """r = 3: a mean whose A has a zero last column makes s_3 = 0 while s_2 > 0."""
    agg = stepper(server_lr=1.0)
    broadcast = point()
    agg.begin_round(broadcast)
    means = {"m/A": broadcast["m/A"].clone(), "m/B": broadcast["m/B"].clone()}
    means["m/A"][:, 2] = 0.0
    summary = RoundSummary(server_round=1)
    assert agg._apply_checked(means, summary) is None
    assert summary.discarded.startswith("the new m lost rank (singular values ")
