"""deploy.register: keys the SuperLink already knows are never registered again.

``Registrar`` runs for real against a fake of the SuperLink's Control API that behaves as
Flower 1.42's does (``ListNodes`` shows every node with its public key, revoked ones included;
``RegisterNode`` of a key it holds is refused with Flower's "Public key already in use" error,
which the real SuperLink logs as an ERROR line). Keys are real site keys from ``deploy.pki``
and are compared in the form Flower's own ``flwr supernode register`` sends.
"""

from __future__ import annotations

import json

import httpx
import pytest
from flwr.cli.supernode.register import try_load_public_key
from flwr.proto.control_pb2 import (
    ListNodesResponse,
    RegisterNodeResponse,
    UnregisterNodeResponse,
)
from flwr.proto.node_pb2 import NodeInfo
from flwr.supercore.error.base import ApiErrorCode

from deploy.errors import DeployError
from deploy.pki import init_federation, site_key
from deploy.register import Registrar, main, public_key_bytes

SITES = ("hospital-a", "hospital-b", "clinic-c")


class FakeSuperLink:
    """The three Control API calls, with the SuperLink's node table in memory."""

    def __init__(self) -> None:
        self.nodes: list[NodeInfo] = []
        self.register_calls: list[tuple[bytes, str]] = []
        self.errors: list[str] = []  # what the real SuperLink logs at ERROR
        self.closed = False

    def ListNodes(self, request):
        return ListNodesResponse(nodes_info=self.nodes, now="2026-01-01T00:00:00+00:00")

    def RegisterNode(self, request):
        self.register_calls.append((request.public_key, request.name))
        if any(n.public_key == request.public_key for n in self.nodes):
            self.errors.append("Public key already in use")
            body = {"code": int(ApiErrorCode.PUBLIC_KEY_ALREADY_IN_USE)}
            body["detail"] = "Public key already in use."
            raise httpx.HTTPStatusError(
                "412",
                request=httpx.Request("POST", "https://superlink/v1/control/register-node"),
                response=httpx.Response(412, text=json.dumps(body)),
            )
        node_id = 1000 + len(self.nodes)
        self.nodes.append(
            NodeInfo(
                node_id=node_id,
                public_key=request.public_key,
                name=request.name,
                status="registered",
                registered_at="2026-01-01T00:00:00+00:00",
            )
        )
        return RegisterNodeResponse(node_id=node_id)

    def UnregisterNode(self, request):
        (node,) = [n for n in self.nodes if n.node_id == request.node_id]
        node.status = "unregistered"
        return UnregisterNodeResponse()

    def close(self):
        self.closed = True


@pytest.fixture
def federation(tmp_path):
    init_federation(tmp_path / "pki", list(SITES))
    return tmp_path / "pki"


def _registrar(federation, fake, tmp_path):
    registry = tmp_path / "registered-sites.json"
    ca = federation / "public" / "ca.crt"
    return Registrar("superlink:8000", ca, registry, control=fake)


def test_a_known_key_is_not_registered_again_and_a_new_one_is(federation, tmp_path):
    fake = FakeSuperLink()
    keys = federation / "public" / "sites"
    first = _registrar(federation, fake, tmp_path).sync(keys)
    assert [line.split(" as node")[0] for line in first] == [
        f"registered {s}" for s in sorted(SITES)
    ]
    assert len(fake.register_calls) == len(SITES)

    # the next `up`: one new site joins; the three known keys are left alone
    site_key(tmp_path / "d-keys", "site-d", publish=keys)
    fake.register_calls.clear()
    again = _registrar(federation, fake, tmp_path).sync(keys)
    new_key = public_key_bytes(keys / "site-d.pub")
    assert fake.register_calls == [(new_key, "site-d")]  # only the new key was sent
    assert fake.errors == []  # so the SuperLink logged no "already in use" ERROR
    assert sum(line.startswith("registered ") for line in again) == 1
    assert {line.split(":")[0] for line in again if "already known" in line} == set(SITES)
    registry = json.loads((tmp_path / "registered-sites.json").read_text())
    assert sorted(registry) == sorted([*SITES, "site-d"])


def test_the_key_sent_is_what_flowers_own_cli_sends(federation):
    pub = federation / "public" / "sites" / "hospital-a.pub"
    assert public_key_bytes(pub) == try_load_public_key(pub)


def test_a_key_known_from_an_earlier_registry_is_recorded_not_resent(federation, tmp_path):
    """The SuperLink knows the key but the registry lost it: recorded again, not re-sent."""
    fake = FakeSuperLink()
    registrar = _registrar(federation, fake, tmp_path)
    registrar.sync(federation / "public" / "sites")
    (tmp_path / "registered-sites.json").unlink()
    fake.register_calls.clear()
    registrar.add(federation / "sites" / "clinic-c" / "site.pub", "clinic-c")
    assert fake.register_calls == [] and fake.errors == []
    registry = json.loads((tmp_path / "registered-sites.json").read_text())
    assert registry["clinic-c"]["node-id"] == str(fake.nodes[0].node_id)


def test_a_revoked_key_is_reported_and_the_other_sites_still_register(federation, tmp_path):
    fake = FakeSuperLink()
    registrar = _registrar(federation, fake, tmp_path)
    keys = federation / "public" / "sites"
    registrar.add(keys / "hospital-a.pub", "hospital-a")
    registrar.revoke("hospital-a")
    fake.register_calls.clear()
    lines = registrar.sync(keys)
    assert [name for _, name in fake.register_calls] == ["clinic-c", "hospital-b"]
    assert fake.errors == []
    (refused,) = [line for line in lines if line.startswith("NOT registered")]
    assert "hospital-a: this key was revoked" in refused and "new key pair" in refused
    with pytest.raises(DeployError, match="was revoked"):
        registrar.add(keys / "hospital-a.pub", "hospital-a")


def test_a_refusal_carries_flowers_code_and_text(federation, tmp_path):
    class Refusing(FakeSuperLink):
        def RegisterNode(self, request):
            body = {"code": int(ApiErrorCode.INVALID_SUPERNODE_LOCATION), "detail": "no."}
            raise httpx.HTTPStatusError(
                "412",
                request=httpx.Request("POST", "https://superlink/x"),
                response=httpx.Response(412, text=json.dumps(body)),
            )

    registrar = _registrar(federation, Refusing(), tmp_path)
    code = int(ApiErrorCode.INVALID_SUPERNODE_LOCATION)
    with pytest.raises(DeployError, match=rf"registering hospital-b was refused: \[code: {code}\]"):
        registrar.add(federation / "public" / "sites" / "hospital-b.pub", "hospital-b")
    assert not (tmp_path / "registered-sites.json").exists()


def test_an_unusable_public_key_is_named(tmp_path):
    bad = tmp_path / "x.pub"
    bad.write_text("ssh-ed25519 AAAA not-a-key\n")
    with pytest.raises(DeployError, match="is not an OpenSSH public key"):
        public_key_bytes(bad)
    with pytest.raises(DeployError, match="not found"):
        public_key_bytes(tmp_path / "missing.pub")


def test_main_without_a_ca_certificate_exits_2(tmp_path, capsys):
    code = main(["--superlink", "x:1", "--ca", str(tmp_path / "ca.crt"), "list"])
    assert code == 2 and "CA certificate" in capsys.readouterr().err
