"""Person-level DP-SGD in the trainers (docs/design.md §3.2): one clip per person, q over people,
whole people per micro-batch, the record level unchanged. Sensitivity is checked in float64:
the trainer's own clipped sum with a float64 clip (``clip_fn``) on its folded gradients."""

from __future__ import annotations

import pytest
import torch

import prism_runtime.trainer.base as trainer_base
import prism_runtime.trainer.prism as prism_module
from prism_core.accounting import calibrate_noise_multiplier
from prism_core.baselines import factor_clip_and_sum
from prism_core.manifold import Point, lift, tangent_norm_sq
from prism_core.mechanism import clip_and_sum_grads
from prism_runtime.data import TokenizedDataset, make_collate
from prism_runtime.data.units import UNIT_KEY, person_records, user_poisson_loader
from prism_runtime.errors import ConfigError
from prism_runtime.lora import read_points
from prism_runtime.model import ModelConfig, load_model
from prism_runtime.trainer import FactorTrainer, PrismTrainer, TrainConfig, make_trainer
from prism_runtime.trainer.dp import UnitFold, fold_units

SST2 = "seq-cls"
K = 3  # max_records_per_user of these tests
C = 1e-3  # far below every person's gradient norm: every person is clipped


def _population(extra: int) -> list[str]:
    """Person ids of 8 people with 1..3 records each, then person 'x' with ``extra`` records."""
    counts = [1, 2, 3, 1, 3, 2, 1, 2]
    return [f"p{i}" for i, c in enumerate(counts) for _ in range(c)] + ["x"] * extra


def _trainer(lm, rows, units, **settings):
    config = TrainConfig(
        **{
            "noise_multiplier": 1.0,
            "max_norm": C,
            "batch_size": len(set(units)),  # q = 1: every person is in every batch
            "micro_batch_size": 1,  # every person alone: neighbouring batches share their terms
            "privacy_unit": "user",
            "max_records_per_user": K,
            "seed": 0,
            "progress": False,
            **settings,
        }
    )
    dataset = TokenizedDataset(rows, lm.tokenizer, SST2, max_length=32)
    return make_trainer(lm, dataset, config, units=units), dataset


def _neighbours(trainer, dataset, units, cap=K):
    """A person-level batch with every person (q = 1, person 'x' capped to ``cap`` records) and
    the same batch without 'x', both as the sampler draws them."""
    records = person_records(units)
    loader, q = user_poisson_loader(
        dataset,
        records,
        expected_users=len(records),
        max_records=cap,
        collate_fn=make_collate(trainer.loaded.tokenizer, SST2),
        generator=torch.Generator().manual_seed(1),
    )
    assert q == 1.0
    with_x = next(iter(loader))
    x = len(records) - 1  # 'x' comes last: its rows are the batch's last unit
    keep = with_x[UNIT_KEY] != x
    without_x = {k: v[keep] for k, v in with_x.items()}
    return with_x, without_x, int((~keep).sum())


def _clip64(points, grads, *, max_norm, previous=None, euclidean=(), frames=None, **kwargs):
    """``clip_and_sum_grads`` in float64 (points, gradients and sums)."""
    del frames  # the trainer's float32 frames: rebuilt in float64 from the points
    return clip_and_sum_grads(
        [Point(p.A.double(), p.B.double()) for p in points],
        [(gA.double(), gB.double()) for gA, gB in grads],
        max_norm=max_norm,
        previous=previous,
        euclidean=[g.double() for g in euclidean],
        **kwargs,
    )


def _factor_clip64(rows, *, max_norm, previous=None, euclidean=(), **kwargs):
    """``factor_clip_and_sum`` in float64."""
    return factor_clip_and_sum(
        [g.double() for g in rows],
        max_norm=max_norm,
        previous=previous,
        euclidean=[g.double() for g in euclidean],
        **kwargs,
    )


def _moved(points, a, b) -> float:
    """The float64 norm of the difference of two ``ClippedSum``: intrinsic (eq. 15) on the
    LoRA tangents, Euclidean on the head."""
    diff_sq = sum(
        tangent_norm_sq(p.A.double(), p.B.double(), (s.dA - t.dA).double(), (s.dB - t.dB).double())
        for p, s, t in zip(points, a.sums, b.sums, strict=True)
    ) + sum((s - t).double().square().sum() for s, t in zip(a.euclidean, b.euclidean, strict=True))
    return float(diff_sq.sqrt())


