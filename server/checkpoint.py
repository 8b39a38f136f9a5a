"""The coordinator's crash-safe round checkpoint, kept in the run folder next to the ledger.

After every round the coordinator writes ``checkpoint.safetensors`` atomically (temporary file,
fsync, ``os.replace``, fsync of the folder): the global arrays as tensors, and in the file's
metadata one JSON document with the round number, the strategy state (site-selection RNG state,
node -> site map, per-site mechanism, exhausted sites, round summaries), the round kind's
state, the metrics so far and the run config. One file, one rename: a crash leaves either the
previous round's checkpoint or this one, never a mix.

Privacy charges are not in the checkpoint: they live in the ledger, confirmed or unconfirmed,
one per (run, round, site) and kind (``server.ledger``). A round re-run after a crash records
its charges again and the ledger ignores those it holds, so a resumed run neither loses nor
duplicates an unconfirmed charge, and a site's resent reply confirms one without counting twice.

The round kind's state (``server.strategy.contract.RoundKind.state_dict``: none for a plain
round, the secure round's central step with its adaptive moments): its tensors are
stored among the arrays under ``round-state/``, its JSON-ready values in the ``round-state``
slot of the metadata. A resumed run continues bit for bit.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

from prism_runtime.durable import atomic_write
from prism_runtime.faults import NO_FAULTS, Faults
from server.errors import ConfigError

__all__ = ["CHECKPOINT", "Checkpoint", "config_differences", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.safetensors"
FORMAT = "prism-fl-checkpoint"
VERSION = "1"


@dataclass
class Checkpoint:
    """The coordinator's state after ``server_round`` rounds."""

    server_round: int
    arrays: dict[str, Tensor]
    run_config: dict[str, Any]
    strategy: dict[str, Any]
    round_state: dict[str, Any]
    train_metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    eval_metrics: dict[int, dict[str, Any]] = field(default_factory=dict)


def save_checkpoint(run_dir: Path, ckpt: Checkpoint, *, faults: Faults = NO_FAULTS) -> Path:
    """Atomically replace ``run_dir/checkpoint.safetensors`` with ``ckpt``.

    ``faults``: the ``mid-checkpoint`` crash point for tests (new file durable, not renamed).
    """
    state = {
        "round": ckpt.server_round,
        "run-config": ckpt.run_config,
        "strategy": ckpt.strategy,
        "round-state": ckpt.round_state,
        "train-metrics": {str(k): v for k, v in ckpt.train_metrics.items()},
        "eval-metrics": {str(k): v for k, v in ckpt.eval_metrics.items()},
    }
    metadata = {"format": FORMAT, "version": VERSION, "state": json.dumps(state, sort_keys=True)}
    data = save_tensors({k: v.contiguous() for k, v in ckpt.arrays.items()}, metadata=metadata)
    path = run_dir / CHECKPOINT
    atomic_write(
        path,
        lambda f: f.write(data),
        before_replace=lambda: faults.reach("mid-checkpoint", ckpt.server_round),
    )
    return path


def _metadata(data: bytes) -> dict[str, str]:
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    return dict(header.get("__metadata__", {}))


def load_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The checkpoint in ``run_dir``, or None if there is none yet.

    Raises:
        ConfigError: the file is not a prism-fl checkpoint or is damaged (it is left as is).
    """
    path = run_dir / CHECKPOINT
    for stale in run_dir.glob(f".{CHECKPOINT}.*.tmp"):  # a write cut short by a crash
        log.info("removing %s: an unfinished checkpoint write", stale)
        stale.unlink(missing_ok=True)
    if not path.exists():
        return None
    data = path.read_bytes()
    try:
        metadata = _metadata(data)
        if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
            raise ValueError(f"format {metadata.get('format')!r} v{metadata.get('version')!r}")
        state = json.loads(metadata["state"])
        arrays = load_tensors(data)
    except (ValueError, KeyError, SafetensorError) as exc:
        raise ConfigError(
            f"{path}: not a readable prism-fl checkpoint ({exc}). The file was left unchanged; "
            "use another run-dir, or restore the checkpoint from a backup to resume this run."
        ) from exc
    return Checkpoint(
        server_round=int(state["round"]),
        arrays=arrays,
        run_config=state["run-config"],
        strategy=state["strategy"],
        round_state=state["round-state"],
        train_metrics={int(k): v for k, v in state["train-metrics"].items()},
        eval_metrics={int(k): v for k, v in state["eval-metrics"].items()},
    )


def config_differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: stored -> current`` for every key whose value differs (or exists on one side)."""
    out = []
    for name in sorted(set(stored) | set(current)):
        if stored.get(name, "<absent>") != current.get(name, "<absent>"):
            out.append(
                f"{name}: {stored.get(name, '<absent>')!r} -> {current.get(name, '<absent>')!r}"
            )
    return out
