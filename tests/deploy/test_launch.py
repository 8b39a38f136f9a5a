"""deploy.launch: secure defaults of the SuperLink/SuperNode launcher."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flower_harness import ROOT
from flwr.common.config import parse_config_args

from deploy.errors import DeployError, InsecureSetupError
from deploy.identity import public_pem
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


def test_a_sites_records_per_person_bound_reaches_its_node_config(pki):
    person = {"PRISM_PRIVACY_UNIT": "user", "PRISM_USER_FIELD": "patient_id"}
    args = supernode_args(_site_env(pki, **person, PRISM_MAX_RECORDS_PER_USER="8"))
    node = parse_config_args([args[args.index("--node-config") + 1]])
    assert node["max-records-per-user"] == 8
    args = supernode_args(_site_env(pki, **person, PRISM_MAX_RECORDS_PER_USER=""))
    assert "max-records-per-user" not in parse_config_args([args[args.index("--node-config") + 1]])
    with pytest.raises(DeployError, match="max-records-per-user"):
        supernode_args(_site_env(pki, **person, PRISM_MAX_RECORDS_PER_USER="0"))


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


def _node(args: list[str]) -> dict:
    return parse_config_args([args[args.index("--node-config") + 1]])


def _secure_env(pki, **extra):
    """hospital-a with its identity key (next to its site key) and the federation's peers."""
    secure = {
        "PRISM_SECURE_IDENTITY": str(pki / "sites" / "hospital-a" / "identity.pem"),
        "PRISM_SECURE_PEERS": str(pki / "public" / "secure-peers"),
    }
    return _site_env(pki, **{**secure, **extra})


def test_a_sites_secure_aggregation_settings_reach_the_site_as_it_reads_them(pki):
    """The kit's four variables become the node config; the site then signs with the kit's
    identity key and pins the published peers (what ``deploy.pki`` made is what it reads)."""
    from client.policy import site_policy
    from client.secure import identity_key, registered_keys
    from prism_runtime.config import SiteConfig, parse_config

    env = _secure_env(pki, PRISM_SECURE_AGGREGATION="Require", PRISM_MIN_HONEST_SITES="2")
    node = _node(supernode_args(env))
    assert node["secure-aggregation"] == "require" and node["min-honest-sites"] == 2
    assert node["secure-identity"] == env["PRISM_SECURE_IDENTITY"]
    assert node["secure-peers"] == env["PRISM_SECURE_PEERS"]
    policy = site_policy(parse_config(SiteConfig, node, what="site setting"))
    assert policy.secure_aggregation == "require" and policy.min_honest_sites == 2
    key = identity_key(policy.state_dir, policy.secure_identity)
    pinned = registered_keys(policy)
    assert list(pinned) == ["hospital-a"]
    assert public_pem(key) == pinned["hospital-a"].public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@pytest.mark.parametrize(
    ("variable", "value", "why"),
    [
        ("PRISM_SECURE_AGGREGATION", "maybe", r"PRISM_SECURE_AGGREGATION='maybe': use off"),
        ("PRISM_MIN_HONEST_SITES", "two", r"PRISM_MIN_HONEST_SITES='two' is not a number"),
        ("PRISM_MIN_HONEST_SITES", "0", r"min-honest-sites"),
        ("PRISM_SECURE_MAX_DROPOUTS", "1", r"secure-max-dropouts=1 is not below"),  # H = 1
        ("PRISM_SECURE_MAX_DROPOUTS", "one", r"PRISM_SECURE_MAX_DROPOUTS='one' is not a number"),
    ],
)
def test_bad_secure_aggregation_settings_are_named(pki, variable, value, why):
    with pytest.raises(DeployError, match=why):
        supernode_args(_secure_env(pki, **{variable: value}))


def test_a_readable_identity_key_is_refused_with_the_fix(pki):
    identity = pki / "sites" / "hospital-a" / "identity.pem"
    identity.chmod(0o644)
    with pytest.raises(InsecureSetupError, match=rf"mode 0644\); run `chmod 600 {identity}`"):
        supernode_args(_secure_env(pki))


