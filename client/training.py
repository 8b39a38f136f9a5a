"""A round's private steps at the site, run only after their charge is durable.

The broadcast point is written into the model; PRISM's adaptive moments of the site's last stored
round are carried over to it (``prism_core.adaptive.realign_state``); the trainer takes the
site's ledger before the charge as its privacy history and is reseeded for this charge
(``client.policy.SitePolicy.round_seed``); then the charged number of steps runs. With
``step-at = coordinator`` the one charged step is released and not applied
(``PrismTrainer.private_gradient``): the coordinator steps on the sites' weighted mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from client.charge import Charge
from client.request import RoundRequest
from client.round_store import RoundStore
from prism_core.adaptive import AdaptiveState, realign_state
from prism_core.manifold import Point
from prism_core.mechanism import PrivateStep
from prism_runtime.errors import ConfigError
from prism_runtime.exchange import load_arrays
from prism_runtime.lora import read_points
from prism_runtime.model import LoadedModel
from prism_runtime.trainer import PrismTrainer, PrivateTrainer, StepResult

__all__ = ["Trained", "train"]


@dataclass(frozen=True)
class Trained:
    """What a round's steps produced.

    Attributes:
        start: the broadcast point, float32, one ``Point`` per LoRA module.
        end: the point the steps reached.
        results: one per step, with the mechanism's ``PrivacyEvent`` record.
        moments: PRISM's adaptive moments with the end points they belong to, kept for the next
            round (``RoundStore.store``); None for a method that keeps none.
        released: the one step's DP release when the coordinator takes the step
            (``step-at = coordinator``; ``end`` is then ``start``), else None.
    """

    start: list[Point]
    end: list[Point]
    results: list[StepResult]
    moments: dict[str, Any] | None
    released: PrivateStep | None = None


def train(
    trainer: PrivateTrainer,
    loaded: LoadedModel,
    request: RoundRequest,
    charged: Charge,
    *,
    seed: int | None,
    rounds: RoundStore,
    gradient: bool = False,
) -> Trained:
    """Run the ``charged.entry.steps`` steps of the round from the broadcast point.

    Args:
        trainer: the site's trainer (its model is ``loaded``).
        loaded: the site's model.
        request: the round's checked request (its arrays passed ``check_broadcast``).
        charged: the round's charge, already durable.
        seed: ``SitePolicy.round_seed`` of this charge (None: from the OS).
        rounds: the site's stored rounds, whose moments a ``PrismTrainer`` carries over.
        gradient: release the round's one charged step without taking it (``step-at =
            coordinator``; a ``PrismTrainer`` and one charged step only).
    """
    start = load_arrays(loaded, request.arrays)
    if gradient:
        if not isinstance(trainer, PrismTrainer) or charged.entry.steps != 1:
            raise ConfigError("step-at=coordinator releases one PRISM step a round")
        trainer.begin_round(charged.history, 1)
        trainer.reseed(seed)
        released, result = trainer.private_gradient()
        return Trained(start, start, [result], None, released)
    saved = rounds.moments()
    if isinstance(trainer, PrismTrainer) and saved is not None:
        trainer.states = _realigned(saved, start)
    trainer.begin_round(charged.history, charged.entry.steps)
    trainer.reseed(seed)
    results = trainer.train(charged.entry.steps)
    end = read_points(loaded.handles)
    moments = None
    if isinstance(trainer, PrismTrainer):
        moments = {
            "states": [vars(s) for s in trainer.states],
            "points": [(p.A, p.B) for p in end],
        }
    return Trained(start, end, results, moments)


def _realigned(saved: dict[str, Any], start: list[Point]) -> list[AdaptiveState]:
    """The stored moments carried from the points they belong to onto ``start``."""
    states = [AdaptiveState(**s) for s in saved["states"]]
    ends = [Point(*p) for p in saved["points"]]
    return [realign_state(s, e, p) for s, e, p in zip(states, ends, start, strict=True)]
