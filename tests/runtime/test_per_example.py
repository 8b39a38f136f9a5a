"""Per-example gradients computed inside the trainable linear layers (``prism_runtime.per_example``)
against Opacus' hooks mode and against autograd on one example at a time."""

from __future__ import annotations

import pytest
import torch
from opacus import GradSampleModule
from torch import nn

from prism_core.manifold import Point
from prism_core.mechanism import step_frames
from prism_runtime import per_example
from prism_runtime.classifier import fold_text_rows
from prism_runtime.data import TokenizedDataset, make_collate, micro_batches
from prism_runtime.data.units import OPEN_KEY, packed_groups
from prism_runtime.errors import ConfigError
from prism_runtime.lora import read_points, write_points_
from prism_runtime.model import ModelConfig, load_model
from prism_runtime.trainer import TrainConfig, make_trainer, per_example_loss
from prism_runtime.trainer import prism as prism_trainer
from prism_runtime.trainer.prism import StepRows

SST2 = "seq-cls"
TOL = 1e-10
"""Relative tolerance of two float64 computations of the same rows (summation order only)."""

PAIRS = [
    ("The nurse was kind.", "Was the nurse kind to you at the clinic last week?"),
    ("Knee pain after running", "What helps with knee pain?"),
    ("Is a fever of 39 C dangerous for a child?", "Fever in children"),
]


def _trainable(lm):
    return [p for h in lm.handles for p in (h.lora_A, h.lora_B)] + list(lm.head_params)


def _clear(params):
    for p in params:
        p.grad = None
        p.grad_sample = None


def _sst2_batch(lm, rows):
    ds = TokenizedDataset(rows, lm.tokenizer, SST2, max_length=32)
    return make_collate(lm.tokenizer, SST2)([ds[i] for i in range(len(ds))])


def _pair_batch(lm):
    rows = [{"text_a": a, "text_b": b, "label": i % 2} for i, (a, b) in enumerate(PAIRS)]
    ds = TokenizedDataset(rows, lm.tokenizer, SST2, max_length=32, pair_encoding="siamese")
    return make_collate(lm.tokenizer, SST2)([ds[i] for i in range(len(ds))])


def _causal_batch(b=4, t=10):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 30000, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 6:] = 0  # a padded sequence
    labels = ids.clone()
    labels[:, :3] = -100  # prompt tokens are not supervised
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _layer_rows(lm, batch, task, seed=0):
    """Every trainable tensor's rows from the layer path, and whether any summed grad formed."""
    params = _trainable(lm)
    layers = per_example.trainable_layers(lm.model)
    per_example.attach(layers)
    torch.manual_seed(seed)  # the same dropout masks as the hooks run
    per_example_loss(lm.model, batch, task).sum().backward()
    rows = [p.grad_sample.clone() for p in params]
    summed = [p.grad is not None for p in params]
    _clear(params)
    per_example.detach(layers)
    return rows, summed


def _hooks_rows(lm, batch, task, seed=0):
    params = _trainable(lm)
    gsm = GradSampleModule(lm.model, batch_first=True, loss_reduction="sum")
    torch.manual_seed(seed)
    per_example_loss(gsm, batch, task).sum().backward()
    rows = [p.grad_sample.clone() for p in params]
    _clear(params)
    gsm._close()
    return rows


def _worst(rows, want):
    """The largest relative distance ||a - b|| / ||b|| over tensors and examples."""
    worst = 0.0
    for a, b in zip(rows, want, strict=True):
        assert a.shape == b.shape
        for i in range(b.shape[0]):
            worst = max(worst, float((a[i] - b[i]).norm() / b[i].norm().clamp_min(1e-300)))
    return worst


def _bert(tiny_bert, **settings):
    lm = load_model(ModelConfig(model=tiny_bert, rank=4, **settings))
    lm.model.to(torch.float64).train()
    with torch.no_grad():  # a head with signal in every row (the zero-shot start is tied)
        lm.model.head.weight.normal_(generator=torch.Generator().manual_seed(1))
    return lm


