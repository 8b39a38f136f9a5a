"""The coordinator's side of unmasking: which shares to ask for, and the exact sum mod 2^b.

After the masked inputs of a round arrive, the participants (the sites whose shares were
relayed, ``U2`` in Bonawitz et al. 2017) split in two: the *survivors*, whose masked input
arrived, and the *dropped*. The coordinator asks the survivors for the shares of each survivor's
self-mask seed and of each dropped site's mask private key (``UnmaskRequest``); a site answers
with one kind of share per site, never both (``SiteRound.answer`` enforces it).

``unmask_sum`` then recovers ``sum_{u in survivors} x_u mod 2^b``: it adds the masked inputs
(the pairwise masks between two survivors cancel), subtracts each survivor's self mask
``PRG(s_u)`` and removes the pairwise masks the survivors share with each dropped site d (its
surviving neighbours, with a sparse masking graph: ``O(k d)`` per dropped site), which it derives
from d's reconstructed mask private key and the survivor's public key. ``MaskedSum`` adds each
masked input to one running sum as it arrives, so the coordinator holds one vector of d words. Every
count is checked before any secret is reconstructed: fewer than t masked inputs, t answers or t
shares of a needed secret raise ``SecureSumAbortedError`` and nothing is unmasked. Each
reconstructed secret is checked against what its owner signed: a seed against its commitment, a
private key against its public key (``ShareError`` names the owner if a returned share was wrong).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from prism_runtime.secure_sum.errors import SecureSumAbortedError, SecureSumError, ShareError
from prism_runtime.secure_sum.field import FieldVector, check_field, modulus_mask
from prism_runtime.secure_sum.graph import MaskingGraph
from prism_runtime.secure_sum.keys import (
    KEY_BYTES,
    MASK_PURPOSE,
    AdvertisedKeys,
    RoundId,
    pairwise_key,
    seed_commitment,
)
from prism_runtime.secure_sum.masks import expand_mask, pairwise_sign
from prism_runtime.secure_sum.shamir import check_threshold, combine_secret

__all__ = [
    "MaskedSum",
    "ShareKind",
    "UnmaskRequest",
    "UnmaskResponse",
    "plan_unmask",
    "unmask_sum",
]

log = logging.getLogger(__name__)


class ShareKind(StrEnum):
    """The two secrets of a site that its shares can reveal."""

    SEED = "self-mask seed"
    MASK_KEY = "mask private key"


@dataclass(frozen=True)
class UnmaskRequest:
    """What the coordinator asks every survivor to reveal.

    Attributes:
        survivors: Sites whose masked input arrived: reveal the shares of their self-mask seeds.
        dropped: Participants whose masked input did not arrive: reveal the shares of their mask
            private keys.
    """

    survivors: frozenset[str]
    dropped: frozenset[str]


@dataclass(frozen=True)
class UnmaskResponse:
    """One survivor's answer: the shares it holds, keyed by the site whose secret they share."""

    site_id: str
    seed_shares: Mapping[str, bytes] = field(default_factory=dict)
    key_shares: Mapping[str, bytes] = field(default_factory=dict)


def plan_unmask(
    masked_from: Collection[str], *, participants: Collection[str], threshold: int
) -> UnmaskRequest:
    """The request for a round whose masked inputs came from ``masked_from``.

    Raises:
        SecureSumAbortedError: Fewer than ``threshold`` masked inputs arrived (ask nobody).
        SecureSumError: A masked input came from a site that is not a participant.
    """
    survivors, everyone = frozenset(masked_from), frozenset(participants)
    strangers = sorted(survivors - everyone)
    if strangers:
        raise SecureSumError(
            f"masked inputs came from {strangers}, which are not participants of this round: "
            "drop them (they share no masks with the others)"
        )
    if len(survivors) < threshold:
        raise SecureSumAbortedError(
            f"secure sum aborted: {len(survivors)} masked inputs arrived and the threshold needs "
            f"{threshold}; nothing was unmasked"
        )
    return UnmaskRequest(survivors, everyone - survivors)


def _shares_of(
    owner: str, kind: ShareKind, answered: Mapping[str, UnmaskResponse]
) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for holder, response in answered.items():
        book = response.seed_shares if kind is ShareKind.SEED else response.key_shares
        if owner in book:
            found[holder] = book[owner]
    return found


