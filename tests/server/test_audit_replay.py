"""Audit part (b): record/replay checks of one real PRISM step, and that they catch bugs."""

from __future__ import annotations

import math

import pytest

from prism_core.mechanism import ClippedSum, privatize
from server.audit.mechanisms import BROKEN, CORRECT, Mechanism
from server.audit.replay import ReplaySettings, build_tiny_model, run_replay_checks

TOL = 1e-3  # float32 release, see ReplaySettings.rel_tol
TENSORS = 6  # 4 LoRA modules (query, value x 2 layers) + classifier weight and bias


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("audit-tiny"))


BLOCK_CHECKS = ("core", "A-perp", "B-perp", "head", "all")


def _run(model_dir: str, mechanism, **settings) -> dict:
    """The checks by short name: sensitivity, noise (independence), and one per block."""
    checks = run_replay_checks(ReplaySettings(**settings), mechanism, model_dir=model_dir)
    out = {}
    for c in checks:
        if c.name.startswith("noise std"):
            out[c.name.split(", ")[1].split(" ")[0]] = c
        else:
            out[c.name.split(" ")[0]] = c
    assert set(out) == {"sensitivity", "noise", *BLOCK_CHECKS}
    return out


@pytest.mark.parametrize("seed", range(3))
def test_the_mechanism_that_trains_passes_with_tight_sensitivity(model_dir, seed):
    """Every check passes on 3 seeds; false alarms: the noise checks at 1e-6 together."""
    checks = _run(model_dir, CORRECT, seed=seed)
    assert all(c.passed for c in checks.values()), [c.detail for c in checks.values()]
    # the added example is clipped, so its effect is exactly C / b: the bound is tight
    assert abs(checks["sensitivity"].measured - 1.0) <= TOL
    assert checks["noise"].measured <= TOL  # noise identical for realised sizes 0, 6 and 9
    assert 0.95 <= checks["all"].measured <= 1.05
    assert "detects sigma_true <=" in checks["core"].detail


def test_noise_off_is_caught(model_dir):
    checks = _run(model_dir, BROKEN["noise-off"])
    assert checks["sensitivity"].passed  # the clip is fine; the noise is missing
    assert not checks["noise"].passed and "NO NOISE" in checks["noise"].detail
    for name in BLOCK_CHECKS:
        assert not checks[name].passed and checks[name].measured == 0.0


@pytest.mark.parametrize("seed", range(2))
def test_half_strength_noise_is_caught_in_every_block(model_dir, seed):
    checks = _run(model_dir, BROKEN["half-noise"], seed=seed)
    assert checks["sensitivity"].passed and checks["noise"].passed
    for name in BLOCK_CHECKS:
        assert not checks[name].passed and 0.4 <= checks[name].measured <= 0.6, name


@pytest.mark.parametrize("seed", range(2))
def test_a_missing_noise_block_is_caught_in_that_block(model_dir, seed):
    """Through the trainer's path: the A-perp block of the release carries no noise."""
    checks = _run(model_dir, BROKEN["no-perp-noise"], seed=seed)
    assert not checks["A-perp"].passed and checks["A-perp"].measured < 1e-3
    assert checks["core"].passed and checks["B-perp"].passed and checks["head"].passed
    assert not checks["all"].passed


def _no_head_noise_privatize(points, clipped, **kw):
    """Tangents noised correctly, the DP head released WITHOUT noise (record still claims sigma)."""
    lora_only = ClippedSum(clipped.sums, clipped.count, clipped.clipped, ())
    step = privatize(points, lora_only, **kw)
    head = [t / kw["expected_batch_size"] for t in clipped.euclidean]
    return step._replace(euclidean=head)


NO_HEAD_NOISE = Mechanism.with_privatize("no-head-noise", _no_head_noise_privatize)


def test_a_head_released_without_noise_is_caught_in_the_head_block(model_dir):
    """The head's 66 coordinates are 6 % of the release: pooled with the tangent blocks their
    missing noise barely moves the std ratio, so the head has its own check, which fails."""
    checks = _run(model_dir, NO_HEAD_NOISE)
    assert not checks["head"].passed and checks["head"].measured == 0.0
    assert all(checks[name].passed for name in ("sensitivity", "noise", "core", "A-perp", "B-perp"))
    assert checks["all"].measured > 0.9  # sqrt(960 / 1026) = 0.967 expected pooled


def test_noise_divided_by_the_realised_batch_is_caught(model_dir):
    checks = _run(model_dir, BROKEN["realised-batch"])
    assert not checks["noise"].passed
    # sizes 0 (divided by 1), 6, 9 against b = 8: the worst std ratio is 8 / 1
    assert not checks["all"].passed
    assert checks["all"].measured == pytest.approx(8.0, rel=0.06)


def test_per_module_clipping_is_caught_by_the_joint_sensitivity(model_dir):
    checks = _run(model_dir, BROKEN["per-module-clip"])
    assert not checks["sensitivity"].passed
    # C is below every module's own norm: each of the 6 tensors is clipped to C separately
    assert checks["sensitivity"].measured == pytest.approx(math.sqrt(TENSORS), rel=TOL)
    assert checks["noise"].passed and all(checks[name].passed for name in BLOCK_CHECKS)


def test_the_audited_release_is_the_one_every_training_step_uses(model_dir, monkeypatch):
    from prism_runtime.data import TokenizedDataset
    from prism_runtime.model import ModelConfig, load_model
    from prism_runtime.synthetic import synthetic_examples
    from prism_runtime.trainer import PrismTrainer, PrivateTrainer, TrainConfig

    calls = []
    original = PrismTrainer.release

    def spy(self, batch, points, **kw):
        out = original(self, batch, points, **kw)
        calls.append((kw, out[0].record))
        return out

    monkeypatch.setattr(PrismTrainer, "release", spy)
    lm = load_model(ModelConfig(model=model_dir, rank=4, head="train"))
    rows = synthetic_examples(32, seed=1)
    config = TrainConfig(noise_multiplier=1.3, max_norm=0.2, batch_size=8, steps=2, progress=False)
    trainer = PrivateTrainer(
        lm, TokenizedDataset(rows, lm.tokenizer, "seq-cls", max_length=32), config
    )
    trainer.train()
    assert len(calls) == 2
    for kw, record in calls:
        assert set(kw) == {"frames"}  # no clip_fn/privatize_fn: prism_core's own functions
        assert record.noise_multiplier == 1.3 and record.max_norm == 0.2
        assert record.expected_batch_size == pytest.approx(8.0, rel=1e-12)  # q N, not realised
