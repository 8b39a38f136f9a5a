"""The streaming aggregator: weighted sums of the replies' updates, one reply at a time, then
the server step (exact tangent mean + the retraction, FedAvg of factors, or with ``step-at =
coordinator`` PRISM's adaptive step on the mean of the sites' noisy gradients).

Flower-free: it takes tensors and a reply's CHECKED facts (``server.strategy.replies``), so it can
be driven by the strategy, a benchmark or a test alike. Memory holds one running sum per tensor,
whatever the number of sites. Sums are in float64 and in the order the replies are added: the
strategy adds them as they arrive (``server.strategy.loop``), so two runs whose replies arrive
in different orders can differ at float64 rounding (float addition is not associative).
"""

from __future__ import annotations

import logging
import math
from typing import Literal, Protocol

import torch
from torch import Tensor

from prism_core.aggregation import Aggregation, site_noise_std
from prism_core.manifold import Point, Tangent
from prism_runtime.facts import ReplyFacts
from prism_runtime.protocol import HEAD_PREFIX, MAX_EXAMPLES, key
from server.errors import ReplyError
from server.optimizer import scheduled_lr, server_step
from server.strategy.rounds import RoundSummary

__all__ = ["MeanStep", "Mode", "StreamingAggregator"]

Mode = Literal["tangent", "factor-average"]
"""``tangent``: PRISM's exact tangent mean; ``factor-average``: FedAvg of A and B (baselines)."""

log = logging.getLogger("server.strategy")


class MeanStep(Protocol):
    """The coordinator's step on the weighted mean of noisy gradients
    (``server.strategy.central.CentralStep.apply_mean``)."""

    def apply_mean(
        self,
        arrays: dict[str, Tensor],
        means: dict[str, Tensor],
        *,
        noise_std: float,
        lr_scale: float = 1.0,
    ) -> dict[str, Tensor]: ...


_SIZE_RTOL = 1e-6  # num-examples against b / q: q = b / N is a float64 division
_MIN_RANK_RATIO = 1e-6  # s_r / s_1 of a retracted Z = A B.T below this: rank r is lost in float32


