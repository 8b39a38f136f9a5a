"""What secure aggregation costs a deployed round: time per round and bytes per site.

Runs the real deployment on loopback twice in one invocation, a plain run and a
``secure-aggregation=true`` run of the same configuration: a SuperLink and K deployed SuperNodes,
each under the site's warm worker (``client/worker.py``, the kit's default executor), the default
configuration (``[tool.flwr.app.config]``: MiniLM, LoRA r = 8, one local step of expected batch
128, PRISM at epsilon 3; 256 synthetic rows per site) for ``--rounds`` rounds with every site in
every round. The round times
are the coordinator's ``round N: sent, answered and aggregated in S s`` lines; their medians
over rounds 2.. are compared as a ratio (round 1 builds every site's model and shard). The
secure run also gives each stage's wall time at the coordinator (``round N: secure stage NAME
in S s``), so the consistency stage's share of a round is read directly, not as the
difference of two noisy rounds.

Bytes per site and round are measured on the messages' encodings for the model's shapes: one
secure round of ``--sites`` sites is played in this process through the codec
(``prism_runtime.secure_sum.messages``), and each message one site receives or sends is
serialised as Flower serialises a ``RecordDict`` (protobuf); the plain round's update (float32
``dA, dB`` per module and the head's change) the same way. Flower's own message framing, the
same for both, is not counted. The same round gives the CPU time of the consistency stage at a
site (signing its view; verifying the t signatures before it unmasks), one thread.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python bench/secure_cost.py --sites 8 --rounds 4 \\
        --out docs/results/secure/cost-k8.json
"""

from __future__ import annotations

import argparse
import json
import re
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

STAGE = re.compile(r"round (\d+): secure stage (\w+) in ([0-9.]+) s")
"""The coordinator's log line of one secure stage's wall time (``SecureRound.run``)."""


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
    result: dict[str, Any] = {
        "secure": secure,
        "flwr-run-wall-s": wall,
        "rounds-applied": summary["rounds-applied"],
        "round-s": [rounds_s[r] for r in sorted(rounds_s)],
        "round-s median r2+": statistics.median(rounds_s[r] for r in sorted(rounds_s)[1:]),
    }
    stages: dict[str, dict[int, float]] = {}
    for r, name, seconds in STAGE.findall((folder / "flwr-run.log").read_text()):
        stages.setdefault(name, {})[int(r)] = float(seconds)
    if secure:
        result["stage-s"] = {name: [by[r] for r in sorted(by)] for name, by in stages.items()}
        result["stage-s median r2+"] = {
            name: statistics.median(by[r] for r in sorted(by)[1:]) for name, by in stages.items()
        }
    return result


def _encoded(content: Any) -> int:
    from flwr.common.serde import recorddict_to_proto

    return len(recorddict_to_proto(content).SerializeToString())


