"""A federated site's round: its own policy and cap, its durable ledger, and what leaves it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers.sites import simulated_node, tiny_run_config

import prism_core.mechanism
import prism_runtime.trainer.base
from client.policy import SIMULATION_DELTA, SIMULATION_EPSILON_CAP, site_policy
from client.reply import released_event
from client.site import Site
from client.site_ledger import SiteLedger
from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.rng import SecureRNG
from prism_runtime.config import RunConfig, SiteConfig, parse_config
from prism_runtime.errors import AccountingMismatchError, ConfigError
from prism_runtime.exchange import to_arrays
from prism_runtime.facts import ReplyFacts
from prism_runtime.protocol import (
    HEAD_PREFIX,
    REFUSAL_REASONS,
    RNG_REPRODUCIBLE,
    RNG_SECURE,
    STATUS_OK,
    STATUS_REFUSED,
    key,
)

SECRET = "test-secret"


_run, _node = tiny_run_config, simulated_node


def _site(tiny_bert, tmp_path, run=None, secret="", **node):
    config = _node(tmp_path, **node)
    return Site(run or _run(tiny_bert), config, site_policy(config, env_secret=secret))


def _same(a, b):
    return set(a) == set(b) and all(a[k].equal(b[k]) for k in a)


def _ledger_bytes(site):
    path = site.ledger.path
    return path.read_bytes() if path.exists() else None


# -- what leaves a site -------------------------------------------------------------------------


def test_default_reply_carries_only_dp_update_and_accounting_facts(tiny_bert, tmp_path):
    site = _site(tiny_bert, tmp_path)
    reply = site.train_round(1, to_arrays(site.loaded))
    assert reply.accounting.status == STATUS_OK
    assert ReplyFacts.parse(reply.accounting.to_record()) == reply.accounting
    assert reply.accounting.rng == RNG_SECURE  # the default: the OS CSPRNG at the site
    assert reply.accounting.unit == "record"  # from the mechanism's records, as charged
    assert [e.unit for e in site.ledger.entries()] == ["record"]
    assert reply.accounting.num_examples is None  # not shared unless the site allows it
    assert reply.nonprivate == {}
    modules = {h.name for h in site.loaded.handles}
    for name in reply.arrays:
        if name.startswith(HEAD_PREFIX):
            continue
        module, part = name.rsplit("/", 1)
        assert module in modules and part in ("dA", "dB")
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in reply.arrays.values())


def test_nonprivate_metrics_only_when_the_run_asks_and_the_site_allows(tiny_bert, tmp_path):
    run = _run(tiny_bert, **{"report-train-loss": True})
    site = _site(
        tiny_bert,
        tmp_path,
        run=run,
        **{"share-num-examples": True, "allow-nonprivate-metrics": True},
    )
    reply = site.train_round(1, to_arrays(site.loaded))
    assert list(reply.nonprivate) == ["nonprivate-train-loss"]
    assert reply.accounting.num_examples == 64


# -- the site's policy: requests above it are refused, and refusing costs nothing -------------

REFUSED_REQUESTS = [
    ({"method": "nondp"}, {}, "nondp-not-allowed"),
    ({"report-train-loss": True}, {}, "nonprivate-metrics-not-allowed"),
    ({"target-epsilon": 1e6}, {}, "epsilon-above-site-cap"),
    ({"delta": 0.9}, {}, "delta-above-site-policy"),
    # the site's own delta allows it, but 0.05 is not below 1/N = 1/64
    ({"delta": 0.05}, {"delta": 0.1}, "delta-not-below-1/n"),
    # a Poisson batch of expected size 128 cannot be drawn from 64 examples (q would be 2)
    ({"batch-size": 128}, {}, "batch-above-site-data"),
    # the coordinator cannot switch DP off or raise the budget on a DEFAULT simulated site
    ({"target-epsilon": 1e6, "delta": 0.9}, {"epsilon-cap": None}, "epsilon-above-site-cap"),
]


@pytest.mark.parametrize(("request_", "node", "code"), REFUSED_REQUESTS, ids=lambda v: str(v))
def test_a_request_the_site_does_not_allow_is_refused_and_charges_nothing(
    tiny_bert, tmp_path, request_, node, code
):
    honest = _site(tiny_bert, tmp_path)
    honest.train_round(1, to_arrays(honest.loaded))
    before = _ledger_bytes(honest)
    assert before is not None and before.count(b"\n") == 1
    hostile = _site(tiny_bert, tmp_path, run=_run(tiny_bert, **request_), **node)
    reply = hostile.train_round(2, to_arrays(honest.loaded))
    assert reply.accounting.status == STATUS_REFUSED
    assert reply.accounting.reason == code and code in REFUSAL_REASONS
    assert reply.accounting.unit == "record"
    assert reply.accounting.steps == 0 and reply.arrays == {} and reply.nonprivate == {}
    assert ReplyFacts.parse(reply.accounting.to_record()) == reply.accounting
    assert _ledger_bytes(hostile) == before  # byte-identical: nothing charged
    again = hostile.train_round(3, to_arrays(honest.loaded))  # and every round alike
    assert again.accounting.reason == code and _ledger_bytes(hostile) == before


def test_requests_at_or_below_the_site_policy_are_honoured(tiny_bert, tmp_path):
    run = _run(tiny_bert, **{"target-epsilon": 20.0, "delta": 1e-6})  # stricter: fine
    stricter = _site(tiny_bert, tmp_path, run=run, **{"epsilon-cap": 50.0, "delta": 1e-4})
    reply = stricter.train_round(1, to_arrays(stricter.loaded))
    assert reply.accounting.status == STATUS_OK
    assert (reply.accounting.epsilon_cap, reply.accounting.delta) == (20.0, 1e-6)
    # the run's request, not the site's policy, is what this run may spend
    assert stricter.ledger.entries()[0].delta == 1e-6


def test_a_default_simulated_site_has_strict_defaults(tiny_bert, tmp_path):
    config = parse_config(SiteConfig, {"partition-id": 1, "num-partitions": 3}, what="n")
    policy = site_policy(config, run_dir=str(tmp_path / "run"))
    assert (policy.epsilon_cap, policy.delta) == (SIMULATION_EPSILON_CAP, SIMULATION_DELTA)
    assert policy.state_dir == tmp_path / "run" / "sites" / "site-1"
    assert not policy.allow_nondp and not policy.allow_nonprivate_metrics
    assert policy.rng == RNG_SECURE
    no_run_dir = site_policy(config, run_id=77)
    assert str(no_run_dir.state_dir) == "runs/flwr-run-77/sites/site-1"


@pytest.mark.parametrize(
    ("node", "missing"),
    [
        ({"site-id": "h"}, "epsilon-cap, delta, state-dir"),
        ({"site-id": "h", "epsilon-cap": 2.0, "delta": 1e-6}, "state-dir"),
        ({"site-id": "h", "delta": 1e-6, "state-dir": "/s"}, "epsilon-cap"),
        # a data file makes a site deployed even with a partition id
        (
            {"partition-id": 0, "num-partitions": 2, "data-path": "/d.jsonl"},
            "epsilon-cap, delta, state-dir",
        ),
    ],
)
def test_a_deployed_site_must_state_its_cap_delta_and_state_dir(node, missing):
    config = parse_config(SiteConfig, node, what="node config")
    with pytest.raises(ConfigError, match=f"lacks {missing}: a site states its own privacy"):
        site_policy(config)


def test_a_deployed_site_refuses_a_reproducible_secret_unless_it_opts_out(tmp_path):
    deployed = {"site-id": "h", "epsilon-cap": 2.0, "delta": 1e-6, "state-dir": str(tmp_path)}
    config = parse_config(SiteConfig, deployed, what="node config")
    with pytest.raises(ConfigError, match="PRISM_FL_RNG_SECRET asks for reproducible"):
        site_policy(config, env_secret=SECRET)
    with_node_secret = parse_config(SiteConfig, {**deployed, "rng-secret": SECRET}, what="n")
    with pytest.raises(ConfigError, match="node config rng-secret asks for reproducible"):
        site_policy(with_node_secret)
    assert SECRET not in repr(with_node_secret)  # the secret stays out of logs
    opted_out = parse_config(SiteConfig, {**deployed, "require-secure-rng": False}, what="n")
    assert site_policy(opted_out, env_secret=SECRET).rng == RNG_REPRODUCIBLE
    # a simulated site may use it, unless it asks for secure randomness
    simulated = parse_config(SiteConfig, {"partition-id": 0, "require-secure-rng": True}, what="n")
    with pytest.raises(ConfigError, match="require-secure-rng is true"):
        site_policy(simulated, env_secret=SECRET)


# -- the site's own cap and ledger -------------------------------------------------------------


def test_site_refuses_past_its_own_cap_even_if_asked(tiny_bert, tmp_path):
    one_round = epsilon([PrivacyEvent(1.0, 16 / 64, 2)], 1e-5)
    run = _run(tiny_bert, **{"target-epsilon": one_round * 1.2})
    site = _site(tiny_bert, tmp_path, run=run, **{"epsilon-cap": one_round * 1.2})
    first = site.train_round(1, to_arrays(site.loaded))
    before = _ledger_bytes(site)
    second = site.train_round(2, to_arrays(site.loaded))  # the server ignored the cap
    assert first.accounting.status == STATUS_OK
    assert second.accounting.status == STATUS_REFUSED and second.arrays == {}
    assert second.accounting.reason == "cap-exhausted"
    assert _ledger_bytes(site) == before
    assert [e.steps for e in site.ledger.entries()] == [2]
    assert site.ledger.epsilon(1e-5) == pytest.approx(one_round)


def test_the_charge_is_durable_before_the_first_step_runs(tiny_bert, tmp_path):
    """Every step of a round starts with that round's charge already in the ledger FILE (read
    back by a fresh ``SiteLedger``, as a restarted site would): a crash mid-round never leaves
    spent budget unrecorded."""
    site = _site(tiny_bert, tmp_path)
    on_disk_at_each_step = []
    step = site.trainer.step

    def step_after_reading_the_file():
        entries = SiteLedger(site.state_dir).entries()
        on_disk_at_each_step.append([(e.server_round, e.steps) for e in entries])
        return step()

    site.trainer.step = step_after_reading_the_file  # the instance attribute shadows the method
    site.train_round(1, to_arrays(site.loaded))
    site.train_round(2, to_arrays(site.loaded))
    assert on_disk_at_each_step == [[(1, 2)]] * 2 + [[(1, 2), (2, 2)]] * 2


def test_the_cap_check_counts_the_round_it_is_about_to_run(tiny_bert, tmp_path):
    """The site's OWN check refuses a round whose steps would pass the cap although the budget
    spent so far is below it. The trainer's budget check (a second line of defence) is switched
    off, so only the site's check can refuse, and nothing may be charged."""
    one_round = epsilon([PrivacyEvent(1.0, 16 / 64, 2)], 1e-5)
    below_one_round = _run(tiny_bert, **{"target-epsilon": one_round * 0.9})
    first = _site(tiny_bert, tmp_path / "a", run=below_one_round)
    first.trainer._check_budget = lambda: None
    reply = first.train_round(1, to_arrays(first.loaded))
    assert (reply.accounting.status, reply.accounting.reason) == (
        STATUS_REFUSED,
        "cap-exhausted",
    )
    assert _ledger_bytes(first) is None  # spent 0 < cap, yet nothing charged or run

    two_rounds = epsilon([PrivacyEvent(1.0, 16 / 64, 4)], 1e-5)
    cap = (one_round + two_rounds) / 2  # one round fits, two do not
    site = _site(tiny_bert, tmp_path / "b", run=_run(tiny_bert, **{"target-epsilon": cap}))
    site.trainer._check_budget = lambda: None
    assert site.train_round(1, to_arrays(site.loaded)).accounting.status == STATUS_OK
    assert epsilon(site.ledger.events(), 1e-5) == pytest.approx(one_round)  # < cap
    before = _ledger_bytes(site)
    second = site.train_round(2, to_arrays(site.loaded))
    assert (second.accounting.status, second.accounting.reason) == (
        STATUS_REFUSED,
        "cap-exhausted",
    )
    assert second.arrays == {} and _ledger_bytes(site) == before


