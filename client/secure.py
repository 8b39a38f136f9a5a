"""A site's part in a secure-aggregation round (docs/design.md §3.3): six messages, one charge.

The coordinator drives six exchanges per round (``server.strategy.secure``); each arrives as a
``train`` message with its own action (``prism_runtime.protocol.SECURE_STAGES``). The ClientApp
resolves the message's context once (``SecureStage.resolve``: the site, the round number and
nonce, the round id, the site's noise) and hands it to the stage of that action, which answers
it:

1. ``advertise``: the site checks its policy (a refusal is the usual refused reply, charging
   nothing), makes the round's ``prism_runtime.secure_sum.SiteRound`` (fresh X25519 key pairs and
   self-mask seed) and returns its public keys, its noise share and its H and D signed with its
   IDENTITY key (``identity_key``: ECDSA P-256, made once in its state folder, never sent);
2. ``share``: it refuses a roster or threshold that fails its threshold condition
   (``prism_runtime.secure_sum.RoundTrust``), checks the Merkle proof of the advertisements it
   receives (every site's, or its neighbourhood's under a sparse graph: the roster is committed
   by its ids and root, ``prism_runtime.secure_sum.roster``), verifies each against the PINNED
   identity keys of its peers (``registered_keys``; a key the coordinator substituted, or a site
   it invented anywhere in the roster, fails here), and returns Shamir shares of its secrets
   sealed for each peer;
3. ``mask``: it opens the shares sealed for it and checks the participants (at most D roster
   sites missing) and the stated largest noise share (at least its own, at most its whole
   noise), then runs the round
   itself: the site's one admission (``client.site.Site.admit``: request and policy checks, the
   charge at the noise the sum carries if H sites are honest and at most D missing), and the
   secure ending (``client.masked_input``: one clipped sum, randomized rounding with a Skellam
   share of the noise, the masks); the reply carries the accounting facts and the masked vector,
   never anything a coordinator could read alone;
4. ``consistency``: it signs the exact participant and survivor sets it was given (once);
5. ``sample``: the coordinator commits to the survivors' signatures it forwards (a Merkle root);
   the site draws which it checks (all of them, or under a sparse graph a random sample,
   ``prism_runtime.secure_sum.views``), durably, and sends its draw;
6. ``unmask``: it reveals the shares that remove the masks of the sum, only for exactly the sets
   it signed and only when the signatures it drew match the root and, from its pinned peers,
   verify on them (at least t; every drawn one under a sparse graph).

Between messages the round's secrets live in ``context.state`` (the SuperNode's memory on the
site's own machine, or the simulation's), never on disk and never in a message; what the site
decided once (which masks, the threshold it shared with, whom it masked with, the one view it
signed and so what it reveals) is written to its
durable record (``client.secure_record``) before each reply leaves, and read back before each
stage: a re-sent request after a crash or a lost state is answered with a refusal, never
decided twice. The state of a finished or replaced round is dropped. Any failure is a coded
error reply (``client.app``; a secure stage's refusals carry the codes of
``prism_runtime.protocol.SECURE_ERRORS``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from client.masked_input import MaskedInput, masked_input
from client.policy import SitePolicy
from client.reply import RoundReply, facts_record, refuse
from client.request import valid_round
from client.secure_record import SecureRecord
from client.site import SecureNoise, Site
from prism_core.distributed import FIELD_BITS, coordinate_bound
from prism_runtime.durable import atomic_write, make_dirs
from prism_runtime.errors import ConfigError
from prism_runtime.facts import ReplyFacts
from prism_runtime.identity import IDENTITY_KEY, IDENTITY_PUBLIC
from prism_runtime.protocol import (
    ACCOUNTING,
    ARRAYS,
    CONFIG,
    ROUND_NONCE,
    SERVER_ROUND,
    SITE_ID,
)
from prism_runtime.secure_sum import (
    KeyBindingError,
    MasksUsedError,
    RoundId,
    SiteRound,
    ThresholdError,
    check_sum_fits,
)
from prism_runtime.secure_sum.messages import (
    decode_advertise_request,
    decode_consistency_request,
    decode_mask_request,
    decode_sample_request,
    decode_share_request,
    decode_unmask_request,
    encode_advertise_reply,
    encode_consistency_reply,
    encode_mask_reply,
    encode_sample_reply,
    encode_share_reply,
    encode_unmask_reply,
)
from prism_runtime.secure_sum.wire import RECORD

__all__ = [
    "STATE",
    "SecureStage",
    "advertise",
    "consistency",
    "identity_key",
    "mask",
    "registered_keys",
    "sample",
    "share",
    "unmask",
]

log = logging.getLogger(__name__)

STATE = "prism-secure-sum"
"""The ``context.state`` record holding the current round's ``SiteRound`` (its secrets)."""


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


