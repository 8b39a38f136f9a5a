"""A site's private clip norm (``max-norm = auto``): the estimate, its charge and its reuse."""

from __future__ import annotations

import json
import math

import pytest
import torch

from client.clip_quantile import ClipPlan, ClipStore, estimate_clip
from client.policy import site_policy
from client.site import Site
from client.site_ledger import SiteLedger
from prism_core.accounting import PrivacyEvent, calibrate_noise_multiplier, epsilon
from prism_core.quantile import QUANTILE_MECHANISM
from prism_runtime.config import RunConfig, SiteConfig, parse_config
from prism_runtime.errors import ConfigError
from prism_runtime.exchange import to_arrays
from prism_runtime.facts import ClipEstimate, ReplyFacts
from prism_runtime.protocol import STATUS_OK, STATUS_REFUSED

BATCH, EXAMPLES, K = 16, 64, 3


class _SyntheticNorms:
    """Stands in for ``PrivateTrainer``: Poisson batches of known per-example norms."""

    def __init__(self, norms: torch.Tensor, sample_rate: float, seed: int) -> None:
        self.norms, self.sample_rate = norms, sample_rate
        self.expected_batch_size = sample_rate * len(norms)
        self.sampler = torch.Generator().manual_seed(seed)
        self.noise = torch.Generator().manual_seed(seed + 1000)

    def count_within(self, clip: float, *, lora_only: bool) -> tuple[int, int]:
        taken = self.norms[torch.rand(len(self.norms), generator=self.sampler) < self.sample_rate]
        return int(taken.numel()), int((taken <= clip).sum())


