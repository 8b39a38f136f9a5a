"""TLS and SuperNode-authentication material for a prism-fl federation (``python -m deploy.pki``).

Subcommands (every one is idempotent: existing files are kept, never overwritten):

- ``init --out DIR --site NAME ... [--san HOST ...]``: everything a one-host federation needs:
  a CA, the SuperLink's server certificate and one authentication key pair per site, laid out
  so that each container mounts only its own part::

      DIR/ca/ca.key, ca.crt                 the CA (its key never leaves this folder)
      DIR/superlink/ca.crt, server.crt, server.key
      DIR/public/ca.crt, sites/NAME.pub     what the register step and the coordinator read
      DIR/sites/NAME/ca.crt, site.key, site.pub

- ``site-key --out DIR [--name NAME]``: one site's key pair (run it AT the site); prints the
  public key to send to the coordinator. The private key never leaves ``DIR``.

TLS keys are ECDSA P-256 with X.509 certificates (the server certificate carries SANs for the
given host names and IP addresses); SuperNode keys are ECDSA P-384 in OpenSSH format, which is
what ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` read.
Private keys are written with mode 0600 and their folders with 0700. Exit codes: 0 done,
2 bad arguments or unusable existing files.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deploy.errors import DeployError

__all__ = ["DEFAULT_SANS", "init_federation", "main", "site_key", "valid_site_name"]

DEFAULT_SANS = ("superlink", "localhost", "127.0.0.1")
_SITE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_DAYS_CA, _DAYS_SERVER = 3650, 825


def valid_site_name(name: str) -> str:
    """Site names become file and node names: lower-case letters, digits, '.', '_' and '-'."""
    if not _SITE_NAME.match(name):
        raise DeployError(
            f"site name {name!r} is not allowed: use 1-63 lower-case letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (e.g. 'hospital-a')"
        )
    return name


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Create ``path`` (never overwrite); private files get mode 0600 from the start."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if private:
        path.parent.chmod(0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise DeployError(
            f"{path} exists but is not an unencrypted PEM private key ({exc}); "
            "move it away to generate a new one"
        ) from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise DeployError(f"{path} is not an EC private key; move it away to generate a new one")
    return key


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "prism-fl federation"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _ensure_ca(ca_dir: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key_path, cert_path = ca_dir / "ca.key", ca_dir / "ca.crt"
    if key_path.exists() and cert_path.exists():
        return _load_key(key_path), x509.load_pem_x509_certificate(cert_path.read_bytes())
    if key_path.exists() or cert_path.exists():
        raise DeployError(
            f"{ca_dir} holds only one of ca.key and ca.crt; restore the missing file "
            "or move the folder away to create a new CA (sites must then trust the new ca.crt)"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("prism-fl federation CA"))
        .issuer_name(_name("prism-fl federation CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=_DAYS_CA))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _pem_key(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return key, cert


def _san(entry: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(entry))
    except ValueError:
        return x509.DNSName(entry)


def _ensure_server_cert(
    out: Path, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, sans: Sequence[str]
) -> None:
    key_path, cert_path = out / "server.key", out / "server.crt"
    if key_path.exists() and cert_path.exists():
        return
    if key_path.exists() or cert_path.exists():
        raise DeployError(
            f"{out} holds only one of server.key and server.crt; move the folder away to "
            "issue a new server certificate"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(sans[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=_DAYS_SERVER))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([_san(s) for s in sans]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(key_path, _pem_key(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)


def site_key(out: Path, name: str = "site") -> Path:
    """Create ``out/site.key`` (OpenSSH EC P-384, 0600) and ``out/site.pub``; return the .pub.

    An existing key pair is kept as it is (its public key is returned again).
    """
    key_path, pub_path = out / "site.key", out / "site.pub"
    if key_path.exists() and pub_path.exists():
        return pub_path
    if key_path.exists() or pub_path.exists():
        raise DeployError(
            f"{out} holds only one of site.key and site.pub; move the folder away to create a "
            "new key pair (the coordinator must then register the new public key)"
        )
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write(key_path, private, private=True)
    _write(pub_path, public + f" {name}\n".encode(), private=False)
    return pub_path


def _copy(src: Path, dst: Path) -> None:
    if not dst.exists():
        _write(dst, src.read_bytes(), private=False)


def init_federation(out: Path, sites: Sequence[str], sans: Sequence[str] = DEFAULT_SANS) -> None:
    """CA, server certificate and one key pair per site under ``out`` (layout: module doc)."""
    for site in sites:
        valid_site_name(site)
    if not sans:
        raise DeployError("the server certificate needs at least one --san host name")
    ca_key, ca_cert = _ensure_ca(out / "ca")
    _ensure_server_cert(out / "superlink", ca_key, ca_cert, sans)
    for folder in (out / "superlink", out / "public"):
        _copy(out / "ca" / "ca.crt", folder / "ca.crt")
    for site in sites:
        pub = site_key(out / "sites" / site, site)
        _copy(out / "ca" / "ca.crt", out / "sites" / site / "ca.crt")
        _copy(pub, out / "public" / "sites" / f"{site}.pub")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.pki", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="CA, server certificate and site keys (idempotent)")
    init.add_argument("--out", type=Path, required=True, help="folder for all the material")
    init.add_argument("--site", action="append", default=[], help="a site name (repeat)")
    init.add_argument(
        "--san",
        action="append",
        default=[],
        help=f"server certificate host name or IP (repeat; default {', '.join(DEFAULT_SANS)})",
    )
    key = sub.add_parser("site-key", help="one site's authentication key pair (run at the site)")
    key.add_argument("--out", type=Path, required=True, help="the site's private key folder")
    key.add_argument("--name", default="site", help="site name (a comment in the public key)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "init":
            sites = args.site or [
                s for s in os.environ.get("PRISM_SITES", "").replace(",", " ").split() if s
            ]
            init_federation(args.out, sites, args.san or DEFAULT_SANS)
            print(
                f"prism-fl pki: CA, server certificate and {len(sites)} site key(s) in {args.out}"
            )
        else:
            pub = site_key(args.out, valid_site_name(args.name))
            print(f"prism-fl pki: private key {args.out / 'site.key'} (mode 0600, keep it here)")
            print("Send this public key to the coordinator (it is not secret):")
            print(pub.read_text().strip())
    except DeployError as exc:
        print(f"prism-fl pki: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