def _writable_by_others(path: Path) -> bool:
    return bool(path.stat().st_mode & 0o022)


def registered_keys(policy: SitePolicy) -> dict[str, ec.EllipticCurvePublicKey]:
    """The pinned identity keys of the federation's sites, by site id.

    Deployed: ``<secure-peers>/<site-id>.pem``, the folder the site's operator installed from
    the federation's registry (never sent by the coordinator); a folder or key file that group
    or others may write is refused, since whoever can write it could pin a site of their own.
    Simulated: the sibling state folders' ``IDENTITY_PUBLIC`` (the simulated sites and the
    coordinator share one machine and one operator).

    Raises:
        KeyBindingError: the peers folder, or a pinned key in it, is writable by group or others.
    """
    keys: dict[str, ec.EllipticCurvePublicKey] = {}
    if policy.secure_peers is not None:
        folder = policy.secure_peers
        files = {p.stem: p for p in sorted(folder.glob("*.pem"))}
        loose = [p for p in (folder, *files.values()) if _writable_by_others(p)]
        if loose:
            raise KeyBindingError(
                f"the pinned identity keys in {folder} (secure-peers) can be written by group or "
                f"others ({', '.join(p.name for p in loose)}): whoever can write there can pin "
                "a site of their own. Run `chmod go-w` on the folder and its files (the "
                "coordinator must never be able to write it); nothing shared"
            )
    else:
        root = policy.state_dir.parent
        files = {p.parent.name: p for p in sorted(root.glob(f"*/{IDENTITY_PUBLIC}"))}
    for site, path in files.items():
        key = _public_key(path)
        if key is not None:
            keys[site] = key
    return keys


