"""Run ``server.federation.run_federation`` in this process with sites on a loopback grid.

Used by ``test_resume.py`` as a subprocess that the test SIGKILLs at a pause point
(``prism_runtime.faults``). The grid delivers each train message to the real ClientApp
(``client.app.app``) of an in-process site, in message order, when it is pushed, and the
coordinator pulls the replies (``helpers.grids.LoopbackSites``): Flower's
transport is left out, everything else (strategy, ledger, checkpoint, sites and their durable
state) is the real code. Usage: ``python resume_driver.py RUN_CONFIG_JSON NUM_SITES``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# run as a script, this folder is on the import path, not tests/ (the tests' helpers)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from helpers.grids import LoopbackSites

from client.app import app as client_app
from prism_runtime.config import RunConfig, parse_config
from prism_runtime.faults import Faults, faults_from_env
from prism_runtime.logs import setup_logging
from server.federation import run_federation


class CrashError(Exception):
    """The coordinator dies here (a test's stand-in for SIGKILL at a crash point)."""


class CrashAt(Faults):
    """Raise ``CrashError`` when the coordinator reaches ``point`` in ``server_round`` (an
    in-process crash, for the tests that resume in the same process)."""

    def __init__(self, point: str, server_round: int) -> None:
        self.point, self.server_round = point, server_round

    def reach(self, point: str, server_round: int) -> None:
        if (point, server_round) == (self.point, self.server_round):
            raise CrashError(point)


def assert_same_adapter(first: Path, second: Path) -> None:
    """The exported adapters of two run folders hold the same tensors, bit for bit."""
    import torch
    from safetensors import safe_open

    with (
        safe_open(str(first / "adapter" / "adapter_model.safetensors"), "pt") as a,
        safe_open(str(second / "adapter" / "adapter_model.safetensors"), "pt") as b,
    ):
        assert sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():  # noqa: SIM118 - safe_open has no iteration
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


class LoopbackGrid(LoopbackSites):
    """The part of ``flwr.serverapp.Grid`` the strategy uses, with in-process sites (each
    answers when its message is pushed; the coordinator pulls the replies)."""

    def __init__(self, run_config: dict[str, object], num_sites: int) -> None:
        self.run_config = run_config
        self.nodes = {
            100 + i: {"partition-id": i, "num-partitions": num_sites} for i in range(num_sites)
        }
        self.states = {n: RecordDict() for n in self.nodes}  # each node's context.state

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def answer(self, msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        context = Context(
            run_id=1,
            node_id=node,
            node_config=dict(self.nodes[node]),  # type: ignore[arg-type]
            state=self.states[node],  # kept between messages, as a SuperNode keeps it
            run_config=dict(self.run_config),  # type: ignore[arg-type]
        )
        TaskIdentity.node_id = node
        try:
            return client_app(msg, context)
        finally:
            TaskIdentity.node_id = 0


def main() -> None:
    setup_logging()
    values = json.loads(sys.argv[1])
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    run = parse_config(RunConfig, values, what="run config")
    grid = LoopbackGrid(values, int(sys.argv[2]))
    run_federation(grid, run, faults=faults_from_env())  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
