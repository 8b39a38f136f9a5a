"""Training files with PEOPLE for the person-level study (docs/benchmarks.md, "Per-patient
privacy"): each row gets a ``patient_id``.

* ``sst2``: SST-2's training rows in a seeded random order, cut into synthetic people of
  heavy-tailed sizes (Zipf: ``P(c) ~ c^-s`` for 1 to ``--max-records`` records, ``s =
  --zipf``), each person's rows consecutive in that order (so a person's rows are a random
  sample of the data, not of one label).
* ``medqp``: medical question pairs grouped by the ASKER: the first question's text identifies
  the person who asked it, and every pair written from it is one of their records (real
  multi-record units: the dataset pairs each question with a similar and a dissimilar one).

With ``--cap K`` the file keeps at most K records of each person (a random chunk, seeded): the
group-privacy baseline's data, whose per-record guarantee converts to one per person by group
privacy with group size K (``prism_core.accounting.group_privacy``).

``report FOLDER`` prints one markdown table of every ``bench/utility.py`` study under FOLDER
(one study per sub-folder): its unit, the epsilon per person it stands for (a record-level study
of capped data: by group privacy at the cap given with ``--group name=K``), and the held-out
accuracy per seed.

Run::

    .venv/bin/python bench/people.py sst2 ../shared/data/sst2/train.jsonl \\
        bench-results/people/sst2.jsonl
    .venv/bin/python bench/people.py sst2 ../shared/data/sst2/train.jsonl \\
        bench-results/people/sst2-k4.jsonl --cap 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

FIELD = "patient_id"


def _read(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def zipf_people(
    rows: list[dict[str, Any]], *, exponent: float, max_records: int, seed: int
) -> list[dict[str, Any]]:
    """``rows`` in a seeded order, each with a synthetic person of Zipf-distributed size."""
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    sizes = list(range(1, max_records + 1))
    weights = [c**-exponent for c in sizes]
    out, person, at = [], 0, 0
    while at < len(order):
        size = rng.choices(sizes, weights)[0]
        for i in order[at : at + size]:
            out.append({**rows[i], FIELD: f"person-{person}"})
        at += size
        person += 1
    return out


def askers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pair with the person who asked its first question (a digest of its text)."""
    return [
        {**r, FIELD: "asker-" + hashlib.sha256(r["text_a"].encode()).hexdigest()[:12]} for r in rows
    ]


def cap_records(rows: list[dict[str, Any]], cap: int, seed: int) -> list[dict[str, Any]]:
    """At most ``cap`` rows of each person: a seeded random chunk, in the file's order."""
    rng = random.Random(seed + 1)
    by_person: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        by_person[r[FIELD]].append(i)
    keep: set[int] = set()
    for indices in by_person.values():
        keep.update(rng.sample(indices, cap) if len(indices) > cap else indices)
    return [r for i, r in enumerate(rows) if i in keep]


def _runs(folder: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted((folder / "runs").glob("*.json")):
        if not path.name.endswith(".spec.json"):
            runs.append(json.loads(path.read_text()))
    return runs


def report(folder: Path, groups: dict[str, int]) -> str:
    """The markdown table of every study under ``folder`` (see the module docstring)."""
    import statistics

    from prism_core.accounting import group_privacy

    lines = [
        "| study | unit | epsilon per person (per record) | seeds | dev acc per seed "
        "| dev mean +- sd | selection mean | epsilon spent (max over sites) | run CPU s (mean) |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for study in sorted(p for p in folder.iterdir() if (p / "runs").is_dir()):
        runs = sorted(_runs(study), key=lambda r: r["spec"]["seed"])
        if not runs:
            continue
        spec = runs[0]["spec"]
        unit = spec["settings"].get("privacy-unit", "record")
        eps, delta = spec["epsilon"], spec["delta"]
        if unit == "user":
            per_person = f"{eps:g}"
        elif study.name in groups:
            k = groups[study.name]
            person_eps, person_delta = group_privacy(eps, delta, k)
            per_person = f"{person_eps:.3g} at delta {person_delta:.2g}, k = {k} ({eps:g})"
        else:
            per_person = f"- ({eps:g})"
        dev_key = next(k for k in runs[0]["metrics"] if k != "select")
        dev = [r["metrics"][dev_key]["accuracy"] for r in runs]
        select = [r["metrics"]["select"]["accuracy"] for r in runs]
        spent = max(s["epsilon"] for r in runs for s in r["privacy"]["sites"])
        sd = f" +- {statistics.stdev(dev):.4f}" if len(dev) > 1 else ""
        lines.append(
            f"| {study.name} | {unit} | {per_person} | {len(runs)} | "
            f"{' / '.join(f'{a:.3f}' for a in dev)} | {statistics.mean(dev):.4f}{sd} | "
            f"{statistics.mean(select):.4f} | {spent:.3f} | "
            f"{statistics.mean(r['total_cpu_s'] for r in runs):.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "report":
        parsed = argparse.ArgumentParser(prog="people.py report")
        parsed.add_argument("folder", type=Path)
        parsed.add_argument("--group", action="append", default=[], help="STUDY=K")
        opts = parsed.parse_args(argv[1:])
        groups = {k: int(v) for k, _, v in (g.partition("=") for g in opts.group)}
        print(report(opts.folder, groups))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["sst2", "medqp"])
    parser.add_argument("train", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--zipf", type=float, default=2.0, help="sst2: Zipf exponent s")
    parser.add_argument("--max-records", type=int, default=50, help="sst2: largest person")
    parser.add_argument("--cap", type=int, default=0, help="keep at most K records per person")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = _read(args.train)
    if args.kind == "sst2":
        rows = zipf_people(rows, exponent=args.zipf, max_records=args.max_records, seed=args.seed)
    else:
        rows = askers(rows)
    if args.cap:
        rows = cap_records(rows, args.cap, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    counts = Counter(r[FIELD] for r in rows)
    sizes = sorted(counts.values())
    print(
        f"{args.out}: {len(rows)} rows, {len(counts)} people, records per person: median "
        f"{sizes[len(sizes) // 2]}, mean {len(rows) / len(counts):.2f}, max {sizes[-1]}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
