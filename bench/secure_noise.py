"""Noise of the mean update under secure aggregation, local DP and central PRISM, measured.

At the same epsilon, delta, sampling rate q and number of steps, three ways to release the mean
of K sites' clipped sums (each site: N units, expected Poisson batch b, clip C):

* **secure** (``secure-aggregation = true``, ``min-honest-sites = H``): each site's sigma' is
  ``calibrate_skellam_sigma`` (integer-order RDP), the sum's Skellam parameter ``mu =
  skellam_mu(sigma', l1, l2)`` at the rounded vector's sensitivities (``discrete_sensitivity``
  of the model's coordinate dimension), each site's share ``mu / H`` (``share_mu``). K real
  shares of a ZERO vector are drawn with ``prism_core.distributed.encode_share``, summed,
  decoded (``decode_sum``) and divided by ``K b``. Formula: ``gamma sqrt(2 K mu / H) / (K b)``;
* **local** (plain federated PRISM): each site adds ``N(0, sigma^2 C^2)`` at its PRV sigma
  (``calibrate_noise_multiplier``) to its sum and divides by b; the coordinator averages the K
  releases. Formula: ``sigma C / (sqrt(K) b)``;
* **central** (PRISM on the pooled data, the same q, expected batch ``K b``): ``N(0,
  sigma_c^2 C^2)`` at its PRV sigma, divided by ``K b``. Formula: ``sigma_c C / (K b)``.

The measured value is the sample standard deviation over ``--coords`` coordinates (relative
standard error about ``1 / sqrt(2 coords)``). Expected ratios: local / secure =
``sqrt(H) sigma / sigma'`` times the rounding's inflation; secure / central = ``sqrt(K / H)
sigma' / sigma_c`` times the inflation ``gamma sqrt(2 mu) / (sigma' C)``, about ``1 +
sqrt(d) / 2^20`` (the rounded vector's l2 sensitivity is ``2^20 + sqrt(d)`` steps).

Run::

    .venv/bin/python bench/secure_noise.py            # K in {4, 8}, H in {K/2, K}, epsilon 3, 1

Prints a markdown table and writes ``<out>/secure_noise.json`` (``BENCH_OUT`` or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prism_core.accounting import calibrate_noise_multiplier, calibrate_skellam_sigma
from prism_core.discrete import share_mu
from prism_core.distributed import (
    decode_sum,
    discrete_sensitivity,
    encode_share,
    gamma,
)
from prism_core.skellam_accounting import skellam_mu, skellam_sigma

SST2_POOL_ROWS = 66_349  # SST-2 train (67,349 rows) less the utility study's 1,000 held out
MINILM_DIM = 12 * (384 + 384) * 8 + 2 * 384 + 2  # 12 modules' (X, Y) coordinates + the head


@cache
def prv_sigma(epsilon: float, delta: float, q: float, steps: int) -> float:
    return calibrate_noise_multiplier(
        target_epsilon=epsilon, delta=delta, sample_rate=q, steps=steps
    )


@cache
def skellam_charged_sigma(epsilon: float, delta: float, q: float, steps: int) -> float:
    return calibrate_skellam_sigma(target_epsilon=epsilon, delta=delta, sample_rate=q, steps=steps)


def measure(
    *, sites: int, honest: int, epsilon: float, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """One (K, H, epsilon) row: the three measured standard deviations and their formulas."""
    K, b, C, d = sites, args.batch_size, args.max_norm, args.coords
    site_rows = args.pool_rows // K
    q = b / site_rows
    sigma = prv_sigma(epsilon, args.delta, q, args.steps)  # a site's local DP sigma
    sigma_c = prv_sigma(epsilon, args.delta, (K * b) / (K * site_rows), args.steps)
    sigma_s = skellam_charged_sigma(epsilon, args.delta, q, args.steps)
    l2, l1 = discrete_sensitivity(args.dim)
    mu = skellam_mu(sigma=sigma_s, l1=l1, l2=l2)
    mu_share = share_mu(mu, honest)
    generator = torch.Generator().manual_seed(seed)
    zero = torch.zeros(d, dtype=torch.float64)
    total = sum(
        encode_share(zero, max_norm=C, mu_share=mu_share, source=generator) for _ in range(K)
    )
    secure = decode_sum(total, max_norm=C) / (K * b)  # type: ignore[arg-type]
    local = torch.stack(
        [torch.normal(0.0, sigma * C, (d,), generator=generator, dtype=torch.float64) / b
         for _ in range(K)]
    ).mean(0)  # fmt: skip
    central = torch.normal(0.0, sigma_c * C, (d,), generator=generator, dtype=torch.float64)
    central = central / (K * b)
    formula = {
        "secure": gamma(C) * math.sqrt(2 * K * mu_share) / (K * b),
        "local": sigma * C / (math.sqrt(K) * b),
        "central": sigma_c * C / (K * b),
    }
    measured = {
        "secure": float(secure.std()),
        "local": float(local.std()),
        "central": float(central.std()),
    }
    inflation = gamma(C) * math.sqrt(2 * mu) / (sigma_s * C)
    return {
        "sites": K,
        "honest": honest,
        "epsilon": epsilon,
        "site_rows": site_rows,
        "q": q,
        "sigma_local": sigma,
        "sigma_central": sigma_c,
        "sigma_skellam": sigma_s,
        "share_sigma": skellam_sigma(mu=mu_share, l1=l1, l2=l2),
        "mu": mu,
        "mu_share": mu_share,
        "rounding_inflation": inflation,
        "measured": measured,
        "formula": formula,
        "ratio_local_over_secure": measured["local"] / measured["secure"],
        "expected_local_over_secure": math.sqrt(honest) * sigma / sigma_s / inflation,
        "ratio_secure_over_central": measured["secure"] / measured["central"],
        "expected_secure_over_central": math.sqrt(K / honest) * sigma_s / sigma_c * inflation,
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| epsilon | K | H | sigma local = central (PRV) | sigma' (RDP) | secure std / C | "
        "local std / C | central std / C | local / secure (expected) | "
        "secure / central (expected) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        m = r["measured"]
        lines.append(
            f"| {r['epsilon']:g} | {r['sites']} | {r['honest']} | {r['sigma_local']:.4f} | "
            f"{r['sigma_skellam']:.4f} | {m['secure']:.4e} | {m['local']:.4e} | "
            f"{m['central']:.4e} | {r['ratio_local_over_secure']:.3f} "
            f"({r['expected_local_over_secure']:.3f}) | {r['ratio_secure_over_central']:.4f} "
            f"({r['expected_secure_over_central']:.4f}) |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[3.0, 1.0])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=128, help="expected batch per site")
    parser.add_argument("--steps", type=int, default=30, help="rounds x local steps (1)")
    parser.add_argument("--max-norm", type=float, default=1.0, help="the clip C")
    parser.add_argument(
        "--pool-rows", type=int, default=SST2_POOL_ROWS, help="N total; each site N // K"
    )
    parser.add_argument("--coords", type=int, default=200_000, help="coordinates drawn")
    parser.add_argument(
        "--dim", type=int, default=MINILM_DIM, help="coordinate dimension of the sensitivity"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("BENCH_OUT", "bench-results")) / "secure"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows = [
        measure(sites=K, honest=H, epsilon=eps, args=args, seed=1000 * K + H)
        for eps in args.epsilons
        for K in args.sites
        for H in sorted({max(1, K // 2), K})
    ]
    text = table(rows)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    payload = {"settings": settings, "rows": rows, "wall_s": time.perf_counter() - started}
    (args.out / "secure_noise.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\n{len(rows)} rows in {payload['wall_s']:.0f} s; {args.out / 'secure_noise.json'}")


if __name__ == "__main__":
    main()