def bytes_per_site(sites: int) -> dict[str, Any]:
    """Bytes one site receives and sends per round, per stage, secure and plain, measured on
    the encoded messages of one round played through the codec; the consistency stage's CPU."""
    import numpy as np
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.app import ArrayRecord, RecordDict

    from prism_core.distributed import FIELD_BITS, coordinate_dim, coordinate_shapes
    from prism_runtime.config import RunConfig
    from prism_runtime.exchange import to_arrays
    from prism_runtime.lora import read_points
    from prism_runtime.model import load_model, model_config_for
    from prism_runtime.protocol import UPDATE
    from prism_runtime.secure_sum import RoundId, RoundTrust, SiteRound, plan_unmask
    from prism_runtime.secure_sum.messages import (
        AdvertiseRequest,
        ConsistencyRequest,
        MaskRequest,
        ShareRequest,
        SignedUnmaskRequest,
        encode_advertise_reply,
        encode_advertise_request,
        encode_consistency_reply,
        encode_consistency_request,
        encode_mask_reply,
        encode_mask_request,
        encode_share_reply,
        encode_share_request,
        encode_unmask_reply,
        encode_unmask_request,
    )

    loaded = load_model(model_config_for(RunConfig()), method="prism")
    dim = coordinate_dim(coordinate_shapes(read_points(loaded.handles), loaded.head_params))
    plain = _encoded(RecordDict({UPDATE: ArrayRecord(to_arrays(loaded))}))  # dA, dB like A, B

    rid, names = RoundId("bench", 1), [f"site-{i}" for i in range(sites)]
    keys = {s: ec.generate_private_key(ec.SECP256R1()) for s in names}
    registered = {s: k.public_key() for s, k in keys.items()}
    trust = RoundTrust(sites, 0)  # every site honest, none missing: t = K
    rounds = {
        s: SiteRound(
            site_id=s,
            round_id=rid,
            identity_key=keys[s],
            bits=FIELD_BITS,
            noise_share=1.0,
            trust=trust,
        )
        for s in names
    }
    roster = {s: r.advertised for s, r in rounds.items()}
    sealed = {s: r.share(roster, registered=registered, threshold=sites) for s, r in rounds.items()}
    masked = {}
    for s, r in rounds.items():
        r.receive({o: sealed[o][s] for o in names if o != s})
        masked[s] = r.mask(np.zeros(dim, dtype=np.uint64), participants=names)
    request = plan_unmask(masked, participants=names, threshold=sites)
    signing, signatures = [], {}
    for s, r in rounds.items():
        start = time.process_time()
        signatures[s] = r.sign_view(request.survivors, identity_key=keys[s])
        signing.append(time.process_time() - start)
    verifying, answers = [], {}
    for s, r in rounds.items():
        start = time.process_time()
        answers[s] = r.answer(request, signatures=signatures, registered=registered)
        verifying.append(time.process_time() - start)

    me = names[0]
    signed = SignedUnmaskRequest(request=request, signatures=signatures)
    ask = AdvertiseRequest(bits=FIELD_BITS, length=dim)
    stages = {
        "advertise": (
            encode_advertise_request(ask, round_id=rid, site_id=me),
            encode_advertise_reply(roster[me], round_id=rid),
        ),
        "share": (
            encode_share_request(
                ShareRequest(roster=roster, threshold=sites), round_id=rid, site_id=me
            ),
            encode_share_reply(sealed[me], round_id=rid, site_id=me),
        ),
        "mask": (
            encode_mask_request(
                MaskRequest(
                    sealed={o: sealed[o][me] for o in names if o != me},
                    participants=frozenset(names),
                ),
                round_id=rid,
                site_id=me,
            ),
            encode_mask_reply(masked[me], round_id=rid, site_id=me, bits=FIELD_BITS),
        ),
        "consistency": (
            encode_consistency_request(
                ConsistencyRequest(survivors=request.survivors), round_id=rid, site_id=me
            ),
            encode_consistency_reply(signatures[me], round_id=rid, site_id=me),
        ),
        "unmask": (
            encode_unmask_request(signed, round_id=rid, site_id=me),
            encode_unmask_reply(answers[me], round_id=rid),
        ),
    }
    received = {stage: _encoded(pair[0]) for stage, pair in stages.items()}
    sent = {stage: _encoded(pair[1]) for stage, pair in stages.items()}
    unsigned = SignedUnmaskRequest(request=request, signatures={})
    forwarded = received["unmask"] - _encoded(
        encode_unmask_request(unsigned, round_id=rid, site_id=me)
    )  # the survivors' signatures in the unmasking request
    stage_bytes = received["consistency"] + sent["consistency"] + forwarded
    return {
        "coordinates": dim,
        "field-bits": FIELD_BITS,
        "plain: update sent": plain,
        "secure: received per stage": received,
        "secure: sent per stage": sent,
        "secure: total received": sum(received.values()),
        "secure: total sent": sum(sent.values()),
        "consistency stage: bytes per site (its messages and the signatures forwarded)": (
            stage_bytes
        ),
        "consistency stage: CPU ms per site, sign (median)": 1e3 * statistics.median(signing),
        "consistency stage: CPU ms per site, verify t signatures and answer (median)": 1e3
        * statistics.median(verifying),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--bytes-only", action="store_true", help="the bytes and CPU of one codec round only"
    )
    args = parser.parse_args()
    result: dict[str, Any] = {"sites": args.sites, "rounds": args.rounds}
    result["bytes"] = bytes_per_site(args.sites)
    if args.bytes_only:
        print(json.dumps(result, indent=2))
        return 0
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
