"""Time one PRISM mechanism step against the dense reference it replaces.

One step (docs/design.md §2, steps 2-5 and 7) for every LoRA module of a configuration:

* low-dimensional path (``prism_core`` from raw per-example factor gradients, as the trainer
  runs it with Opacus' hooks; its default takes rows the layers already whitened,
  ``clip_and_sum_whitened``, timed by ``bench/step.py``): per-step thin-QR frames of
  all modules (``step_frames``, phase "lift / project"), the fused lift + intrinsic norm +
  global clip + sum of the per-example factor gradients ``(gA_i, gB_i)``
  (``clip_and_sum_grads``, phase "norm + clip + sum"), tangent noise and division by b
  (``privatize``), and the QR + 2r x 2r SVD retraction of every module (``retract_modules``);
* with ``--compare-reference``, also the "before" path: the same step with the pre-fusion code
  frozen in ``bench/reference_mechanism.py`` (per-example ``lift``, then ``clip_and_sum``,
  ``privatize`` and a per-module ``retract``), timed interleaved with the low-dim path in the
  same process so that both see the same load;
* dense reference: per-example gradients ``G_i`` (m x n), ``project_dense`` of each, dense
  Frobenius norms, the same global clip, a dense Gaussian ``Xi`` (m x n) projected with
  ``project_dense``, and a rank-r truncated ``torch.linalg.svd`` of ``Z + step * dZ``.

All paths get the same inputs (``gA_i = G_i B``, ``gB_i = G_i.T A``, with ``gB_i`` laid out as
Opacus delivers it: the transpose of ``lora_A``'s (b, r, n) per-example gradient) wherever the
dense per-example gradients fit in memory; the clipped sums of the paths are checked to agree
before timing. Run::

    .venv/bin/python bench/mechanism.py [--repeats N] [--out FILE.json]
        [--threads T] [--clock {wall,cpu}] [--skip-gemma] [--skip-dense] [--compare-reference]
        [--contiguous-grads]

It prints markdown tables to stdout (the numbers in ``docs/benchmarks.md``), progress to
stderr, and optionally writes the raw timings (both clocks) as JSON. On a machine shared with
other jobs, multi-threaded MKL/OpenMP wall-clock times degrade by an order of magnitude; use
``--threads 1 --clock cpu`` there for numbers that depend little on the other jobs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from prism_core.manifold import Point, project_dense, retract, tangent_to_dense
from prism_core.mechanism import (
    clip_and_sum_grads,
    clip_coefficients,
    privatize,
    retract_modules,
    step_frames,
)

try:  # run as a script: bench/ is on sys.path
    import reference_mechanism as reference
except ImportError:  # imported as bench.mechanism
    from bench import reference_mechanism as reference

NOISE_MULTIPLIER = 1.0
MAX_NORM = 1.0
LEARNING_RATE = 1e-3
DATASET_SIZE = 50_000  # N_site; only sets the recorded sample rate q = b / N
DTYPE = torch.float32
LOG = logging.getLogger("bench.mechanism")
PHASES = ("lift / project", "norm + clip + sum", "noise", "retract")


@dataclass(frozen=True)
class Module:
    """One LoRA module: ``m = out_features``, ``n = in_features`` (docs/design.md §1)."""

    name: str
    m: int
    n: int


@dataclass(frozen=True)
class Config:
    """A set of modules sharing the LoRA rank r."""

    name: str
    modules: tuple[Module, ...]
    r: int


MINILM = Config(
    name="MiniLM (6 layers x {query, value})",
    modules=tuple(Module(f"layer{i}.{p}", 384, 384) for i in range(6) for p in ("query", "value")),
    r=8,
)

GEMMA_LAYER = Config(
    name="Gemma-3-4B, one decoder layer",
    modules=(
        Module("q_proj", 2048, 2560),
        Module("k_proj", 1024, 2560),
        Module("v_proj", 1024, 2560),
        Module("o_proj", 2560, 2048),
        Module("gate_proj", 10240, 2560),
        Module("up_proj", 10240, 2560),
        Module("down_proj", 2560, 10240),
    ),
    r=16,
)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""``wall``: elapsed time. ``cpu``: CPU seconds of this process, summed over its threads; with
``--threads 1`` it is robust to other processes sharing the cores."""


