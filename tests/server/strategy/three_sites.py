"""Test helper: three sites (nodes 11, 12 and 13) of a one-module adapter answering the
coordinator's strategy through a loopback grid: their honest replies (``reply``), error
replies whose reason carries a ``SECRET`` (``error``), an honest round, the epsilon of
their steps and the budget report's rows by site."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, RecordDict
from helpers.grids import LoopbackSites
from helpers.points import random_point
from reply_facts import honest_facts
from strategy_helpers import strategy_for

from prism_core.accounting import PrivacyEvent, epsilon
from prism_runtime.protocol import ACCOUNTING, CONFIG, UPDATE, key

MODULE = "layer.0.q"
M, N, R = 10, 8, 2
NODES = [11, 12, 13]
TAU, SIGMA, Q, DELTA = 2, 1.0, 0.05, 1e-5
SECRET = "patient 4711: HbA1c 9.3%"


class Grid(LoopbackSites):
    def __init__(self, nodes=NODES, answer=None):
        self.nodes, self.site = list(nodes), answer

    def get_node_ids(self):
        return list(self.nodes)

    def answer(self, msg):
        return self.site(msg)


def adapter():
    A, B = random_point(M, N, R, 0, dtype=torch.float32)
    return {key(MODULE, "A"): A, key(MODULE, "B"): B}


def new_strategy(ledger, **kw):
    params = dict(sites_per_round=len(NODES), local_steps=TAU, target_epsilon=100.0, delta=DELTA)
    params.update(kw)
    return strategy_for(modules=[MODULE], ledger=ledger, **params)


def site_of(node):
    return f"site-{node}"


def facts(node, request, **changes):
    """An honest reply's facts, with ``changes`` (None: leave the fact out)."""
    config = request.content[CONFIG]
    return honest_facts(
        site_of(node), config, **{"sigma": SIGMA, "q": Q, "steps": TAU, "delta": DELTA, **changes}
    )


def reply(request, **changes):
    node = request.metadata.dst_node_id
    update = {
        key(MODULE, "dA"): torch.full((M, R), 1e-3),
        key(MODULE, "dB"): torch.full((N, R), -1e-3),
    }
    content = RecordDict(
        {
            UPDATE: ArrayRecord(update),
            ACCOUNTING: ConfigRecord(facts(node, request, **changes)),
        }
    )
    return Message(content=content, reply_to=request)


def error(request, code, reason=f"Traceback: ValueError({SECRET!r})"):
    return Message(Error(code=code, reason=reason), reply_to=request)


def ask(strategy, server_round, arrays=None):
    arrays = adapter() if arrays is None else arrays
    requests = strategy.configure_train(server_round, ArrayRecord(arrays), ConfigRecord(), Grid())
    return {r.metadata.dst_node_id: r for r in requests}


def honest_round(strategy, server_round):
    requests = ask(strategy, server_round)
    new, metrics = strategy.aggregate_train(server_round, [reply(r) for r in requests.values()])
    assert metrics["sites-accepted"] == len(NODES) and new is not None
    return requests


def eps(steps, sigma=SIGMA):
    return epsilon([PrivacyEvent(sigma, Q, steps)], DELTA)


def rows(report):
    return {r["site_id"]: r for r in report["sites"]}
