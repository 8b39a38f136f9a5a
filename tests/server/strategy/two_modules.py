"""Test helper: the coordinator's strategy on a tiny adapter of two modules (12 x 10, rank
3), a grid of fixed node ids, and the honest replies of its sites.

``strategy_and_ledger`` builds the strategy (``strategy_helpers.strategy_for``) on a fresh
ledger; ``site_reply`` echoes the request's round and nonce as an honest site's ClientApp
does."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from helpers.points import random_point
from reply_facts import honest_facts
from strategy_helpers import strategy_for

from prism_runtime.protocol import ACCOUNTING, CONFIG, ROUND_NONCE, SERVER_ROUND, UPDATE, key
from server.ledger import Ledger

MODULES = ["layer.0.q", "layer.0.v"]
SHAPES = {"layer.0.q": (12, 10, 3), "layer.0.v": (12, 10, 3)}


class Grid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def adapter(seed=0):
    arrays = {}
    for i, module in enumerate(MODULES):
        m, n, r = SHAPES[module]
        A, B = random_point(m, n, r, seed + i, dtype=torch.float32)
        arrays[key(module, "A")], arrays[key(module, "B")] = A, B
    return arrays


def strategy_and_ledger(tmp_path, mode="tangent", **kw):
    ledger = Ledger.open(tmp_path / "ledger.sqlite")
    return strategy_for(modules=MODULES, ledger=ledger, mode=mode, **kw), ledger


def site_facts(site, steps=2, status="ok"):
    """An honest reply's facts; ``site_reply`` echoes the request's round and nonce."""
    return honest_facts(site, None, status=status, steps=steps, epsilon_cap=10.0)


def site_reply(request, arrays, facts):
    config = request.content[CONFIG]  # an honest site echoes the round and its nonce
    facts = {**facts, SERVER_ROUND: config[SERVER_ROUND], ROUND_NONCE: config[ROUND_NONCE]}
    content = RecordDict({UPDATE: ArrayRecord(arrays), ACCOUNTING: ConfigRecord(facts)})
    return Message(content=content, reply_to=request)
