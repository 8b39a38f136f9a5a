"""Time and peak memory of the accountant calls a coordinator's numbers can trigger at a site.

A site answers every request with accountant calls BEFORE any charge: the calibration of sigma
(``calibrate_noise_multiplier``), the cap check of a round (``epsilon`` of the ledger plus the
planned steps) and the trainer's step budget (``max_steps``). Every number in them is bounded
(``prism_runtime.ranges``): sigma >= SIGMA_MIN, at most SITE_STEPS_MAX steps a run, q in (0, 1].
This measures each call at the corners of those ranges, one fresh process per case (its peak
RSS is the call's memory plus the interpreter's), and prints one table row per case.

    python bench/accountant.py --out bench-results/accountant.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

CASES: list[tuple[str, float, float, int]] = [
    # (call, sigma or target epsilon, q, steps)
    ("epsilon", 0.3, 0.001, 1),
    ("epsilon", 0.3, 0.1, 30),
    ("epsilon", 0.3, 1.0, 1),
    ("epsilon", 0.3, 1.0, 100_000),
    ("epsilon", 0.3, 0.001, 100_000),
    ("epsilon", 1.0, 0.01, 30_000),
    ("epsilon", 2.0, 0.01, 100_000),
    ("epsilon", 0.5, 0.2, 3_000),
    ("max_steps", 0.3, 0.1, 120),
    ("max_steps", 1.0, 0.01, 40_000),
    ("calibrate", 8.0, 1.0, 100_000),
    ("calibrate", 8.0, 0.25, 30),
    ("calibrate", 3.0, 0.01, 100_000),
    ("calibrate", 100.0, 0.5, 1_000),
]


def _one(call: str, value: float, q: float, steps: int) -> dict[str, object]:
    """Run one case in this process; the parent reads its JSON line."""
    from prism_core.accounting import (
        PrivacyEvent,
        calibrate_noise_multiplier,
        epsilon,
        max_steps,
    )

    start = time.perf_counter()
    if call == "epsilon":
        result = epsilon([PrivacyEvent(value, q, steps)], 1e-5)
    elif call == "max_steps":
        result = max_steps(
            [],
            noise_multiplier=value,
            sample_rate=q,
            delta=1e-5,
            target_epsilon=8.0,
            limit=steps,
        )
    else:
        result = calibrate_noise_multiplier(
            target_epsilon=value, delta=1e-5, sample_rate=q, steps=steps
        )
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"result": float(result), "seconds": seconds, "peak_rss_mb": peak_mb}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    parser.add_argument("--case", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case is not None:
        call, value, q, steps = args.case
        print(json.dumps(_one(call, float(value), float(q), int(steps))))
        return 0
    rows = []
    print(f"{'call':<10} {'sigma/eps':>9} {'q':>6} {'steps':>8} {'result':>10} {'s':>7} {'MB':>6}")
    for call, value, q, steps in CASES:
        done = subprocess.run(
            [sys.executable, __file__, "--case", call, str(value), str(q), str(steps)],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        row = {"call": call, "value": value, "q": q, "steps": steps}
        row.update(json.loads(done.stdout.strip().splitlines()[-1]))
        rows.append(row)
        print(
            f"{call:<10} {value:>9g} {q:>6g} {steps:>8d} {row['result']:>10.4g} "
            f"{row['seconds']:>7.2f} {row['peak_rss_mb']:>6.0f}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        machine = {"python": platform.python_version(), "machine": platform.machine()}
        args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
