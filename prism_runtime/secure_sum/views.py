"""The consistency check of a secure-sum round: the participant and survivor sets, signed.

The coordinator routes every message, so it can tell each site different participant
(``U2``: whose shares were relayed, whom a site masks with) and survivor (``U3``: whose masked
inputs arrived) sets. Before any site reveals a share, every survivor signs the exact sets it was
given, ``RoundView``, with its identity key (ECDSA P-256, SHA-256, over the framed run id,
round, signer, both sorted sets and the round's transcript). The coordinator COMMITS to the
signatures it forwards (``SignatureBook``: the root of a Merkle tree over them in signer order,
with the unmasking request); each site draws which of them it checks (``draw_signatures``),
keeps its draw durably and sends it back; the coordinator opens those places, with their
multiproof, and a site reveals its shares only when the opened signatures match the root and,
from distinct survivors whose identity keys it pinned, verify on EXACTLY its own sets
(``check_signatures``: at least t of them; every drawn one when sampled), as in the
ConsistencyCheck round of Bonawitz et al. 2017 (CCS). Why t signatures suffice is ``trust``'s
threshold condition.

The transcript (``round_transcript``) is the digest of the threshold, the graph, the roster's
ids, the Merkle root of every roster site's advertisement (fresh keys, seed commitment, noise
share, H and D: ``roster``) and the largest noise share stated for the roster: it names one run
of the round, so a signature collected in an earlier run of the same round id (a coordinator
that re-runs a round to gather signatures on views of its choice) confirms nothing in a later
one, whose keys are new; and sites that hold one transcript hold the same advertisement of
every roster site, whether or not they ever received it.

With a sparse masking graph a site checks a SAMPLE of the forwarded signatures instead of all
of them (``sample_size``): what the signatures must show is that at least ``needed`` genuine
survivors hold the view, ``(n + c) // 2 + 1`` with ``c = n - H`` for the smallest H a site of
its neighbourhood signed (``RoundTrust.confirmations``: what a site reveals are its
neighbourhood's secrets), so that no two views are both confirmed by sites that each sign one.
If fewer than that are genuine among the ``F`` forwarded, a uniform sample of ``s`` of them,
drawn from the site's CSPRNG after their root arrived (the coordinator cannot change a
committed signature, and one place holds one signer), all verify with probability at most
``C(needed - 1, s) / C(F, s)``; the site draws the least ``s`` that keeps this below
``2^-SECURITY_BITS`` (47 at H = 0.9 n with none missing, whatever n; more the more of the
roster is missing). A drawn signature that fails stops the site (nothing revealed): a
colluding site can so stop a round, as it can with a wrong share, and learns nothing by it.
A site receives ``s`` signatures and about ``s log2(F / s)`` hashes instead of all ``F``.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from prism_runtime.secure_sum._encoding import DOMAIN, frame
from prism_runtime.secure_sum.errors import ConsistencyError
from prism_runtime.secure_sum.graph import SECURITY_BITS
from prism_runtime.secure_sum.keys import AdvertisedKeys, RoundId
from prism_runtime.secure_sum.merkle import LEAF, MerkleTree
from prism_runtime.secure_sum.roster import CommittedRoster

__all__ = [
    "RoundView",
    "SignatureBook",
    "check_signatures",
    "draw_signatures",
    "round_transcript",
    "sample_size",
    "sign_view",
    "signature_leaf",
]


def round_transcript(
    threshold: int,
    roster: Iterable[AdvertisedKeys],
    graph: tuple[int, int] | None = None,
) -> bytes:
    """The transcript of a round over the whole ``roster`` (``roster.transcript_of``: the
    threshold, a sparse masking ``graph``'s degree and neighbourhood threshold, the roster's
    sorted ids, the root of its advertisements and their largest noise share), what each site
    computes from its part of the roster (``roster.RosterPart``)."""
    committed = CommittedRoster({keys.site_id: keys for keys in roster})
    return committed.transcript(threshold, graph)


@dataclass(frozen=True)
class RoundView:
    """The sets a site was given in one round.

    Attributes:
        participants: the sites whose shares were relayed to it and whom it masked with (U2).
        survivors: the participants whose masked inputs arrived (U3); the others dropped.
        transcript: ``round_transcript`` of the run of the round the site shared in.
    """

    participants: frozenset[str]
    survivors: frozenset[str]
    transcript: bytes

    @property
    def dropped(self) -> frozenset[str]:
        """The participants whose masked inputs did not arrive."""
        return self.participants - self.survivors


def _view_bytes(view: RoundView) -> bytes:
    """The framed sets and transcript of ``view``: the part of every signer's signed bytes that
    does not name the signer (framed once, however many signatures are checked on it)."""
    participants, survivors = sorted(view.participants), sorted(view.survivors)
    return frame(len(participants), *participants, len(survivors), *survivors, view.transcript)


def _signed_bytes(
    round_id: RoundId, signer: str, view: RoundView, framed: bytes | None = None
) -> bytes:
    """``frame(DOMAIN, "round-view", run, round, signer, |U2|, *U2, |U3|, *U3, transcript)``
    (``framed``: ``_view_bytes(view)``, if already made; framing concatenates its fields)."""
    head = frame(DOMAIN, "round-view", round_id.run_id, round_id.server_round, signer)
    return head + (_view_bytes(view) if framed is None else framed)


def sign_view(
    view: RoundView,
    *,
    round_id: RoundId,
    site_id: str,
    identity_key: ec.EllipticCurvePrivateKey,
) -> bytes:
    """``site_id``'s DER ECDSA P-256/SHA-256 signature of ``view`` in ``round_id``."""
    message = _signed_bytes(round_id, site_id, view)
    return identity_key.sign(message, ec.ECDSA(hashes.SHA256()))


