"""``StreamingAggregator``: a site's shard size for ``aggregation = examples``, from its checked
facts (``N = b / q``, or a stated ``num-examples`` that must agree with it), at the edges of what
it accepts; the factor-average and tangent steps, the noise std the server step is told, and the
guards that discard a round (non-finite, overflow, lost rank) without moving the optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from prism_runtime.protocol import MAX_EXAMPLES
from server.errors import ReplyError
from server.optimizer import ServerOptimizer, ServerOptimizerConfig
from server.strategy.aggregator import _SIZE_RTOL, StreamingAggregator
from server.strategy.rounds import RoundSummary


def aggregator(expected_batch_size: float | None) -> StreamingAggregator:
    return stepper(mode="tangent", aggregation="examples", expected_batch_size=expected_batch_size)


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


# -- the round's sums, the server step and its guards -----------------------------------------

M, N, R = 6, 5, 3


def stepper(
    mode: str = "factor-average",
    kind: str = "sgd",
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
        optimizer=ServerOptimizer(
            ServerOptimizerConfig(kind=kind, lr=server_lr), ["m"], list(head)
        ),
        server_lr=server_lr,
        lr_schedule="constant",
        num_rounds=3,
        local_lr=0.2,
        local_steps=4,
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


def dp_facts(sigma: float) -> dict[str, object]:
    return {"sigma": sigma, "max-norm": 0.05, "expected-batch-size": 16.0}


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


def test_the_server_step_is_told_the_noise_std_of_the_weighted_mean_in_update_units() -> None:
    """Two sites at sigma 1 and 2 with their inverse-noise weights: the std of the mean is
    ``sqrt(sum w_k^2 s_k^2) / sum w_k`` with ``s_k = sigma_k C / b``, times ``lr sqrt(tau)``
    (local lr 0.2, 4 steps); computed here from those numbers alone."""
    agg = stepper(mode="tangent", kind="adaptive")
    agg.begin_round(point())
    told: list[float] = []
    step = agg.optimizer.step

    def recording(*args, **kw):
        told.append(kw["noise_std"])
        return step(*args, **kw)

    agg.optimizer.step = recording  # type: ignore[method-assign]
    update = {"m/dA": torch.full((M, R), 1e-3), "m/dB": torch.full((N, R), -1e-3)}
    for sigma in (1.0, 2.0):
        agg.add(update, dp_facts(sigma), agg.weight(dp_facts(sigma)))
    assert agg.finish(RoundSummary(server_round=1)) is not None
    s = [sigma * 0.05 / 16.0 for sigma in (1.0, 2.0)]
    w = [1 / x**2 for x in s]
    mean_std = math.sqrt(sum((wk * sk) ** 2 for wk, sk in zip(w, s, strict=True))) / sum(w)
    assert told == [pytest.approx(0.2 * math.sqrt(4) * mean_std, rel=1e-12)]


def test_a_non_private_round_tells_the_server_step_no_noise() -> None:
    agg = stepper(mode="tangent", kind="adaptive", dp=False)
    agg.begin_round(point())
    agg.add({"m/dA": torch.zeros(M, R), "m/dB": torch.zeros(N, R)}, {}, 1.0)
    assert agg._aggregate_noise_std() == 0.0
    agg.begin_round(point())
    assert agg._aggregate_noise_std() == 0.0  # no update at all


def test_a_non_finite_mean_is_discarded_with_its_reason() -> None:
    agg = stepper()
    agg.begin_round(point())
    bad = point(1)
    bad["m/A"][0, 0] = float("nan")
    summary = RoundSummary(server_round=1)
    assert agg._apply_checked({k: v for k, v in bad.items() if k != "head/w"}, summary) is None
    assert summary.discarded == "the aggregated update is not finite"


def test_a_step_whose_result_is_not_finite_is_discarded_and_leaves_the_optimizer_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A momentum server step applied once; in round 2 the step moves the velocity and then
    returns a non-finite adapter (as an overflow would): the round is discarded and the
    optimizer's state is that of round 1."""
    agg = stepper(mode="tangent", kind="momentum")
    agg.begin_round(point())
    update = {"m/dA": torch.full((M, R), 1e-2), "m/dB": torch.full((N, R), 1e-2)}
    assert agg._apply_checked(update, RoundSummary(server_round=1)) is not None
    before = agg.optimizer.state_dict()
    step = agg.optimizer.step

    def overflowing(*args, **kw):
        moved, head = step(*args, **kw)  # the velocity moves
        return {m: type(p)(p.A * float("inf"), p.B) for m, p in moved.items()}, head

    monkeypatch.setattr(agg.optimizer, "step", overflowing)
    summary = RoundSummary(server_round=2)
    assert agg._apply_checked(update, summary) is None
    assert summary.discarded == "the retracted adapter is not finite"
    after = agg.optimizer.state_dict()
    assert after[1] == before[1]
    assert after[0].keys() == before[0].keys() and after[0]
    for name, tensor in before[0].items():
        assert torch.equal(after[0][name], tensor), name


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
