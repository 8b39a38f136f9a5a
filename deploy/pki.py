"""TLS and SuperNode-authentication material for a prism-fl federation (``python -m deploy.pki``).

Every party that holds a secret gets its own folder, and in a container its own volume, so no
container can see another party's secret whatever the Docker Engine version (no ``subpath``):

- ``init --ca DIR --superlink DIR --public DIR [--san HOST ...]``: the coordinator's material, one
  folder per holder: ``--ca`` gets the CA (``ca.key``, ``ca.crt``; the key never leaves it),
  ``--superlink`` the SuperLink's ``ca.crt``, ``server.crt``, ``server.key``, ``--public`` what
  the register step and the coordinator read (``ca.crt``; sites publish ``sites/NAME.pub`` here).
- ``init --out DIR [--site NAME ...]``: the same in one folder on a host without containers, with
  one key pair per site::

      DIR/ca/ca.key, ca.crt                 the CA (its key never leaves this folder)
      DIR/superlink/ca.crt, server.crt, server.key
      DIR/public/ca.crt, sites/NAME.pub     what the register step and the coordinator read
      DIR/public/secure-peers/NAME.pem      the sites' identity public keys (a peers folder)
      DIR/sites/NAME/ca.crt, site.key, site.pub, identity.pem

- ``site-key --out DIR [--name NAME] [--ca-cert FILE] [--publish DIR] [--publish-identity DIR]``:
  one site's keys (run it AT the site, or in the site's own key volume): its SuperNode key pair
  (``site.key``, ``site.pub``) and its secure-aggregation identity key (``identity.pem``); prints
  both public keys, the first to send to the coordinator, the second to the federation's
  registry of identity keys (which every site pins). The private keys never leave ``DIR``.
  ``--ca-cert`` copies the federation's CA certificate into ``DIR``; ``--publish`` writes the
  public key as ``DIR2/NAME.pub`` (what the register step reads); ``--publish-identity`` writes
  the identity public key as ``DIR3/NAME.pem`` (a peers folder, node config ``secure-peers``).
  It prints the identity key's fingerprint, for the operators to compare out of band.
- ``fingerprints DIR``: the fingerprint of every pinned identity key in the peers folder ``DIR``
  (``deploy.identity.fingerprint``), one ``NAME.pem  XXXX XXXX ...`` line each, to compare with
  what each site's operator read off its own ``site-key`` output; refused if the folder fails
  the launcher's checks (a private key in it, writable by group or others).

Idempotent: private keys and certificates are never overwritten; copies of public files
(``ca.crt`` in a holder's folder, a published ``NAME.pub`` or ``NAME.pem``) follow their
source. TLS keys are ECDSA P-256 with X.509 certificates (the server certificate carries SANs
for the given host names and IP addresses); SuperNode keys are ECDSA P-384 in OpenSSH format,
which is what ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register``
read; identity keys are ECDSA P-256 in PKCS8 PEM (public halves: SubjectPublicKeyInfo PEM), what
the secure sum signs with (``deploy.identity``).
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
from deploy.identity import fingerprint, load_identity, pinned_keys, public_pem
from prism_runtime.identity import IDENTITY_KEY

__all__ = [
    "DEFAULT_SANS",
    "init_coordinator",
    "init_federation",
    "main",
    "site_identity",
    "site_key",
    "valid_site_name",
]

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


def _unwritable(path: Path, exc: OSError) -> DeployError:
    return DeployError(
        f"cannot write {path} ({exc.strerror}): its folder must be writable by uid {os.getuid()}. "
        "A Docker volume mounted where the image has no folder is owned by root: mount each "
        "holder's volume at /pki, /tls, /pki-public or /keys (docker-compose.yml does), or "
        "`chown` the host folder to the containers' user (deploy/README.md)"
    )


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Create ``path`` (never overwrite); private files get mode 0600 from the start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if private:
            path.parent.chmod(0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    except PermissionError as exc:
        raise _unwritable(path, exc) from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _publish(data: bytes, path: Path) -> None:
    """Make the public file ``path`` hold ``data`` (a copy follows its source; mode 0644)."""
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    _write(tmp, data, private=False)
    tmp.replace(path)


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


def site_identity(out: Path) -> bytes:
    """The public half (PEM) of the identity key ``out/identity.pem``, made (P-256, PKCS8,
    0600) if it does not exist; an existing key is kept as it is."""
    path = out / IDENTITY_KEY
    if path.exists():
        return public_pem(load_identity(path))
    key = ec.generate_private_key(ec.SECP256R1())
    _write(path, _pem_key(key), private=True)
    return public_pem(key)


def site_key(
    out: Path,
    name: str = "site",
    *,
    ca_cert: Path | None = None,
    publish: Path | None = None,
    publish_identity: Path | None = None,
) -> Path:
    """Create ``out/site.key`` (OpenSSH EC P-384, 0600) and ``out/site.pub``, and the identity
    key ``out/identity.pem`` (``site_identity``); return the .pub.

    An existing key is kept as it is (its public key is returned again). ``ca_cert``: the
    federation's CA certificate, copied to ``out/ca.crt``; ``publish``: a folder that gets a copy
    of the public key as ``NAME.pub`` (what ``deploy.register sync`` reads);
    ``publish_identity``: a folder that gets the identity public key as ``NAME.pem`` (a peers
    folder; left writable by its owner only).
    """
    valid_site_name(name)
    if ca_cert is not None and not ca_cert.is_file():
        raise DeployError(
            f"CA certificate {ca_cert} not found: create the coordinator's material first "
            "(`python -m deploy.pki init ...`)"
        )
    key_path, pub_path = out / "site.key", out / "site.pub"
    if key_path.exists() != pub_path.exists():
        raise DeployError(
            f"{out} holds only one of site.key and site.pub; move the folder away to create a "
            "new key pair (the coordinator must then register the new public key)"
        )
    if not key_path.exists():
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
    identity = site_identity(out)
    if ca_cert is not None:
        _publish(ca_cert.read_bytes(), out / "ca.crt")
    if publish is not None:
        _publish(pub_path.read_bytes(), publish / f"{name}.pub")
    if publish_identity is not None:
        _publish(identity, publish_identity / f"{name}.pem")
        _owner_writable_only(publish_identity)
    return pub_path


def _owner_writable_only(folder: Path) -> None:
    """Take group and others' write permission off a peers folder (the launcher refuses it)."""
    mode = folder.stat().st_mode
    if mode & 0o022:
        try:
            folder.chmod(mode & ~0o022 & 0o7777)
        except PermissionError as exc:
            raise _unwritable(folder, exc) from exc