def test_a_calibrated_sigma_covers_every_planned_round(tiny_bert, tmp_path):
    """noise-multiplier = -1: sigma is calibrated so that ALL planned rounds (num-rounds x
    local-steps at q = b / N) spend the target, not one round. Checked by composing the planned
    steps with the site's sigma (PRV, the reporting accountant): at most the target, and within
    3 % of it (calibration tolerance 0.5 %)."""
    target, rounds = 3.0, 12
    run = _run(
        tiny_bert, **{"noise-multiplier": -1.0, "target-epsilon": target, "num-rounds": rounds}
    )
    site = _site(tiny_bert, tmp_path, run=run)
    q = 16 / 64
    assert site.sample_rate == pytest.approx(q, rel=1e-12)
    planned = epsilon([PrivacyEvent(site.sigma, q, rounds * 2)], 1e-5)
    assert target * 0.97 <= planned <= target
    # one round at this sigma spends far less: a sigma for one round would overshoot
    assert epsilon([PrivacyEvent(site.sigma, q, 2)], 1e-5) < target / 2
    reply = site.train_round(1, to_arrays(site.loaded))
    assert reply.accounting.sigma == site.sigma  # the steps ran at that sigma


def test_a_restart_remembers_spent_budget(tiny_bert, tmp_path):
    site = _site(tiny_bert, tmp_path)
    site.train_round(1, to_arrays(site.loaded))
    restarted = _site(tiny_bert, tmp_path)
    spent = site.ledger.epsilon(1e-5)
    assert spent > 0
    assert restarted.ledger.epsilon(1e-5) == pytest.approx(spent)


