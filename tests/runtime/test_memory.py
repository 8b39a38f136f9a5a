"""The micro-batch a trainer chooses from the memory it has (``prism_runtime.memory``)."""

from __future__ import annotations

import logging

import pytest

from prism_runtime.data import TokenizedDataset
from prism_runtime.memory import (
    CPU_MICRO_BATCH_MAX,
    MEMORY_SHARE,
    auto_micro_batch,
    available_bytes,
    bytes_per_example,
)
from prism_runtime.model import ModelConfig, load_model
from prism_runtime.trainer import TrainConfig, make_trainer


@pytest.fixture(scope="module")
def tiny(tiny_bert):
    return load_model(ModelConfig(model=tiny_bert, rank=4))


def test_the_choice_is_the_largest_micro_batch_whose_estimate_fits_the_memory_share(tiny):
    per = bytes_per_example(tiny, 32)
    for examples in (1, 3, 17):
        memory = int(examples * per / MEMORY_SHARE) + 1
        assert auto_micro_batch(tiny, 32, available=memory).size == examples
    assert auto_micro_batch(tiny, 32, available=0).size == 1  # never 0
    assert auto_micro_batch(tiny, 32, available=10**15).size == CPU_MICRO_BATCH_MAX  # CPU cap


def test_the_estimate_grows_with_the_rows_the_lora_modules_and_siamese_pairs(tiny_bert, tiny):
    assert bytes_per_example(tiny, 64) > 2 * bytes_per_example(tiny, 32)  # attention is T^2
    wider = load_model(
        ModelConfig(model=tiny_bert, rank=8, target_modules=("query", "key", "value"))
    )
    assert bytes_per_example(wider, 32) > bytes_per_example(tiny, 32)
    pairs = load_model(
        ModelConfig(model=tiny_bert, rank=4, text_pairs=True, pair_encoding="siamese")
    )
    assert pairs.spec.siamese
    assert bytes_per_example(pairs, 32) > 1.9 * bytes_per_example(tiny, 32)


def test_a_trainer_at_micro_batch_zero_chooses_and_says_so_and_a_set_one_is_kept(
    tiny, sst2_rows, caplog
):
    dataset = TokenizedDataset(sst2_rows[:40], tiny.tokenizer, "seq-cls", max_length=32)
    base = {"noise_multiplier": 1.0, "batch_size": 8, "seed": 0, "progress": False}
    assert TrainConfig(**base).micro_batch_size == 0  # auto is the default
    with caplog.at_level(logging.INFO, logger="prism_runtime.trainer.base"):
        trainer = make_trainer(tiny, dataset, TrainConfig(**base))
    want = auto_micro_batch(tiny, 32, available=available_bytes(tiny.device)).size
    assert abs(trainer.micro_batch_size - want) <= 1  # free memory moves between the calls
    assert f"micro-batch {trainer.micro_batch_size} (auto:" in caplog.text
    trainer.step()
    fixed = make_trainer(tiny, dataset, TrainConfig(**base, micro_batch_size=3))
    assert fixed.micro_batch_size == 3