def test_a_missing_or_wrong_identity_key_is_refused_naming_the_fix(pki, tmp_path):
    missing = tmp_path / "nowhere" / "identity.pem"
    with pytest.raises(DeployError, match=r"does not exist: make it with ./make-site-key.sh"):
        supernode_args(_secure_env(pki, PRISM_SECURE_IDENTITY=str(missing)))
    p384 = tmp_path / "p384.pem"
    p384.write_bytes(
        ec.generate_private_key(ec.SECP384R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    p384.chmod(0o600)
    with pytest.raises(DeployError, match="is not an ECDSA P-256 private key"):
        supernode_args(_secure_env(pki, PRISM_SECURE_IDENTITY=str(p384)))


def _p256_public(path):
    path.write_bytes(public_pem(ec.generate_private_key(ec.SECP256R1())))


@pytest.mark.parametrize(
    ("damage", "error", "why"),
    [
        ("private key", InsecureSetupError, r"holds a PRIVATE key \(stray.pem\)"),
        ("not a key", DeployError, r"clinic-c.pem is not an ECDSA P-256 public key"),
        ("own key missing", DeployError, r"but not this site's own \(hospital-a.pem\)"),
        ("own key replaced", DeployError, r"hospital-a.pem .* is not the public half"),
        ("no identity", DeployError, r"PRISM_SECURE_IDENTITY is not set"),
        ("not a folder", DeployError, r"is not a folder"),
        ("folder writable by others", InsecureSetupError, r"\(secure-peers\) can be written"),
        ("key writable by group", InsecureSetupError, r"keys \(clinic-c.pem\) can be written"),
    ],
)
def test_an_unusable_peers_folder_is_refused(pki, damage, error, why):
    peers = pki / "public" / "secure-peers"
    env = _secure_env(pki)
    _p256_public(peers / "clinic-c.pem")  # another site of the federation
    if damage == "private key":
        (peers / "stray.pem").write_bytes(
            (pki / "sites" / "hospital-a" / "identity.pem").read_bytes()
        )
    elif damage == "not a key":
        (peers / "clinic-c.pem").write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n")
    elif damage == "own key missing":
        (peers / "hospital-a.pem").unlink()
    elif damage == "own key replaced":
        _p256_public(peers / "hospital-a.pem")
    elif damage == "no identity":
        env["PRISM_SECURE_IDENTITY"] = ""
    elif damage == "folder writable by others":
        peers.chmod(0o777)  # a shared volume another party's service can write
    elif damage == "key writable by group":
        (peers / "clinic-c.pem").chmod(0o664)
    else:
        env["PRISM_SECURE_PEERS"] = str(pki / "public" / "ca.crt")
    with pytest.raises(error, match=why):
        supernode_args(env)


def test_the_pinned_keys_fingerprints_are_logged_at_start(pki, caplog):
    """Every pinned key's fingerprint is in the site's log when it starts, as ``deploy.pki
    fingerprints`` and ``site-key`` print it, for the operators to compare out of band."""
    import logging

    from deploy.identity import fingerprint

    peers = pki / "public" / "secure-peers"
    _p256_public(peers / "clinic-c.pem")
    with caplog.at_level(logging.INFO, logger="deploy.launch"):
        supernode_args(_secure_env(pki, PRISM_SECURE_MAX_DROPOUTS="0"))
    for site in ("clinic-c", "hospital-a"):
        printed = fingerprint((peers / f"{site}.pem").read_bytes())
        assert f"pinned identity key of {site}: {printed}" in caplog.text


def test_an_empty_peers_folder_leaves_the_site_out_of_secure_rounds(pki, tmp_path, caplog):
    """``allow``: it starts, warns, and names no peers (so it refuses secure rounds with
    secure-aggregation-not-configured); ``require`` would refuse every round: refused."""
    empty = tmp_path / "peers"
    empty.mkdir()
    with caplog.at_level("WARNING", logger="deploy.launch"):
        node = _node(supernode_args(_secure_env(pki, PRISM_SECURE_PEERS=str(empty))))
    assert "secure-peers" not in node and node["secure-identity"].endswith("identity.pem")
    assert f"the peers folder {empty} (PRISM_SECURE_PEERS) pins no identity keys" in caplog.text
    for peers in (str(empty), ""):
        env = _secure_env(pki, PRISM_SECURE_PEERS=peers, PRISM_SECURE_AGGREGATION="require")
        with pytest.raises(DeployError, match=r"require, but .*: this site would refuse every"):
            supernode_args(env)
    caplog.clear()
    off = _node(
        supernode_args(
            _secure_env(pki, PRISM_SECURE_PEERS=str(empty), PRISM_SECURE_AGGREGATION="off")
        )
    )
    assert off["secure-aggregation"] == "off" and not caplog.text


def test_an_empty_peers_folder_warning_reaches_the_log(pki, tmp_path):
    """The launcher's warning is on stderr before Flower starts (here: before it fails to
    reach a SuperLink, which is not there)."""
    empty = tmp_path / "peers"
    empty.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "FLWR_HOME": str(tmp_path)}
    env |= _secure_env(pki, PRISM_SECURE_PEERS=str(empty), PRISM_SITE_EXECUTOR="flower")
    done = subprocess.run(
        [sys.executable, "-m", "deploy.launch", "supernode", "--version"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "prism-fl launch: WARNING: the peers folder" in done.stderr
    assert "1.42.0" in done.stdout + done.stderr  # flower-supernode itself ran (exec)