def _separate(folders: dict[str, Path]) -> None:
    """Each holder's folder is its own: none is another's, or inside another's."""
    resolved = {what: path.resolve() for what, path in folders.items()}
    for what, path in resolved.items():
        for other, other_path in resolved.items():
            if what != other and (path == other_path or path.is_relative_to(other_path)):
                raise DeployError(
                    f"the {what} folder {folders[what]} is (inside) the {other} folder "
                    f"{folders[other]}: each holder needs a folder of its own, so that no one "
                    "sees another's secret"
                )


def init_coordinator(
    ca_dir: Path, superlink_dir: Path, public_dir: Path, sans: Sequence[str] = DEFAULT_SANS
) -> None:
    """The CA in ``ca_dir``, the SuperLink's TLS material in ``superlink_dir`` and the public
    CA certificate in ``public_dir``: three holders, three folders (layout: module doc)."""
    if not sans:
        raise DeployError("the server certificate needs at least one --san host name")
    _separate({"CA": ca_dir, "SuperLink": superlink_dir, "public": public_dir})
    ca_key, ca_cert = _ensure_ca(ca_dir)
    _ensure_server_cert(superlink_dir, ca_key, ca_cert, sans)
    certificate = (ca_dir / "ca.crt").read_bytes()
    for folder in (superlink_dir, public_dir):
        _publish(certificate, folder / "ca.crt")


