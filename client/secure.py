"""A site's part in a secure-aggregation round (docs/design.md §3.3): four messages, one charge.

The coordinator drives four exchanges per round (``server.strategy.secure``); each arrives as a
``train`` message with its own action (``ACTIONS``) and is answered here:

1. ``secure_advertise``: the site checks its policy (a refusal is the usual refused reply,
   charging nothing), makes the round's ``prism_runtime.secure_sum.SiteRound`` (fresh X25519 key
   pairs and self-mask seed) and returns its public keys signed with its IDENTITY key
   (``identity_key``: ECDSA P-256, made once in its state folder, never sent);
2. ``secure_share``: it verifies every site's advertisement against the PINNED identity keys
   of its peers (``registered_keys``; a key the coordinator substituted fails here), refuses a
   threshold below its own H, and returns Shamir shares of its secrets sealed for each peer;
3. ``secure_mask``: the round itself (``client.site.Site.secure_round``): request and policy
   checks, the charge at the noise the sum carries if H sites are honest, one clipped sum at the
   broadcast point in public tangent coordinates, randomized rounding and a Skellam share of the
   noise (``prism_core.distributed``), then the masks; the reply carries the accounting facts and
   the masked vector, never anything a coordinator could read alone;
4. ``secure_unmask``: it reveals the shares that remove the masks of the sum, and only when at
   least its H masked inputs survived (fewer: the round is aborted with nothing unmasked).

Between messages the round's secrets live in ``context.state`` (the SuperNode's memory on the
site's own machine, or the simulation's), never on disk and never in a message; the state of a
finished or replaced round is dropped. Any failure is a coded error reply (``client.app``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord, Context, RecordDict

from client.policy import SitePolicy
from prism_core.distributed import FIELD_BITS
from prism_runtime.durable import atomic_write, make_dirs
from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum import RoundId, SecureSumAbortedError, SiteRound
from prism_runtime.secure_sum.messages import (
    decode_advertise_request,
    decode_mask_request,
    decode_share_request,
    decode_unmask_request,
    encode_advertise_reply,
    encode_share_reply,
    encode_unmask_reply,
)
from prism_runtime.secure_sum.wire import RECORD

__all__ = [
    "ACTIONS",
    "IDENTITY_KEY",
    "IDENTITY_PUBLIC",
    "STATE",
    "advertise",
    "identity_key",
    "load_round",
    "registered_keys",
    "secure_part",
    "share",
    "unmask",
]

log = logging.getLogger(__name__)

ACTIONS = ("secure_advertise", "secure_share", "secure_mask", "secure_unmask")
"""The ``train.<action>`` message types of a secure-aggregation round, in order."""
STATE = "prism-secure-sum"
"""The ``context.state`` record holding the current round's ``SiteRound`` (its secrets)."""
IDENTITY_KEY = "secure-identity.pem"
"""The site's identity private key in its state folder (ECDSA P-256, mode 0600)."""
IDENTITY_PUBLIC = "secure-identity.pub"
"""Its public key beside it (PEM): what the federation pins as this site's identity."""


def identity_key(state_dir: Path, path: Path | None = None) -> ec.EllipticCurvePrivateKey:
    """The site's identity key: ``path`` (node config ``secure-identity``, e.g. made by the
    site kit's ``deploy.pki site-key``), else ``<state_dir>/IDENTITY_KEY``, made on first use
    with its public half ``IDENTITY_PUBLIC`` beside it.

    Raises:
        ConfigError: the key file exists but is not a P-256 private key in PEM, or ``path`` is
            given and does not exist.
    """
    if path is not None and not path.exists():
        raise ConfigError(
            f"secure-identity {path} does not exist: create the site's identity key with "
            "`python -m deploy.pki site-key` (site kit: make-site-key.sh) or unset it"
        )
    path = path or state_dir / IDENTITY_KEY
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except ValueError as exc:
            raise ConfigError(
                f"{path}: not a PEM private key ({exc}); restore the site's identity key from "
                "its backup (its public key is pinned at the other sites)"
            ) from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(
            key.curve, ec.SECP256R1
        ):
            raise ConfigError(f"{path}: the identity key must be an ECDSA P-256 private key")
        return key
    make_dirs(state_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    atomic_write(path, lambda f: f.write(private), mode=0o600)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    atomic_write(state_dir / IDENTITY_PUBLIC, lambda f: f.write(public))
    log.info("made the site's secure-aggregation identity key %s", path)
    return key


def _public_key(path: Path) -> ec.EllipticCurvePublicKey | None:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError):
        log.warning("%s: not a PEM public key; that peer cannot take part", path)
        return None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        log.warning("%s: not an ECDSA public key; that peer cannot take part", path)
        return None
    return key