def sample_size(forwarded: int, needed: int, *, bits: int = SECURITY_BITS) -> int:
    """The least s such that s of ``forwarded`` signatures, drawn uniformly without
    replacement, all verify with probability at most ``2^-bits`` when fewer than ``needed`` of
    the forwarded are genuine (``C(needed - 1, s) / C(forwarded, s)``); ``forwarded`` when no
    smaller s does (then every one is checked)."""
    genuine, log_bound, limit = needed - 1, 0.0, -bits * math.log(2)
    for drawn in range(forwarded):
        if genuine - drawn <= 0:
            return drawn + 1  # more draws than genuine signatures: none passes
        log_bound += math.log((genuine - drawn) / (forwarded - drawn))
        if log_bound <= limit:
            return drawn + 1
    return forwarded


def signature_leaf(signer: str, signature: bytes) -> bytes:
    """The leaf hash of one forwarded signature (``merkle``): its signer and its bytes."""
    return hashlib.sha256(LEAF + frame(DOMAIN, "signature-leaf", signer, signature)).digest()


class SignatureBook:
    """The survivors' signatures as the coordinator forwards them: committed by the root of a
    Merkle tree over them in signer order (``signers``, sorted ids), opened at the places each
    site draws.

    Args:
        signatures: The survivors' signatures of their views, keyed by signer.
    """

    def __init__(self, signatures: Mapping[str, bytes]) -> None:
        self.signatures = dict(signatures)
        self.signers = tuple(sorted(signatures))
        self.tree = MerkleTree([signature_leaf(s, self.signatures[s]) for s in self.signers])
        self.root = self.tree.root

    def open(self, drawn: Sequence[int]) -> tuple[dict[str, bytes], tuple[bytes, ...]]:
        """The signatures at places ``drawn`` (keyed by signer) and their multiproof."""
        chosen = {self.signers[at]: self.signatures[self.signers[at]] for at in drawn}
        return chosen, self.tree.proof(drawn)


def draw_signatures(forwarded: int, needed: int | None) -> tuple[int, ...]:
    """The places (in signer order) of the forwarded signatures a site checks: every one
    without ``needed``, else a uniform ``sample_size(forwarded, needed)`` of them drawn from the
    OS CSPRNG (module docstring), sorted."""
    size = forwarded if needed is None else sample_size(forwarded, needed)
    if size >= forwarded:
        return tuple(range(forwarded))
    return tuple(sorted(secrets.SystemRandom().sample(range(forwarded), size)))


def check_signatures(
    view: RoundView,
    signatures: Mapping[str, bytes],
    *,
    round_id: RoundId,
    registered: Mapping[str, ec.EllipticCurvePublicKey],
    threshold: int,
    sampled: bool,
) -> frozenset[str]:
    """The signers in ``signatures`` (the ones a site drew) whose signature verifies on exactly
    ``view``.

    A signature counts only if its signer is a survivor of ``view`` (a site signs only as a
    survivor) with an identity key in ``registered`` and it verifies on this round, this run of
    it (the transcript) and exactly these two sets. ``sampled``: the signatures are a sample
    drawn from at least ``threshold`` forwarded ones (module docstring), and every one must
    count; otherwise at least ``threshold`` must.

    Raises:
        ConsistencyError: a sampled signature does not count, or fewer than ``threshold`` do:
            the coordinator told other sites other sets (or too few survivors signed, or one
            forwarded a damaged signature); reveal nothing.
    """
    framed = _view_bytes(view)

    def verifies(signer: str) -> bool:
        if signer not in view.survivors or signer not in registered:
            return False
        try:
            registered[signer].verify(
                signatures[signer],
                _signed_bytes(round_id, signer, view, framed),
                ec.ECDSA(hashes.SHA256()),
            )
        except InvalidSignature:
            return False
        return True

    valid = frozenset(signer for signer in sorted(signatures) if verifies(signer))
    if sampled:
        if len(valid) == len(signatures):
            return valid
        raise ConsistencyError(
            f"{len(signatures) - len(valid)} of the {len(signatures)} signatures this site drew "
            f"do not verify on exactly its {len(view.participants)} participants and "
            f"{len(view.survivors)} survivors: other sites were given other sets (or a site "
            "signed falsely); nothing revealed"
        )
    if len(valid) < threshold:
        raise ConsistencyError(
            f"{len(valid)} of {len(signatures)} forwarded signatures verify on exactly this "
            f"site's {len(view.participants)} participants and {len(view.survivors)} survivors, "
            f"and the threshold needs {threshold}: other sites were given other sets; nothing "
            "revealed"
        )
    return valid