@dataclass(frozen=True)
class SecureStage:
    """One message of a site's secure round with its context, resolved once (``resolve``).

    The round id (``round_id``) and the site's secure noise (``noise``) are resolved when a stage
    first reads them: a site refusing the run answers ``advertise`` with its refusal whatever
    else the message holds.

    Attributes:
        site: the site (``client.site.get_site``).
        server_round: the message's round number, checked.
        nonce: the message's round nonce, echoed in a reply that carries facts.
        content: the message's records.
        context: the node's Flower context; its ``state`` keeps the round's ``SiteRound``
            between messages.
    """

    site: Site
    server_round: int
    nonce: str
    content: RecordDict
    context: Context

    @classmethod
    def resolve(
        cls, content: RecordDict, context: Context, *, open_site: Callable[[], Site]
    ) -> SecureStage:
        """The stage of the message ``content``; the site is opened (``open_site``) only once
        the round number is checked.

        Raises:
            ConfigError: the message carries no valid round number.
        """
        config = cast(ConfigRecord, content[CONFIG])
        server_round = config.get(SERVER_ROUND)
        if not valid_round(server_round):
            raise ConfigError("the secure-aggregation message carries no valid round number")
        return cls(open_site(), server_round, str(config.get(ROUND_NONCE, "")), content, context)

    @functools.cached_property
    def round_id(self) -> RoundId:
        """The coordinator's run id and the round, which the round's keys and shares are bound to.

        Raises:
            ConfigError: the message names no run id of at most 256 characters.
        """
        run_id = cast(ConfigRecord, self.content[CONFIG]).get("run-id", "")
        if not isinstance(run_id, str) or not 0 < len(run_id) <= 256:
            raise ConfigError("the secure-aggregation message names no run id of at most 256 chars")
        return RoundId(run_id, self.server_round)

    @property
    def noise(self) -> SecureNoise:
        """The site's secure noise for this run (H, its share, the vector's length).

        Raises:
            ConfigError: the site takes no part in secure aggregation for this run.
        """
        if self.site.secure is None:
            raise ConfigError("this site takes no part in secure aggregation for this run")
        return self.site.secure

    def secure_part(self) -> RecordDict:
        """The message's secure-sum record, alone (what its codec checks)."""
        record = self.content.get(RECORD)
        if not isinstance(record, ConfigRecord):
            raise ConfigError("the secure-aggregation message carries no secure-sum record")
        return RecordDict({RECORD: record})

    @property
    def record(self) -> SecureRecord:
        """The site's durable record of its current round's decisions."""
        return SecureRecord(self.site.policy.state_dir)

    def load_round(self) -> SiteRound:
        """This round's ``SiteRound`` from ``context.state``, with the site's durable record of
        what it decided taken in (``SiteRound.recall``).

        Raises:
            MasksUsedError: none is kept for this round (the site restarted, or the coordinator
                skipped a stage), or the kept one is older than the durable record: the site
                cannot take part any more this round.
        """
        record = self.context.state.get(STATE)
        blob = record.get("round") if isinstance(record, ConfigRecord) else None
        if isinstance(blob, bytes):
            kept = SiteRound.from_bytes(blob)
            if kept.round_id == self.round_id:
                kept.recall(self.record.load())
                return kept
        raise MasksUsedError(
            f"no secure-sum state of round {self.server_round} at this site (restarted, or a "
            "stage was skipped): it cannot take part in this round any more"
        )

    def keep_round(self, site_round: SiteRound) -> None:
        """Keep ``site_round`` for the round's next message (replacing any earlier round's), its
        decisions durably first (``client.secure_record``): call it before the reply leaves."""
        self.record.keep(site_round.round_id, site_round.decisions())
        self.context.state[STATE] = ConfigRecord({"round": site_round.to_bytes()})

    def drop_round(self) -> None:
        """Forget the round's secrets (after the last message of the round, or an abort)."""
        if STATE in self.context.state:
            del self.context.state[STATE]

    def facts_reply(self, accounting: ReplyFacts) -> RecordDict:
        """A reply carrying the accounting facts ``accounting`` and this message's nonce."""
        return RecordDict({ACCOUNTING: facts_record(accounting, self.nonce)})


def advertise(stage: SecureStage) -> RecordDict:
    """Stage 1: the policy's refusal, or a fresh ``SiteRound`` and its signed advertisement.

    The request must name the site's own coordinate count and field; the advertisement signs,
    with the round's keys, the site's ``mu / (H - D)`` (the share it needs every honest site to
    add) and its H and D (from which the coordinator picks the threshold). The new round
    replaces the site's durable record, so a state of an earlier round is stale from here on.
    """
    site = stage.site
    refusal = site.admission_refusal(secure=True)
    if refusal is not None:
        refused = refuse(site.facts, site.ledger, stage.server_round, refusal)
        return stage.facts_reply(refused.accounting)
    noise, round_id = stage.noise, stage.round_id
    part = stage.secure_part()
    # The coordinator addresses a node it has not bound yet as node-<id>; the keys are signed
    # with the site's own id, which its peers check against their pinned keys.
    addressee = part[RECORD].get(SITE_ID)
    expected = site.site_id if addressee == site.site_id else f"node-{stage.context.node_id}"
    request = decode_advertise_request(part, round_id=round_id, site_id=expected)
    if request.bits != FIELD_BITS or request.length != noise.dim:
        raise ConfigError(
            f"secure-aggregation request for {request.bits} bits and {request.length} "
            f"coordinates; this site sends {FIELD_BITS} bits and {noise.dim} coordinates "
            "(another model or version)"
        )
    site_round = SiteRound(
        site_id=site.site_id,
        round_id=round_id,
        identity_key=identity_key(site.policy.state_dir, site.policy.secure_identity),
        bits=request.bits,
        noise_share=noise.mu_share,
        trust=noise.trust,
    )
    stage.keep_round(site_round)
    return encode_advertise_reply(site_round.advertised, round_id=round_id)


