"""A hostile coordinator's NUMBERS, through the real ClientApp train handler.

The rule (docs/security.md, "Numbers from the coordinator"): whether a site replies ``ok``, the
code it sends and every released number depend on private data only through the noise. So two
neighbouring shards (same N, one label differs) give the same reply status and finite releases
whatever the coordinator broadcasts; every number out of its accepted range
(``prism_runtime.ranges``) is answered with a code before anything is charged, leaving the
site's ledger byte-identical; and the shard size a reply states is the one the documents say.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client.app import app
from prism_runtime.config import RunConfig, parse_config
from prism_runtime.exchange import to_arrays
from prism_runtime.model import load_model, model_config_for
from prism_runtime.protocol import (
    ACCOUNTING,
    ARRAYS,
    CONFIG,
    HEAD_PREFIX,
    ROUND_NONCE,
    SERVER_ROUND,
    SITE_ERROR_CODES,
    STATUS_OK,
    STATUS_REFUSED,
    UPDATE,
)
from prism_runtime.ranges import BROADCAST_SCALE_MAX, SERVER_ROUND_MAX

N = 32


@pytest.fixture(autouse=True)
def _task_identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1


def _run_config(tiny_bert: str, **extra: object) -> dict[str, object]:
    values: dict[str, object] = {
        "model": tiny_bert,
        "lora-rank": 4,
        "local-steps": 1,
        "batch-size": 8,
        "micro-batch-size": 8,
        "max-length": 24,
        "noise-multiplier": 10.0,
        "target-epsilon": 8.0,
    }
    values.update(extra)
    return values


def _site(tmp_path: Path, name: str, positives: int) -> dict[str, object]:
    """A deployed site whose shard has N rows, ``positives`` of them labelled 1."""
    folder = tmp_path / name
    folder.mkdir()
    rows = ["text,label"] + [
        f"a short note number {i},{1 if i < positives else 0}" for i in range(N)
    ]
    (folder / "train.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return {
        "site-id": name,
        "data-path": str(folder / "train.csv"),
        "state-dir": str(folder / "state"),
        "epsilon-cap": 8.0,
        "delta": 1e-5,
        "require-secure-rng": True,
    }


def _call(arrays, run_config, node_config, server_round: object = 1, run_id: int = 42):
    config = ConfigRecord({ROUND_NONCE: "n", "run-id": f"run-{run_id}"})
    if server_round is not None:
        config[SERVER_ROUND] = server_round
    content = RecordDict({CONFIG: config, ARRAYS: ArrayRecord(arrays)})
    msg = Message(content=content, dst_node_id=7, message_type="train")
    context = Context(
        run_id=run_id, node_id=7, node_config=node_config, state=RecordDict(), run_config=run_config
    )
    return app(msg, context)


def _start(run_config) -> dict[str, torch.Tensor]:
    run = parse_config(RunConfig, run_config, what="run config")
    return to_arrays(load_model(model_config_for(run), method="prism"))


def _status(reply) -> str:
    """``ok``, ``refused:<reason>`` or ``error:<code>``: everything a reply's outcome says."""
    if reply.has_error():
        assert reply.error.reason == SITE_ERROR_CODES.get(reply.error.code)
        return f"error:{reply.error.code}"
    facts = reply.content[ACCOUNTING]
    if facts["status"] == STATUS_REFUSED:
        return f"refused:{facts['reason']}"
    assert facts["status"] == STATUS_OK
    return STATUS_OK


def _released(reply) -> dict[str, torch.Tensor]:
    return reply.content[UPDATE].to_torch_state_dict() if not reply.has_error() else {}


def _state(node: dict[str, object]) -> dict[str, bytes]:
    """Every file of the site's state folder, byte for byte (the ledger and the stored reply)."""
    root = Path(str(node["state-dir"]))
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _head_limit(start: dict[str, torch.Tensor], name: str) -> float:
    return BROADCAST_SCALE_MAX * (1.0 + float(start[name].abs().max()))


