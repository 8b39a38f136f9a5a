"""The real ClientApp callable: coded error replies, refusals as replies, where the ledger lives."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client.app import app, error_code
from prism_runtime.config import RunConfig, parse_config
from prism_runtime.exchange import to_arrays
from prism_runtime.model import load_model, model_config_for
from prism_runtime.protocol import (
    ACCOUNTING,
    ARRAYS,
    CONFIG,
    ROUND_NONCE,
    SECURE_ERRORS,
    SERVER_ROUND,
    SITE_ERROR_CODES,
    STATUS_OK,
    STATUS_REFUSED,
)
from prism_runtime.secure_sum import (
    ConsistencyError,
    KeyBindingError,
    MasksUsedError,
    NoiseShareError,
    SecureSumAbortedError,
    SecureSumError,
    ShareError,
    ThresholdError,
)

PRIVATE = "Jane-Roe-1984-diagnosis"  # a cell value that must never leave the site


def _run_config(tiny_bert, **extra):
    values = {
        "model": tiny_bert,
        "lora-rank": 4,
        "local-steps": 1,
        "batch-size": 8,
        "micro-batch-size": 8,
        "synthetic-examples": 32,
        "max-length": 24,
        "noise-multiplier": 1.0,
        "target-epsilon": 8.0,
    }
    values.update(extra)
    return values


@pytest.fixture(autouse=True)
def _task_identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


@pytest.fixture
def site_log():
    """Records of the ClientApp's own logger (the site's log)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger = logging.getLogger("client.app")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _message(arrays, **config):
    content = RecordDict(
        {
            CONFIG: ConfigRecord({SERVER_ROUND: 1, ROUND_NONCE: "n-1", **config}),
            ARRAYS: ArrayRecord(arrays),
        }
    )
    return Message(content=content, dst_node_id=7, message_type="train")


def _call(msg, run_config, node_config):
    TaskIdentity.node_id = 7
    context = Context(
        run_id=42, node_id=7, node_config=node_config, state=RecordDict(), run_config=run_config
    )
    return app(msg, context)


def _arrays(run_config):
    run = parse_config(RunConfig, run_config, what="run config")
    return to_arrays(load_model(model_config_for(run), method="prism"))


def _assert_coded(reply, code):
    assert reply.has_error() and not reply.has_content()
    assert reply.error.code == code
    assert reply.error.reason == SITE_ERROR_CODES[code]  # the fixed text, nothing else


def test_a_data_error_is_a_coded_reply_without_the_data(tiny_bert, tmp_path, site_log):
    data = tmp_path / "train.csv"
    data.write_text(f"text,label\nfine,1\nok,{PRIVATE}\n", encoding="utf-8")
    node = {
        "site-id": "hospital-a",
        "data-path": str(data),
        "state-dir": str(tmp_path / "state"),
        "epsilon-cap": 8.0,
        "delta": 1e-6,
    }
    run_config = _run_config(tiny_bert)
    reply = _call(_message({"x": torch.zeros(1)}), run_config, node)
    _assert_coded(reply, 4002)
    assert PRIVATE not in reply.error.reason and "line 3" not in reply.error.reason
    # the full error, with its traceback, is in the site's own log only
    (record,) = [r for r in site_log if r.exc_info]
    assert "line 3: label must be an integer" in str(record.exc_info[1])
    assert PRIVATE not in str(record.exc_info[1])  # not even the log quotes the cell


def test_a_config_error_is_a_coded_reply(tiny_bert, tmp_path, site_log):
    node = {"site-id": "hospital-a", "epsilon-cap": 8.0, "delta": 1e-6}  # no state-dir
    reply = _call(_message({"x": torch.zeros(1)}), _run_config(tiny_bert), node)
    _assert_coded(reply, 4001)
    assert "state-dir" not in reply.error.reason
    assert any("lacks state-dir" in str(r.exc_info[1]) for r in site_log if r.exc_info)
    bad_run = _call(_message({"x": torch.zeros(1)}), {"secure-rng": True}, node)
    _assert_coded(bad_run, 4001)


def test_any_other_failure_is_a_coded_internal_error(tiny_bert, tmp_path, site_log):
    content = RecordDict({CONFIG: ConfigRecord({SERVER_ROUND: 1})})  # no ARRAYS record
    msg = Message(content=content, dst_node_id=7, message_type="train")
    node = {"partition-id": 0, "num-partitions": 2, "state-dir": str(tmp_path / "s")}
    reply = _call(msg, _run_config(tiny_bert), node)
    _assert_coded(reply, 4003)
    assert "arrays" not in reply.error.reason.lower()
    assert any(r.exc_info for r in site_log)


def test_a_refusal_is_a_normal_reply(tiny_bert, tmp_path):
    node = {"partition-id": 0, "num-partitions": 2, "state-dir": str(tmp_path / "s")}
    run_config = _run_config(tiny_bert, method="nondp")
    reply = _call(_message({"x": torch.zeros(1)}), run_config, node)
    assert not reply.has_error()
    facts = reply.content[ACCOUNTING]
    assert facts["status"] == STATUS_REFUSED and facts["reason"] == "nondp-not-allowed"
    assert facts[ROUND_NONCE] == "n-1"
    assert not (tmp_path / "s" / "privacy-ledger.jsonl").exists()


def test_the_messages_run_dir_does_not_move_the_ledger(tiny_bert, tmp_path):
    """A simulated site without state-dir keeps its ledger under the RUN config's run-dir."""
    run_dir, hostile = tmp_path / "run", tmp_path / "elsewhere"
    run_config = _run_config(tiny_bert, **{"run-dir": str(run_dir)})
    node = {"partition-id": 0, "num-partitions": 2}
    msg = _message(_arrays(run_config), **{"run-dir": str(hostile), "run-id": "r"})
    reply = _call(msg, run_config, node)
    assert not reply.has_error(), reply.error
    assert reply.content[ACCOUNTING]["status"] == STATUS_OK
    ledger = run_dir / "sites" / "site-0" / "privacy-ledger.jsonl"
    assert ledger.read_text().count("\n") == 1
    assert not hostile.exists()  # a new run-dir in the message gives no fresh ledger


SECURE_REFUSALS = [
    ThresholdError,
    SecureSumAbortedError,
    ConsistencyError,
    MasksUsedError,
    KeyBindingError,
    ShareError,
    NoiseShareError,
]


def test_each_secure_refusal_is_replied_with_its_own_code_and_fixed_text():
    """A secure stage's refusal is an error reply with its kind's code (4010 to 4015) and that
    code's fixed text; every code is listed once, and none is a plain site error's."""
    codes = {cls: error_code(cls("round 3: site-b's keys ...")) for cls in SECURE_REFUSALS}
    assert set(codes.values()) == set(SECURE_ERRORS) == set(range(4010, 4016))
    assert all(code == cls.code for cls, code in codes.items())
    assert all(SITE_ERROR_CODES[code] == SECURE_ERRORS[code] for code in SECURE_ERRORS)
    assert error_code(SecureSumError("malformed")) == 4003
