"""deploy.pki: CA, server certificate and site keys - layout, modes, formats, idempotence."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from flwr.cli.supernode.register import try_load_public_key

from deploy.errors import DeployError
from deploy.pki import init_coordinator, init_federation, main, site_key


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_init_layout_modes_and_certificate(tmp_path):
    out = tmp_path / "pki"
    init_federation(out, ["hospital-a", "clinic-c"], ["superlink", "localhost", "127.0.0.1"])
    for key in ("ca/ca.key", "superlink/server.key", "sites/hospital-a/site.key"):
        assert _mode(out / key) == 0o600, key
        assert _mode((out / key).parent) == 0o700, key
    # the CA key exists only in ca/; every other folder gets the CA certificate only
    assert [p.relative_to(out) for p in out.rglob("ca.key")] == [Path("ca/ca.key")]
    assert (out / "public" / "sites" / "clinic-c.pub").read_bytes() == (
        out / "sites" / "clinic-c" / "site.pub"
    ).read_bytes()
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
        assert main(["site-key", *site_args, "--publish", str(public / "sites")]) == 0
        assert _files(keys) == {"ca.crt", "site.key", "site.pub"}
        assert _mode(keys / "site.key") == 0o600 and _mode(keys) == 0o700
    assert _files(ca) == {"ca.key", "ca.crt"}
    assert _files(tls) == {"ca.crt", "server.crt", "server.key"}
    assert _files(public) == {"ca.crt", "sites/hospital-a.pub", "sites/clinic-c.pub"}
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
