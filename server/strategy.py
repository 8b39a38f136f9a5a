"""Coordinator strategy: exact tangent aggregation + retraction, and the factor-averaging baselines.

PRISM (``mode="tangent"``): every site of a round starts from the same broadcast point
``Z_t = A B.T``, so their tangent updates live in one vector space and the weighted mean of the
lifts IS the weighted mean of the ``dZ_k`` (the map ``(dA, dB) -> dA B.T + A dB.T`` is linear).
The server then takes ``Retr_r(Z_t + eta_s * mean dZ)`` (QR + 2r x 2r SVD, full rank r kept).
Sums are streamed reply by reply, so memory does not grow with the number of sites.

Baselines (``mode="factor-average"``): FedIT-style FedAvg of ``A`` and ``B`` separately (inexact:
``mean(A) mean(B).T != mean(A B.T)``), used with factor-space DP or FFA on the sites.

Every reply is validated before it touches the aggregate; a bad reply is logged, counted per
reason in the round summary and skipped (see ``PrismStrategy.aggregate_train`` for the checks
and for which accounting facts reach the ledger). No NaN or Inf can reach the global adapter:
the replies, their mean and the retracted result are all checked before anything is applied.

Nothing a site writes as free text is logged or stored: an error reply is shown by its
``Error.code`` and that code's fixed text (``client.protocol.SITE_ERROR_CODES``), a refusal by
its reason code (``client.protocol.REFUSAL_REASONS``); ``Error.reason`` is never read.

Every site asked to run a round is charged in the ledger: a valid reply's facts as a confirmed
charge; a site that gives no valid answer (an error reply, no reply before the round's end,
facts that do not match the configuration, an invalid or replayed reply) as an UNCONFIRMED
charge of the round's steps at its last confirmed parameters (``Ledger.last_confirmed``), or,
for a site with none, with unknown parameters (accounted as epsilon inf). It may have charged
itself before failing; the report counts these charges in the site's worst-case epsilon.

A private clip norm (``max-norm = auto``, ``AutoClip``): a site's reply carries its clip as
``max-norm``, checked against the public range of every estimate the run config allows, and in
the round it estimated it, the estimate's own event (``quantile-*`` facts), recorded as a ledger
row of mechanism ``QUANTILE_MECHANISM`` beside the training row.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.result import Result
from torch import Tensor

from client.config import HEAD_MOMENTUM, SGD_HEADS
from client.protocol import (
    ACCOUNTING,
    ACCOUNTING_KEYS,
    ARRAYS,
    CONFIG,
    HEAD_PREFIX,
    REFUSAL_REASONS,
    RNG,
    RNG_MODES,
    ROUND_NONCE,
    SERVER_ROUND,
    SITE_ERROR_CODES,
    STATUS_OK,
    STATUS_REFUSED,
    UPDATE,
    key,
)
from client.testhooks import pause_point
from prism_core.aggregation import Aggregation, aggregate_noise_std, site_noise_std
from prism_core.bounds import (
    FLOAT32_SLACK,
    adam_gain,
    dp_step_norm_bound,
    factor_update_norm_bounds,
    round_update_norm_bound,
    tangent_dimension,
)
from prism_core.manifold import Point, Tangent, tangent_norm_sq
from prism_core.mechanism import ADJACENCY
from prism_core.quantile import QUANTILE_MECHANISM
from server.errors import (
    ConfigError,
    InvalidEventError,
    LedgerConflictError,
    LedgerError,
    ReplyError,
    SitesUnavailableError,
)
from server.ledger import DEFAULT_MECHANISM, UNKNOWN_Q, UNKNOWN_SIGMA, Ledger, LedgerEvent
from server.optimizer import ServerOptimizer, ServerOptimizerConfig, scheduled_lr

__all__ = [
    "AutoClip",
    "PrismStrategy",
    "RoundSummary",
    "UpdateBound",
    "error_reply_text",
    "validate_facts",
]

log = logging.getLogger(__name__)

Mode = Literal["tangent", "factor-average"]


@dataclass
class RoundSummary:
    """What happened in one round (logged and kept for the run summary).

    ``rejected`` holds ``(who, why)``; ``rejected_by_reason`` counts them by ``ReplyError.code``.
    ``discarded`` says why an aggregate was computed but not applied (non-finite or rank lost).
    ``refusal_codes`` maps each refusing site to its reason code; ``unconfirmed`` lists the sites
    charged an unconfirmed round (asked, no valid answer; see ``PrismStrategy.aggregate_train``).
    """

    server_round: int
    sent: int = 0
    accepted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (who, why)
    applied: bool = False
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    discarded: str = ""
    refusal_codes: dict[str, str] = field(default_factory=dict)
    unconfirmed: list[str] = field(default_factory=list)

    def reject(self, who: str, exc: ReplyError) -> None:
        self.rejected.append((who, str(exc)))
        self.rejected_by_reason[exc.code] = self.rejected_by_reason.get(exc.code, 0) + 1


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
    client.config.HEAD_MOMENTUM``, whose velocity (kept across a site's rounds) is at most
    ``1 / (1 - beta)`` times that step bound.
    """

    lr: float
    optimizer: Literal["adaptive", "sgd"] = "adaptive"
    beta1: float = 0.9
    beta2: float = 0.999
    bias_correction: bool = True
    head_lr: float | None = None
    head_betas: tuple[float, float] = (0.9, 0.999)
    head_optimizer: Literal["adamw", "sgd", "momentum"] = "adamw"
    max_norm: float = 0.0
    expected_batch_size: float = 0.0
    failure: float = 1e-9

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

    def __post_init__(self) -> None:
        ok = 0 < self.low <= self.high < math.inf and self.steps >= 1
        if not (ok and self.noise_multiplier > 0):
            raise ConfigError(f"{self}: need 0 < low <= high, steps >= 1 and sigma_b > 0")