@dataclass
class PhaseTimer:
    """Collects seconds per phase on every clock, one list entry per repeat."""

    seconds: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: {clock: {} for clock in CLOCKS}
    )

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = {clock: read() for clock, read in CLOCKS.items()}
        yield
        for clock, read in CLOCKS.items():
            self.seconds[clock].setdefault(phase, []).append(read() - start[clock])

    def totals(self, clock: str) -> list[float]:
        """Per-repeat total over all phases."""
        return [sum(parts) for parts in zip(*self.seconds[clock].values(), strict=True)]


@dataclass(frozen=True)
class Timing:
    """Median milliseconds of one path, in total and per phase, on every clock."""

    repeats: int
    median_ms: dict[str, float]
    phase_ms: dict[str, dict[str, float]]

    @staticmethod
    def from_timer(timer: PhaseTimer) -> Timing:
        return Timing(
            repeats=len(timer.totals("wall")),
            median_ms={c: 1e3 * statistics.median(timer.totals(c)) for c in CLOCKS},
            phase_ms={
                c: {k: 1e3 * statistics.median(v) for k, v in timer.seconds[c].items()}
                for c in CLOCKS
            },
        )


# --------------------------------------------------------------------------- inputs


def make_points(config: Config, gen: torch.Generator) -> list[Point]:
    """Random full-rank factors with ``||A||_F ~ ||B||_F ~ 1`` (balanced, well conditioned)."""
    r = config.r
    return [
        Point(
            torch.randn(mod.m, r, generator=gen, dtype=DTYPE) / math.sqrt(mod.m),
            torch.randn(mod.n, r, generator=gen, dtype=DTYPE) / math.sqrt(mod.n),
        )
        for mod in config.modules
    ]


def make_dense_grads(config: Config, b: int, gen: torch.Generator) -> list[Tensor]:
    """Per-example dense gradients ``G_i`` (b, m, n), one tensor per module."""
    return [
        torch.randn(b, mod.m, mod.n, generator=gen, dtype=DTYPE) / math.sqrt(mod.m * mod.n)
        for mod in config.modules
    ]


OPACUS_LAYOUT = True
"""Lay ``gB`` out as Opacus does (``--contiguous-grads`` turns it off: (b, n, r) row-major)."""


def opacus_layout(gB: Tensor) -> Tensor:
    """``gB`` (b, n, r) stored as Opacus stores ``lora_A``'s gradient: (b, r, n), transposed."""
    return gB.mT.contiguous().mT if OPACUS_LAYOUT else gB.contiguous()