def share(stage: SecureStage) -> RecordDict:
    """Stage 2: check the threshold, verify the roster against the pinned keys, then the
    sealed shares (``SiteRound.share``), shared once.

    Raises:
        ThresholdError: the roster or threshold fails the site's threshold condition, or the
            masking graph is sparse and the site does not accept one or its bound.
        KeyBindingError: an advertisement does not verify (a substituted key, or a site whose
            key is not pinned here), or the peers folder is writable by others.
        MasksUsedError: the site shared already this round (its kept state is stale).
    """
    site, round_id = stage.site, stage.round_id
    site_round = stage.load_round()
    request = decode_share_request(stage.secure_part(), round_id=round_id, site_id=site.site_id)
    if request.graph is not None and not stage.noise.sparse_graph:
        raise ThresholdError(
            f"a sparse masking graph of degree {request.graph_degree}: this site masks with "
            "every site of a round only (node config secure-graph); nothing shared"
        )
    sealed = site_round.share(
        request.roster,
        registered=registered_keys(site.policy),
        threshold=request.threshold,
        graph=request.graph,
    )
    stage.keep_round(site_round)
    return encode_share_reply(sealed, round_id=round_id, site_id=site.site_id)


def mask(stage: SecureStage) -> RecordDict:
    """Stage 3: the round itself, answered with its facts and, unless refused, its masked input.

    First the shares sealed for this site and the participants U2, refused before anything is
    charged: a participant set ``SiteRound.check_participants`` refuses (masked already, more
    than D roster sites missing, fewer than t), one the field could not sum
    (``check_sum_fits``), or a stated largest noise share L below its own share or above its
    whole noise (``SiteRound.noise_share``). Then the site's admission (``Site.admit``, a
    secure round) and the secure ending (``client.masked_input``), adding L, bound in the
    transcript every roster site shared under, never less than its own share: each roster
    site's own share ``mu_j / (H_j - D_j)`` is then covered by each honest site whose input a
    sum holds, whatever their sizes and whatever participants the coordinator names to whom.
    The decision to mask is durable before the reply leaves (``SecureStage.keep_round``).

    Raises:
        MasksUsedError: this round's masks were used already (a re-sent request).
        SecureSumAbortedError: fewer participants than t, or more than D roster sites missing.
        NoiseShareError: the stated largest share is below this site's own or above its whole
            noise.
    """
    site, noise, round_id = stage.site, stage.noise, stage.round_id
    site_round = stage.load_round()
    request = decode_mask_request(
        stage.secure_part(),
        round_id=round_id,
        site_id=site.site_id,
        roster=site_round.roster_ids,
        near=site_round.graph.neighbourhood(site.site_id),
    )
    participants = request.participants
    site_round.receive(request.sealed)
    # whatever mask() would refuse is refused now, before the round is charged
    site_round.check_participants(participants)
    largest = site_round.noise_share()  # L: at least its own share, at most its whole noise
    # the sum of every participant's share cannot wrap
    check_sum_fits(sites=len(participants), bound=coordinate_bound(), bits=FIELD_BITS)
    arrays = cast(ArrayRecord, stage.content[ARRAYS]).to_torch_state_dict()
    mu_share = max(largest, noise.mu_share)
    answer: RoundReply | MaskedInput
    with site.admit(stage.server_round, arrays, secure=True) as admitted:
        if isinstance(admitted, RoundReply):  # a refusal: nothing charged
            answer = admitted
        else:
            answer = masked_input(
                site,
                admitted,
                site_round=site_round,
                participants=participants,
                mu_share=mu_share,
            )
    stage.keep_round(site_round)
    reply = stage.facts_reply(answer.accounting)
    if isinstance(answer, MaskedInput):
        sent = encode_mask_reply(
            answer.masked, round_id=round_id, site_id=site.site_id, bits=FIELD_BITS
        )
        reply[RECORD] = sent[RECORD]
    return reply


