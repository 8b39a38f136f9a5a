"""Coordinator cost: aggregation + retraction time and memory vs the number of sites; bytes per
site per round; accountant time for 10^4 steps.

What runs is the product's own server path, with no Flower transport:
``server.strategy.PrismStrategy.configure_train`` (broadcast of the global factors) and
``aggregate_train`` (per reply: validation of the accounting facts, a real SQLite ledger append,
validation of every array, streaming weighted sum; then the mean and ``prism_core.manifold.retract``
of every module). Replies are real Flower ``Message`` objects built as a site builds them
(``RecordDict`` of an ``ArrayRecord`` of float32 ``dA``/``dB`` per module and a ``ConfigRecord``
of accounting facts), from synthetic tensors.

Shapes: Gemma-3-4B (34 decoder layers, hidden 2560, 8 query heads and 4 key/value heads of 256,
MLP 10240), LoRA r = 16 on q, k, v, up and down: 170 modules, 20.3 M adapter parameters.

Memory: each site count runs in a fresh subprocess. After the strategy, ledger and broadcast
exist, the process resets its peak resident set (``echo 5 > /proc/self/clear_refs``) and reads
``VmRSS``; after ``aggregate_train`` it reads ``VmHWM``. The difference is the peak extra
resident memory of aggregation + retraction, everything included (torch tensors, numpy buffers,
Flower records, allocator slack); tracemalloc would miss torch's allocations. Replies are
produced lazily, one at a time, as a generator handed to ``aggregate_train`` (``--hold all``
instead builds every reply before aggregating, as Flower's ``Grid.send_and_receive`` does: it
returns a list).

Time: wall clock of ``aggregate_train`` minus the time spent building the synthetic replies
(measured inside the generator), and of the retraction step alone (``StreamingAggregator.apply``,
timed by wrapping it on the instance). Bytes: the sum of the serialised sizes
(``InflatableObject.deflate()``) of every object of the reply message's object tree, which is
what Flower 1.42 ships (gRPC framing not counted). Run::

    .venv/bin/python bench/server.py --threads 1 [--sites 1 10 100] [--out FILE.json]

Round loop (``--round-memory K ...``, only this): peak extra RSS of one whole round of the
coordinator's loop (configure, push, pull, validation, ledger, sums, retraction), for the
collect-all loop (Flower's ``Grid.send_and_receive`` returns every reply in a list, then
``aggregate_train``) and the streaming loop (``server.strategy.loop.run_rounds``: push, then
pull and sum one reply at a time). The grid is Flower's own ``InMemoryGrid`` (the simulation
engine's) over an in-memory LinkState with K registered SuperNodes (the tests' loopback grid,
``tests/helpers/grids.py``'s ``FlowerSites``, answering on pull); no SuperLink or SuperNode
process runs: each site builds its reply (public random update of the adapter's shapes) when
the coordinator pulls its message id, so a reply exists in this process from its pull on, as a
reply pulled from a SuperLink in another process does. Also reports the most reply
ArrayRecords alive at once (weak references). Each (K, loop) runs in a fresh subprocess::

    .venv/bin/python bench/server.py --threads 1 --round-memory 1 10 50 [--layers 34] [--out F]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# This file is named like the repo's `server` package: make the package win the import; the
# tests' strategy helper (tests/server) builds the strategy a unit test drives.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.task_identity import TaskIdentity
from step import environment, load_average

from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.records import ADJACENCY, SAMPLING
from prism_runtime.protocol import ACCOUNTING, CONFIG, ROUND_NONCE, SERVER_ROUND, UPDATE, key
from server.ledger import Ledger
from server.strategy import PrismStrategy
from server.strategy.loop import run_rounds
from server.strategy.replies import in_order
from tests.helpers.grids import FlowerSites
from tests.server.strategy_helpers import strategy_for as unit_strategy

LOG = logging.getLogger("bench.server")

RANK = 16
LAYERS = 34
# Gemma-3-4B (hidden 2560, 8 q heads + 4 kv heads of head_dim 256, MLP 10240): (m = out, n = in)
GEMMA_MODULES = {
    "q_proj": (2048, 2560),
    "k_proj": (1024, 2560),
    "v_proj": (1024, 2560),
    "up_proj": (10240, 2560),
    "down_proj": (2560, 10240),
}
# all-MiniLM-L6-v2 with the product's default LoRA (r = 8 on query and value), for bytes only
MINILM_MODULES = {"query": (384, 384), "value": (384, 384)}


def shapes(modules: dict[str, tuple[int, int]], layers: int, rank: int) -> dict[str, tuple]:
    """``{module name: (m, n, r)}`` for every adapted module of every layer."""
    return {
        f"model.layers.{i}.{name}": (m, n, rank)
        for i in range(layers)
        for name, (m, n) in modules.items()
    }


def global_arrays(spec: dict[str, tuple], seed: int = 0) -> dict[str, torch.Tensor]:
    """Balanced random global factors (full rank), float32."""
    g = torch.Generator().manual_seed(seed)
    arrays = {}
    for module, (m, n, r) in spec.items():
        arrays[key(module, "A")] = torch.randn(m, r, generator=g) / m**0.5
        arrays[key(module, "B")] = torch.randn(n, r, generator=g) / n**0.5
    return arrays


def site_update(spec: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    """A site's tangent update (synthetic): ``dA``, ``dB`` per module, float32."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for module, (m, n, r) in spec.items():
        out[key(module, "dA")] = 1e-3 * torch.randn(m, r, generator=g)
        out[key(module, "dB")] = 1e-3 * torch.randn(n, r, generator=g)
    return out


