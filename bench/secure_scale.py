"""The secure sum at the scale of edge fleets, in one process: n sites and the coordinator.

Every site is a real ``prism_runtime.secure_sum.SiteRound`` (fresh X25519 keys, ECDSA P-256
identity, Shamir shares sealed with ChaCha20-Poly1305, ChaCha20 masks); the coordinator plans
the unmasking and adds each masked input to one running sum as it arrives (``MaskedSum``), so it
holds one vector whatever n. No transport: messages are handed over in memory, and their bytes
are counted from the objects that would travel (keys, commitments, signatures, sealed shares,
site ids, the masked vector of d 8-byte words).

The round: every site counts on H = n - c honest sites (c = ``--corrupt`` x n colluders allowed
for) and tolerates D = the dropout count; the coordinator takes the least common threshold and,
with ``--graph sparse``, the common sparse graph (``secure_sum.common_graph``: the least even
degree k whose failure bound is <= 2^-40 and abort bound <= 2^-20). A fraction ``delta`` of the
roster drops, split evenly over three stages: after advertising (never shares), after sharing
(never masks: its masks are removed with its rebuilt mask key) and after masking (never answers
the unmasking). The sum is compared with the plain sum of the survivors' inputs exactly.

The coordinator commits the roster (``CommittedRoster``: each site receives the roster's ids,
the stated largest noise share and its neighbourhood's advertisements with their Merkle proof)
and the survivors' signatures (``SignatureBook``: each site draws which it checks and receives
those with their proof); the sets travel as bitmaps over the roster.

Reported per (n, delta, d): degree k and neighbourhood threshold, per-site median and max time
over all of a site's calls, per-site bytes sent and received (median; received also by part:
the roster, the sealed shares, the sets and roots, the drawn signatures), ChaCha mask words one
site expands, the coordinator's time (committing, opening, adds and unmasking) and the vector it
holds (one running sum of d words: no site's vector is kept after it is added), whether the
round succeeded and the sum was exact.

    PYTHONPATH=. .venv/bin/python bench/secure_scale.py --sites 10 100 300 1000 \\
        --dropout 0 0.1 0.3 --length 74498 --out bench-results/secure-scale.json

``--shamir K:T [K:T ...]`` instead times the Shamir split of one 32-byte secret among K + 1
holders at threshold T and its recombination from T shares: ``secure_sum.shamir`` (GF(2^521 -
1)) against Flower's ``crypto.shamir`` (pycryptodome's GF(2^128)), the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec

from prism_runtime.secure_sum import (
    AdvertisedKeys,
    CommittedRoster,
    MaskedSum,
    MaskingGraph,
    RoundId,
    RoundTrust,
    SecureSumError,
    SignatureBook,
    SiteRound,
    centre,
    common_graph,
    encode_signed,
    least_common_threshold,
    plan_unmask,
)
from prism_runtime.secure_sum import masks as masks_module

BITS = 62
T = TypeVar("T")


def _advert_bytes(a: AdvertisedKeys) -> int:
    return (
        len(a.site_id)
        + len(a.mask_public)
        + len(a.share_public)
        + len(a.seed_commitment)
        + (len(a.signature) + 8 + 4 + 4)
    )


def simulate(
    n: int, *, delta: float, length: int, corrupt: float, sparse: bool, seed: int
) -> dict[str, Any]:
    """One round of n in-process sites (module docstring); the measurements."""
    rng = np.random.default_rng(seed)  # which sites drop and the test inputs; never the masks
    ids = [f"site-{i:05d}" for i in range(n)]
    dropped_total = round(delta * n)
    c = int(corrupt * n)
    trust = RoundTrust(n - c, max(dropped_total, 0) if dropped_total < n - c else n - c - 1)
    seconds: dict[str, float] = defaultdict(float)
    sent: dict[str, int] = defaultdict(int)
    received: dict[str, int] = defaultdict(int)
    parts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # what was received

    def receive(site: str, what: str, size: int) -> None:
        received[site] += size
        parts[what][site] += size

    def timed(site: str, call: Callable[[], T]) -> T:
        start = time.perf_counter()
        out = call()
        seconds[site] += time.perf_counter() - start
        return out

    identities = {s: ec.generate_private_key(ec.SECP256R1()) for s in ids}
    registered = {s: k.public_key() for s, k in identities.items()}
    round_id = RoundId("scale", 1)
    sites = {
        s: timed(
            s,
            lambda s=s: SiteRound(
                site_id=s,
                round_id=round_id,
                identity_key=identities[s],
                bits=BITS,
                noise_share=1.0,
                trust=trust,
            ),
        )
        for s in ids
    }
    roster = {s: site.advertised for s, site in sites.items()}
    for s in ids:
        sent[s] += _advert_bytes(roster[s])
    threshold = least_common_threshold([trust] * n, n)
    assert threshold is not None
    graph = common_graph([trust] * n, n) if sparse else None

    order = list(rng.permutation(ids))
    third = dropped_total // 3
    stage_drops = [third, third, dropped_total - 2 * third]
    drop_share = set(order[: stage_drops[0]])
    drop_mask = set(order[stage_drops[0] : stage_drops[0] + stage_drops[1]])
    drop_answer = set(order[stage_drops[0] + stage_drops[1] : dropped_total])

    # Stage 2: the coordinator commits the roster (its ids, the Merkle tree of the
    # advertisements) and sends each site its part: its neighbourhood's advertisements and
    # their proof; every site that stays checks it and seals shares for its holders.
    start = time.perf_counter()
    committed = CommittedRoster(roster)
    degree = n - 1 if graph is None else graph[0]
    masking = MaskingGraph.derive(
        committed.ids, degree=degree, seed=committed.seed(threshold, graph)
    )
    part_of = {s: committed.part(masking.neighbourhood(s)) for s in ids}
    coordinator = time.perf_counter() - start
    ids_bytes = sum(len(s) for s in committed.ids)
    sealed: dict[str, dict[str, bytes]] = {}
    for s in ids:
        if s in drop_share:
            continue
        part = part_of[s]
        leaves = sum(_advert_bytes(a) for a in part.leaves.values())
        receive(s, "roster", ids_bytes + 8 + leaves + 32 * len(part.proof) + 16)
        sealed[s] = timed(
            s,
            lambda s=s, part=part: sites[s].share(
                part, registered=registered, threshold=threshold, graph=graph
            ),
        )
        sent[s] += sum(len(b) + len(r) for r, b in sealed[s].items())
    sharing = sorted(sealed)
    for s in sharing:
        box = {p: b[s] for p, b in sealed.items() if s in b}
        receive(s, "shares", sum(len(b) + len(p) for p, b in box.items()))
        timed(s, lambda s=s, box=box: sites[s].receive(box))
    participants = sharing
    bitmap = (n + 7) // 8  # a set of roster sites on the wire

    plain = {s: rng.integers(-(2**20), 2**20, size=length, endpoint=True) for s in participants}
    running = MaskedSum(length, bits=BITS)
    words: list[int] = []
    real_expand = masks_module.expand_mask

    def counting(key: bytes, size: int, *, bits: int) -> np.ndarray:
        words.append(size)
        return real_expand(key, size, bits=bits)

    masks_module.expand_mask = counting  # counts the site's mask words; restored below
    mask_words: list[int] = []
    try:
        outcome = "ok"
        for s in participants:
            receive(s, "sets", bitmap)
            if s in drop_mask:
                continue
            words.clear()
            try:
                vector = timed(
                    s,
                    lambda s=s: sites[s].mask(
                        encode_signed(plain[s], bits=BITS, bound=2**20),
                        participants=participants,
                    ),
                )
            except SecureSumError as exc:
                outcome = f"aborted at mask ({type(exc).__name__})"
                break
            mask_words.append(sum(words))
            sent[s] += vector.nbytes
            start = time.perf_counter()
            running.add(s, vector)
            coordinator += time.perf_counter() - start
            del vector
    finally:
        masks_module.expand_mask = real_expand

    result: dict[str, Any] = {
        "sites": n,
        "dropout": delta,
        "length": length,
        "corrupt": corrupt,
        "graph": "sparse" if graph is not None else "complete",
        "degree": graph[0] if graph is not None else n - 1,
        "neighbourhood_threshold": graph[1] if graph is not None else threshold,
        "threshold": threshold,
        "dropped": {"share": len(drop_share), "mask": len(drop_mask), "answer": len(drop_answer)},
    }
    if outcome == "ok":
        try:
            start = time.perf_counter()
            request = plan_unmask(running.sites, participants=participants, threshold=threshold)
            coordinator += time.perf_counter() - start
            survivors = sorted(request.survivors)
            signatures = {}
            for s in survivors:
                receive(s, "sets", bitmap + 16)
                signatures[s] = timed(
                    s,
                    lambda s=s: sites[s].sign_view(survivors, identity_key=identities[s]),
                )
                sent[s] += len(signatures[s])
            start = time.perf_counter()
            book = SignatureBook(signatures)  # the coordinator commits what it forwards
            coordinator += time.perf_counter() - start
            answers = []
            for s in survivors:
                if s in drop_answer:
                    continue
                receive(s, "sets", 3 * bitmap + 32)  # survivors, dropped, signers; the root
                drawn = timed(
                    s,
                    lambda s=s: sites[s].draw(request, signers=book.signers, root=book.root),
                )
                sent[s] += 4 * len(drawn)
                start = time.perf_counter()
                opened, proof = book.open(drawn)
                coordinator += time.perf_counter() - start
                receive(
                    s,
                    "signatures",
                    sum(len(b) + len(o) for o, b in opened.items()) + 32 * len(proof),
                )
                response = timed(
                    s,
                    lambda s=s, opened=opened, proof=proof: sites[s].reveal(
                        request, signatures=opened, proof=proof, registered=registered
                    ),
                )
                sent[s] += sum(
                    len(b) + len(o)
                    for shares in (response.seed_shares, response.key_shares)
                    for o, b in shares.items()
                )
                answers.append(response)
            start = time.perf_counter()
            total = running.unmask(
                answers,
                roster=roster,
                participants=participants,
                threshold=threshold,
                round_id=round_id,
                graph=masking,
                graph_threshold=None if graph is None else graph[1],
            )
            coordinator += time.perf_counter() - start
            expected = np.sum([plain[s] for s in survivors], axis=0)
            exact = bool(np.array_equal(centre(total, bits=BITS), expected))
            result |= {"exact": exact}
        except SecureSumError as exc:
            outcome = f"aborted at unmask ({type(exc).__name__})"
    active = [s for s in ids if s not in drop_share]
    result |= {
        "outcome": outcome,
        "site_seconds_median": statistics.median(seconds[s] for s in active),
        "site_seconds_max": max(seconds[s] for s in active),
        "site_sent_bytes_median": statistics.median(sent[s] for s in active),
        "site_received_bytes_median": statistics.median(received[s] for s in active),
        "site_received_bytes_by_part": {
            what: statistics.median(got.get(s, 0) for s in active)
            for what, got in sorted(parts.items())
        },
        "site_mask_words": max(mask_words, default=0),
        "coordinator_seconds": coordinator,
        "coordinator_sum_bytes": running.total.nbytes,
    }
    return result


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _shamir_row(k: int, t: int, repeats: int) -> dict[str, Any]:
    """Split and combine times (ms, medians) of one 32-byte secret among ``k + 1`` holders at
    threshold ``t``: ours and Flower's."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares

    from prism_runtime.secure_sum import combine_secret, split_secret

    secret, holders = bytes(range(32)), [f"s{i:04d}" for i in range(k + 1)]
    used = dict(list(split_secret(secret, threshold=t, holders=holders).items())[:t])
    theirs = create_shares(secret, t, k + 1)[:t]
    return {
        "holders": k + 1,
        "threshold": t,
        "split_ms": _median_ms(lambda: split_secret(secret, threshold=t, holders=holders), repeats),
        "combine_ms": _median_ms(
            lambda: combine_secret(used, threshold=t, holders=holders, secret_bytes=32, what="x"),
            repeats,
        ),
        "flower_split_ms": _median_ms(lambda: create_shares(secret, t, k + 1), repeats),
        "flower_combine_ms": _median_ms(lambda: combine_shares(theirs), repeats),
    }


def time_shamir(pairs: list[str], repeats: int) -> list[dict[str, Any]]:
    """``_shamir_row`` for each ``K:T`` of ``pairs``, printed as it is measured."""
    rows = []
    for pair in pairs:
        k, t = (int(v) for v in pair.split(":"))
        rows.append(_shamir_row(k, t, repeats))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[10, 100, 300, 1000])
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    parser.add_argument("--length", type=int, nargs="+", default=[74_498])
    parser.add_argument("--corrupt", type=float, default=0.1, help="colluders allowed for (c/n)")
    parser.add_argument("--graph", choices=["sparse", "complete"], default="sparse")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shamir", nargs="+", metavar="K:T", help="time the Shamir fields only")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    meta = {"machine": platform.processor() or platform.machine(), "date": str(date.today())}
    if args.shamir:
        rows = time_shamir(args.shamir, args.repeats)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "shamir": rows}, indent=1) + "\n")
        return
    rows = []
    for length in args.length:
        for n in args.sites:
            for delta in args.dropout:
                row = simulate(
                    n,
                    delta=delta,
                    length=length,
                    corrupt=args.corrupt,
                    sparse=args.graph == "sparse",
                    seed=args.seed,
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
