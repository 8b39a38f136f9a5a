"""deploy.pki: CA, server certificate and site keys - layout, modes, formats, idempotence."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from flwr.cli.supernode.register import try_load_public_key

from deploy.errors import DeployError
from deploy.identity import load_identity, public_pem
from deploy.pki import init_coordinator, init_federation, main, site_identity, site_key


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_init_layout_modes_and_certificate(tmp_path):
    out = tmp_path / "pki"
    init_federation(out, ["hospital-a", "clinic-c"], ["superlink", "localhost", "127.0.0.1"])
    private = ("ca/ca.key", "superlink/server.key", "sites/hospital-a/site.key")
    for key in (*private, "sites/hospital-a/identity.pem"):
        assert _mode(out / key) == 0o600, key
        assert _mode((out / key).parent) == 0o700, key
    # the CA key exists only in ca/; every other folder gets the CA certificate only
    assert [p.relative_to(out) for p in out.rglob("ca.key")] == [Path("ca/ca.key")]
    assert (out / "public" / "sites" / "clinic-c.pub").read_bytes() == (
        out / "sites" / "clinic-c" / "site.pub"
    ).read_bytes()
    # the sites' identity public keys: a peers folder (one <site-id>.pem each)
    peers = out / "public" / "secure-peers"
    assert sorted(p.name for p in peers.iterdir()) == ["clinic-c.pem", "hospital-a.pem"]
    for site in ("hospital-a", "clinic-c"):
        identity = load_identity(out / "sites" / site / "identity.pem")
        assert (peers / f"{site}.pem").read_bytes() == public_pem(identity)
    ca = x509.load_pem_x509_certificate((out / "ca" / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((out / "superlink" / "server.crt").read_bytes())
    cert.verify_directly_issued_by(ca)  # raises if the signature or issuer does not match
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["superlink", "localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_site_key_is_what_flower_reads(tmp_path):
    pub = site_key(tmp_path / "keys", "hospital-a")
    private = load_ssh_private_key((tmp_path / "keys" / "site.key").read_bytes(), None)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert private.curve.name == "secp384r1"
    # the exact loader `flwr supernode register` uses (exits on a key it cannot use)
    assert try_load_public_key(pub).startswith(b"-----BEGIN PUBLIC KEY-----")
    assert pub.read_text().strip().endswith(" hospital-a")


def test_init_is_idempotent_and_adds_new_sites_only(tmp_path):
    out = tmp_path / "pki"
    init_federation(out, ["hospital-a"])
    before = _snapshot(out)
    init_federation(out, ["hospital-a", "hospital-b"])
    after = _snapshot(out)
    assert {k: after[k] for k in before} == before  # nothing existing was rewritten
    assert "sites/hospital-b/site.key" in after


def test_half_present_ca_is_refused_unchanged(tmp_path):
    out = tmp_path / "pki"
    init_federation(out, [])
    (out / "ca" / "ca.key").unlink()
    before = _snapshot(out)
    with pytest.raises(DeployError, match=r"only one of ca\.key and ca\.crt"):
        init_federation(out, ["hospital-a"])
    assert _snapshot(out) == before


def test_bad_site_name_creates_nothing(tmp_path, capsys):
    out = tmp_path / "pki"
    assert main(["init", "--out", str(out), "--site", "Hospital A"]) == 2
    assert "site name 'Hospital A' is not allowed" in capsys.readouterr().err
    assert not out.exists()


def test_site_key_command_prints_the_public_key_only(tmp_path, capsys):
    assert main(["site-key", "--out", str(tmp_path / "k"), "--name", "clinic-c"]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "k" / "site.pub").read_text().strip() in printed
    body = [ln for ln in (tmp_path / "k" / "site.key").read_text().splitlines() if "---" not in ln]
    assert body and not any(line in printed for line in body)


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_each_holder_gets_its_own_folder_and_only_its_own_files(tmp_path):
    """``init --ca --superlink --public`` and ``site-key --ca-cert --publish``: what the compose
    steps run, one folder (volume) per holder."""
    ca, tls, public = tmp_path / "pki" / "ca", tmp_path / "tls", tmp_path / "public"
    args = ["init", "--ca", str(ca), "--superlink", str(tls), "--public", str(public)]
    assert main([*args, "--san", "superlink"]) == 0
    for site in ("hospital-a", "clinic-c"):
        keys = tmp_path / f"{site}-keys"
        site_args = ["--out", str(keys), "--name", site, "--ca-cert", str(public / "ca.crt")]
        publish = ["--publish", str(public / "sites")]
        publish += ["--publish-identity", str(public / "secure-peers")]
        assert main(["site-key", *site_args, *publish]) == 0
        assert _files(keys) == {"ca.crt", "site.key", "site.pub", "identity.pem"}
        assert _mode(keys / "site.key") == 0o600 and _mode(keys) == 0o700
        assert _mode(keys / "identity.pem") == 0o600
    assert _files(ca) == {"ca.key", "ca.crt"}
    assert _files(tls) == {"ca.crt", "server.crt", "server.key"}
    assert _files(public) == {
        "ca.crt",
        "sites/hospital-a.pub",
        "sites/clinic-c.pub",
        "secure-peers/hospital-a.pem",
        "secure-peers/clinic-c.pem",
    }
    for file in public.rglob("*"):  # the public folder holds no private key
        assert file.is_dir() or b"PRIVATE KEY" not in file.read_bytes(), file
    assert (public / "sites" / "clinic-c.pub").read_bytes() == (
        tmp_path / "clinic-c-keys" / "site.pub"
    ).read_bytes()
    assert len({(f / "ca.crt").read_bytes() for f in (ca, tls, public)}) == 1
    before = _snapshot(tmp_path)
    assert main([*args, "--san", "superlink"]) == 0  # idempotent
    assert _snapshot(tmp_path) == before


def test_a_stale_published_key_follows_the_sites_key(tmp_path):
    """A site key made again: the published copy is replaced, the private key never is."""
    public = tmp_path / "public" / "sites"
    public.mkdir(parents=True)
    (public / "hospital-a.pub").write_text("ecdsa-sha2-nistp384 AAAAold hospital-a\n")
    pub = site_key(tmp_path / "keys", "hospital-a", publish=public)
    assert (public / "hospital-a.pub").read_bytes() == pub.read_bytes()
    key = (tmp_path / "keys" / "site.key").read_bytes()
    site_key(tmp_path / "keys", "hospital-a", publish=public)
    assert (tmp_path / "keys" / "site.key").read_bytes() == key


@pytest.mark.parametrize(
    "layout",
    [
        ("x", "x", "y"),  # the SuperLink's key next to the CA key
        ("x", "x/tls", "y"),  # inside the CA's folder
        ("x", "y", "y/public"),
    ],
)
def test_holders_sharing_a_folder_are_refused_before_anything_is_written(tmp_path, layout):
    ca, tls, public = (tmp_path / part for part in layout)
    with pytest.raises(DeployError, match="each holder needs a folder of its own"):
        init_coordinator(ca, tls, public)
    assert not any(tmp_path.iterdir())


def test_init_takes_one_of_its_two_forms(tmp_path, capsys):
    assert main(["init", "--out", str(tmp_path / "a"), "--ca", str(tmp_path / "b")]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["init", "--ca", str(tmp_path / "b")]) == 2
    assert "--ca DIR --superlink DIR --public DIR" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_site_key_without_the_coordinators_certificate_is_refused(tmp_path, capsys):
    missing = tmp_path / "public" / "ca.crt"
    assert main(["site-key", "--out", str(tmp_path / "k"), "--ca-cert", str(missing)]) == 2
    assert f"CA certificate {missing} not found" in capsys.readouterr().err
    assert not (tmp_path / "k").exists()


_SPKI = (serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def test_the_identity_key_is_the_p256_key_the_site_signs_with(tmp_path):
    """``identity.pem`` is what the site's ``secure-identity`` reads (P-256, PKCS8, 0600),
    a different key from the SuperNode key (P-384)."""
    from client.secure import identity_key

    site_key(tmp_path / "keys", "hospital-a")
    path = tmp_path / "keys" / "identity.pem"
    assert path.read_text().startswith("-----BEGIN PRIVATE KEY-----\n")  # PKCS8
    assert _mode(path) == 0o600
    key = identity_key(tmp_path / "state", path)
    assert isinstance(key.curve, ec.SECP256R1)
    assert public_pem(key) == site_identity(tmp_path / "keys")
    assert not (tmp_path / "state").exists()  # the named key is used, none made in the state
    auth = load_ssh_private_key((tmp_path / "keys" / "site.key").read_bytes(), None)
    assert public_pem(key) != auth.public_key().public_bytes(*_SPKI)


def test_site_key_adds_an_identity_to_an_older_key_folder_and_keeps_it(tmp_path):
    """A key folder from before identity keys: its SuperNode key pair is kept (it stays
    registered) and the identity key is added; later runs keep both."""
    keys = tmp_path / "keys"
    site_key(keys, "hospital-a")
    (keys / "identity.pem").unlink()
    before = _snapshot(keys)
    site_key(keys, "hospital-a")
    after = _snapshot(keys)
    assert {k: after[k] for k in before} == before and "identity.pem" in after
    site_key(keys, "hospital-a", publish_identity=tmp_path / "peers")
    assert _snapshot(keys) == after


def test_a_stale_published_identity_follows_the_sites_key(tmp_path):
    peers = tmp_path / "peers"
    site_key(tmp_path / "old", "hospital-a", publish_identity=peers)
    stale = (peers / "hospital-a.pem").read_bytes()
    site_key(tmp_path / "keys", "hospital-a", publish_identity=peers)
    published = (peers / "hospital-a.pem").read_bytes()
    assert published != stale and published == site_identity(tmp_path / "keys")
    assert _mode(peers / "hospital-a.pem") == 0o644


@pytest.mark.parametrize("content", ["p384", "garbage"])
def test_an_unusable_identity_key_is_refused_and_kept(tmp_path, capsys, content):
    keys = tmp_path / "keys"
    keys.mkdir()
    if content == "p384":
        data = ec.generate_private_key(ec.SECP384R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    else:
        data = b"-----BEGIN NOT A KEY-----\nsecret-looking-line\n"
    (keys / "identity.pem").write_bytes(data)
    assert main(["site-key", "--out", str(keys), "--name", "hospital-a"]) == 2
    err = capsys.readouterr().err
    assert f"{keys / 'identity.pem'} is not" in err
    assert (keys / "identity.pem").read_bytes() == data  # never overwritten
    assert data.decode().splitlines()[1] not in err  # the content is never quoted


def test_site_key_command_prints_the_identity_public_key_only(tmp_path, capsys):
    keys, peers = tmp_path / "k", tmp_path / "peers"
    args = ["site-key", "--out", str(keys), "--name", "clinic-c", "--publish-identity", str(peers)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    public = site_identity(keys)
    assert public.decode().strip() in printed and "registry as clinic-c.pem" in printed
    assert (peers / "clinic-c.pem").read_bytes() == public
    body = [ln for ln in (keys / "identity.pem").read_text().splitlines() if "---" not in ln]
    assert body and not any(line in printed for line in body)


def test_fingerprints_are_printed_when_a_key_is_made_and_for_a_peers_folder(tmp_path, capsys):
    """``site-key`` prints the identity key's fingerprint (SHA-256 of its DER public key, 16
    groups of 4 hex digits); ``fingerprints`` prints the same line for every pinned key, so two
    operators can compare what each pinned with what each made."""
    peers = tmp_path / "peers"
    made = {}
    for site in ("clinic-c", "hospital-a"):
        keys = tmp_path / site
        assert (
            main(["site-key", "--out", str(keys), "--name", site, "--publish-identity", str(peers)])
            == 0
        )
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(f"{site}.pem "))
        der = serialization.load_pem_public_key(site_identity(keys)).public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        digest = hashlib.sha256(der).hexdigest()
        assert line == f"{site}.pem  " + " ".join(digest[i : i + 4] for i in range(0, 64, 4))
        made[site] = line
    assert not peers.stat().st_mode & 0o022  # the published peers folder: its owner's only
    assert main(["fingerprints", str(peers)]) == 0
    assert capsys.readouterr().out.splitlines() == [made["clinic-c"], made["hospital-a"]]
    peers.chmod(0o775)
    assert main(["fingerprints", str(peers)]) == 2
    assert "can be written by group or others" in capsys.readouterr().err
