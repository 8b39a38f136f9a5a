"""The kits' shell scripts and deploy/README.md's host-side recipes: valid bash, usable as root."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from compose_local import dockerfile_instructions
from flower_harness import ROOT
from flwr.cli.supernode.register import try_load_public_key

from deploy.identity import load_identity, public_pem

SCRIPTS = sorted((ROOT / "deploy").rglob("*.sh"))


def test_there_are_kit_scripts():
    names = {p.name for p in SCRIPTS}
    assert {"make-site-key.sh", "register-site.sh", "revoke-site.sh", "list-sites.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_valid_executable_bash(script):
    assert os.access(script, os.X_OK), f"chmod +x {script}"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


MAKE_SITE_KEY = ROOT / "deploy" / "site" / "make-site-key.sh"


def _make_site_key(
    keys: Path, *, bin_first: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run make-site-key.sh for site ``hospital-a`` into ``keys`` (``bin_first``: fake commands
    found before the real ones; ``env``: more variables)."""
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    variables = {
        "PATH": f"{bin_first}:{path}" if bin_first else path,
        "PYTHONPATH": str(ROOT),
        "PRISM_SITE_ID": "hospital-a",
        "PRISM_PEERS_DIR": str(keys.parent / "peers"),
        **env,
    }
    return subprocess.run(
        [str(MAKE_SITE_KEY), str(keys)],
        env=variables,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_make_site_key_prints_the_public_key_and_keeps_the_private_one(tmp_path):
    keys = tmp_path / "keys"
    done = _make_site_key(keys)
    assert done.returncode == 0, done.stderr
    public = (keys / "site.pub").read_text().strip()
    assert public.endswith(" hospital-a") and public in done.stdout
    assert stat.S_IMODE((keys / "site.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert try_load_public_key(keys / "site.pub")  # what `flwr supernode register` accepts
    secret = [ln for ln in (keys / "site.key").read_text().splitlines() if "-----" not in ln]
    assert not any(line in done.stdout + done.stderr for line in secret)
    # a second run keeps the key pair
    again = _make_site_key(keys)
    assert again.returncode == 0 and public in again.stdout
    assert (keys / "site.pub").read_text().strip() == public


def test_make_site_key_prints_the_identity_key_for_the_registry(tmp_path):
    """The secure-aggregation identity key stays in the keys folder (0600); its public half is
    printed for the federation's registry, and the (empty) peers folder is made."""
    keys = tmp_path / "keys"
    done = _make_site_key(keys)
    assert done.returncode == 0, done.stderr
    identity = keys / "identity.pem"
    assert stat.S_IMODE(identity.stat().st_mode) == 0o600
    public = public_pem(load_identity(identity)).decode().strip()
    assert public in done.stdout and "registry as hospital-a.pem" in done.stdout
    secret = [ln for ln in identity.read_text().splitlines() if "-----" not in ln]
    assert secret and not any(line in done.stdout + done.stderr for line in secret)
    assert (tmp_path / "peers").is_dir() and not any((tmp_path / "peers").iterdir())
    before = identity.read_bytes()
    again = _make_site_key(keys)
    assert again.returncode == 0 and public in again.stdout
    assert identity.read_bytes() == before  # kept: the other sites pinned its public half


README = ROOT / "deploy" / "README.md"


def _fake_bin(folder: Path, uid: int) -> Path:
    """``id`` answering ``uid`` (root when 0) and a ``chown`` that records its arguments."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (folder / "chown").write_text(f'#!/bin/sh\necho "$@" >> "{folder}/chown.calls"\n')
    for tool in ("id", "chown"):
        (folder / tool).chmod(0o755)
    return folder


def _readme_block(marker: str) -> str:
    """The README's ```bash block that contains ``marker``, without its docker/flwr lines
    (no engine, no SuperLink here): the host-side part of the recipe."""
    (block,) = [
        b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) if marker in b
    ]
    keep = [ln for ln in block.splitlines() if not ln.startswith(("docker ", ".venv/bin/flwr"))]
    return "\n".join(keep)


def _bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(("uid", "expected"), [(0, "10001"), (1000, "1000")])
def test_the_one_host_recipe_never_builds_for_root(tmp_path, uid, expected):
    """deploy/README.md section 1 as root: ids 10001 (the image's build check passes), the
    host folders the containers use are given to them; as a user: that user's ids."""
    fake = _fake_bin(tmp_path / "bin", uid)
    recipe = _readme_block("docker compose up -d --build        # pki")
    done = _bash(
        recipe + '\nenv | grep "^PRISM_[UG]ID=" | sort',
        tmp_path,
        {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"PRISM_GID={expected}", f"PRISM_UID={expected}"]  # exported
    calls = (fake / "chown.calls").read_text().splitlines()
    assert calls == [f"-R {expected}:{expected} runs deploy/local"]
    for site in ("hospital-a", "hospital-b", "clinic-c"):
        assert (tmp_path / "deploy" / "local" / site / "data").is_dir()
    check = next(r for w, r in dockerfile_instructions() if w == "RUN")
    build = _bash(
        check, tmp_path, {"PATH": "/usr/bin:/bin", "PRISM_UID": expected, "PRISM_GID": expected}
    )
    assert build.returncode == 0, build.stderr


def test_the_connection_recipe_works_where_flwr_never_ran(tmp_path):
    """No ~/.flwr yet: the recipe makes it; run twice, the connection is there once, and
    Flower's own reader finds it."""
    home, repo = tmp_path / "home", tmp_path / "repo"
    home.mkdir()
    repo.mkdir()
    recipe = _readme_block("[superlink.prism-compose]")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    for _ in range(2):
        done = _bash(recipe, repo, env)
        assert done.returncode == 0, done.stderr
    config = (home / ".flwr" / "config.toml").read_text()
    assert config.count("[superlink.prism-compose]") == 1
    read = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from flwr.cli.flower_config import read_superlink_connection as r; "
            "c = r('prism-compose'); print(json.dumps([c.address, c.root_certificates]))",
        ],
        env={**env, "FLWR_HOME": str(home / ".flwr"), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout.splitlines()[-1]) == ["127.0.0.1:8000", f"{repo}/deploy/ca.crt"]


def test_make_site_key_as_root_gives_the_key_to_the_containers_user(tmp_path):
    fake = _fake_bin(tmp_path / "bin", 0)
    keys = tmp_path / "keys"
    done = _make_site_key(keys, bin_first=fake)
    assert done.returncode == 0, done.stderr
    assert (keys / "site.key").is_file()
    assert (fake / "chown.calls").read_text().splitlines() == [f"-R 10001:10001 {keys}"]
    refused = _make_site_key(tmp_path / "other", bin_first=fake, PRISM_UID="0")
    assert refused.returncode == 2 and "must not be 0" in refused.stderr
    assert not (tmp_path / "other").exists()
