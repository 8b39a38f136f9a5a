"""What an honest site's round can move: the sites' optimizer (``UpdateBound``), a private
clip's public range (``AutoClip``), and the checks of a reply's update against them.

See ``prism_core.bounds`` for the bounds themselves. Nothing here reads the ledger or Flower's
transport: ``UpdateChecker`` takes the round's broadcast point and a reply's update and facts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from flwr.app import ArrayRecord
from torch import Tensor

from prism_core.bounds import (
    FLOAT32_SLACK,
    adam_gain,
    dp_step_norm_bound,
    factor_update_norm_bounds,
    round_update_norm_bound,
    tangent_dimension,
)
from prism_core.manifold import Point, tangent_norm_sq
from prism_runtime.config import HEAD_MOMENTUM, SGD_HEADS, RunConfig, site_method
from prism_runtime.facts import ReplyFacts
from prism_runtime.protocol import HEAD_PREFIX, key
from prism_runtime.train_config import ADAMW_BETAS, TrainConfig, site_train_config
from server.errors import ConfigError, ReplyError
from server.strategy.aggregator import Mode

__all__ = ["AutoClip", "UpdateBound", "UpdateChecker"]

_MAX_ABS = 1e8  # no adapter or update entry is this large; rejected before any arithmetic


@dataclass(frozen=True)
class UpdateBound:
    """What the coordinator knows of the sites' local optimizer, to bound an honest update.

    See ``prism_core.bounds``. ``optimizer="adaptive"`` is PRISM's transform (the trainer's);
    ``"sgd"`` bounds plain DP steps from ``max_norm``, ``expected_batch_size`` and the site's
    reported ``sigma``/``q`` with false-rejection probability ``failure`` per round. The DP head
    and the factor-space baselines use torch AdamW (betas ``head_betas``, no weight decay);
    ``head_optimizer="sgd"``: the head takes plain SGD steps on its DP gradient, bounded like a
    DP step from ``max_norm`` (the total clip, >= the head's share) and the reply's sigma/q;
    ``"momentum"``: heavy-ball steps ``v <- beta v + g`` with the sites' ``beta =
    prism_runtime.config.HEAD_MOMENTUM``, whose velocity (kept across a site's rounds) is at most
    ``1 / (1 - beta)`` times that step bound.
    """

    lr: float
    optimizer: Literal["adaptive", "sgd"] = "adaptive"
    beta1: float = 0.9
    beta2: float = 0.999
    bias_correction: bool = True
    head_lr: float | None = None
    head_betas: tuple[float, float] = ADAMW_BETAS
    head_optimizer: Literal["adamw", "sgd", "momentum"] = "adamw"
    max_norm: float = 0.0
    expected_batch_size: float = 0.0
    failure: float = 1e-9

    @classmethod
    def for_sites(cls, train: TrainConfig, *, failure: float = 1e-9) -> UpdateBound:
        """The bound for sites that run ``train``: the ``TrainConfig`` every honest site derives
        from the run config (``prism_runtime.train_config.site_train_config``), so the lr, the
        clip and batch, PRISM's adaptive betas and bias correction, and the head's lr, optimizer
        and AdamW betas are the ones the sites' trainer actually uses."""
        adaptive = train.adaptive.to_config()
        return cls(
            lr=train.lr,
            beta1=adaptive.beta1,
            beta2=adaptive.beta2,
            bias_correction=adaptive.bias_correction,
            head_lr=train.head_learning_rate,
            head_betas=ADAMW_BETAS,
            head_optimizer=train.head_optimizer,
            max_norm=train.max_norm,
            expected_batch_size=float(train.batch_size),
            failure=failure,
        )

    @classmethod
    def for_run(cls, run: RunConfig) -> UpdateBound:
        """The bound for the honest sites of ``run``: ``for_sites`` of the ``TrainConfig`` each
        of them derives from it (``site_train_config``: PRISM's adaptive transform, the head's
        SGD or AdamW, AdamW for the baselines); with ``max-norm = auto``, at the largest clip a
        site's estimate can give (``AutoClip.high``)."""
        clip = run.max_norm if isinstance(run.max_norm, float) else run.auto_clip_range[1]
        train = site_train_config(
            run, method=site_method(run.method), max_norm=clip, epsilon=run.target_epsilon
        )
        return cls.for_sites(train)

    def __post_init__(self) -> None:
        if self.optimizer not in ("adaptive", "sgd"):
            raise ConfigError(f"optimizer={self.optimizer!r}: use 'adaptive' or 'sgd'")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr={self.lr!r}: the sites' local lr must be finite and > 0")
        sgd = self.optimizer == "sgd" or self.head_optimizer in SGD_HEADS
        if sgd and not (self.max_norm > 0 and self.expected_batch_size > 0):
            raise ConfigError(
                f"optimizer='sgd' (or head_optimizer='sgd') needs max_norm > 0 and "
                f"expected_batch_size > 0, got "
                f"{self.max_norm!r} and {self.expected_batch_size!r}"
            )
        if not 0 < self.failure < 1:
            raise ConfigError(f"failure={self.failure!r}: must be in (0, 1)")


@dataclass(frozen=True)
class AutoClip:
    """A run with ``max-norm = auto``: what the coordinator knows of the sites' private clips.

    Each site estimates its clip C privately in its first round of the run (``prism_core.
    quantile``, ``client.clip_quantile``) and reports it as ``max-norm``; that round's reply also
    carries the estimate's own event (``quantile-sigma``, ``quantile-q``, ``quantile-steps``),
    recorded as its own ledger row (``QUANTILE_MECHANISM``).

    Attributes:
        low, high: every total clip an honest site can report (``RunConfig.auto_clip_range``:
            public, from the run config). A reply outside ``[low, high]`` (beyond float32 slack)
            is rejected; ``high`` is the clip the update bound assumes for a site.
        steps: K, the quantile steps of one estimate.
        noise_multiplier: the count's sigma_b at the run's expected batch size, used for an
            UNCONFIRMED estimate (a site that may have estimated and then failed).
    """

    low: float
    high: float
    steps: int
    noise_multiplier: float

    @classmethod
    def for_run(cls, run: RunConfig) -> AutoClip | None:
        """What the coordinator checks of the private clips of ``run``'s sites; None when the
        run fixes its clip or runs ``nondp`` (no clip, nothing estimated)."""
        if not run.auto_clip or run.method == "nondp":
            return None
        low, high = run.auto_clip_range
        return cls(
            low=low,
            high=high,
            steps=run.clip_quantile_steps,
            noise_multiplier=run.clip_quantile_noise * run.batch_size,
        )

    def __post_init__(self) -> None:
        ok = 0 < self.low <= self.high < math.inf and self.steps >= 1
        if not (ok and self.noise_multiplier > 0):
            raise ConfigError(f"{self}: need 0 < low <= high, steps >= 1 and sigma_b > 0")


class UpdateChecker:
    """This round's bounds on an honest update, and the checks of a reply's update.

    ``begin_round`` takes the broadcast arrays and computes the round's bounds; ``validate``
    checks a reply's update (keys, dtype, shapes, finite and sane values, the norm bound of the
    mechanism the reply's facts state) and returns its tensors. Without an ``UpdateBound`` only
    the shapes and values are checked. ``gradient`` (``step-at = coordinator``): a reply is one
    DP release, not a round's displacement, bounded by ``dp_step_norm_bound`` (``gradient_bound``).
    """

    def __init__(
        self,
        *,
        modules: list[str],
        head: list[str],
        mode: Mode,
        local_steps: int,
        update_bound: UpdateBound | None,
        gradient: bool = False,
    ) -> None:
        if gradient and (mode != "tangent" or local_steps != 1):
            raise ConfigError("a gradient reply is PRISM's one release (tangent mode, 1 step)")
        self.modules, self.head, self.mode = modules, head, mode
        self.local_steps, self.update_bound = local_steps, update_bound
        self.gradient = gradient
        self.broadcast: dict[str, Tensor] = {}
        self.norm_bound: float | None = None  # tangent mode: bound on the update's norm
        self.factor_bounds: dict[str, float] = {}  # factor-average: per-tensor bounds

    def begin_round(self, server_round: int, broadcast: dict[str, Tensor]) -> None:
        """The round's broadcast point and its bounds."""
        self.broadcast = broadcast
        self._set_bounds(server_round)

    def expected_update_keys(self) -> dict[str, tuple[int, ...]]:
        parts = ("dA", "dB") if self.mode == "tangent" else ("A", "B")
        shapes: dict[str, tuple[int, ...]] = {}
        for module in self.modules:
            for part, base in zip(parts, ("A", "B"), strict=True):
                shapes[key(module, part)] = tuple(self.broadcast[key(module, base)].shape)
        for name in self.head:
            shapes[HEAD_PREFIX + name] = tuple(self.broadcast[HEAD_PREFIX + name].shape)
        return shapes

    def _set_bounds(self, server_round: int) -> None:
        """This round's norm bounds on an honest update (``prism_core.bounds``)."""
        self.norm_bound, self.factor_bounds = None, {}
        ub = self.update_bound
        if ub is None or self.gradient:  # a gradient's bound needs the reply's sigma and q
            return

        def horizon(beta1: float, beta2: float) -> int | None:
            # A site's optimizer step count can exceed server_round * tau (a state folder kept
            # across runs), so take the supremum over all t when it is finite (b1^2 < b2).
            return None if beta1**2 < beta2 else server_round * self.local_steps

        head_lr = ub.lr if ub.head_lr is None else ub.head_lr
        b1, b2 = ub.head_betas
        head_gain = adam_gain(beta1=b1, beta2=b2, max_step=horizon(b1, b2))
        head_size = sum(self.broadcast[HEAD_PREFIX + n].numel() for n in self.head)
        if ub.head_optimizer in SGD_HEADS:
            head_size = 0  # an SGD head's bound needs the reply's sigma and q (_head_sgd_bound)
        if self.mode == "tangent":
            if ub.optimizer == "sgd":
                return  # depends on the reply's sigma and q: computed per reply
            points = [
                Point(self.broadcast[key(m, "A")], self.broadcast[key(m, "B")])
                for m in self.modules
            ]
            gain = adam_gain(
                beta1=ub.beta1,
                beta2=ub.beta2,
                bias_correction=ub.bias_correction,
                max_step=horizon(ub.beta1, ub.beta2),
            )
            self.norm_bound = round_update_norm_bound(
                points,
                lr=ub.lr,
                local_steps=self.local_steps,
                gain=gain,
                head_size=head_size,
                head_lr=head_lr,
                head_gain=head_gain,
            )
            return
        gain = head_gain  # the baselines' factors use the same torch AdamW
        shapes = []
        for m in self.modules:
            (rows, r), n = self.broadcast[key(m, "A")].shape, self.broadcast[key(m, "B")].shape[0]
            shapes.append((int(rows), int(n), int(r)))
        bounds = factor_update_norm_bounds(
            shapes, lr=ub.lr, local_steps=self.local_steps, gain=gain
        )
        for m, (bound_a, bound_b) in zip(self.modules, bounds, strict=True):
            self.factor_bounds[key(m, "A")], self.factor_bounds[key(m, "B")] = bound_a, bound_b
        for name in self.head if head_size else ():
            size = self.broadcast[HEAD_PREFIX + name].numel()
            self.factor_bounds[HEAD_PREFIX + name] = (
                head_lr * self.local_steps * head_gain * math.sqrt(size)
            )

    def head_sgd_bound(self, facts: ReplyFacts) -> float:
        """Bound on an SGD head's move over the round: ``head_lr tau`` times one DP step's norm.

        One step is ``head_lr (sum_i alpha_i g_i + sigma C xi) / b`` with every example's head
        gradient clipped to at most C (``dp_step_norm_bound`` over the head's coordinates).
        With momentum ``beta`` the step is ``head_lr v_t``, ``v_t = sum_s beta^(t-s) g_s`` over
        every DP gradient the site has released in this run at the same sigma, q and C, so
        ``|v_t| <= G / (1 - beta)`` for the same per-step bound ``G``.
        """
        ub = self.update_bound
        if ub is None or ub.head_optimizer not in SGD_HEADS or not self.head:
            return 0.0
        step = dp_step_norm_bound(
            max_norm=self.clip_of(facts),
            noise_multiplier=facts.sigma,
            expected_batch_size=ub.expected_batch_size,
            sample_rate=facts.q,
            dimension=sum(self.broadcast[HEAD_PREFIX + n].numel() for n in self.head),
            failure=ub.failure / self.local_steps,
        )
        head_lr = ub.lr if ub.head_lr is None else ub.head_lr
        velocity = 1.0 / (1.0 - HEAD_MOMENTUM) if ub.head_optimizer == "momentum" else 1.0
        return head_lr * self.local_steps * step * velocity

    def clip_of(self, facts: ReplyFacts) -> float:
        """The clip C to bound a reply's DP steps with: its ``max-norm`` fact, never above the
        update bound's ``max_norm`` (the run's C, or ``AutoClip.high`` for ``max-norm = auto``)."""
        ub = self.update_bound
        assert ub is not None
        return min(ub.max_norm if facts.max_norm is None else facts.max_norm, ub.max_norm)

    def gradient_bound(self, facts: ReplyFacts) -> float:
        """The norm bound of one DP release over every module and the head, from the reply's
        sigma and q (``dp_step_norm_bound``; a ``gradient`` reply, or one of ``tau`` steps)."""
        ub = self.update_bound
        assert ub is not None
        shapes = [
            (*self.broadcast[key(m, "A")].shape, self.broadcast[key(m, "B")].shape[0])
            for m in self.modules
        ]
        dim = tangent_dimension([(m, n, r) for m, r, n in shapes])
        dim += sum(self.broadcast[HEAD_PREFIX + n].numel() for n in self.head)
        return dp_step_norm_bound(
            max_norm=self.clip_of(facts),
            noise_multiplier=facts.sigma,
            expected_batch_size=ub.expected_batch_size,
            sample_rate=facts.q,
            dimension=dim,
            failure=ub.failure / self.local_steps,
        )

    def sgd_bound(self, facts: ReplyFacts) -> float:
        """Tangent-mode bound for plain DP-SGD sites, from the reply's sigma and q."""
        ub = self.update_bound
        assert ub is not None
        step = self.gradient_bound(facts)
        return round_update_norm_bound(
            [], lr=ub.lr, local_steps=self.local_steps, optimizer="sgd", dp_step=step
        )

    def validate(self, update: Any, facts: ReplyFacts) -> dict[str, Tensor]:
        """Keys, dtype, shapes, finite and sane values, and the mechanism's norm bound."""
        if not isinstance(update, ArrayRecord):
            raise ReplyError(f"update is a {type(update).__name__}, not an ArrayRecord", "keys")
        expected = self.expected_update_keys()
        got = set(update.keys())
        if got != set(expected):
            missing, extra = sorted(set(expected) - got), sorted(got - set(expected))
            raise ReplyError(
                f"wrong update keys (missing {missing[:3]}, unexpected {extra[:3]})", "keys"
            )
        tensors = {}
        for name, array in update.items():
            if array.dtype != "float32":
                raise ReplyError(f"{name}: dtype {array.dtype}, expected float32", "dtype")
            if tuple(array.shape) != expected[name]:
                raise ReplyError(
                    f"{name}: shape {tuple(array.shape)}, expected {expected[name]}", "shape"
                )
            try:
                tensor = torch.from_numpy(array.numpy().copy()).reshape(expected[name])
            except Exception as exc:  # a garbled payload of the right declared dtype and shape
                raise ReplyError(f"{name}: cannot decode the array ({exc!r})", "dtype") from exc
            if not torch.isfinite(tensor).all():
                raise ReplyError(f"{name}: contains NaN or Inf", "non-finite")
            if tensor.numel() and float(tensor.abs().max()) > _MAX_ABS:
                raise ReplyError(
                    f"{name}: an entry of size {float(tensor.abs().max()):.3g} > {_MAX_ABS:g}",
                    "magnitude",
                )
            tensors[name] = tensor
        self.check_norm(tensors, facts)
        return tensors

    def check_norm(self, tensors: dict[str, Tensor], facts: ReplyFacts) -> None:
        """Reject an update larger than an honest site's round can produce (float64 norms)."""
        if self.update_bound is None:
            return
        head_sgd = self.head_sgd_bound(facts)
        if self.mode == "factor-average":
            bounds = dict(self.factor_bounds)
            bounds.update({HEAD_PREFIX + n: head_sgd for n in self.head if head_sgd})
            for name, bound in bounds.items():
                moved = float((tensors[name].double() - self.broadcast[name].double()).norm())
                if moved > bound * (1 + FLOAT32_SLACK) + 1e-6:
                    raise ReplyError(
                        f"{name} moved by {moved:.4g}, more than the {bound:.4g} that "
                        f"{self.local_steps} AdamW steps at lr {self.update_bound.lr} allow",
                        "norm",
                    )
            return
        if self.gradient:
            bound, head_sgd = self.gradient_bound(facts), 0.0  # the head is in the one release
        else:
            bound = self.norm_bound if self.norm_bound is not None else self.sgd_bound(facts)
        total = 0.0
        for m in self.modules:
            A, B = self.broadcast[key(m, "A")].double(), self.broadcast[key(m, "B")].double()
            dA, dB = tensors[key(m, "dA")].double(), tensors[key(m, "dB")].double()
            total += float(tangent_norm_sq(A, B, dA, dB).clamp_min(0.0))
        head_sq = sum(float(tensors[HEAD_PREFIX + n].double().square().sum()) for n in self.head)
        scale = math.sqrt(sum(float(v.double().square().sum()) for v in self.broadcast.values()))
        if head_sgd:  # an SGD head's steps have their own bound; the modules keep theirs
            head_norm = math.sqrt(head_sq)
            if not math.isfinite(head_norm) or head_norm > head_sgd * (1 + FLOAT32_SLACK) + 1e-6:
                raise ReplyError(
                    f"head update norm {head_norm:.4g} exceeds the bound {head_sgd:.4g} of "
                    f"{self.local_steps} SGD steps on its DP gradient",
                    "norm",
                )
        else:
            total += head_sq
        norm = math.sqrt(total)
        # a gradient is not a move of the adapter: no slack scaled by the adapter's size
        limit = bound * (1 + FLOAT32_SLACK) + (0.0 if self.gradient else 1e-6 * scale)
        if math.isfinite(norm) and norm <= limit:
            return
        if self.gradient:
            raise ReplyError(
                f"gradient norm {norm:.4g} exceeds the bound {bound:.4g} of one DP release "
                f"(sigma {facts.sigma:g}, q {facts.q:g})",
                "norm",
            )
        raise ReplyError(
            f"update norm {norm:.4g} exceeds the bound {bound:.4g} implied by the mechanism "
            f"({self.local_steps} steps at lr {self.update_bound.lr}, "
            f"{self.update_bound.optimizer} optimizer)",
            "norm",
        )

    # -- aggregation -----------------------------------------------------------------------
