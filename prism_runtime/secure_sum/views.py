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

The transcript (``round_transcript``) is the digest of the threshold and the roster's fresh
keys and seed commitments: it names one run of the round, so a signature collected in an
earlier run of the same round id (a coordinator that re-runs a round to gather signatures on
views of its choice) confirms nothing in a later one, whose keys are new.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from prism_runtime.secure_sum._encoding import DOMAIN, frame
from prism_runtime.secure_sum.errors import ConsistencyError
from prism_runtime.secure_sum.keys import AdvertisedKeys, RoundId

__all__ = ["RoundView", "confirming_signers", "round_transcript", "sign_view"]


def round_transcript(
    threshold: int,
    roster: Iterable[AdvertisedKeys],
    graph: tuple[int, int] | None = None,
) -> bytes:
    """SHA-256 of ``threshold`` and each roster site's id, round keys and seed commitment,
    in id order: what one run of a round shared with (its keys are fresh every run); with a
    sparse masking ``graph`` (degree, neighbourhood threshold), those two as well."""
    fields: list[bytes | str | int] = [DOMAIN, "round-transcript", threshold]
    if graph is not None:
        fields += ["sparse-graph", *graph]
    for keys in sorted(roster, key=lambda k: k.site_id):
        fields += [keys.site_id, keys.mask_public, keys.share_public, keys.seed_commitment]
    return hashlib.sha256(frame(*fields)).digest()


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


def confirming_signers(
    view: RoundView,
    signatures: Mapping[str, bytes],
    *,
    round_id: RoundId,
    registered: Mapping[str, ec.EllipticCurvePublicKey],
    threshold: int,
) -> frozenset[str]:
    """The survivors whose signature in ``signatures`` verifies on exactly ``view``.

    A signature counts only if its signer is a survivor of ``view`` (a site signs only as a
    survivor) with an identity key in ``registered`` and it verifies on this round, this run of
    it (the transcript) and exactly these two sets; the others are ignored.

    Raises:
        ConsistencyError: fewer than ``threshold`` signatures count: the coordinator told other
            sites other sets (or too few survivors signed); reveal nothing.
    """
    valid = []
    framed = _view_bytes(view)
    for signer in sorted(signatures):
        public = registered.get(signer)
        if signer not in view.survivors or public is None:
            continue
        try:
            public.verify(
                signatures[signer],
                _signed_bytes(round_id, signer, view, framed),
                ec.ECDSA(hashes.SHA256()),
            )
        except InvalidSignature:
            continue
        valid.append(signer)
    if len(valid) < threshold:
        raise ConsistencyError(
            f"{len(valid)} of {len(signatures)} forwarded signatures verify on exactly this "
            f"site's {len(view.participants)} participants and {len(view.survivors)} survivors, "
            f"and the threshold needs {threshold}: other sites were given other sets; nothing "
            "revealed"
        )
    return frozenset(valid)