def test_bad_run_and_node_configs_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown run config key\(s\) \['lora-rnak'\]"):
        parse_config(RunConfig, {"lora-rnak": 4}, what="run config")
    with pytest.raises(ConfigError, match="run config local-steps=0"):
        parse_config(RunConfig, {"local-steps": 0}, what="run config")
    with pytest.raises(ConfigError, match="min-sites=5 exceeds sites-per-round=3"):
        parse_config(RunConfig, {"min-sites": 5}, what="run config")


def test_a_re_asked_round_resends_the_stored_reply_and_spends_nothing(tiny_bert, tmp_path):
    site = _site(tiny_bert, tmp_path)
    arrays = to_arrays(site.loaded)
    first = site.train_round(1, arrays, run_id="run-a")
    restarted = _site(tiny_bert, tmp_path)  # a new process of the same site
    again = restarted.train_round(1, arrays, run_id="run-a")
    assert _same(again.arrays, first.arrays) and again.accounting == first.accounting
    assert [e.server_round for e in restarted.ledger.entries()] == [1]  # charged once
    moved = {k: v + 1e-3 for k, v in arrays.items()}  # another broadcast point: a new release
    other = restarted.train_round(1, moved, run_id="run-a")
    assert not _same(other.arrays, first.arrays)
    assert [e.server_round for e in restarted.ledger.entries()] == [1, 1]


