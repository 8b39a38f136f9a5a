"""bench/step.py's helpers: option defaults, the token counts, the in-order A/B switch and the
Gemma-3 decoder path (a tiny config-built model takes one step).

Nothing is timed: the timings are the benchmark's job (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import transformers
from helpers.bench import bench_module

from prism_core.records import DEFAULT_MECHANISM
from prism_runtime.config import RunConfig


@pytest.fixture(scope="module")
def step():
    yield from bench_module("step")


def batch_of(lengths, width=6):
    """A collated seq-cls batch, right-padded to ``width``, rows of the given token counts."""
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return {"input_ids": mask * 7, "attention_mask": mask, "labels": torch.zeros(len(lengths))}


def test_defaults_keep_todays_packed_run(step):
    args = step.parse_args([])
    assert args.data == "packed" and args.methods == ["prism", "dp-adamw", "nondp"]
    assert step.resolve_workload(args.data) == step.Workload("packed", 64, 64, 64)


def test_real_data_takes_the_products_defaults(step):
    run = RunConfig()
    for data in ("sst2", "medical_abstracts"):
        work = step.resolve_workload(data)
        assert work == step.Workload(data, 128, run.batch_size, run.micro_batch_size)
    work = step.resolve_workload("sst2", max_length=64, batch=32, micro_batch=16)
    assert work == step.Workload("sst2", 64, 32, 16)


def test_packed_stays_64_tokens(step):
    assert step.resolve_workload("packed", max_length=64).max_length == 64
    with pytest.raises(SystemExit, match="exactly 64"):
        step.resolve_workload("packed", max_length=128)


def test_memory_process_flags_rebuild_the_workload(step):
    work = step.resolve_workload("medical_abstracts", micro_batch=32)
    args = step.parse_args(work.flags())
    rebuilt = step.resolve_workload(
        args.data, max_length=args.max_length, batch=args.batch, micro_batch=args.micro_batch
    )
    assert rebuilt == work


def test_methods_option(step):
    args = step.parse_args(["--methods", "prism", "prism-inorder", "prism"])
    assert args.methods == ["prism", "prism-inorder"]
    assert step.pairs(args.methods) == [("prism", "prism-inorder")]
    with pytest.raises(SystemExit):
        step.parse_args(["--methods", "sgd"])


def test_token_counts(step):
    micro = batch_of([1, 4, 2])
    assert step.padded_tokens(micro) == 3 * 6  # rows x width, padding included
    assert step.real_tokens(micro) == 7
    siamese = {"attention_mask": torch.ones(3, 2, 5, dtype=torch.long)}
    assert step.padded_tokens(siamese) == 30


@pytest.mark.parametrize(("in_order", "padded"), [(False, 2 * 1 + 2 * 4), (True, 2 * 4 + 2 * 4)])
def test_probe_counts_and_forces_batch_order(step, in_order, padded):
    """Rows of 1, 4, 1, 4 tokens in micro-batches of 2: by length [1, 1] [4, 4], else [1, 4] x 2."""
    import prism_runtime.trainer.base as trainer_module

    original = trainer_module.micro_batches
    with step.micro_batch_probe(in_order=in_order) as seen:
        micros = list(trainer_module.micro_batches(batch_of([1, 4, 1, 4]), 2, by_length=True))
    assert trainer_module.micro_batches is original
    assert sum(p for p, _ in seen) == padded and sum(r for _, r in seen) == 10
    assert sum(int(m["attention_mask"].shape[0]) for m in micros) == 4


def test_throughput_and_its_ratio(step):
    a = step.MethodTimes(cpu=[0.5, 1.0, 1.0], batch=[60, 64, 70])
    b = step.MethodTimes(cpu=[1.0, 1.0, 2.0], batch=[60, 64, 70])
    assert a.per_cpu_second() == pytest.approx(194 / 2.5, rel=1e-12)
    ratio = step.throughput_ratio({"a": a, "b": b}, "a", "b")
    assert ratio["of_totals"] == pytest.approx(4.0 / 2.5, rel=1e-12)
    assert ratio["paired"] == pytest.approx(2.0, rel=1e-12)  # per round: 2, 1, 2


def test_gemma_4b_shape_has_the_text_models_parameter_count(step):
    """``--model gemma3-4b`` is Gemma-3-4B's text decoder: 3.88e9 parameters (the 4.3e9 of
    google/gemma-3-4b-pt less its 0.42e9 vision tower), counted on the meta device."""
    dims = {k: v for k, v in step.DECODERS["gemma3-4b"].items() if v is not None}
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**dims))
    total = sum(p.numel() for p in model.parameters())
    assert abs(total / 3.88e9 - 1) < 0.01, total
    names = {n.split(".")[-1] for n, _ in model.named_modules()}
    assert set(step.DECODER_LORA["target_modules"]) <= names


def test_decoder_runs_a_private_step_on_real_rows(step, monkeypatch, tmp_path):
    """The decoder path end to end on the tiny Gemma-3 (built under ``tmp_path``): a causal-LM
    model with r = 16 LoRA on q, k, v, up, down, SST-2 rows as instruction/response, one PRISM
    step that records its privacy event."""
    if not step.SST2.exists():
        pytest.skip(f"needs {step.SST2} (PRISM_DATA_DIR or ../shared/data)")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setitem(step.SETTINGS, "model", "gemma3-tiny")
    monkeypatch.setitem(step.SETTINGS, "device", "cpu")
    work = step.resolve_workload("sst2", batch=8, micro_batch=4)
    dataset = step.build_dataset(step.load_tokenizer(step.model_path()), work, 64)
    trainer = step.make_run("prism", dataset, 0, work)
    assert trainer.loaded.config.task == "causal-lm"
    assert len(trainer.loaded.handles) == 2 * 5 and trainer.loaded.handles[0].shape[2] == 16
    result = trainer.step()
    assert result.record is not None and result.record.mechanism == DEFAULT_MECHANISM
    assert math.isfinite(result.loss)
    with pytest.raises(SystemExit, match="--data sst2"):
        step.build_dataset(None, step.resolve_workload("packed"), 8)
