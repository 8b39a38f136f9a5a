"""Register and revoke sites' authentication keys at the SuperLink (``python -m deploy.register``).

The coordinator decides which SuperNodes may join: only a SuperNode whose public key was
registered here is accepted (the SuperLink runs with ``--enable-supernode-auth``). This talks to
the SuperLink's Control API over TLS with Flower's own client (what ``flwr supernode
register/unregister/list`` use) and keeps a small registry file (site name -> node id) for
``revoke NAME``.

Keys the SuperLink already knows are never sent again: ``sync`` and ``add`` first list the
SuperLink's nodes with their public keys (Flower's ``ListNodes``) and register only new keys, so
a normal ``docker compose up`` leaves no "Public key already in use" errors in the SuperLink's
log. A revoked key stays known to the SuperLink and cannot be registered again (the site makes
a new key pair).

Subcommands (options default to the environment variables in brackets):

- ``sync [--keys DIR]``: register every ``DIR/NAME.pub`` the SuperLink does not know yet
  [PRISM_SITE_KEYS_DIR]
- ``add PUBLIC_KEY --name NAME``: register one site's public key (``site.pub`` it sent you)
- ``revoke NAME_OR_NODE_ID``: unregister a site; its SuperNode is refused from then on
- ``list``: the registry and the SuperLink's node list

Common options: ``--superlink HOST:PORT`` [PRISM_SUPERLINK], ``--ca FILE`` [PRISM_CA_CERT],
``--registry FILE`` [PRISM_REGISTRY], ``--wait SECONDS`` to wait for the SuperLink (default 60).
Exit codes: 0 done, 1 the SuperLink refused or could not be reached, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import click
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.proto.control_pb2 import (
    ListNodesRequest,
    ListNodesResponse,
    RegisterNodeRequest,
    RegisterNodeResponse,
    UnregisterNodeRequest,
    UnregisterNodeResponse,
)
from flwr.proto.node_pb2 import NodeInfo
from flwr.supercore.primitives.asymmetric import public_key_to_bytes, uses_nist_ec_curve

from deploy.errors import DeployError
from deploy.pki import valid_site_name

__all__ = ["ControlApi", "Registrar", "flower_control", "main", "public_key_bytes"]

CONNECTION = "prism-coordinator"
UNREGISTERED = "unregistered"  # Flower's node status of a revoked key
_IN_USE = "already in use"  # Flower's refusal of a key it holds (a race with another register)


class ControlApi(Protocol):
    """What this module uses of Flower's Control API client (``ControlHttpClient``)."""

    def ListNodes(self, request: ListNodesRequest) -> ListNodesResponse: ...

    def RegisterNode(self, request: RegisterNodeRequest) -> RegisterNodeResponse: ...

    def UnregisterNode(self, request: UnregisterNodeRequest) -> UnregisterNodeResponse: ...

    def close(self) -> None: ...


def flower_control(superlink: str, ca: Path) -> ControlApi:
    """Flower's own Control API client for ``superlink`` over TLS (built as the CLI builds it)."""
    from flwr.cli.typing import SuperLinkConnection
    from flwr.cli.utils import init_http_client_from_connection

    connection = SuperLinkConnection(
        name=CONNECTION, address=superlink, root_certificates=str(ca.resolve())
    )
    with contextlib.redirect_stdout(sys.stderr):  # Flower prints the connection it uses
        client: ControlApi = init_http_client_from_connection(connection)
    return client


@contextlib.contextmanager
def _api(what: str) -> Iterator[None]:
    """Flower's own translation of Control API errors (code + public text) as a DeployError."""
    from flwr.cli.utils import flwr_cli_exc_handler

    try:
        with flwr_cli_exc_handler():
            yield
    except click.ClickException as exc:
        raise DeployError(f"{what}: {exc.format_message()}") from None


def public_key_bytes(path: Path) -> bytes:
    """The SuperLink's form of an OpenSSH EC public key file (what ``flwr supernode register``
    sends, and what the SuperLink's node list shows)."""
    if not path.is_file():
        raise DeployError(f"public key {path} not found")
    try:
        key = serialization.load_ssh_public_key(path.read_bytes())
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise DeployError(
            f"{path} is not an OpenSSH public key ({exc}); the site makes its key pair with "
            "`python -m deploy.pki site-key` and sends its site.pub"
        ) from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not uses_nist_ec_curve(key):
        raise DeployError(
            f"{path} is not a NIST elliptic-curve public key, which SuperNode authentication "
            "needs; make one with `python -m deploy.pki site-key`"
        )
    return public_key_to_bytes(key)


class RevokedKeyError(DeployError):
    """The key was registered once and revoked: the SuperLink never accepts it again."""


