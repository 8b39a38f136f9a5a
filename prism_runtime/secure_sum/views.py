"""The consistency check of a secure-sum round: the participant and survivor sets, signed.

The coordinator routes every message, so it can tell each site different participant
(``U2``: whose shares were relayed, whom a site masks with) and survivor (``U3``: whose masked
inputs arrived) sets. Before any site reveals a share, every survivor signs the exact sets it was
given, ``RoundView``, with its identity key (ECDSA P-256, SHA-256, over the framed run id, round,
signer and both sorted sets); the coordinator forwards the signatures with the unmasking
request, and a site reveals its shares only when at least t of them, from distinct survivors
whose identity keys it pinned, verify on EXACTLY its own sets (``confirming_signers``), as in
the ConsistencyCheck round of Bonawitz et al. 2017 (CCS). Why t signatures suffice is
``trust``'s threshold condition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from prism_runtime.secure_sum._encoding import DOMAIN, frame
from prism_runtime.secure_sum.errors import ConsistencyError
from prism_runtime.secure_sum.keys import RoundId

__all__ = ["RoundView", "confirming_signers", "sign_view"]


@dataclass(frozen=True)
class RoundView:
    """The sets a site was given in one round.

    Attributes:
        participants: the sites whose shares were relayed to it and whom it masked with (U2).
        survivors: the participants whose masked inputs arrived (U3); the others dropped.
    """

    participants: frozenset[str]
    survivors: frozenset[str]

    @property
    def dropped(self) -> frozenset[str]:
        """The participants whose masked inputs did not arrive."""
        return self.participants - self.survivors


def _signed_bytes(round_id: RoundId, signer: str, view: RoundView) -> bytes:
    participants, survivors = sorted(view.participants), sorted(view.survivors)
    return frame(
        DOMAIN,
        "round-view",
        round_id.run_id,
        round_id.server_round,
        signer,
        len(participants),
        *participants,
        len(survivors),
        *survivors,
    )


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
    survivor) with an identity key in ``registered`` and it verifies on this round and exactly
    these two sets; the others are ignored.

    Raises:
        ConsistencyError: fewer than ``threshold`` signatures count: the coordinator told other
            sites other sets (or too few survivors signed); reveal nothing.
    """
    valid = []
    for signer in sorted(signatures):
        public = registered.get(signer)
        if signer not in view.survivors or public is None:
            continue
        try:
            public.verify(
                signatures[signer],
                _signed_bytes(round_id, signer, view),
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
