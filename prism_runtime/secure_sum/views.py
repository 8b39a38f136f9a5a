"""The consistency check of a secure-sum round: the participant and survivor sets, signed.

The coordinator routes every message, so it can tell each site different participant
(``U2``: whose shares were relayed, whom a site masks with) and survivor (``U3``: whose masked
inputs arrived) sets. Before any site reveals a share, every survivor signs the exact sets it was
given, ``RoundView``, with its identity key (ECDSA P-256, SHA-256, over the framed run id,
round, signer, both sorted sets and the round's transcript); the coordinator forwards the
signatures with the unmasking request, and a site reveals its shares only when at least t of
them, from distinct survivors whose identity keys it pinned, verify on EXACTLY its own sets
(``confirming_signers``), as in the ConsistencyCheck round of Bonawitz et al. 2017 (CCS). Why
t signatures suffice is ``trust``'s threshold condition.

The transcript (``round_transcript``) is the digest of the threshold, the graph, the roster's
ids, the Merkle root of every roster site's advertisement (fresh keys, seed commitment, noise
share, H and D: ``roster``) and the largest noise share stated for the roster: it names one run
of the round, so a signature collected in an earlier run of the same round id (a coordinator
that re-runs a round to gather signatures on views of its choice) confirms nothing in a later
one, whose keys are new; and sites that hold one transcript hold the same advertisement of
every roster site, whether or not they ever received it.

With a sparse masking graph a site checks a SAMPLE of the forwarded signatures instead of all
of them (``sample_size``): what the signatures must show is that at least ``needed`` genuine
survivors hold the view, ``(n + c) // 2 + 1`` with ``c = n - H`` for the smallest H any roster
site signed (``RoundTrust.confirmations``: what a site reveals are its neighbours' secrets), so
that no two views are both confirmed by sites that each sign one. If fewer than that are
genuine among the ``F`` forwarded, a uniform sample of ``s`` of them, drawn from the site's
CSPRNG after the signatures arrived, all verify with probability at most
``C(needed - 1, s) / C(F, s)``; the site draws the least ``s`` that keeps this below
``2^-SECURITY_BITS`` (47 at H = 0.9 n with none missing, whatever n; more the more of the
roster is missing), and if a drawn signature fails it
verifies every one and counts, exactly as without a sample.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from prism_runtime.secure_sum._encoding import DOMAIN, frame
from prism_runtime.secure_sum.errors import ConsistencyError
from prism_runtime.secure_sum.graph import SECURITY_BITS
from prism_runtime.secure_sum.keys import AdvertisedKeys, RoundId
from prism_runtime.secure_sum.roster import CommittedRoster

__all__ = ["RoundView", "confirming_signers", "round_transcript", "sample_size", "sign_view"]


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


def confirming_signers(
    view: RoundView,
    signatures: Mapping[str, bytes],
    *,
    round_id: RoundId,
    registered: Mapping[str, ec.EllipticCurvePublicKey],
    threshold: int,
    needed: int | None = None,
) -> frozenset[str]:
    """The survivors whose signature in ``signatures`` was checked and verifies on exactly
    ``view``.

    A signature counts only if its signer is a survivor of ``view`` (a site signs only as a
    survivor) with an identity key in ``registered`` and it verifies on this round, this run of
    it (the transcript) and exactly these two sets; the others are ignored. With ``needed``
    (a sparse graph's sites: the genuine signers the view must have, module docstring) and at
    least ``threshold`` such signers forwarded, a ``sample_size`` sample of them drawn from the
    OS CSPRNG is checked and returned if every one verifies; otherwise, and without
    ``needed``, every signature is checked.

    Raises:
        ConsistencyError: fewer than ``threshold`` signatures count: the coordinator told other
            sites other sets (or too few survivors signed); reveal nothing.
    """
    framed = _view_bytes(view)
    candidates = [
        signer for signer in sorted(signatures) if signer in view.survivors and signer in registered
    ]

    def verifies(signer: str) -> bool:
        try:
            registered[signer].verify(
                signatures[signer],
                _signed_bytes(round_id, signer, view, framed),
                ec.ECDSA(hashes.SHA256()),
            )
        except InvalidSignature:
            return False
        return True

    if needed is not None and len(candidates) >= threshold:
        size = sample_size(len(candidates), needed)
        if size < len(candidates):
            drawn = secrets.SystemRandom().sample(candidates, size)
            if all(verifies(signer) for signer in drawn):
                return frozenset(drawn)
            # a forged or damaged signature was forwarded: count every one, as without a sample
    valid = [signer for signer in candidates if verifies(signer)]
    if len(valid) < threshold:
        raise ConsistencyError(
            f"{len(valid)} of {len(signatures)} forwarded signatures verify on exactly this "
            f"site's {len(view.participants)} participants and {len(view.survivors)} survivors, "
            f"and the threshold needs {threshold}: other sites were given other sets; nothing "
            "revealed"
        )
    return frozenset(valid)
