"""Coordinator strategy: exact tangent aggregation + retraction, and the factor-averaging baselines.

PRISM (``mode="tangent"``): every site of a round starts from the same broadcast point
``Z_t = A B.T``, so their tangent updates live in one vector space and the weighted mean of the
lifts IS the weighted mean of the ``dZ_k`` (the map ``(dA, dB) -> dA B.T + A dB.T`` is linear).
The server then takes ``Retr_r(Z_t + eta_s * mean dZ)`` (QR + 2r x 2r SVD, full rank r kept).
Sums are streamed reply by reply, so memory does not grow with the number of sites.

Baselines (``mode="factor-average"``): FedIT-style FedAvg of ``A`` and ``B`` separately (inexact:
``mean(A) mean(B).T != mean(A B.T)``), used with factor-space DP or FFA on the sites.

Every reply is validated before it touches the aggregate; a bad reply is logged and skipped. A
reply's accounting facts go to the ledger even when its update is rejected: spent budget is
never under-counted.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.result import Result
from torch import Tensor

from client.protocol import (
    ACCOUNTING,
    ARRAYS,
    CONFIG,
    HEAD_PREFIX,
    STATUS_OK,
    STATUS_REFUSED,
    UPDATE,
    key,
)
from client.testhooks import pause_point
from prism_core.manifold import retract
from server.errors import ReplyError
from server.ledger import Ledger, LedgerEvent

__all__ = ["PrismStrategy", "RoundSummary", "validate_facts"]

log = logging.getLogger(__name__)

Mode = Literal["tangent", "factor-average"]


@dataclass
class RoundSummary:
    """What happened in one round (logged and kept for the run summary)."""

    server_round: int
    sent: int = 0
    accepted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (who, why)
    applied: bool = False


def validate_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """Check a reply's accounting facts; return them typed. Raises ``ReplyError``."""
    required = {"site-id": str, "status": str, "sigma": float, "q": float, "steps": int}
    for name, kind in required.items():
        if name not in facts:
            raise ReplyError(f"accounting facts lack {name!r}")
        if kind is float and not isinstance(facts[name], int | float):
            raise ReplyError(f"{name}={facts[name]!r} is not a number")
        if kind is int and (not isinstance(facts[name], int) or isinstance(facts[name], bool)):
            raise ReplyError(f"{name}={facts[name]!r} is not an integer")
        if kind is str and not isinstance(facts[name], str):
            raise ReplyError(f"{name}={facts[name]!r} is not a string")
    if not facts["site-id"]:
        raise ReplyError("empty site-id")
    if facts["status"] not in (STATUS_OK, STATUS_REFUSED):
        raise ReplyError(f"unknown status {facts['status']!r}")
    sigma, q, steps = float(facts["sigma"]), float(facts["q"]), int(facts["steps"])
    if not (math.isfinite(sigma) and sigma >= 0 and 0 < q <= 1 and steps >= 0):
        raise ReplyError(f"impossible mechanism parameters sigma={sigma}, q={q}, steps={steps}")
    return facts


