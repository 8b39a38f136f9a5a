"""The site's warm worker (``client.worker``): what it answers, how it starts the SuperNode, and
the one ``Site`` per run it keeps. A real TLS federation served by workers started through
``deploy.launch``: tests/deploy/test_compose_loopback.py."""

from __future__ import annotations

import logging
from collections import OrderedDict

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import client.site
from client.policy import site_policy
from client.site import get_site
from client.site_ledger import SiteLedgerEntry
from client.worker import (
    DEFAULT_POLL_S,
    POLL_ENV,
    _answer,
    main,
    poll_seconds,
    runtime_address,
    supernode_command,
)
from deploy.errors import DeployError
from deploy.launch import site_command
from prism_core.records import PrivacyEvent
from prism_runtime.config import RunConfig, SiteConfig, parse_config
from prism_runtime.errors import ConfigError
from prism_runtime.protocol import APP_ID, SITE_ERROR_CODES

SECRET_TEXT = "patient 4711 has diabetes"


@pytest.fixture(autouse=True)
def _task_identity():
    """What ``pull_task_input`` sets in the worker for each task (Flower reads it to build
    messages)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 3, 7, 1
    yield


def _message() -> Message:
    return Message(
        content=RecordDict({"config": ConfigRecord({"server-round": 1})}),
        dst_node_id=7,
        message_type="train",
    )


def _context() -> Context:
    return Context(run_id=3, node_id=7, node_config={}, state=RecordDict(), run_config={})


class _App:
    """A ClientApp stand-in that records its calls and answers like the real one."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, *, message: Message, context: Context) -> Message:
        self.calls += 1
        if self.fail:
            raise RuntimeError(SECRET_TEXT)
        return Message(RecordDict({"ok": ConfigRecord({"x": 1})}), reply_to=message)


def test_a_run_of_another_app_is_refused_with_the_config_code_and_never_reaches_the_app():
    app = _App()
    reply = _answer(app, _message(), _context(), "mallory/exfiltrate", "0.1.0")
    assert app.calls == 0
    assert reply.has_error()
    assert reply.error.code == 4001
    assert reply.error.reason == SITE_ERROR_CODES[4001]


def test_prism_fl_runs_reach_the_installed_app():
    app = _App()
    reply = _answer(app, _message(), _context(), APP_ID, "0.1.0")
    assert app.calls == 1 and not reply.has_error()
    assert reply.content["ok"]["x"] == 1


def test_another_prism_fl_version_is_served_by_the_installed_code_with_a_warning(caplog):
    app = _App()
    with caplog.at_level(logging.WARNING, logger="client.worker"):
        reply = _answer(app, _message(), _context(), APP_ID, "99.0.0")
    assert app.calls == 1 and not reply.has_error()
    assert "99.0.0" in caplog.text and "installed" in caplog.text


def test_an_app_that_raises_is_answered_with_a_code_never_the_exception_text(caplog):
    with caplog.at_level(logging.ERROR, logger="client.worker"):
        reply = _answer(_App(fail=True), _message(), _context(), APP_ID, "0.1.0")
    assert reply.error.code == 4003
    assert reply.error.reason == SITE_ERROR_CODES[4003]
    assert SECRET_TEXT not in reply.error.reason
    assert SECRET_TEXT in caplog.text  # the full error stays in the site's own log


def test_the_app_id_is_pyprojects_publisher_and_name():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert f"{project['tool']['flwr']['app']['publisher']}/{project['project']['name']}" == APP_ID


@pytest.mark.parametrize(
    ("argv", "address"),
    [
        (["flower-supernode", "--insecure"], "127.0.0.1:9094"),
        (["flower-supernode", "--port", "9301"], "127.0.0.1:9301"),
        (["/venv/bin/flower-supernode", "--host=0.0.0.0", "--port=9302"], "0.0.0.0:9302"),
    ],
)
def test_runtime_address_is_the_supernodes_runtime_api(argv, address):
    assert runtime_address(argv) == address


def test_the_supernode_runs_in_process_isolation_with_the_executor_secret(tmp_path):
    secret = tmp_path / "s"
    command = supernode_command(["flower-supernode", "--port", "9301"], secret)
    assert command == [
        "flower-supernode",
        "--port",
        "9301",
        "--isolation",
        "process",
        "--superexec-auth-secret-file",
        str(secret),
    ]
    with pytest.raises(ValueError, match="isolation"):
        supernode_command(["flower-supernode", "--isolation", "subprocess"], secret)


@pytest.mark.parametrize("value", ["0", "abc", "nan", "inf", "10", "-1"])
def test_an_unusable_poll_interval_is_an_error_naming_the_variable(value):
    with pytest.raises(ValueError, match=POLL_ENV):
        poll_seconds({POLL_ENV: value})


def test_poll_interval_default_and_override():
    assert poll_seconds({}) == DEFAULT_POLL_S
    assert poll_seconds({POLL_ENV: "0.2"}) == 0.2


def test_main_without_a_supernode_command_is_a_usage_error(capsys):
    assert main([]) == 2
    assert main(["--", "flower-superlink"]) == 2
    assert "usage" in capsys.readouterr().err


# -- deploy.launch: the worker is the site's default executor ------------------------------------


def _site_env(**change: str) -> dict[str, str]:
    env = {
        "PRISM_SUPERLINK": "coordinator:8000",
        "PRISM_ALLOW_INSECURE": "1",
        "PRISM_SITE_ID": "hospital-a",
        "PRISM_DATA_PATH": "/data/train.jsonl",
        "PRISM_STATE_DIR": "/var/lib/prism",
        "PRISM_EPSILON_CAP": "3",
        "PRISM_DELTA": "1e-5",
    }
    return {**env, **change}


