"""Table and plot of a budget study: ``bench/federation_run.py`` runs at several budgets.

Reads each run folder's ``result.json`` (the run config, the coordinator's accuracy on the held-out
selection split after every round, the exported model's dev accuracy, every site's epsilon) and
writes ``budget.md`` (one row per run: the budget in example-gradients per site, batch, rounds,
lr, the clip's head share, the server-lr schedule, dev accuracy, the best and the last selection
accuracy, epsilon, wall time), ``budget.png`` (the selection accuracy per round of every run,
against example-gradients per site, so runs of different batches share one axis) and
``budget-dev.png``: dev accuracy against the budget, one line per kind of run (method, secure
or plain, epsilon, sites, LoRA targets), at each budget the run whose LAST selection accuracy is
highest, averaged over its seeds (the settings chosen on training rows, never on dev; ``chosen``
in ``budget.md``, with the seeds' mean dev accuracy that the plot shows). A
``bench/central_curve.py`` result (``prism-train`` on the pooled rows of ``--sites`` sites) is a
central line, its budget per site the pooled one over the sites.

    .venv/bin/python bench/budget_report.py --out docs/results/budget RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prism_runtime.config import DEFAULT_LR, DEFAULT_MAX_NORM
from prism_runtime.plan import LR_PER_ROW, plan_budget
from prism_runtime.train_config import DEFAULT_HEAD_SHARE

UNRECORDED_MAX_LR = 0.02
"""The planner's lr cap while results did not yet record the keys a budget set (``resolved``)."""

DEFAULTS = {
    "batch-size": 128,
    "num-rounds": 30,
    "lr": 0.002,
    "max-norm": 1.0,
    "head-max-norm": 0.9,
}


def _row(name: str, result: dict[str, Any]) -> dict[str, Any]:
    config = {**DEFAULTS, **result["run-config"]}
    if "resolved" in result:  # the keys as the run applied them
        config.update(result["resolved"])
    elif config.get("budget"):  # a result without them: the plain plan, the rule it ran under
        plan = plan_budget(passes=config["budget"], rows_per_site=config["rows-per-site"])
        config.update(plan.settings(site_step=True))
        config["lr"] = min(UNRECORDED_MAX_LR, LR_PER_ROW * plan.batch_size)
    curve = {int(k): v for k, v in result["selection-curve"].items()}
    dev = next(iter(result["eval"].values()))["accuracy"]
    batch, rounds = int(config["batch-size"]), int(config["num-rounds"])
    local = int(config.get("local-steps", 1))
    return {
        "run": name,
        "example-gradients": batch * rounds * local,
        "batch": batch,
        "rounds": rounds,
        "local steps": local,
        "lr": config["lr"],
        "clip": config["max-norm"],
        "head share": config["head-max-norm"],
        "server lr": config.get("server-lr-schedule", "constant"),
        "method": config.get("method", "prism")
        + ("-secure" if config.get("secure-aggregation") else ""),
        "dev": dev,
        "selection best": max(v for k, v in curve.items() if k > 0),
        "selection last": curve[max(curve)],
        "epsilon (max)": max(result["epsilon"].values()) if result["epsilon"] else None,
        "seconds": result["seconds"],
        "curve": curve,
        "per round": batch * local,
        "series": _series(config, result),
    }


