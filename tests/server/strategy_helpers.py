"""Test helper: a ``PrismStrategy`` on a test's own small adapter, with every setting named.

``PrismStrategy.from_run`` builds the strategy of a run config, and the tests that model a run
use it. The tests that drive the strategy's parts on a synthetic adapter build it with
``strategy_for``: its constructor has no defaults, so ``UNIT_SETTINGS`` names each setting they
rely on and a test overrides the ones it is about. Where these differ from what a run config
can say, they do so on purpose: no fixed clip C or batch b (each reply states its own), no bound
on the update's norm (any finite update of the right shape is honest), inverse-noise weights,
one round, a local lr of 1, and no wait for sites that are not connected.
"""

from __future__ import annotations

from typing import Any

from prism_runtime.train_config import MECHANISMS
from server.ledger import Ledger
from server.strategy import PrismStrategy

UNIT_SETTINGS: dict[str, Any] = {
    "head": [],
    "mode": "tangent",
    "run_id": "run-1",
    "sites_per_round": 3,
    "min_sites": 1,
    "server_lr": 1.0,
    "lr_schedule": "constant",
    "num_rounds": 1,
    "server_optimizer": "sgd",
    "local_steps": 2,
    "local_lr": 1.0,
    "target_epsilon": 10.0,
    "delta": 1e-5,
    "aggregation": "inverse-noise",
    "noise_multiplier": None,
    "max_norm": None,
    "expected_batch_size": None,
    "sample_rate": None,
    "seed": 0,
    "wait_for_nodes": 0.0,
    "connect_timeout": 600.0,
    "update_bound": None,
    "mechanism": MECHANISMS["prism"],
    "dp": True,
    "auto_clip": None,
}


def strategy_for(*, modules: list[str], ledger: Ledger, **settings: Any) -> PrismStrategy:
    """A strategy over ``modules`` charging ``ledger``: ``UNIT_SETTINGS`` with ``settings``."""
    unknown = sorted(set(settings) - set(UNIT_SETTINGS))
    if unknown:
        raise TypeError(f"not a PrismStrategy setting: {unknown}")
    return PrismStrategy(modules=modules, ledger=ledger, **{**UNIT_SETTINGS, **settings})
