"""``prism-train``: private LoRA fine-tuning of one model on one site's data, from the shell.

Example (MiniLM on SST-2, PRISM at epsilon 3)::

    prism-train --model PATH --data train.jsonl --eval-data dev.jsonl --task seq-cls \\
        --method prism --epsilon 3 --delta 1e-5 --steps 60 --batch-size 256 --max-norm 0.1 \\
        --out runs/sst2-prism

Settings come from ``--config FILE`` (a flat YAML or TOML mapping whose keys are the option names,
kebab-case or snake_case) and from the command line, which wins. Everything is validated by the
pydantic models ``prism_runtime.model.ModelConfig`` and ``prism_runtime.trainer.TrainConfig`` (plus
``RunOptions`` here) before any data or model is loaded.

Writes ``<out>/adapter`` (peft format, loads on the original base with
``PeftModel.from_pretrained``) and ``<out>/metrics.json``: privacy parameters and spent epsilon,
held-out metrics. No training loss or accuracy is written: they are computed from un-noised
private data. Exit codes: 0 success, 1 data error, 2 configuration error.

Randomness: Poisson sampling, dropout and noise come from the OS CSPRNG by default. ``--seed``
alone seeds only public choices (the head and orthonormal initialisation); it seeds sampling,
dropout and noise too only with ``--reproducible``, which is for tests and benchmarks: anyone
who knows the seed can predict the noise. ``metrics.json`` records which (``rng``).

Classes (seq-cls): ``--num-labels``, else one per ``--label-texts``, else the training labels'
classes 0..K-1 (``prism_runtime.data.labels``); a label outside them is a data error naming its
rows, never its value. ``--label-texts auto`` and ``--head-init auto`` follow the data as the
run config's keys do (``prism_runtime.data.settings``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from client.policy import delta_below_one_over_n
from prism_runtime.config import (
    AUTO,
    DEFAULT_BATCH_SIZE,
    DEFAULT_DELTA,
    DEFAULT_HEAD_LR,
    DEFAULT_HEAD_OPTIMIZER,
    DEFAULT_LORA_ALPHA,
    DEFAULT_LORA_RANK,
    DEFAULT_LORA_TARGETS,
    DEFAULT_LR,
    DEFAULT_MAX_LENGTH,
    DEFAULT_MAX_NORM,
    HEAD_MOMENTUM,
    check_label_texts,
    describe_allowed,
)
from prism_runtime.errors import ConfigError, DataError
from prism_runtime.train_config import DEFAULT_HEAD_SHARE

if TYPE_CHECKING:
    from prism_runtime.data import ExampleFile

__all__ = ["EXIT_CONFIG_ERROR", "EXIT_DATA_ERROR", "EXIT_OK", "RunOptions", "build_parser", "main"]

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_DATA_ERROR = 1
EXIT_CONFIG_ERROR = 2

PROG = "prism-train"
DEFAULT_INIT = {"prism": "spectral-residual"}  # the baselines start from peft's standard init
BASELINE_INIT = "standard"
JOINT_CLIP = -1
"""``--head-max-norm -1``: one joint clip of LoRA and head (the run config's convention)."""
FOLLOW_DATA = ("label_texts", "head_init")
"""Options that may be ``auto``: resolved from the data once it is read (``_classifier_config``)."""

# Option (snake_case, as in the config file) -> field of ModelConfig / TrainConfig.
MODEL_FIELDS = {
    "model": "model",
    "task": "task",
    "num_labels": "num_labels",
    "rank": "rank",
    "alpha": "alpha",
    "target_modules": "target_modules",
    "init": "init",
    "head": "head",
    "pooling": "pooling",
    "pair_encoding": "pair_encoding",
    "head_init": "head_init",
    "label_texts": "label_texts",
    "seed": "seed",
}
TRAIN_FIELDS = {
    "method": "method",
    "epsilon": "epsilon",
    "delta": "delta",
    "noise_multiplier": "noise_multiplier",
    "steps": "steps",
    "batch_size": "batch_size",
    "micro_batch_size": "micro_batch_size",
    "grad_sample_mode": "grad_sample_mode",
    "max_norm": "max_norm",
    "lr": "lr",
    "head_lr": "head_lr",
    "head_optimizer": "head_optimizer",
    "head_max_norm": "head_max_norm",
    "privacy_unit": "privacy_unit",
    "max_records_per_user": "max_records_per_user",
    "no_progress": "progress",  # negated below
}


class RunOptions(BaseModel):
    """Settings of one ``prism-train`` run that are not model or training settings."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    data: Path = Field(description="training data of this site (.jsonl, .csv, save_to_disk)")
    eval_data: Path | None = Field(None, description="held-out evaluation data")
    max_length: int | None = Field(
        None,
        ge=2,
        description=f"tokens per example (default: {DEFAULT_MAX_LENGTH}, capped by the model)",
    )
    train_limit: int | None = Field(None, ge=1, description="use only the first N training rows")
    eval_limit: int | None = Field(None, ge=1, description="use only the first N evaluation rows")
    out: Path | None = Field(None, description="output folder (default runs/<method>-<time>)")
    user_field: str | None = Field(
        None,
        min_length=1,
        description="the data field naming each row's person (needed with --privacy-unit user; "
        "at record level it adds epsilon per person by group privacy)",
    )


RUN_FIELDS = {name: name for name in RunOptions.model_fields}


# --------------------------------------------------------------------------------------------
# Command line and config file
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every option defaults to "not given" so the config file can fill it."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Differentially private LoRA fine-tuning (PRISM and baselines) on one site.",
        argument_default=argparse.SUPPRESS,
        epilog="Exit codes: 0 success, 1 data error, 2 configuration error.",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="flat YAML (.yaml/.yml) or TOML (.toml) mapping of options"
    )
    io = parser.add_argument_group("data and model")
    io.add_argument("--model", help="local model folder or a model in the local HF cache")
    io.add_argument("--data", metavar="FILE", help="training data (.jsonl, .csv, save_to_disk)")
    io.add_argument("--eval-data", metavar="FILE", help="held-out evaluation data")
    io.add_argument("--task", choices=["seq-cls", "causal-lm"], help="default seq-cls")
    io.add_argument(
        "--num-labels",
        type=int,
        help="classes (seq-cls; default: one per --label-texts, else the training labels' "
        "classes 0..K-1, where a label above a gap is refused)",
    )
    io.add_argument(
        "--max-length", type=int, help=f"tokens per example (default {DEFAULT_MAX_LENGTH})"
    )
    io.add_argument("--train-limit", type=int, metavar="N", help="use the first N training rows")
    io.add_argument("--eval-limit", type=int, metavar="N", help="use the first N evaluation rows")
    io.add_argument("--out", metavar="DIR", help="output folder (default runs/<method>-<time>)")
    dp = parser.add_argument_group("privacy")
    dp.add_argument("--method", choices=["prism", "dp-adamw", "ffa", "nondp"], help="default prism")
    dp.add_argument("--epsilon", type=float, help="target epsilon; calibrates sigma")
    dp.add_argument(
        "--delta", type=float, help=f"delta (default {DEFAULT_DELTA:g}; keep it << 1/N)"
    )
    dp.add_argument("--noise-multiplier", type=float, help="sigma (instead of calibrating it)")
    dp.add_argument(
        "--max-norm",
        type=float,
        help=f"total clip C, LoRA and head together (default {DEFAULT_MAX_NORM})",
    )
    dp.add_argument(
        "--privacy-unit",
        choices=["record", "user"],
        help="unit of the guarantee: record (default) or user (each person with all their "
        "records: people are sampled, --batch-size counts people; needs --user-field)",
    )
    dp.add_argument(
        "--user-field",
        metavar="FIELD",
        help="the field of each row naming its person (e.g. patient_id); with --privacy-unit "
        "record the report adds epsilon per person by group privacy",
    )
    dp.add_argument(
        "--max-records-per-user",
        type=int,
        metavar="K",
        help="--privacy-unit user: the most records of a sampled person per step (default 4)",
    )
    dp.add_argument(
        "--reproducible",
        action="store_true",
        help="seed sampling, dropout and noise from --seed (tests, benchmarks ONLY: anyone who "
        "knows the seed can predict the noise). Default: all three from the OS CSPRNG",
    )
    opt = parser.add_argument_group("optimisation")
    opt.add_argument("--steps", type=int, help="logical steps (default 100)")
    opt.add_argument(
        "--batch-size",
        type=int,
        help=f"EXPECTED Poisson batch size (default {DEFAULT_BATCH_SIZE})",
    )
    opt.add_argument(
        "--micro-batch-size",
        type=int,
        help="examples per forward/backward, memory only (default: the largest that fits the "
        "memory available, at most 64 on a CPU; the run logs its choice)",
    )
    opt.add_argument(
        "--grad-sample-mode",
        choices=["layer", "hooks"],
        help="per-example gradients: in each trainable layer's backward (default layer) or by "
        "Opacus' hooks; both exact",
    )
    opt.add_argument("--lr", type=float, help=f"learning rate (default {DEFAULT_LR})")
    opt.add_argument(
        "--head-lr", type=float, help=f"seq-cls head learning rate (default {DEFAULT_HEAD_LR})"
    )
    opt.add_argument(
        "--seed",
        type=int,
        help="seed of the public initialisation (default 0); of sampling, dropout and noise "
        "only with --reproducible",
    )
    opt.add_argument("--no-progress", action="store_true", help="no progress bar")
    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--rank", type=int, help=f"LoRA rank r (default {DEFAULT_LORA_RANK})")
    lora.add_argument(
        "--alpha",
        type=float,
        help=f"LoRA alpha, scaling alpha / r (default {DEFAULT_LORA_ALPHA:g})",
    )
    lora.add_argument(
        "--target-modules",
        help=f"comma list of module names (default {','.join(DEFAULT_LORA_TARGETS)})",
    )
    lora.add_argument(
        "--init",
        choices=["spectral-residual", "orthonormal", "standard"],
        help="default spectral-residual for prism, standard for the baselines",
    )
    lora.add_argument(
        "--head",
        choices=["train", "frozen"],
        help="seq-cls head: trained inside the DP mechanism (default) or frozen at its seeded init",
    )
    cls = parser.add_argument_group("classifier (seq-cls)")
    cls.add_argument(
        "--pooling",
        choices=["auto", "mean", "cls", "max", "last", "pooler"],
        help="sentence vector (default auto: the model's own sentence-transformers pooling)",
    )
    cls.add_argument(
        "--pair-encoding",
        choices=["auto", "siamese", "joint"],
        help="text pairs: each text alone or one joint sequence (default auto: siamese for "
        "sentence-transformers models)",
    )
    cls.add_argument(
        "--head-init",
        choices=[AUTO, "random", "zero-shot"],
        help="head start: seeded random (default), zero-shot from --label-texts, or auto: "
        "zero-shot where a public start exists (as the run config's head-init)",
    )
    cls.add_argument(
        "--label-texts",
        metavar="'A|B|...'",
        help="PUBLIC description of each class in label order, '|'-separated (zero-shot); "
        "never derived from private data; auto: as the run config's label-texts (the "
        "sentiment texts for two-class single texts, else none)",
    )
    cls.add_argument(
        "--head-max-norm",
        type=float,
        help="the head's share of the clip C (< --max-norm; LoRA gets sqrt(C^2 - share^2)); "
        f"default {DEFAULT_HEAD_SHARE:g} x --max-norm; -1: one joint clip",
    )
    cls.add_argument(
        "--head-optimizer",
        choices=["adamw", "sgd", "momentum"],
        help=f"DP head optimizer (default {DEFAULT_HEAD_OPTIMIZER}; momentum = heavy-ball SGD, "
        f"beta {HEAD_MOMENTUM})",
    )
    return parser


def _option_names(parser: argparse.ArgumentParser) -> list[str]:
    """snake_case names of the options a config file may set (all but --config and --help)."""
    return sorted(
        a.dest for a in parser._actions if a.option_strings and a.dest not in ("config", "help")
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def read_config_file(path: Path, valid: Sequence[str]) -> dict[str, Any]:
    """A flat mapping from a YAML or TOML file, keys normalised to snake_case.

    Raises:
        ConfigError: missing or unreadable file, unknown format, not a flat mapping, unknown or
            duplicated keys (the message lists the valid keys).
    """
    if not path.is_file():
        raise ConfigError(f"config file {path}: no such file. Check the path of --config.")
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        elif suffix == ".toml":
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        else:
            raise ConfigError(
                f"config file {path}: unsupported type {suffix or '(no suffix)'!r}. "
                "Use .yaml, .yml or .toml."
            )
    except (yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path}: cannot parse it ({exc}).") from exc
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"config file {path}: expected a mapping of option names to values, found "
            f"{type(raw).__name__}."
        )
    values: dict[str, Any] = {}
    unknown = []
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in valid:
            unknown.append(str(key))
        elif name in values:
            raise ConfigError(f"config file {path}: {name!r} is set twice (kebab and snake case).")
        elif isinstance(value, Mapping):
            raise ConfigError(
                f"config file {path}: {key!r} is a nested table; the config is a flat mapping."
            )
        else:
            values[name] = value
    if unknown:
        listing = ", ".join(n.replace("_", "-") for n in valid)
        raise ConfigError(
            f"config file {path}: unknown key(s) {', '.join(map(repr, unknown))}. "
            f"Valid keys (kebab-case or snake_case): {listing}."
        )
    return values


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _problems(
    exc: ValidationError,
    model: type[BaseModel],
    option_of: Mapping[str, str],
    sources: Mapping[str, str],
) -> list[str]:
    """One line per validation problem, naming the option, its value, and what is allowed."""
    lines = []
    for err in exc.errors():
        if not err["loc"]:  # a model-level rule, e.g. DP without epsilon or noise multiplier
            lines.append(str(err["msg"]).removeprefix("Value error, "))
            continue
        field = str(err["loc"][0])
        option = option_of.get(field, field)
        flag = _flag(option)
        if err["type"] == "missing":
            lines.append(f"{flag} is required: give it, or set '{option}' in the config file.")
            continue
        value = err.get("input")
        where = f" (from {sources[option]})" if option in sources else ""
        allowed = describe_allowed(model, field) if field in model.model_fields else ""
        hint = f" (allowed: {allowed})" if allowed else ""
        lines.append(f"{flag}={value!r}{where}: {err['msg']}{hint}.")
    return lines


def _validated(
    model: type[BaseModel],
    fields: Mapping[str, str],
    values: Mapping[str, Any],
    sources: Mapping[str, str],
    problems: list[str],
) -> Any:
    data = {field: values[option] for option, field in fields.items() if option in values}
    if "progress" in data:
        data["progress"] = not data["progress"]
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        option_of = {field: option for option, field in fields.items()}
        problems.extend(_problems(exc, model, option_of, sources))
        return None


def build_configs(values: Mapping[str, Any], sources: Mapping[str, str]) -> tuple[Any, Any, Any]:
    """Validate merged options into ``(ModelConfig, TrainConfig, RunOptions)``.

    Raises:
        ConfigError: every problem found, one per line.
    """
    from prism_runtime.model import ModelConfig
    from prism_runtime.trainer import TrainConfig

    merged = {k: v for k, v in values.items() if not (k in FOLLOW_DATA and v == AUTO)}
    if merged.get("head_max_norm") == JOINT_CLIP:  # as the run config's head-max-norm = -1
        merged["head_max_norm"] = None
    if "init" not in merged:
        merged["init"] = DEFAULT_INIT.get(str(merged.get("method", "prism")), BASELINE_INIT)
    problems: list[str] = []
    model_cfg = _validated(ModelConfig, MODEL_FIELDS, merged, sources, problems)
    train_cfg = _validated(TrainConfig, TRAIN_FIELDS, merged, sources, problems)
    reproducible = merged.get("reproducible", False)
    if not isinstance(reproducible, bool):
        where = f" (from {sources['reproducible']})" if "reproducible" in sources else ""
        problems.append(f"--reproducible={reproducible!r}{where}: must be true or false.")
    elif train_cfg is not None and model_cfg is not None and reproducible:
        train_cfg = train_cfg.model_copy(update={"seed": model_cfg.seed})
    run_opts = _validated(RunOptions, RUN_FIELDS, merged, sources, problems)
    if problems:  # a shared option (seed) can be reported by two models: keep the first
        raise ConfigError("\n".join(dict.fromkeys(problems)))
    return model_cfg, train_cfg, run_opts


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _load_data(
    path: Path, task: str, limit: int | None, what: str, user_field: str | None = None
) -> ExampleFile:
    from prism_runtime.data import read_examples

    read = read_examples(path, task, user_field=user_field)
    if limit is not None and limit < len(read.examples):
        log.info("using the first %d of %d %s examples", limit, len(read.examples), what)
    return read.head(limit)


LABELS_FIX = "Fix those rows' labels, or set --num-labels to the number of classes."


def _classes(values: Mapping[str, Any], model_cfg: Any, train: ExampleFile) -> int:
    """K: ``--num-labels``, else one class per ``--label-texts``, else the training labels'
    classes (``prism_runtime.data.labels``: a stray label is refused, naming its rows)."""
    from prism_runtime.data.labels import derived_class_count

    if "num_labels" in values:
        return int(model_cfg.num_labels)
    if model_cfg.label_texts and values.get("label_texts") != AUTO:
        return max(2, len(model_cfg.label_texts))
    k = derived_class_count(
        train.source,
        train.labels,
        train.where,
        fix="set --num-labels to the number of classes (and --label-texts to one text per class).",
    )
    log.info("num_labels=%d (the training labels' classes 0..%d)", k, k - 1)
    return k


def _classifier_config(
    values: Mapping[str, Any], model_cfg: Any, train: ExampleFile, held_out: ExampleFile | None
) -> Any:
    """``model_cfg`` with the classes and text pairs of the data, every label checked, and
    ``--label-texts auto`` / ``--head-init auto`` resolved as the run config resolves them
    (``prism_runtime.data.settings``).

    Raises:
        DataError: a label outside the classes (naming its rows, never its value).
        ConfigError: label texts whose count is not the number of classes.
    """
    from prism_runtime.classifier import resolve_pair_encoding
    from prism_runtime.config import split_label_texts
    from prism_runtime.data.labels import check_labels
    from prism_runtime.data.settings import auto_head_init, auto_label_texts

    k = _classes(values, model_cfg, train)
    pairs = "text_a" in train.examples[0]
    texts = model_cfg.label_texts
    if values.get("label_texts") == AUTO:
        texts = split_label_texts(auto_label_texts(pairs, k))
    check_label_texts(texts, k, texts_key="--label-texts", labels_key="--num-labels")
    for data in (train, held_out):
        if data is not None:
            check_labels(data.source, data.labels, data.where, k, fix=LABELS_FIX)
    head_init = model_cfg.head_init
    if values.get("head_init") == AUTO:
        siamese = pairs and resolve_pair_encoding(model_cfg.model, model_cfg.pair_encoding) == (
            "siamese"
        )
        head_init = auto_head_init(
            pairs=pairs, siamese=siamese, num_labels=k, label_texts="|".join(texts)
        )
    return model_cfg.model_copy(
        update={"num_labels": k, "text_pairs": pairs, "label_texts": texts, "head_init": head_init}
    )


def _max_length(loaded: Any, given: int | None) -> int:
    """``given`` if the model's position embeddings allow it; else the default, capped by it."""
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return given or DEFAULT_MAX_LENGTH
    if given is None:
        return min(DEFAULT_MAX_LENGTH, limit)
    if given > limit:
        raise ConfigError(
            f"--max-length={given} exceeds the model's max_position_embeddings={limit}: "
            f"use --max-length <= {limit}."
        )
    return given


def _default_out(method: str) -> Path:
    return Path("runs") / f"{method}-{time.strftime('%Y%m%d-%H%M%S')}"


def run(values: Mapping[str, Any], sources: Mapping[str, str]) -> int:
    """Validate, load, train, evaluate, export. Returns the exit code (errors are raised)."""
    started = time.perf_counter()
    model_cfg, train_cfg, opts = build_configs(values, sources)

    from client.site_data import person_counts
    from prism_core.accounting import epsilon, epsilon_report
    from prism_runtime.cache import CACHE_DIR_ENV
    from prism_runtime.data import TokenizedDataset
    from prism_runtime.evaluate import evaluate
    from prism_runtime.export import export_adapter, write_metrics
    from prism_runtime.model import load_model
    from prism_runtime.trainer import PrivateTrainer

    task = model_cfg.task
    if train_cfg.privacy_unit == "user" and not opts.user_field:
        raise ConfigError(
            "--privacy-unit user needs --user-field: name the field of each training row that "
            "identifies its person (e.g. --user-field patient_id)"
        )
    train_file = _load_data(opts.data, task, opts.train_limit, "training", opts.user_field)
    eval_file = (
        _load_data(opts.eval_data, task, opts.eval_limit, "evaluation") if opts.eval_data else None
    )
    if task == "seq-cls":
        model_cfg = _classifier_config(values, model_cfg, train_file, eval_file)
    train = train_file.examples
    held_out = eval_file.examples if eval_file is not None else None
    people = person_counts(train) if opts.user_field else None
    if people is not None and train_cfg.privacy_unit == "user":
        units, what = len(people), "people"
    else:
        units, what = len(train), "training examples"
    if train_cfg.method != "nondp" and not delta_below_one_over_n(train_cfg.delta, units):
        raise ConfigError(
            f"--delta={train_cfg.delta:g} is not below 1/N = {1 / units:g} for N={units} {what}: "
            "such a guarantee allows leaking a whole unit with probability delta. Use delta well "
            "below 1/N."
        )

    if train_cfg.seed is None and "seed" in values:
        log.info(
            "--seed=%s seeds the initialisation only; sampling, dropout and noise come from the "
            "OS CSPRNG (--reproducible seeds them too: for tests and benchmarks only)",
            values["seed"],
        )
    # PRISM_CACHE_DIR (prism_runtime.cache): reuse the spectral-residual start and the
    # tokenised data
    cache = Path(os.environ[CACHE_DIR_ENV]) if os.environ.get(CACHE_DIR_ENV) else None
    loaded = load_model(model_cfg, method=train_cfg.method, cache_dir=cache)
    max_length = _max_length(loaded, opts.max_length)
    dataset = TokenizedDataset(
        train,
        loaded.tokenizer,
        task,
        max_length=max_length,
        pair_encoding=loaded.pair_encoding,
        cache_dir=cache,
    )
    trainer = PrivateTrainer(loaded, dataset, train_cfg)
    if trainer.is_private and train_cfg.epsilon is not None:
        allowed = trainer.steps_allowed()
        if allowed < train_cfg.steps:
            raise ConfigError(
                f"--steps={train_cfg.steps} does not fit the budget: only {allowed} steps with "
                f"noise multiplier {trainer.noise_multiplier} and q={trainer.sample_rate:.4g} stay "
                f"within epsilon={train_cfg.epsilon}. Lower --steps or raise --noise-multiplier."
            )
    import torch

    train_started = time.perf_counter()
    trainer.train()
    train_time = time.perf_counter() - train_started

    eval_metrics = None
    if held_out is not None:
        eval_metrics = evaluate(loaded, held_out, max_length=max_length)
    out = opts.out or _default_out(train_cfg.method)
    adapter_dir = export_adapter(loaded, out / "adapter")

    report = epsilon_report(trainer.history, train_cfg.delta) if trainer.is_private else None
    # At the record level with the people known: what the run gives each person, by group
    # privacy with the largest number of records of one person (the group-privacy baseline).
    group = None
    if trainer.is_private and people is not None and train_cfg.privacy_unit == "record":
        group = max(people.values())
    metrics = {
        "method": train_cfg.method,
        "model": model_cfg.model,
        "task": task,
        "num_labels": model_cfg.num_labels if task == "seq-cls" else None,
        "rank": model_cfg.rank,
        "alpha": model_cfg.alpha,
        "target_modules": list(model_cfg.target_modules),
        "init": model_cfg.init,
        "max_length": max_length,
        "lr": train_cfg.lr,
        "head": model_cfg.head if task == "seq-cls" else None,
        "head_lr": train_cfg.head_learning_rate if task == "seq-cls" else None,
        "head_optimizer": train_cfg.head_optimizer if task == "seq-cls" else None,
        "head_max_norm": train_cfg.head_max_norm if task == "seq-cls" else None,
        "classifier": _classifier_facts(loaded) if task == "seq-cls" else None,
        "noise_multiplier": trainer.noise_multiplier if trainer.is_private else None,
        "sample_rate": trainer.sample_rate,
        "expected_batch_size": trainer.expected_batch_size,
        "micro_batch_size": trainer.micro_batch_size,
        "micro_batch": (
            trainer.micro_batch_choice.describe() if trainer.micro_batch_choice else "set"
        ),
        "grad_sample_mode": train_cfg.grad_sample_mode if trainer.is_private else None,
        "threads": torch.get_num_threads(),
        "max_norm": train_cfg.max_norm if trainer.is_private else None,
        "steps": trainer.steps_done,
        "delta": train_cfg.delta if trainer.is_private else None,
        "epsilon": trainer.epsilon() if trainer.is_private else None,
        "epsilon_rdp": report.rdp if report is not None else None,
        "privacy_unit": train_cfg.privacy_unit,
        "num_people": len(people) if people is not None else None,
        "max_records_per_user": (
            train_cfg.max_records_per_user if train_cfg.privacy_unit == "user" else None
        ),
        "group_size": group,
        "epsilon_per_person": (
            epsilon(trainer.history, train_cfg.delta, group_size=group) if group else None
        ),
        "target_epsilon": train_cfg.epsilon,
        "rng": trainer.rng,
        "seed": model_cfg.seed,
        "rng_seed": train_cfg.seed,
        "num_train_examples": len(train),
        "eval_data": str(opts.eval_data) if opts.eval_data else None,
        "eval": eval_metrics,
        "train_time_s": round(train_time, 3),
        "wall_time_s": round(time.perf_counter() - started, 3),
    }
    metrics_path = write_metrics(out, metrics)
    _print_summary(metrics, adapter_dir, metrics_path)
    return EXIT_OK


def _classifier_facts(loaded: Any) -> dict[str, Any]:
    """The resolved pooling, pair encoding and head start (public settings)."""
    spec = loaded.spec
    return {
        "pooling": spec.pooling,
        "normalize": spec.normalize,
        "pair_encoding": spec.pair_encoding if loaded.config.text_pairs else None,
        "head_init": spec.head_init,
        "label_texts": list(spec.label_texts),
    }


UNIT_WORDS = {"record": "record", "user": "person"}


def _print_summary(metrics: Mapping[str, Any], adapter: Path, metrics_path: Path) -> None:
    lines = [
        f"{PROG}: {metrics['method']} on {metrics['num_train_examples']} examples, "
        f"{metrics['steps']} steps of expected batch {metrics['expected_batch_size']:.0f}, "
        f"{metrics['wall_time_s']:.0f} s"
    ]
    micro = metrics["micro_batch"]
    compute = [micro if micro != "set" else f"micro-batch {metrics['micro_batch_size']}"]
    if metrics["grad_sample_mode"]:
        compute.append(f"per-example gradients by {metrics['grad_sample_mode']}")
    compute.append(f"{metrics['threads']} threads, training {metrics['train_time_s']:.1f} s")
    lines.append("compute: " + ", ".join(compute))
    if metrics["epsilon"] is None:
        lines.append("privacy: none (non-DP baseline)")
    else:
        lines.append(
            f"privacy: epsilon={metrics['epsilon']:.4f} per {UNIT_WORDS[metrics['privacy_unit']]} "
            f"(PRV; RDP {metrics['epsilon_rdp']:.4f}) at delta={metrics['delta']:g}, "
            f"sigma={metrics['noise_multiplier']:.4f}, q={metrics['sample_rate']:.4g}, "
            f"C={metrics['max_norm']:g}"
        )
        if metrics["epsilon_per_person"] is not None:
            lines.append(
                f"per person: epsilon={metrics['epsilon_per_person']:.4f} by group privacy "
                f"(up to {metrics['group_size']} records of one person in the data)"
            )
    ev = metrics["eval"]
    if ev is not None:
        shown = ", ".join(
            f"{k}={v:.4f}" for k, v in ev.items() if k != "examples" and math.isfinite(v)
        )
        lines.append(f"eval: {shown} on {ev['examples']} examples")
    lines += [f"adapter: {adapter}", f"metrics: {metrics_path}"]
    print("\n".join(lines))


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def _setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:  # leave an embedding application's (or pytest's) logging alone
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )


def _error(message: str) -> None:
    for line in message.splitlines():
        print(f"{PROG}: error: {line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run ``prism-train`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = vars(parser.parse_args(argv))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_CONFIG_ERROR
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time unless asked
    _setup_logging()
    from prism_core.errors import BudgetExceededError, PrivacyParameterError

    valid = _option_names(parser)
    try:
        config_path = args.pop("config", None)
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        if config_path is not None:
            values = read_config_file(Path(config_path), valid)
            sources = dict.fromkeys(values, str(config_path))
        values.update(args)  # the command line wins over the config file
        for name in args:
            sources.pop(name, None)
        return run(values, sources)
    except DataError as exc:
        _error(str(exc))
        return EXIT_DATA_ERROR
    except (ConfigError, PrivacyParameterError, BudgetExceededError) as exc:
        _error(str(exc))
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
