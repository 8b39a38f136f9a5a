"""A site's local training settings (``TrainConfig``), with the one set of defaults.

``TrainConfig`` is what a site's trainer runs; its defaults are the run config's
(``prism_runtime.config.DEFAULT_*``), so ``prism-train``, a federated site and the coordinator's
bound on an honest update agree without mapping anything by hand: a site derives its
``TrainConfig`` from the run config with ``site_train_config``, and the coordinator derives the
same object from the same run config to bound the sites' updates (``server.strategy.bounds.
UpdateBound.for_sites``), optimizer constants (PRISM's adaptive betas, AdamW's betas) included.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prism_core.adaptive import AdaptiveConfig
from prism_runtime.config import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DELTA,
    DEFAULT_HEAD_LR,
    DEFAULT_HEAD_MAX_NORM,
    DEFAULT_HEAD_OPTIMIZER,
    DEFAULT_LR,
    DEFAULT_MAX_NORM,
    DEFAULT_MAX_RECORDS_PER_USER,
    DEFAULT_MICRO_BATCH_SIZE,
    RunConfig,
)

__all__ = [
    "ADAMW_BETAS",
    "DEFAULT_HEAD_SHARE",
    "DEFAULT_MAX_RECORDS_PER_USER",
    "MECHANISMS",
    "METHODS",
    "PRIVACY_UNITS",
    "AdaptiveSettings",
    "Method",
    "PrivacyUnit",
    "TrainConfig",
    "site_train_config",
]

Method = Literal["prism", "dp-adamw", "ffa", "nondp"]
METHODS: tuple[str, ...] = ("prism", "dp-adamw", "ffa", "nondp")
MECHANISMS: dict[str, str] = {
    "prism": "prism-tangent-gaussian",
    "dp-adamw": "factor-gaussian",
    "ffa": "ffa-gaussian",
    "nondp": "none",
}
"""The ``PrivacyEvent.mechanism`` each training method runs."""

PrivacyUnit = Literal["record", "user"]
PRIVACY_UNITS: tuple[str, ...] = ("record", "user")

ADAMW_BETAS: tuple[float, float] = (0.9, 0.999)
"""The betas of every AdamW a site runs (an AdamW head, the factor-space baselines); the
coordinator's update bound reads them from here."""

DEFAULT_HEAD_SHARE = DEFAULT_HEAD_MAX_NORM / DEFAULT_MAX_NORM
"""A ``TrainConfig`` that sets no ``head_max_norm`` gives the head this fraction of its clip
(at the default clip: the run config's default ``head-max-norm``)."""


