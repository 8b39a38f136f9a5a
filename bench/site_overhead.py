"""A deployed site's overhead per round, with Flower's executor and with the site's warm worker.

Runs the real thing on loopback, once per executor: a SuperLink, ONE deployed SuperNode (site 0
of the demo's 3 synthetic partitions, its own policy and state folder) and ``flwr run`` of the
demo configuration (``[tool.flwr.app.config]``: MiniLM, LoRA r = 8, one local step of expected
batch 128, PRISM at epsilon 3) for ``--rounds`` rounds with one site per round.

- ``flower``: ``flower-supernode`` as Flower runs it: its SuperExec starts a fresh
  ``flwr-clientapp`` process for every message;
- ``worker``: ``python -m client.worker -- flower-supernode ...`` (what ``deploy.launch`` starts by
  default): one long-lived process runs every message with the installed ClientApp.

Read from the logs (every number is a wall-clock time of this run):

- ``round``: the coordinator's ``round N: sent, answered and aggregated in S s``;
- ``site round``: the ClientApp's ``round N answered in S s`` (``Site.train_round``: the checks,
  the ledger charge, the private step, the reply);
- ``task`` (worker only): the worker's ``task ... S s (pull, ClientApp, push)``, from the
  acquired task to the pushed reply.

Derived per round (worker): ``start = ClientApp - site round``, what the site adds before and
after its round: the run and node config, the ``Site`` lookup (round 1: its set-up, the model,
the shard, the calibration, from the site's start cache when warm) and the reply record; the
worker's idle poll adds at most ``PRISM_WORKER_POLL`` (0.05 s) before it. ``transfer = pull +
push``: the message moved between the SuperNode and the site's process, which Flower's
``flwr-clientapp`` does too (the pull also waits for the SuperNode to finish fetching the message
from the SuperLink: it hands out the task first). With Flower's executor the start is not in the
logs: it is the difference of the coordinator's rounds (and ``bench/site_start.py`` breaks it
down). The coordinator's round also holds Flower's own waits: the SuperNode polls the SuperLink
every 3 s when idle and for a reply every 0.5 s, the coordinator polls replies every 1 s.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python bench/site_overhead.py --rounds 6 \\
        --out docs/results/site-overhead/minilm-demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(HERE), str(HERE / "tests")]

from flower_harness import (  # noqa: E402  (real SuperLink/SuperNode processes on loopback)
    flower_env,
    flwr_run,
    free_port,
    insecure_superlink,
    insecure_supernode,
    port_open,
    processes,
    wait_for,
    write_connection,
)

ROUND = re.compile(r"round (\d+): sent, answered and aggregated in ([0-9.]+) s")
SITE_ROUND = re.compile(r"round (\d+) answered in ([0-9.]+) s")
TASK = re.compile(
    r"task \d+ of run \d+: ([0-9.]+) s \(pull ([0-9.]+), ClientApp ([0-9.]+), push ([0-9.]+)\)"
)


def run_config(rounds: int, run_dir: Path, overrides: dict[str, Any] | None = None) -> str:
    """``--run-config`` of the app's defaults for ``rounds`` rounds of one site, plus
    ``overrides`` (e.g. more sites per round)."""
    defaults = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    values: dict[str, Any] = {
        **defaults,
        "num-rounds": rounds,
        "sites-per-round": 1,
        "min-sites": 1,
        "run-dir": str(run_dir),
        **(overrides or {}),
    }
    return " ".join(
        f"{k}='{v}'"
        if isinstance(v, str)
        else f"{k}={str(v).lower() if isinstance(v, bool) else v}"
        for k, v in values.items()
    )


def one(executor: str, rounds: int, folder: Path) -> dict[str, Any]:
    """One deployed run with ``executor``; the per-round times from its logs."""
    env = flower_env(folder / "flwr")
    port = free_port()
    write_connection(folder / "flwr", "bench", f"127.0.0.1:{port}")
    node_config = (
        f"site-id='site-0' partition-id=0 num-partitions=3 state-dir='{folder / 'state'}' "
        "epsilon-cap=8.0 delta=1e-5"
    )
    supernode = insecure_supernode(port, node_config)
    if executor == "worker":
        worker = os.environ.get("PRISM_BENCH_WORKER", "")  # a wrapped worker script, to profile
        module = [worker] if worker else ["-m", "client.worker"]
        supernode = [sys.executable, *module, "--", *supernode]
    with processes(env, folder) as group:
        group.start("superlink", insecure_superlink(port, folder / "link.db"))
        wait_for(lambda: port_open(port), 60, "the SuperLink port")
        group.start("site", supernode)
        start = time.monotonic()
        done = flwr_run(env, "bench", run_config(rounds, folder / "run"), timeout=3600)
        wall = time.monotonic() - start
        (folder / "flwr-run.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"flwr run failed ({done.returncode}): {done.stderr[-2000:]}")
    server = (folder / "flwr-run.log").read_text()
    site_log = (folder / "site.log").read_text(errors="replace")
    coordinator = {int(r): float(s) for r, s in ROUND.findall(server)}
    site_round = {int(r): float(s) for r, s in SITE_ROUND.findall(site_log)}
    tasks = [tuple(map(float, t)) for t in TASK.findall(site_log)]
    if sorted(coordinator) != list(range(1, rounds + 1)) or sorted(site_round) != sorted(
        coordinator
    ):
        raise RuntimeError(f"{executor}: rounds missing from the logs in {folder}")
    result: dict[str, Any] = {
        "executor": executor,
        "flwr-run-wall-s": wall,
        "rounds": [
            {"round": r, "round-s": coordinator[r], "site-round-s": site_round[r]}
            for r in sorted(coordinator)
        ],
    }
    if executor == "worker":
        if len(tasks) != rounds:
            raise RuntimeError(f"worker: {len(tasks)} task lines for {rounds} rounds")
        for row, (total, pull, app, push) in zip(result["rounds"], tasks, strict=True):
            row.update(
                {
                    "task-s": total,
                    "pull-s": pull,
                    "clientapp-s": app,
                    "push-s": push,
                    "start-s": app - row["site-round-s"],
                    "transfer-s": pull + push,
                }
            )
    return result


def summarize(result: dict[str, Any]) -> dict[str, float]:
    """Medians over rounds 2.. (round 1 apart: it builds the site) of each column, and the
    ratios of the site's start (and of the transfer) to the site's round and the whole round."""
    later = result["rounds"][1:]
    out = {}
    for key in ("round-s", "site-round-s", "start-s", "transfer-s", "pull-s", "push-s"):
        if later and key in later[0]:
            out[f"{key} median r2+"] = statistics.median(r[key] for r in later)
            out[f"{key} round 1"] = result["rounds"][0][key]
    if "start-s median r2+" in out:
        for part in ("start", "transfer"):
            for whole in ("site-round", "round"):
                out[f"{part} / {whole} r2+"] = (
                    out[f"{part}-s median r2+"] / out[f"{whole}-s median r2+"]
                )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--executors", nargs="+", default=["flower", "worker"], choices=["flower", "worker"]
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="pfl-overhead-") as tmp:
        for executor in args.executors:
            result = one(executor, args.rounds, Path(tmp) / executor)
            result["summary"] = summarize(result)
            results.append(result)
            print(executor, json.dumps(result["summary"], indent=1), flush=True)
    report = {
        "machine": f"{os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
