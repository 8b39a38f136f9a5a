"""The noise of the trainer's release under a split clip: every entry, the DP head's included,
gets std ``sigma C / b`` with C the TOTAL clip (the sensitivity), not the head's share C_head.

Each test releases twice on the same batch at the same factors with two noise seeds: the
clipped sum is the same in both, so the entry-wise difference of the releases is pure noise of
std ``sqrt(2) sigma C / b``. The std is estimated as the RMS of the difference over the n
entries of a group (its mean is 0). For n i.i.d. zero-mean Gaussians that estimate has relative
standard error ``1 / sqrt(2 n)``; the tolerance is 6 of them (a correct mechanism fails a
check with probability about 2e-9). C_head = 0.7 C gives the head and the LoRA part (its share
``sqrt(C^2 - C_head^2) = 0.71 C``) about the same margin: noise scaled by either share lies
outside the tolerance band of the right std, and its own band does not overlap that one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from prism_runtime.data import TokenizedDataset, make_collate
from prism_runtime.lora import read_points
from prism_runtime.model import ModelConfig, load_model
from prism_runtime.trainer import PrivateTrainer, TrainConfig

SST2 = "seq-cls"
SIGMA, C, C_HEAD, B = 1.3, 1.0, 0.7, 8
RANK = 16
"""LoRA rank: 2048 noisy LoRA entries per FFA release (4 modules x 32 x 16), 4096 for dp-adamw."""
NUM_LABELS = 64
"""A head of 32 x 64 weights and 64 biases: 2112 noisy entries per release."""
Z = 6.0
"""Standard errors of the std estimate allowed (two-sided Gaussian tail 2e-9)."""


def _trainer(tiny_bert: str, rows: list[dict], method: str, mode: str) -> PrivateTrainer:
    init = "spectral-residual" if method == "prism" else "standard"
    lm = load_model(
        ModelConfig(model=tiny_bert, rank=RANK, init=init, num_labels=NUM_LABELS), method=method
    )
    config = TrainConfig(
        method=method,
        noise_multiplier=SIGMA,
        max_norm=C,
        head_max_norm=C_HEAD,
        batch_size=B,
        micro_batch_size=3,
        seed=0,
        grad_sample_mode=mode,
        progress=False,
    )
    dataset = TokenizedDataset(rows[:40], lm.tokenizer, SST2, max_length=32)
    trainer = PrivateTrainer(lm, dataset, config)
    assert trainer.expected_batch_size == pytest.approx(B)
    return trainer


def _batch(trainer: PrivateTrainer, rows: list[dict]) -> dict[str, Tensor]:
    lm = trainer.loaded
    ds = TokenizedDataset(rows, lm.tokenizer, SST2, max_length=32)
    batch = make_collate(lm.tokenizer, SST2)([ds[i] for i in range(len(ds))])
    return {k: v.to(lm.device) for k, v in batch.items()}


def _noise_difference(trainer: PrivateTrainer, release: Callable[[], list[Tensor]]) -> list[Tensor]:
    """``release()`` under noise seeds 1 and 2, entry-wise difference (the signal cancels)."""
    outputs = []
    for seed in (1, 2):
        trainer.noise = torch.Generator().manual_seed(seed)
        outputs.append(release())
    return [a - b for a, b in zip(*outputs, strict=True)]


def _check_std(differences: list[Tensor], *, expected: float, wrong: float, what: str) -> None:
    """The std of one release's noise, ``RMS(difference) / sqrt(2)``, is ``expected`` within
    ``Z`` standard errors; the band of the same width around ``wrong`` lies below it."""
    flat = torch.cat([d.detach().double().flatten() for d in differences])
    n = flat.numel()
    measured = flat.square().mean().sqrt().item() / math.sqrt(2.0)
    tolerance = Z / math.sqrt(2 * n)
    assert wrong * (1 + tolerance) < expected * (1 - tolerance)  # the test tells them apart
    assert measured == pytest.approx(expected, rel=tolerance), (
        f"{what}: noise std {measured:.5f} over {n} entries, expected sigma C / b = "
        f"{expected:.5f} (noise at the part's share of the clip: {wrong:.5f})"
    )


@pytest.mark.parametrize("mode", ["layer", "hooks"])
def test_prism_head_noise_has_the_total_clip(tiny_bert, sst2_rows, mode):
    trainer = _trainer(tiny_bert, sst2_rows, "prism", mode)
    batch, points = _batch(trainer, sst2_rows[:B]), read_points(trainer.loaded.handles)
    sums: list[list[Tensor]] = []

    def release() -> list[Tensor]:
        released, clipped, _ = trainer.release(batch, points)
        sums.append(clipped.euclidean)
        return released.euclidean

    differences = _noise_difference(trainer, release)
    for first, second in zip(*sums, strict=True):
        assert torch.equal(first, second)  # the same clipped sum: the difference is noise only
    assert sum(d.numel() for d in differences) == 32 * NUM_LABELS + NUM_LABELS
    _check_std(differences, expected=SIGMA * C / B, wrong=SIGMA * C_HEAD / B, what="prism head")


@pytest.mark.parametrize("mode", ["layer", "hooks"])
@pytest.mark.parametrize("method", ["dp-adamw", "ffa"])
def test_factor_baseline_noise_has_the_total_clip_on_lora_and_head(
    method, tiny_bert, sst2_rows, mode
):
    trainer = _trainer(tiny_bert, sst2_rows, method, mode)
    batch = _batch(trainer, sst2_rows[:B])
    n_head = len(trainer.loaded.head_params)
    assert n_head == 2

    def release() -> list[Tensor]:
        noisy, record, _ = trainer.factor_release(batch)
        assert (record.noise_multiplier, record.max_norm) == (SIGMA, C)
        return noisy

    differences = _noise_difference(trainer, release)
    lora, head = differences[:-n_head], differences[-n_head:]
    assert [d.shape for d in head] == [p.shape for p in trainer.loaded.head_params]
    _check_std(head, expected=SIGMA * C / B, wrong=SIGMA * C_HEAD / B, what=f"{method} head")
    c_lora = math.sqrt(C**2 - C_HEAD**2)  # the LoRA part's share of the split clip
    _check_std(lora, expected=SIGMA * C / B, wrong=SIGMA * c_lora / B, what=f"{method} LoRA")
