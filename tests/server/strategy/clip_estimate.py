"""Test helper: the coordinator's side of a private clip norm (``max-norm = auto``): the
run config of a real site that estimates its clip (``run_config``), and hand-made replies
of one-module sites that state the estimate's facts (``ESTIMATED``) for a strategy with
the public clip range ``AUTO``."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from helpers.points import random_point
from helpers.sites import tiny_run_config
from reply_facts import honest_facts
from strategy_helpers import strategy_for

from prism_runtime.protocol import ACCOUNTING, CONFIG, ROUND_NONCE, SERVER_ROUND, UPDATE, key
from server.strategy import AutoClip

TRAIN = "prism-tangent-gaussian"
K = 3


class Grid:
    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)


def ask(strategy, server_round, arrays, nodes=(11,)):
    requests = strategy.configure_train(
        server_round, ArrayRecord(arrays), ConfigRecord(), Grid(nodes)
    )
    return {r.metadata.dst_node_id: r for r in requests}


def message(request, arrays, facts):
    facts = {**facts, ROUND_NONCE: request.content[CONFIG][ROUND_NONCE]}
    content = RecordDict({UPDATE: ArrayRecord(arrays), ACCOUNTING: ConfigRecord(facts)})
    return Message(content=content, reply_to=request)


def rows(report):
    return {r["site_id"]: r for r in report["sites"]}


def run_config(tiny_bert):
    values = {
        "max-norm": "auto",
        "clip-quantile-steps": K,
        "clip-quantile-noise": 0.1,
        "target-epsilon": 40.0,
        # one joint clip and a frozen head: the strategy below bounds updates as for AdamW
        "lora-head": "frozen",
        "head-init": "random",
        "head-optimizer": "adamw",
        "head-lr": -1.0,
        "head-max-norm": -1.0,
    }
    return tiny_run_config(tiny_bert, **values)


MODULE, M, N, R = "layer.0.q", 10, 8, 2
TAU, SIGMA, Q, DELTA = 2, 1.0, 0.05, 1e-5
AUTO = AutoClip(low=0.01, high=1.0, steps=K, noise_multiplier=6.4)


def adapter():
    A, B = random_point(M, N, R, 0, dtype=torch.float32)
    return {key(MODULE, "A"): A, key(MODULE, "B"): B}


def new_strategy(ledger, auto=AUTO):
    return strategy_for(
        modules=[MODULE],
        ledger=ledger,
        sites_per_round=2,
        local_steps=TAU,
        target_epsilon=100.0,
        delta=DELTA,
        auto_clip=auto,
    )


def facts(node, request, **changes):
    """An honest reply's facts, with ``changes`` (None: leave the fact out); the nonce is
    added by ``message``."""
    facts = {SERVER_ROUND: request.content[CONFIG][SERVER_ROUND], "mechanism": TRAIN}
    facts.update({"sigma": SIGMA, "q": Q, "steps": TAU, "delta": DELTA, "max-norm": 0.2})
    return honest_facts(f"site-{node}", None, **{**facts, **changes})


def reply(request, **changes):
    node = request.metadata.dst_node_id
    update = {
        key(MODULE, "dA"): torch.full((M, R), 1e-3),
        key(MODULE, "dB"): torch.full((N, R), -1e-3),
    }
    return message(request, update, facts(node, request, **changes))


ESTIMATED = {"quantile-sigma": 6.4, "quantile-q": Q, "quantile-steps": K}