class AdaptiveSettings(BaseModel):
    """PRISM's adaptive transform (``prism_core.adaptive.AdaptiveConfig``), reference defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    floor_scale: float = Field(0.5, ge=0)
    cond_max: float = Field(1e4, ge=1)
    relift_direction: bool = True

    def to_config(self) -> AdaptiveConfig:
        return AdaptiveConfig(**self.model_dump())


class TrainConfig(BaseModel):
    """Local training and privacy settings of one site (defaults: the run config's)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    method: Method = Field("prism", description="prism, dp-adamw, ffa or nondp")
    epsilon: float | None = Field(None, gt=0, description="target epsilon (cap); calibrates sigma")
    delta: float = Field(
        DEFAULT_DELTA, gt=0, lt=1, description="delta of the (epsilon, delta) guarantee"
    )
    noise_multiplier: float | None = Field(None, ge=0, description="sigma; else calibrated")
    steps: int = Field(100, ge=1, description="planned logical steps")
    batch_size: int = Field(
        DEFAULT_BATCH_SIZE,
        ge=1,
        description="EXPECTED (Poisson) batch size b = q N, in privacy units: records, or "
        "people under privacy_unit='user'",
    )
    sample_rate: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Poisson rate q, one public rate for every site of a secure-aggregation run "
        "(expected batch q N; batch_size is then not used); None: q = batch_size / N",
    )
    micro_batch_size: int = Field(
        DEFAULT_MICRO_BATCH_SIZE,
        ge=0,
        description="examples per forward/backward (memory only); 0: the largest that fits the "
        "memory available (prism_runtime.memory.auto_micro_batch), logged",
    )
    grad_sample_mode: Literal["layer", "hooks"] = Field(
        "layer",
        description="how per-example gradients are computed: 'layer' (inside each trainable "
        "linear layer's backward, prism_runtime.per_example) or 'hooks' (Opacus' "
        "GradSampleModule); both exact, 'layer' at about the cost of a non-DP backward",
    )
    max_norm: float = Field(
        DEFAULT_MAX_NORM, gt=0, description="total clip C (the sensitivity): LoRA and head"
    )
    lr: float = Field(DEFAULT_LR, gt=0, description="learning rate (retraction step for prism)")
    head_lr: float | None = Field(
        DEFAULT_HEAD_LR, gt=0, description="classifier head lr (None: lr)"
    )
    head_optimizer: Literal["adamw", "sgd", "momentum"] = Field(
        DEFAULT_HEAD_OPTIMIZER,
        description="DP head optimizer: plain sgd on the DP gradient, momentum (heavy-ball SGD, "
        "beta prism_runtime.config.HEAD_MOMENTUM) or adamw",
    )
    head_max_norm: float | None = Field(
        None,
        gt=0,
        description="the head's share C_head < max_norm of the clip (LoRA gets "
        "sqrt(C^2 - C_head^2)); not given: DEFAULT_HEAD_SHARE x max_norm; None = one joint "
        "clip of LoRA and head at max_norm",
    )
    privacy_unit: PrivacyUnit = Field(
        "record",
        description="the unit of the guarantee: 'record' (each row; Poisson sampling of rows) "
        "or 'user' (each person: people Poisson-sampled at q = batch_size / N_users, at most "
        "max_records_per_user records each, one clip of C per person; needs every row's person)",
    )
    max_records_per_user: int = Field(
        DEFAULT_MAX_RECORDS_PER_USER,
        ge=1,
        description="privacy_unit='user': the most records of one person in a batch (a random "
        "chunk of a person with more, drawn afresh at each step)",
    )
    group_size: int | None = Field(
        None,
        ge=1,
        description="privacy_unit='user' after record-level events in the history: the most "
        "records of one person, by which those events count per person (group privacy, "
        "prism_core.accounting.epsilon)",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (baselines, head)")
    adaptive: AdaptiveSettings = AdaptiveSettings()
    seed: int | None = Field(
        None,
        description="None: sampling, dropout and noise from the OS (private); an int: "
        "reproducible (tests, benchmarks; predictable to anyone who knows it)",
    )
    progress: bool = Field(True, description="tqdm progress bar on stderr")

    @property
    def head_learning_rate(self) -> float:
        """The head's lr: ``head_lr``, or ``lr`` when it is None (as the run config's -1)."""
        return self.head_lr or self.lr

    @model_validator(mode="before")
    @classmethod
    def _default_head_share(cls, data: Any) -> Any:
        """Not given: the head gets ``DEFAULT_HEAD_SHARE`` of whatever clip is set."""
        if isinstance(data, dict) and "head_max_norm" not in data:
            max_norm = data.get("max_norm", DEFAULT_MAX_NORM)
            if isinstance(max_norm, int | float) and not isinstance(max_norm, bool):
                data = {**data, "head_max_norm": DEFAULT_HEAD_SHARE * float(max_norm)}
        return data

    @model_validator(mode="after")
    def _head_share(self) -> TrainConfig:
        if self.head_max_norm is not None and self.head_max_norm >= self.max_norm:
            raise ValueError(
                f"head_max_norm={self.head_max_norm} must be < max_norm={self.max_norm}: "
                "max_norm is the total clip C (the sensitivity) and the head gets a share of it"
            )
        return self

    @model_validator(mode="after")
    def _privacy_given(self) -> TrainConfig:
        if self.method != "nondp" and self.epsilon is None and self.noise_multiplier is None:
            raise ValueError(
                f"method={self.method!r} needs epsilon (a target to calibrate sigma) or "
                "noise_multiplier"
            )
        return self


def site_train_config(
    run: RunConfig,
    *,
    method: str,
    max_norm: float,
    epsilon: float | None = None,
    delta: float | None = None,
    noise_multiplier: float | None = None,
    privacy_unit: str = "record",
    group_size: int | None = None,
    max_records_per_user: int | None = None,
) -> TrainConfig:
    """The ``TrainConfig`` a site runs for ``run``: the run's steps, batch, lr and head settings;
    the site's own privacy facts (its epsilon cap and delta for this run, its sigma) and its
    clip (``max_norm``: the run's, or the site's private estimate with ``max-norm = auto``), its
    privacy unit (the site's policy, never the run's alone), its ``max_records_per_user`` (the
    site's bound on the run's, ``client.policy.SitePolicy.records_per_user``; None: the run's)
    and, at the person level after record-level events, its ``group_size``.
    The coordinator calls it with the run's own values to know what honest sites run."""
    return TrainConfig(
        method=cast(Method, method),  # validated here: TrainConfig refuses any other name
        epsilon=epsilon if method != "nondp" else None,
        delta=run.delta if delta is None else delta,
        noise_multiplier=noise_multiplier if method != "nondp" else None,
        steps=run.local_steps,
        batch_size=run.batch_size,
        sample_rate=run.sample_rate or None,
        micro_batch_size=run.micro_batch_size,
        max_norm=max_norm,
        lr=run.lr,
        head_lr=run.head_learning_rate,
        head_optimizer=run.head_optimizer,
        head_max_norm=run.head_clip,
        privacy_unit=cast(PrivacyUnit, privacy_unit),  # validated by TrainConfig
        max_records_per_user=(
            run.max_records_per_user if max_records_per_user is None else max_records_per_user
        ),
        group_size=group_size,
        progress=False,
    )