_MAX_STEPS = 10**6  # more local steps than any real round; larger is a garbled fact
_MAX_SIGMA = 1e4
_MAX_SCALE = 1e9  # largest C or expected batch a reply may state
_SCALE_RTOL = 1e-6  # a reply's C and b must equal the run's to this relative tolerance
_MAX_COUNT_SIGMA = 1e8  # a clip estimate's count noise (sigma_b = noise * b) grows with b
_QUANTILE_FACTS = ("quantile-sigma", "quantile-q", "quantile-steps")
_MAX_ABS = 1e8  # no adapter or update entry is this large; rejected before any arithmetic
_MIN_RANK_RATIO = 1e-6  # s_r / s_1 of a retracted Z = A B.T below this: rank r is lost in float32
_SAMPLING = "poisson"  # the only sampling the accountant composes
_FLOWER_ERRORS = {
    value: name for name, value in vars(ErrorCode).items() if isinstance(value, int)
}  # Flower's own codes (a ClientApp that crashed or raised, a node gone): fixed names
_OPTIONAL_FACTS: dict[str, type] = {
    SERVER_ROUND: int,
    ROUND_NONCE: str,
    RNG: str,
    "reason": str,
    "mechanism": str,
    "adjacency": str,
    "sampling": str,
    "delta": float,
    "epsilon-cap": float,
    "epsilon": float,
    "num-examples": int,
    "max-norm": float,
    "expected-batch-size": float,
    "quantile-sigma": float,
    "quantile-q": float,
    "quantile-steps": int,
}


def _check_type(name: str, value: Any, kind: type) -> None:
    """Type (and for numbers finiteness) of one fact; the site's own ``epsilon`` may be inf."""
    if kind is float and not (isinstance(value, int | float) and not isinstance(value, bool)):
        raise ReplyError(f"accounting fact {name}={value!r} is not a number", "facts")
    if kind is float and name != "epsilon" and not math.isfinite(float(value)):
        raise ReplyError(f"accounting fact {name}={value!r} is not finite", "facts")
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ReplyError(f"accounting fact {name}={value!r} is not an integer", "facts")
    if kind is str and not isinstance(value, str):
        raise ReplyError(f"accounting fact {name}={value!r} is not a string", "facts")
    if kind is str and (len(value) > 1000 or not value.isprintable()):
        raise ReplyError(f"accounting fact {name} is too long or has control characters", "facts")


def validate_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """Check a reply's accounting facts; return them typed. Raises ``ReplyError``.

    Required: ``site-id``, ``status``, ``sigma``, ``q``, ``steps``; every other key must be one
    of ``client.protocol.ACCOUNTING_KEYS`` with the right type; values must be in range.
    """
    unknown = sorted(set(facts) - set(ACCOUNTING_KEYS))
    if unknown:
        raise ReplyError(f"unknown accounting facts {unknown[:3]}", "facts")
    required = {"site-id": str, "status": str, "sigma": float, "q": float, "steps": int}
    for name, kind in required.items():
        if name not in facts:
            raise ReplyError(f"accounting facts lack {name!r}", "facts")
        _check_type(name, facts[name], kind)
    for name, kind in _OPTIONAL_FACTS.items():
        if name in facts:
            _check_type(name, facts[name], kind)
    if not facts["site-id"] or len(facts["site-id"]) > 128:
        raise ReplyError(f"site-id {facts['site-id'][:20]!r} is empty or too long", "facts")
    if facts["status"] not in (STATUS_OK, STATUS_REFUSED):
        raise ReplyError(f"unknown status {facts['status'][:20]!r}", "facts")
    sigma, q, steps = float(facts["sigma"]), float(facts["q"]), int(facts["steps"])
    if not (0 <= sigma <= _MAX_SIGMA and 0 < q <= 1 and 0 <= steps <= _MAX_STEPS):
        raise ReplyError(
            f"impossible mechanism parameters sigma={sigma}, q={q}, steps={steps}", "facts"
        )
    if "delta" in facts and not 0 < float(facts["delta"]) < 1:
        raise ReplyError(f"delta={facts['delta']!r} is not in (0, 1)", "facts")
    for name in ("max-norm", "expected-batch-size"):
        if name in facts and not 0 < float(facts[name]) <= _MAX_SCALE:
            raise ReplyError(f"{name}={facts[name]!r} is not in (0, {_MAX_SCALE:g}]", "facts")
    if "num-examples" in facts and not 1 <= int(facts["num-examples"]) <= 10**12:
        raise ReplyError(f"num-examples={facts['num-examples']!r} is not in [1, 1e12]", "facts")
    if SERVER_ROUND in facts and int(facts[SERVER_ROUND]) < 0:
        raise ReplyError(f"server-round={facts[SERVER_ROUND]!r} is negative", "facts")
    if "max-norm" in facts and not float(facts["max-norm"]) > 0:
        raise ReplyError(f"max-norm={facts['max-norm']!r} is not > 0", "facts")
    _check_quantile_facts(facts)
    return facts


def _check_quantile_facts(facts: dict[str, Any]) -> None:
    """A private clip estimate's facts: all three or none, in range (``validate_facts``)."""
    given = [name for name in _QUANTILE_FACTS if name in facts]
    if not given:
        return
    if len(given) != len(_QUANTILE_FACTS):
        raise ReplyError(f"clip-estimate facts {given} without the others", "facts")
    sigma, q = float(facts["quantile-sigma"]), float(facts["quantile-q"])
    steps = int(facts["quantile-steps"])
    if not (0 < sigma <= _MAX_COUNT_SIGMA and 0 < q <= 1 and 1 <= steps <= _MAX_STEPS):
        raise ReplyError(
            f"impossible clip-estimate parameters sigma={sigma}, q={q}, steps={steps}", "facts"
        )