def _plan(gamma: float, **kw: object) -> ClipPlan:
    args: dict[str, object] = dict(
        initial=0.05,
        target_quantile=gamma,
        lr=0.3,
        steps=60,
        noise_multiplier=0.01 * 400,  # sigma_b = 0.01 b: little noise
        sample_rate=0.1,
        head_clip=None,
    )
    args.update(kw)
    return ClipPlan(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("gamma", [0.2, 0.5, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_geometric_update_converges_near_the_quantile(gamma, seed):
    """4000 log-normal norms (median 0.4), b = 400: after 60 steps from C_0 = 0.05 the estimate
    is within 10 % (log-ratio) of the empirical gamma-quantile and the fraction of norms below it
    within 0.04 of gamma (seen: <= 4 % and <= 0.02)."""
    g = torch.Generator().manual_seed(seed)
    norms = torch.exp(torch.randn(4000, generator=g, dtype=torch.float64) * 0.7 + math.log(0.4))
    estimate = estimate_clip(_SyntheticNorms(norms, 0.1, seed), _plan(gamma))  # type: ignore[arg-type]
    target = float(torch.quantile(norms, gamma))
    assert abs(math.log(estimate.estimate / target)) <= 0.10
    assert float((norms <= estimate.estimate).double().mean()) == pytest.approx(gamma, abs=0.04)
    assert estimate.max_norm == estimate.estimate  # no head share: the estimate is the clip
    assert len(estimate.records) == 60
    assert {(r.mechanism, r.noise_multiplier, r.sample_rate) for r in estimate.records} == {
        (QUANTILE_MECHANISM, 4.0, 0.1)
    }


def test_the_fraction_divides_by_the_expected_batch_not_the_realised_one():
    """Every drawn example is below C, but the batches are small (37 of b = 100): the fraction is
    0.37 < gamma, so C must GROW. Dividing by the realised size (fraction 1) would shrink it."""

    class _Small(_SyntheticNorms):
        def count_within(self, clip: float, *, lora_only: bool) -> tuple[int, int]:
            return 37, 37

    trainer = _Small(torch.zeros(1000), 0.1, 0)
    plan = _plan(0.5, steps=1, noise_multiplier=1e-6)
    estimate = estimate_clip(trainer, plan)  # type: ignore[arg-type]
    assert estimate.estimate == pytest.approx(0.05 * math.exp(0.3 * (0.5 - 0.37)), rel=1e-6)


def test_a_split_clip_estimates_the_lora_part_and_adds_the_head_share():
    class _Record(_SyntheticNorms):
        def count_within(self, clip: float, *, lora_only: bool) -> tuple[int, int]:
            assert lora_only  # the head has its own share: count the LoRA norms alone
            return super().count_within(clip, lora_only=lora_only)

    norms = torch.full((1000,), 0.2, dtype=torch.float64)
    estimate = estimate_clip(_Record(norms, 0.1, 0), _plan(0.5, head_clip=0.3))  # type: ignore[arg-type]
    assert estimate.max_norm == pytest.approx(math.hypot(estimate.estimate, 0.3))


# -- a real site (tiny BERT) ----------------------------------------------------------------


def _run(tiny_bert, **overrides):
    values = {
        "model": tiny_bert,
        "lora-rank": 4,
        "local-steps": 2,
        "num-rounds": 3,
        "batch-size": BATCH,
        "micro-batch-size": 8,
        "synthetic-examples": EXAMPLES,
        "max-length": 24,
        "max-norm": "auto",
        "clip-quantile-steps": K,
        "clip-quantile-noise": 0.5,  # sigma_b = 8: a cheap estimate
        "noise-multiplier": 1.0,
        "target-epsilon": 40.0,
    }
    values.update(overrides)
    return parse_config(RunConfig, values, what="run config")


def _site(tiny_bert, tmp_path, run=None, **node):
    values = {"partition-id": 0, "num-partitions": 3, "state-dir": str(tmp_path / "state")}
    values.update(node)
    config = parse_config(SiteConfig, {"epsilon-cap": 50.0, **values}, what="node config")
    return Site(run or _run(tiny_bert), config, site_policy(config))


def test_an_auto_clip_site_charges_the_estimate_then_training_within_its_cap(tiny_bert, tmp_path):
    noise = {"clip-quantile-noise": 0.1}  # sigma_b = 1.6: an estimate that costs something
    run = _run(tiny_bert, **{"noise-multiplier": -1.0, "target-epsilon": 8.0, **noise})
    site = _site(tiny_bert, tmp_path, run)
    q = BATCH / EXAMPLES
    quantile = PrivacyEvent(0.1 * BATCH, q, K)
    assert epsilon([quantile], run.delta) > 0.5
    fresh = calibrate_noise_multiplier(
        target_epsilon=8.0, delta=run.delta, sample_rate=q, steps=run.planned_site_steps
    )
    assert site.sigma > fresh  # the training steps get what the estimate leaves
    planned = epsilon([quantile, PrivacyEvent(site.sigma, q, run.planned_site_steps)], run.delta)
    assert 8.0 * (1 - 0.005) - 1e-9 <= planned <= 8.0

    reply = site.train_round(1, to_arrays(site.loaded), run_id="run-a")
    facts = reply.accounting
    assert facts.status == STATUS_OK and ReplyFacts.parse(facts.to_record()) == facts
    entries = SiteLedger(tmp_path / "state").entries()
    assert [(e.server_round, e.mechanism) for e in entries] == [
        (1, QUANTILE_MECHANISM),
        (1, "prism-tangent-gaussian"),
    ]  # the estimate is charged first, as its own event
    assert (entries[0].sigma, entries[0].q, entries[0].steps) == (1.6, q, K)
    assert (entries[1].sigma, entries[1].steps) == (site.sigma, 2)
    assert facts.quantile == ClipEstimate(1.6, q, K)
    spent = epsilon([e.event for e in entries], run.delta)
    assert facts.epsilon == pytest.approx(spent, rel=1e-12) and spent <= 8.0

    stored = ClipStore(tmp_path / "state").load()
    assert stored is not None and stored.run_id == "run-a" and stored.server_round == 1
    low, high = run.auto_clip_range
    assert low <= facts.max_norm <= high
    assert facts.max_norm == stored.max_norm == site.trainer.config.max_norm


def test_a_restarted_site_reuses_its_runs_clip_and_a_new_run_estimates_again(tiny_bert, tmp_path):
    site = _site(tiny_bert, tmp_path)
    first = site.train_round(1, to_arrays(site.loaded), run_id="run-a").accounting
    assert first.quantile is not None

    restarted = _site(tiny_bert, tmp_path)  # a new process: nothing in memory
    second = restarted.train_round(2, to_arrays(restarted.loaded), run_id="run-a").accounting
    assert second.quantile is None  # nothing spent on the clip again
    assert second.max_norm == first.max_norm
    mechanisms = [e.mechanism for e in SiteLedger(tmp_path / "state").entries()]
    assert mechanisms.count(QUANTILE_MECHANISM) == 1 and len(mechanisms) == 3

    third = restarted.train_round(1, to_arrays(restarted.loaded), run_id="run-b").accounting
    assert third.quantile is not None  # a new run: a new estimate, charged
    entries = SiteLedger(tmp_path / "state").entries()
    assert [e.mechanism for e in entries[-2:]] == [QUANTILE_MECHANISM, "prism-tangent-gaussian"]
    assert ClipStore(tmp_path / "state").load().run_id == "run-b"  # type: ignore[union-attr]


def test_the_cap_check_covers_the_estimate_before_anything_is_charged(tiny_bert, tmp_path):
    """A cap that the round's steps fit but not the estimate plus the steps: refused, nothing
    charged, no estimate stored (the estimate is never spent on a round that cannot run)."""
    q = BATCH / EXAMPLES
    train = epsilon([PrivacyEvent(1.0, q, 2)], 1e-5)
    both = epsilon([PrivacyEvent(0.8, q, K), PrivacyEvent(1.0, q, 2)], 1e-5)
    assert both > train + 1.0
    run = _run(tiny_bert, **{"clip-quantile-noise": 0.05, "target-epsilon": (train + both) / 2})
    site = _site(tiny_bert, tmp_path, run)
    reply = site.train_round(1, to_arrays(site.loaded), run_id="run-a")
    assert (reply.accounting.status, reply.accounting.reason) == (
        STATUS_REFUSED,
        "cap-exhausted",
    )
    assert SiteLedger(tmp_path / "state").entries() == []
    assert ClipStore(tmp_path / "state").load() is None


@pytest.mark.parametrize("method", ["prism", "fedavg-factors"])
def test_count_within_counts_the_norms_the_clip_sees(tiny_bert, tmp_path, method):
    """With a DP head: every example is within a huge C and none within a tiny one; the joint
    (LoRA + head) norm is never below the LoRA norm, so fewer examples are within C jointly."""
    run = _run(tiny_bert, method=method, **{"lora-head": "train"})
    site = _site(tiny_bert, tmp_path, run)
    trainer = site.trainer

    def count(clip: float, lora_only: bool) -> tuple[int, int]:
        trainer.reseed(7)  # the same Poisson batch every time
        return trainer.count_within(clip, lora_only=lora_only)

    n, below = count(1e6, False)
    assert n > 0 and below == n
    assert count(1e-9, False) == (n, 0)
    for clip in (0.01, 0.05, 0.2, 1.0):
        joint, lora = count(clip, False)[1], count(clip, True)[1]
        assert joint <= lora
    params = {name: p.detach().clone() for name, p in site.loaded.model.named_parameters()}
    assert all(p.equal(params[name]) for name, p in site.loaded.model.named_parameters())


def test_a_split_head_clip_runs_with_the_total_of_the_estimate_and_the_share(tiny_bert, tmp_path):
    run = _run(tiny_bert, **{"lora-head": "train", "head-max-norm": 0.05})
    site = _site(tiny_bert, tmp_path, run)
    assert site.clip_plan is not None and site.clip_plan.head_clip == 0.05
    facts = site.train_round(1, to_arrays(site.loaded), run_id="run-a").accounting
    stored = ClipStore(tmp_path / "state").load()
    assert stored is not None
    assert facts.max_norm == pytest.approx(math.hypot(stored.estimate, 0.05), rel=1e-12)
    assert site.trainer.config.head_max_norm == 0.05  # the head keeps its share
    low, high = run.auto_clip_range
    assert low <= facts.max_norm <= high


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda obj: {**obj, "estimate": 1e9, "max-norm": 1e9}, "is not one the plan can produce"),
        (lambda obj: {k: v for k, v in obj.items() if k != "run-id"}, "unreadable"),
        (None, "unreadable"),  # not JSON
    ],
)
def test_a_damaged_clip_file_stops_the_site_and_is_left_as_it_is(
    tiny_bert, tmp_path, damage, problem
):
    site = _site(tiny_bert, tmp_path)
    site.train_round(1, to_arrays(site.loaded), run_id="run-a")
    path = tmp_path / "state" / ClipStore.FILE
    text = json.dumps(damage(json.loads(path.read_text()))) if damage else '{"run-id": "run-a"'
    path.write_text(text)
    entries = SiteLedger(tmp_path / "state").entries()
    restarted = _site(tiny_bert, tmp_path)
    with pytest.raises(ConfigError, match=problem) as info:
        restarted.train_round(2, to_arrays(restarted.loaded), run_id="run-a")
    assert str(path) in str(info.value) and "move it away" in str(info.value)
    assert path.read_text() == text
    assert SiteLedger(tmp_path / "state").entries() == entries  # nothing charged


