"""Per-round key agreement of the secure sum, with public keys bound to the sites' identities.

Each site makes two X25519 key pairs per round, as in SecAgg (Bonawitz et al. 2017; Bell et al.
2020): the *mask* pair, whose pairwise agreements key the masks that cancel in the sum, and the
*share* pair, whose pairwise agreements key the encryption of the Shamir shares sent through the
coordinator. A pairwise key is HKDF-SHA256 (no salt, 32 bytes) over the X25519 shared secret with
an ``info`` that frames the purpose, the run id, the round and BOTH site ids in sorted order, so
both ends derive the same key and a key never serves two purposes, runs, rounds or pairs.

The coordinator relays the public keys, so it could substitute its own and sit in the middle.
Each site therefore signs what it advertises (both public keys, a commitment to its self-mask
seed, the run id, the round and its site id) with its identity key: ECDSA over P-256 with
SHA-256, the kind of key Flower's SuperNode authentication registers. A receiver verifies each
advertisement against the identity key registered for that site id and refuses the roster
(``KeyBindingError``, naming the site) when a signature does not verify.

The signature also covers the site's noise share and its H and D (``trust.RoundTrust``), which
the coordinator reads to pick a threshold every site accepts.

The seed commitment (SHA-256 of the framed 32-byte seed) hides the seed (it is uniformly random)
and lets the coordinator check that the seed it reconstructs from shares is the one the site
masked with; the mask public key plays that role for the reconstructed mask private key.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum._encoding import DOMAIN, frame
from prism_runtime.secure_sum.errors import KeyBindingError
from prism_runtime.secure_sum.trust import RoundTrust

__all__ = [
    "KEY_BYTES",
    "MASK_PURPOSE",
    "SHARE_PURPOSE",
    "AdvertisedKeys",
    "RoundId",
    "noise_share_bytes",
    "pairwise_key",
    "seed_commitment",
    "sign_keys",
    "verify_keys",
]

KEY_BYTES = 32
"""Length of an X25519 public or private key, of a derived pairwise key and of a seed."""
MASK_PURPOSE = "pairwise-mask"
"""HKDF purpose of the key that expands into a pairwise mask."""
SHARE_PURPOSE = "share-encryption"
"""HKDF purpose of the key that encrypts the Shamir shares sent from one site to another."""


@dataclass(frozen=True)
class RoundId:
    """The round a key, signature or ciphertext belongs to: the run id and the round number."""

    run_id: str
    server_round: int

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ConfigError(f"run_id is {self.run_id!r}: give the coordinator run's id string")
        if isinstance(self.server_round, bool) or not isinstance(self.server_round, int):
            raise ConfigError(f"server_round is {self.server_round!r}: give an int round number")
        if not 0 <= self.server_round < 2**63:
            raise ConfigError(f"server_round is {self.server_round}: give a round in [0, 2^63)")


@dataclass(frozen=True)
class AdvertisedKeys:
    """What a site publishes for one round, signed with its identity key.

    Attributes:
        site_id: The registered site id of the signer.
        mask_public: Raw X25519 public key (32 bytes) of the pairwise-mask key pair.
        share_public: Raw X25519 public key (32 bytes) of the share-encryption key pair.
        seed_commitment: ``seed_commitment(seed)`` of the site's self-mask seed (32 bytes).
        signature: DER ECDSA P-256/SHA-256 signature over all of the above, the run id and round.
        noise_share: the Skellam parameter this site needs EVERY honest site to add (its
            ``mu / (H - D)``); signed with the keys, so the coordinator cannot understate it to
            the other sites (each adds the largest of the round's participants).
        honest_sites: H, the honest sites this site counts on (``trust.RoundTrust``).
        max_dropouts: D, the most roster sites it tolerates missing: with H, what the
            coordinator needs to pick a threshold every site accepts.
    """

    site_id: str
    mask_public: bytes
    share_public: bytes
    seed_commitment: bytes
    signature: bytes
    noise_share: float
    honest_sites: int
    max_dropouts: int

    @property
    def trust(self) -> RoundTrust:
        """The H and D this site signed.

        Raises:
            ConfigError: they are not ints with ``0 <= D < H``.
        """
        return RoundTrust(self.honest_sites, self.max_dropouts)


def seed_commitment(seed: bytes) -> bytes:
    """SHA-256 of the framed self-mask seed: binds the seed without revealing it."""
    return hashlib.sha256(frame(DOMAIN, "seed-commitment", seed)).digest()


def noise_share_bytes(noise_share: float) -> bytes:
    """The signed encoding of a noise share: 8 bytes, float64 little-endian.

    Raises:
        ConfigError: not a finite number >= 0.
    """
    if not (isinstance(noise_share, float | int) and math.isfinite(noise_share)) or noise_share < 0:
        raise ConfigError(f"noise share {noise_share!r}: give a finite number >= 0")
    return struct.pack("<d", float(noise_share))


def _signed_bytes(
    round_id: RoundId,
    site_id: str,
    mask_public: bytes,
    share_public: bytes,
    commitment: bytes,
    noise_share: float,
    trust: RoundTrust,
) -> bytes:
    return frame(
        DOMAIN,
        "advertised-keys",
        round_id.run_id,
        round_id.server_round,
        site_id,
        mask_public,
        share_public,
        commitment,
        noise_share_bytes(noise_share),
        trust.honest,
        trust.dropouts,
    )


def sign_keys(
    *,
    round_id: RoundId,
    site_id: str,
    mask_public: bytes,
    share_public: bytes,
    commitment: bytes,
    identity_key: ec.EllipticCurvePrivateKey,
    noise_share: float,
    trust: RoundTrust,
) -> AdvertisedKeys:
    """Sign a site's round keys, noise share, H and D with its identity key (ECDSA P-256,
    SHA-256).

    Raises:
        ConfigError: The identity key is not on P-256 or a key is not 32 bytes.
    """
    if not isinstance(identity_key.curve, ec.SECP256R1):
        raise ConfigError(
            f"site {site_id!r}: the identity key is on {identity_key.curve.name}; the secure sum "
            "signs with the site's registered P-256 (secp256r1) key"
        )
    for name, value in (("mask_public", mask_public), ("share_public", share_public)):
        if len(value) != KEY_BYTES:
            raise ConfigError(f"site {site_id!r}: {name} has {len(value)} bytes, not {KEY_BYTES}")
    message = _signed_bytes(
        round_id, site_id, mask_public, share_public, commitment, float(noise_share), trust
    )
    signature = identity_key.sign(message, ec.ECDSA(hashes.SHA256()))
    return AdvertisedKeys(
        site_id,
        mask_public,
        share_public,
        commitment,
        signature,
        float(noise_share),
        trust.honest,
        trust.dropouts,
    )


def verify_keys(
    advertised: AdvertisedKeys,
    *,
    round_id: RoundId,
    registered: Mapping[str, ec.EllipticCurvePublicKey],
) -> None:
    """Check that ``advertised`` was signed for this round by the site it names.

    Args:
        advertised: One site's advertisement as relayed by the coordinator.
        round_id: The round the receiver is in (a replay from another round fails).
        registered: The identity public key of every registered site id.

    Raises:
        KeyBindingError: The site has no registered key, a key is malformed, or the signature does
            not verify (the keys were substituted): abort the round, do not share secrets.
    """
    site = advertised.site_id
    public = registered.get(site)
    if public is None:
        raise KeyBindingError(
            f"site {site!r} advertised round keys but has no registered identity key: refuse "
            "this roster (register the site's key before it joins a secure sum)"
        )
    if not isinstance(public.curve, ec.SECP256R1):
        raise KeyBindingError(
            f"the registered identity key of site {site!r} is on {public.curve.name}, not P-256: "
            "register its P-256 key"
        )
    lengths = (len(advertised.mask_public), len(advertised.share_public))
    if lengths != (KEY_BYTES, KEY_BYTES) or len(advertised.seed_commitment) != KEY_BYTES:
        raise KeyBindingError(
            f"site {site!r} advertised keys of {lengths} bytes and a commitment of "
            f"{len(advertised.seed_commitment)} bytes, not 32 each: refuse this roster"
        )
    try:
        trust = advertised.trust
    except ConfigError:
        raise KeyBindingError(
            f"site {site!r} advertised H = {advertised.honest_sites} and D = "
            f"{advertised.max_dropouts}, not 0 <= D < H: refuse this roster"
        ) from None
    try:
        noise_share_bytes(advertised.noise_share)
    except ConfigError:
        raise KeyBindingError(
            f"site {site!r} advertised a noise share of {advertised.noise_share!r}, not a finite "
            "number >= 0: refuse this roster"
        ) from None
    message = _signed_bytes(
        round_id,
        site,
        advertised.mask_public,
        advertised.share_public,
        advertised.seed_commitment,
        advertised.noise_share,
        trust,
    )
    try:
        public.verify(advertised.signature, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise KeyBindingError(
            f"the round keys advertised for site {site!r} (run {round_id.run_id!r}, round "
            f"{round_id.server_round}) do not verify against its registered identity key: they "
            "were substituted on the way; abort the round and share nothing with this roster"
        ) from None


def pairwise_key(
    private: X25519PrivateKey,
    peer_public: bytes,
    *,
    purpose: str,
    round_id: RoundId,
    site: str,
    peer: str,
) -> bytes:
    """HKDF-SHA256 over the X25519 secret of ``site`` (holding ``private``) and ``peer``.

    Gives 32 bytes, the same at both ends (and to whoever reconstructs either private key).

    ``info`` frames the purpose, run id, round and the two site ids sorted; the salt is empty
    (RFC 5869 allows it: the X25519 output is already a uniformly keyed secret, and the
    ``info`` separates every use).

    Raises:
        KeyBindingError: The peer key is malformed or of low order (all-zero shared secret).
        ConfigError: The two site ids are equal.
    """
    if site == peer:
        raise ConfigError(f"pairwise_key needs two different sites, got {site!r} twice")
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:
        raise KeyBindingError(
            f"the {purpose} public key of site {peer!r} is malformed or of low order: refuse it"
        ) from None
    low, high = sorted((site, peer))
    info = frame(DOMAIN, purpose, round_id.run_id, round_id.server_round, low, high)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)
