"""Coordinator strategy: exact tangent aggregation, FedAvg-of-factors error, reply validation."""

from __future__ import annotations

import pytest
import torch
from conftest import random_point
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from reply_facts import honest_facts
from sitegrid import LoopbackSites
from strategy_helpers import strategy_for

from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.manifold import project_dense, tangent_displacement, tangent_to_dense
from prism_runtime.protocol import ACCOUNTING, CONFIG, ROUND_NONCE, SERVER_ROUND, UPDATE, key
from server.ledger import Ledger
from server.strategy import UpdateBound

pytestmark = pytest.mark.usefixtures("flower_identity")

MODULES = ["layer.0.q", "layer.0.v"]
SHAPES = {"layer.0.q": (12, 10, 3), "layer.0.v": (12, 10, 3)}


class _Grid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def _global(seed=0):
    arrays = {}
    for i, module in enumerate(MODULES):
        m, n, r = SHAPES[module]
        A, B = random_point(m, n, r, seed + i, dtype=torch.float32)
        arrays[key(module, "A")], arrays[key(module, "B")] = A, B
    return arrays


def _strategy(tmp_path, mode="tangent", **kw):
    ledger = Ledger.open(tmp_path / "ledger.sqlite")
    return strategy_for(modules=MODULES, ledger=ledger, mode=mode, **kw), ledger


def _facts(site, steps=2, status="ok"):
    """An honest reply's facts; ``_reply`` echoes the request's round and nonce."""
    return honest_facts(site, None, status=status, steps=steps, epsilon_cap=10.0)


def _reply(request, arrays, facts):
    config = request.content[CONFIG]  # an honest site echoes the round and its nonce
    facts = {**facts, SERVER_ROUND: config[SERVER_ROUND], ROUND_NONCE: config[ROUND_NONCE]}
    content = RecordDict({UPDATE: ArrayRecord(arrays), ACCOUNTING: ConfigRecord(facts)})
    return Message(content=content, reply_to=request)