def factor_grads(points: Sequence[Point], dense: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """``gA_i = G_i B`` and ``gB_i = G_i.T A`` from the dense gradients (same inputs)."""
    return [(G @ p.B, opacus_layout((p.A.mT @ G).mT)) for p, G in zip(points, dense, strict=True)]


def random_factor_grads(
    config: Config, b: int, gen: torch.Generator
) -> list[tuple[Tensor, Tensor]]:
    """Random ``(gA_i, gB_i)`` of the right shapes, for batches whose ``G_i`` cannot be held."""
    r = config.r
    return [
        (
            torch.randn(b, mod.m, r, generator=gen, dtype=DTYPE) / math.sqrt(mod.m),
            opacus_layout(torch.randn(b, mod.n, r, generator=gen, dtype=DTYPE) / math.sqrt(mod.n)),
        )
        for mod in config.modules
    ]


# --------------------------------------------------------------------------- the two paths


def lowdim_step(
    points: Sequence[Point],
    grads: Sequence[tuple[Tensor, Tensor]],
    *,
    b: int,
    gen: torch.Generator,
    timer: PhaseTimer,
) -> list[Point]:
    """One PRISM step with ``prism_core``: O((m + n) r^2) per example and module."""
    with timer("lift / project"):
        frames = step_frames(points)
    with timer("norm + clip + sum"):
        clipped = clip_and_sum_grads(points, grads, max_norm=MAX_NORM, frames=frames)
    with timer("noise"):
        updates = privatize(
            points,
            clipped,
            noise_multiplier=NOISE_MULTIPLIER,
            max_norm=MAX_NORM,
            expected_batch_size=b,
            sample_rate=b / DATASET_SIZE,
            generator=gen,
            frames=frames,
        ).tangents
    with timer("retract"):
        return retract_modules(frames, updates, -LEARNING_RATE)


def reference_step(
    points: Sequence[Point],
    grads: Sequence[tuple[Tensor, Tensor]],
    *,
    b: int,
    gen: torch.Generator,
    timer: PhaseTimer,
) -> list[Point]:
    """The same step with the pre-fusion code (``bench/reference_mechanism.py``)."""
    with timer("lift / project"):
        lifts = [
            reference.lift(p.A, p.B, gA, gB) for p, (gA, gB) in zip(points, grads, strict=True)
        ]
    with timer("norm + clip + sum"):
        clipped = reference.clip_and_sum(points, lifts, max_norm=MAX_NORM)
    with timer("noise"):
        updates = reference.privatize(
            points,
            clipped,
            noise_multiplier=NOISE_MULTIPLIER,
            max_norm=MAX_NORM,
            expected_batch_size=b,
            sample_rate=b / DATASET_SIZE,
            generator=gen,
        ).tangents
    with timer("retract"):
        return [
            retract(p.A, p.B, u.dA, u.dB, -LEARNING_RATE)
            for p, u in zip(points, updates, strict=True)
        ]


def dense_clipped_sums(
    points: Sequence[Point], dense: Sequence[Tensor], timer: PhaseTimer
) -> list[Tensor]:
    """Dense projection of every ``G_i``, Frobenius norms, global clip, clipped sum (m x n)."""
    with timer("lift / project"):
        projected = [project_dense(p.A, p.B, G) for p, G in zip(points, dense, strict=True)]
    with timer("norm + clip + sum"):
        norms_sq = torch.stack([P.square().sum(dim=(-2, -1)) for P in projected])
        alpha = clip_coefficients(norms_sq, MAX_NORM)
        return [torch.einsum("b,bmn->mn", alpha, P) for P in projected]


def dense_step(
    points: Sequence[Point],
    dense: Sequence[Tensor],
    *,
    b: int,
    gen: torch.Generator,
    timer: PhaseTimer,
) -> list[Point]:
    """The dense reference step: m x n per example, dense noise, full SVD truncated to rank r."""
    sums = dense_clipped_sums(points, dense, timer)
    scale = NOISE_MULTIPLIER * MAX_NORM
    with timer("noise"):
        directions = []
        for p, s in zip(points, sums, strict=True):
            xi = torch.randn(s.shape, generator=gen, dtype=s.dtype)
            directions.append((s + scale * project_dense(p.A, p.B, xi)) / b)
    with timer("retract"):
        new_points = []
        for p, dZ in zip(points, directions, strict=True):
            r = p.A.shape[-1]
            U, S, Vh = torch.linalg.svd(p.A @ p.B.mT - LEARNING_RATE * dZ, full_matrices=False)
            root = S[:r].sqrt()
            new_points.append(Point(U[:, :r] * root, Vh[:r].mT * root))
        return new_points


def agreement(
    points: Sequence[Point], grads: Sequence[tuple[Tensor, Tensor]], dense: Sequence[Tensor]
) -> float:
    """Max relative difference between the clipped sums of the two paths (noise-free)."""
    clipped = clip_and_sum_grads(points, grads, max_norm=MAX_NORM)
    dense_sums = dense_clipped_sums(points, dense, PhaseTimer())
    worst = 0.0
    for p, t, ref in zip(points, clipped.sums, dense_sums, strict=True):
        ours = tangent_to_dense(p.A, p.B, t.dA, t.dB)
        worst = max(worst, float((ours - ref).norm() / ref.norm().clamp_min(1e-30)))
    return worst


def reference_agreement(
    points: Sequence[Point], grads: Sequence[tuple[Tensor, Tensor]], *, b: int
) -> float:
    """Max relative difference between the noise-free released updates (clipped sums / b) of
    the low-dim path and the pre-fusion reference, compared as dZ = dA B.T + A dB.T (the
    released object; ``privatize`` releases its min-norm lift, the reference the plain lift).
    (The noise samplers are compared in ``tests/prism_core/test_mechanism.py``; they draw
    their Gaussians in different orders.)"""
    kwargs: dict[str, Any] = {
        "noise_multiplier": 0.0,
        "max_norm": MAX_NORM,
        "expected_batch_size": b,
        "sample_rate": b / DATASET_SIZE,
        "generator": torch.Generator(),
    }
    ours = privatize(points, clip_and_sum_grads(points, grads, max_norm=MAX_NORM), **kwargs)
    lifts = [reference.lift(p.A, p.B, gA, gB) for p, (gA, gB) in zip(points, grads, strict=True)]
    theirs = reference.privatize(
        points, reference.clip_and_sum(points, lifts, max_norm=MAX_NORM), **kwargs
    )
    worst = 0.0
    for p, a, r in zip(points, ours.tangents, theirs.tangents, strict=True):
        x, y = tangent_to_dense(p.A, p.B, *a), tangent_to_dense(p.A, p.B, *r)
        worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-30)))
    return worst


