"""The coordinator's norm bound on a site's round update (prism_core.bounds), on real sites.

Honest replies from the real trainer (tiny BERT, several seeds, PRISM with a DP head and the
factor-space baseline) must pass with a wide margin; the same reply scaled past the bound must
be rejected with reason ``norm``, and its accounting facts still charged.
"""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from reply_facts import honest_facts
from strategy_helpers import strategy_for

from client.policy import site_policy
from client.site import Site
from prism_runtime.config import RunConfig, SiteConfig, parse_config
from prism_runtime.exchange import head_named, to_arrays
from prism_runtime.protocol import ACCOUNTING, CONFIG, ROUND_NONCE, SERVER_ROUND, UPDATE
from server.ledger import Ledger
from server.strategy import PrismStrategy, UpdateBound

pytestmark = pytest.mark.usefixtures("flower_identity")

MARGIN = 0.5  # an honest update uses less than half of the bound


def _dp_step_bound(*, C, sigma, b, q, dimension, failure):
    """One DP step's norm bound, eqs. (16)-(19) of PRISM, written out from its two tails:
    ``(C X + sigma C ||xi||) / b`` with the realised Poisson batch X at its multiplicative
    Chernoff quantile (``P(X >= (1 + d) b) <= exp(-d^2 b / (2 + d))``, solved for d at
    ``failure / 2``; never above N = b / q) and ``||xi||^2 ~ chi^2_D`` at its Laurent-Massart
    quantile (2000, Lemma 1: ``D + 2 sqrt(D x) + 2 x``, ``x = ln(2 / failure)``)."""
    L = math.log(2 / failure)
    d = (L + math.sqrt(L * L + 8 * b * L)) / (2 * b)
    batch = min((1 + d) * b, b / q)
    noise = math.sqrt(dimension + 2 * math.sqrt(dimension * L) + 2 * L)
    return C * (batch + sigma * noise) / b


def test_the_written_out_dp_step_bound_is_above_a_brute_force_maximum():
    """50,000 draws of the worst case (every example fully clipped along one direction, so the
    clipped sum is exactly C X): the largest step norm stays below the bound at failure 1e-3
    (expected exceedances <= 50) and above half of it (the bound is not vacuous)."""
    C, sigma, b, q, D, draws = 0.5, 1.2, 32.0, 0.1, 57, 50_000
    g = torch.Generator().manual_seed(0)
    N = torch.full((draws,), b / q, dtype=torch.float64)
    X = torch.binomial(N, torch.full_like(N, q), generator=g)
    xi = torch.randn(draws, D, generator=g, dtype=torch.float64)
    direction = torch.zeros(D, dtype=torch.float64)
    direction[0] = 1.0
    norms = (C * X[:, None] * direction + sigma * C * xi).norm(dim=1) / b
    bound = _dp_step_bound(C=C, sigma=sigma, b=b, q=q, dimension=D, failure=1e-3)
    assert int((norms > bound).sum()) <= 1e-3 * draws
    tight = _dp_step_bound(C=C, sigma=sigma, b=b, q=q, dimension=D, failure=1e-9)
    assert 0.5 * tight < float(norms.max()) <= tight


class _Grid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def _run(tiny_bert, seed, **overrides):
    values = {
        "model": tiny_bert,
        "lora-rank": 4,
        "local-steps": 3,
        "batch-size": 16,
        "micro-batch-size": 16,
        "synthetic-examples": 48,
        "max-length": 16,
        "noise-multiplier": 0.8,
        "target-epsilon": 50.0,
        "max-norm": 0.5,
        "lr": 0.05,
        "seed": seed,
        # the AdamW-head setting these bounds were written for (the SGD head has its own test)
        "lora-head": "frozen",
        "head-init": "random",
        "head-optimizer": "adamw",
        "head-lr": -1.0,
        "head-max-norm": -1.0,
    }
    values.update(overrides)
    return parse_config(RunConfig, values, what="run config")


def _strategy(run, site, tmp_path):
    """The coordinator's strategy of ``run`` (its update bound: the sites' own optimizer
    settings, ``UpdateBound.for_run``; the sigma every reply must state: the run's)."""
    return PrismStrategy.from_run(
        run,
        modules=[h.name for h in site.loaded.handles],
        head=[n for n, _ in head_named(site.loaded)],
        ledger=Ledger.open(tmp_path / "ledger.sqlite"),
        run_id="run",
        wait_for_nodes=0.0,
    )


def _one_round(strategy, site, server_round):
    """The real site trains from the strategy's broadcast; its reply (maybe scaled) goes back."""
    broadcast = to_arrays(site.loaded)
    (request,) = strategy.configure_train(
        server_round, ArrayRecord(broadcast), ConfigRecord(), _Grid([7])
    )
    config = request.content[CONFIG]
    reply = site.train_round(config[SERVER_ROUND], broadcast)
    facts = {**reply.accounting, ROUND_NONCE: config[ROUND_NONCE]}  # as the ClientApp echoes it
    content = RecordDict({UPDATE: ArrayRecord(reply.arrays), ACCOUNTING: ConfigRecord(facts)})
    return strategy.aggregate_train(server_round, [Message(content=content, reply_to=request)])