def _central_row(name: str, result: dict[str, Any], sites: int) -> dict[str, Any]:
    """A ``bench/central_curve.py`` result (``prism-train`` on the pooled rows of ``sites``
    sites) as a row: its example-gradients and batch per site are the pooled ones / ``sites``,
    its selection curve is by step."""
    argv = result["prism-train"]
    args = {argv[i][2:]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    batch, steps = int(args["batch-size"]), int(args["steps"])
    clip = float(args.get("max-norm", DEFAULT_MAX_NORM))  # prism-train's defaults where unset
    head = float(args.get("head-max-norm", DEFAULT_HEAD_SHARE * clip))
    method = args.get("method", "prism")
    points = result["selection-curve"]  # [{"step", "selection", "seconds"}, ...]
    curve = {int(p["step"]): float(p["selection"]) for p in points}
    epsilon = result.get("epsilon")
    return {
        "run": name,
        "example-gradients": round(batch * steps / sites),
        "batch": round(batch / sites),
        "rounds": steps,
        "local steps": 1,
        "lr": float(args.get("lr", DEFAULT_LR)),
        "clip": clip,
        "head share": head,
        "server lr": "-",
        "method": f"{method}-central",
        "dev": float(result["dev"]),
        "selection best": max(v for k, v in curve.items() if k > 0),
        "selection last": curve[max(curve)],
        "epsilon (max)": epsilon,
        "seconds": points[-1]["seconds"] if points else None,
        "curve": curve,
        "per round": batch / sites,
        "series": "non-DP LoRA, central"
        if method == "nondp"
        else f"{method} central, eps {round(float(epsilon)):g}",
    }


def _series(config: dict[str, Any], result: dict[str, Any]) -> str:
    """The kind of run a line of ``budget-dev.png`` joins: what is compared, not what is tuned
    (batch, rounds, lr and the clip are chosen at each budget)."""
    method = str(config.get("method", "prism"))
    if method == "nondp":
        name = "non-DP LoRA"
    else:
        secure = "secure" if config.get("secure-aggregation") else "plain"
        if secure == "plain":  # step-at as run (``resolved``) or stated; else: site steps
            step = "coordinator" if config.get("step-at") == "coordinator" else "site"
            secure += f" (step at {step})"
        spent = max(result["epsilon"].values()) if result["epsilon"] else 0.0
        name = f"{method} {secure}, eps {round(float(spent)):g}"
    sites = len(result["epsilon"]) if result["epsilon"] else int(config.get("sites-per-round", 3))
    if sites != 3:
        name += f", {sites} sites"
    honest = config.get("min-honest-sites")
    if config.get("secure-aggregation") and honest is not None and int(honest) < sites:
        name += f", H = {int(honest)}"  # each site adds sigma / sqrt(H): more noise in the sum
    if config.get("lora-targets"):
        name += f", LoRA on {config['lora-targets']}"
    return name


def _chosen(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per series and budget (example-gradients within 5%), the setting (batch, rounds, lr,
    clip, head share, server lr) whose last selection accuracy, averaged over its seeds, is
    highest: the model a run exports is its last. Returns each chosen run's setting's mean dev
    accuracy, by run name."""
    settings: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        bucket = round(20 * math.log(row["example-gradients"]))  # 5% wide
        key = (row["series"], bucket, *(row[k] for k in SETTING))
        settings.setdefault(key, []).append(row)
    best: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for key, runs in settings.items():
        score = sum(r["selection last"] for r in runs) / len(runs)
        place = (key[0], key[1])
        if place not in best or score > _mean(best[place], "selection last"):
            best[place] = runs
    return {r["run"]: _mean(runs, "dev") for runs in best.values() for r in runs}


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return float(sum(r[key] for r in runs) / len(runs))


SETTING = ("batch", "rounds", "lr", "clip", "head share", "server lr")
"""What is chosen at each budget; runs that differ only in their seed share a setting."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "runs",
        nargs="+",
        type=Path,
        help="bench/federation_run.py --out folders, or their result.json files kept as NAME.json",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--task", default="SST-2", help="the task's name in the plot's title (default SST-2)"
    )
    parser.add_argument(
        "--sites",
        type=int,
        default=3,
        help="the sites whose pooled rows a central run trained on (its budget per site)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in args.runs:
        kept = path.suffix == ".json"  # a result kept in a results folder, named by its run
        file, name = (path, path.stem) if kept else (path / "result.json", path.name)
        result = json.loads(file.read_text())
        target = args.out / f"{name}.json"
        inside = file.resolve().is_relative_to(args.out.resolve())  # e.g. out/central/NAME.json
        if not inside and (not target.exists() or not target.samefile(file)):
            shutil.copy(file, target)
        central = "prism-train" in result  # bench/central_curve.py's result
        rows.append(_central_row(name, result, args.sites) if central else _row(name, result))
    rows.sort(key=lambda r: (r["example-gradients"], r["run"]))
    chosen = _chosen(rows)
    for row in rows:
        row["chosen"] = f"yes (seeds' dev {chosen[row['run']]:.3f})" if row["run"] in chosen else ""
    columns = [c for c in rows[0] if c not in ("curve", "per round")]
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    for row in rows:
        cells = []
        for c in columns:
            v = row[c]
            cells.append(f"{v:.3f}" if isinstance(v, float) and c != "lr" else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    (args.out / "budget.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colours = plt.get_cmap("tab20").colors  # distinct beyond the default cycle's ten
    for i, row in enumerate(rows):
        xs = [r * row["per round"] for r in sorted(row["curve"])]
        ys = [row["curve"][r] for r in sorted(row["curve"])]
        spent = row["epsilon (max)"]
        eps = "no DP" if spent in (None, "inf", float("inf")) else f"eps {float(spent):.1f}"
        label = f"{row['run']} ({eps}, dev {row['dev']:.3f})"
        ax.plot(xs, ys, marker=".", color=colours[(2 * i) % 20 + (2 * i) // 20 % 2], label=label)
    ax.set_xscale("symlog", linthresh=1000)
    title = f"{args.task}, 3 Dirichlet(0.5) sites: accuracy against compute"
    _save(fig, ax, "accuracy, held-out selection split", title, args.out / "budget.png")

    fig, ax = plt.subplots(figsize=(9, 5))
    series = sorted({row["series"] for row in rows})
    for i, name in enumerate(series):
        points = sorted(
            {
                (row["example-gradients"], chosen[row["run"]])
                for row in rows
                if row["series"] == name and row["run"] in chosen
            }
        )
        xs, ys = zip(*points, strict=True)
        colour = colours[(2 * i) % 20 + (2 * i) // 20 % 2]  # the light shades after ten
        ax.plot(xs, ys, marker="os"[i // 10 % 2], color=colour, label=name)
    ax.set_xscale("log")
    title = f"{args.task}: dev accuracy against the budget, settings chosen per budget"
    _save(fig, ax, "accuracy on dev (held out)", title, args.out / "budget-dev.png")


def _save(fig: Any, ax: Any, ylabel: str, title: str, path: Path) -> None:
    """Label, grid and legend ``ax``; write ``fig`` to ``path`` and close it."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("example-gradients per site")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