def init_federation(out: Path, sites: Sequence[str], sans: Sequence[str] = DEFAULT_SANS) -> None:
    """Everything under one folder ``out`` (a host without containers; layout: module doc)."""
    for site in sites:
        valid_site_name(site)
    init_coordinator(out / "ca", out / "superlink", out / "public", sans)
    for site in sites:
        site_key(
            out / "sites" / site,
            site,
            ca_cert=out / "public" / "ca.crt",
            publish=out / "public" / "sites",
            publish_identity=out / "public" / "secure-peers",
        )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.pki", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="CA, server certificate (and site keys with --out)")
    init.add_argument("--out", type=Path, help="one folder for all the material (no containers)")
    init.add_argument("--site", action="append", default=[], help="with --out: a site (repeat)")
    init.add_argument("--ca", type=Path, help="the CA's own folder (its key stays there)")
    init.add_argument("--superlink", type=Path, help="the SuperLink's own TLS folder")
    init.add_argument("--public", type=Path, help="folder for the public CA certificate")
    init.add_argument(
        "--san",
        action="append",
        default=[],
        help=f"server certificate host name or IP (repeat; default {', '.join(DEFAULT_SANS)})",
    )
    key = sub.add_parser(
        "site-key", help="one site's authentication and identity keys (run at the site)"
    )
    key.add_argument("--out", type=Path, required=True, help="the site's private key folder")
    key.add_argument("--name", default="site", help="site name (a comment in the public key)")
    key.add_argument("--ca-cert", type=Path, help="copy this CA certificate into --out")
    key.add_argument("--publish", type=Path, help="folder that gets a copy of NAME.pub")
    key.add_argument(
        "--publish-identity",
        type=Path,
        help="folder (of pinned identity keys) that gets the identity public key as NAME.pem",
    )
    prints = sub.add_parser(
        "fingerprints", help="the fingerprint of every identity key a peers folder pins"
    )
    prints.add_argument("folder", type=Path, help="the peers folder (secure-peers)")
    return parser


def _init(args: argparse.Namespace) -> str:
    """``init`` in one of its two forms; returns what was done."""
    sans = args.san or DEFAULT_SANS
    holders = (args.ca, args.superlink, args.public)
    if args.out is not None:
        if any(holders):
            raise DeployError("give either --out, or --ca, --superlink and --public, not both")
        sites = args.site or [
            s for s in os.environ.get("PRISM_SITES", "").replace(",", " ").split() if s
        ]
        init_federation(args.out, sites, sans)
        return f"CA, server certificate and {len(sites)} site key(s) in {args.out}"
    if not all(holders) or args.site:
        raise DeployError(
            "give --out DIR [--site NAME ...], or --ca DIR --superlink DIR --public DIR (one "
            "folder per holder; site keys then come from `site-key` in each site's folder)"
        )
    init_coordinator(args.ca, args.superlink, args.public, sans)
    return f"CA in {args.ca}, SuperLink TLS in {args.superlink}, CA certificate in {args.public}"


def _site_key(args: argparse.Namespace) -> None:
    """``site-key``: make the keys, print where they are and both public keys."""
    pub = site_key(
        args.out,
        args.name,
        ca_cert=args.ca_cert,
        publish=args.publish,
        publish_identity=args.publish_identity,
    )
    identity = site_identity(args.out).decode().strip()
    print(f"prism-fl pki: private key {args.out / 'site.key'} (mode 0600, keep it here)")
    print(
        f"prism-fl pki: secure-aggregation identity key {args.out / IDENTITY_KEY} "
        "(mode 0600, keep it here and back it up: the other sites pin its public key)"
    )
    print("Send this public key to the coordinator (it is not secret):")
    print(pub.read_text().strip())
    print(
        f"Send this identity public key to the federation's registry as {args.name}.pem "
        "(it is not secret; every site of the federation pins it):"
    )
    print(identity)
    print(
        "Its fingerprint: read it to every other site's operator out of band (telephone, "
        "paper), who compares it with `python -m deploy.pki fingerprints PEERS_DIR` before "
        "trusting the registry's file:"
    )
    print(f"{args.name}.pem  {fingerprint(identity.encode())}")


def _fingerprints(folder: Path) -> None:
    """``fingerprints``: one line per pinned key of the peers folder ``folder``."""
    pinned = pinned_keys(folder, variable="the peers folder")
    if not pinned:
        raise DeployError(f"{folder} pins no identity keys (no <site-id>.pem)")
    for site, pem in sorted(pinned.items()):
        print(f"{site}.pem  {fingerprint(pem)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "init":
            print(f"prism-fl pki: {_init(args)}")
        elif args.command == "fingerprints":
            _fingerprints(args.folder)
        else:
            _site_key(args)
    except DeployError as exc:
        print(f"prism-fl pki: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
