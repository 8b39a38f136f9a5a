"""A deployed site's secure-aggregation identity key and its folder of pinned peer keys.

In a secure-aggregation round every site signs its round keys with its IDENTITY key (ECDSA
P-256, PKCS8 PEM, mode 0600; ``prism_runtime.identity.IDENTITY_KEY`` in the site's key folder,
made by ``python -m deploy.pki site-key``) and checks every other site's signature against the
public keys it PINNED: the peers folder (node config ``secure-peers``) holds one ``<site-id>.pem``
(SubjectPublicKeyInfo PEM) per site of the federation, this site's own included, installed by
the site's operator from the federation's registry, never sent by the coordinator. The identity
key is not the SuperNode authentication key (``site.key``, P-384 OpenSSH), which only the
coordinator checks.

A pinned key is only as good as the way it came: every key's FINGERPRINT (``fingerprint``:
SHA-256 of its DER SubjectPublicKeyInfo, in 16 groups of 4 hex digits) is printed when it is
made (``python -m deploy.pki site-key``), listed for a peers folder (``python -m deploy.pki
fingerprints DIR``) and logged when a site starts, so the operators compare them out of band
(by telephone, on paper) before trusting a registry's file; and the peers folder must be
writable by its owner only (``check_peers``), never by a service of the coordinator.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from deploy.errors import DeployError, InsecureSetupError
from prism_runtime.identity import IDENTITY_KEY

__all__ = ["check_peers", "fingerprint", "load_identity", "pinned_keys", "public_pem"]

_PRIVATE_MARK = b"PRIVATE KEY"


def public_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """The public half of ``key`` as a peers-folder file (SubjectPublicKeyInfo PEM)."""
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def load_identity(path: Path) -> ec.EllipticCurvePrivateKey:
    """The identity private key in ``path`` (unencrypted PEM, ECDSA P-256).

    Raises:
        DeployError: the file is not such a key (its content is never quoted).
    """
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError):
        raise DeployError(
            f"{path} is not an unencrypted PEM private key: restore the site's identity key from "
            "its backup (its public half is pinned at the other sites), or move the file away "
            "and make a new one with `python -m deploy.pki site-key` (then every site must pin "
            "the new public key)"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise DeployError(
            f"{path} is not an ECDSA P-256 private key: the secure sum signs with P-256 (the "
            "SuperNode key site.key, P-384, is a different key); make one with "
            "`python -m deploy.pki site-key`"
        )
    return key


def fingerprint(pem: bytes) -> str:
    """The fingerprint of a public key in PEM: SHA-256 of its DER SubjectPublicKeyInfo, as 16
    groups of 4 hex digits (what two operators read to each other to compare a pinned key).

    Raises:
        DeployError: ``pem`` is not a public key in PEM.
    """
    try:
        key = serialization.load_pem_public_key(pem)
    except ValueError:
        raise DeployError("not a public key in PEM: no fingerprint") from None
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    digest = hashlib.sha256(der).hexdigest()
    return " ".join(digest[i : i + 4] for i in range(0, len(digest), 4))


def _peer(path: Path) -> bytes:
    """The public key in ``path`` (normalised PEM), refused if it is not a P-256 public key."""
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except ValueError:
        key = None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise DeployError(
            f"pinned identity key {path} is not an ECDSA P-256 public key in PEM: ask the "
            "federation's registry for that site's identity public key again"
        )
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def pinned_keys(folder: Path, *, variable: str) -> dict[str, bytes]:
    """The public keys a peers folder pins (site id -> normalised PEM), checked.

    The folder is public but the site's alone to write: it must hold no private key, and
    neither it nor a key in it may be writable by group or others (whoever can write it can
    pin a site of their own; the site refuses such a folder at every round too). Every ``*.pem``
    must be a P-256 public key.

    Raises:
        InsecureSetupError: a private key lies in the folder, or it or a key in it is writable
            by group or others.
        DeployError: the folder is missing or a key is unusable.
    """
    if not folder.is_dir():
        raise DeployError(
            f"{variable}={folder} is not a folder: it is the folder of the federation's pinned "
            "identity keys (one <site-id>.pem per site, from the federation's registry)"
        )
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    secret = [p.name for p in files if _PRIVATE_MARK in p.read_bytes()]
    if secret:
        raise InsecureSetupError(
            f"refusing to start: the peers folder {folder} ({variable}) holds a PRIVATE key "
            f"({', '.join(secret)}); it holds the other sites' public keys only. Move the file "
            "into the site's key folder (or delete it if it belongs to no one here)"
        )
    pems = [p for p in files if p.suffix == ".pem"]
    loose = [p.name for p in (folder, *pems) if p.stat().st_mode & 0o022]
    if loose:
        raise InsecureSetupError(
            f"refusing to start: the peers folder {folder} ({variable}) or its keys "
            f"({', '.join(loose)}) can be written by group or others, so someone else (a "
            f"service of the coordinator) could pin a site of their own. Run `chmod go-w "
            f"{folder} {folder}/*.pem`, and mount it read-only wherever another party runs"
        )
    return {p.stem: _peer(p) for p in pems}


def check_peers(folder: Path, *, site_id: str, identity: Path | None, variable: str) -> int:
    """Check the peers folder ``folder``; returns how many site keys it pins (0: none yet).

    The folder passes ``pinned_keys``; once it pins any, it must pin this site's own
    (``<site_id>.pem``, the public half of ``identity``): every site, this one included, checks
    this site's signatures against it.

    Raises:
        InsecureSetupError: as ``pinned_keys``.
        DeployError: the folder is missing, a key is unusable, this site's own key is missing
            or is not the public half of ``identity``, or ``identity`` is not given.
    """
    pinned = pinned_keys(folder, variable=variable)
    if not pinned:
        return 0
    if identity is None:
        raise DeployError(
            f"{folder} ({variable}) pins the federation's identity keys but PRISM_SECURE_IDENTITY "
            "is not set: name this site's identity key (`python -m deploy.pki site-key` makes "
            f"{IDENTITY_KEY}), whose public half the registry holds as {site_id}.pem"
        )
    own = pinned.get(site_id)
    if own is None:
        raise DeployError(
            f"{folder} ({variable}) pins {len(pinned)} site key(s) but not this site's own "
            f"({site_id}.pem): every site checks its own signature too. Install the registry's "
            f"complete set, which holds {site_id}.pem, the key make-site-key.sh printed"
        )
    if own != public_pem(load_identity(identity)):
        raise DeployError(
            f"{folder / f'{site_id}.pem'} ({variable}) is not the public half of this site's "
            f"identity key {identity} (PRISM_SECURE_IDENTITY): the federation pinned another "
            "key, and every secure round would fail its signature checks. Send the registry "
            "the public key `python -m deploy.pki site-key` prints, or restore the identity key "
            "the registry holds"
        )
    return len(pinned)
