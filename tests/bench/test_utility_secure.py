"""The utility study's ``prism-secure`` method (bench/utility.py): its run config, and the local
grid's routing of the secure-aggregation stages through the site's ClientApp with each node's
``context.state`` kept between messages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

BENCH = Path(__file__).resolve().parents[2] / "bench" / "utility.py"
SITES = 3


@pytest.fixture(scope="module")
def utility():
    spec = importlib.util.spec_from_file_location("bench_utility_secure", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spec(utility, method, pool: Path):
    from prism_runtime.config import RunConfig, parse_config

    if not pool.exists():  # 96 rows, one blank line: central's N counts rows, not lines
        pool.write_text(
            "".join(f'{{"text": "row {i}", "label": {i % 2}}}\n' for i in range(96)) + "\n"
        )

    product = parse_config(RunConfig, {}, what="run config").model_dump(by_alias=True)
    return {
        "num_labels": 2, "method": method, "rounds": 2, "sites": SITES, "local_steps": 1,
        "batch_size": 16, "micro_batch_size": 16, "max_norm": 1.0, "lr": 0.001,
        "epsilon": 1.0, "delta": 1e-5, "pool": str(pool), "dirichlet_alpha": 0.5,
        "max_length": 32, "seed": 0, "select": "select.jsonl",
        "settings": {key: product[key] for key in utility.SETTINGS},
    }  # fmt: skip


def test_prism_secure_is_prism_with_every_site_honest(utility, tmp_path):
    from prism_runtime.config import RunConfig, parse_config

    pool = tmp_path / "pool.jsonl"
    values = utility.run_config_of(_spec(utility, "prism-secure", pool), tmp_path)
    run = parse_config(RunConfig, values, what="run config")
    assert run.method == "prism" and run.secure_aggregation and run.min_honest_sites == SITES
    plain = utility.run_config_of(_spec(utility, "prism", pool), tmp_path)
    assert "secure-aggregation" not in plain and "min-honest-sites" not in plain
    assert {k: v for k, v in values.items() if k not in plain} == {
        "secure-aggregation": True,
        "min-honest-sites": SITES,
        "sample-rate": SITES * 16 / 96,  # central's q: K b over the pooled rows
    }
    assert "prism-secure" in utility.FEDERATED


def test_local_grid_routes_secure_stages_and_keeps_each_nodes_state(utility, monkeypatch, tmp_path):
    """Each message reaches the ClientApp function of its type (``client.app.app`` dispatches),
    and a node's ``context.state`` written at one stage is read at the next."""
    from flwr.supercore.task_identity import TaskIdentity

    import client.app

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # federated_run's
    seen: list[tuple[int, str, object]] = []

    def handler(name):
        def handle(msg, context):
            seen.append((context.node_id, name, context.state.get("kept")))
            context.state["kept"] = ConfigRecord({"stage": name})
            return Message(RecordDict(), reply_to=msg)

        return handle

    def secure_stage(msg, context, *, stage):  # the app's secure actions name their stage
        return handler(stage.__name__)(msg, context)

    monkeypatch.setattr(client.app, "_train", handler("train"))
    monkeypatch.setattr(client.app, "_secure", secure_stage)
    spec = _spec(utility, "prism-secure", tmp_path / "pool.jsonl")
    grid = utility._local_grid(utility.run_config_of(spec, tmp_path), SITES)
    assert grid.get_node_ids() == [1, 2, 3]
    for kind in ("train.secure_advertise", "train.secure_share", "train"):
        messages = [Message(RecordDict(), dst_node_id=node, message_type=kind) for node in (1, 2)]
        ids = grid.push_messages(messages)
        assert len(grid.pull_messages(ids)) == 2
    assert [(n, s) for n, s, _ in seen] == [
        (1, "advertise"), (2, "advertise"), (1, "share"), (2, "share"), (1, "train"), (2, "train"),
    ]  # fmt: skip
    kept = [None if k is None else k["stage"] for _, _, k in seen]
    assert kept == [None, None, "advertise", "advertise", "share", "share"]
