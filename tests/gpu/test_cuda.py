"""The trainer and the export on CUDA: frozen base in bf16, LoRA factors and head in float32.

``prism_runtime.model.load_model`` with ``device="cuda"`` loads the base with ``dtype=bfloat16`` and
casts every LoRA factor to float32; ``prism_runtime.trainer.PrivateTrainer`` runs its forward and
backward under bf16 autocast. These tests run that path on a tiny config-built BERT classifier
(``tests/conftest.py``) and check the privacy clip, one PRISM step and the export. Marked
``gpu`` (``make test-gpu``); skipped, with the reason, where torch sees no CUDA device.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModel

from prism_core.manifold import tangent_norm_sq
from prism_runtime.classifier import ClassifierSpec, PooledClassifier
from prism_runtime.data import TokenizedDataset, make_collate
from prism_runtime.export import CLASSIFIER_WEIGHTS, export_adapter
from prism_runtime.lora import read_points
from prism_runtime.model import LoadedModel, ModelConfig, load_model
from prism_runtime.synthetic import synthetic_examples
from prism_runtime.trainer import PrivateTrainer, TrainConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason=(
            f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}); run `make test-gpu` on a GPU machine with the "
            "CUDA build of the same torch version"
        ),
    ),
]

TASK = "seq-cls"
ROWS = synthetic_examples(96, seed=0)
MAX_LENGTH = 32
MIN_STEP = 1e-3  # ||Z_1 - Z_0||_F of one step: sigma C / b * sqrt(D) * lr is about 0.1 here
LOGIT_RTOL = 0.05  # bf16 (8-bit mantissa) base + bf16 autocast vs. a float32 CPU reload
LOGIT_ATOL = 1e-2


def _model(tiny_bert: str) -> LoadedModel:
    return load_model(ModelConfig(model=tiny_bert, rank=4, device="cuda"))


def _dataset(lm: LoadedModel, rows: list[dict[str, object]]) -> TokenizedDataset:
    return TokenizedDataset(rows, lm.tokenizer, TASK, max_length=MAX_LENGTH)


def _batch(lm: LoadedModel, rows: list[dict[str, object]]) -> dict[str, torch.Tensor]:
    ds = _dataset(lm, rows)
    return make_collate(lm.tokenizer, TASK)([ds[i] for i in range(len(ds))])


def _dense(lm: LoadedModel) -> list[torch.Tensor]:
    """``Z = A B.T`` of every LoRA module, in float64 on the CPU."""
    return [(p.A.double() @ p.B.double().T).cpu() for p in read_points(lm.handles)]


def test_the_base_is_bf16_and_the_lora_factors_and_head_are_float32_on_cuda(tiny_bert):
    lm = _model(tiny_bert)
    assert lm.device.type == "cuda"
    factors = [p for h in lm.handles for p in (h.lora_A, h.lora_B)]
    assert len(factors) == 8  # query and value of 2 layers, A and B each
    for p in [*factors, *lm.head_params]:
        assert p.is_cuda and p.dtype == torch.float32 and p.requires_grad, (p.shape, p.dtype)
    frozen = [(n, p) for n, p in lm.model.named_parameters() if not p.requires_grad]
    assert frozen
    wrong = [
        (n, p.dtype, p.device) for n, p in frozen if p.dtype != torch.bfloat16 or not p.is_cuda
    ]
    assert not wrong, wrong[:5]


def test_the_global_clip_holds_on_cuda_under_bf16_autocast(tiny_bert):
    """Adding one example moves the clipped sum (LoRA lifts and head) by at most C, and by C
    when every example is clipped: the sensitivity bound survives bf16 activations."""
    lm = _model(tiny_bert)
    C = 1e-3  # far below the per-example norms: every example is clipped
    config = TrainConfig(
        noise_multiplier=1.0, max_norm=C, batch_size=8, micro_batch_size=3, progress=False
    )
    trainer = PrivateTrainer(lm, _dataset(lm, ROWS[:40]), config)
    points = read_points(lm.handles)
    cuda = {k: v.to(lm.device) for k, v in _batch(lm, ROWS[:9]).items()}
    with_x, _ = trainer.clipped_sum(cuda, points)
    without_x, _ = trainer.clipped_sum({k: v[:8] for k, v in cuda.items()}, points)
    assert with_x.clipped == 9
    diff_sq = sum(
        tangent_norm_sq(p.A, p.B, a.dA - b.dA, a.dB - b.dB)
        for p, a, b in zip(points, with_x.sums, without_x.sums, strict=True)
    ) + sum(
        (a - b).square().sum() for a, b in zip(with_x.euclidean, without_x.euclidean, strict=True)
    )
    assert C * 0.99 <= diff_sq.sqrt().item() <= C * (1 + 1e-4)


def test_one_prism_step_on_cuda_moves_the_adapter_by_a_finite_nonzero_amount(tiny_bert):
    lm = _model(tiny_bert)
    config = TrainConfig(
        noise_multiplier=1.0,
        max_norm=1.0,
        steps=1,
        batch_size=16,
        micro_batch_size=8,
        lr=5e-2,
        seed=0,
        progress=False,
    )
    trainer = PrivateTrainer(lm, _dataset(lm, ROWS), config)
    before, head_before = _dense(lm), [p.detach().clone() for p in lm.head_params]
    (result,) = trainer.train(1)
    after = _dense(lm)
    assert result.record is not None and result.record.noise_multiplier == pytest.approx(1.0)
    assert torch.isfinite(torch.tensor(result.loss))
    moved = sum((b - a).square().sum() for a, b in zip(before, after, strict=True)).sqrt()
    assert torch.isfinite(moved) and moved.item() >= MIN_STEP, moved
    for a, b in zip(head_before, lm.head_params, strict=True):
        assert torch.isfinite(b).all() and (b - a).norm().item() > 0
    for h in lm.handles:  # the retraction wrote float32 factors back
        assert h.lora_A.dtype == h.lora_B.dtype == torch.float32


def test_the_cuda_trained_adapter_exports_and_loads_with_peft_on_cpu(tiny_bert, tmp_path):
    """The exported adapter, on the ORIGINAL float32 base on the CPU with plain peft, gives
    finite logits within bf16 rounding of the CUDA model's."""
    lm = _model(tiny_bert)
    config = TrainConfig(
        noise_multiplier=0.5, steps=3, batch_size=16, lr=5e-2, seed=0, progress=False
    )
    PrivateTrainer(lm, _dataset(lm, ROWS[:64]), config).train()
    out = export_adapter(lm, tmp_path / "adapter")
    inputs = {k: v for k, v in _batch(lm, ROWS[64:80]).items() if k != "labels"}
    lm.model.eval()
    with torch.no_grad():
        on_cuda = lm.model(**{k: v.to(lm.device) for k, v in inputs.items()}).logits
    spec = ClassifierSpec.load(out)
    head = torch.nn.Linear(spec.in_features, spec.num_labels)
    head.load_state_dict(load_file(str(out / CLASSIFIER_WEIGHTS)))
    base = AutoModel.from_pretrained(tiny_bert)
    reloaded = PooledClassifier(PeftModel.from_pretrained(base, str(out)), spec, head).eval()
    with torch.no_grad():
        on_cpu = reloaded(**inputs).logits
    assert on_cpu.dtype == torch.float32 and torch.isfinite(on_cpu).all()
    assert torch.isfinite(on_cuda).all()
    torch.testing.assert_close(
        on_cuda.float().cpu(),
        on_cpu,
        rtol=0,
        atol=LOGIT_ATOL + LOGIT_RTOL * on_cpu.abs().max().item(),
    )
