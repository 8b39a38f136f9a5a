"""Test helper: a ``PrismStrategy`` on a test's own small adapter, with every setting named.

``PrismStrategy.from_run`` builds the strategy of a run config, and the tests that model a run
use it. The tests that drive the strategy's parts on a synthetic adapter build it with
``strategy_for``, through the same ``PrismStrategy.assemble`` and ``PlainRound.of`` that
``from_run`` uses, from settings a run config need not be able to say: ``UNIT_SETTINGS`` names
each setting they rely on and a test overrides the ones it is about. Where these differ from
what a run config can say, they do so on purpose: no fixed clip C or batch b (each reply states
its own), no bound on the update's norm (any finite update of the right shape is honest),
inverse-noise weights, one round, and no wait for sites that are not connected.
"""

from __future__ import annotations

from typing import Any

from prism_runtime.train_config import MECHANISMS
from server.ledger import Ledger
from server.strategy import PlainRound, PrismStrategy, RunTerms
from server.strategy.binding import SiteBinding

UNIT_SETTINGS: dict[str, Any] = {
    "head": [],
    "mode": "tangent",
    "run_id": "run-1",
    "sites_per_round": 3,
    "min_sites": 1,
    "server_lr": 1.0,
    "lr_schedule": "constant",
    "num_rounds": 1,
    "local_steps": 2,
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
    """A plain-round strategy over ``modules`` charging ``ledger``: ``UNIT_SETTINGS`` with
    ``settings``, each handed to the part that uses it."""
    unknown = sorted(set(settings) - set(UNIT_SETTINGS))
    if unknown:
        raise TypeError(f"not a PrismStrategy setting: {unknown}")
    s = {**UNIT_SETTINGS, **settings}
    terms = RunTerms(
        mechanism=s["mechanism"],
        dp=s["dp"],
        local_steps=s["local_steps"],
        delta=s["delta"],
        noise_multiplier=s["noise_multiplier"],
        max_norm=s["max_norm"],
        expected_batch_size=s["expected_batch_size"],
        sample_rate=s["sample_rate"],
        auto_clip=s["auto_clip"],
    )
    return PrismStrategy.assemble(
        modules=modules,
        head=s["head"],
        ledger=ledger,
        run_id=s["run_id"],
        terms=terms,
        round_kind=PlainRound.of(
            modules=modules,
            head=s["head"],
            mode=s["mode"],
            terms=terms,
            update_bound=s["update_bound"],
            server_lr=s["server_lr"],
            lr_schedule=s["lr_schedule"],
            num_rounds=s["num_rounds"],
            aggregation=s["aggregation"],
            min_sites=s["min_sites"],
        ),
        binding=SiteBinding(),
        target_epsilon=s["target_epsilon"],
        sites_per_round=s["sites_per_round"],
        min_sites=s["min_sites"],
        seed=s["seed"],
        wait_for_nodes=s["wait_for_nodes"],
        connect_timeout=s["connect_timeout"],
    )