@pytest.mark.parametrize("records_of_x", [K, 3 * K])
@pytest.mark.parametrize("head_share", ["split", "joint"])
def test_adding_one_person_moves_the_prism_clipped_sum_by_at_most_C(
    records_of_x, head_share, tiny_bert, sst2_rows
):
    """Person 'x' with k records, or with 3k under the cap k: LoRA lifts (intrinsic norm) and
    head gradients together move by <= C (float64), and by about C (the clip is active)."""
    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    units = _population(records_of_x)
    split = {} if head_share == "split" else {"head_max_norm": None}
    trainer, dataset = _trainer(lm, sst2_rows[: len(units)], units, **split)
    assert isinstance(trainer, PrismTrainer)
    with_x, without_x, rows_of_x = _neighbours(trainer, dataset, units)
    assert rows_of_x == K  # the cap: a random chunk of k of x's records
    points = read_points(lm.handles)
    a, _ = trainer.clipped_sum(with_x, points, clip_fn=_clip64)
    b, _ = trainer.clipped_sum(without_x, points, clip_fn=_clip64)
    assert (a.count, b.count) == (9, 8)  # people, not records
    assert a.clipped == 9
    moved = _moved(points, a, b)
    assert moved <= C * (1 + 1e-9)
    assert moved >= C * 0.99


def test_the_fold_is_what_bounds_a_person(tiny_bert, sst2_rows):
    """Person 'x' holds k copies of one record (3k in the data, capped to k): the person level
    moves the sum by C, the record level by k C (k clipped terms in one direction), so the
    bound above is the fold's, not the data's."""
    units = _population(3 * K)
    rows = sst2_rows[:15] + [sst2_rows[15]] * (3 * K)
    moves = {}
    for unit in ("user", "record"):
        lm = load_model(ModelConfig(model=tiny_bert, rank=4))  # Opacus wraps a model once
        trainer, dataset = _trainer(lm, rows, units, privacy_unit=unit)
        with_x, without_x, _ = _neighbours(trainer, dataset, units)
        points = read_points(lm.handles)
        a, _ = trainer.clipped_sum(with_x, points, clip_fn=_clip64)
        b, _ = trainer.clipped_sum(without_x, points, clip_fn=_clip64)
        moves[unit] = _moved(points, a, b)
    assert C * 0.99 <= moves["user"] <= C * (1 + 1e-9)
    assert moves["record"] == pytest.approx(K * C, rel=1e-3)


@pytest.mark.parametrize("method", ["dp-adamw", "ffa"])
@pytest.mark.parametrize("records_of_x", [K, 3 * K])
def test_adding_one_person_moves_the_factor_clipped_sum_by_at_most_C(
    method, records_of_x, tiny_bert, sst2_rows
):
    """The factor-space baselines: the clipped sum of the trainable factors and the head moves
    by <= C in the factor norm (float64) when one person joins, and by about C."""
    lm = load_model(ModelConfig(model=tiny_bert, rank=4, init="standard"), method=method)
    units = _population(records_of_x)
    trainer, dataset = _trainer(lm, sst2_rows[: len(units)], units, method=method)
    assert isinstance(trainer, FactorTrainer)
    with_x, without_x, rows_of_x = _neighbours(trainer, dataset, units)
    assert rows_of_x == K
    a, _ = trainer.factor_clipped_sum(with_x, clip_fn=_factor_clip64)
    b, _ = trainer.factor_clipped_sum(without_x, clip_fn=_factor_clip64)
    assert len(a) == len(trainer.params)
    moved = sum((s - t).square().sum() for s, t in zip(a, b, strict=True)).sqrt().item()
    assert moved <= C * (1 + 1e-9)
    assert moved >= C * 0.99


def test_the_default_float32_clip_bounds_a_person_with_packed_micro_batches(tiny_bert, sst2_rows):
    """End to end in the trainer's own float32 clip, with several people per micro-batch (so
    the neighbours' terms are grouped differently): the move stays within C up to float32
    rounding of the other terms (relative 1e-4, the clip's own margin)."""
    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    units = _population(3 * K)
    trainer, dataset = _trainer(lm, sst2_rows[: len(units)], units, micro_batch_size=4)
    with_x, without_x, _ = _neighbours(trainer, dataset, units)
    points = read_points(lm.handles)
    a, _ = trainer.clipped_sum(with_x, points)
    b, _ = trainer.clipped_sum(without_x, points)
    assert C * 0.99 <= _moved(points, a, b) <= C * (1 + 1e-4)