def _llama(tiny_llama, **settings):
    config = ModelConfig(
        model=tiny_llama, task="causal-lm", rank=4, target_modules=("q_proj", "v_proj"), **settings
    )
    lm = load_model(config)
    lm.model.to(torch.float64).train()
    return lm


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_layer_rows_equal_opacus_hooks_on_a_padded_classifier_batch(tiny_bert, sst2_rows, dropout):
    """Padded SST-2 rows of different lengths, LoRA dropout on or off: every LoRA factor's and
    the head weight's and bias's rows equal Opacus' hooks mode (float64, relative 1e-10), and
    the layer path forms no summed gradient."""
    lm = _bert(tiny_bert, dropout=dropout)
    batch = _sst2_batch(lm, sst2_rows[:6])
    assert (batch["attention_mask"] == 0).any()  # padded
    rows, summed = _layer_rows(lm, batch, SST2)
    assert _worst(rows, _hooks_rows(lm, batch, SST2)) <= TOL
    assert not any(summed)
    assert len(rows) == 2 * len(lm.handles) + 2  # the head's weight and bias


def test_layer_rows_equal_opacus_hooks_on_a_padded_causal_lm_batch(tiny_llama):
    lm = _llama(tiny_llama, dropout=0.2)
    batch = _causal_batch()
    rows, _ = _layer_rows(lm, batch, "causal-lm")
    assert _worst(rows, _hooks_rows(lm, batch, "causal-lm")) <= TOL


def test_bf16_base_weights_with_float32_factors_give_float32_rows_equal_to_hooks(tiny_llama):
    """The GPU layout on a CPU: the frozen base in bfloat16, the LoRA factors in float32 (peft
    casts the LoRA branch's input to the factors' dtype). The rows are float32 and equal Opacus'
    hooks rows on the same model within float32 rounding (relative 1e-5)."""
    config = ModelConfig(
        model=tiny_llama, task="causal-lm", rank=4, target_modules=("q_proj", "v_proj")
    )
    lm = load_model(config)
    for p in lm.model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    lm.model.train()
    assert lm.handles[0].lora_A.dtype == torch.float32
    batch = _causal_batch()
    rows, _ = _layer_rows(lm, batch, "causal-lm")
    assert all(r.dtype == torch.float32 for r in rows)
    assert _worst(rows, _hooks_rows(lm, batch, "causal-lm")) <= 1e-5


@pytest.mark.parametrize("task", [SST2, "causal-lm"])
def test_layer_rows_equal_autograd_on_one_example_at_a_time(tiny_bert, tiny_llama, sst2_rows, task):
    """Row i of every trainable tensor is the gradient of example i's loss alone (the example
    padded to its own length), relative 1e-10 in float64."""
    if task == SST2:
        lm = _bert(tiny_bert)
        batch = _sst2_batch(lm, sst2_rows[:5])
        singles = [_sst2_batch(lm, sst2_rows[i : i + 1]) for i in range(5)]
    else:
        lm = _llama(tiny_llama)
        batch = _causal_batch()
        singles = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(4)]
    params = _trainable(lm)
    rows, _ = _layer_rows(lm, batch, task)
    for i, one in enumerate(singles):
        want = torch.autograd.grad(per_example_loss(lm.model, one, task).sum(), params)
        for k, (r, w) in enumerate(zip(rows, want, strict=True)):
            assert (r[i] - w).norm() <= TOL * w.norm() + 1e-300, (i, k)


def test_siamese_text_rows_fold_into_the_hooks_rows_of_each_pair(tiny_bert):
    """A siamese batch of B pairs runs the encoder on 2B texts: the layer path gives one row per
    text (as Opacus does) and the folded rows equal Opacus' folded rows."""
    lm = _bert(tiny_bert, text_pairs=True, pair_encoding="siamese")
    batch = _pair_batch(lm)
    B = int(batch["labels"].shape[0])
    rows, _ = _layer_rows(lm, batch, SST2)
    hooks = _hooks_rows(lm, batch, SST2)
    assert rows[0].shape[0] == 2 * B
    folded = [fold_text_rows(r, B) for r in rows]
    assert _worst(folded, [fold_text_rows(r, B) for r in hooks]) <= TOL


def _roll_rows(store):
    return lambda p, rows: store(p, rows.roll(1, dims=0))


def _unscaled_lora_rows(lm, store):
    lora = {id(h.lora_B): h.scaling for h in lm.handles}
    return lambda p, rows: store(p, rows / lora.get(id(p), 1.0))