# -- the broadcast is checked before anything is charged ---------------------------------------


def _rank_deficient(t):
    out = t.clone()
    out[:, -1] = out[:, 0] * 2.0  # two proportional columns: rank r - 1
    return out


BAD_BROADCASTS = {
    "nan": lambda a, n: {**a, n: torch.full_like(a[n], math.nan)},
    "inf-entry": lambda a, n: {
        **a,
        n: a[n].index_put((torch.tensor([0]),), torch.tensor(math.inf)),
    },
    "rank-deficient": lambda a, n: {**a, n: _rank_deficient(a[n])},
    "zero-factor": lambda a, n: {**a, n: torch.zeros_like(a[n])},
    "missing-key": lambda a, n: {k: v for k, v in a.items() if k != n},
    "extra-key": lambda a, n: {**a, "evil/A": torch.ones(3, 4)},
    "wrong-shape": lambda a, n: {**a, n: torch.ones(a[n].shape[0] + 1, a[n].shape[1])},
    "integer-dtype": lambda a, n: {**a, n: a[n].round().to(torch.int64)},
}


@pytest.mark.parametrize("kind", sorted(BAD_BROADCASTS))
def test_a_bad_broadcast_is_refused_before_anything_is_charged(tiny_bert, tmp_path, kind):
    site = _site(tiny_bert, tmp_path)
    good = to_arrays(site.loaded)
    site.train_round(1, good)
    before = _ledger_bytes(site)
    name = key(site.loaded.handles[0].name, "A")
    reply = site.train_round(2, BAD_BROADCASTS[kind](good, name))
    assert reply.accounting.status == STATUS_REFUSED
    assert reply.accounting.reason == "bad-broadcast" and reply.arrays == {}
    assert _ledger_bytes(site) == before  # byte-identical: the garbled round cost nothing
    assert site.train_round(2, good).accounting.status == STATUS_OK  # a good one still runs