def test_launch_runs_the_supernode_under_the_worker_by_default():
    command = site_command(_site_env())
    assert command[1:4] == ["-m", "client.worker", "--"]
    assert command[4].endswith("flower-supernode")
    assert "--isolation" not in command  # the worker adds it


def test_launch_with_flowers_executor_runs_the_supernode_alone():
    command = site_command(_site_env(PRISM_SITE_EXECUTOR="flower"))
    assert command[0] == "flower-supernode"


def test_launch_refuses_an_unknown_executor():
    with pytest.raises(DeployError, match="PRISM_SITE_EXECUTOR"):
        site_command(_site_env(PRISM_SITE_EXECUTOR="fork"))


# -- one Site per run in a long-lived process -----------------------------------------------------


def _tiny_run(tiny_bert: str) -> RunConfig:
    return parse_config(
        RunConfig,
        {
            "model": tiny_bert,
            "lora-rank": 4,
            "batch-size": 16,
            "micro-batch-size": 8,
            "synthetic-examples": 64,
            "max-length": 24,
            "noise-multiplier": 1.0,
        },
        what="run config",
    )


def _tiny_node(partition: int, state_dir: str) -> SiteConfig:
    return parse_config(
        SiteConfig,
        {
            "partition-id": partition,
            "num-partitions": 3,
            "state-dir": state_dir,
            "epsilon-cap": 50.0,
        },
        what="node config",
    )


def test_a_new_run_drops_the_sites_of_the_previous_run(tiny_bert, tmp_path, monkeypatch):
    monkeypatch.setattr(client.site, "_SITES", OrderedDict())
    run = _tiny_run(tiny_bert)
    node = _tiny_node(0, str(tmp_path / "s"))
    policy = site_policy(node)
    first = get_site(run, node, policy, run_id=1)
    assert get_site(run, node, policy, run_id=1) is first  # the model loads once per run
    second = get_site(run, node, policy, run_id=2)
    assert second is not first
    assert list(client.site._SITES.values()) == [second]


def test_a_process_keeps_at_most_sites_kept_sites_open_the_least_recent_closed_first(
    tiny_bert, tmp_path, monkeypatch
):
    """A simulation actor serving more virtual sites than ``PRISM_SITES_KEPT`` holds that many open,
    and a closed site opens again from its state folder with its ledger as it was."""
    monkeypatch.setattr(client.site, "_SITES", OrderedDict())
    monkeypatch.setenv("PRISM_SITES_KEPT", "2")
    monkeypatch.setattr(client.site, "_memory_low", lambda: False)
    run = _tiny_run(tiny_bert)
    nodes = [_tiny_node(i, str(tmp_path / f"s{i}")) for i in range(3)]
    policies = [site_policy(n) for n in nodes]
    site0 = get_site(run, nodes[0], policies[0], run_id=1)
    site0.ledger.charge(SiteLedgerEntry(1, PrivacyEvent(1.0, 0.25, 2), site0.delta))  # on disk
    spent = site0.ledger.epsilon(site0.delta)
    site1 = get_site(run, nodes[1], policies[1], run_id=1)
    assert get_site(run, nodes[0], policies[0], run_id=1) is site0  # used last: kept
    site2 = get_site(run, nodes[2], policies[2], run_id=1)
    assert list(client.site._SITES.values()) == [site0, site2]  # site 1 closed
    reopened = get_site(run, nodes[1], policies[1], run_id=1)
    assert reopened is not site1
    assert list(client.site._SITES.values()) == [site2, reopened]  # site 0 closed
    again = get_site(run, nodes[0], policies[0], run_id=1)
    assert again is not site0 and again.site_id == site0.site_id
    assert again.ledger.epsilon(again.delta) == pytest.approx(spent, rel=1e-12)
    assert spent > 0


def test_a_process_short_of_memory_closes_its_open_sites_before_it_opens_another(
    tiny_bert, tmp_path, monkeypatch
):
    monkeypatch.setattr(client.site, "_SITES", OrderedDict())
    low = [False]
    monkeypatch.setattr(client.site, "_memory_low", lambda: low[0])
    run = _tiny_run(tiny_bert)
    nodes = [_tiny_node(i, str(tmp_path / f"s{i}")) for i in range(3)]
    opened = [get_site(run, n, site_policy(n), run_id=1) for n in nodes[:2]]
    assert list(client.site._SITES.values()) == opened
    low[0] = True
    assert get_site(run, nodes[1], site_policy(nodes[1]), run_id=1) is opened[1]  # open: kept
    third = get_site(run, nodes[2], site_policy(nodes[2]), run_id=1)
    assert list(client.site._SITES.values()) == [third]


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_sites_kept_setting_is_refused_saying_what_to_give(value, monkeypatch):
    monkeypatch.setenv("PRISM_SITES_KEPT", value)
    with pytest.raises(ConfigError, match=r"PRISM_SITES_KEPT=.*integer >= 1"):
        client.site._sites_kept()


def test_available_memory_is_read_from_the_kernel(monkeypatch):
    """The floor compares MemAvailable with MemTotal (this machine's, read twice: once at a
    floor it is above, once at one it is below)."""
    monkeypatch.setattr(client.site, "MEMORY_FLOOR", 0.0)
    assert client.site._memory_low() is False
    monkeypatch.setattr(client.site, "MEMORY_FLOOR", 1.01)
    assert client.site._memory_low() is True
