"""Plain rounds with ``step-at = coordinator``: each site releases one noisy gradient at the
broadcast point and the coordinator takes PRISM's adaptive step on their weighted mean.

The step itself is checked against the site's own: on one site's release, the coordinator's
step (``CentralStep.apply_mean``) lands exactly where that site's own PRISM step lands from the
same batch and noise. The round is checked end to end on the real coordinator and the real
ClientApp of each site over a loopback grid (``resume_driver.LoopbackGrid``; Flower's transport
is left out): every round applied, one step charged a round, the moments checkpointed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from flwr.supercore.task_identity import TaskIdentity
from reply_facts import honest_reply_facts
from resume_driver import CrashAt, CrashError, LoopbackGrid, assert_same_adapter
from safetensors import safe_open

from client.release import released_gradient
from prism_core.bounds import dp_step_norm_bound, tangent_dimension
from prism_runtime.config import RunConfig, parse_config
from prism_runtime.data import TokenizedDataset
from prism_runtime.errors import ConfigError
from prism_runtime.exchange import head_named, to_arrays
from prism_runtime.faults import Faults
from prism_runtime.model import ModelConfig, load_model
from prism_runtime.protocol import HEAD_PREFIX, key
from prism_runtime.train_config import site_train_config
from prism_runtime.trainer import PrismTrainer
from server.errors import ReplyError
from server.federation import run_federation
from server.ledger import Ledger
from server.strategy.aggregator import StreamingAggregator
from server.strategy.bounds import UpdateBound, UpdateChecker
from server.strategy.central import CentralStep

SITES, ROUNDS = 3, 2


def _run_config(model: str, **extra: object) -> RunConfig:
    values: dict[str, object] = {
        "model": model,
        "lora-rank": 4,
        "batch-size": 16,
        "micro-batch-size": 16,
        "noise-multiplier": 1.0,
        "max-norm": 0.5,
        "head-max-norm": 0.4,
        "lr": 0.01,
        "head-lr": 2.0,
        "step-at": "coordinator",
        **extra,
    }
    return parse_config(RunConfig, values, what="run config")


def test_the_coordinators_step_on_one_release_is_the_sites_own_step(tiny_bert, sst2_rows):
    """Two copies of one model and trainer, one seed: the first takes its own PRISM step
    (``PrismTrainer.step``: release, adaptive transform, retraction, the head's optimizer); the
    second only releases (``private_gradient``) and the coordinator steps on that release. The
    two end at the same factors and head (float32 tolerance), and the release is charged alike."""
    run = _run_config(tiny_bert)
    config = site_train_config(run, method="prism", max_norm=0.5, noise_multiplier=1.0)
    config = config.model_copy(update={"steps": 1, "seed": 7})

    def trainer() -> PrismTrainer:
        lm = load_model(ModelConfig(model=tiny_bert, rank=4))
        dataset = TokenizedDataset(sst2_rows[:64], lm.tokenizer, "seq-cls", max_length=32)
        return PrismTrainer(lm, dataset, config)

    own, released = trainer(), trainer()
    start = to_arrays(own.loaded)
    assert all(torch.equal(v, to_arrays(released.loaded)[k]) for k, v in start.items())
    (result,) = own.train(1)
    release, gradient_result = released.private_gradient()
    assert gradient_result.record == result.record  # the same event, charged alike
    assert released.history == own.history
    means = released_gradient(released.loaded, release)
    modules = [h.name for h in released.loaded.handles]
    head = [name for name, _ in head_named(released.loaded)]
    central = CentralStep(run, modules=modules, head=head, arrays=start)
    moved = central.apply_mean(start, means, noise_std=1.0 * 0.5 / 16)
    ended = to_arrays(own.loaded)
    assert set(moved) == set(ended)
    for name, value in ended.items():
        torch.testing.assert_close(moved[name], value, atol=2e-6, rtol=1e-5, msg=name)
    assert any(not torch.equal(ended[k], start[k]) for k in start)  # the step moved something
    unchanged = to_arrays(released.loaded)
    assert all(torch.equal(unchanged[k], start[k]) for k in start)  # nothing moved at the site


def test_the_round_server_lr_scales_the_head_step_as_the_lora_step(tiny_bert):
    """``lr_scale`` (the round's server lr) scales the head's SGD step as it scales the LoRA
    step: half the scale, half the head's move, from the same state."""
    run = _run_config(tiny_bert, **{"head-optimizer": "sgd"})
    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    start = to_arrays(lm)
    modules = [h.name for h in lm.handles]
    head = [name for name, _ in head_named(lm)]
    g = torch.Generator().manual_seed(5)
    means = {
        k.removesuffix("/A") + "/dA": torch.zeros_like(v)
        for k, v in start.items()
        if k.endswith("/A")
    }
    means |= {
        k.removesuffix("/B") + "/dB": torch.zeros_like(v)
        for k, v in start.items()
        if k.endswith("/B")
    }
    means |= {HEAD_PREFIX + n: torch.randn(start[HEAD_PREFIX + n].shape, generator=g) for n in head}
    for scale in (1.0, 0.5):
        central = CentralStep(run, modules=modules, head=head, arrays=start)
        moved = central.apply_mean(start, means, noise_std=0.01, lr_scale=scale)
        for n in head:
            delta = moved[HEAD_PREFIX + n] - start[HEAD_PREFIX + n]
            torch.testing.assert_close(delta, -2.0 * scale * means[HEAD_PREFIX + n])
    assert central.optimizer is not None and central.head_lrs == [2.0]  # the base lr is kept


class RecordingStep:
    """A ``MeanStep`` that records what the aggregator hands it and returns the broadcast."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, torch.Tensor], float, float]] = []

    def apply_mean(
        self,
        arrays: dict[str, torch.Tensor],
        means: dict[str, torch.Tensor],
        *,
        noise_std: float,
        lr_scale: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        self.calls.append((means, noise_std, lr_scale))
        return dict(arrays)


def test_the_aggregator_hands_the_weighted_mean_and_its_noise_to_the_coordinators_step():
    """Weights 1 and 3, noise stds 0.2 and 0.1: the mean is (x1 + 3 x2) / 4 and its noise std
    sqrt((0.2 / 4)^2 + (0.3 / 4)^2); the round's server lr (cosine, round 2 of 4) scales the
    step."""
    step = RecordingStep()
    aggregator = StreamingAggregator(
        modules=["m"],
        head=[],
        mode="tangent",
        server_lr=1.0,
        lr_schedule="cosine",
        num_rounds=4,
        aggregation="examples",
        dp=True,
        central=step,
    )
    broadcast = {key("m", "A"): torch.ones(3, 2), key("m", "B"): torch.ones(2, 2)}
    aggregator.begin_round(broadcast)
    x1 = {key("m", "dA"): torch.full((3, 2), 1.0), key("m", "dB"): torch.full((2, 2), 2.0)}
    x2 = {key("m", "dA"): torch.full((3, 2), 5.0), key("m", "dB"): torch.full((2, 2), -2.0)}
    aggregator.add(x1, 1.0, 0.2)
    aggregator.add(x2, 3.0, 0.1)
    aggregator.apply({k: (v / 1.0) for k, v in aggregator._sums.items()}, 0.5)
    means, noise, lr = step.calls[0]
    assert noise == pytest.approx(math.hypot(0.2 / 4, 0.3 / 4), rel=1e-12)
    assert aggregator.mean_noise_std == pytest.approx(math.hypot(0.05, 0.075), rel=1e-12)
    assert lr == 0.5
    summary = type("S", (), {"server_round": 2, "discarded": ""})()
    aggregator.finish(summary)  # type: ignore[arg-type]
    means, _, lr = step.calls[1]
    torch.testing.assert_close(means[key("m", "dA")], torch.full((3, 2), 4.0))
    torch.testing.assert_close(means[key("m", "dB")], torch.full((2, 2), -1.0))
    assert lr == pytest.approx(0.5 * (1 + math.cos(math.pi * 1 / 4)), rel=1e-12)


def test_a_gradient_reply_is_checked_against_one_releases_bound():
    """The norm of a reply is bounded by ``dp_step_norm_bound`` at the reply's sigma and q,
    over the tangent and head dimensions: just inside passes, just outside is ``norm``."""
    m, n, r, head = 6, 4, 2, (3, 4)
    g = torch.Generator().manual_seed(3)
    broadcast = {
        key("m", "A"): torch.randn(m, r, generator=g),
        key("m", "B"): torch.randn(n, r, generator=g),
        HEAD_PREFIX + "weight": torch.randn(*head, generator=g),
    }
    facts = honest_reply_facts(sigma=1.3, q=0.1, max_norm=0.5)
    checker = UpdateChecker(
        modules=["m"],
        head=["weight"],
        mode="tangent",
        local_steps=1,
        update_bound=UpdateBound(lr=0.05, max_norm=0.8, expected_batch_size=16.0),
        gradient=True,
    )
    checker.begin_round(1, broadcast)
    bound = dp_step_norm_bound(
        max_norm=0.5,
        noise_multiplier=1.3,
        expected_batch_size=16.0,
        sample_rate=0.1,
        dimension=tangent_dimension([(m, n, r)]) + 12,
        failure=1e-9,
    )
    assert checker.gradient_bound(facts) == pytest.approx(bound, rel=1e-12)
    for factor, ok in ((0.999, True), (1.002, False)):
        update = {
            key("m", "dA"): torch.zeros(m, r),
            key("m", "dB"): torch.zeros(n, r),
            HEAD_PREFIX + "weight": torch.zeros(*head),
        }
        update[HEAD_PREFIX + "weight"].view(-1)[0] = bound * factor
        record = ArrayRecord({k: Array(np.ascontiguousarray(v.numpy())) for k, v in update.items()})
        if ok:
            checker.validate(record, facts)
        else:
            with pytest.raises(ReplyError, match=r"gradient norm .* one DP release") as err:
                checker.validate(record, facts)
            assert err.value.code == "norm"
    with pytest.raises(Exception, match="one release"):
        UpdateChecker(
            modules=["m"], head=[], mode="tangent", local_steps=2, update_bound=None, gradient=True
        )


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"local-steps": 2}, "local-steps=2"),
        ({"method": "fedavg-factors"}, "method='fedavg-factors'"),
    ],
)
def test_step_at_coordinator_needs_prism_and_one_local_step(tiny_bert, extra, named):
    with pytest.raises(ConfigError, match=rf"run config: step-at=coordinator needs .*{named}"):
        _run_config(tiny_bert, **extra)


def test_secure_aggregation_refuses_site_steps(tiny_bert):
    with pytest.raises(ConfigError, match=r"step-at='site' \(the coordinator steps on the sum"):
        _run_config(tiny_bert, **{"step-at": "site", "secure-aggregation": True})


# -- end to end over a loopback grid -------------------------------------------------------


def _values(model: str, run_dir: Path) -> dict[str, object]:
    return {
        "model": model,
        "lora-rank": 4,
        "num-rounds": ROUNDS,
        "batch-size": 16,
        "micro-batch-size": 16,
        "synthetic-examples": 96,
        "max-length": 24,
        "target-epsilon": 8.0,
        "sites-per-round": SITES,
        "min-sites": SITES,
        "step-at": "coordinator",
        "server-eval-data": "synthetic",
        "run-dir": str(run_dir),
    }


def _grid(values: dict[str, object], **node: Any) -> LoopbackGrid:
    grid = LoopbackGrid(values, SITES)
    for config in grid.nodes.values():
        config.update(node)
    return grid


def _federate(values: dict[str, object], grid: LoopbackGrid, faults: Faults | None = None) -> Path:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    run = parse_config(RunConfig, values, what="run config")
    if faults is None:
        return run_federation(grid, run)  # type: ignore[arg-type]
    return run_federation(grid, run, faults=faults)  # type: ignore[arg-type]


def test_a_plain_run_stepping_at_the_coordinator_applies_every_round_and_charges_one_step(
    tiny_bert, tmp_path
):
    run_dir = _federate(values := _values(tiny_bert, tmp_path / "run"), _grid(values))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds-applied"] == ROUNDS
    ledger = Ledger.open(run_dir / "ledger.sqlite")
    try:
        sites = ledger.sites()
        assert len(sites) == SITES
        for site in sites:
            events = ledger.events(site)
            assert [e.round for e in events] == list(range(1, ROUNDS + 1)), events
            assert all(e.confirmed and e.event.steps == 1 for e in events), events
            assert {e.event.mechanism for e in events} == {"prism-tangent-gaussian"}
    finally:
        ledger.close()
    with safe_open(str(run_dir / "checkpoint.safetensors"), "pt") as ckpt:
        kept = [k for k in ckpt.keys() if k.startswith("round-state/central/adaptive/")]  # noqa: SIM118
    assert kept, "the coordinator's adaptive moments are checkpointed"


def test_a_resumed_coordinator_step_run_ends_where_the_uninterrupted_one_does(tiny_bert, tmp_path):
    """The coordinator's adaptive moments and head optimizer are its resume state: a run that
    dies before round 2 and resumes ends with the adapter of the run that never stopped (the
    sites seed from a site-held secret here, so both draw the same noise)."""
    secret = {"rng-secret": "coordinator-step-resume-test"}
    straight = _values(tiny_bert, tmp_path / "straight")
    straight_dir = _federate(straight, _grid(straight, **secret))
    crashed = _values(tiny_bert, tmp_path / "crashed")
    with pytest.raises(CrashError):
        _federate(crashed, _grid(crashed, **secret), faults=CrashAt("round-start", 2))
    resumed_dir = _federate(crashed, _grid(crashed, **secret))
    assert_same_adapter(straight_dir, resumed_dir)