class StreamingAggregator:
    """Weighted running sums of one round's updates and the server step that applies them.

    Args:
        modules, head, mode: the global arrays' LoRA modules and head tensors; ``tangent``
            (PRISM) or ``factor-average`` (baselines).
        server_lr, lr_schedule, num_rounds: the server lr of round t (``scheduled_lr``).
        aggregation: ``inverse-noise``, ``uniform`` or ``examples`` (``prism_core.aggregation``).
        dp: whether the replies carry DP noise (non-DP: noise std 0, uniform inverse-noise).
        expected_batch_size: the run's expected batch b (``examples``: a site's shard size is
            ``b / q``; None: every reply must state ``num-examples``).
        central: ``step-at = coordinator``: the replies are the sites' noisy gradients and
            the server step is PRISM's adaptive step on their weighted mean
            (``server.strategy.central.CentralStep.apply_mean``, at the round's server lr as a
            factor of the run's lr); None: the replies are displacements (``server_step``).
    """

    def __init__(
        self,
        *,
        modules: list[str],
        head: list[str],
        mode: Mode,
        server_lr: float,
        lr_schedule: str,
        num_rounds: int,
        aggregation: Aggregation,
        dp: bool,
        expected_batch_size: float | None = None,
        central: MeanStep | None = None,
    ) -> None:
        scheduled_lr(server_lr, lr_schedule, 1, num_rounds)  # validates both
        if central is not None and mode != "tangent":
            raise ValueError("the coordinator's step takes PRISM's tangent replies")
        self.central = central
        self.modules, self.head, self.mode = modules, head, mode
        self.server_lr, self.lr_schedule, self.num_rounds = server_lr, lr_schedule, num_rounds
        self.aggregation: Aggregation = aggregation
        self.dp = dp
        self.expected_batch_size = expected_batch_size
        self.broadcast: dict[str, Tensor] = {}
        self._sums: dict[str, Tensor] = {}
        self._total = 0.0
        self._noise_var = 0.0  # sum of (weight x noise std)^2

    def begin_round(self, broadcast: dict[str, Tensor]) -> None:
        """Start a round at the broadcast arrays: empty sums."""
        self.broadcast = broadcast
        self._sums, self._total, self._noise_var = {}, 0.0, 0.0

    def add(self, update: dict[str, Tensor], weight: float, noise_std: float = 0.0) -> None:
        """Add one checked reply's update, with its ``weight(facts)`` and its ``noise_std
        (facts)``, to the running sums."""
        for name, tensor in update.items():
            value = weight * tensor.double()
            self._sums[name] = self._sums[name] + value if name in self._sums else value
        self._total += weight
        self._noise_var += (weight * noise_std) ** 2

    @property
    def mean_noise_std(self) -> float:
        """The std per coordinate of this round's weighted mean's noise so far:
        ``prism_core.aggregation.aggregate_noise_std`` of the normalised weights and the replies'
        ``sigma C / b``, ``sqrt(sum_k (w_k s_k)^2) / sum_k w_k``, kept as two running sums."""
        return math.sqrt(self._noise_var) / self._total if self._total > 0 else 0.0

    @property
    def total_weight(self) -> float:
        """The sum of this round's weights so far (0 before any update)."""
        return self._total

    def finish(self, summary: RoundSummary) -> dict[str, Tensor] | None:
        """The next global arrays from the weighted mean, or None if the step was discarded
        (``summary.discarded`` says why)."""
        means = {k: (v / self._total).float() for k, v in self._sums.items()}
        return self._apply_checked(means, summary)

    def noise_std(self, facts: ReplyFacts) -> float:
        """``sigma C / b`` of a reply from its CHECKED facts (0 for a non-private run)."""
        if not self.dp:
            return 0.0
        if facts.max_norm is None or facts.expected_batch_size is None:  # RunTerms.check
            raise ReplyError("a DP reply without its max-norm or expected-batch-size", "facts")
        return site_noise_std(
            noise_multiplier=facts.sigma,
            max_norm=facts.max_norm,
            expected_batch_size=facts.expected_batch_size,
        )

    def weight(self, facts: ReplyFacts) -> float:
        """The reply's un-normalised weight (the streamed sum is divided by their total).

        ``inverse-noise``: ``(b / (sigma C))^2`` from the reply's facts, which ``RunTerms.check``
        has matched against the run's C and b (post-processing of public parameters; exact in
        the tangent space at the broadcast point); ``uniform``: 1; ``examples``: N_k
        (``num_examples``). See ``prism_core.aggregation``.
        """
        if self.aggregation == "uniform":
            return 1.0
        if self.aggregation == "examples":
            return self.num_examples(facts)
        std = self.noise_std(facts)
        return 1.0 if std == 0 else 1.0 / (std * std)

    def num_examples(self, facts: ReplyFacts) -> float:
        """A site's shard size N_k from its CHECKED facts, for ``examples`` weights.

        A site samples at ``q = b / N`` (capped at 1), so its ``q`` and the run's expected batch
        ``b`` already state N (docs/security.md: N is public); ``num-examples``, sent by a site
        that shares it, must agree with ``b / q`` (to float rounding; at ``q = 1``, N <= b).
        Raises ``ReplyError`` (``facts``) on a disagreement or when neither is known.
        """
        q = facts.q
        implied = None if self.expected_batch_size is None else self.expected_batch_size / q
        if implied is not None and implied > MAX_EXAMPLES:
            raise ReplyError(f"q = {q:.3g} implies more than {MAX_EXAMPLES:.0e} examples", "facts")
        if facts.num_examples is None:
            if implied is None:
                raise ReplyError("aggregation=examples but the reply has no num-examples", "facts")
            return implied
        stated = float(facts.num_examples)
        if implied is not None and not (
            stated <= implied * (1 + _SIZE_RTOL)
            if q >= 1.0
            else math.isclose(stated, implied, rel_tol=_SIZE_RTOL, abs_tol=0.5)
        ):
            raise ReplyError(
                f"num-examples {int(stated)} disagrees with b / q = {implied:.6g}", "facts"
            )
        return stated

    def _apply_checked(
        self, means: dict[str, Tensor], summary: RoundSummary
    ) -> dict[str, Tensor] | None:
        """``apply``, guarded: a non-finite mean or result, or lost rank, keeps the old adapter."""
        reason = ""
        if not all(torch.isfinite(v).all() for v in means.values()):
            reason = "the aggregated update is not finite"
        else:
            t = summary.server_round
            lr = scheduled_lr(self.server_lr, self.lr_schedule, t, self.num_rounds)
            new = self.apply(means, lr)
            if not all(torch.isfinite(v).all() for v in new.values()):
                reason = "the retracted adapter is not finite"
            else:
                for m in self.modules:
                    A, B = new[key(m, "A")].double(), new[key(m, "B")].double()
                    RA = torch.linalg.qr(A, mode="r")[1]
                    RB = torch.linalg.qr(B, mode="r")[1]
                    sv = torch.linalg.svdvals(RA @ RB.mT)  # singular values of Z = A B.T
                    if not float(sv[-1]) > _MIN_RANK_RATIO * float(sv[0]):
                        reason = f"the new {m} lost rank (singular values {sv.tolist()})"
                        break
        if reason:
            summary.discarded = reason
            log.error("round %d: %s; global adapter unchanged", summary.server_round, reason)
            return None
        return new

    def apply(self, means: dict[str, Tensor], lr: float) -> dict[str, Tensor]:
        """The next global arrays from this round's means, with server lr ``lr``."""
        if self.central is not None:
            return self.central.apply_mean(
                self.broadcast, means, noise_std=self.mean_noise_std, lr_scale=lr
            )
        if self.mode == "tangent":
            return self._apply_tangent(means, lr)
        new: dict[str, Tensor] = {}
        for module in self.modules:  # factor-average: FedAvg step of A and B
            A, B = self.broadcast[key(module, "A")], self.broadcast[key(module, "B")]
            A_new = A + lr * (means[key(module, "A")] - A)
            B_new = B + lr * (means[key(module, "B")] - B)
            new[key(module, "A")] = A_new.to(torch.float32).contiguous()
            new[key(module, "B")] = B_new.to(torch.float32).contiguous()
        for name in self.head:
            value = self.broadcast[HEAD_PREFIX + name]
            delta = means[HEAD_PREFIX + name] - value
            new[HEAD_PREFIX + name] = (value + lr * delta).contiguous()
        return new

    def _apply_tangent(self, means: dict[str, Tensor], lr: float) -> dict[str, Tensor]:
        """The server step (``server.optimizer.server_step``) from the aggregated tangent update."""
        points = {
            m: Point(self.broadcast[key(m, "A")], self.broadcast[key(m, "B")]) for m in self.modules
        }
        updates = {m: Tangent(means[key(m, "dA")], means[key(m, "dB")]) for m in self.modules}
        values = {n: self.broadcast[HEAD_PREFIX + n] for n in self.head}
        deltas = {n: means[HEAD_PREFIX + n] for n in self.head}
        moved, head = server_step(points, updates, values, deltas, lr=lr)
        new: dict[str, Tensor] = {}
        for m in self.modules:
            new[key(m, "A")] = moved[m].A.to(torch.float32).contiguous()
            new[key(m, "B")] = moved[m].B.to(torch.float32).contiguous()
        for n in self.head:
            new[HEAD_PREFIX + n] = head[n].to(torch.float32).contiguous()
        return new
