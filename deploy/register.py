"""Register and revoke sites' authentication keys at the SuperLink (``python -m deploy.register``).

The coordinator decides which SuperNodes may join: only a SuperNode whose public key was
registered here is accepted (the SuperLink runs with ``--enable-supernode-auth``). This wraps
``flwr supernode register/unregister/list`` over TLS and keeps a small registry file
(site name -> node id) because Flower's listing does not show names.

Subcommands (options default to the environment variables in brackets):

- ``sync [--keys DIR]``: register every ``DIR/NAME.pub`` not registered yet [PRISM_SITE_KEYS_DIR]
- ``add PUBLIC_KEY --name NAME``: register one site's public key (``site.pub`` it sent you)
- ``revoke NAME_OR_NODE_ID``: unregister a site; its SuperNode is refused from then on
- ``list``: the registry and Flower's node list

Common options: ``--superlink HOST:PORT`` [PRISM_SUPERLINK], ``--ca FILE`` [PRISM_CA_CERT],
``--registry FILE`` [PRISM_REGISTRY], ``--wait SECONDS`` to wait for the SuperLink (default 60).
Exit codes: 0 done, 1 the SuperLink refused or could not be reached, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deploy.errors import DeployError
from deploy.pki import valid_site_name

__all__ = ["Registrar", "main"]

CONNECTION = "prism-coordinator"


class Registrar:
    """Talks to one SuperLink's Control API with the ``flwr`` CLI over TLS."""

    def __init__(self, superlink: str, ca: Path, registry: Path | None) -> None:
        if not superlink:
            raise DeployError("no SuperLink address: pass --superlink HOST:PORT or PRISM_SUPERLINK")
        if not ca.is_file():
            raise DeployError(f"CA certificate {ca} not found: pass --ca or set PRISM_CA_CERT")
        self.registry = registry
        self.home = Path(tempfile.mkdtemp(prefix="prism-register-"))
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{superlink}"\nroot-certificates = "{ca.resolve()}"\n'
        )
        self.env = dict(os.environ, FLWR_HOME=str(self.home), FLWR_TELEMETRY_ENABLED="0")

    def _flwr(self, *args: str) -> dict[str, Any]:
        flwr = Path(sys.executable).parent / "flwr"
        command = [str(flwr if flwr.exists() else "flwr"), "supernode", *args]
        done = subprocess.run(
            [*command, CONNECTION, "--format", "json"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        try:
            reply: dict[str, Any] = json.loads(done.stdout)
        except json.JSONDecodeError:
            raise DeployError(
                f"`flwr supernode {args[0]}` failed (exit {done.returncode}): "
                f"{(done.stdout + done.stderr).strip()[-500:]}"
            ) from None
        return reply

    def wait(self, seconds: float) -> list[dict[str, Any]]:
        """Wait until the SuperLink answers; return its node list."""
        deadline = time.monotonic() + seconds
        while True:
            reply = self._flwr("list")
            if reply.get("success"):
                return list(reply.get("nodes", []))
            if time.monotonic() > deadline:
                raise DeployError(
                    f"the SuperLink did not answer within {seconds:.0f} s: "
                    f"{reply.get('error-message', '').strip()}"
                )
            time.sleep(2)

    def _load(self) -> dict[str, Any]:
        if self.registry is None or not self.registry.exists():
            return {}
        try:
            data: dict[str, Any] = json.loads(self.registry.read_text())
        except json.JSONDecodeError as exc:
            raise DeployError(
                f"registry {self.registry} is not valid JSON ({exc}); restore it from a backup"
            ) from exc
        return data

    def _save(self, data: dict[str, Any]) -> None:
        if self.registry is None:
            return
        self.registry.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.registry.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.registry)  # atomic: the old registry stays intact until this point

    def add(self, public_key: Path, name: str) -> str:
        """Register ``public_key`` as site ``name``; an already registered key is not an error."""
        valid_site_name(name)
        if not public_key.is_file():
            raise DeployError(f"public key {public_key} not found")
        data = self._load()
        reply = self._flwr("register", str(public_key), "--name", name)
        if reply.get("success"):
            data[name] = {"node-id": str(reply["node-id"]), "public-key": str(public_key)}
            self._save(data)
            return f"registered {name} as node {reply['node-id']}"
        message = str(reply.get("error-message", "")).strip()
        if "already in use" in message:
            return f"{name}: key already registered"
        raise DeployError(f"registering {name} was refused: {message}")

    def sync(self, keys: Path) -> list[str]:
        """Register every ``keys/NAME.pub``."""
        if not keys.is_dir():
            raise DeployError(f"site key folder {keys} not found: pass --keys DIR")
        pubs = sorted(keys.glob("*.pub"))
        if not pubs:
            raise DeployError(f"no NAME.pub files in {keys}")
        return [self.add(pub, pub.stem) for pub in pubs]

    def revoke(self, site: str) -> str:
        """Unregister a site by name (from the registry) or by node id."""
        data = self._load()
        node_id = data[site]["node-id"] if site in data else site
        if not node_id.isdigit():
            raise DeployError(
                f"{site!r} is neither a registered site name ({sorted(data)}) nor a node id"
            )
        reply = self._flwr("unregister", node_id)
        if not reply.get("success"):
            raise DeployError(f"revoking {site} failed: {reply.get('error-message', '').strip()}")
        data = {k: v for k, v in data.items() if v["node-id"] != node_id}
        self._save(data)
        return f"revoked {site} (node {node_id})"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deploy.register", description="Site keys.")
    env = os.environ.get
    parser.add_argument("--superlink", default=env("PRISM_SUPERLINK", ""))
    parser.add_argument("--ca", type=Path, default=Path(env("PRISM_CA_CERT", "ca.crt")))
    parser.add_argument("--registry", type=Path, default=env("PRISM_REGISTRY") or None)
    parser.add_argument("--wait", type=float, default=60.0)
    sub = parser.add_subparsers(dest="command", required=True)
    sync = sub.add_parser("sync")
    sync.add_argument("--keys", type=Path, default=Path(env("PRISM_SITE_KEYS_DIR", "sites")))
    add = sub.add_parser("add")
    add.add_argument("public_key", type=Path)
    add.add_argument("--name", required=True)
    revoke = sub.add_parser("revoke")
    revoke.add_argument("site")
    sub.add_parser("list")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = _build_parser().parse_args(argv)
    try:
        registrar = Registrar(args.superlink, args.ca, args.registry)
    except DeployError as exc:
        print(f"prism-fl register: {exc}", file=sys.stderr)
        return 2
    try:
        nodes = registrar.wait(args.wait)
        if args.command == "sync":
            lines = registrar.sync(args.keys)
        elif args.command == "add":
            lines = [registrar.add(args.public_key, args.name)]
        elif args.command == "revoke":
            lines = [registrar.revoke(args.site)]
        else:
            lines = [json.dumps({"registry": registrar._load(), "nodes": nodes}, indent=2)]
    except DeployError as exc:
        print(f"prism-fl register: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        print(f"prism-fl register: {line}" if args.command != "list" else line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