def consistency(stage: SecureStage) -> RecordDict:
    """Stage 4: the site's signature of its participants and the survivors it is told
    (``SiteRound.sign_view``): one view per round, durable before the reply leaves.

    Raises:
        ConsistencyError: the survivors are not all participants, do not name this site, or
            differ from a survivor set it signed already.
        SecureSumAbortedError: fewer survivors than t, or more than D roster sites missing.
        MasksUsedError: the site has not masked (its kept state is stale or gone).
    """
    site, round_id = stage.site, stage.round_id
    site_round = stage.load_round()
    request = decode_consistency_request(
        stage.secure_part(), round_id=round_id, site_id=site.site_id, roster=site_round.roster_ids
    )
    signature = site_round.sign_view(
        request.survivors,
        identity_key=identity_key(site.policy.state_dir, site.policy.secure_identity),
    )
    stage.keep_round(site_round)
    return encode_consistency_reply(signature, round_id=round_id, site_id=site.site_id)


def sample(stage: SecureStage) -> RecordDict:
    """Stage 5: which of the signatures the coordinator committed to (their root and signers
    arrive with the unmasking request) the site checks: all of them, or under a sparse graph a
    random sample (``SiteRound.draw``, from the OS CSPRNG), drawn once a round and durable
    before the reply leaves, so that a check on a sample is never drawn again.

    Raises:
        ConsistencyError: the request names other sets than the site signed, the signers are
            not survivors or fewer than t, or it drew for another root or signers already.
    """
    site, round_id = stage.site, stage.round_id
    site_round = stage.load_round()
    call = decode_sample_request(
        stage.secure_part(), round_id=round_id, site_id=site.site_id, roster=site_round.roster_ids
    )
    drawn = site_round.draw(call.request, signers=call.signers, root=call.root)
    stage.keep_round(site_round)
    return encode_sample_reply(
        drawn, round_id=round_id, site_id=site.site_id, forwarded=len(call.signers)
    )


def unmask(stage: SecureStage) -> RecordDict:
    """Stage 6: the shares that unmask the sum, only for exactly the view this site signed (its
    durable record holds it) and with the signatures it drew, matching their committed root,
    from survivors it pinned that confirm it (``SiteRound.reveal``: at least t valid, or under a
    sparse graph every drawn one).

    Raises:
        ConsistencyError: the request names other sets than the site signed, the signatures
            are not the drawn ones or do not match their root or do not confirm the view, or
            the site drew none; nothing is revealed.
    """
    site, round_id = stage.site, stage.round_id
    site_round = stage.load_round()
    call = decode_unmask_request(
        stage.secure_part(),
        round_id=round_id,
        site_id=site.site_id,
        roster=site_round.roster_ids,
        drawn=site_round.drawn_signers,
    )
    registered = registered_keys(site.policy)
    response = site_round.reveal(
        call.request, signatures=call.signatures, proof=call.proof, registered=registered
    )
    stage.drop_round()
    return encode_unmask_reply(response, round_id=round_id)