def _norm_and_bound(strategy, arrays):
    """The strategy's own norm of a reply and this round's bound, via a rejected probe."""
    tensors = {k: torch.as_tensor(v) for k, v in arrays.items()}
    strategy.checker.check_norm(tensors, {})  # raises if over the bound
    if strategy.mode == "tangent":
        from prism_core.manifold import tangent_norm_sq

        total = 0.0
        for m in strategy.modules:
            point = strategy.checker.broadcast
            A, B = point[f"{m}/A"].double(), point[f"{m}/B"].double()
            dA, dB = tensors[f"{m}/dA"].double(), tensors[f"{m}/dB"].double()
            total += float(tangent_norm_sq(A, B, dA, dB))
        for n in strategy.head:
            total += float(tensors[f"head/{n}"].double().square().sum())
        return total**0.5, strategy.checker.norm_bound
    ratios = [
        float((tensors[k].double() - strategy.checker.broadcast[k].double()).norm()) / b
        for k, b in strategy.checker.factor_bounds.items()
    ]
    return max(ratios), 1.0


@pytest.mark.parametrize(
    ("method", "seed"),
    [("prism", 0), ("prism", 1), ("prism", 2), ("fedavg-factors", 0)],
)
def test_honest_site_updates_pass_with_margin_and_scaled_ones_are_rejected(
    tiny_bert, tmp_path, method, seed
):
    head = {"lora-head": "train"} if method == "prism" else {}  # PRISM with its DP head
    run = _run(tiny_bert, seed, method=method, **head)
    node = parse_config(
        SiteConfig,
        {
            "partition-id": seed,
            "num-partitions": 3,
            "state-dir": str(tmp_path / "state"),
            "epsilon-cap": 50.0,
        },
        what="node config",
    )
    # reproducible mode (a site-held secret per seed) keeps this test deterministic
    site = Site(run, node, site_policy(node, env_secret=f"update-bound-{seed}"))
    strategy = _strategy(run, site, tmp_path)
    for server_round in (1,):  # the next round starts with warm optimizer moments
        _, metrics = _one_round(strategy, site, server_round)
        assert metrics["sites-accepted"] == 1, strategy.summaries[-1].rejected
    # measure the honest margin on one more round, then send that same reply scaled up
    broadcast = to_arrays(site.loaded)
    (request,) = strategy.configure_train(2, ArrayRecord(broadcast), ConfigRecord(), _Grid([7]))
    config = request.content[CONFIG]
    reply = site.train_round(2, broadcast)
    reply.accounting[ROUND_NONCE] = config[ROUND_NONCE]  # as the ClientApp echoes it
    norm, bound = _norm_and_bound(strategy, reply.arrays)
    print(f"honest norm / bound = {norm / bound:.4f}")
    assert 0 < norm < MARGIN * bound, (norm, bound)
    factor = 1.5 * bound / norm
    if strategy.mode == "tangent":
        arrays = {k: (v * factor).contiguous() for k, v in reply.arrays.items()}
    else:  # move the factors 1.5x further than the bound allows
        point = strategy.checker.broadcast
        arrays = {
            k: (point[k] + factor * (v - point[k])).contiguous() for k, v in reply.arrays.items()
        }
    content = RecordDict({UPDATE: ArrayRecord(arrays), ACCOUNTING: ConfigRecord(reply.accounting)})
    new, metrics = strategy.aggregate_train(2, [Message(content=content, reply_to=request)])
    assert new is None and metrics["rejected-norm"] == 1
    assert [e.round for e in strategy.ledger.events(site.site_id)] == [1, 2]  # still charged