def facts(site: str, steps: int = 10) -> dict[str, Any]:
    """Accounting facts as a site sends them (``client.reply.SiteFacts.common``)."""
    return {
        "site-id": site,
        "status": "ok",
        "reason": "",
        "server-round": 1,
        "mechanism": "prism-tangent-gaussian",
        "adjacency": ADJACENCY,
        "sampling": SAMPLING,
        "sigma": 1.0,
        "q": 0.01,
        "steps": steps,
        "delta": 1e-5,
        "epsilon-cap": 8.0,
        "epsilon": 0.5,
        "max-norm": 1.0,
        "expected-batch-size": 64.0,
        "rng": "os-csprng",
    }


def reply(request: Message, arrays: dict[str, torch.Tensor], site: str) -> Message:
    """A site's train reply, built as ``client.app.train`` builds it (round and nonce echoed)."""
    config = request.content[CONFIG]
    stated = {**facts(site), SERVER_ROUND: config[SERVER_ROUND], ROUND_NONCE: config[ROUND_NONCE]}
    content = RecordDict({UPDATE: ArrayRecord(arrays), ACCOUNTING: ConfigRecord(stated)})
    return Message(content=content, reply_to=request)


def message_bytes(message: Message) -> int:
    """Serialised size of every object in the message's object tree (what Flower ships)."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


class _Grid:
    """The two Grid calls ``configure_train`` makes: node ids (no transport)."""

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = list(nodes)

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False if not permitted."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def strategy_for(spec: dict[str, tuple], sites: int, folder: Path) -> PrismStrategy:
    """The tests' plain-round strategy (``tests/server/strategy_helpers.py``: C, b and sigma as
    the replies state them, not fixed by a run config; the replies' shapes and values are
    checked, not their norm) for ``sites`` sites of 10 local steps."""
    return unit_strategy(
        modules=list(spec),
        ledger=Ledger.open(folder / "ledger.sqlite"),
        run_id="bench-server",
        sites_per_round=sites,
        local_steps=10,
        target_epsilon=8.0,
        mechanism="prism-tangent-gaussian",
    )


def aggregation_child(sites: int, hold: str) -> dict[str, Any]:
    """One round of ``sites`` replies through the real strategy; time and peak memory."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    spec = shapes(GEMMA_MODULES, LAYERS, RANK)
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        strategy = strategy_for(spec, sites, Path(tmp))
        glob = ArrayRecord(global_arrays(spec))
        requests = list(
            strategy.configure_train(1, glob, ConfigRecord(), _Grid(range(1, sites + 1)))
        )
        retract_s = 0.0
        apply = strategy.round_kind.aggregator.apply

        def timed_apply(means: dict[str, torch.Tensor], lr: float) -> dict[str, torch.Tensor]:
            nonlocal retract_s
            t0 = time.perf_counter()
            out = apply(means, lr)
            retract_s += time.perf_counter() - t0
            return out

        strategy.round_kind.aggregator.apply = timed_apply  # type: ignore[method-assign]
        build_s = 0.0

        def replies() -> Iterator[Message]:
            nonlocal build_s
            for i, request in enumerate(requests):
                t0 = time.perf_counter()
                msg = reply(request, site_update(spec, i), f"site-{i}")
                build_s += time.perf_counter() - t0
                yield msg

        gc.collect()
        reset = _reset_peak()
        rss0 = _status("VmRSS")
        t0 = time.perf_counter()
        if hold == "all":
            held = list(replies())
            new, metrics = strategy.aggregate_train(1, held)
        else:
            new, metrics = strategy.aggregate_train(1, replies())
        total_s = time.perf_counter() - t0
        peak = _status("VmHWM")
        assert new is not None and metrics is not None and metrics["sites-accepted"] == sites
        strategy.ledger.close()
    return {
        "sites": sites,
        "hold": hold,
        "peak_reset": reset,
        "rss_before_kib": rss0,
        "peak_kib": peak,
        "extra_peak_mib": (peak - rss0) / 1024,
        "aggregate_s": total_s - build_s,
        "retract_s": retract_s,
        "build_replies_s": build_s,
    }