def test_fold_units_sums_a_persons_rows_and_the_lift_of_the_sum_is_the_sum_of_lifts():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(7, 3, generator=g, dtype=torch.float64)
    B = torch.randn(5, 3, generator=g, dtype=torch.float64)
    unit = torch.tensor([0, 0, 1, 2, 2, 2])
    gA = torch.randn(6, 7, 3, generator=g, dtype=torch.float64)
    gB = torch.randn(6, 5, 3, generator=g, dtype=torch.float64)
    head = torch.randn(6, 2, 4, generator=g, dtype=torch.float64)
    fA, fB, fh = fold_units([gA, gB, head], unit)
    for person, rows in enumerate(([0, 1], [2], [3, 4, 5])):
        torch.testing.assert_close(fA[person], gA[rows].sum(0), rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(fh[person], head[rows].sum(0), rtol=1e-14, atol=1e-14)
        lifted = lift(A, B, fA[person], fB[person])
        lifts = lift(A, B, gA[rows], gB[rows])
        torch.testing.assert_close(lifted.dA, lifts.dA.sum(0), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(lifted.dB, lifts.dB.sum(0), rtol=1e-10, atol=1e-12)


def test_unit_fold_adds_a_persons_pieces_before_returning_them():
    """Micro-batches [a, a, b(open)] then [b, b, c]: a alone first, then b's three rows summed
    and c, as one pass would fold them; a non-finite row in a piece makes the whole person NaN;
    a batch that ends open is refused."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 2, 3, generator=g, dtype=torch.float64)
    whole = fold_units([rows], torch.tensor([0, 0, 1, 1, 1, 2]))[0]
    fold = UnitFold()
    first = fold.fold([rows[:3]], torch.tensor([0, 0, 1]), True)[0]
    second = fold.fold([rows[3:]], torch.tensor([0, 0, 1]), False)[0]
    fold.close()
    assert torch.allclose(torch.cat([first, second]), whole, rtol=1e-12, atol=1e-15)
    bad = rows.clone()
    bad[2, 0, 0] = float("inf")
    fold = UnitFold()
    fold.fold([bad[:3]], torch.tensor([0, 0, 1]), True)
    out = fold.fold([bad[3:]], torch.tensor([0, 0, 1]), False)[0]
    assert out[0].isnan().all() and out[1].isfinite().all()
    fold.fold([rows[:2]], torch.tensor([0, 1]), True)
    with pytest.raises(ValueError, match="marked open"):
        fold.close()


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 3e38])
def test_a_non_finite_record_drops_its_whole_person(bad):
    """One record of person 1 is not finite (or its entries' sum overflows float32): person
    1's rows are NaN in every tensor, its clip coefficient is 0, the others' sums are kept."""
    g = torch.Generator().manual_seed(1)
    unit = torch.tensor([0, 1, 1, 1, 2])
    lora = torch.randn(5, 4, 2, generator=g)
    head = torch.randn(5, 3, generator=g)
    lora[2, 0, 0] = bad
    if bad == 3e38:
        lora[2, 0, 1] = bad  # finite entries whose sum is inf
    folded_lora, folded_head = fold_units([lora, head], unit)
    assert folded_lora[1].isnan().all() and folded_head[1].isnan().all()
    assert torch.isfinite(folded_lora[[0, 2]]).all() and torch.isfinite(folded_head[[0, 2]]).all()
    sums, alpha = factor_clip_and_sum([folded_lora], max_norm=1e6, euclidean=[folded_head])
    assert alpha.tolist() == [1.0, 0.0, 1.0]
    torch.testing.assert_close(sums[0], lora[[0, 4]].sum(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sums[1], head[[0, 4]].sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_a_person_level_step_is_accounted_over_people(method, tiny_bert, sst2_rows, monkeypatch):
    """q = b_u / N_users in the trainer and in every event, b = b_u, sigma calibrated at that q;
    a batch never holds more than k records of one person."""
    init = "spectral-residual" if method == "prism" else "standard"
    lm = load_model(ModelConfig(model=tiny_bert, rank=2, init=init), method=method)
    units = [f"u{i % 25}" for i in range(80)]  # 25 people with 3 or 4 records
    config = TrainConfig(
        method=method,
        epsilon=4.0,
        steps=3,
        batch_size=10,
        micro_batch_size=4,
        privacy_unit="user",
        max_records_per_user=2,
        seed=3,
        progress=False,
    )
    seen: list[list[int]] = []
    split = trainer_base.unit_micro_batches

    def spy(batch, size, **kwargs):
        seen.append(torch.bincount(batch[UNIT_KEY]).tolist())
        return split(batch, size, **kwargs)

    dataset = TokenizedDataset(sst2_rows[:80], lm.tokenizer, SST2, max_length=32)
    trainer = make_trainer(lm, dataset, config, units=units)
    monkeypatch.setattr(trainer_base, "unit_micro_batches", spy)
    results = trainer.train()
    assert trainer.privacy_unit == "user" and trainer.num_units == 25
    assert trainer.sample_rate == 10 / 25 and trainer.expected_batch_size == pytest.approx(10.0)
    sigma = calibrate_noise_multiplier(
        target_epsilon=4.0, delta=config.delta, sample_rate=10 / 25, steps=3
    )
    assert trainer.noise_multiplier == pytest.approx(sigma, rel=1e-12)
    for r in results:
        assert r.record.sample_rate == 10 / 25 and r.record.expected_batch_size == 10.0
        assert r.record.unit == "user"  # the event says what it protects: a person
    assert len(seen) == 3 and all(max(counts, default=0) <= 2 for counts in seen)
    assert [r.batch_size for r in results] == [sum(counts) for counts in seen]
    count, below = trainer.count_within(1e6, lora_only=False)
    assert count == below and 0 < count <= 25  # people, not records


def test_the_trainers_micro_batches_are_bounded_and_the_clip_sees_each_person_once(
    tiny_bert, sst2_rows, monkeypatch
):
    """Every micro-batch the person-level trainer backpropagates has at most micro_batch_size
    rows, a person with more spans consecutive micro-batches, and the clip receives each
    sampled person exactly once per step."""
    lm = load_model(ModelConfig(model=tiny_bert, rank=2))
    units = [f"u{i // 5}" for i in range(60)]  # 12 people with 5 records: more than a micro
    config = TrainConfig(
        noise_multiplier=1.0,
        steps=2,
        batch_size=6,
        micro_batch_size=3,
        privacy_unit="user",
        max_records_per_user=4,
        seed=0,
        progress=False,
    )
    trainer = make_trainer(
        lm, TokenizedDataset(sst2_rows[:60], lm.tokenizer, SST2, max_length=32), config, units=units
    )
    people: list[int] = []
    micros: list[int] = []
    clipped: list[int] = []
    split = trainer_base.unit_micro_batches
    clip = prism_module.clip_and_sum_whitened

    def spy(batch, size, **kwargs):
        people.append(int(batch[UNIT_KEY].max()) + 1 if batch[UNIT_KEY].numel() else 0)
        clipped.append(0)
        for micro in split(batch, size, **kwargs):
            micros.append(int(micro[UNIT_KEY].shape[0]))
            yield micro

    def clip_spy(points, rows, **kwargs):
        clipped[-1] += int(rows[0][0].shape[1])  # (L, people, r, m)
        return clip(points, rows, **kwargs)

    monkeypatch.setattr(trainer_base, "unit_micro_batches", spy)
    monkeypatch.setattr(prism_module, "clip_and_sum_whitened", clip_spy)
    trainer.train()
    assert micros and max(micros) <= 3
    assert clipped == people and sum(people) > 0
    assert any(m == 1 for m in micros)  # a person with 4 > 3 rows: pieces of 3 and 1


def _big_person(extra: int) -> list[str]:
    """8 people with 1..3 records, then 'x' with ``extra`` (all of them under the cap 6)."""
    return _population(0) + ["x"] * extra


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_a_person_across_micro_batches_is_clipped_as_in_one_pass(
    method, micro, tiny_bert, sst2_rows
):
    """Person 'x' with 6 records (the cap), micro-batches of 1, 2 or 4 rows: the clipped sum
    (float64 clip, every person clipped) equals the unbatched one, all rows in one pass, to
    float32 rounding of the per-example gradients; and so does the loss."""
    init = "spectral-residual" if method == "prism" else "standard"
    units = _big_person(6)
    rows = sst2_rows[: len(units)]
    sums = {}
    for size in (micro, len(units)):
        lm = load_model(ModelConfig(model=tiny_bert, rank=4, init=init), method=method)
        trainer, dataset = _trainer(
            lm, rows, units, method=method, micro_batch_size=size, max_records_per_user=6
        )
        batch, _, rows_of_x = _neighbours(trainer, dataset, units, cap=6)
        assert rows_of_x == 6
        if method == "prism":
            points = read_points(lm.handles)
            acc, loss = trainer.clipped_sum(batch, points, clip_fn=_clip64)
            assert acc.count == acc.clipped == 9  # people, each clipped once
            flat = [*(t for s in acc.sums for t in (s.dA, s.dB)), *acc.euclidean]
        else:
            flat, loss = trainer.factor_clipped_sum(batch, clip_fn=_factor_clip64)
        sums[size] = (torch.cat([t.double().flatten() for t in flat]), loss)
    (split, split_loss), (whole, whole_loss) = sums[micro], sums[len(units)]
    assert float((split - whole).norm()) <= 1e-5 * float(whole.norm())
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)


@pytest.mark.parametrize("sampled", [True, False])
def test_a_micro_batch_is_bounded_whether_or_not_a_big_person_is_sampled(
    sampled, tiny_bert, sst2_rows, monkeypatch
):
    """Micro-batches of at most 2 rows with the cap k = 6: the largest forward/backward holds
    2 rows whether the batch holds person 'x' with 6 records or not."""
    lm = load_model(ModelConfig(model=tiny_bert, rank=2))
    units = _big_person(6)
    trainer, dataset = _trainer(
        lm, sst2_rows[: len(units)], units, micro_batch_size=2, max_records_per_user=6
    )
    with_x, without_x, _ = _neighbours(trainer, dataset, units, cap=6)
    seen: list[int] = []
    backward = trainer._backward

    def spy(micro):
        seen.append(int(micro["labels"].shape[0]))
        return backward(micro)

    monkeypatch.setattr(trainer, "_backward", spy)
    trainer.clipped_sum(with_x if sampled else without_x, read_points(lm.handles))
    assert max(seen) == 2


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_one_record_per_person_is_the_record_level_run_bit_for_bit(method, tiny_bert, sst2_rows):
    """With one record per person, in row order, a person-level run draws the record level's
    batches and releases the same updates: equal factors and head, bit for bit, across an
    epoch boundary; and at the record level the person ids change nothing."""
    init = "spectral-residual" if method == "prism" else "standard"

    def run(unit, units, users=False):
        lm = load_model(ModelConfig(model=tiny_bert, rank=2, init=init), method=method)
        rows = sst2_rows[:32]
        if users:
            rows = [{**r, "user": i} for i, r in enumerate(rows)]
        config = TrainConfig(
            method=method,
            noise_multiplier=0.8,
            steps=6,  # 32 rows at q = 8 / 32: 4 batches a pass
            batch_size=8,
            micro_batch_size=3,
            max_norm=0.05,
            privacy_unit=unit,
            seed=9,
            progress=False,
        )
        dataset = TokenizedDataset(rows, lm.tokenizer, SST2, max_length=32)
        results = make_trainer(lm, dataset, config, units=units).train()
        return read_points(lm.handles), [p.detach() for p in lm.head_params], results

    record = run("record", None)
    for other in (run("user", list(range(32))), run("user", None, users=True)):
        for a, b in zip(record[0], other[0], strict=True):
            assert torch.equal(a.A, b.A) and torch.equal(a.B, b.B)
        for a, b in zip(record[1], other[1], strict=True):
            assert torch.equal(a, b)
        assert [r.loss for r in record[2]] == [r.loss for r in other[2]]
        assert {r.record.unit for r in record[2]} == {"record"}
        assert {r.record.unit for r in other[2]} == {"user"}
    ignored = run("record", [i // 4 for i in range(32)], users=True)
    for a, b in zip(record[0], ignored[0], strict=True):
        assert torch.equal(a.A, b.A) and torch.equal(a.B, b.B)


def test_person_level_settings_are_refused_with_what_to_do(tiny_bert, sst2_rows):
    lm = load_model(ModelConfig(model=tiny_bert, rank=2))
    dataset = TokenizedDataset(sst2_rows[:20], lm.tokenizer, SST2, max_length=32)
    config = TrainConfig(
        noise_multiplier=1.0, batch_size=4, privacy_unit="user", seed=0, progress=False
    )
    with pytest.raises(ConfigError, match="needs the person of every row: pass units"):
        make_trainer(lm, dataset, config)
    with pytest.raises(ConfigError, match="units has 3 person ids for 20 rows"):
        make_trainer(lm, dataset, config, units=["a", "b", "c"])
    with pytest.raises(ConfigError, match=r"larger than the number of people \(3\)"):
        make_trainer(lm, dataset, config, units=[i % 3 for i in range(20)])
    assert TrainConfig(noise_multiplier=1.0).privacy_unit == "record"
    assert TrainConfig(noise_multiplier=1.0).max_records_per_user == 4
    trainer = make_trainer(lm, dataset, config, units=[i % 5 for i in range(20)])
    with pytest.raises(ValueError, match="needs its 'unit' tensor"):
        batch = make_collate(lm.tokenizer, SST2)([dataset[i] for i in range(4)])
        trainer.clipped_sum(batch, read_points(lm.handles))
