"""The kits' shell scripts: valid bash; the site's key script creates a usable key pair."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from flower_harness import ROOT
from flwr.cli.supernode.register import try_load_public_key

SCRIPTS = sorted((ROOT / "deploy").rglob("*.sh"))


def test_there_are_kit_scripts():
    names = {p.name for p in SCRIPTS}
    assert {"make-site-key.sh", "register-site.sh", "revoke-site.sh", "list-sites.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_valid_executable_bash(script):
    assert os.access(script, os.X_OK), f"chmod +x {script}"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_make_site_key_prints_the_public_key_and_keeps_the_private_one(tmp_path):
    keys = tmp_path / "keys"
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "PRISM_SITE_ID": "hospital-a",
    }
    script = ROOT / "deploy" / "site" / "make-site-key.sh"
    done = subprocess.run(
        [str(script), str(keys)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    public = (keys / "site.pub").read_text().strip()
    assert public.endswith(" hospital-a") and public in done.stdout
    assert stat.S_IMODE((keys / "site.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert try_load_public_key(keys / "site.pub")  # what `flwr supernode register` accepts
    secret = [ln for ln in (keys / "site.key").read_text().splitlines() if "-----" not in ln]
    assert not any(line in done.stdout + done.stderr for line in secret)
    # a second run keeps the key pair
    again = subprocess.run(
        [str(script), str(keys)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert again.returncode == 0 and public in again.stdout
    assert (keys / "site.pub").read_text().strip() == public