class Registrar:
    """Registers, lists and revokes site keys at one SuperLink through its Control API.

    ``control`` is Flower's client (``flower_control``, the default) or any object with the same
    three calls.
    """

    def __init__(
        self,
        superlink: str,
        ca: Path,
        registry: Path | None,
        *,
        control: ControlApi | None = None,
    ) -> None:
        if not superlink:
            raise DeployError("no SuperLink address: pass --superlink HOST:PORT or PRISM_SUPERLINK")
        if not ca.is_file():
            raise DeployError(f"CA certificate {ca} not found: pass --ca or set PRISM_CA_CERT")
        self.registry = registry
        self.control = control if control is not None else flower_control(superlink, ca)

    def close(self) -> None:
        """Close the connection to the SuperLink."""
        self.control.close()

    def nodes(self) -> list[NodeInfo]:
        """Every node the SuperLink knows, revoked ones included, with its public key."""
        with _api("listing the SuperLink's nodes failed"):
            reply = self.control.ListNodes(ListNodesRequest())
        return list(reply.nodes_info)

    def known_keys(self) -> dict[bytes, NodeInfo]:
        """The SuperLink's nodes by public key (a known key is never registered again)."""
        return {node.public_key: node for node in self.nodes()}

    def wait(self, seconds: float) -> list[dict[str, Any]]:
        """Wait until the SuperLink answers; return its node list (node id, name, status)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                nodes = self.nodes()
            except DeployError as exc:
                if time.monotonic() > deadline:
                    raise DeployError(
                        f"the SuperLink did not answer within {seconds:.0f} s: {exc}"
                    ) from None
                time.sleep(2)
                continue
            return [{"node-id": str(n.node_id), "name": n.name, "status": n.status} for n in nodes]

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

    def _remember(self, name: str, node_id: int, public_key: Path) -> None:
        data = self._load()
        entry = {"node-id": str(node_id), "public-key": str(public_key)}
        if data.get(name) != entry:
            data[name] = entry
            self._save(data)

    def add(
        self, public_key: Path, name: str, known: Mapping[bytes, NodeInfo] | None = None
    ) -> str:
        """Register ``public_key`` as site ``name`` unless the SuperLink already knows the key.

        ``known``: the SuperLink's nodes by key (``known_keys``); listed now when not given.

        Raises:
            RevokedKeyError: the key was revoked; it cannot be registered again.
            DeployError: the key file is unusable, or the SuperLink refused or is unreachable.
        """
        valid_site_name(name)
        key = public_key_bytes(public_key)
        node = (self.known_keys() if known is None else known).get(key)
        if node is not None and node.status == UNREGISTERED:
            raise RevokedKeyError(
                f"{name}: this key was revoked (node {node.node_id}) and is never accepted "
                "again; the site makes a new key pair (`python -m deploy.pki site-key`) and "
                "sends its new site.pub"
            )
        if node is not None:
            self._remember(name, node.node_id, public_key)
            return f"{name}: already known as node {node.node_id}, kept"
        try:
            with _api(f"registering {name} was refused"):
                reply = self.control.RegisterNode(RegisterNodeRequest(public_key=key, name=name))
        except DeployError as exc:
            if _IN_USE in str(exc):  # registered meanwhile by someone else
                return f"{name}: already known to the SuperLink, kept"
            raise
        if not reply.node_id:
            raise DeployError(f"registering {name} was refused: the SuperLink gave no node id")
        self._remember(name, reply.node_id, public_key)
        return f"registered {name} as node {reply.node_id}"

    def sync(self, keys: Path) -> list[str]:
        """Register every ``keys/NAME.pub`` the SuperLink does not know yet (one listing)."""
        if not keys.is_dir():
            raise DeployError(f"site key folder {keys} not found: pass --keys DIR")
        pubs = sorted(keys.glob("*.pub"))
        if not pubs:
            raise DeployError(f"no NAME.pub files in {keys}")
        known = self.known_keys()
        lines = []
        for pub in pubs:
            try:
                lines.append(self.add(pub, pub.stem, known))
            except RevokedKeyError as exc:  # the other sites still get registered
                lines.append(f"NOT registered: {exc}")
        return lines

    def revoke(self, site: str) -> str:
        """Unregister a site by name (from the registry) or by node id."""
        data = self._load()
        node_id = data[site]["node-id"] if site in data else site
        if not node_id.isdigit():
            raise DeployError(
                f"{site!r} is neither a registered site name ({sorted(data)}) nor a node id"
            )
        with _api(f"revoking {site} failed"):
            self.control.UnregisterNode(UnregisterNodeRequest(node_id=int(node_id)))
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
    finally:
        registrar.close()
    for line in lines:
        print(f"prism-fl register: {line}" if args.command != "list" else line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
