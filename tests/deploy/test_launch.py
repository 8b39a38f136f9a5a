"""deploy.launch: secure defaults of the SuperLink/SuperNode launcher."""

from __future__ import annotations

import subprocess
import sys

import pytest
from flower_harness import ROOT
from flwr.common.config import parse_config_args

from deploy.errors import DeployError, InsecureSetupError
from deploy.launch import superlink_args, supernode_args
from deploy.pki import init_federation


@pytest.fixture
def pki(tmp_path):
    init_federation(tmp_path / "pki", ["hospital-a"])
    return tmp_path / "pki"


def _site_env(pki, **extra):
    env = {
        "PRISM_SUPERLINK": "coordinator.example.org:8000",
        "PRISM_CA_CERT": str(pki / "sites" / "hospital-a" / "ca.crt"),
        "PRISM_SITE_KEY": str(pki / "sites" / "hospital-a" / "site.key"),
        "PRISM_SITE_ID": "hospital-a",
        "PRISM_DATA_PATH": "/data/train.jsonl",
        "PRISM_STATE_DIR": "/var/lib/prism",
        "PRISM_EPSILON_CAP": "2.5",
        "PRISM_DELTA": "1e-6",
    }
    env.update(extra)
    return env


def test_superlink_runs_with_tls_auth_and_no_runtime_installs(pki):
    args = superlink_args({"PRISM_TLS_DIR": str(pki / "superlink"), "PRISM_DATABASE": "/x/s.db"})
    assert "--insecure" not in args
    assert "--enable-supernode-auth" in args
    assert "--disable-runtime-dependency-installation" in args
    assert args[args.index("--ssl-keyfile") + 1] == str(pki / "superlink" / "server.key")
    assert args[args.index("--database") + 1] == "/x/s.db"


def test_supernode_node_config_round_trips_through_flowers_parser(pki):
    args = supernode_args(_site_env(pki))
    assert args[args.index("--auth-supernode-private-key") + 1].endswith("site.key")
    config = parse_config_args([args[args.index("--node-config") + 1]])
    assert config == {
        "site-id": "hospital-a",
        "data-path": "/data/train.jsonl",
        "state-dir": "/var/lib/prism",
        "epsilon-cap": 2.5,
        "delta": 1e-6,
        "require-secure-rng": True,  # a kit site never runs on reproducible randomness
    }


@pytest.mark.parametrize("role", ["superlink", "supernode"])
def test_group_readable_private_key_is_refused(pki, role):
    key = pki / ("superlink/server.key" if role == "superlink" else "sites/hospital-a/site.key")
    key.chmod(0o640)
    with pytest.raises(InsecureSetupError, match=rf"mode 0640\); run `chmod 600 {key}`"):
        if role == "superlink":
            superlink_args({"PRISM_TLS_DIR": str(pki / "superlink")})
        else:
            supernode_args(_site_env(pki))


def test_plain_text_needs_the_explicit_flag(pki):
    with pytest.raises(InsecureSetupError, match=r"no TLS is configured.*PRISM_ALLOW_INSECURE=1"):
        superlink_args({})
    with pytest.raises(InsecureSetupError, match="--insecure was passed"):
        superlink_args({"PRISM_TLS_DIR": str(pki / "superlink")}, ["--insecure"])
    env = _site_env(pki, PRISM_CA_CERT="", PRISM_SITE_KEY="")
    with pytest.raises(InsecureSetupError, match="no TLS is configured"):
        supernode_args(env)
    assert "--insecure" in supernode_args({**env, "PRISM_ALLOW_INSECURE": "1"})
    assert "--insecure" in superlink_args({"PRISM_ALLOW_INSECURE": "1"})


def test_half_configured_tls_site_is_refused(pki):
    with pytest.raises(InsecureSetupError, match="must both be set"):
        supernode_args(_site_env(pki, PRISM_SITE_KEY=""))


def test_bad_site_settings_are_named(pki):
    with pytest.raises(DeployError, match="PRISM_EPSILON_CAP='lots' is not a number"):
        supernode_args(_site_env(pki, PRISM_EPSILON_CAP="lots"))
    with pytest.raises(DeployError, match="PRISM_SUPERLINK is not set"):
        supernode_args(_site_env(pki, PRISM_SUPERLINK=""))
    with pytest.raises(DeployError, match="node config needs site-id"):
        supernode_args(_site_env(pki, PRISM_SITE_ID=""))


@pytest.mark.parametrize(
    "unset", [("PRISM_EPSILON_CAP",), ("PRISM_DELTA",), ("PRISM_STATE_DIR", "PRISM_DELTA")]
)
def test_a_site_without_its_privacy_policy_or_ledger_folder_is_refused(pki, unset):
    env = _site_env(pki, **dict.fromkeys(unset, ""))
    with pytest.raises(DeployError, match="refusing to start") as info:
        supernode_args(env)
    for variable in unset:
        assert variable in str(info.value).split(": ")[1]