def time_path(
    label: str, step: Callable[[PhaseTimer], object], *, warmup: int, repeats: int
) -> Timing:
    """Run ``step`` ``warmup`` times untimed, then ``repeats`` times timed; return medians."""
    for _ in range(warmup):
        step(PhaseTimer())
    timer = PhaseTimer()
    for _ in range(repeats):
        step(timer)
    timing = Timing.from_timer(timer)
    LOG.info(
        "  %s: median %.2f ms wall, %.2f ms CPU over %d repeats",
        label,
        timing.median_ms["wall"],
        timing.median_ms["cpu"],
        repeats,
    )
    return timing


def time_interleaved(
    steps: dict[str, Callable[[PhaseTimer], object]], *, warmup: int, repeats: int
) -> dict[str, Timing]:
    """Time several paths in alternation (the order rotating every repeat), so a change in the
    machine's load during the run falls on all of them alike; return medians per path."""
    timers = {label: PhaseTimer() for label in steps}
    labels = list(steps)
    for _ in range(warmup):
        for step in steps.values():
            step(PhaseTimer())
    for rep_index in range(repeats):
        shift = rep_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            steps[label](timers[label])
    timings = {label: Timing.from_timer(timer) for label, timer in timers.items()}
    for label, timing in timings.items():
        LOG.info(
            "  %s: median %.2f ms wall, %.2f ms CPU over %d repeats",
            label,
            timing.median_ms["wall"],
            timing.median_ms["cpu"],
            repeats,
        )
    return timings


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Row:
    """One line of the results table."""

    config: str
    b: int
    lowdim: Timing
    dense: Timing | None
    note: str
    lowdim_bytes: int
    dense_bytes: int
    max_rel_diff: float | None = None
    reference: Timing | None = None
    reference_rel_diff: float | None = None

    def ratio(self, clock: str) -> float | None:
        if self.dense is None:
            return None
        return self.dense.median_ms[clock] / self.lowdim.median_ms[clock]

    def speedup(self, clock: str) -> float | None:
        """Pre-fusion reference time over low-dim time, same run."""
        if self.reference is None:
            return None
        return self.reference.median_ms[clock] / self.lowdim.median_ms[clock]


def input_bytes(config: Config, b: int) -> tuple[int, int]:
    """Bytes of per-example gradients, low-dim ``(gA_i, gB_i)`` and dense ``G_i``, all modules."""
    size = torch.finfo(DTYPE).bits // 8
    low = sum(b * (mod.m + mod.n) * config.r for mod in config.modules) * size
    dense = sum(b * mod.m * mod.n for mod in config.modules) * size
    return low, dense


@dataclass(frozen=True)
class LowDim:
    """Timings of the low-dim path and, if compared, of the pre-fusion reference."""

    lowdim: Timing
    reference: Timing | None = None
    reference_rel_diff: float | None = None


def time_lowdim(
    points: Sequence[Point],
    grads: Sequence[tuple[Tensor, Tensor]],
    *,
    b: int,
    seed: int,
    warmup: int,
    repeats: int,
    compare_reference: bool,
) -> LowDim:
    """Time the low-dim path, interleaved with the pre-fusion reference if asked."""
    gen = torch.Generator().manual_seed(seed + 1)
    steps: dict[str, Callable[[PhaseTimer], object]] = {
        "low-dim": lambda t: lowdim_step(points, grads, b=b, gen=gen, timer=t)
    }
    diff = None
    if compare_reference:
        diff = reference_agreement(points, grads, b=b)
        LOG.info("  noise-free updates agree with the pre-fusion reference to %.1e", diff)
        steps["before"] = lambda t: reference_step(points, grads, b=b, gen=gen, timer=t)
    timings = time_interleaved(steps, warmup=warmup, repeats=repeats)
    return LowDim(timings["low-dim"], timings.get("before"), diff)