def _site_ends(glob, k, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    ends = []
    for _ in range(k):
        end = {}
        for module in MODULES:
            A, B = glob[key(module, "A")], glob[key(module, "B")]
            end[module] = (
                A + scale * torch.randn(A.shape, generator=g),
                B + scale * torch.randn(B.shape, generator=g),
            )
        ends.append(end)
    return ends


def _best_rank_r(A, B, dA, dB, t):
    """Best rank-r approximation (truncated dense SVD) of ``Z + t (dA B.T + A dB.T)``: what the
    retraction must return (eq. 22, Prop. 3.2), computed without ``prism_core``."""
    U, S, Vh = torch.linalg.svd(A @ B.T + t * (dA @ B.T + A @ dB.T))
    r = A.shape[1]
    return (U[:, :r] * S[:r]) @ Vh[:r]


def _round(strategy, glob, payloads):
    requests = list(
        strategy.configure_train(1, ArrayRecord(glob), ConfigRecord(), _Grid([11, 12, 13]))
    )
    replies = [_reply(req, *payload) for req, payload in zip(requests, payloads, strict=True)]
    return strategy.aggregate_train(1, replies)


def test_tangent_aggregation_is_the_exact_mean_of_projected_site_displacements(tmp_path):
    glob = _global()
    ends = _site_ends(glob, 3, seed=1)
    payloads = []
    for i, end in enumerate(ends):
        arrays = {}
        for module in MODULES:
            A, B = glob[key(module, "A")].double(), glob[key(module, "B")].double()
            d = tangent_displacement(A, B, *(t.double() for t in end[module]))
            arrays[key(module, "dA")], arrays[key(module, "dB")] = d.dA.float(), d.dB.float()
        payloads.append((arrays, _facts(f"site-{i}")))
    strategy, ledger = _strategy(tmp_path)
    new, metrics = _round(strategy, glob, payloads)
    assert metrics["sites-accepted"] == 3
    new = new.to_torch_state_dict()
    for module in MODULES:
        A, B = glob[key(module, "A")].double(), glob[key(module, "B")].double()
        target = (
            sum(
                project_dense(A, B, e[module][0].double() @ e[module][1].double().T - A @ B.T)
                for e in ends
            )
            / 3
        )
        # the server's aggregated tangent vector, recovered exactly from the messages
        mean = [
            sum(p[0][key(module, part)].double() for p in payloads) / 3 for part in ("dA", "dB")
        ]
        got = tangent_to_dense(A, B, *mean)
        assert ((got - target).norm() / target.norm()).item() < 1e-6
        # and the new global point is its retraction (server lr 1): the best rank-r
        # approximation of Z + mean dZ
        torch.testing.assert_close(
            new[key(module, "A")].double() @ new[key(module, "B")].double().T,
            _best_rank_r(A, B, *mean, 1.0),
            atol=1e-5,
            rtol=1e-5,
        )
        # FedAvg of factors on the same inputs is not the mean of the Z_k
        mean_A = sum(e[module][0].double() for e in ends) / 3
        mean_B = sum(e[module][1].double() for e in ends) / 3
        mean_Z = sum(e[module][0].double() @ e[module][1].double().T for e in ends) / 3
        assert ((mean_A @ mean_B.T - mean_Z).norm() / mean_Z.norm()).item() > 1e-4
    assert ledger.sites() == ["site-0", "site-1", "site-2"]


def test_invalid_replies_are_skipped_and_still_charged(tmp_path):
    glob = _global()
    good = {}
    for module in MODULES:
        good[key(module, "dA")] = torch.zeros_like(glob[key(module, "A")])
        good[key(module, "dB")] = torch.zeros_like(glob[key(module, "B")])
    nan = dict(good)
    nan[key(MODULES[0], "dA")] = torch.full_like(good[key(MODULES[0], "dA")], float("nan"))
    wrong_shape = dict(good)
    wrong_shape[key(MODULES[1], "dB")] = torch.zeros(3, 3)
    strategy, ledger = _strategy(tmp_path)
    new, metrics = _round(
        strategy, glob, [(good, _facts("a")), (nan, _facts("b")), (wrong_shape, _facts("c"))]
    )
    assert metrics["sites-accepted"] == 1 and metrics["replies-rejected"] == 2
    reasons = [why for _, why in strategy.summaries[-1].rejected]
    assert any("NaN" in r for r in reasons) and any("shape" in r for r in reasons)
    assert ledger.sites() == ["a", "b", "c"]  # their budget was spent all the same
    assert all(torch.isfinite(t).all() for t in new.to_torch_state_dict().values())


def test_too_few_valid_replies_leave_the_adapter_unchanged(tmp_path):
    glob = _global()
    strategy, _ = _strategy(tmp_path, min_sites=2)
    bad = {key(MODULES[0], "dA"): torch.zeros(1)}
    new, metrics = _round(
        strategy, glob, [(bad, _facts("a")), (bad, _facts("b")), (bad, _facts("c"))]
    )
    assert new is None and metrics["applied"] == 0


def test_valid_replies_fewer_than_min_sites_leave_the_adapter_unchanged(tmp_path):
    """min-sites=3: two VALID replies (and one invalid) do not update the adapter, although
    they alone would give a finite aggregate; with three valid ones the round applies."""
    glob = _global()
    payloads = _noisy_payloads(glob, [1.0, 2.0, 3.0])
    bad = {key(MODULES[0], "dA"): torch.zeros(1)}
    two = tmp_path / "two"
    two.mkdir()
    strategy, ledger = _strategy(two, min_sites=3)
    new, metrics = _round(strategy, glob, [payloads[0], payloads[1], (bad, payloads[2][1])])
    assert metrics["sites-accepted"] == 2 and metrics["replies-rejected"] == 1
    assert new is None and metrics["applied"] == 0
    assert ledger.sites() == ["site-0", "site-1", "site-2"]  # all charged all the same
    three = tmp_path / "three"
    three.mkdir()
    strategy, _ = _strategy(three, min_sites=3)
    new, metrics = _round(strategy, glob, payloads)
    assert metrics["sites-accepted"] == 3 and metrics["applied"] == 1 and new is not None


class _ReplyingGrid(LoopbackSites, _Grid):
    """Answers every train message like a site with the given (sigma, q, cap)."""

    def __init__(self, nodes, facts_of, update_of):
        super().__init__(nodes)
        self.facts_of, self.update_of = facts_of, update_of
        self.asked: list[list[int]] = []

    def push_messages(self, messages):
        messages = list(messages)
        self.asked.append(sorted(m.metadata.dst_node_id for m in messages))
        return super().push_messages(messages)

    def answer(self, msg):
        return _reply(msg, self.update_of(), self.facts_of(msg.metadata.dst_node_id))


def _zero_update(glob):
    return lambda: {
        key(m, p): torch.zeros_like(glob[key(m, b)])
        for m in MODULES
        for p, b in (("dA", "A"), ("dB", "B"))
    }


def test_exhausted_sites_are_never_selected_again_and_the_run_ends_cleanly(tmp_path):
    glob = _global()

    def after(rounds):
        return epsilon([PrivacyEvent(1.0, 0.05, 2 * rounds)], 1e-5)

    caps = {11: after(1) * 1.001, 12: after(2) * 1.001, 13: after(2) * 1.001}  # 1, 2, 2 rounds

    def facts_of(node):
        facts = _facts(f"site-{node}")
        facts["epsilon-cap"] = caps[node]
        return facts

    grid = _ReplyingGrid([11, 12, 13], facts_of, _zero_update(glob))
    strategy, ledger = _strategy(tmp_path)
    result = strategy.start(grid, ArrayRecord(glob), num_rounds=5)
    assert grid.asked == [[11, 12, 13], [12, 13]]  # site-11 dropped after the round that filled it
    assert len(strategy.summaries) == 2  # round 3: nobody can continue, the run ends
    for node in caps:
        assert ledger.epsilon(f"site-{node}").prv <= caps[node]
    assert set(result.arrays.keys()) == set(glob)


def _factor_payloads(glob):
    """Three sites' ends as factor-average replies (what a fedavg-factors site, dp-adamw, runs)."""
    ends = _site_ends(glob, 3, seed=4)
    payloads = []
    for i, end in enumerate(ends):
        arrays = {}
        for module in MODULES:
            arrays[key(module, "A")], arrays[key(module, "B")] = end[module]
        payloads.append((arrays, {**_facts(f"s{i}"), "mechanism": "factor-gaussian"}))
    return ends, payloads


def test_factor_average_mode_is_fedavg_of_factors(tmp_path):
    glob = _global()
    ends, payloads = _factor_payloads(glob)
    strategy, _ = _strategy(tmp_path, mode="factor-average", mechanism="factor-gaussian")
    new, _ = _round(strategy, glob, payloads)
    new = new.to_torch_state_dict()
    for module in MODULES:
        mean_A = sum(e[module][0] for e in ends) / 3
        torch.testing.assert_close(new[key(module, "A")], mean_A, rtol=1e-6, atol=1e-6)


def _noisy_payloads(glob, sigmas):
    payloads = []
    for i, (end, sigma) in enumerate(
        zip(_site_ends(glob, len(sigmas), seed=5), sigmas, strict=True)
    ):
        arrays = {}
        for module in MODULES:
            A, B = glob[key(module, "A")].double(), glob[key(module, "B")].double()
            d = tangent_displacement(A, B, *(t.double() for t in end[module]))
            arrays[key(module, "dA")], arrays[key(module, "dB")] = d.dA.float(), d.dB.float()
        payloads.append((arrays, {**_facts(f"site-{i}"), "sigma": sigma}))
    return payloads


SIGMAS, SHARDS = [0.7, 2.1, 17.0], [500, 150, 40]  # a small site needs tenfold noise


def _closed_form_weights(aggregation):
    """docs/design.md §3: (b_k / (sigma_k C_k))^2, 1 or N_k, normalised (here C = 0.05, b = 16)."""
    raw = {
        "inverse-noise": [(16.0 / (s * 0.05)) ** 2 for s in SIGMAS],
        "uniform": [1.0] * len(SIGMAS),
        "examples": [float(n) for n in SHARDS],
    }[aggregation]
    return [w / sum(raw) for w in raw]


def _sized_payloads(glob, share_sizes=True):
    """Three honest sites sampling at q = b / N_k (b = 16, N_k = SHARDS); with ``share_sizes``
    they also state ``num-examples`` (a site's opt-in)."""
    return [
        (arrays, {**facts, "q": 16.0 / n, **({"num-examples": n} if share_sizes else {})})
        for (arrays, facts), n in zip(_noisy_payloads(glob, SIGMAS), SHARDS, strict=True)
    ]


def _weighted_round(tmp_path, aggregation, share_sizes=True):
    """One round of ``_sized_payloads`` under ``aggregation``."""
    glob = _global()
    payloads = _sized_payloads(glob, share_sizes)
    folder = tmp_path / f"{aggregation}-{share_sizes}"
    folder.mkdir()
    strategy, _ = _strategy(folder, aggregation=aggregation, max_norm=0.05, expected_batch_size=16)
    new, metrics = _round(strategy, glob, payloads)
    assert metrics["sites-accepted"] == 3 and metrics["applied"] == 1
    return glob, payloads, new.to_torch_state_dict()


def _expected_z(glob, payloads, weights):
    """Per module the best rank-r approximation of ``Z + sum_k w_k dZ_k`` (server lr 1)."""
    out = {}
    for module in MODULES:
        A, B = glob[key(module, "A")].double(), glob[key(module, "B")].double()
        mean = [
            sum(
                w * p[0][key(module, part)].double() for w, p in zip(weights, payloads, strict=True)
            )
            for part in ("dA", "dB")
        ]
        out[module] = _best_rank_r(A, B, *mean, 1.0)
    return out


@pytest.mark.parametrize("aggregation", ["inverse-noise", "uniform", "examples"])
def test_the_applied_update_uses_the_configured_weights(tmp_path, aggregation):
    """The new adapter is the retraction of the closed-form weighted mean for the configured
    mode, and is measurably NOT what either other mode's weights give."""
    glob, payloads, new = _weighted_round(tmp_path, aggregation)
    weights = _closed_form_weights(aggregation)
    assert sum(weights) == pytest.approx(1.0, abs=1e-12)
    want = _expected_z(glob, payloads, weights)
    others = [
        _expected_z(glob, payloads, _closed_form_weights(a))
        for a in ("inverse-noise", "uniform", "examples")
        if a != aggregation
    ]
    for module in MODULES:
        got = new[key(module, "A")].double() @ new[key(module, "B")].double().T
        torch.testing.assert_close(got, want[module], atol=1e-5, rtol=1e-5)
        for other in others:
            assert float((got - other[module]).abs().max()) > 1e-3  # 100x the tolerance


def test_examples_weights_need_no_opt_in_the_shard_size_is_b_over_q(tmp_path):
    """``examples`` weights from the sites' q = b / N_k alone (no ``num-examples`` sent) are
    the closed-form N_k weights: the same adapter as when the sites share their sizes."""
    _, _, shared = _weighted_round(tmp_path, "examples", share_sizes=True)
    glob, payloads, implied = _weighted_round(tmp_path, "examples", share_sizes=False)
    assert all("num-examples" not in facts for _, facts in payloads)
    want = _expected_z(glob, payloads, _closed_form_weights("examples"))
    for module in MODULES:
        got = implied[key(module, "A")].double() @ implied[key(module, "B")].double().T
        torch.testing.assert_close(got, want[module], atol=1e-5, rtol=1e-5)
        for part in ("A", "B"):
            torch.testing.assert_close(
                implied[key(module, part)], shared[key(module, part)], atol=1e-7, rtol=1e-6
            )


def test_a_q_that_implies_an_impossible_shard_is_rejected(tmp_path):
    """q = 1e-300 would state N = 1.6e301 and take all the weight: rejected (``facts``)."""
    glob = _global()
    payloads = _sized_payloads(glob, share_sizes=False)
    payloads[0][1]["q"] = 1e-300
    strategy, _ = _strategy(tmp_path, aggregation="examples", max_norm=0.05, expected_batch_size=16)
    _, metrics = _round(strategy, glob, payloads)
    assert metrics["sites-accepted"] == 2
    assert metrics["rejected-facts"] == 1


@pytest.mark.parametrize("stated", [41, 4000])
def test_a_shard_size_that_disagrees_with_b_over_q_is_rejected(tmp_path, stated):
    """A site sampling at q = 16 / 40 but claiming N = 4000 would buy 100x its weight: the
    reply is rejected (``facts``) and the others are aggregated."""
    glob = _global()
    payloads = _sized_payloads(glob)
    payloads[2][1]["num-examples"] = stated
    strategy, _ = _strategy(tmp_path, aggregation="examples", max_norm=0.05, expected_batch_size=16)
    _, metrics = _round(strategy, glob, payloads)
    assert metrics["sites-accepted"] == 2
    assert metrics["rejected-facts"] == 1


@pytest.mark.parametrize(
    ("fact", "value"), [("max-norm", 0.5), ("expected-batch-size", 1.0), ("max-norm", None)]
)
def test_weights_never_come_from_facts_that_do_not_match_the_run(tmp_path, fact, value):
    """A site claiming a larger b (or smaller C) would buy itself more weight: rejected."""
    glob = _global()
    payloads = _noisy_payloads(glob, [1.0, 1.0, 1.0])
    facts = {**payloads[0][1], fact: value}
    payloads[0] = (payloads[0][0], {k: v for k, v in facts.items() if v is not None})
    strategy, _ = _strategy(tmp_path, max_norm=0.05, expected_batch_size=16)
    _, metrics = _round(strategy, glob, payloads)
    assert metrics["sites-accepted"] == 2
    assert metrics["rejected-facts-mismatch"] == 1


def _round_at(strategy, glob, payloads, server_round):
    requests = list(
        strategy.configure_train(
            server_round, ArrayRecord(glob), ConfigRecord(), _Grid([11, 12, 13])
        )
    )
    replies = [_reply(req, *payload) for req, payload in zip(requests, payloads, strict=True)]
    return strategy.aggregate_train(server_round, replies)


@pytest.mark.parametrize(("server_round", "eta"), [(1, 1.0), (3, 0.5)])
def test_a_cosine_schedule_scales_the_tangent_step_of_the_round(tmp_path, server_round, eta):
    """Round t of T = 4 with server-lr 1: cos(pi (t - 1) / 4) annealing gives 1 in round 1 and
    exactly 1/2 in round 3; the new Z is the truncated dense SVD of Z + eta * mean dZ."""
    glob = _global()
    payloads = _noisy_payloads(glob, [1.0, 1.0, 1.0])
    for _, facts in payloads:
        facts["steps"] = 2
    strategy, _ = _strategy(tmp_path, aggregation="uniform", lr_schedule="cosine", num_rounds=4)
    new, metrics = _round_at(strategy, glob, payloads, server_round)
    assert metrics["applied"] == 1
    new = new.to_torch_state_dict()
    for module in MODULES:
        A, B = glob[key(module, "A")].double(), glob[key(module, "B")].double()
        mean = [
            sum(p[0][key(module, part)].double() for p in payloads) / 3 for part in ("dA", "dB")
        ]
        want = _best_rank_r(A, B, *mean, eta)
        got = new[key(module, "A")].double() @ new[key(module, "B")].double().T
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if eta != 1.0:  # and measurably not the unscheduled step
            assert float((got - _best_rank_r(A, B, *mean, 1.0)).abs().max()) > 1e-3


def test_a_cosine_schedule_scales_the_factor_average_step(tmp_path):
    """The baselines get the same schedule: round 3 of 4 moves A half way to the sites' mean."""
    glob = _global()
    ends, payloads = _factor_payloads(glob)
    strategy, _ = _strategy(
        tmp_path,
        mode="factor-average",
        mechanism="factor-gaussian",
        lr_schedule="cosine",
        num_rounds=4,
    )
    new, _ = _round_at(strategy, glob, payloads, 3)
    new = new.to_torch_state_dict()
    for module in MODULES:
        A = glob[key(module, "A")]
        mean_A = sum(e[module][0] for e in ends) / 3
        torch.testing.assert_close(
            new[key(module, "A")], A + 0.5 * (mean_A - A), rtol=1e-6, atol=1e-6
        )


def test_an_unknown_server_lr_schedule_is_refused(tmp_path):
    with pytest.raises(ValueError, match="server lr schedule 'step'"):
        _strategy(tmp_path, lr_schedule="step", num_rounds=4)


def test_a_momentum_head_may_move_ten_times_one_sgd_steps_bound(tmp_path):
    """Heavy ball with beta 0.9 sums the site's DP gradients with weights 0.9^k: at most
    1 / (1 - 0.9) = 10 times one step's bound, for the same reported sigma, q and C."""
    facts = {**_facts("site-0"), "sigma": 1.3, "q": 0.1}
    bounds = {}
    for optimizer in ("sgd", "momentum"):
        strategy, _ = _strategy(
            tmp_path / optimizer,
            head=["weight"],
            max_norm=0.05,
            expected_batch_size=16,
            update_bound=UpdateBound(
                lr=0.01,
                max_norm=0.05,
                expected_batch_size=16,
                head_lr=2.0,
                head_optimizer=optimizer,
            ),
        )
        strategy.checker.broadcast = {"head/weight": torch.zeros(2, 8)}
        bounds[optimizer] = strategy.checker.head_sgd_bound(facts)
    assert bounds["sgd"] > 0
    assert bounds["momentum"] == pytest.approx(10.0 * bounds["sgd"], rel=1e-12)