def test_a_site_with_a_reproducible_secret_is_refused_unless_it_opts_out(pki):
    with pytest.raises(DeployError, match="requires secure randomness"):
        supernode_args(_site_env(pki, PRISM_FL_RNG_SECRET="s"))
    args = supernode_args(_site_env(pki, PRISM_FL_RNG_SECRET="s", PRISM_REQUIRE_SECURE_RNG="false"))
    node = parse_config_args([args[args.index("--node-config") + 1]])
    assert node["require-secure-rng"] is False and "rng-secret" not in node
    assert "s" not in node.values()  # the secret is never put on a command line


def test_a_sites_allow_switches_reach_its_node_config(pki):
    env = _site_env(pki, PRISM_ALLOW_NONDP="true", PRISM_ALLOW_NONPRIVATE_METRICS="1")
    args = supernode_args(env)
    node = parse_config_args([args[args.index("--node-config") + 1]])
    assert node["allow-nondp"] is True and node["allow-nonprivate-metrics"] is True


def test_a_sites_privacy_unit_and_person_field_reach_its_node_config(pki):
    env = _site_env(pki, PRISM_PRIVACY_UNIT="user", PRISM_USER_FIELD="patient_id")
    args = supernode_args(env)
    node = parse_config_args([args[args.index("--node-config") + 1]])
    assert node["privacy-unit"] == "user" and node["user-field"] == "patient_id"
    with pytest.raises(DeployError, match="user-field"):  # per person needs the person's field
        supernode_args(_site_env(pki, PRISM_PRIVACY_UNIT="user"))
    with pytest.raises(DeployError, match="privacy-unit"):
        supernode_args(_site_env(pki, PRISM_PRIVACY_UNIT="patient"))


def test_insecure_start_prints_a_warning(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PRISM_ALLOW_INSECURE": "1"}
    env["FLWR_HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "deploy.launch", "superlink", "--version"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "WARNING: prism-fl is running WITHOUT TLS" in done.stderr
    assert "PRISM_DATABASE is not set" in done.stderr  # state in memory: said out loud
    assert "1.42.0" in done.stdout + done.stderr  # flower-superlink itself ran (exec)


@pytest.mark.parametrize(
    ("policy", "why"),
    [
        (
            {"PRISM_EPSILON_CAP": "2", "PRISM_DELTA": "1e-6", "PRISM_STATE_DIR": "/s"},
            "refusing to start: no TLS is configured",
        ),
        ({}, "refusing to start: PRISM_EPSILON_CAP, PRISM_DELTA, PRISM_STATE_DIR not set"),
    ],
)
def test_refusal_exits_2_before_flower_starts(tmp_path, policy, why):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "FLWR_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "deploy.launch", "supernode"],
        env={**env, "PRISM_SUPERLINK": "x:1", "PRISM_SITE_ID": "a", **policy},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert why in done.stderr
    assert "Starting Flower" not in done.stderr


FIX = "one volume per secret holder, no subpath"


def test_the_whole_key_volume_as_the_superlinks_folder_is_refused_naming_the_fix(pki):
    """An Engine before 26 ignores ``volume.subpath``: the SuperLink sees the whole volume."""
    with pytest.raises(InsecureSetupError) as info:
        superlink_args({"PRISM_TLS_DIR": str(pki)})
    message = str(info.value)
    assert "not the SuperLink's own (ca/, public/, sites/, superlink/)" in message
    assert FIX in message and "Docker Engines before 26" in message


def test_the_whole_key_volume_as_a_sites_folder_is_refused_naming_the_fix(pki):
    env = _site_env(pki, PRISM_CA_CERT=str(pki / "ca.crt"), PRISM_SITE_KEY=str(pki / "site.key"))
    with pytest.raises(InsecureSetupError, match=r"not the site's own \(ca/, public/, sites/"):
        supernode_args(env)


@pytest.mark.parametrize("foreign", ["ca.key", "hospital-b.key", "server.key", "sites/"])
def test_another_partys_file_next_to_a_sites_key_is_refused(pki, foreign):
    folder = pki / "sites" / "hospital-a"
    if foreign.endswith("/"):
        (folder / foreign).mkdir()
    else:
        (folder / foreign).write_text("secret of someone else\n")
    with pytest.raises(InsecureSetupError, match=rf"not the site's own \({foreign}\).*{FIX}"):
        supernode_args(_site_env(pki))


def test_the_own_folder_with_hidden_bookkeeping_is_accepted(pki):
    (pki / "superlink" / ".snapshot").mkdir()  # a platform's own entry, not a party's file
    assert "--enable-supernode-auth" in superlink_args({"PRISM_TLS_DIR": str(pki / "superlink")})


def test_a_refused_folder_exits_2_before_flower_starts(pki, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "FLWR_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "deploy.launch", "superlink"],
        env={**env, "PRISM_TLS_DIR": str(pki)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert FIX in done.stderr and "Starting Flower" not in done.stderr
