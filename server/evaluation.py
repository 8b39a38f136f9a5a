"""Evaluate or use an exported model the way a user would: ``prism-fl evaluate`` / ``predict``.

A run folder (``prism-fl`` federation or ``prism-train``) holds ``adapter/``: the peft adapter
for the ORIGINAL base model and, for a classifier, its pooling and head (``prism_runtime.export``).
``load_run`` finds the base model and the token limit the run used, loads the three together
(``prism_runtime.export.load_exported``), and the same ``prism_runtime.evaluate`` code that
reported the run's held-out metrics scores the rows here, so the numbers agree.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_runtime.config import resolve_model
from prism_runtime.data import load_examples
from prism_runtime.errors import ConfigError
from prism_runtime.evaluate import evaluate_rows, predict
from prism_runtime.export import ADAPTER_CONFIG, load_exported
from prism_runtime.model import LoadedModel

__all__ = ["ExportedRun", "evaluate_run", "load_run", "predict_run", "write_jsonl"]

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 128
RUN_CONFIG = "run-config.json"  # written by a federation (kebab-case keys)
TRAIN_METRICS = "metrics.json"  # written by prism-train (snake_case keys)


@dataclass
class ExportedRun:
    """An exported model, loaded, with the token limit its run trained with."""

    run_dir: Path
    adapter: Path
    loaded: LoadedModel
    max_length: int

    @property
    def task(self) -> str:
        return self.loaded.config.task


def _adapter_dir(path: Path) -> Path:
    if (path / "adapter" / ADAPTER_CONFIG).is_file():
        return path / "adapter"
    if (path / ADAPTER_CONFIG).is_file():
        return path
    raise ConfigError(
        f"{path}: no exported adapter here (expected {path / 'adapter' / ADAPTER_CONFIG}). Give "
        "the folder of a finished prism-fl run or prism-train --out, or its adapter folder."
    )


def _run_settings(run_dir: Path) -> dict[str, Any]:
    """``model`` and ``max_length`` the run used, from run-config.json or metrics.json."""
    for name, keys in (
        (RUN_CONFIG, ("model", "max-length")),
        (TRAIN_METRICS, ("model", "max_length")),
    ):
        path = run_dir / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: unreadable ({exc}); pass --model and --max-length") from exc
        if isinstance(data, dict):
            return {"model": data.get(keys[0]), "max_length": data.get(keys[1])}
    return {}


def load_run(
    path: str | os.PathLike[str],
    *,
    model: str | None = None,
    max_length: int | None = None,
    device: str = "auto",
) -> ExportedRun:
    """Load the exported model of a run folder (or of its ``adapter`` folder).

    Args:
        path: the run folder, or the adapter folder itself.
        model: the original base model; default: the run's ``model`` setting, else the
            adapter's ``base_model_name_or_path``.
        max_length: token limit; default: the run's, else 128.
        device: ``auto``, ``cpu`` or ``cuda``.

    Raises:
        ConfigError: no adapter, unreadable files, or a base model that cannot be loaded.
    """
    adapter = _adapter_dir(Path(path))
    run_dir = adapter.parent if adapter.name == "adapter" else adapter
    settings = _run_settings(run_dir)
    base = model or (resolve_model(str(settings["model"])) if settings.get("model") else None)
    loaded = load_exported(adapter, model=base, device=device)
    limit = max_length or settings.get("max_length") or DEFAULT_MAX_LENGTH
    if not isinstance(limit, int) or limit < 2:
        raise ConfigError(f"max_length={limit!r} is invalid: pass --max-length >= 2")
    log.info(
        "loaded %s (%s) on %s, max_length=%d", adapter, loaded.config.model, loaded.device, limit
    )
    return ExportedRun(run_dir, adapter, loaded, limit)


def evaluate_run(
    run: ExportedRun, data: str | os.PathLike[str], *, batch_size: int = 64
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Metrics (accuracy and loss, or exact match) and one prediction per row of ``data``."""
    num_labels = run.loaded.config.num_labels if run.task == "seq-cls" else None
    examples = load_examples(data, run.task, num_labels=num_labels)
    _check_pairs(run, examples)
    metrics, rows = evaluate_rows(
        run.loaded, examples, max_length=run.max_length, batch_size=batch_size
    )
    return metrics, _numbered(rows)


def predict_run(
    run: ExportedRun, data: str | os.PathLike[str], *, batch_size: int = 64
) -> list[dict[str, Any]]:
    """One prediction per row of ``data`` (no labels needed; any present are ignored)."""
    examples = load_examples(data, run.task, with_labels=False)
    _check_pairs(run, examples)
    return _numbered(
        predict(run.loaded, examples, max_length=run.max_length, batch_size=batch_size)
    )


def _check_pairs(run: ExportedRun, examples: list[dict[str, Any]]) -> None:
    spec = run.loaded.spec
    if spec is not None and spec.siamese and "text_a" not in examples[0]:
        raise ConfigError(
            "this model classifies text pairs (siamese): give rows with text_a and text_b"
        )


def _numbered(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{"row": i, **row} for i, row in enumerate(rows, start=1)]


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write one JSON object per line (atomic replace); return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(dict(row), sort_keys=True) + "\n")
    tmp.replace(out)
    return out
