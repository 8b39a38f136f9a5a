"""Loopback grids: Flower's ``Grid`` message calls with the sites in this process, for the
coordinator tests and the benchmarks (bench/server.py, bench/utility.py put ``tests/`` on their
import path and import this module as ``helpers.grids``, as the tests do).

``LoopbackSites``: a mixin for the tests' small grids (fixed node ids): the sites answer when the
messages are pushed and their replies wait to be pulled, with the semantics of Flower's
``InMemoryGrid`` (a fresh id per pushed message; ``pull_messages`` returns the replies to the
given ids, each once; a site that never answers leaves its id pending until the round's timeout).

``FlowerSites``: Flower's own ``flwr.superlink.grid.InMemoryGrid`` (the simulation engine's grid)
over an in-memory LinkState with registered SuperNodes, whose sites answer in this process
according to a schedule (after so many ``pull_messages`` calls and/or seconds after the push), or
only once the coordinator pulls their message id (``answer_on_pull``): a reply is stored in the
LinkState as a SuperNode's reply is, and pulled through Flower's code. It records which replies
each pull returned and how many of the replies pulled before a call are still alive (weak
references): what the coordinator holds.
"""

from __future__ import annotations

import secrets
import time
import weakref
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from flwr.app import ArrayRecord, Message
from flwr.common.constant import HEARTBEAT_INTERVAL_INF, NOOP_ACCOUNT_NAME, NOOP_FLWR_AID
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord, Task
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

Answer = Callable[[Message], "Message | None"]


class LoopbackSites:
    """``push_messages`` / ``pull_messages`` / ``send_and_receive`` over ``self.answer(msg)``,
    a site's reply or None (the site never answers)."""

    def answer(self, msg: Message) -> Message | None:
        raise NotImplementedError

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        waiting = self.__dict__.setdefault("_replies", {})
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())  # as InMemoryGrid does
            waiting[msg.metadata.message_id] = self.answer(msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        waiting = self.__dict__.setdefault("_replies", {})
        ready = [i for i in message_ids if waiting.get(i) is not None]
        return [waiting.pop(i) for i in ready]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        ids = self.push_messages(messages)
        return self.pull_messages(ids)  # every site answered at once, or never


@dataclass(frozen=True)
class Arrival:
    """When a site's reply reaches the LinkState: once the grid has served ``pulls``
    ``pull_messages`` calls since the push and ``seconds`` have passed since it (None: never)."""

    pulls: int = 0
    seconds: float = 0.0


class FlowerSites(InMemoryGrid):
    """Flower's ``InMemoryGrid`` with ``num_nodes`` SuperNodes answered by ``answer(index, msg)``.

    ``arrival(index)`` says when node ``index``'s reply arrives (default: at once). Node
    ``index`` is ``self.node_ids[index]`` (random ids, as a LinkState assigns them). With
    ``answer_on_pull`` a due site answers only when ``pull_messages`` is given its message id, so
    its reply exists in this process from that pull on, as a reply pulled from a SuperLink
    process does. The run is ``TaskIdentity.run_id``'s, and ``TaskIdentity.node_id`` must be the
    SuperLink's (1) while the coordinator's messages are built, as in Flower's simulation.
    """

    def __init__(
        self,
        num_nodes: int,
        answer: Callable[[int, Message], Message | None],
        arrival: Callable[[int], Arrival | None] = lambda index: Arrival(),
        *,
        answer_on_pull: bool = False,
    ) -> None:
        factory = LinkStateFactory(
            FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
        )
        super().__init__(factory, pull_interval=0.01)
        self.node_ids = [
            self.state.create_node(
                NOOP_FLWR_AID,
                NOOP_ACCOUNT_NAME,
                secrets.token_bytes(32),
                heartbeat_interval=HEARTBEAT_INTERVAL_INF,
            )
            for _ in range(num_nodes)
        ]
        for node in self.node_ids:
            self.state.acknowledge_node_heartbeat(
                node_id=node, heartbeat_interval=HEARTBEAT_INTERVAL_INF
            )
        run = Run.create_empty(run_id=TaskIdentity.run_id)  # messages take their run from it
        run.primary_task_id = run.run_id + 1
        run.federation_id = NOOP_FEDERATION_ID
        state: Any = self.state
        state.run_ids[run.run_id] = RunRecord(run=run)  # as flwr.simulation.run_simulation does
        state.task_store[run.primary_task_id] = Task(task_id=run.primary_task_id, run_id=run.run_id)
        self.set_run(run)
        self.answer, self.arrival = answer, arrival
        self.answer_on_pull = answer_on_pull
        self.pulls = 0
        self.pushed_at = 0.0
        self.pulled: list[list[int]] = []  # per pull_messages call: src nodes of its replies
        self.peak_held = 0  # most pulled replies alive at once (those of this call included)
        self._pulled_refs: list[weakref.ref[Any]] = []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = list(super().push_messages(messages))
        self.pulls, self.pushed_at = 0, time.monotonic()
        return ids

    def held(self) -> int:
        """How many replies pulled so far are still alive (their update ArrayRecords)."""
        return sum(ref() is not None for ref in self._pulled_refs)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        ids = list(message_ids)
        held = self.held()
        self.deliver(ids if self.answer_on_pull else None)
        self.pulls += 1
        replies = list(super().pull_messages(ids))
        self.pulled.append([m.metadata.src_node_id for m in replies])
        for msg in replies:
            # not ``content.array_records``: its _SyncedDict is a reference cycle that would
            # keep the records alive until the garbage collector runs
            content = msg.content.values() if msg.has_content() else []
            records = [r for r in content if isinstance(r, ArrayRecord)]
            self._pulled_refs += [weakref.ref(r) for r in records]
        self.peak_held = max(self.peak_held, held + len(replies))
        return replies

    def deliver(self, message_ids: Collection[str] | None = None) -> None:
        """Sites whose reply is due answer now (a SuperNode storing its reply); with
        ``message_ids``, only the sites those messages went to."""
        elapsed = time.monotonic() - self.pushed_at
        state: Any = self.state
        if message_ids is not None:
            sent = [state.message_ins_store.get(i) for i in message_ids]
            to = {m.metadata.dst_node_id for m in sent if m is not None}
        for index, node in enumerate(self.node_ids):
            due = self.arrival(index)
            if due is None or self.pulls < due.pulls or elapsed < due.seconds:
                continue
            if message_ids is not None and node not in to:
                continue
            for msg in self.state.get_message_ins(node_id=node, limit=1):
                reply = self.answer(index, msg)
                if reply is not None:
                    reply.metadata.__dict__["_message_id"] = str(uuid4())
                    self.state.store_message_res(reply)