def test_a_non_finite_head_in_the_broadcast_is_refused(tiny_bert, tmp_path):
    site = _site(tiny_bert, tmp_path, run=_run(tiny_bert, **{"lora-head": "train"}))
    good = to_arrays(site.loaded)
    heads = [k for k in good if k.startswith(HEAD_PREFIX)]
    assert heads
    before = _ledger_bytes(site)
    bad = {**good, heads[0]: torch.full_like(good[heads[0]], math.nan)}
    assert site.train_round(1, bad).accounting.reason == "bad-broadcast"
    assert _ledger_bytes(site) == before


# -- randomness belongs to the site -------------------------------------------------------------


def test_a_coordinator_replica_cannot_reproduce_a_reply(tiny_bert, tmp_path):
    """Same run config (same seed), same partition, same broadcast: the replies differ."""
    site = _site(tiny_bert, tmp_path / "site")
    replica = _site(tiny_bert, tmp_path / "replica")  # what a curious coordinator can build
    arrays = to_arrays(site.loaded)
    real = site.train_round(3, arrays, run_id="x")
    copy = replica.train_round(3, arrays, run_id="x")
    assert real.accounting.rng == RNG_SECURE
    for name in real.arrays:
        assert not torch.allclose(real.arrays[name], copy.arrays[name], rtol=0, atol=1e-7), name


class _Draws:
    """Records, during one round, every Gaussian draw of the mechanism (tangent and head noise,
    via ``prism_core.mechanism.standard_normal``) and every batch the trainer sampled."""

    def __init__(self, monkeypatch):
        self.noise, self.batches = [], []
        draw, split = prism_core.mechanism.standard_normal, prism_runtime.trainer.base.micro_batches

        def recording_draw(*args, **kwargs):
            out = draw(*args, **kwargs)
            self.noise.append(out.detach().double().flatten().clone())
            return out

        def recording_split(batch, *args, **kwargs):
            self.batches.append(batch["input_ids"].clone())
            return split(batch, *args, **kwargs)

        monkeypatch.setattr(prism_core.mechanism, "standard_normal", recording_draw)
        monkeypatch.setattr(prism_runtime.trainer.base, "micro_batches", recording_split)

    def take(self):
        noise, batches = torch.cat(self.noise), list(self.batches)
        self.noise, self.batches = [], []
        return noise, batches


def _same_batches(a, b):
    if len(a) != len(b):
        return False
    return all(x.shape == y.shape and x.equal(y) for x, y in zip(a, b, strict=True))


def test_noise_and_batches_are_not_reproducible_from_what_the_coordinator_knows(
    tiny_bert, tmp_path, monkeypatch
):
    """Default policy: a replica built from the run config (its seed included), the same
    partition and the same broadcast draws other noise AND other batches than the site."""
    site = _site(tiny_bert, tmp_path / "site")
    replica = _site(tiny_bert, tmp_path / "replica")
    arrays = to_arrays(site.loaded)
    draws = _Draws(monkeypatch)
    site.train_round(1, arrays, run_id="x")
    noise, batches = draws.take()
    replica.train_round(1, arrays, run_id="x")
    replica_noise, replica_batches = draws.take()
    count = noise.numel()
    assert count == replica_noise.numel() > 1000 and len(batches) == 2
    # independent N(0, 1) draws: |corr| < 5 / sqrt(count) except with probability ~6e-7
    corr = torch.corrcoef(torch.stack([noise, replica_noise]))[0, 1]
    assert abs(float(corr)) < 5 / math.sqrt(count)
    assert not _same_batches(batches, replica_batches)  # P(equal) ~ 0.625^128 for q = 1/4
    assert isinstance(site.trainer.noise, SecureRNG)