class _CrashError(Exception):
    """A crash injected at one point of a round."""


def test_a_crash_between_the_two_charges_never_leaves_a_step_uncharged(tiny_bert, tmp_path):
    """Crash after the estimate's charge, before its store: the restart estimates and charges
    again (counted twice, never zero). Crash after the store, before the training charge: the
    restart reuses the estimate and charges only the steps."""
    site = _site(tiny_bert, tmp_path)

    def lost(stored):
        raise _CrashError

    site.clip_store.save = lost  # type: ignore[method-assign]
    with pytest.raises(_CrashError):
        site.train_round(1, to_arrays(site.loaded), run_id="run-a")
    mechanisms = [e.mechanism for e in SiteLedger(tmp_path / "state").entries()]
    assert mechanisms == [QUANTILE_MECHANISM]  # charged before it ran
    assert ClipStore(tmp_path / "state").load() is None

    restarted = _site(tiny_bert, tmp_path)
    charge = restarted.ledger.charge

    def crash_on_training(entry):
        if entry.mechanism != QUANTILE_MECHANISM:
            raise _CrashError
        charge(entry)

    restarted.ledger.charge = crash_on_training  # type: ignore[method-assign]
    with pytest.raises(_CrashError):
        restarted.train_round(1, to_arrays(restarted.loaded), run_id="run-a")
    stored = ClipStore(tmp_path / "state").load()
    assert stored is not None and stored.run_id == "run-a"  # stored before the steps' charge
    mechanisms = [e.mechanism for e in SiteLedger(tmp_path / "state").entries()]
    assert mechanisms == [QUANTILE_MECHANISM, QUANTILE_MECHANISM]  # the first one counts too

    again = _site(tiny_bert, tmp_path)
    facts = again.train_round(1, to_arrays(again.loaded), run_id="run-a").accounting
    assert facts.quantile is None and facts.max_norm == stored.max_norm
    entries = SiteLedger(tmp_path / "state").entries()
    assert [e.mechanism for e in entries] == [QUANTILE_MECHANISM] * 2 + ["prism-tangent-gaussian"]
    assert facts.epsilon == pytest.approx(epsilon([e.event for e in entries], 1e-5))
