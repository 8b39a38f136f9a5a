"""One federated run in one process with any run config (the defaults search of the docs).

The product's coordinator (``server.federation.run_federation``: strategy, ledger, checkpoint,
export) drives K product sites (``client.app.train`` -> ``client.site.Site``) through the
in-process grid of ``bench/utility.py`` (no Flower transport). The training file is split once
into a held-out SELECTION set (evaluated by the coordinator after every round: the curve a
default is chosen on) and the sites' pool (Dirichlet or IID over K sites). At the end the
exported model is evaluated on ``--eval-data`` (default: the task's dev split) with
``prism-fl evaluate``'s code path: the number a user would see. Public data only.

    .venv/bin/python bench/federation_run.py --out bench-results/defaults/a \\
        --set head-init=zero-shot "label-texts=this is bad|this is great"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from bench.utility import DATA_DIR, _local_grid, read_jsonl, write_jsonl

RESOLVED = (
    "batch-size",
    "num-rounds",
    "local-steps",
    "lr",
    "max-norm",
    "head-max-norm",
    "head-lr",
    "sample-rate",
)
"""The run-config keys a result records as the run applied them (a budget sets some)."""


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--task", default="sst2", help="a folder of PRISM_DATA_DIR (default ../shared/data)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--select-rows", type=int, default=500)
    parser.add_argument("--train-rows", type=int, default=0, help="pool rows (0 = all)")
    parser.add_argument("--eval-data", type=Path, help="default: the task's dev.jsonl")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="run-config KEY=VALUE overrides")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from flwr.supercore.task_identity import TaskIdentity

    from prism_runtime.config import RunConfig, parse_config
    from server.evaluation import evaluate_run, load_run
    from server.federation import run_federation

    folder = DATA_DIR / args.task
    data = args.out / "data"
    pool, select = data / "pool.jsonl", data / "select.jsonl"
    if not pool.exists():
        rows = read_jsonl(folder / "train.jsonl")
        order = np.random.default_rng(12345).permutation(len(rows))
        write_jsonl(select, [rows[i] for i in order[: args.select_rows]])
        rest = [rows[i] for i in order[args.select_rows :]]
        write_jsonl(pool, rest[: args.train_rows] if args.train_rows else rest)
    overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: use KEY=VALUE")
        overrides[name] = _value(value)
    run_config = {
        "data": str(pool.resolve()),
        "partitioner": "dirichlet",
        "sites-per-round": args.sites,
        "min-sites": args.sites,
        "server-eval-data": str(select.resolve()),
        "run-dir": str((args.out / "run").resolve()),
        "seed": 0,
        **overrides,
    }
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    run = parse_config(RunConfig, run_config, what="run config")
    start = time.perf_counter()
    run_dir = run_federation(_local_grid(run.model_dump(by_alias=True), args.sites), run)
    seconds = time.perf_counter() - start
    eval_data = args.eval_data or folder / "dev.jsonl"
    metrics, _ = evaluate_run(load_run(run_dir), eval_data)
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = {r: m.get("accuracy") for r, m in summary.get("server-eval", {}).items()}
    sites = json.loads((run_dir / "report.json").read_text())["sites"]
    dumped = run.model_dump(by_alias=True)
    result = {
        "run-config": run_config,
        "resolved": {  # what a budget set, as run, and where the step was taken
            **{key: dumped[key] for key in RESOLVED},
            "step-at": "coordinator" if run.steps_at_coordinator else "site",
        },
        "seconds": round(seconds, 1),
        "selection-curve": curve,
        "eval": {str(eval_data): metrics},
        "epsilon": {s["site_id"]: s["epsilon"] for s in sites},
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
