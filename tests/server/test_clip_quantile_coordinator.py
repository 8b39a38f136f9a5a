"""The coordinator side of a private clip norm (``max-norm = auto``): the estimate's charge in
the ledger and the report, the reported clip's range, and unconfirmed estimates.

The first test drives ``PrismStrategy.aggregate_train`` with REAL replies of a ``client.site.Site``
(tiny BERT), so both ledgers (the site's and the coordinator's) and the report are compared on
the same run; the others use hand-made facts, as ``test_site_owned_privacy`` does.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
from conftest import random_point
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, RecordDict
from reply_facts import honest_facts
from strategy_helpers import strategy_for

from client.policy import site_policy
from client.site import Site
from client.site_ledger import SiteLedger
from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.quantile import QUANTILE_MECHANISM
from prism_runtime.config import RunConfig, SiteConfig, parse_config
from prism_runtime.exchange import head_named, to_arrays
from prism_runtime.protocol import (
    ACCOUNTING,
    ARRAYS,
    CONFIG,
    ROUND_NONCE,
    SERVER_ROUND,
    UPDATE,
    key,
)
from server.audit.accountants import check_ledger
from server.ledger import Ledger
from server.report import build_report
from server.report_files import write_reports
from server.strategy import AutoClip, PrismStrategy, UpdateBound

pytestmark = pytest.mark.usefixtures("flower_identity")

TRAIN = "prism-tangent-gaussian"
K = 3


class _Grid:
    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)


def _ask(strategy, server_round, arrays, nodes=(11,)):
    requests = strategy.configure_train(
        server_round, ArrayRecord(arrays), ConfigRecord(), _Grid(nodes)
    )
    return {r.metadata.dst_node_id: r for r in requests}


def _message(request, arrays, facts):
    facts = {**facts, ROUND_NONCE: request.content[CONFIG][ROUND_NONCE]}
    content = RecordDict({UPDATE: ArrayRecord(arrays), ACCOUNTING: ConfigRecord(facts)})
    return Message(content=content, reply_to=request)


def _rows(report):
    return {r["site_id"]: r for r in report["sites"]}


# -- a real site -------------------------------------------------------------------------------


def _run(tiny_bert):
    values = {
        "model": tiny_bert,
        "lora-rank": 4,
        "local-steps": 2,
        "batch-size": 16,
        "micro-batch-size": 8,
        "synthetic-examples": 64,
        "max-length": 24,
        "max-norm": "auto",
        "clip-quantile-steps": K,
        "clip-quantile-noise": 0.1,
        "noise-multiplier": 1.0,
        "target-epsilon": 40.0,
        # one joint clip and a frozen head: the strategy below bounds updates as for AdamW
        "lora-head": "frozen",
        "head-init": "random",
        "head-optimizer": "adamw",
        "head-lr": -1.0,
        "head-max-norm": -1.0,
    }
    return parse_config(RunConfig, values, what="run config")


def test_the_estimate_is_charged_in_both_ledgers_and_in_the_report(tiny_bert, tmp_path):
    run = _run(tiny_bert)
    node = parse_config(
        SiteConfig,
        {
            "partition-id": 0,
            "num-partitions": 3,
            "state-dir": str(tmp_path / "site"),
            "epsilon-cap": 40.0,
        },
        what="node config",
    )
    site = Site(run, node, site_policy(node))
    ledger = Ledger.open(tmp_path / "ledger.sqlite")
    strategy = PrismStrategy.from_run(
        run,
        modules=[h.name for h in site.loaded.handles],
        head=[name for name, _ in head_named(site.loaded)],
        ledger=ledger,
        run_id="run-1",
        wait_for_nodes=0.0,
    )
    assert strategy.terms.auto_clip == AutoClip.for_run(run)
    assert strategy.update_bound == UpdateBound.for_run(run)
    assert strategy.update_bound.max_norm == run.auto_clip_range[1]  # the largest clip
    arrays = to_arrays(site.loaded)
    for server_round in (1, 2):
        (request,) = _ask(strategy, server_round, arrays).values()
        broadcast = request.content[ARRAYS].to_torch_state_dict()
        reply = site.train_round(server_round, broadcast, run_id="run-1")
        new, metrics = strategy.aggregate_train(
            server_round, [_message(request, reply.arrays, reply.accounting)]
        )
        assert metrics["sites-accepted"] == 1 and new is not None, strategy.summaries[-1]
        arrays = new.to_torch_state_dict()
        if server_round == 1:
            assert reply.accounting["quantile-steps"] == K

    # the coordinator's ledger holds what the site's ledger holds, the estimate as its own row
    site_entries = SiteLedger(tmp_path / "site").entries()
    rows = ledger.events("site-0")
    assert [(e.round, e.mechanism) for e in rows] == [
        (1, QUANTILE_MECHANISM),
        (1, TRAIN),
        (2, TRAIN),
    ]
    assert [(e.round, e.mechanism, e.sigma, e.q, e.steps) for e in rows] == [
        (e.server_round, e.mechanism, e.sigma, e.q, e.steps) for e in site_entries
    ]
    assert all(e.confirmed for e in rows)
    spent = epsilon([e.event for e in site_entries], run.delta)
    assert ledger.epsilon("site-0").prv == pytest.approx(spent, rel=1e-12)
    without = epsilon([e.event for e in site_entries[1:]], run.delta)
    assert spent > without + 1e-3  # the estimate is not free

    report = build_report(ledger, planned_steps_per_round=run.local_steps)
    row = _rows(report)["site-0"]
    assert row["epsilon"] == pytest.approx(spent, rel=1e-12)
    assert (row["quantile_steps"], row["quantile_charges"]) == (K, 1)
    assert row["quantile_sigma_values"] == [pytest.approx(0.1 * run.batch_size)]
    assert (row["steps"], row["rounds"]) == (2 * run.local_steps, 2)  # training alone
    assert "private clip estimate" in row["note"]
    assert [(p["round"], p["epsilon"]) for p in report["series"]["site-0"]] == [
        (1, pytest.approx(epsilon([e.event for e in site_entries[:2]], run.delta))),
        (2, pytest.approx(spent)),
    ]
    paths = write_reports(report, tmp_path / "report")
    with paths["csv"].open(newline="") as f:
        (table,) = list(csv.DictReader(f))
    assert (table["quantile_steps"], table["quantile_charges"]) == (str(K), "1")
    assert _rows(json.loads(paths["json"].read_text()))["site-0"]["quantile_steps"] == K
    assert "clip-estimate steps" in paths["html"].read_text()

    (check,) = check_ledger(ledger)  # prism-fl audit (a): PRV, RDP and PLD on mixed events
    assert check.passed, check.reasons
    assert check.events == 3 and abs(check.pld - check.prv) <= check.pld_tolerance
    ledger.close()


# -- hand-made replies -------------------------------------------------------------------------

MODULE, M, N, R = "layer.0.q", 10, 8, 2
TAU, SIGMA, Q, DELTA = 2, 1.0, 0.05, 1e-5
AUTO = AutoClip(low=0.01, high=1.0, steps=K, noise_multiplier=6.4)


def _global():
    A, B = random_point(M, N, R, 0, dtype=torch.float32)
    return {key(MODULE, "A"): A, key(MODULE, "B"): B}


def _strategy(ledger, auto=AUTO):
    return strategy_for(
        modules=[MODULE],
        ledger=ledger,
        sites_per_round=2,
        local_steps=TAU,
        target_epsilon=100.0,
        delta=DELTA,
        auto_clip=auto,
    )


def _facts(node, request, **changes):
    """An honest reply's facts, with ``changes`` (None: leave the fact out); the nonce is
    added by ``_message``."""
    facts = {SERVER_ROUND: request.content[CONFIG][SERVER_ROUND], "mechanism": TRAIN}
    facts.update({"sigma": SIGMA, "q": Q, "steps": TAU, "delta": DELTA, "max-norm": 0.2})
    return honest_facts(f"site-{node}", None, **{**facts, **changes})


def _reply(request, **changes):
    node = request.metadata.dst_node_id
    update = {
        key(MODULE, "dA"): torch.full((M, R), 1e-3),
        key(MODULE, "dB"): torch.full((N, R), -1e-3),
    }
    return _message(request, update, _facts(node, request, **changes))


ESTIMATED = {"quantile-sigma": 6.4, "quantile-q": Q, "quantile-steps": K}


@pytest.mark.parametrize(
    ("changes", "auto", "code"),
    [
        ({"max-norm": 1.5}, AUTO, "facts-mismatch"),  # above every clip the estimate can give
        ({"max-norm": 0.001}, AUTO, "facts-mismatch"),
        ({"max-norm": None}, AUTO, "facts-mismatch"),
        ({**ESTIMATED, "quantile-steps": K + 1}, AUTO, "facts-mismatch"),
        ({"quantile-sigma": 6.4, "quantile-steps": K}, AUTO, "facts"),  # q missing
        ({**ESTIMATED, "quantile-sigma": 0.0}, AUTO, "facts"),
        ({**ESTIMATED, "max-norm": 0.05}, None, "facts-mismatch"),  # no estimate in this run
    ],
)
def test_a_reply_with_an_impossible_clip_or_estimate_is_rejected_and_charged(
    tmp_path, changes, auto, code
):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = _strategy(ledger, auto)
        requests = _ask(strategy, 1, _global(), nodes=(11,))
        _, metrics = strategy.aggregate_train(1, [_reply(requests[11], **changes)])
        assert metrics["sites-accepted"] == 0 and metrics[f"rejected-{code}"] == 1
        assert metrics["sites-unconfirmed"] == 1
        assert not any(e.confirmed for e in ledger.records())


def test_an_honest_estimate_at_the_ends_of_the_range_is_accepted(tmp_path):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = _strategy(ledger)
        requests = _ask(strategy, 1, _global(), nodes=(11, 12))
        replies = [
            _reply(requests[11], **ESTIMATED, **{"max-norm": AUTO.high}),
            _reply(requests[12], **ESTIMATED, **{"max-norm": AUTO.low}),
        ]
        _, metrics = strategy.aggregate_train(1, replies)
        assert metrics["sites-accepted"] == 2
        for site in ("site-11", "site-12"):
            first, second = ledger.events(site)
            assert (first.mechanism, first.sigma, first.q, first.steps) == (
                QUANTILE_MECHANISM,
                6.4,
                Q,
                K,
            )
            assert (second.mechanism, second.steps, second.confirmed) == (TRAIN, TAU, True)


def test_a_failing_site_without_a_confirmed_estimate_is_charged_one_unconfirmed(tmp_path):
    """Round 1: site-11 reports its estimate; site-12 reused a stored clip (its estimate's reply
    was lost). Round 2 both fail: site-12 may have estimated again, so it is charged an
    unconfirmed estimate (the run's K and sigma_b, its last q) beside the unconfirmed steps."""
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = _strategy(ledger)
        requests = _ask(strategy, 1, _global(), nodes=(11, 12))
        _, metrics = strategy.aggregate_train(
            1, [_reply(requests[11], **ESTIMATED), _reply(requests[12])]
        )
        assert metrics["sites-accepted"] == 2
        requests = _ask(strategy, 2, _global(), nodes=(11, 12))
        errors = [Message(Error(code=4003, reason="x"), reply_to=r) for r in requests.values()]
        _, metrics = strategy.aggregate_train(2, errors)
        assert metrics["sites-unconfirmed"] == 2

        def round_2(site):
            return [(e.mechanism, e.confirmed, e.sigma, e.q, e.steps) for e in ledger.events(site)
                    if e.round == 2]  # fmt: skip

        assert round_2("site-11") == [(TRAIN, False, SIGMA, Q, TAU)]
        assert round_2("site-12") == [
            (QUANTILE_MECHANISM, False, AUTO.noise_multiplier, Q, K),
            (TRAIN, False, SIGMA, Q, TAU),
        ]
        training = PrivacyEvent(SIGMA, Q, TAU)
        worst = epsilon([training, PrivacyEvent(6.4, Q, K), training], DELTA)
        assert ledger.epsilon("site-12").prv == pytest.approx(worst, rel=1e-12)
        row = _rows(build_report(ledger))["site-12"]
        assert (row["unconfirmed_rounds"], row["unconfirmed_steps"]) == (1, TAU)
        assert (row["quantile_charges"], row["quantile_steps"]) == (1, K)