def registered_keys(policy: SitePolicy) -> dict[str, ec.EllipticCurvePublicKey]:
    """The pinned identity keys of the federation's sites, by site id.

    Deployed: ``<secure-peers>/<site-id>.pem``, the folder the site's operator installed from
    the federation's registry (never sent by the coordinator). Simulated: the sibling state
    folders' ``IDENTITY_PUBLIC`` (the simulated sites and the coordinator share one machine).
    """
    keys: dict[str, ec.EllipticCurvePublicKey] = {}
    if policy.secure_peers is not None:
        files = {p.stem: p for p in sorted(policy.secure_peers.glob("*.pem"))}
    else:
        root = policy.state_dir.parent
        files = {p.parent.name: p for p in sorted(root.glob(f"*/{IDENTITY_PUBLIC}"))}
    for site, path in files.items():
        key = _public_key(path)
        if key is not None:
            keys[site] = key
    return keys


def _round_id(config: ConfigRecord, server_round: int) -> RoundId:
    run_id = config.get("run-id", "")
    if not isinstance(run_id, str) or not 0 < len(run_id) <= 256:
        raise ConfigError("the secure-aggregation message names no run id of at most 256 chars")
    return RoundId(run_id, server_round)


def secure_part(content: RecordDict) -> RecordDict:
    """The secure-sum record of a message, alone (what its codec checks)."""
    record = content.get(RECORD)
    if not isinstance(record, ConfigRecord):
        raise ConfigError("the secure-aggregation message carries no secure-sum record")
    return RecordDict({RECORD: record})


def load_round(context: Context, round_id: RoundId) -> SiteRound:
    """This round's ``SiteRound`` from ``context.state``.

    Raises:
        SecureSumAbortedError: none is kept for this round (the site restarted, or the
            coordinator skipped a stage): the site cannot take part any more this round.
    """
    record = context.state.get(STATE)
    blob = record.get("round") if isinstance(record, ConfigRecord) else None
    if isinstance(blob, bytes):
        kept = SiteRound.from_bytes(blob)
        if kept.round_id == round_id:
            return kept
    raise SecureSumAbortedError(
        f"no secure-sum state of round {round_id.server_round} at this site (restarted, or a "
        "stage was skipped): it cannot take part in this round any more"
    )


def keep_round(context: Context, site_round: SiteRound) -> None:
    """Keep ``site_round`` for the round's next message (replacing any earlier round's)."""
    context.state[STATE] = ConfigRecord({"round": site_round.to_bytes()})


def drop_round(context: Context) -> None:
    """Forget the round's secrets (after the last message of the round)."""
    if STATE in context.state:
        del context.state[STATE]