class PrismStrategy(Strategy):
    """Round orchestration for PRISM and the factor-averaging baselines.

    Args:
        modules: LoRA module names (keys ``<module>/A``, ``<module>/B`` of the global arrays).
        head: names of the DP head tensors (keys ``head/<name>``), possibly empty.
        mode: ``tangent`` (PRISM) or ``factor-average`` (baselines).
        ledger: the coordinator's privacy ledger.
        run_id: this run's id in the ledger.
        sites_per_round, min_sites, server_lr, weight_by_examples, local_steps, default cap
        (epsilon, delta) and seed: see ``client.config.RunConfig``.
    """

    def __init__(
        self,
        *,
        modules: list[str],
        head: list[str],
        mode: Mode,
        ledger: Ledger,
        run_id: str,
        sites_per_round: int,
        min_sites: int,
        server_lr: float,
        local_steps: int,
        target_epsilon: float,
        delta: float,
        weight_by_examples: bool = False,
        seed: int = 0,
        wait_for_nodes: float = 120.0,
    ) -> None:
        self.modules, self.head, self.mode = modules, head, mode
        self.ledger, self.run_id = ledger, run_id
        self.sites_per_round, self.min_sites = sites_per_round, min_sites
        self.server_lr, self.local_steps = server_lr, local_steps
        self.target_epsilon, self.delta = target_epsilon, delta
        self.weight_by_examples = weight_by_examples
        self.rng = random.Random(seed)
        self.wait_for_nodes = wait_for_nodes
        self.node_site: dict[int, str] = {}
        self.site_mechanism: dict[
            str, tuple[float, float, float, float]
        ] = {}  # sigma, q, cap, delta
        self.exhausted: set[str] = set()
        self.summaries: list[RoundSummary] = []
        self._broadcast: dict[str, Tensor] = {}
        self._sent_to: dict[int, int] = {}

    # -- selection -------------------------------------------------------------------------

    def _eligible(self, site: str, server_round: int) -> bool:
        if site in self.exhausted:
            return False
        if site not in self.site_mechanism:
            return True
        sigma, q, cap, delta = self.site_mechanism[site]
        if sigma == 0:  # non-DP run: no budget to enforce
            return True
        ok = self.ledger.can_run(
            site,
            sigma=sigma,
            q=q,
            steps=self.local_steps,
            epsilon_cap=cap,
            delta=delta,
            before=(self.run_id, server_round),  # a re-run round decides as it did at first
        )
        if not ok:
            self.exhausted.add(site)
            log.info("site %s: next round would exceed its cap; no longer selected", site)
        return ok

    def _nodes(self, grid: Grid) -> list[int]:
        deadline = time.monotonic() + self.wait_for_nodes
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= self.sites_per_round or (
                len(nodes) >= self.min_sites and time.monotonic() > deadline
            ):
                return nodes
            log.info("waiting for sites: %d connected, want %d", len(nodes), self.sites_per_round)
            time.sleep(1.0)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global factors to up to ``sites_per_round`` sites that can still run."""
        nodes = self._nodes(grid)
        eligible = [
            n for n in nodes if self._eligible(self.node_site.get(n, f"node-{n}"), server_round)
        ]
        if not eligible:
            return []
        chosen = self.rng.sample(eligible, min(self.sites_per_round, len(eligible)))
        self._broadcast = {k: v.clone() for k, v in arrays.to_torch_state_dict().items()}
        config["server-round"] = server_round
        content = RecordDict({ARRAYS: arrays, CONFIG: config})
        self._sent_to = {n: server_round for n in chosen}
        self.summaries.append(RoundSummary(server_round, sent=len(chosen)))
        return [
            Message(content=content, message_type="train", dst_node_id=n) for n in sorted(chosen)
        ]

    # -- validation ------------------------------------------------------------------------

    def _expected_update_keys(self) -> dict[str, tuple[int, ...]]:
        parts = ("dA", "dB") if self.mode == "tangent" else ("A", "B")
        shapes: dict[str, tuple[int, ...]] = {}
        for module in self.modules:
            for part, base in zip(parts, ("A", "B"), strict=True):
                shapes[key(module, part)] = tuple(self._broadcast[key(module, base)].shape)
        for name in self.head:
            shapes[HEAD_PREFIX + name] = tuple(self._broadcast[HEAD_PREFIX + name].shape)
        return shapes

    def _validate_update(self, update: ArrayRecord) -> dict[str, Tensor]:
        expected = self._expected_update_keys()
        got = set(update.keys())
        if got != set(expected):
            missing, extra = sorted(set(expected) - got), sorted(got - set(expected))
            raise ReplyError(f"wrong update keys (missing {missing[:3]}, unexpected {extra[:3]})")
        tensors = {}
        for name, array in update.items():
            if array.dtype != "float32":
                raise ReplyError(f"{name}: dtype {array.dtype}, expected float32")
            if tuple(array.shape) != expected[name]:
                raise ReplyError(f"{name}: shape {tuple(array.shape)}, expected {expected[name]}")
            tensor = torch.from_numpy(array.numpy().copy())
            if not torch.isfinite(tensor).all():
                raise ReplyError(f"{name}: contains NaN or Inf")
            tensors[name] = tensor
        return tensors

    # -- aggregation -----------------------------------------------------------------------

    def _record(self, server_round: int, facts: dict[str, Any]) -> None:
        if int(facts["steps"]) <= 0:
            return
        cap = float(facts.get("epsilon-cap", self.target_epsilon))
        delta = float(facts.get("delta", self.delta))
        event = LedgerEvent(
            run_id=self.run_id,
            round=server_round,
            site_id=str(facts["site-id"]),
            mechanism=str(facts.get("mechanism", "unknown")),
            adjacency=str(facts.get("adjacency", "add-remove")),
            sampling=str(facts.get("sampling", "poisson")),
            sigma=float(facts["sigma"]),
            q=float(facts["q"]),
            steps=int(facts["steps"]),
            delta=delta,
            epsilon_cap=cap if cap > 0 else None,
        )
        self.ledger.append(event)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, ledger and stream-aggregate the replies; apply if enough are valid."""
        summary = self.summaries[-1]
        sums: dict[str, Tensor] = {}
        total_weight = 0.0
        seen: set[str] = set()
        for msg in replies:
            node = msg.metadata.src_node_id
            who = self.node_site.get(node, f"node-{node}")
            if msg.has_error():
                summary.rejected.append((who, f"error reply: {msg.error.reason}"))
                continue
            try:
                facts = validate_facts(dict(msg.content[ACCOUNTING]))
                site = facts["site-id"]
                bound = self.node_site.setdefault(node, site)
                if bound != site:
                    raise ReplyError(f"node {node} is {bound!r} but claims to be {site!r}")
                if site in seen:
                    raise ReplyError(f"second reply of {site!r} in round {server_round}")
                if self._sent_to.get(node) != server_round:
                    raise ReplyError(f"node {node} was not asked in round {server_round}")
                seen.add(site)
                who = site
                self._record(server_round, facts)
                sigma, q = float(facts["sigma"]), float(facts["q"])
                cap = float(facts.get("epsilon-cap", self.target_epsilon))
                self.site_mechanism[site] = (sigma, q, cap, float(facts.get("delta", self.delta)))
                if facts["status"] == STATUS_REFUSED:
                    summary.refused.append(site)
                    self.exhausted.add(site)
                    log.info(
                        "site %s refused round %d: %s", site, server_round, facts.get("reason", "")
                    )
                    continue
                update = self._validate_update(msg.content[UPDATE])
            except (ReplyError, KeyError, TypeError, ValueError) as exc:
                summary.rejected.append((who, str(exc)))
                log.warning("round %d: rejected reply from %s: %s", server_round, who, exc)
                continue
            weight = float(facts.get("num-examples", 1)) if self.weight_by_examples else 1.0
            for name, tensor in update.items():
                sums[name] = sums[name] + weight * tensor if name in sums else weight * tensor
            total_weight += weight
            summary.accepted.append(site)
        if len(summary.accepted) < self.min_sites or total_weight <= 0:
            log.warning(
                "round %d: %d valid updates < min-sites=%d; global adapter unchanged",
                server_round,
                len(summary.accepted),
                self.min_sites,
            )
            return None, self._metrics(summary)
        means = {k: v / total_weight for k, v in sums.items()}
        summary.applied = True
        return ArrayRecord(self._apply(means)), self._metrics(summary)

    def _apply(self, means: dict[str, Tensor]) -> dict[str, Tensor]:
        new: dict[str, Tensor] = {}
        for module in self.modules:
            A, B = self._broadcast[key(module, "A")], self._broadcast[key(module, "B")]
            if self.mode == "tangent":
                dA, dB = means[key(module, "dA")], means[key(module, "dB")]
                A_new, B_new = retract(A, B, dA, dB, self.server_lr)
            else:
                A_new = A + self.server_lr * (means[key(module, "A")] - A)
                B_new = B + self.server_lr * (means[key(module, "B")] - B)
            new[key(module, "A")] = A_new.to(torch.float32).contiguous()
            new[key(module, "B")] = B_new.to(torch.float32).contiguous()
        for name in self.head:
            value = self._broadcast[HEAD_PREFIX + name]
            delta = means[HEAD_PREFIX + name]
            if self.mode != "tangent":
                delta = delta - value
            new[HEAD_PREFIX + name] = (value + self.server_lr * delta).contiguous()
        return new

    @staticmethod
    def _metrics(summary: RoundSummary) -> MetricRecord:
        return MetricRecord(
            {
                "sites-sent": summary.sent,
                "sites-accepted": len(summary.accepted),
                "sites-refused": len(summary.refused),
                "replies-rejected": len(summary.rejected),
                "applied": int(summary.applied),
            }
        )

    # -- checkpoint ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy carries from one round to the next, as JSON-ready values.

        The server optimizer is plain ``server-lr`` SGD on the retraction today: it has no state,
        and its slot in the checkpoint (``server.federation``) records just that.
        """
        version, internal, gauss = self.rng.getstate()
        return {
            "rng": [version, list(internal), gauss],
            "node-site": {str(n): s for n, s in self.node_site.items()},
            "site-mechanism": {s: list(m) for s, m in self.site_mechanism.items()},
            "exhausted": sorted(self.exhausted),
            "summaries": [vars(x) for x in self.summaries],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (after a coordinator restart)."""
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.node_site = {int(n): str(s) for n, s in state["node-site"].items()}
        self.site_mechanism = {
            s: (float(m[0]), float(m[1]), float(m[2]), float(m[3]))
            for s, m in state["site-mechanism"].items()
        }
        self.exhausted = set(state["exhausted"])
        self.summaries = [
            RoundSummary(
                server_round=int(x["server_round"]),
                sent=int(x["sent"]),
                accepted=list(x["accepted"]),
                refused=list(x["refused"]),
                rejected=[(str(w), str(r)) for w, r in x["rejected"]],
                applied=bool(x["applied"]),
            )
            for x in state["summaries"]
        ]

    # -- evaluation is server-side only (see server.app); sites are never asked to evaluate ---

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sites do not evaluate: an evaluation on private data would be an un-noised release."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info(
            "PrismStrategy(mode=%s, modules=%d, head=%d, sites/round=%d, min-sites=%d, "
            "server-lr=%s)",
            self.mode,
            len(self.modules),
            len(self.head),
            self.sites_per_round,
            self.min_sites,
            self.server_lr,
        )

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Any = None,
        on_round_end: Any = None,
        first_round: int = 1,
        previous: Result | None = None,
    ) -> Result:
        """Run rounds until ``num_rounds`` or until no site can continue within its cap.

        A resumed run passes ``first_round`` (the round after its checkpoint), the checkpointed
        global arrays as ``initial_arrays`` and the metrics so far as ``previous``; the strategy
        state comes from ``load_state_dict``. ``on_round_end(round, arrays, summary, result)``
        runs after each round (the coordinator checkpoints there).
        """
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        result = Result() if previous is None else previous
        result.arrays = initial_arrays
        arrays = initial_arrays
        if evaluate_fn is not None and first_round == 1:
            metrics = evaluate_fn(0, arrays)
            if metrics is not None:
                result.evaluate_metrics_serverapp[0] = metrics
        for server_round in range(first_round, num_rounds + 1):
            messages = list(self.configure_train(server_round, arrays, train_config, grid))
            if not messages:
                log.info(
                    "round %d: no site can continue within its cap; ending the run", server_round
                )
                break
            pause_point("round-start", server_round)
            replies = self._in_order(grid.send_and_receive(messages=messages, timeout=timeout))
            new_arrays, metrics = self.aggregate_train(
                server_round, _pausing(replies, server_round)
            )
            self._note_missing(messages, replies)
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            if metrics is not None:
                result.train_metrics_clientapp[server_round] = metrics
            if evaluate_fn is not None:
                eval_metrics = evaluate_fn(server_round, arrays)
                if eval_metrics is not None:
                    result.evaluate_metrics_serverapp[server_round] = eval_metrics
            if on_round_end is not None:
                on_round_end(server_round, arrays, self.summaries[-1], result)
        return result

    @staticmethod
    def _in_order(replies: Iterable[Message]) -> list[Message]:
        """Replies sorted by claimed site id, then node: a fixed summation order, so the
        aggregate does not depend on arrival order (float addition is not associative)."""

        def order(msg: Message) -> tuple[str, int]:
            site = ""
            if not msg.has_error() and ACCOUNTING in msg.content:
                site = str(msg.content[ACCOUNTING].get("site-id", ""))
            return site, int(msg.metadata.src_node_id)

        return sorted(replies, key=order)

    def _note_missing(self, messages: list[Message], replies: list[Message]) -> None:
        """Count sites that sent no reply before the timeout (crashed or too slow)."""
        answered = {m.metadata.src_node_id for m in replies}
        summary = self.summaries[-1]
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in answered:
                who = self.node_site.get(node, f"node-{node}")
                summary.rejected.append((who, "no reply before the round timeout"))
                log.warning(
                    "round %d: no reply from %s before the timeout; the round goes on without it",
                    summary.server_round,
                    who,
                )


def _pausing(replies: list[Message], server_round: int) -> Iterable[Message]:
    """Yield the replies; the ``mid-aggregation`` test pause point sits after the first."""
    for index, msg in enumerate(replies):
        if index == 1:
            pause_point("mid-aggregation", server_round)
        yield msg
