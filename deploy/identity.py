"""A deployed site's secure-aggregation identity key and its folder of pinned peer keys.

In a secure-aggregation round every site signs its round keys with its IDENTITY key (ECDSA
P-256, PKCS8 PEM, mode 0600; ``prism_runtime.identity.IDENTITY_KEY`` in the site's key folder,
made by ``python -m deploy.pki site-key``) and checks every other site's signature against the
public keys it PINNED: the peers folder (node config ``secure-peers``) holds one ``<site-id>.pem``
(SubjectPublicKeyInfo PEM) per site of the federation, this site's own included, installed by
the site's operator from the federation's registry, never sent by the coordinator. The identity
key is not the SuperNode authentication key (``site.key``, P-384 OpenSSH), which only the
coordinator checks.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from deploy.errors import DeployError, InsecureSetupError
from prism_runtime.identity import IDENTITY_KEY

__all__ = ["check_peers", "load_identity", "public_pem"]

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


def check_peers(folder: Path, *, site_id: str, identity: Path | None, variable: str) -> int:
    """Check the peers folder ``folder``; returns how many site keys it pins (0: none yet).

    The folder is public: it must hold no private key. Every ``*.pem`` must be a P-256 public
    key; once it pins any, it must pin this site's own (``<site_id>.pem``, the public half of
    ``identity``): every site, this one included, checks this site's signatures against it.

    Raises:
        InsecureSetupError: a private key lies in the folder.
        DeployError: the folder is missing, a key is unusable, this site's own key is missing
            or is not the public half of ``identity``, or ``identity`` is not given.
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
    pinned = {p.stem: _peer(p) for p in files if p.suffix == ".pem"}
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