def advertise(
    policy: SitePolicy,
    content: RecordDict,
    context: Context,
    *,
    server_round: int,
    length: int,
    noise_share: float,
) -> RecordDict:
    """Stage 1: a fresh ``SiteRound`` and its signed advertisement (the policy was checked by
    the caller). ``length`` is the site's own coordinate count, which the request must name;
    ``noise_share`` its ``mu / H``, the share it needs every honest site to add (signed with
    its keys)."""
    config = cast(ConfigRecord, content["config"])
    round_id = _round_id(config, server_round)
    part = secure_part(content)
    # The coordinator addresses a node it has not bound yet as node-<id>; the keys are signed
    # with the site's own id, which its peers check against their pinned keys.
    addressee = part[RECORD].get("site-id")
    expected = policy.site_id if addressee == policy.site_id else f"node-{context.node_id}"
    request = decode_advertise_request(part, round_id=round_id, site_id=expected)
    if request.bits != FIELD_BITS or request.length != length:
        raise ConfigError(
            f"secure-aggregation request for {request.bits} bits and {request.length} "
            f"coordinates; this site sends {FIELD_BITS} bits and {length} coordinates (another "
            "model or version)"
        )
    site_round = SiteRound(
        site_id=policy.site_id,
        round_id=round_id,
        identity_key=identity_key(policy.state_dir, policy.secure_identity),
        bits=request.bits,
        noise_share=noise_share,
    )
    keep_round(context, site_round)
    return encode_advertise_reply(site_round.advertised, round_id=round_id)


def share(
    policy: SitePolicy, content: RecordDict, context: Context, *, server_round: int, honest: int
) -> RecordDict:
    """Stage 2: verify the roster against the pinned keys, then the sealed shares.

    Raises:
        SecureSumAbortedError: the threshold is below the site's ``honest`` sites H (a sum of
            fewer masked inputs could be unmasked), so it shares nothing.
        KeyBindingError: an advertisement does not verify (a substituted key).
    """
    config = cast(ConfigRecord, content["config"])
    round_id = _round_id(config, server_round)
    site_round = load_round(context, round_id)
    request = decode_share_request(secure_part(content), round_id=round_id, site_id=policy.site_id)
    if request.threshold < honest:
        drop_round(context)
        raise SecureSumAbortedError(
            f"threshold {request.threshold} is below this site's {honest} honest sites: a sum of "
            "fewer masked inputs could be unmasked; nothing shared"
        )
    sealed = site_round.share(
        request.roster, registered=registered_keys(policy), threshold=request.threshold
    )
    keep_round(context, site_round)
    return encode_share_reply(sealed, round_id=round_id, site_id=policy.site_id)


def receive_shares(
    policy: SitePolicy, content: RecordDict, context: Context, *, server_round: int, honest: int
) -> tuple[SiteRound, frozenset[str]]:
    """Stage 3's first half: the shares sealed for this site and the participants U2.

    Raises:
        SecureSumAbortedError: fewer participants than the site's ``honest`` sites H.
    """
    config = cast(ConfigRecord, content["config"])
    round_id = _round_id(config, server_round)
    site_round = load_round(context, round_id)
    request = decode_mask_request(secure_part(content), round_id=round_id, site_id=policy.site_id)
    if len(request.participants) < honest:
        drop_round(context)
        raise SecureSumAbortedError(
            f"{len(request.participants)} participants, fewer than this site's {honest} honest "
            "sites: nothing charged or sent"
        )
    site_round.receive(request.sealed)
    # whatever mask() would refuse is refused now, before the round is charged
    site_round.check_participants(request.participants)
    return site_round, request.participants


def unmask(
    policy: SitePolicy, content: RecordDict, context: Context, *, server_round: int, honest: int
) -> RecordDict:
    """Stage 4: the shares that unmask the sum, only if at least H masked inputs survived.

    Raises:
        SecureSumAbortedError: fewer survivors than the site's ``honest`` sites H; nothing is
            revealed and the round's secrets are dropped.
    """
    config = cast(ConfigRecord, content["config"])
    round_id = _round_id(config, server_round)
    site_round = load_round(context, round_id)
    request = decode_unmask_request(secure_part(content), round_id=round_id, site_id=policy.site_id)
    if len(request.survivors) < honest:
        drop_round(context)
        raise SecureSumAbortedError(
            f"{len(request.survivors)} masked inputs survived, fewer than this site's {honest} "
            "honest sites: nothing revealed"
        )
    response = site_round.answer(request)
    drop_round(context)
    return encode_unmask_reply(response, round_id=round_id)