def error_reply_text(code: object) -> str:
    """The fixed text shown for a site's error reply with ``Error.code`` ``code``.

    A code of ``client.protocol.SITE_ERROR_CODES`` gets its text; one of Flower's own error codes
    (a ClientApp that crashed or raised, a node gone) its Flower name; any other code is
    "unknown site error code N". The site's ``Error.reason`` is never used: it is free text.
    """
    if not isinstance(code, int) or isinstance(code, bool):
        return "site error code is not an integer"
    if code in SITE_ERROR_CODES:
        return SITE_ERROR_CODES[code]
    if code in _FLOWER_ERRORS:
        return f"Flower error {_FLOWER_ERRORS[code]} (the site's ClientApp or node failed)"
    return f"unknown site error code {code}"


def _error_code(msg: Message) -> int | None:
    code = msg.error.code
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def _error_reply(msg: Message) -> ReplyError:
    """The rejection of an error reply: its code and that code's fixed text, nothing else."""
    code = _error_code(msg)
    shown = "?" if code is None else str(code)
    return ReplyError(f"error reply {shown}: {error_reply_text(code)}", "error-reply")


def _unconfirmed_code(error: ReplyError, msg: Message) -> str:
    """The ledger code of the unconfirmed charge a rejected reply leads to."""
    if error.code == "error-reply" and msg.has_error():
        code = _error_code(msg)
        return "error-reply" if code is None else f"error-reply-{code}"
    return error.code