def round_memory_child(sites: int, path: str) -> dict[str, Any]:
    """One round of ``sites`` sites through the coordinator's round loop on ``FlowerSites``
    (each site answers when its message id is pulled):
    ``stream`` is ``server.strategy.loop.run_rounds`` (replies pulled and summed one at a
    time); ``collect`` is the loop before it: ``Grid.send_and_receive`` (Flower's, which
    returns every reply in a list), ``in_order``, then ``aggregate_train``. Peak extra RSS of
    the round (configure, push, pull, validation, ledger, sums, retraction)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    spec = shapes(GEMMA_MODULES, LAYERS, RANK)
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        strategy = strategy_for(spec, sites, Path(tmp))
        grid = FlowerSites(
            sites,
            lambda i, request: reply(request, site_update(spec, i), f"site-{i}"),
            answer_on_pull=True,
        )
        glob = ArrayRecord(global_arrays(spec))
        gc.collect()
        reset = _reset_peak()
        rss0 = _status("VmRSS")
        t0 = time.perf_counter()
        if path == "stream":
            result = run_rounds(
                strategy, grid, glob, num_rounds=1, timeout=3600.0, train_config=ConfigRecord()
            )
            metrics = result.train_metrics_clientapp[1]
        else:
            messages = list(strategy.configure_train(1, glob, ConfigRecord(), grid))
            replies = in_order(grid.send_and_receive(messages, timeout=3600.0))
            new, metrics = strategy.aggregate_train(1, replies)
            assert new is not None and metrics is not None
            del replies
        total_s = time.perf_counter() - t0
        peak = _status("VmHWM")
        assert metrics["sites-accepted"] == sites and metrics["applied"] == 1, dict(metrics)
        strategy.ledger.close()
    return {
        "sites": sites,
        "path": path,
        "layers": LAYERS,
        "reply_mib": sum(m * r + n * r for m, n, r in spec.values()) * 4 / 2**20,
        "peak_reset": reset,
        "rss_before_kib": rss0,
        "peak_kib": peak,
        "extra_peak_mib": (peak - rss0) / 1024,
        "round_s": total_s,
        "peak_replies_held": grid.peak_held,
    }


def run_round_child(sites: int, path: str, threads: int | None, layers: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child-round", str(sites), "--path", path]
    command += ["--layers", str(layers)] + (["--threads", str(threads)] if threads else [])
    LOG.info("round loop: %d sites (%s), load %s", sites, path, load_average())
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child for {sites} sites ({path}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def round_memory(args: argparse.Namespace) -> None:
    """``--round-memory``: the coordinator round loop's peak memory, collect-all vs streaming."""
    env = environment()
    env["load_start"] = load_average()
    runs = [
        run_round_child(k, path, args.threads, args.layers)
        for k in args.round_memory
        for path in ("collect", "stream")
    ]
    env["load_end"] = load_average()
    print(
        f"CPU: {env['cpu']} ({env['cores']} cores) | torch {env['torch']} | {env['date']} | "
        f"commit {env['commit']}\n/proc/loadavg: start {env['load_start']}; end "
        f"{env['load_end']}\nGrid: Flower InMemoryGrid + in-memory LinkState, sites answer "
        f"when pulled; {args.layers} layers, reply {runs[0]['reply_mib']:.1f} MiB float32\n"
    )
    print("| sites | round loop | round s | peak replies held | extra peak RSS MiB |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for r in runs:
        loop = "send_and_receive + aggregate" if r["path"] == "collect" else "streaming (pull 1)"
        print(
            f"| {r['sites']} | {loop} | {r['round_s']:.2f} | {r['peak_replies_held']} | "
            f"{r['extra_peak_mib']:,.0f} |"
        )
    if not all(r["peak_reset"] for r in runs):
        print("\nWARNING: peak RSS could not be reset; extra peak includes set-up.")
    if args.out is not None:
        payload = {"environment": env, "args": {k: str(v) for k, v in vars(args).items()}}
        args.out.write_text(json.dumps({**payload, "round_memory": runs}, indent=2) + "\n")
        LOG.info("wrote %s", args.out)


def run_child(sites: int, hold: str, threads: int | None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", str(sites), "--hold", hold]
    command += ["--threads", str(threads)] if threads else []
    LOG.info("aggregation: %d sites (hold %s), load %s", sites, hold, load_average())
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child for {sites} sites failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def wire_bytes() -> list[dict[str, Any]]:
    """Bytes of one reply (site -> server) and one broadcast, vs the float32 adapter size."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    rows = []
    for name, spec in (
        ("Gemma-3-4B, r=16, q/k/v/up/down, 34 layers", shapes(GEMMA_MODULES, LAYERS, RANK)),
        ("all-MiniLM-L6-v2, r=8, query/value, 6 layers", shapes(MINILM_MODULES, 6, 8)),
    ):
        glob = global_arrays(spec)
        adapter = sum(t.numel() for t in glob.values()) * 4
        with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
            strategy = strategy_for(spec, 1, Path(tmp))
            (request,) = strategy.configure_train(1, ArrayRecord(glob), ConfigRecord(), _Grid([1]))
            rep = reply(request, site_update(spec, 0), "site-0")
            rows.append(
                {
                    "config": name,
                    "modules": len(spec),
                    "adapter_params": adapter // 4,
                    "adapter_bytes": adapter,
                    "broadcast_bytes": message_bytes(request),
                    "reply_bytes": message_bytes(rep),
                }
            )
            strategy.ledger.close()
    return rows


def accountant_times(steps: int, repeats: int) -> list[dict[str, Any]]:
    """Epsilon of a ``steps``-step history with PRV and RDP (``prism_core.accounting``)."""
    histories = {
        f"one event of {steps} steps (sigma 1.0, q 0.01)": [PrivacyEvent(1.0, 0.01, steps)],
        f"{steps // 100} rounds x 100 steps, sigma alternating 1.0/1.1": [
            PrivacyEvent(1.0 if i % 2 == 0 else 1.1, 0.01, 100) for i in range(steps // 100)
        ],
    }
    rows = []
    for name, history in histories.items():
        for accountant in ("prv", "rdp"):
            times, eps = [], 0.0
            for _ in range(repeats):
                t0 = time.perf_counter()
                eps = epsilon(history, 1e-5, accountant=accountant)  # type: ignore[arg-type]
                times.append(time.perf_counter() - t0)
            rows.append(
                {"history": name, "accountant": accountant, "epsilon": eps, "times_s": times}
            )
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument(
        "--hold-all-sites",
        type=int,
        nargs="*",
        default=[1, 10],
        help="site counts also run with every reply held in memory at once (Flower's list)",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--accountant-steps", type=int, default=10_000)
    parser.add_argument("--accountant-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the raw results as JSON here")
    parser.add_argument(
        "--round-memory",
        type=int,
        nargs="+",
        metavar="K",
        help="only measure the round loop's peak memory for these site counts, collect-all "
        "(Grid.send_and_receive) vs streaming (push/pull), through Flower's InMemoryGrid",
    )
    parser.add_argument(
        "--layers", type=int, default=LAYERS, help="decoder layers of the adapter (34: Gemma)"
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-round", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=("collect", "stream"), help=argparse.SUPPRESS)
    parser.add_argument("--hold", choices=("one", "all"), default="one", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr, force=True
    )
    logging.getLogger("server").setLevel(logging.WARNING)
    global LAYERS
    LAYERS = args.layers
    if args.child is not None:
        print(json.dumps(aggregation_child(args.child, args.hold)))
        return
    if args.child_round is not None:
        print(json.dumps(round_memory_child(args.child_round, args.path)))
        return
    if args.round_memory:
        round_memory(args)
        return
    env = environment()
    env["load_start"] = load_average()
    started = time.perf_counter()
    runs = [run_child(k, "one", args.threads) for k in args.sites]
    runs += [run_child(k, "all", args.threads) for k in args.hold_all_sites]
    LOG.info("bytes on the wire")
    wire = wire_bytes()
    LOG.info("accountant, %d steps", args.accountant_steps)
    acc = accountant_times(args.accountant_steps, args.accountant_repeats)
    env["load_end"] = load_average()
    elapsed = time.perf_counter() - started

    print(
        f"CPU: {env['cpu']} ({env['cores']} cores) | torch {env['torch']} "
        f"({env['torch_threads']} threads) | {env['date']} | commit {env['commit']} | "
        f"{elapsed:.0f} s total\n/proc/loadavg: start {env['load_start']}; end {env['load_end']}\n"
    )
    print("| sites | replies held | aggregate s | of which retract s | extra peak RSS MiB |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for r in runs:
        held = "one at a time" if r["hold"] == "one" else "all at once"
        print(
            f"| {r['sites']} | {held} | {r['aggregate_s']:.2f} | {r['retract_s']:.2f} | "
            f"{r['extra_peak_mib']:,.0f} |"
        )
    if not all(r["peak_reset"] for r in runs):
        print("\nWARNING: peak RSS could not be reset; extra peak includes set-up.")
    print(
        "\n| adapter | modules | params | float32 MiB | reply bytes | reply / adapter | "
        "broadcast / adapter |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for w in wire:
        print(
            f"| {w['config']} | {w['modules']} | {w['adapter_params']:,} | "
            f"{w['adapter_bytes'] / 2**20:,.2f} | {w['reply_bytes']:,} | "
            f"{w['reply_bytes'] / w['adapter_bytes']:.4f} | "
            f"{w['broadcast_bytes'] / w['adapter_bytes']:.4f} |"
        )
    print("\n| history | accountant | epsilon (delta 1e-5) | median s |")
    print("| --- | --- | ---: | ---: |")
    for a in acc:
        median = sorted(a["times_s"])[len(a["times_s"]) // 2]
        print(f"| {a['history']} | {a['accountant']} | {a['epsilon']:.4f} | {median:.3f} |")
    if args.out is not None:
        payload = {
            "environment": env,
            "args": {k: str(v) for k, v in vars(args).items()},
            "elapsed_s": elapsed,
            "aggregation": runs,
            "wire": wire,
            "accountant": acc,
        }
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        LOG.info("wrote %s", args.out)


if __name__ == "__main__":
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    main()