def run_pair(
    config: Config,
    b: int,
    *,
    seed: int,
    warmup: int,
    repeats: int,
    dense_warmup: int,
    dense_repeats: int,
    note: str,
    compare_reference: bool = False,
) -> Row:
    """Time the paths on the same inputs (``gA_i = G_i B``, ``gB_i = G_i.T A``)."""
    gen = torch.Generator().manual_seed(seed)
    points = make_points(config, gen)
    dense = make_dense_grads(config, b, gen)
    grads = factor_grads(points, dense)
    LOG.info("%s, b=%d: inputs ready", config.name, b)
    diff = agreement(points, grads, dense)
    LOG.info("  clipped sums agree to %.1e (relative)", diff)
    low = time_lowdim(
        points,
        grads,
        b=b,
        seed=seed,
        warmup=warmup,
        repeats=repeats,
        compare_reference=compare_reference,
    )
    ref = time_path(
        "dense",
        lambda t: dense_step(points, dense, b=b, gen=gen, timer=t),
        warmup=dense_warmup,
        repeats=dense_repeats,
    )
    return Row(
        config.name,
        b,
        low.lowdim,
        ref,
        note,
        *input_bytes(config, b),
        max_rel_diff=diff,
        reference=low.reference,
        reference_rel_diff=low.reference_rel_diff,
    )


def run_lowdim_only(
    config: Config,
    b: int,
    *,
    seed: int,
    warmup: int,
    repeats: int,
    note: str,
    compare_reference: bool = False,
) -> Row:
    """Time the low-dimensional path alone (and the reference), on random factor gradients."""
    gen = torch.Generator().manual_seed(seed)
    points = make_points(config, gen)
    grads = random_factor_grads(config, b, gen)
    LOG.info("%s, b=%d: inputs ready", config.name, b)
    low = time_lowdim(
        points,
        grads,
        b=b,
        seed=seed,
        warmup=warmup,
        repeats=repeats,
        compare_reference=compare_reference,
    )
    return Row(
        config.name,
        b,
        low.lowdim,
        None,
        note,
        *input_bytes(config, b),
        reference=low.reference,
        reference_rel_diff=low.reference_rel_diff,
    )


# --------------------------------------------------------------------------- report


def _mib(n: int) -> str:
    mib = n / 2**20
    return f"{mib:,.0f}" if mib >= 10 else f"{mib:.2f}"