def test_sgd_bound_follows_the_reported_noise_and_rejects_past_it(tmp_path):
    """Plain DP-SGD sites: the bound uses C, b and the reply's sigma; 0.9x passes, 1.1x fails."""
    from conftest import random_point

    from prism_core.manifold import tangent_norm_sq

    m, n, r = 12, 10, 3
    A, B = random_point(m, n, r, 0, dtype=torch.float32)
    glob = {"mod/A": A, "mod/B": B}
    g = torch.Generator().manual_seed(0)
    dA, dB = torch.randn(m, r, generator=g), torch.randn(n, r, generator=g)
    unit = float(tangent_norm_sq(A.double(), B.double(), dA.double(), dB.double())) ** 0.5
    C, b, lr, tau, sigma, q = 0.5, 32.0, 0.1, 2, 1.2, 0.1
    # tau steps of at most one DP step each (failure 1e-9 / tau per step), retraction slack 2
    dimension = r * (m + n - r)  # the tangent space of the rank-r manifold (Thm 3.1)
    step = _dp_step_bound(C=C, sigma=sigma, b=b, q=q, dimension=dimension, failure=1e-9 / tau)
    bound = 2 * lr * tau * step
    for factor, accepted in ((0.9, 1), (1.1, 0)):
        strategy = strategy_for(
            modules=["mod"],
            ledger=Ledger.open(tmp_path / f"ledger-{factor}.sqlite"),
            run_id="run",
            sites_per_round=1,
            local_steps=tau,
            update_bound=UpdateBound(lr=lr, optimizer="sgd", max_norm=C, expected_batch_size=b),
        )
        (request,) = strategy.configure_train(1, ArrayRecord(glob), ConfigRecord(), _Grid([3]))
        facts = honest_facts(
            "s", request.content[CONFIG], sigma=sigma, q=q, max_norm=C,
            expected_batch_size=float(b), steps=tau, reason=None, epsilon_cap=None, epsilon=None,
        )  # fmt: skip
        scale = factor * bound / unit
        update = {"mod/dA": (scale * dA).contiguous(), "mod/dB": (scale * dB).contiguous()}
        content = RecordDict({UPDATE: ArrayRecord(update), ACCOUNTING: ConfigRecord(facts)})
        _, metrics = strategy.aggregate_train(1, [Message(content=content, reply_to=request)])
        assert metrics["sites-accepted"] == accepted, strategy.summaries[-1].rejected


@pytest.mark.parametrize(
    ("method", "optimizer"), [("prism", "sgd"), ("fedavg-factors", "sgd"), ("prism", "momentum")]
)
def test_sgd_head_bound_admits_an_honest_site_and_rejects_a_pushed_head(
    tiny_bert, tmp_path, method, optimizer
):
    """A DP head on plain SGD (its own clip share and lr): the honest round passes; the same
    reply with the head moved 1.5x past ``head_lr tau`` x (one DP step's bound) is rejected.
    With heavy-ball momentum 0.9 the velocity (carried from round 1 into round 2) can reach
    1 / (1 - 0.9) = 10 steps' bound: the same checks against 10x the SGD bound."""
    head = {
        "lora-head": "train",
        "head-optimizer": optimizer,
        "head-lr": 2.0,
        "head-max-norm": 0.3,
    }
    run = _run(tiny_bert, 0, method=method, **head)
    node = parse_config(
        SiteConfig,
        {
            "partition-id": 0,
            "num-partitions": 3,
            "state-dir": str(tmp_path / "state"),
            "epsilon-cap": 50.0,  # the run asks for more than the simulation default
        },
        what="node config",
    )
    site = Site(run, node, site_policy(node, env_secret="update-bound-sgd-head"))
    strategy = _strategy(run, site, tmp_path)
    strategy.update_bound = UpdateBound(
        lr=run.lr,
        max_norm=run.max_norm,
        expected_batch_size=run.batch_size,
        head_lr=run.head_learning_rate,
        head_optimizer=optimizer,
    )
    _, metrics = _one_round(strategy, site, 1)
    assert metrics["sites-accepted"] == 1, strategy.summaries[-1].rejected
    broadcast = to_arrays(site.loaded)
    (request,) = strategy.configure_train(2, ArrayRecord(broadcast), ConfigRecord(), _Grid([7]))
    reply = site.train_round(2, broadcast)
    reply.accounting[ROUND_NONCE] = request.content[CONFIG][ROUND_NONCE]
    # head_lr tau DP steps over the head's coordinates, with the total clip C (>= its share)
    facts = reply.accounting
    assert facts["max-norm"] == run.max_norm
    step = _dp_step_bound(
        C=run.max_norm,
        sigma=facts["sigma"],
        b=run.batch_size,
        q=facts["q"],
        dimension=sum(p.numel() for _, p in head_named(site.loaded)),
        failure=1e-9 / run.local_steps,
    )
    velocity = 10.0 if optimizer == "momentum" else 1.0  # 1 / (1 - beta), beta = 0.9
    bound = run.head_learning_rate * run.local_steps * step * velocity
    names = [f"head/{n}" for n in strategy.head]
    start = {
        k: broadcast[k] if method != "prism" else torch.zeros_like(broadcast[k]) for k in names
    }
    moved = sum(float((reply.arrays[k] - start[k]).double().square().sum()) for k in names) ** 0.5
    assert 0 < moved < MARGIN * bound, (moved, bound)
    factor = 1.5 * bound / moved
    arrays = dict(reply.arrays)
    for k in names:
        arrays[k] = (start[k] + factor * (reply.arrays[k] - start[k])).contiguous()
    content = RecordDict({UPDATE: ArrayRecord(arrays), ACCOUNTING: ConfigRecord(reply.accounting)})
    new, metrics = strategy.aggregate_train(2, [Message(content=content, reply_to=request)])
    assert new is None and metrics["rejected-norm"] == 1
