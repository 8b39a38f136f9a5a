"""What secure aggregation costs a deployed round: time per round and bytes per site.

Runs the real deployment on loopback twice in one invocation, a plain run and a
``secure-aggregation=true`` run of the same configuration: a SuperLink and K deployed SuperNodes,
each under the site's warm worker (``client/worker.py``, the kit's default executor), the default
configuration (``[tool.flwr.app.config]``: MiniLM, LoRA r = 8, one local step of expected batch
128, PRISM at epsilon 3; 256 synthetic rows per site) for ``--rounds`` rounds with every site in
every round. The round times
are the coordinator's ``round N: sent, answered and aggregated in S s`` lines; their medians
over rounds 2.. are compared as a ratio (round 1 builds every site's model and shard).

Bytes per site and round are computed from the messages' encodings for the model's shapes
(``prism_runtime.secure_sum.messages``; the plain round's update is float32 ``dA, dB`` per
module and the head's change), not measured on the wire (Flower adds its own framing to both).

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python bench/secure_cost.py --sites 8 --rounds 4 \\
        --out docs/results/secure/cost-k8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
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

from bench.site_overhead import ROUND, run_config  # noqa: E402  (the same run, more sites)


def one(secure: bool, sites: int, rounds: int, folder: Path) -> dict[str, Any]:
    """One deployed run; the coordinator's round times from its log."""
    env = flower_env(folder / "flwr")
    port = free_port()
    write_connection(folder / "flwr", "bench", f"127.0.0.1:{port}")
    with processes(env, folder) as group:
        group.start("superlink", insecure_superlink(port, folder / "link.db"))
        wait_for(lambda: port_open(port), 60, "the SuperLink port")
        for i in range(sites):
            node_config = (
                f"site-id='site-{i}' partition-id={i} num-partitions={sites} "
                f"state-dir='{folder / 'state' / str(i)}' epsilon-cap=8.0 delta=1e-5 "
                f"min-honest-sites={sites} secure-peers='{folder / 'peers'}'"
            )
            supernode = insecure_supernode(port, node_config)
            group.start(f"site-{i}", [sys.executable, "-m", "client.worker", "--", *supernode])
        start = time.monotonic()
        overrides = {
            "sites-per-round": sites,
            "min-sites": sites,
            "synthetic-examples": 256 * sites,  # each site's shard holds its expected batch
            "secure-aggregation": secure,
            "min-honest-sites": sites,
        }
        config = run_config(rounds, folder / "run", overrides)
        done = flwr_run(env, "bench", config, timeout=3600)
        wall = time.monotonic() - start
        (folder / "flwr-run.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"flwr run failed ({done.returncode}): {done.stderr[-2000:]}")
    rounds_s = {int(r): float(s) for r, s in ROUND.findall((folder / "flwr-run.log").read_text())}
    if sorted(rounds_s) != list(range(1, rounds + 1)):
        raise RuntimeError(f"rounds missing from the log in {folder}")
    summary = json.loads((folder / "run" / "summary.json").read_text())
    return {
        "secure": secure,
        "flwr-run-wall-s": wall,
        "rounds-applied": summary["rounds-applied"],
        "round-s": [rounds_s[r] for r in sorted(rounds_s)],
        "round-s median r2+": statistics.median(rounds_s[r] for r in sorted(rounds_s)[1:]),
    }


def bytes_per_site(sites: int) -> dict[str, int]:
    """Bytes one site receives and sends per round, secure and plain, from the encodings."""
    from prism_core.distributed import FIELD_BITS, coordinate_dim, coordinate_shapes
    from prism_runtime.config import RunConfig
    from prism_runtime.exchange import to_arrays
    from prism_runtime.lora import read_points
    from prism_runtime.model import load_model, model_config_for
    from prism_runtime.secure_sum.wire import SEALED_SHARES_BYTES, SHARE_BYTES

    loaded = load_model(model_config_for(RunConfig()), method="prism")
    dim = coordinate_dim(coordinate_shapes(read_points(loaded.handles), loaded.head_params))
    arrays = to_arrays(loaded)
    update = sum(v.numel() * 4 for v in arrays.values())  # dA, dB like A, B; the head's change
    keys = 3 * 32 + 72  # two public keys, a commitment, a DER P-256 signature (at most 72)
    return {
        "coordinates": dim,
        "field-bits": FIELD_BITS,
        "plain: update sent": update,
        "secure: keys sent": keys,
        "secure: roster received": sites * keys,
        "secure: shares sent": (sites - 1) * SEALED_SHARES_BYTES,
        "secure: shares received": (sites - 1) * SEALED_SHARES_BYTES,
        "secure: masked vector sent": 8 * dim,
        "secure: unmask shares sent": sites * SHARE_BYTES,
        "secure: total sent": keys
        + (sites - 1) * SEALED_SHARES_BYTES
        + 8 * dim
        + sites * SHARE_BYTES,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result: dict[str, Any] = {"sites": args.sites, "rounds": args.rounds}
    result["bytes"] = bytes_per_site(args.sites)
    with tempfile.TemporaryDirectory(prefix="secure-cost-") as tmp:
        base = Path(tmp)
        peers = base / "peers"  # every run's sites pin the same identity keys
        peers.mkdir()
        from client.secure import identity_key
        from prism_runtime.identity import IDENTITY_PUBLIC

        for secure in (False, True):
            folder = base / ("secure" if secure else "plain")
            for i in range(args.sites):
                state = folder / "state" / str(i)
                identity_key(state)
                (peers / f"site-{i}.pem").write_bytes((state / IDENTITY_PUBLIC).read_bytes())
            (folder / "peers").symlink_to(peers)
            result["secure" if secure else "plain"] = one(secure, args.sites, args.rounds, folder)
    result["round time ratio secure / plain (median r2+)"] = (
        result["secure"]["round-s median r2+"] / result["plain"]["round-s median r2+"]
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
