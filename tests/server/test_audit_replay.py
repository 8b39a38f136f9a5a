"""Audit part (b): record/replay checks of one real PRISM step, and that they catch bugs."""

from __future__ import annotations

import math

import pytest

from server.audit.mechanisms import BROKEN, CORRECT
from server.audit.replay import ReplaySettings, build_tiny_model, run_replay_checks

TOL = 1e-3  # float32 release, see ReplaySettings.rel_tol
TENSORS = 6  # 4 LoRA modules (query, value x 2 layers) + classifier weight and bias


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("audit-tiny"))


def _run(model_dir: str, mechanism) -> dict:
    checks = run_replay_checks(ReplaySettings(), mechanism, model_dir=model_dir)
    return {c.name.split(" ")[0] + ("-std" if "std" in c.name else ""): c for c in checks}


def test_the_mechanism_that_trains_passes_with_tight_sensitivity(model_dir):
    checks = _run(model_dir, CORRECT)
    assert all(c.passed for c in checks.values()), [c.detail for c in checks.values()]
    # the added example is clipped, so its effect is exactly C / b: the bound is tight
    assert abs(checks["sensitivity"].measured - 1.0) <= TOL
    assert checks["noise"].measured <= TOL  # noise identical for realised sizes 0, 6 and 9
    assert 0.95 <= checks["noise-std"].measured <= 1.05


def test_noise_off_is_caught(model_dir):
    checks = _run(model_dir, BROKEN["noise-off"])
    assert checks["sensitivity"].passed  # the clip is fine; the noise is missing
    assert not checks["noise"].passed and "NO NOISE" in checks["noise"].detail
    assert not checks["noise-std"].passed and checks["noise-std"].measured == 0.0


def test_noise_divided_by_the_realised_batch_is_caught(model_dir):
    checks = _run(model_dir, BROKEN["realised-batch"])
    assert not checks["noise"].passed
    # sizes 0 (divided by 1), 6, 9 against b = 8: the worst std ratio is 8 / 1
    assert not checks["noise-std"].passed
    assert checks["noise-std"].measured == pytest.approx(8.0, rel=0.06)


def test_per_module_clipping_is_caught_by_the_joint_sensitivity(model_dir):
    checks = _run(model_dir, BROKEN["per-module-clip"])
    assert not checks["sensitivity"].passed
    # C is below every module's own norm: each of the 6 tensors is clipped to C separately
    assert checks["sensitivity"].measured == pytest.approx(math.sqrt(TENSORS), rel=TOL)
    assert checks["noise"].passed and checks["noise-std"].passed


def test_the_audited_release_is_the_one_every_training_step_uses(model_dir, monkeypatch):
    from client.data import TokenizedDataset
    from client.model import ModelConfig, load_model
    from client.synthetic import synthetic_examples
    from client.trainer import PrivateTrainer, TrainConfig

    calls = []
    original = PrivateTrainer.release

    def spy(self, batch, points, **kw):
        out = original(self, batch, points, **kw)
        calls.append((kw, out[0].record))
        return out

    monkeypatch.setattr(PrivateTrainer, "release", spy)
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