@pytest.mark.parametrize("fault", [_roll_rows, _unscaled_lora_rows])
def test_a_planted_fault_in_the_rows_is_caught(tiny_bert, sst2_rows, monkeypatch, fault):
    """The comparison the tests above make catches a row of the wrong example and rows that
    miss LoRA's scaling alpha / r (here 4): the worst relative error is far above tolerance."""
    lm = _bert(tiny_bert, alpha=16.0)
    assert {h.scaling for h in lm.handles} == {4.0}
    batch = _sst2_batch(lm, sst2_rows[:6])
    want = _hooks_rows(lm, batch, SST2)
    store = per_example._store_rows
    planted = fault(store) if fault is _roll_rows else fault(lm, store)
    monkeypatch.setattr(per_example, "_store_rows", planted)
    rows, _ = _layer_rows(lm, batch, SST2)
    assert _worst(rows, want) > 0.5


@pytest.mark.parametrize("unit", ["record", "user"])
@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_two_steps_on_the_layer_path_release_what_the_hooks_path_releases(
    tiny_bert, sst2_rows, method, unit
):
    """The same seed (batches, dropout, noise), one model on each path: after two steps
    (micro-batches of 5, so a person's records can span two) the LoRA factors and the head
    agree within float32 rounding (relative 1e-4), and the history is the same."""
    rows = sst2_rows[:48]
    units = [i // 3 for i in range(len(rows))] if unit == "user" else None
    finals, histories = [], []
    for mode in ("layer", "hooks"):
        lm = load_model(ModelConfig(model=tiny_bert, rank=4, dropout=0.1), method=method)
        config = TrainConfig(
            method=method,
            noise_multiplier=1.0,
            steps=2,
            batch_size=6,
            micro_batch_size=5,
            privacy_unit=unit,
            max_records_per_user=2,
            seed=0,
            grad_sample_mode=mode,
            progress=False,
        )
        dataset = TokenizedDataset(rows, lm.tokenizer, SST2, max_length=32)
        trainer = make_trainer(lm, dataset, config, units=units)
        trainer.train()
        finals.append(
            [t for p in read_points(lm.handles) for t in (p.A, p.B)]
            + [p.detach().clone() for p in lm.head_params]
        )
        histories.append(trainer.history)
    layer, hooks = finals
    for a, b in zip(layer, hooks, strict=True):
        assert (a - b).norm() <= 1e-4 * b.norm(), (a - b).norm()
    assert histories[0] == histories[1]


def test_the_layer_path_adds_no_hook_and_a_step_leaves_no_grads(tiny_bert, sst2_rows):
    """No module of the model has a forward or backward hook on the layer path; the attached
    layers are exactly the LoRA factors' and the head's; a non-DP trainer on the same model
    takes them off (its summed gradients are autograd's own)."""
    lm = load_model(ModelConfig(model=tiny_bert, rank=4))
    dataset = TokenizedDataset(sst2_rows[:40], lm.tokenizer, SST2, max_length=32)
    config = TrainConfig(noise_multiplier=1.0, steps=1, batch_size=8, micro_batch_size=3, seed=0)
    trainer = make_trainer(lm, dataset, config.model_copy(update={"progress": False}))
    modules = list(lm.model.modules())
    assert not any(m._forward_hooks or m._backward_hooks for m in modules)
    layers = {id(m) for m in per_example.attached(lm.model)}
    owners = {id(m) for m in modules if any(p.requires_grad for p in m.parameters(recurse=False))}
    assert layers == owners and len(owners) == 2 * len(lm.handles) + 1
    trainer.step()
    for name, p in lm.model.named_parameters():
        assert p.grad is None and getattr(p, "grad_sample", None) is None, name
    make_trainer(lm, dataset, config.model_copy(update={"method": "nondp", "progress": False}))
    assert per_example.attached(lm.model) == []


def test_a_trainable_layer_that_is_not_linear_is_refused_with_the_way_out():
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    model[0].requires_grad_(False)
    with pytest.raises(ConfigError, match=r"LayerNorm.*grad_sample_mode='hooks'"):
        per_example.trainable_layers(model)


# -- whitened rows written into the clip's buffers (PRISM's step) ------------------------------


def _sinks(lm, b, seed=3):
    """A sink for every LoRA factor with a random whitening matrix: {param id: sink}."""
    g = torch.Generator().manual_seed(seed)
    sinks = {}
    for h in lm.handles:
        (m, r), n = h.lora_B.shape, h.lora_A.shape[1]
        for p, side, k in ((h.lora_B, "input", m), (h.lora_A, "output", n)):
            W = torch.randn(r, r, generator=g, dtype=torch.float64)
            sinks[id(p)] = per_example.RowSink(torch.empty(b, r, k, dtype=torch.float64), W, side)
            per_example.set_sink(p, sinks[id(p)])
    return sinks


def _expected_sink(h, p, rows, W):
    """What a sink holds: ``W.T grad`` for lora_A (r, n), ``(grad W).T`` for lora_B (m, r)."""
    return W.mT @ rows if p is h.lora_A else (rows @ W).mT


@pytest.mark.parametrize("calls", [1, 2])
def test_row_sinks_hold_the_whitened_rows_of_both_factors(tiny_bert, sst2_rows, calls):
    """With sinks set, each LoRA factor's backward writes its rows whitened, ``W.T grad_i`` for
    ``lora_A`` and ``(grad_i W).T`` for ``lora_B``, into the sink (float64, relative 1e-10,
    LoRA dropout on), no ``grad_sample`` for those factors, the head's rows as before; a second
    backward adds to what the first wrote (as ``grad_sample`` sums)."""
    lm = _bert(tiny_bert, dropout=0.3)
    batch = _sst2_batch(lm, sst2_rows[:6])
    want, _ = _layer_rows(lm, batch, SST2)
    params = _trainable(lm)
    layers = per_example.trainable_layers(lm.model)
    per_example.attach(layers)
    sinks = _sinks(lm, 6)
    for _ in range(calls):
        torch.manual_seed(0)  # the dropout masks of _layer_rows
        per_example_loss(lm.model, batch, SST2).sum().backward()
    rows = dict(zip((id(p) for p in params), want, strict=True))
    for h in lm.handles:
        for p in (h.lora_A, h.lora_B):
            sink = sinks[id(p)]
            expected = calls * _expected_sink(h, p, rows[id(p)], sink.whiten)
            assert sink.filled and getattr(p, "grad_sample", None) is None
            assert _worst([sink.out], [expected]) <= TOL
    head = [p.grad_sample for p in lm.head_params]
    assert _worst(head, [calls * rows[id(p)] for p in lm.head_params]) <= TOL
    per_example.clear_sinks(params)
    assert not any(hasattr(p, "row_sink") for p in params)
    per_example.detach(layers)


def test_a_row_sink_of_another_shape_is_refused(tiny_bert, sst2_rows):
    lm = _bert(tiny_bert)
    batch = _sst2_batch(lm, sst2_rows[:6])
    per_example.attach(per_example.trainable_layers(lm.model))
    _sinks(lm, 5)  # set for 5 examples, the batch has 6
    with pytest.raises(RuntimeError, match="another micro-batch or layer"):
        per_example_loss(lm.model, batch, SST2).sum().backward()


def _roll_sink(monkeypatch):
    """Plant: each sink's rows moved one example along."""
    write = per_example.RowSink.write

    def planted(self, g, x):
        write(self, g, x)
        self.out.copy_(self.out.roll(1, dims=0))

    monkeypatch.setattr(per_example.RowSink, "write", planted)


def _skip_whitening(monkeypatch):
    """Plant: rows written without the whitening."""
    write = per_example.RowSink.write

    def planted(self, g, x):
        self.whiten = torch.eye(self.whiten.shape[0], dtype=self.whiten.dtype)
        write(self, g, x)

    monkeypatch.setattr(per_example.RowSink, "write", planted)


def _swap_whitening(monkeypatch):
    """Plant: each module's two factors whitened by each other's R^-1."""
    prepare = StepRows.prepare

    def planted(self, micro):
        prepare(self, micro)
        for (_, a), (_, c) in zip(self._sinks[0::2], self._sinks[1::2], strict=True):
            a.whiten, c.whiten = c.whiten, a.whiten

    monkeypatch.setattr(StepRows, "prepare", planted)


def _trainer_for(tiny_bert, sst2_rows, setting, split):
    """A PRISM trainer on 60 rows: ``record``, ``user`` (3 records a person, at most 2 a
    batch), ``user-split`` (3 a batch in micro-batches of 2: a person's records span two) or
    ``siamese`` text pairs; at an unbalanced point (A x 3, B / 3), where RA and RB differ."""
    rows, units, settings = sst2_rows[:60], None, {}
    if setting == "siamese":
        lm = _bert(tiny_bert, text_pairs=True, pair_encoding="siamese")
        rows = [
            {"text_a": a["text"], "text_b": b["text"], "label": a["label"]}
            for a, b in zip(rows[0::2], rows[1::2], strict=True)
        ]
        dataset = TokenizedDataset(rows, lm.tokenizer, SST2, max_length=32, pair_encoding="siamese")
    else:
        lm = _bert(tiny_bert)
        dataset = TokenizedDataset(rows, lm.tokenizer, SST2, max_length=32)
    if setting.startswith("user"):
        units = [i // 3 for i in range(len(rows))]
        most = 3 if setting == "user-split" else 2
        settings = {"privacy_unit": "user", "max_records_per_user": most}
    config = TrainConfig(
        noise_multiplier=1.0,
        steps=1,
        batch_size=12,
        micro_batch_size=2 if setting == "user-split" else 5,
        max_norm=3.0 if setting == "siamese" else 1.0,  # a pair's head reads 4 features
        head_max_norm=split,
        seed=0,
        progress=False,
        **settings,
    )
    trainer = make_trainer(lm, dataset, config, units=units)
    write_points_(lm.handles, [Point(p.A * 3, p.B / 3) for p in read_points(lm.handles)])
    return lm, trainer


@pytest.mark.parametrize(
    ("setting", "fault", "split"),
    [
        ("record", None, None),
        ("record", None, 0.8),
        ("record-small", None, None),  # 2-row micro-batches: several share a clip
        ("record-small", None, 0.8),
        ("record-small", _roll_sink, None),
        ("user", None, None),
        ("user-split", None, None),
        ("siamese", None, None),
        ("record", _roll_sink, None),  # under a split clip a permutation of rows sums the same
        ("record", _skip_whitening, None),
        ("record", _skip_whitening, 0.8),
        ("record", _swap_whitening, None),
    ],
)
def test_whitened_rows_give_the_clipped_sum_of_the_grad_sample_rows(
    tiny_bert, sst2_rows, monkeypatch, setting, fault, split
):
    """PRISM's clipped sum over a batch's micro-batches from the whitened rows the layers write
    (the default) equals the one from their ``grad_sample`` rows (``whitened_rows = False``)
    within float32 rounding (the clip works at the float32 frames: relative 1e-5): joint and
    split head clip, examples clipped and not, at the person level (records folded into
    people, also a person's records across two micro-batches) and for siamese pairs (two text
    rows an example), also where micro-batches of 2 rows share a buffer and a clip
    (``packed_groups``). A planted fault in the sinks (rows of the wrong example, caught through
    the joint clip that ties them to the head; rows not whitened; the two factors' R^-1
    swapped) moves it by more than 1%. No sink is left on a factor."""
    small = setting == "record-small"
    lm, trainer = _trainer_for(tiny_bert, sst2_rows, "record" if small else setting, split)
    batch = trainer._next_batch()
    points = read_points(lm.handles)
    frames = step_frames(points)
    opened = []
    split_micro = (lambda whole: micro_batches(whole, 2)) if small else trainer._micro_batches

    def watch(whole):
        for micro in split_micro(whole):
            opened.append(OPEN_KEY in micro and bool(micro[OPEN_KEY].any()))
            yield micro

    trainer._micro_batches = watch
    if fault is not None:
        fault(monkeypatch)
    got, _ = trainer.clipped_sum(batch, points, frames=frames)
    assert any(opened) == (setting == "user-split")  # a person across two micro-batches
    assert not any(hasattr(p, "row_sink") for p in _trainable(lm))
    trainer.whitened_rows = False
    want, _ = trainer.clipped_sum(batch, points, frames=frames)
    assert got.count == want.count > 5  # several micro-batches
    assert 0 < want.clipped < want.count
    got_t = [t for s in got.sums for t in s] + list(got.euclidean)
    want_t = [t for s in want.sums for t in s] + list(want.euclidean)
    error = max(float((a - b).norm() / b.norm()) for a, b in zip(got_t, want_t, strict=True))
    assert error <= 1e-5 if fault is None else error > 0.01


def test_packed_groups_fill_the_cap_in_order():
    """Consecutive micro-batches share a clip while their rows fit in the cap; one larger than
    the cap goes alone; a cap of 0 clips each alone; every micro-batch is in one group."""
    assert packed_groups([3, 4, 5, 20, 2, 2], 12) == [3, 1, 2]
    assert packed_groups([3, 4, 5], 11) == [2, 1]
    assert packed_groups([13, 1], 12) == [1, 1]
    assert packed_groups([3, 4, 5], 0) == [1, 1, 1]
    assert packed_groups([], 12) == []
    sizes = [5, 1, 7, 3, 3, 9, 2]
    groups = packed_groups(sizes, 10)
    assert sum(groups) == len(sizes)
    start = 0
    for count in groups:
        assert count == 1 or sum(sizes[start : start + count]) <= 10
        start += count


@pytest.mark.parametrize(
    ("setting", "grouped"), [("record", True), ("user", False), ("siamese", False)]
)
def test_record_level_micro_batches_share_one_clip(
    tiny_bert, sst2_rows, monkeypatch, setting, grouped
):
    """At the record level with one text an example the whitened rows of consecutive
    micro-batches fill one buffer of at most ``micro_batch_size`` rows and meet one clip
    (fewer clips than micro-batches, each of at most that many rows, every example counted
    once); a person's fold or siamese pairs clip every micro-batch alone."""
    _, trainer = _trainer_for(tiny_bert, sst2_rows, setting, None)
    if setting == "record":  # micro-batches of 2 rows under a cap of 5, as length groups cut
        trainer._micro_batches = lambda whole: micro_batches(whole, 2)
    batch = trainer._next_batch()
    micros = list(trainer._micro_batches(batch))
    clip = prism_trainer.clip_and_sum_whitened
    seen = []

    def counted(points, rows, **kwargs):
        seen.append(int(rows[0][0].shape[1]))
        return clip(points, rows, **kwargs)

    monkeypatch.setattr(prism_trainer, "clip_and_sum_whitened", counted)
    points = read_points(trainer.loaded.handles)
    got, _ = trainer.clipped_sum(batch, points)
    assert len(micros) > 2
    if grouped:
        assert 1 <= len(seen) < len(micros)
        assert max(seen) <= trainer.micro_batch_size
        assert sum(seen) == got.count == int(batch["labels"].shape[0])
    else:
        assert len(seen) == len(micros)


def test_a_step_whose_sinks_fail_leaves_no_sink_behind(tiny_bert, sst2_rows, monkeypatch):
    """An error inside the backward (here a sink that refuses to write) propagates, leaves the
    factors without sinks and no per-example rows behind, and the next step runs."""
    lm = _bert(tiny_bert)
    dataset = TokenizedDataset(sst2_rows[:40], lm.tokenizer, SST2, max_length=32)
    config = TrainConfig(noise_multiplier=1.0, steps=1, batch_size=8, seed=0, progress=False)
    trainer = make_trainer(lm, dataset, config)

    def broken(self, g, x):
        raise RuntimeError("planted")

    monkeypatch.setattr(per_example.RowSink, "write", broken)
    with pytest.raises(RuntimeError, match="planted"):
        trainer.step()
    params = _trainable(lm)
    assert not any(hasattr(p, "row_sink") for p in params)
    assert all(getattr(p, "grad_sample", None) is None for p in params)  # no stale rows
    monkeypatch.undo()
    assert trainer.step().step == 1  # the failed step counted nothing
    assert all(getattr(p, "grad_sample", None) is None for p in params)


def test_step_rows_refuse_a_factor_the_backward_did_not_reach(tiny_bert):
    """Buffers are allocated uninitialised: a factor whose slot no backward wrote is an error,
    never its memory in a sum."""
    lm = _bert(tiny_bert)
    frames = step_frames(read_points(lm.handles))
    rows = StepRows(lm.handles, frames)
    rows.prepare({"labels": torch.zeros(3, dtype=torch.long)})
    with pytest.raises(ConfigError, match=r"LoRA modules \[.*query.*\] got no per-example"):
        rows.rows()
    rows.close()
    assert not any(hasattr(p, "row_sink") for p in _trainable(lm))