def _broadcasts(start: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Hostile broadcasts: each changes the site's own start in one way."""
    heads = [k for k in start if k.startswith(HEAD_PREFIX)]
    weight = next(k for k in heads if k.endswith("weight"))
    factor = next(k for k in start if k.endswith("/A"))
    signs = torch.where(torch.arange(start[weight].numel()) % 2 == 0, 1.0, -1.0)
    signs = signs.reshape(start[weight].shape)

    def changed(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**start, name: value}

    U, S, Vh = torch.linalg.svd(start[factor].double(), full_matrices=False)
    S_bad = S.clone()
    S_bad[-1] = S[0] * 2e-6  # rank r in name only: s_r / s_1 = 2e-6
    return {
        "honest": dict(start),
        "head 3e38": changed(weight, 3e38 * signs),
        "head at its limit": changed(weight, 0.99 * _head_limit(start, weight) * signs),
        "head above its limit": changed(weight, 1.01 * _head_limit(start, weight) * signs),
        "factors 1e19": {
            k: (v * 1e19 if "/" in k and "head" not in k else v) for k, v in start.items()
        },
        "ill-conditioned factor": changed(factor, (U @ torch.diag(S_bad) @ Vh).float()),
    }


def test_neighbouring_shards_give_the_same_status_and_finite_releases(tiny_bert, tmp_path):
    """32 negatives against 31 negatives and 1 positive (same N): for every broadcast, honest or
    hostile, both sites answer alike, and every released number is finite."""
    run_config = _run_config(tiny_bert)
    start = _start(run_config)
    sites = [_site(tmp_path, "all-negative", 0), _site(tmp_path, "one-positive", 1)]
    expected = {
        "honest": STATUS_OK,
        "head 3e38": "refused:bad-broadcast",
        "head at its limit": STATUS_OK,
        "head above its limit": "refused:bad-broadcast",
        "factors 1e19": "refused:bad-broadcast",
        "ill-conditioned factor": "refused:bad-broadcast",
    }
    server_round = 0
    for name, arrays in _broadcasts(start).items():
        for _ in range(2):  # fresh Poisson batches and noise each time
            server_round += 1
            replies = [_call(arrays, run_config, node, server_round) for node in sites]
            assert [_status(r) for r in replies] == [expected[name]] * 2, name
            for reply in replies:
                for key, value in _released(reply).items():
                    assert torch.isfinite(value).all(), (name, key)


@pytest.mark.parametrize(
    ("server_round", "why"),
    [
        (-1, "negative"),
        (0, "zero"),
        (SERVER_ROUND_MAX + 1, "too large"),
        (True, "a bool"),
        (1.5, "not an integer"),
        ("1", "a string"),
        (None, "missing"),
    ],
)
def test_a_round_number_out_of_range_is_refused_and_charges_nothing(
    tiny_bert, tmp_path, server_round, why
):
    run_config = _run_config(tiny_bert)
    start = _start(run_config)
    node = _site(tmp_path, "hospital", 1)
    assert _status(_call(start, run_config, node, 1)) == STATUS_OK
    before = _state(node)
    reply = _call(start, run_config, node, server_round)
    assert _status(reply) == "refused:bad-round", why
    assert reply.content[ACCOUNTING][SERVER_ROUND] == 0
    assert _state(node) == before  # byte-identical ledger and stored reply
    # the site is not bricked: the next round runs
    assert _status(_call(start, run_config, node, 2)) == STATUS_OK


@pytest.mark.parametrize(
    "extra",
    [
        {"max-norm": 1e-44},
        {"max-norm": 1e30},
        {"max-norm": 0.5, "head-max-norm": 1e-9},
        {"noise-multiplier": 0.001},
        {"noise-multiplier": 0.29},
        {"noise-multiplier": 1e9},
        {"max-norm": "auto", "clip-quantile-noise": 0.00125},
        {"lr": 1e30},
        {"head-lr": 1e30},
        {"local-steps": 10**6},
        {"num-rounds": 10**5, "local-steps": 10},
    ],
    ids=lambda extra: ",".join(f"{k}={v}" for k, v in extra.items()),
)
def test_a_run_number_out_of_range_is_a_coded_answer_and_charges_nothing(
    tiny_bert, tmp_path, extra
):
    """Out-of-range run-config numbers: error 4001 (the run config is refused) before any
    charge; the ledger stays byte-identical and the message carries no detail."""
    node = _site(tmp_path, "hospital", 1)
    run_config = _run_config(tiny_bert)
    start = _start(run_config)
    assert _status(_call(start, run_config, node, 1)) == STATUS_OK
    before = _state(node)
    reply = _call(start, _run_config(tiny_bert, **extra), node, 2, run_id=43)
    assert _status(reply) == "error:4001"
    assert _state(node) == before


def test_an_out_of_range_broadcast_charges_nothing(tiny_bert, tmp_path):
    run_config = _run_config(tiny_bert)
    start = _start(run_config)
    node = _site(tmp_path, "hospital", 1)
    assert _status(_call(start, run_config, node, 1)) == STATUS_OK
    before = _state(node)
    for server_round, (name, arrays) in enumerate(_broadcasts(start).items(), start=2):
        if name in ("honest", "head at its limit"):
            continue
        assert _status(_call(arrays, run_config, node, server_round)) == "refused:bad-broadcast"
        assert _state(node) == before, name


def test_a_reply_states_the_shard_size_as_documented(tiny_bert, tmp_path):
    """docs/security.md: N is public to the coordinator (b / q of every reply, refusals too),
    so the guarantee against it is replace-one with N public."""
    run_config = _run_config(tiny_bert)
    node = _site(tmp_path, "hospital", 1)
    facts = _call(_start(run_config), run_config, node, 1).content[ACCOUNTING]
    assert facts["expected-batch-size"] / facts["q"] == pytest.approx(N, rel=1e-12)
    refused = _call(_start(run_config), _run_config(tiny_bert, **{"target-epsilon": 9.0}), node, 2)
    facts = refused.content[ACCOUNTING]
    assert facts["status"] == STATUS_REFUSED and 8 / facts["q"] == pytest.approx(N, rel=1e-12)


@pytest.mark.parametrize(
    "extra",
    [
        {"max-norm": 1e4, "head-max-norm": 0.9e4, "noise-multiplier": 1e4},
        {"max-norm": 2e-6, "head-max-norm": 1e-6, "noise-multiplier": 1.0},
        {"max-norm": 1e4, "head-max-norm": -1, "noise-multiplier": 1.0, "lr": 10.0},
        {"head-lr": 1000.0, "lr": 10.0, "noise-multiplier": 1e4},
        {"head-optimizer": "adamw", "head-lr": 1000.0, "max-norm": 1e4, "head-max-norm": 1.0},
        {"method": "fedavg-factors", "max-norm": 1e4, "noise-multiplier": 1e4, "lr": 10.0},
    ],
    ids=lambda extra: ",".join(f"{k}={v}" for k, v in extra.items()),
)
def test_numbers_at_the_edges_of_their_ranges_train_and_release_finite_values(
    tiny_bert, tmp_path, extra
):
    """Nothing the coordinator controls makes a charged round fail: at the edges of the
    accepted ranges, and at a broadcast at its limits, the round runs and releases finite
    numbers (a failure after the charge would spend budget for nothing)."""
    run_config = _run_config(tiny_bert, **extra)
    run = parse_config(RunConfig, run_config, what="run config")
    method = "prism" if run.method == "prism" else "dp-adamw"
    start = to_arrays(load_model(model_config_for(run), method=method))
    heads = [k for k in start if k.startswith(HEAD_PREFIX)]
    at_limits = dict(start)
    for name in heads:
        signs = torch.where(torch.arange(start[name].numel()) % 2 == 0, 1.0, -1.0)
        at_limits[name] = 0.99 * _head_limit(start, name) * signs.reshape(start[name].shape)
    for name, value in start.items():
        if name.endswith(("/A", "/B")):  # spectral norm 0.9 BROADCAST_SCALE_MAX (1 + ||F0||)
            norm = float(torch.linalg.matrix_norm(value.double(), ord=2))
            limit = BROADCAST_SCALE_MAX * (1.0 + norm)
            at_limits[name] = value * (0.9 * limit / norm) if norm > 0 else value
    node = _site(tmp_path, "hospital", 1)
    for server_round, arrays in enumerate((start, at_limits), start=1):
        reply = _call(arrays, run_config, node, server_round)
        assert _status(reply) == STATUS_OK
        for key, value in _released(reply).items():
            assert torch.isfinite(value).all(), key
