"""The round contract: what every round kind offers the round loop.

A round kind turns one round's messages (``PrismStrategy.configure_train``) into the next
global arrays. Two kinds exist: ``PlainRound`` (``server.strategy.plain``: one exchange, the
sites' noisy updates streamed into a weighted mean and the server step) and ``SecureRound``
(``server.strategy.secure``: six exchanges, only the sum of the sites' masked inputs, then
PRISM's step on it). Both take every reply through the same ``ReplyIntake``, own their server
step, and carry their own checkpoint state; ``PrismStrategy.from_run`` picks the kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid
from torch import Tensor

from server.strategy.intake import ReplyIntake
from server.strategy.transport import Exchange

__all__ = ["STATE_PREFIX", "RoundContext", "RoundKind"]

STATE_PREFIX = "round-state/"
"""Prefix of a round kind's tensors among the checkpoint's arrays."""


@dataclass
class RoundContext:
    """One round as the loop hands it to a round kind.

    Attributes:
        server_round: the round.
        grid: Flower's grid.
        messages: ``configure_train``'s messages (one per chosen node: arrays and config).
        intake: the round's reply intake.
        exchange: how each exchange is pushed and pulled (timeout, polling, crash points).
    """

    server_round: int
    grid: Grid
    messages: list[Message]
    intake: ReplyIntake
    exchange: Exchange


class RoundKind(Protocol):
    """What a round kind does (module docstring)."""

    def begin(self, server_round: int, broadcast: dict[str, Tensor]) -> None:
        """Start ``server_round`` at the broadcast arrays (a copy the kind may keep)."""

    def run(self, round_: RoundContext) -> ArrayRecord | None:
        """Run the round: the next global arrays, or None when nothing is applied (the round's
        summary says why)."""

    def describe(self) -> str:
        """The kind's settings, for the run's log."""

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The kind's state carried across rounds: tensors (keys under ``STATE_PREFIX``) and
        JSON-ready values, for the coordinator's checkpoint."""

    def load_state_dict(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (tensors without ``STATE_PREFIX`` ignored)."""