def results_table(rows: Sequence[Row], clock: str) -> str:
    lines = [
        "| config | b | low-dim ms | dense ms | dense / low-dim "
        "| per-example grads MiB, low-dim / dense | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        dense = "—" if row.dense is None else f"{row.dense.median_ms[clock]:,.1f}"
        ratio = row.ratio(clock)
        ratio_s = "—" if ratio is None else f"{ratio:,.0f}x"
        lines.append(
            f"| {row.config} | {row.b} | {row.lowdim.median_ms[clock]:,.2f} | {dense} | {ratio_s} "
            f"| {_mib(row.lowdim_bytes)} / {_mib(row.dense_bytes)} | {row.note} |"
        )
    return "\n".join(lines)


def speedup_table(rows: Sequence[Row], clock: str) -> str:
    """Before (pre-fusion reference) vs after (low-dim), timed interleaved in this run."""
    lines = [
        "| config | b | before ms | after ms | before / after | noise-free update max rel diff |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        speedup = row.speedup(clock)
        if row.reference is None or speedup is None:
            continue
        lines.append(
            f"| {row.config} | {row.b} | {row.reference.median_ms[clock]:,.2f} "
            f"| {row.lowdim.median_ms[clock]:,.2f} | {speedup:.2f}x "
            f"| {row.reference_rel_diff:.1e} |"
        )
    return "\n".join(lines)


def phase_table(rows: Sequence[Row], clock: str) -> str:
    lines = [
        "| config | b | path | " + " | ".join(PHASES) + " | total |",
        "| --- | ---: | --- | " + " | ".join("---:" for _ in PHASES) + " | ---: |",
    ]
    for row in rows:
        paths = (("low-dim", row.lowdim), ("before", row.reference), ("dense", row.dense))
        for path, timing in paths:
            if timing is None:
                continue
            cells = " | ".join(f"{timing.phase_ms[clock][p]:,.2f}" for p in PHASES)
            total = timing.median_ms[clock]
            lines.append(f"| {row.config} | {row.b} | {path} | {cells} | {total:,.2f} |")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "uncommitted"
    return {
        "cpu": cpu,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "commit": commit,
        "dtype": str(DTYPE),
        "load_average_1min": os.getloadavg()[0],
    }


def _to_json(row: Row) -> dict[str, Any]:
    def timing(t: Timing | None) -> dict[str, Any] | None:
        if t is None:
            return None
        return {"repeats": t.repeats, "median_ms": t.median_ms, "phase_ms": t.phase_ms}

    return {
        "config": row.config,
        "b": row.b,
        "lowdim": timing(row.lowdim),
        "dense": timing(row.dense),
        "before_reference": timing(row.reference),
        "ratio_before_over_lowdim": {clock: row.speedup(clock) for clock in CLOCKS},
        "max_rel_diff_noise_free_update_vs_before": row.reference_rel_diff,
        "ratio_dense_over_lowdim": {clock: row.ratio(clock) for clock in CLOCKS},
        "per_example_grad_bytes": {"lowdim": row.lowdim_bytes, "dense": row.dense_bytes},
        "max_rel_diff_clipped_sum": row.max_rel_diff,
        "note": row.note,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up runs (default 3)")
    parser.add_argument(
        "--gemma-dense-repeats",
        type=int,
        default=3,
        help="timed repeats of the Gemma dense path, 20-75 s each on 2 cores (default 3)",
    )
    parser.add_argument(
        "--gemma-dense-batch",
        type=int,
        default=4,
        help="b for the Gemma dense comparison; 64 dense m x n gradients do not fit (default 4)",
    )
    parser.add_argument("--batch", type=int, default=64, help="b of the low-dim path (default 64)")
    parser.add_argument("--skip-gemma", action="store_true", help="MiniLM shapes only")
    parser.add_argument(
        "--skip-dense", action="store_true", help="no dense reference (low-dim rows only)"
    )
    parser.add_argument(
        "--contiguous-grads",
        action="store_true",
        help="gB as a row-major (b, n, r) tensor instead of Opacus' transposed (b, r, n) layout",
    )
    parser.add_argument(
        "--compare-reference",
        action="store_true",
        help="also time the pre-fusion code (bench/reference_mechanism.py), interleaved",
    )
    parser.add_argument(
        "--threads", type=int, help="torch.set_num_threads (default: leave torch's default)"
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="which clock the printed tables use; the JSON has both (default wall)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    parser.add_argument("--out", type=Path, help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(message)s",
        stream=sys.stderr,
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    global OPACUS_LAYOUT
    OPACUS_LAYOUT = not args.contiguous_grads
    env = environment()
    env["gB_layout"] = "opacus (b, r, n) transposed" if OPACUS_LAYOUT else "row-major (b, n, r)"
    started = time.perf_counter()
    rows = []
    common = {
        "seed": args.seed,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "compare_reference": args.compare_reference,
    }
    with torch.inference_mode():
        if args.skip_dense:
            rows.append(run_lowdim_only(MINILM, args.batch, note="low-dim only", **common))
        else:
            rows.append(
                run_pair(
                    MINILM,
                    args.batch,
                    dense_warmup=args.warmup,
                    dense_repeats=args.repeats,
                    note="same inputs",
                    **common,
                )
            )
        if not args.skip_gemma:
            rows.append(run_lowdim_only(GEMMA_LAYER, args.batch, note="low-dim only", **common))
        if not (args.skip_gemma or args.skip_dense):
            rows.append(
                run_pair(
                    GEMMA_LAYER,
                    args.gemma_dense_batch,
                    dense_warmup=0,
                    dense_repeats=args.gemma_dense_repeats,
                    note=f"same inputs; dense median of {args.gemma_dense_repeats}",
                    **common,
                )
            )
    elapsed = time.perf_counter() - started
    env["load_average_1min_end"] = os.getloadavg()[0]

    print(
        f"CPU: {env['cpu']} | torch {env['torch']} ({env['torch_threads']} threads) | "
        f"{env['dtype']} | gB {env['gB_layout']} | {env['date']} | commit {env['commit']} | "
        f"{elapsed:.0f} s total | "
        f"1-min load average {env['load_average_1min']:.2f} at start, "
        f"{env['load_average_1min_end']:.2f} at end\n"
    )
    clock = "wall-clock" if args.clock == "wall" else "CPU-time"
    print(f"Median {clock} ms per step:\n")
    print(results_table(rows, args.clock))
    if args.compare_reference:
        print(f"\nBefore (pre-fusion code) vs after, median {clock} ms, interleaved:\n")
        print(speedup_table(rows, args.clock))
    print(f"\nMedian {clock} ms per phase:\n")
    print(phase_table(rows, args.clock))
    diffs = [
        f"{r.config} b={r.b}: {r.max_rel_diff:.1e}" for r in rows if r.max_rel_diff is not None
    ]
    if diffs:
        print(
            "\nMax relative difference of the clipped sums, low-dim vs dense: " + "; ".join(diffs)
        )
    if args.out is not None:
        payload = {"environment": env, "elapsed_s": elapsed, "results": [_to_json(r) for r in rows]}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