def test_reproducible_noise_follows_the_site_secret_never_the_run_seed(
    tiny_bert, tmp_path, monkeypatch
):
    """Reproducible mode: the same secret gives the same draws whatever the run's ``seed``;
    another secret gives other draws. (The site's own data file: the rows do not depend on the
    run's seed, so only the randomness could differ.)"""
    data = tmp_path / "rows.jsonl"
    rows = [{"text": f"row {i} is {'good' if i % 2 else 'bad'}", "label": i % 2} for i in range(64)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def deployed(folder, run_seed, secret):
        node = {
            "site-id": "h",
            "data-path": str(data),
            "epsilon-cap": 50.0,
            "delta": 1e-5,
            "state-dir": str(tmp_path / folder),
            "require-secure-rng": False,
        }
        config = parse_config(SiteConfig, node, what="node config")
        run = _run(tiny_bert, seed=run_seed)
        return Site(run, config, site_policy(config, env_secret=secret))

    draws = _Draws(monkeypatch)
    sites = {
        folder: deployed(folder, run_seed, secret)
        for folder, run_seed, secret in (("a", 0, SECRET), ("b", 7, SECRET), ("c", 0, "other"))
    }
    arrays = to_arrays(sites["a"].loaded)
    results = {}
    for folder, site in sites.items():
        site.train_round(1, arrays, run_id="x")
        results[folder] = draws.take()
    (noise_a, batches_a), (noise_b, batches_b), (noise_c, batches_c) = (results[k] for k in "abc")
    assert noise_a.numel() > 0 and torch.equal(noise_a, noise_b)  # the run seed changed nothing
    assert _same_batches(batches_a, batches_b)
    assert not torch.allclose(noise_a, noise_c) and not _same_batches(batches_a, batches_c)


def test_sampling_and_noise_differ_between_reseeds_by_default(tiny_bert, tmp_path):
    site = _site(tiny_bert, tmp_path)
    trainer = site.trainer

    def draw():
        trainer.reseed(site.policy.round_seed(1, 0))  # None: from the OS
        batches = [next(trainer._batches)["input_ids"] for _ in range(3)]
        noise = [trainer.noise.normal((64,), torch.float64, torch.device("cpu")) for _ in range(2)]
        return batches, torch.cat(noise)

    (b1, n1), (b2, n2) = draw(), draw()
    assert trainer.rng == RNG_SECURE
    assert any(x.shape != y.shape or not x.equal(y) for x, y in zip(b1, b2, strict=True))
    assert not torch.allclose(n1, n2)


def test_reproducible_mode_needs_the_sites_secret_and_says_so(tiny_bert, tmp_path):
    arrays = to_arrays(_site(tiny_bert, tmp_path / "init").loaded)
    a = _site(tiny_bert, tmp_path / "a", secret=SECRET).train_round(3, arrays, run_id="x")
    b = _site(tiny_bert, tmp_path / "b", secret=SECRET).train_round(3, arrays, run_id="y")
    assert a.accounting.rng == RNG_REPRODUCIBLE
    assert _same(a.arrays, b.arrays)  # the same secret: bitwise the same reply
    other = _site(tiny_bert, tmp_path / "c", secret="another").train_round(3, arrays, run_id="x")
    assert not _same(a.arrays, other.arrays)
    node_secret = _site(tiny_bert, tmp_path / "d", **{"rng-secret": SECRET})
    assert _same(node_secret.train_round(3, arrays, run_id="x").arrays, a.arrays)


def test_a_re_run_round_is_charged_again_and_draws_fresh_noise(tiny_bert, tmp_path):
    """Reproducible mode: the second charge of a round (no stored reply) is a new release."""
    site = _site(tiny_bert, tmp_path, secret=SECRET)
    arrays = to_arrays(site.loaded)
    first = site.train_round(1, arrays)  # no run id: nothing to resend
    (tmp_path / "state" / "last-round.pt").unlink()  # as if the site died before storing
    fresh = _site(tiny_bert, tmp_path, secret=SECRET)
    second = fresh.train_round(1, arrays)
    assert [e.server_round for e in fresh.ledger.entries()] == [1, 1]  # charged twice ...
    assert not _same(first.arrays, second.arrays)  # ... so it must be two independent draws


# -- one accounting path: the mechanism's records ----------------------------------------------


def test_reply_facts_are_the_mechanisms_records_and_a_mismatch_fails_loudly(tiny_bert, tmp_path):
    site = _site(tiny_bert, tmp_path)
    reply = site.train_round(1, to_arrays(site.loaded))
    (entry,) = site.ledger.entries()
    facts = reply.accounting
    assert (facts.sigma, facts.q, facts.steps) == (entry.sigma, entry.q, entry.steps)
    assert facts.mechanism == "prism-tangent-gaussian" == entry.mechanism
    # A trainer that runs another sigma than the site charged: no reply, the charge stays.
    site.trainer.noise_multiplier = 2.0
    with pytest.raises(AccountingMismatchError, match="the mechanism ran"):
        site.train_round(2, to_arrays(site.loaded))
    assert [e.server_round for e in SiteLedger(tmp_path / "state").entries()] == [1, 2]


def test_released_event_needs_one_mechanism_and_equal_steps():
    record = PrivacyEvent(1.0, 0.25, 1, max_norm=0.1, expected_batch_size=4.0)
    released = released_event([record] * 3, "prism-tangent-gaussian")
    assert released == PrivacyEvent(1.0, 0.25, 3, max_norm=0.1, expected_batch_size=4.0)
    with pytest.raises(AccountingMismatchError):
        released_event([record], "factor-gaussian")
    other = PrivacyEvent(1.1, 0.25, 1, max_norm=0.1, expected_batch_size=4.0)
    with pytest.raises(AccountingMismatchError):
        released_event([record, other], "prism-tangent-gaussian")
    with pytest.raises(AccountingMismatchError):
        released_event([], "prism-tangent-gaussian")


def test_an_allowed_nondp_run_is_recorded_as_unprotected(tiny_bert, tmp_path):
    run = _run(tiny_bert, method="nondp", **{"lora-init": "standard"})
    site = _site(tiny_bert, tmp_path, run=run, **{"allow-nondp": True})
    reply = site.train_round(1, to_arrays(site.loaded))
    assert reply.accounting.status == STATUS_OK and reply.accounting.sigma == 0.0
    (entry,) = site.ledger.entries()
    assert entry.sigma == 0.0 and entry.steps == 2
    assert reply.accounting.epsilon == math.inf  # the data now has no DP guarantee
    dp = _site(tiny_bert, tmp_path)  # a later DP run on the same ledger cannot claim one
    assert dp.train_round(2, to_arrays(dp.loaded)).accounting.reason == "cap-exhausted"


def test_siamese_pairs_with_a_zero_shot_sgd_head_run_a_round(tiny_bert, tmp_path):
    """Text pairs encoded siamese, the head from the cosine rule, trained by SGD with its own
    clip share: a round runs and replies with a finite DP update (head included)."""
    from conftest import shared_data_file

    with open(shared_data_file("medical_questions_pairs/train.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(96)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = {
        "data": str(data),
        "text-pairs": True,
        "pair-encoding": "siamese",
        "head-init": "zero-shot",
        "lora-head": "train",
        "head-optimizer": "sgd",
        "head-lr": 1.0,
        "head-max-norm": 0.03,  # of max-norm 0.05: LoRA gets 0.04
    }
    site = _site(tiny_bert, tmp_path, run=_run(tiny_bert, **pairs))
    assert site.loaded.spec.siamese and site.loaded.pair_encoding == "siamese"
    broadcast = to_arrays(site.loaded)
    reply = site.train_round(1, broadcast)
    assert reply.accounting.status == STATUS_OK
    assert all(torch.isfinite(t).all() for t in reply.arrays.values())
    assert reply.arrays[HEAD_PREFIX + "head.weight"].abs().sum() > 0  # the head moved
    with pytest.raises(ConfigError, match="text-pairs=true but this site's data are single"):
        _site(tiny_bert, tmp_path / "single", run=_run(tiny_bert, **{"text-pairs": True}))
