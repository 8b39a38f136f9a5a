"""Per-message start cost of a site's ClientApp, against the time of one local round.

In deployment Flower's SuperNode starts a FRESH ``flwr-clientapp`` process for every message,
so each round at each site pays the ClientApp's start: Python and its imports, the model load,
the spectral-residual (PiSSA) SVD, the site's data and its tokenisation, the ledger, the noise
calibration. This script starts one fresh Python process per sample, as Flower does; the child
builds the site exactly as ``client.app`` does (``client.site.get_site`` with the run config of
``pyproject.toml``'s ``[tool.flwr.app.config]``) and then answers round 1 from the initial
broadcast.

Reported per sample (child-side ``time.perf_counter``; the parent's wall time of the whole
process gives ``python start + exit``):

* ``imports``: ``import client.app`` (Flower, torch, transformers, peft, opacus, the site);
* the parts of the ``Site`` construction, by wrapping these functions in the child only (a few
  microseconds per call; a name missing from the code under test is skipped): read rows, base
  model load, tokenizer load, zero-shot head, LoRA attach (``get_peft_model``: with
  ``init=spectral-residual`` and no cached start, peft's PiSSA SVD of every target weight), the
  cached-start lookup, tokenisation (``TokenizedDataset``), ledger open, noise calibration,
  trainer set-up; ``site: other`` is the rest of ``Site()``;
* ``start``: everything before the round (imports + config + ``Site()``);
* ``round``: ``Site.train_round`` of round 1 in the same fresh process (what a deployed site
  pays after the start), and ``round (warm)``: a second round in that process, for reference.

Samples alternate between code roots (``--roots``: e.g. a checkout of the code before a change
and the one after; each root gets its own state folder, so a cache warms only where the code has
one), and the first sample of each root is reported apart (``cold``: empty caches). Medians of
the other samples; the ratio ``start / round`` is the number the issue asks about (target
<= 10 % on an idle machine). Run::

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python bench/site_start.py [--samples N]
        [--data synthetic|sst2] [--roots DIR ...] [--threads T] [--out FILE.json]

``--data sst2``: the site's data file is the first ``--sst2-rows`` rows (default 22,450, a
third of SST-2's training set, as for one of three sites) of ``sst2/train.jsonl`` in the data
folder (``PRISM_DATA_DIR``, default ``../shared/data`` next to the checkout), given as the
node's ``data-path`` (a deployed site: its own ``epsilon-cap``, ``delta`` and ``state-dir``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the checkout, for its tests.helpers.shared_data: the data folder of the tests and benchmarks
sys.path.append(str(Path(__file__).resolve().parent.parent))

from tests.helpers.shared_data import SHARED_DATA

HERE = Path(__file__).resolve().parent.parent
SST2 = SHARED_DATA / "sst2" / "train.jsonl"  # PRISM_DATA_DIR or ../shared/data

WRAPPED: tuple[tuple[str, str, str], ...] = (
    ("read rows", "client.site", "site_examples"),
    ("model load", "prism_runtime.model", "_load_base"),
    ("tokenizer load", "prism_runtime.model", "load_tokenizer"),
    ("zero-shot head", "prism_runtime.model", "new_head"),
    ("lora attach (peft, PiSSA SVD if uncached)", "prism_runtime.model", "get_peft_model"),
    ("lora attach, start cache (key; load or PiSSA + store)", "prism_runtime.model", "attach_lora"),
    ("tokenise or read shard cache", "prism_runtime.data.TokenizedDataset", "__init__"),
    ("ledger open", "client.site_ledger.SiteLedger", "__init__"),
    ("noise calibration", "client.site", "calibrate_noise_multiplier"),
    ("trainer set-up", "prism_runtime.trainer.PrivateTrainer", "__init__"),
)
"""(label, module or module.Class, attribute) of the functions timed inside ``Site()``."""


# --------------------------------------------------------------------------- child


def _wrap(times: dict[str, float], label: str, owner: Any, attr: str) -> None:
    original: Callable[..., Any] = getattr(owner, attr)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times[label] = times.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, attr, timed)


def _owner(path: str) -> Any:
    import importlib

    parts = path.split(".")
    for split in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One sample in this fresh process: imports, site start, round 1 and 2."""
    t0 = time.perf_counter()
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import client.app  # noqa: F401  (what flwr-clientapp imports)

    times: dict[str, float] = {"imports": time.perf_counter() - t0}
    for label, owner, attr in WRAPPED:
        try:
            _wrap(times, label, _owner(owner), attr)
        except (ImportError, AttributeError):
            continue
    from client.policy import site_policy
    from client.site import get_site
    from prism_runtime.config import RunConfig, SiteConfig, parse_config
    from prism_runtime.exchange import to_arrays

    t1 = time.perf_counter()
    run = parse_config(RunConfig, spec["run"], what="run config")
    node = parse_config(SiteConfig, spec["node"], what="node config")
    policy = site_policy(node, run_dir="", run_id="bench", env_secret="")
    times["config"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    site = get_site(run, node, policy)
    inside = time.perf_counter() - t2
    times["site: other"] = inside - sum(times.get(label, 0.0) for label, _, _ in WRAPPED)
    times["start"] = time.perf_counter() - t0
    arrays = to_arrays(site.loaded)
    t3 = time.perf_counter()
    reply = site.train_round(1, arrays)
    times["round"] = time.perf_counter() - t3
    t4 = time.perf_counter()
    site.train_round(2, arrays)
    times["round (warm)"] = time.perf_counter() - t4
    times["status"] = reply.accounting.status
    return times


# --------------------------------------------------------------------------- parent


def run_config() -> dict[str, Any]:
    """The demo's run config: ``[tool.flwr.app.config]`` of this checkout's pyproject."""
    with (HERE / "pyproject.toml").open("rb") as f:
        return dict(tomllib.load(f)["tool"]["flwr"]["app"]["config"])


def node_config(data: str, state_dir: Path, data_file: Path | None) -> dict[str, Any]:
    node: dict[str, Any] = {"state-dir": str(state_dir), "epsilon-cap": 8.0, "delta": 1e-5}
    if data == "sst2" and data_file is not None:
        node.update({"data-path": str(data_file), "site-id": "bench-site"})
    else:
        node.update({"partition-id": 0, "num-partitions": 3})
    return node


def sample(root: Path, spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    env["TRANSFORMERS_OFFLINE"] = "1"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env,
        cwd=spec["cwd"],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({root}):\n{done.stderr[-4000:]}")
    times = json.loads(done.stdout.strip().splitlines()[-1])
    inside = times["start"] + times["round"] + times["round (warm)"]
    times["python start + exit"] = wall - inside
    times["process"] = wall
    return times


def _table(rows: dict[str, list[dict[str, Any]]]) -> str:
    labels = ["python start + exit", "imports", "config"]
    labels += [label for label, _, _ in WRAPPED] + ["site: other", "start", "round", "round (warm)"]
    roots = list(rows)
    head = "| part (s) | " + " | ".join(f"{r} cold | {r} warm (median)" for r in roots) + " |"
    lines = [head, "|---|" + "---|---|" * len(roots)]
    for label in labels:
        cells = []
        present = False
        for r in roots:
            cold = rows[r][0].get(label)
            warm = [s[label] for s in rows[r][1:] if label in s]
            present = present or cold is not None or bool(warm)
            cells.append("-" if cold is None else f"{cold:.2f}")
            cells.append(f"{statistics.median(warm):.2f}" if warm else "-")
        if present:
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    ratio = []
    for r in roots:
        for which, samples in (("cold", rows[r][:1]), ("warm", rows[r][1:])):
            if samples:
                s = statistics.median(x["start"] for x in samples)
                t = statistics.median(x["round"] for x in samples)
                ratio.append(f"{r} {which}: start/round = {s:.2f}/{t:.2f} = {s / t:.0%}")
    return "\n".join(lines) + "\n\n" + "\n".join(ratio)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=4, help="processes per root (1 cold)")
    parser.add_argument("--data", choices=("synthetic", "sst2"), default="synthetic")
    parser.add_argument("--sst2-rows", type=int, default=22450)
    parser.add_argument("--roots", nargs="+", type=Path, default=[HERE])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    with tempfile.TemporaryDirectory(prefix="site-start-") as tmp:
        work = Path(tmp)
        data_file = None
        if args.data == "sst2":
            data_file = work / "site.jsonl"
            with SST2.open() as src:
                rows = [next(src) for _ in range(args.sst2_rows)]
            data_file.write_text("".join(rows))
        rows_by_root: dict[str, list[dict[str, Any]]] = {}
        names = {root: f"{root.name or root}#{i}" for i, root in enumerate(args.roots)}
        for n in range(args.samples):
            for i, root in enumerate(args.roots):
                state = work / f"state-{i}"
                spec = {
                    "run": run_config(),
                    "node": node_config(args.data, state, data_file),
                    "threads": args.threads,
                    "cwd": str(work),
                }
                times = sample(root.resolve(), spec)
                rows_by_root.setdefault(names[root], []).append(times)
                print(
                    f"sample {n} {names[root]}: start {times['start']:.2f} s, "
                    f"round {times['round']:.2f} s, process {times['process']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    print(_table(rows_by_root))
    if args.out:
        meta = {"data": args.data, "samples": args.samples, "roots": [str(r) for r in args.roots]}
        args.out.write_text(json.dumps({"args": meta, "samples": rows_by_root}, indent=1))


if __name__ == "__main__":
    main()