class PrismStrategy(Strategy):
    """Round orchestration for PRISM and the factor-averaging baselines.

    Args:
        modules: LoRA module names (keys ``<module>/A``, ``<module>/B`` of the global arrays).
        head: names of the DP head tensors (keys ``head/<name>``), possibly empty.
        mode: ``tangent`` (PRISM) or ``factor-average`` (baselines).
        ledger: the coordinator's privacy ledger.
        run_id: this run's id in the ledger.
        sites_per_round, min_sites, server_lr, aggregation, local_steps, default cap
        (epsilon, delta) and seed: see ``client.config.RunConfig``.
        update_bound: the sites' local optimizer settings; when given, a reply whose update
            norm exceeds what an honest site can produce (``prism_core.bounds``) is rejected.
        mechanism: the mechanism the run's method runs on each site
            (``client.trainer.MECHANISMS[client.config.site_method(method)]``); a reply
            reporting another is rejected.
        dp: whether that mechanism adds noise; a DP reply must report sigma > 0.
        auto_clip: set for a run with ``max-norm = auto`` (see ``AutoClip``).
        lr_schedule, num_rounds: the server lr of round ``t`` is
            ``scheduled_lr(server_lr, lr_schedule, t, num_rounds)`` (run-config
            ``server-lr-schedule``), for every mode and server optimizer.
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
        aggregation: Aggregation = "inverse-noise",
        max_norm: float | None = None,
        expected_batch_size: float | None = None,
        server_optimizer: ServerOptimizerConfig | None = None,
        local_lr: float = 1.0,
        seed: int = 0,
        wait_for_nodes: float = 120.0,
        connect_timeout: float = 600.0,
        update_bound: UpdateBound | None = None,
        mechanism: str = DEFAULT_MECHANISM,
        dp: bool = True,
        auto_clip: AutoClip | None = None,
        lr_schedule: str = "constant",
        num_rounds: int = 1,
    ) -> None:
        scheduled_lr(server_lr, lr_schedule, 1, num_rounds)  # validates both
        self.lr_schedule, self.num_rounds = lr_schedule, num_rounds
        self.modules, self.head, self.mode = modules, head, mode
        self.mechanism, self.dp = mechanism, dp
        self.ledger, self.run_id = ledger, run_id
        self.sites_per_round, self.min_sites = sites_per_round, min_sites
        self.server_lr, self.local_steps = server_lr, local_steps
        self.target_epsilon, self.delta = target_epsilon, delta
        self.aggregation: Aggregation = aggregation
        self.max_norm, self.expected_batch_size = max_norm, expected_batch_size
        self.local_lr = local_lr
        self.optimizer = ServerOptimizer(
            server_optimizer or ServerOptimizerConfig(kind="sgd", lr=server_lr), modules, head
        )
        self._noise: list[tuple[float, float]] = []  # (weight, noise std) of this round's updates
        self.rng = random.Random(seed)
        self.wait_for_nodes, self.connect_timeout = wait_for_nodes, connect_timeout
        self.node_site: dict[int, str] = {}
        self.site_mechanism: dict[
            str, tuple[float, float, float, float]
        ] = {}  # sigma, q, cap, delta
        self.exhausted: set[str] = set()
        self.summaries: list[RoundSummary] = []
        self._broadcast: dict[str, Tensor] = {}
        self._sent_to: dict[int, int] = {}
        self.update_bound = update_bound
        self._nonce = ""
        self._connected: set[int] = set()
        self._norm_bound: float | None = None  # tangent mode: bound on the update's norm
        self._factor_bounds: dict[str, float] = {}  # factor-average: per-tensor bounds
        self.auto_clip = auto_clip

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
        """The connected nodes: once ``sites_per_round`` are, or ``min_sites`` after
        ``wait_for_nodes`` seconds; fewer than ``min_sites`` after ``connect_timeout`` stops the
        run with ``SitesUnavailableError`` (a coordinator must not wait forever)."""
        start = time.monotonic()
        while True:
            nodes = sorted(grid.get_node_ids())
            waited = time.monotonic() - start
            if len(nodes) >= self.sites_per_round or (
                len(nodes) >= self.min_sites and waited > self.wait_for_nodes
            ):
                return nodes
            if waited > self.connect_timeout:
                raise SitesUnavailableError(
                    f"{len(nodes)} of min-sites={self.min_sites} sites connected after "
                    f"{self.connect_timeout:g} s (connect-timeout): start more sites (SuperNodes) "
                    "or lower min-sites, then run again: applied rounds resume from the checkpoint."
                )
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
        self._connected = set(nodes)
        self._nonce = secrets.token_hex(16)  # a replayed reply of any earlier round lacks it
        config[SERVER_ROUND] = server_round
        config[ROUND_NONCE] = self._nonce
        self._set_bounds(server_round)
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

    def _set_bounds(self, server_round: int) -> None:
        """This round's norm bounds on an honest update (``prism_core.bounds``)."""
        self._norm_bound, self._factor_bounds = None, {}
        ub = self.update_bound
        if ub is None:
            return

        def horizon(beta1: float, beta2: float) -> int | None:
            # A site's optimizer step count can exceed server_round * tau (a state folder kept
            # across runs), so take the supremum over all t when it is finite (b1^2 < b2).
            return None if beta1**2 < beta2 else server_round * self.local_steps

        head_lr = ub.lr if ub.head_lr is None else ub.head_lr
        b1, b2 = ub.head_betas
        head_gain = adam_gain(beta1=b1, beta2=b2, max_step=horizon(b1, b2))
        head_size = sum(self._broadcast[HEAD_PREFIX + n].numel() for n in self.head)
        if ub.head_optimizer in SGD_HEADS:
            head_size = 0  # an SGD head's bound needs the reply's sigma and q (_head_sgd_bound)
        if self.mode == "tangent":
            if ub.optimizer == "sgd":
                return  # depends on the reply's sigma and q: computed per reply
            points = [
                Point(self._broadcast[key(m, "A")], self._broadcast[key(m, "B")])
                for m in self.modules
            ]
            gain = adam_gain(
                beta1=ub.beta1,
                beta2=ub.beta2,
                bias_correction=ub.bias_correction,
                max_step=horizon(ub.beta1, ub.beta2),
            )
            self._norm_bound = round_update_norm_bound(
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
            (rows, r), n = self._broadcast[key(m, "A")].shape, self._broadcast[key(m, "B")].shape[0]
            shapes.append((int(rows), int(n), int(r)))
        bounds = factor_update_norm_bounds(
            shapes, lr=ub.lr, local_steps=self.local_steps, gain=gain
        )
        for m, (bound_a, bound_b) in zip(self.modules, bounds, strict=True):
            self._factor_bounds[key(m, "A")], self._factor_bounds[key(m, "B")] = bound_a, bound_b
        for n in self.head if head_size else ():
            size = self._broadcast[HEAD_PREFIX + n].numel()
            self._factor_bounds[HEAD_PREFIX + n] = (
                head_lr * self.local_steps * head_gain * math.sqrt(size)
            )

    def _head_sgd_bound(self, facts: dict[str, Any]) -> float:
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
            max_norm=self._clip_of(facts),
            noise_multiplier=float(facts["sigma"]),
            expected_batch_size=ub.expected_batch_size,
            sample_rate=float(facts["q"]),
            dimension=sum(self._broadcast[HEAD_PREFIX + n].numel() for n in self.head),
            failure=ub.failure / self.local_steps,
        )
        head_lr = ub.lr if ub.head_lr is None else ub.head_lr
        velocity = 1.0 / (1.0 - HEAD_MOMENTUM) if ub.head_optimizer == "momentum" else 1.0
        return head_lr * self.local_steps * step * velocity

    def _clip_of(self, facts: dict[str, Any]) -> float:
        """The clip C to bound a reply's DP steps with: its ``max-norm`` fact, never above the
        update bound's ``max_norm`` (the run's C, or ``AutoClip.high`` for ``max-norm = auto``)."""
        ub = self.update_bound
        assert ub is not None
        return min(float(facts.get("max-norm", ub.max_norm)), ub.max_norm)

    def _sgd_bound(self, facts: dict[str, Any]) -> float:
        """Tangent-mode bound for plain DP-SGD sites, from the reply's sigma and q."""
        ub = self.update_bound
        assert ub is not None
        shapes = [
            (*self._broadcast[key(m, "A")].shape, self._broadcast[key(m, "B")].shape[0])
            for m in self.modules
        ]
        dim = tangent_dimension([(m, n, r) for m, r, n in shapes])
        dim += sum(self._broadcast[HEAD_PREFIX + n].numel() for n in self.head)
        step = dp_step_norm_bound(
            max_norm=self._clip_of(facts),
            noise_multiplier=float(facts["sigma"]),
            expected_batch_size=ub.expected_batch_size,
            sample_rate=float(facts["q"]),
            dimension=dim,
            failure=ub.failure / self.local_steps,
        )
        return round_update_norm_bound(
            [], lr=ub.lr, local_steps=self.local_steps, optimizer="sgd", dp_step=step
        )

    def _validate_update(self, update: Any, facts: dict[str, Any]) -> dict[str, Tensor]:
        """Keys, dtype, shapes, finite and sane values, and the mechanism's norm bound."""
        if not isinstance(update, ArrayRecord):
            raise ReplyError(f"update is a {type(update).__name__}, not an ArrayRecord", "keys")
        expected = self._expected_update_keys()
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
        self._check_norm(tensors, facts)
        return tensors

    def _check_norm(self, tensors: dict[str, Tensor], facts: dict[str, Any]) -> None:
        """Reject an update larger than an honest site's round can produce (float64 norms)."""
        if self.update_bound is None:
            return
        head_sgd = self._head_sgd_bound(facts)
        if self.mode == "factor-average":
            bounds = dict(self._factor_bounds)
            bounds.update({HEAD_PREFIX + n: head_sgd for n in self.head if head_sgd})
            for name, bound in bounds.items():
                moved = float((tensors[name].double() - self._broadcast[name].double()).norm())
                if moved > bound * (1 + FLOAT32_SLACK) + 1e-6:
                    raise ReplyError(
                        f"{name} moved by {moved:.4g}, more than the {bound:.4g} that "
                        f"{self.local_steps} AdamW steps at lr {self.update_bound.lr} allow",
                        "norm",
                    )
            return
        bound = self._norm_bound if self._norm_bound is not None else self._sgd_bound(facts)
        total = 0.0
        for m in self.modules:
            A, B = self._broadcast[key(m, "A")].double(), self._broadcast[key(m, "B")].double()
            dA, dB = tensors[key(m, "dA")].double(), tensors[key(m, "dB")].double()
            total += float(tangent_norm_sq(A, B, dA, dB).clamp_min(0.0))
        head_sq = sum(float(tensors[HEAD_PREFIX + n].double().square().sum()) for n in self.head)
        scale = math.sqrt(sum(float(v.double().square().sum()) for v in self._broadcast.values()))
        if head_sgd:  # an SGD head has its own bound; the modules keep theirs
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
        if not math.isfinite(norm) or norm > bound * (1 + FLOAT32_SLACK) + 1e-6 * scale:
            raise ReplyError(
                f"update norm {norm:.4g} exceeds the bound {bound:.4g} implied by the mechanism "
                f"({self.local_steps} steps at lr {self.update_bound.lr}, "
                f"{self.update_bound.optimizer} optimizer)",
                "norm",
            )

    # -- aggregation -----------------------------------------------------------------------

    def _cross_check(self, facts: dict[str, Any]) -> None:
        """The reply's facts against what the coordinator configured; raises ``ReplyError``.

        ``facts-mismatch``: steps other than the round's (0 for a refusal), another mechanism,
        sampling other than Poisson, adjacency other than add/remove, an ``rng`` not in
        ``client.protocol.RNG_MODES``, sigma 0 for a DP method, delta above the run's, or one
        of these facts missing. ``refusal-reason``: a refusal whose reason is not one of
        ``client.protocol.REFUSAL_REASONS`` (a malformed refusal). No site text is echoed.
        """
        refused = facts["status"] == STATUS_REFUSED
        if refused and facts.get("reason") not in REFUSAL_REASONS:
            raise ReplyError(
                "refused reply without a known reason code (client.protocol.REFUSAL_REASONS)",
                "refusal-reason",
            )
        wanted: dict[str, object] = {
            "mechanism": self.mechanism,
            "sampling": _SAMPLING,
            "adjacency": ADJACENCY,
        }
        for name, value in wanted.items():
            if facts.get(name) != value:
                raise ReplyError(f"fact {name} is not the run's {value!r}", "facts-mismatch")
        if facts.get(RNG) not in RNG_MODES:
            raise ReplyError(f"fact rng is not one of {list(RNG_MODES)}", "facts-mismatch")
        steps = 0 if refused else self.local_steps
        if int(facts["steps"]) != steps:
            raise ReplyError(
                f"reply ran {facts['steps']} steps, the round asked for {steps}", "facts-mismatch"
            )
        # A refusal spent nothing: a site that refused up front never calibrated (sigma 0).
        if self.dp and not refused and not float(facts["sigma"]) > 0:
            raise ReplyError("sigma = 0 for a differentially private method", "facts-mismatch")
        if self.dp and not refused:
            for name, value in (
                ("max-norm", self.max_norm),
                ("expected-batch-size", self.expected_batch_size),
            ):
                stated = facts.get(name)
                if stated is None or (
                    value is not None and not math.isclose(stated, value, rel_tol=_SCALE_RTOL)
                ):
                    raise ReplyError(
                        f"fact {name} is missing or not the run's {value!r}", "facts-mismatch"
                    )
        if not refused and ("delta" not in facts or float(facts["delta"]) > self.delta):
            raise ReplyError(
                f"delta {facts.get('delta')!r} is missing or above the run's {self.delta}",
                "facts-mismatch",
            )
        self._cross_check_clip(facts)

    def _cross_check_clip(self, facts: dict[str, Any]) -> None:
        """``max-norm = auto``: an ok reply's ``max-norm`` in ``AutoClip``'s range, and a clip
        estimate's facts only on an ok reply of such a run, with the run's K steps."""
        estimated = "quantile-steps" in facts
        auto = self.auto_clip
        if estimated and (auto is None or facts["status"] != STATUS_OK):
            raise ReplyError(
                "clip-estimate facts on a refusal or in a run without max-norm = auto",
                "facts-mismatch",
            )
        if auto is None or facts["status"] != STATUS_OK:
            return
        if estimated and int(facts["quantile-steps"]) != auto.steps:
            raise ReplyError(
                f"the clip estimate ran {facts['quantile-steps']} steps, the run asks {auto.steps}",
                "facts-mismatch",
            )
        clip = float(facts.get("max-norm", math.nan))
        low, high = auto.low * (1 - FLOAT32_SLACK), auto.high * (1 + FLOAT32_SLACK)
        if not low <= clip <= high:
            raise ReplyError(
                f"max-norm {facts.get('max-norm')!r} is missing or outside [{auto.low:.6g}, "
                f"{auto.high:.6g}], the clips a private estimate of this run can give",
                "facts-mismatch",
            )

    def _record(self, server_round: int, facts: dict[str, Any]) -> None:
        """Charge a reply's cross-checked facts to the ledger as CONFIRMED.

        Raises:
            ReplyError: ``facts`` if the ledger refuses the values, ``ledger-conflict`` if the
                site already has a different confirmed record of this round (the stored one is
                kept), ``ledger-error`` if the ledger cannot be written.
        """
        steps = int(facts["steps"])
        if steps <= 0:
            return
        cap = float(facts.get("epsilon-cap", self.target_epsilon))
        event = LedgerEvent(
            run_id=self.run_id,
            round=server_round,
            site_id=str(facts["site-id"]),
            mechanism=str(facts["mechanism"]),
            adjacency=str(facts["adjacency"]),
            sampling=str(facts["sampling"]),
            sigma=float(facts["sigma"]),
            q=float(facts["q"]),
            steps=steps,
            delta=float(facts["delta"]),
            epsilon_cap=cap if cap > 0 else None,
            rng=str(facts[RNG]),
        )
        events = [event]
        if "quantile-steps" in facts:  # a private clip estimate ran before the steps
            events.insert(
                0,
                replace(
                    event,
                    mechanism=QUANTILE_MECHANISM,
                    sigma=float(facts["quantile-sigma"]),
                    q=float(facts["quantile-q"]),
                    steps=int(facts["quantile-steps"]),
                ),
            )
        try:
            self.ledger.append_many(events)  # all of the round's charges, or none
        except InvalidEventError as exc:
            raise ReplyError(f"accounting facts refused by the ledger: {exc}", "facts") from exc
        except LedgerConflictError as exc:
            raise ReplyError(
                f"the ledger already holds a different record of this round ({exc})",
                "ledger-conflict",
            ) from exc
        except LedgerError as exc:
            log.error("round %d: ledger write failed: %s", server_round, exc)
            raise ReplyError(
                f"the ledger cannot record the charge ({exc})", "ledger-error"
            ) from exc

    @property
    def site_node(self) -> dict[str, int]:
        """The node each bound site answers from (the inverse of ``node_site``)."""
        return {site: node for node, site in self.node_site.items()}

    def _check_origin(self, server_round: int, node: int, facts: dict[str, Any]) -> str:
        """Round, nonce, node<->site binding and one reply per site; returns the site id.

        A reply failing here is NOT charged to the ledger: a stale or replayed reply's facts
        belong to (and were recorded in) another round, a reply from a node that was not asked
        carries no steps this round asked for, and facts claiming another node's site cannot be
        attributed. Sites keep their own durable ledger, which is the authority on their spend.
        """
        site = str(facts["site-id"])
        if self._sent_to.get(node) != server_round:
            raise ReplyError(f"node {node} was not asked in round {server_round}", "not-asked")
        claimed = facts.get(SERVER_ROUND)
        if claimed != server_round:
            raise ReplyError(
                f"reply is for round {claimed!r}, the current round is {server_round} "
                "(stale or replayed)",
                "stale-round",
            )
        if facts.get(ROUND_NONCE) != self._nonce:
            raise ReplyError("reply does not echo this round's nonce (replayed)", "replay")
        bound = self.node_site.get(node)
        if bound is not None and bound != site:
            raise ReplyError(f"node {node} is {bound!r} but claims to be {site!r}", "site-binding")
        owner = self.site_node.get(site)
        if owner is not None and owner != node and owner in self._connected:
            raise ReplyError(
                f"site {site!r} belongs to node {owner}, still connected; node {node} claims it",
                "site-binding",
            )
        if owner is not None and owner != node:
            log.warning("site %s moved from node %d to node %d", site, owner, node)
            self.node_site.pop(owner, None)
        self.node_site[node] = site
        return site

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, ledger and stream-aggregate the replies; apply if enough are valid.

        Per reply, in order: an error reply is rejected (shown by its code's fixed text, never
        its reason); the accounting facts are type- and range-checked (``validate_facts``); the
        reply must come from a node asked this round, carry this round's number and nonce,
        match the node's bound site id, and be the site's first reply this round
        (``_check_origin``); its facts must match what the coordinator configured
        (``_cross_check``: steps, mechanism, sampling, adjacency, rng, sigma, q, delta, a known
        refusal code, and with ``max-norm = auto`` the reported clip's range and the clip
        estimate's steps). Only then are they charged to the ledger as CONFIRMED (a private clip
        estimate as its own row, in the same transaction as the steps), so a reply
        whose UPDATE is bad (keys, dtype, shape, NaN/Inf, huge entries, a norm beyond the
        mechanism's bound) is still charged: the site spent that budget. A ledger conflict (a
        different confirmed record of the same round) rejects the reply, never the round.
        Refusals charge nothing and end the site's selection.

        Then every node asked this round that gave no valid answer (no reply, an error reply, or
        only rejected ones before its facts were confirmed) is charged the round's steps as
        UNCONFIRMED (``_charge_unconfirmed``): it may have charged itself before failing.
        """
        summary = self.summaries[-1]
        sums: dict[str, Tensor] = {}
        total_weight = 0.0
        self._noise = []
        seen: set[str] = set()
        answered: set[int] = set()  # asked nodes whose facts were confirmed or that refused
        pending: dict[int, tuple[str, int]] = {}  # asked node -> (code, steps) of a rejection
        replied: set[int] = set()
        for msg in replies:
            node = msg.metadata.src_node_id
            replied.add(node)
            who = self.node_site.get(node, f"node-{node}")
            steps = self.local_steps  # what an unconfirmed charge of this node counts
            try:
                if msg.has_error():
                    raise _error_reply(msg)
                facts = self._facts_of(msg)
                site = self._check_origin(server_round, node, facts)
                who = site
                if site in seen:
                    raise ReplyError(
                        f"second reply of {site!r} in round {server_round}", "duplicate"
                    )
                seen.add(site)
                steps = max(steps, int(facts["steps"]))  # a site claiming more is charged more
                self._cross_check(facts)
                self._record(server_round, facts)
                answered.add(node)
                sigma, q = float(facts["sigma"]), float(facts["q"])
                cap = float(facts.get("epsilon-cap", self.target_epsilon))
                if sigma > 0 or not self.dp:  # an up-front refusal has no mechanism to keep
                    self.site_mechanism[site] = (sigma, q, cap, float(facts["delta"]))
                if facts["status"] == STATUS_REFUSED:
                    self._refused(server_round, site, str(facts["reason"]), summary)
                    continue
                update = self._validate_update(msg.content.get(UPDATE), facts)
                weight = self._weight(facts)
            except (ReplyError, KeyError, TypeError, ValueError) as exc:
                error = exc if isinstance(exc, ReplyError) else ReplyError(repr(exc), "invalid")
                summary.reject(who, error)
                log.warning("round %d: rejected reply from %s: %s", server_round, who, error)
                if error.code == "ledger-conflict":
                    answered.add(node)  # the round's confirmed record is in the ledger already
                elif self._sent_to.get(node) == server_round and node not in answered:
                    code, before = pending.get(node, (_unconfirmed_code(error, msg), 0))
                    pending[node] = (code, max(before, steps))
                continue
            for name, tensor in update.items():
                value = weight * tensor.double()
                sums[name] = sums[name] + value if name in sums else value
            total_weight += weight
            self._noise.append((weight, self._noise_std(facts)))
            summary.accepted.append(site)
        self._charge_unanswered(server_round, answered, pending, replied, summary)
        if len(summary.accepted) < self.min_sites or total_weight <= 0:
            log.warning(
                "round %d: %d valid updates < min-sites=%d; global adapter unchanged",
                server_round,
                len(summary.accepted),
                self.min_sites,
            )
            return None, self._metrics(summary)
        means = {k: (v / total_weight).float() for k, v in sums.items()}
        new = self._apply_checked(means, summary)
        if new is None:
            return None, self._metrics(summary)
        summary.applied = True
        return ArrayRecord(new), self._metrics(summary)

    def _refused(self, server_round: int, site: str, code: str, summary: RoundSummary) -> None:
        """A valid refusal (its code checked by ``_cross_check``): no charge, no more rounds."""
        summary.refused.append(site)
        summary.refusal_codes[site] = code
        self.exhausted.add(site)
        log.info(
            "site %s refused round %d: %s (%s)", site, server_round, code, REFUSAL_REASONS[code]
        )

    def _charge_unanswered(
        self,
        server_round: int,
        answered: set[int],
        pending: dict[int, tuple[str, int]],
        replied: set[int],
        summary: RoundSummary,
    ) -> None:
        """Charge every node asked this round without a valid answer as UNCONFIRMED."""
        for node in sorted(n for n, r in self._sent_to.items() if r == server_round):
            if node in answered:
                continue
            who = self.node_site.get(node, f"node-{node}")
            if node not in replied:
                error = ReplyError("no reply before the round timeout", "no-reply")
                summary.reject(who, error)
                log.warning(
                    "round %d: no reply from %s before the timeout; the round goes on without it",
                    server_round,
                    who,
                )
            code, steps = pending.get(node, ("no-reply", self.local_steps))
            self._charge_unconfirmed(server_round, who, code, steps, summary)

    def _charge_unconfirmed(
        self, server_round: int, site: str, code: str, steps: int, summary: RoundSummary
    ) -> None:
        """Record ``steps`` unconfirmed steps of ``site`` in this round (see the module doc).

        At the site's last confirmed parameters (sigma, q, delta, cap, mechanism, rng); a site
        with none (never seen, or a node never bound to a site: ``node-<id>``) is recorded with
        unknown parameters, accounted as sigma 0 (epsilon inf, the worst case); with
        ``max-norm = auto`` and no confirmed clip estimate of the site in this run, plus an
        unconfirmed estimate (``_unconfirmed_estimate``). Idempotent: the ledger keeps one
        unconfirmed charge per (run, round, site, mechanism) and none once confirmed
        (a re-run round whose charge is already confirmed adds nothing, and is not listed in
        ``summary.unconfirmed``).
        """
        if any(
            e.round == server_round and e.confirmed
            for e in self.ledger.events(site_id=site, run_id=self.run_id)
        ):
            log.info(
                "round %d: %s gave no valid answer this time (%s), but the ledger already holds "
                "its confirmed charge of this round (a re-run round): nothing to add",
                server_round,
                site,
                code,
            )
            return
        last = self.ledger.last_confirmed(site)
        if last is None:
            event = LedgerEvent(
                run_id=self.run_id,
                round=server_round,
                site_id=site,
                sigma=UNKNOWN_SIGMA,
                q=UNKNOWN_Q,
                steps=steps,
                delta=self.delta,
                mechanism=self.mechanism,
                confirmed=False,
                params_known=False,
                code=code,
            )
        else:
            event = LedgerEvent(
                run_id=self.run_id,
                round=server_round,
                site_id=site,
                sigma=last.sigma,
                q=last.q,
                steps=steps,
                delta=last.delta,
                epsilon_cap=last.epsilon_cap,
                mechanism=last.mechanism,
                adjacency=last.adjacency,
                sampling=last.sampling,
                rng=last.rng,
                confirmed=False,
                code=code,
            )
        summary.unconfirmed.append(site)
        try:
            self.ledger.append_many([*self._unconfirmed_estimate(site, last, event), event])
        except LedgerError as exc:
            log.error(
                "round %d: the unconfirmed charge of %s could NOT be recorded: %s",
                server_round,
                site,
                exc,
            )
            return
        log.warning(
            "round %d: %s charged %d steps as UNCONFIRMED (%s), %s",
            server_round,
            site,
            steps,
            code,
            "parameters unknown: epsilon unknown (worst case)"
            if last is None
            else f"at its last confirmed sigma={last.sigma}, q={last.q}",
        )

    def _unconfirmed_estimate(
        self, site: str, last: LedgerEvent | None, event: LedgerEvent
    ) -> list[LedgerEvent]:
        """With ``max-norm = auto``, a site without a confirmed clip estimate in this run may
        have estimated (and charged) one before failing: an unconfirmed estimate row too, at
        the run's K and sigma_b and the site's last confirmed q (none for unknown parameters:
        the training row is already accounted as epsilon inf)."""
        auto = self.auto_clip
        if auto is None or last is None:
            return []
        estimated = any(
            e.mechanism == QUANTILE_MECHANISM and e.confirmed
            for e in self.ledger.events(site_id=site, run_id=self.run_id)
        )
        if estimated:
            return []
        return [
            replace(
                event,
                mechanism=QUANTILE_MECHANISM,
                sigma=auto.noise_multiplier,
                steps=auto.steps,
            )
        ]

    def _facts_of(self, msg: Message) -> dict[str, Any]:
        record = msg.content.get(ACCOUNTING)
        if not isinstance(record, ConfigRecord):
            raise ReplyError("reply has no accounting facts record", "facts")
        return validate_facts(dict(record))

    def _noise_std(self, facts: dict[str, Any]) -> float:
        """``sigma C / b`` of a reply from its CHECKED facts (0 for a non-private run)."""
        if not self.dp:
            return 0.0
        return site_noise_std(
            noise_multiplier=float(facts["sigma"]),
            max_norm=float(facts["max-norm"]),
            expected_batch_size=float(facts["expected-batch-size"]),
        )

    def _weight(self, facts: dict[str, Any]) -> float:
        """The reply's un-normalised weight (the streamed sum is divided by their total).

        ``inverse-noise``: ``(b / (sigma C))^2`` from the reply's facts, which ``_cross_check``
        has matched against the run's C and b (post-processing of public parameters; exact in
        the tangent space at the broadcast point); ``uniform``: 1; ``examples``: N_k (FedAvg;
        needs sites that share their shard size). See ``prism_core.aggregation``.
        """
        if self.aggregation == "uniform":
            return 1.0
        if self.aggregation == "examples":
            if "num-examples" not in facts:
                raise ReplyError("aggregation=examples but the reply has no num-examples", "facts")
            return float(facts["num-examples"])
        std = self._noise_std(facts)
        return 1.0 if std == 0 else 1.0 / (std * std)

    def _apply_checked(
        self, means: dict[str, Tensor], summary: RoundSummary
    ) -> dict[str, Tensor] | None:
        """``_apply``, guarded: a non-finite mean or result, or lost rank, keeps the old adapter."""
        reason = ""
        saved = copy.deepcopy(self.optimizer)  # a discarded step must not move its moments
        if not all(torch.isfinite(v).all() for v in means.values()):
            reason = "the aggregated update is not finite"
        else:
            t = summary.server_round
            lr = scheduled_lr(self.server_lr, self.lr_schedule, t, self.num_rounds)
            new = self._apply(means, lr)
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
            self.optimizer = saved
            summary.discarded = reason
            log.error("round %d: %s; global adapter unchanged", summary.server_round, reason)
            return None
        return new

    def _aggregate_noise_std(self) -> float:
        """Per-coordinate noise std of this round's weighted mean, in the update's units.

        ``sqrt(sum_k w_k^2 s_k^2) / sum_k w_k`` with ``s_k = sigma_k C_k / b_k`` is the noise of
        the mean of one DP step per site; a site's update is ``tau`` local steps of size ``lr``,
        so it is scaled by ``lr sqrt(tau)`` (exact for plain SGD steps, the scale of the noise
        for the adaptive ones). Sets the adaptive server optimizer's DP-aware floors (eq. 26).
        """
        if not self._noise:
            return 0.0
        total = math.fsum(w for w, _ in self._noise)
        weights = [w / total for w, _ in self._noise]
        std = aggregate_noise_std(weights, [s for _, s in self._noise])
        return self.local_lr * math.sqrt(self.local_steps) * std

    def _apply(self, means: dict[str, Tensor], lr: float) -> dict[str, Tensor]:
        """The next global arrays from this round's means, with server lr ``lr``."""
        if self.mode == "tangent":
            return self._apply_tangent(means, lr)
        new: dict[str, Tensor] = {}
        for module in self.modules:  # factor-average: FedAvg step of A and B
            A, B = self._broadcast[key(module, "A")], self._broadcast[key(module, "B")]
            A_new = A + lr * (means[key(module, "A")] - A)
            B_new = B + lr * (means[key(module, "B")] - B)
            new[key(module, "A")] = A_new.to(torch.float32).contiguous()
            new[key(module, "B")] = B_new.to(torch.float32).contiguous()
        for name in self.head:
            value = self._broadcast[HEAD_PREFIX + name]
            delta = means[HEAD_PREFIX + name] - value
            new[HEAD_PREFIX + name] = (value + lr * delta).contiguous()
        return new

    def _apply_tangent(self, means: dict[str, Tensor], lr: float) -> dict[str, Tensor]:
        """The server optimizer's step (``server.optimizer``) from the aggregated tangent update."""
        points = {
            m: Point(self._broadcast[key(m, "A")], self._broadcast[key(m, "B")])
            for m in self.modules
        }
        updates = {m: Tangent(means[key(m, "dA")], means[key(m, "dB")]) for m in self.modules}
        values = {n: self._broadcast[HEAD_PREFIX + n] for n in self.head}
        deltas = {n: means[HEAD_PREFIX + n] for n in self.head}
        moved, head = self.optimizer.step(
            points, updates, values, deltas, noise_std=self._aggregate_noise_std(), lr=lr
        )
        new: dict[str, Tensor] = {}
        for m in self.modules:
            new[key(m, "A")] = moved[m].A.to(torch.float32).contiguous()
            new[key(m, "B")] = moved[m].B.to(torch.float32).contiguous()
        for n in self.head:
            new[HEAD_PREFIX + n] = head[n].to(torch.float32).contiguous()
        return new

    @staticmethod
    def _metrics(summary: RoundSummary) -> MetricRecord:
        return MetricRecord(
            {
                "sites-sent": summary.sent,
                "sites-accepted": len(summary.accepted),
                "sites-refused": len(summary.refused),
                "replies-rejected": len(summary.rejected),
                "sites-unconfirmed": len(summary.unconfirmed),
                "applied": int(summary.applied),
                **{f"rejected-{code}": n for code, n in sorted(summary.rejected_by_reason.items())},
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
                rejected_by_reason={
                    str(k): int(v) for k, v in x.get("rejected_by_reason", {}).items()
                },
                discarded=str(x.get("discarded", "")),
                refusal_codes={str(k): str(v) for k, v in x.get("refusal_codes", {}).items()},
                unconfirmed=[str(w) for w in x.get("unconfirmed", [])],
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
            "server-lr=%s %s)",
            self.mode,
            len(self.modules),
            len(self.head),
            self.sites_per_round,
            self.min_sites,
            self.server_lr,
            self.lr_schedule,
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


def _pausing(replies: list[Message], server_round: int) -> Iterable[Message]:
    """Yield the replies; the ``mid-aggregation`` test pause point sits after the first."""
    for index, msg in enumerate(replies):
        if index == 1:
            pause_point("mid-aggregation", server_round)
        yield msg
