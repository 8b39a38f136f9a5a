"""The file names of a site's secure-aggregation identity key: one name for the site and its kit.

A site signs its round keys with its identity key (ECDSA P-256; ``prism_runtime.secure_sum.keys``).
The site kit makes it in the site's key folder (``python -m deploy.pki site-key``), and a site
whose node config names none (``secure-identity``) makes it in its state folder on first use
(``client.secure.identity_key``): both under ``IDENTITY_KEY``. A leaf module without imports, so
that the kit's key tool starts without the model runtime.
"""

from __future__ import annotations

__all__ = ["IDENTITY_KEY", "IDENTITY_PUBLIC"]

IDENTITY_KEY = "identity.pem"
"""A site's identity private key (ECDSA P-256, PKCS8 PEM, mode 0600). Not ``*.key``: the key
folder's launcher check refuses foreign ``*.key`` files."""
IDENTITY_PUBLIC = "identity.pub"
"""Its public half beside it in a site's state folder (SubjectPublicKeyInfo PEM): what the
simulated sites pin of one another."""