class MaskedSum:
    """The coordinator's running sum of a round's masked inputs, unmasked at the end.

    Each masked input is added as it arrives (``add``) and can be dropped at once: the
    coordinator holds one vector of ``length`` words whatever the number of sites. ``unmask``
    then removes the survivors' self masks and the pairwise masks of each dropped site with its
    surviving neighbours: ``O(k d)`` per dropped site with a masking graph of degree k.
    """

    def __init__(self, length: int, *, bits: int) -> None:
        self.bits = bits
        self.total = np.zeros(length, dtype=np.uint64)
        self.sites: set[str] = set()

    def add(self, site: str, vector: FieldVector) -> None:
        """Add ``site``'s masked input (once; a vector of the sum's length in the field).

        Raises:
            SecureSumError: A second input of ``site``, or a vector of another length.
        """
        vector = check_field(vector, bits=self.bits, what=f"the masked input of {site!r}")
        if site in self.sites:
            raise SecureSumError(f"a second masked input of {site!r} this round")
        if vector.shape != self.total.shape:
            raise SecureSumError(
                f"masked inputs have different lengths [{vector.shape[0]}, {self.total.shape[0]}]"
            )
        self.total += vector  # wraps mod 2^64; 2^b divides 2^64, so the final reduction is exact
        self.sites.add(site)

    def unmask(
        self,
        responses: Iterable[UnmaskResponse],
        *,
        roster: Mapping[str, AdvertisedKeys],
        participants: Collection[str],
        threshold: int,
        round_id: RoundId,
        graph: MaskingGraph | None = None,
        graph_threshold: int | None = None,
    ) -> FieldVector:
        """The sum mod 2^b of the added sites' plain inputs (``unmask_sum``'s arguments; the
        added sites are the survivors)."""
        holders = sorted(roster)
        check_threshold(threshold, len(holders))
        outside = sorted(set(participants) - set(roster))
        if outside:
            raise SecureSumError(f"participants {outside} are not in the roster of advertised keys")
        request = plan_unmask(self.sites, participants=participants, threshold=threshold)
        if graph is None:
            graph = MaskingGraph.derive(roster, degree=len(holders) - 1, seed=b"")
        split = threshold if graph.complete or graph_threshold is None else graph_threshold
        holders_of = graph.neighbourhood  # the whole roster with the complete graph

        answered: dict[str, UnmaskResponse] = {}
        for response in responses:
            if response.site_id in request.survivors:
                answered[response.site_id] = response
            else:
                log.warning(
                    "ignoring an unmasking answer from %r, not a survivor", response.site_id
                )
        if len(answered) < threshold:
            raise SecureSumAbortedError(
                f"secure sum aborted: {len(answered)} survivors answered the unmasking request "
                f"and the threshold needs {threshold}; nothing was unmasked"
            )
        needed = [(u, ShareKind.SEED) for u in sorted(request.survivors)]
        needed += [(d, ShareKind.MASK_KEY) for d in sorted(request.dropped)]
        found = {(owner, kind): _shares_of(owner, kind, answered) for owner, kind in needed}
        short = [f"{len(s)} for the {k} of {o!r}" for (o, k), s in found.items() if len(s) < split]
        if short:
            raise SecureSumAbortedError(
                f"secure sum aborted: too few shares were returned ({', '.join(short)}) and the "
                f"threshold needs {split} of each; nothing was unmasked"
            )

        n, bits = self.total.shape[0], self.bits
        total = self.total.copy()
        for (owner, kind), shares in found.items():
            what = f"the {kind} of site {owner!r}"
            secret = combine_secret(
                shares,
                threshold=split,
                holders=holders_of(owner),
                secret_bytes=KEY_BYTES,
                what=what,
            )
            if kind is ShareKind.SEED:
                if seed_commitment(secret) != roster[owner].seed_commitment:
                    raise ShareError(
                        f"{what} rebuilt from shares does not match its commitment: a survivor "
                        "returned a wrong share; this round's sum cannot be recovered"
                    )
                total -= expand_mask(secret, n, bits=bits)
                continue
            private = X25519PrivateKey.from_private_bytes(secret)
            if private.public_key().public_bytes_raw() != roster[owner].mask_public:
                raise ShareError(
                    f"{what} rebuilt from shares does not match its public key: a survivor "
                    "returned a wrong share; this round's sum cannot be recovered"
                )
            masked_with = request.survivors & set(holders_of(owner))
            for survivor in sorted(masked_with):
                key = pairwise_key(
                    private,
                    roster[survivor].mask_public,
                    purpose=MASK_PURPOSE,
                    round_id=round_id,
                    site=owner,
                    peer=survivor,
                )
                if pairwise_sign(survivor, owner) > 0:
                    total -= expand_mask(key, n, bits=bits)
                else:
                    total += expand_mask(key, n, bits=bits)
        return total & modulus_mask(bits)


def unmask_sum(
    masked: Mapping[str, FieldVector],
    responses: Iterable[UnmaskResponse],
    *,
    roster: Mapping[str, AdvertisedKeys],
    participants: Collection[str],
    threshold: int,
    bits: int,
    round_id: RoundId,
    graph: MaskingGraph | None = None,
    graph_threshold: int | None = None,
) -> FieldVector:
    """The sum mod 2^b of the survivors' plain inputs.

    Args:
        masked: Masked input per survivor (the sites whose input arrived).
        responses: The survivors' answers to ``plan_unmask``'s request (others are ignored).
        roster: The advertised keys of every site of the round (``U1``).
        participants: The sites whose shares were relayed and who masked with each other (``U2``).
        threshold: t, as the sites used it.
        bits: b.
        round_id: The round (it enters the pairwise key derivation).
        graph: The round's sparse masking graph, if any (``graph``): each site's shares are
            held by its neighbourhood, and a dropped site's masks are removed from its
            neighbours only.
        graph_threshold: The neighbourhood threshold of a sparse ``graph``.

    Returns:
        A new uint64 vector in ``[0, 2^b)``; ``field.centre`` maps it to signed integers.

    Raises:
        SecureSumAbortedError: Fewer than t masked inputs, answers, or shares of a needed secret.
        ShareError: A reconstructed secret does not match its owner's signed commitment.
        SecureSumError: Vectors of different lengths, or sites outside the roster.
    """
    lengths = {np.asarray(v).shape[0] if np.asarray(v).ndim else 0 for v in masked.values()}
    if len(lengths) > 1:
        raise SecureSumError(f"masked inputs have different lengths {sorted(lengths)}")
    running = MaskedSum(lengths.pop() if lengths else 0, bits=bits)
    for site, vector in masked.items():
        running.add(site, vector)
    return running.unmask(
        responses,
        roster=roster,
        participants=participants,
        threshold=threshold,
        round_id=round_id,
        graph=graph,
        graph_threshold=graph_threshold,
    )
