"""A site's part in one round of the secure sum: its secrets, the shares it holds, its answers.

``SiteRound`` holds everything a site must keep for one round and nothing longer: two fresh
X25519 key pairs and a fresh 32-byte self-mask seed (``secrets``), and the site's H and D
(``trust.RoundTrust``). In order, a site

1. publishes ``advertised`` (its public keys, seed commitment, noise share, H and D, signed with
   its identity key);
2. ``share``: refuses a roster or threshold that does not meet its threshold condition
   (``ThresholdError``) or names an unregistered site, rebuilds the root of the roster's
   advertisements from its part of it (``roster.RosterPart``), verifies the advertisement of
   every site whose keys it uses (every roster site's with the complete graph, its neighbours'
   with a sparse one, ``graph``) against the registered identity keys (``KeyBindingError`` names
   a substituted site; the others it never receives are bound by the root in the round's
   transcript), splits its seed and mask private key with threshold t among the roster (with a
   sparse graph: with the neighbourhood threshold among its neighbourhood, after checking the
   graph against its own bound) and seals each receiver's two shares for the round's
   transcript (``envelope``);
3. ``receive``: opens the shares the other sites sealed for it (``ShareError`` if one fails);
4. ``mask``: masks its ONE input of the round with its self mask and a pairwise mask per
   participant (per participating neighbour), refusing more than D missing roster sites;
5. ``sign_view``: signs the participant and survivor sets it was given (``views``), once;
6. ``draw``: for an unmasking request of exactly its signed sets, draws which of the committed
   signatures it checks (all, or a random sample with a sparse graph, ``views``), once;
7. ``reveal``: with the drawn signatures opened against their root and confirming its view (t
   valid, or every drawn one with a sparse graph), reveals the seed shares of the survivors and
   the mask-key shares of the dropped (``answer``: both in one process).

The rules that keep a masked input private are enforced here: a site never masks twice, never
signs two views, and reveals shares only for the one view it signed (so never both the seed
share and the mask-key share of one site), confirmed by the signatures of survivors it drew.
What it decided once (``decisions``) is the site's to keep durably before each reply leaves;
``recall`` restores it into a ``SiteRound`` whose in-memory state is older.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from prism_runtime.secure_sum._encoding import DOMAIN, frame
from prism_runtime.secure_sum.envelope import SharePair, open_shares, seal_shares
from prism_runtime.secure_sum.errors import (
    ConsistencyError,
    KeyBindingError,
    MasksUsedError,
    NoiseShareError,
    SecureSumAbortedError,
    SecureSumError,
    ShareError,
)
from prism_runtime.secure_sum.field import FieldVector, check_bits
from prism_runtime.secure_sum.graph import MaskingGraph
from prism_runtime.secure_sum.keys import (
    KEY_BYTES,
    MASK_PURPOSE,
    SHARE_PURPOSE,
    AdvertisedKeys,
    RoundId,
    pairwise_key,
    seed_commitment,
    sign_keys,
    verify_keys,
)
from prism_runtime.secure_sum.masks import mask_input
from prism_runtime.secure_sum.merkle import HASH_BYTES, root_of
from prism_runtime.secure_sum.roster import RosterPart, graph_seed, transcript_of
from prism_runtime.secure_sum.shamir import check_threshold, split_secret
from prism_runtime.secure_sum.trust import RoundTrust
from prism_runtime.secure_sum.unmask import UnmaskRequest, UnmaskResponse
from prism_runtime.secure_sum.views import (
    RoundView,
    SignatureBook,
    check_signatures,
    draw_signatures,
    sign_view,
    signature_leaf,
)

__all__ = ["NOISE_SHARE_SLACK", "RoundDecisions", "SignatureDraw", "SiteRound", "share_too_large"]

NOISE_SHARE_SLACK = 1e-9
"""Relative slack on the largest noise share a site accepts (its whole noise ``mu``): the float
rounding of ``(mu / (H - D)) (H - D)``, far below any share a site could need more."""


def share_too_large(largest: float, keys: AdvertisedKeys) -> bool:
    """Whether a site that advertised ``keys`` refuses to add the roster's ``largest`` noise
    share: it exceeds the site's whole noise, ``(H - D)`` times its own share (with
    ``NOISE_SHARE_SLACK``). The one rule of ``SiteRound.noise_share``; the coordinator applies it
    to the advertisements it holds to stop a round every such site would refuse."""
    return largest > keys.noise_share * keys.trust.share_divisor * (1 + NOISE_SHARE_SLACK)


@dataclass(frozen=True)
class SignatureDraw:
    """The forwarded signatures a site drew to check: the root they were committed under, the
    signers (sorted) and the places drawn among them."""

    root: bytes
    signers: tuple[str, ...]
    drawn: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        """The draw as JSON values (``from_json`` reads it back)."""
        return {"root": self.root.hex(), "signers": list(self.signers), "drawn": list(self.drawn)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> SignatureDraw:
        """The draw ``to_json`` wrote (``ValueError``, ``KeyError`` or ``TypeError`` if not)."""
        signers = tuple(str(s) for s in value["signers"])
        places = value["drawn"]
        if any(isinstance(at, bool) or not isinstance(at, int) for at in places):
            raise TypeError("drawn")
        drawn = tuple(places)
        increasing = all(a < b for a, b in pairwise(drawn))
        if not drawn or not increasing or not 0 <= drawn[0] <= drawn[-1] < len(signers):
            raise ValueError("drawn")
        if any(a >= b for a, b in pairwise(signers)):
            raise ValueError("signers")
        root = bytes.fromhex(value["root"])
        if len(root) != HASH_BYTES:
            raise ValueError("root")
        return cls(root, signers, drawn)


@dataclass(frozen=True)
class RoundDecisions:
    """What a site decided once in a round, for its durable record (``SiteRound.decisions``).

    Attributes:
        masks: the identity of the round's masks (``SiteRound.masks_id``).
        threshold: the threshold it split its secrets with; None: not shared yet.
        participants: the participants it masked its input with; None: not masked yet.
        survivors: the survivor set it signed (and the only one it reveals shares for);
            None: none signed yet.
        draw: the forwarded signatures it drew to check (``SignatureDraw``): one draw per
            round, so that a check on a sample is never drawn again; None: none drawn yet.
    """

    masks: str
    threshold: int | None
    participants: frozenset[str] | None
    survivors: frozenset[str] | None
    draw: SignatureDraw | None = None

    def to_json(self) -> dict[str, Any]:
        """The decisions as JSON values (``from_json`` reads them back)."""
        return {
            "masks": self.masks,
            "threshold": self.threshold,
            "participants": None if self.participants is None else sorted(self.participants),
            "survivors": None if self.survivors is None else sorted(self.survivors),
            "draw": None if self.draw is None else self.draw.to_json(),
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> RoundDecisions:
        """The decisions ``to_json`` wrote.

        Raises:
            SecureSumError: ``value`` is not such a record.
        """
        try:
            participants, survivors = value["participants"], value["survivors"]
            threshold = value["threshold"]
            if threshold is not None and (isinstance(threshold, bool) or threshold < 1):
                raise ValueError("threshold")
            draw = value.get("draw")
            return cls(
                masks=str(value["masks"]),
                threshold=None if threshold is None else int(threshold),
                participants=None if participants is None else frozenset(map(str, participants)),
                survivors=None if survivors is None else frozenset(map(str, survivors)),
                draw=None if draw is None else SignatureDraw.from_json(draw),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SecureSumError(f"not a secure-sum decision record ({exc})") from None


class SiteRound:
    """One site's secrets and share book for one round (make a new one every round)."""

    def __init__(
        self,
        *,
        site_id: str,
        round_id: RoundId,
        identity_key: ec.EllipticCurvePrivateKey,
        bits: int,
        noise_share: float,
        trust: RoundTrust,
    ) -> None:
        check_bits(bits)
        self.site_id = site_id
        self.round_id = round_id
        self.bits = bits
        self.trust = trust
        self._mask_key = X25519PrivateKey.generate()
        self._share_key = X25519PrivateKey.generate()
        self._seed = secrets.token_bytes(KEY_BYTES)
        self._advertised = sign_keys(
            round_id=round_id,
            site_id=site_id,
            mask_public=self._mask_key.public_key().public_bytes_raw(),
            share_public=self._share_key.public_key().public_bytes_raw(),
            commitment=seed_commitment(self._seed),
            identity_key=identity_key,
            noise_share=noise_share,
            trust=trust,
        )
        self._ids: tuple[str, ...] = ()  # the roster's ids, sorted
        self._roster: dict[str, AdvertisedKeys] = {}  # the neighbourhood's advertisements
        self._digest = b""  # roster.roster_digest of the ids and the advertisements' root
        self._largest = 0.0  # L, the roster's stated largest noise share
        self._threshold = 0
        self._sparse: tuple[int, int] | None = None  # (degree, neighbourhood threshold)
        self._graph: MaskingGraph | None = None
        self._transcript: bytes | None = None
        self._held: dict[str, SharePair] = {}
        self._participants: frozenset[str] = frozenset()
        self._survivors: frozenset[str] | None = None
        self._draw: SignatureDraw | None = None

    @property
    def advertised(self) -> AdvertisedKeys:
        """This site's signed public keys and seed commitment for the round, to publish."""
        return self._advertised

    @property
    def masks_id(self) -> str:
        """The identity of this round's masks: SHA-256 (hex) of the framed mask public key,
        share public key and seed commitment, fresh in every ``SiteRound``."""
        a = self._advertised
        digest = hashlib.sha256(
            frame(DOMAIN, "masks", a.mask_public, a.share_public, a.seed_commitment)
        )
        return digest.hexdigest()

    def share(
        self,
        roster: Mapping[str, AdvertisedKeys] | RosterPart,
        *,
        registered: Mapping[str, ec.EllipticCurvePublicKey],
        threshold: int,
        graph: tuple[int, int] | None = None,
    ) -> dict[str, bytes]:
        """Check the threshold, verify the roster, split this site's secrets among it (or among
        its neighbourhood of a sparse masking graph) and seal each receiver's shares.

        Args:
            roster: This site's part of the roster (``roster.RosterPart``: the sorted ids of
                ``U1``, the largest noise share stated for it, and the advertisements of this
                site's neighbourhood with their Merkle proof), or the whole roster (every
                site's advertisement keyed by site id), as relayed by the coordinator.
            registered: The identity public key of each registered site id.
            threshold: t; this site's threshold condition must accept it for the roster's size.
            graph: A sparse masking graph's degree k and neighbourhood threshold (``graph``),
                which this site must accept (``RoundTrust.check_graph``); None, or a degree of
                ``n - 1`` and above: the complete graph.

        Returns:
            The sealed shares for each other holder of this site's shares, keyed by receiver.

        Raises:
            MasksUsedError: This site shared already this round.
            ThresholdError: The roster is smaller than H, t fails the threshold condition, or
                the graph breaks this site's guarantee with too high a probability.
            KeyBindingError: The roster names a site with no registered identity key; an
                advertisement it received does not verify or is malformed (names the site); the
                advertisements received are not all of this site's neighbourhood, or their proof
                does not fit them; or the roster does not carry this site's own keys unchanged.
        """
        if self._ids:
            raise MasksUsedError(f"site {self.site_id!r} already shared its secrets this round")
        part = roster if isinstance(roster, RosterPart) else RosterPart.whole(roster)
        n = len(part.ids)
        strangers = [site for site in part.ids if site not in registered]
        if strangers:
            raise KeyBindingError(
                f"site {strangers[0]!r} is in the roster but has no registered identity key "
                f"({len(strangers)} such sites): refuse this roster (register a site's key before "
                "it joins a secure sum)"
            )
        self.trust.check_threshold(threshold, n)
        if graph is not None and graph[0] >= n - 1:
            graph = None
        if graph is not None:
            self.trust.check_graph(n, degree=graph[0], threshold=graph[1])
        if part.leaves.get(self.site_id) != self._advertised:
            raise KeyBindingError(
                f"the roster does not carry the keys site {self.site_id!r} advertised: they were "
                "substituted or left out; abort the round"
            )
        check_threshold(threshold, n)
        digest = part.digest  # the ids sorted, every leaf in place, the proof fits
        degree = n - 1 if graph is None else graph[0]
        seed = graph_seed(threshold, graph, digest)
        masking = MaskingGraph.derive(part.ids, degree=degree, seed=seed)
        holders = masking.neighbourhood(self.site_id)
        missing = [site for site in holders if site not in part.leaves]
        if missing:
            raise KeyBindingError(
                f"the roster lacks the advertisements of {len(missing)} sites of site "
                f"{self.site_id!r}'s neighbourhood (e.g. {missing[0]!r}): abort the round"
            )
        for site in holders:  # the keys this site uses: every site's with the complete graph
            verify_keys(part.leaves[site], round_id=self.round_id, registered=registered)
        self._ids = part.ids
        self._roster = {site: part.leaves[site] for site in holders}
        self._digest, self._largest = digest, part.largest_share
        self._threshold = threshold
        self._sparse = graph
        self._graph = masking
        transcript = self.transcript
        split = self._share_threshold
        seeds = split_secret(self._seed, threshold=split, holders=holders)
        keys = split_secret(self._mask_key.private_bytes_raw(), threshold=split, holders=holders)
        sealed: dict[str, bytes] = {}
        for peer in holders:
            pair = SharePair(seeds[peer], keys[peer])
            if peer == self.site_id:
                self._held[peer] = pair
                continue
            key = self._pairwise(self._roster[peer], SHARE_PURPOSE)
            sealed[peer] = seal_shares(
                key,
                pair,
                sender=self.site_id,
                receiver=peer,
                round_id=self.round_id,
                transcript=transcript,
            )
        return sealed

    @property
    def roster_ids(self) -> tuple[str, ...]:
        """The sorted site ids of the roster this site shared with (what the participant and
        survivor sets of its messages are bitmaps over)."""
        if not self._ids:
            raise SecureSumError(f"site {self.site_id!r} has no verified roster this round")
        return self._ids

    @property
    def graph(self) -> MaskingGraph:
        """The round's masking graph, derived from the roster and transcript it shared with."""
        if not self._ids:
            raise SecureSumError(f"site {self.site_id!r} has no verified roster this round")
        if self._graph is None:
            degree = len(self._ids) - 1 if self._sparse is None else self._sparse[0]
            seed = graph_seed(self._threshold, self._sparse, self._digest)
            self._graph = MaskingGraph.derive(self._ids, degree=degree, seed=seed)
        return self._graph

    def _confirmations(self) -> int:
        """The genuine signatures a sampled check must show: for the most colluders any site of
        its neighbourhood allows for (the H each signed is in the transcript), as the shares
        this site reveals are its neighbourhood's secrets, and each of them is protected by the
        checks of its own holders, every one of which counts its H in."""
        weakest = min(keys.honest_sites for keys in self._roster.values())
        return self.trust.confirmations(len(self._ids), weakest=weakest)

    @property
    def sampled(self) -> bool:
        """Whether this site checks the consistency signatures on a random sample (it shared
        under a sparse masking graph), and so draws once per round."""
        return self._sparse is not None

    @property
    def _share_threshold(self) -> int:
        return self._threshold if self._sparse is None else self._sparse[1]

    def _holders(self, site: str) -> list[str]:
        return self.graph.neighbourhood(site)  # the whole roster with the complete graph

    def receive(self, sealed: Mapping[str, bytes]) -> None:
        """Open and keep the shares each sender sealed for this site (all, or none on an error).

        Raises:
            ShareError: A ciphertext fails authentication (also when its sender was told
                another threshold or roster) or comes from a site not in the roster.
        """
        if not self._ids:
            raise SecureSumError(f"site {self.site_id!r} must share before it receives shares")
        opened: dict[str, SharePair] = {}
        senders = set(self._holders(self.site_id)) - {self.site_id}
        for sender in sorted(sealed):
            if sender not in senders:
                raise ShareError(
                    f"shares arrived from {sender!r}, not another holder of this site's shares"
                )
            key = self._pairwise(self._roster[sender], SHARE_PURPOSE)
            opened[sender] = open_shares(
                key,
                sealed[sender],
                sender=sender,
                receiver=self.site_id,
                round_id=self.round_id,
                transcript=self.transcript,
            )
        self._held.update(opened)

    def check_participants(self, participants: Collection[str]) -> frozenset[str]:
        """Everything ``mask`` checks of ``participants`` before it masks, so that a site can
        check them before it spends anything on the input (``mask`` calls it again).

        Raises:
            MasksUsedError: This site already masked an input this round.
            ConsistencyError: A participant's shares did not arrive here, or this site is not
                listed itself.
            SecureSumAbortedError: Fewer than t participants, or more than D roster sites
                missing from them.
        """
        if self._participants:
            raise MasksUsedError(
                f"site {self.site_id!r} already masked its input this round: it masks one input "
                "once (two masked inputs would reveal their difference)"
            )
        everyone = frozenset(participants)
        near = everyone & set(self._holders(self.site_id))
        missing = sorted((near - set(self._held)) | (everyone - set(self._ids)))
        if self.site_id not in everyone or missing:
            raise ConsistencyError(
                f"site {self.site_id!r} cannot mask with participants {sorted(everyone)}: it holds "
                f"no shares from {missing} (or is not listed itself); abort the round"
            )
        self.trust.check_present(len(everyone), len(self._ids), "participants")
        if len(everyone) < self._threshold:
            raise SecureSumAbortedError(
                f"secure sum aborted: {len(everyone)} participants and the threshold needs "
                f"{self._threshold}; nothing was sent"
            )
        if len(near) < self._share_threshold:
            raise SecureSumAbortedError(
                f"secure sum aborted: {len(near)} of this site's neighbourhood participate and "
                f"its neighbourhood threshold needs {self._share_threshold}; nothing was sent"
            )
        return everyone

    def mask(self, x: FieldVector, *, participants: Collection[str]) -> FieldVector:
        """This site's masked input: ``x`` plus its self mask and a pairwise mask per participant.

        Args:
            x: The input in Z_(2^b) (``field.encode_signed``).
            participants: The sites whose shares were relayed (``U2``), this one included; this
                site must hold a share from each.

        Raises:
            The errors of ``check_participants``.
        """
        everyone = self.check_participants(participants)
        near = everyone & set(self._holders(self.site_id))
        keys = {
            peer: self._pairwise(self._roster[peer], MASK_PURPOSE)
            for peer in near
            if peer != self.site_id
        }
        self._participants = everyone
        return mask_input(
            x, site=self.site_id, self_seed=self._seed, pairwise_keys=keys, bits=self.bits
        )

    def noise_share(self) -> float:
        """L, the largest noise share stated for the roster (bound by the round's transcript):
        what this site adds, so that every roster site's own share is covered by each honest
        site whose input a sum holds, whatever their sizes and whoever the coordinator names
        as participants (a site a coordinator leaves out of one site's participants still has
        its share added by it: the site adds the same under every view).

        Raises:
            NoiseShareError: L is below this site's own share (its noise would not be covered
                by the other sites' shares), or above its whole noise (``mu = (H - D)`` times
                its own share, with ``NOISE_SHARE_SLACK``): no policy of this site could need
                it, and every honest site adding it would drown the round.
        """
        if not self._ids:
            raise SecureSumError(f"site {self.site_id!r} has no verified roster this round")
        largest, mine = self._largest, self._advertised.noise_share
        own = mine * self.trust.share_divisor
        if share_too_large(largest, self._advertised):
            raise NoiseShareError(
                f"a roster site signed a noise share of {largest:.6g}, more than this site's "
                f"whole noise {own:.6g}: refused before anything is charged"
            )
        if largest < mine:
            raise NoiseShareError(
                f"the roster's largest noise share is stated as {largest:.6g}, below this "
                f"site's own {mine:.6g}: the other sites would add too little; refused before "
                "anything is charged"
            )
        return largest

    @property
    def transcript(self) -> bytes:
        """``views.round_transcript`` of the roster, threshold and graph this site shared with."""
        if self._transcript is None:
            self._transcript = transcript_of(
                self._threshold, self._sparse, self._digest, self._largest
            )
        return self._transcript

    def view(self, survivors: Collection[str]) -> RoundView:
        """This run of the round as this site saw it, with ``survivors``: the participants it
        masked with, ``survivors`` and the transcript."""
        return RoundView(self._participants, frozenset(survivors), self.transcript)

    def sign_view(
        self, survivors: Collection[str], *, identity_key: ec.EllipticCurvePrivateKey
    ) -> bytes:
        """This site's signature of its participants and ``survivors`` (``views.sign_view``).

        A site signs one view per round (the same sets may be signed again).

        Raises:
            MasksUsedError: This site has not masked its input this round.
            ConsistencyError: It signed other survivors already, ``survivors`` are not all
                participants, or this site is not among them.
            SecureSumAbortedError: Fewer than t survivors, or more than D roster sites missing.
        """
        if not self._participants:
            raise MasksUsedError(
                f"site {self.site_id!r} has not masked an input this round: nothing to confirm"
            )
        named = frozenset(survivors)
        if self._survivors is not None and self._survivors != named:
            raise ConsistencyError(
                f"site {self.site_id!r} signed another survivor set this round: it signs one "
                "view per round; nothing further signed or revealed"
            )
        strangers = sorted(named - self._participants)
        if strangers or self.site_id not in named:
            raise ConsistencyError(
                f"survivors {strangers} are not participants of site {self.site_id!r}, or it is "
                "not named a survivor itself: nothing signed"
            )
        self.trust.check_present(len(named), len(self._ids), "survivors")
        if len(named) < self._threshold:
            raise SecureSumAbortedError(
                f"secure sum aborted: {len(named)} survivors and the threshold needs "
                f"{self._threshold}; nothing signed"
            )
        self._survivors = named
        view = self.view(named)
        return sign_view(
            view, round_id=self.round_id, site_id=self.site_id, identity_key=identity_key
        )

    def _signed(self, request: UnmaskRequest) -> RoundView:
        """The view this site signed, if ``request`` names exactly its sets."""
        if self._survivors is None:
            raise ConsistencyError(
                f"site {self.site_id!r} signed no survivor set this round: it answers no "
                "unmasking request"
            )
        view = self.view(self._survivors)
        if request.survivors != view.survivors or request.dropped != view.dropped:
            raise ConsistencyError(
                f"the unmasking request names {len(request.survivors)} survivors and "
                f"{len(request.dropped)} dropped, not the {len(view.survivors)} and "
                f"{len(view.dropped)} site {self.site_id!r} signed: nothing revealed"
            )
        return view

    def draw(
        self, request: UnmaskRequest, *, signers: Collection[str], root: bytes
    ) -> tuple[int, ...]:
        """The places (in sorted signer order) of the forwarded signatures this site will check:
        every one with the complete graph, a random sample under a sparse one
        (``views.draw_signatures``), drawn once a round and kept (``decisions``; a caller keeps
        them durably before the draw leaves): the same request, signers and root get the same
        draw again, others none. The complete graph's check counts every signature, sound
        however often it is made, so there a new root is drawn (all of it) again.

        Args:
            request: The unmasking request: it must name exactly the sets this site signed.
            signers: The survivors whose signatures the coordinator forwards.
            root: The root the coordinator committed them under (``views.SignatureBook``).

        Raises:
            ConsistencyError: This site signed no view or another one, the signers are not
                survivors of it or fewer than t, or (sparse graph) it drew for other signers or
                another root this round already. Nothing is revealed.
        """
        view = self._signed(request)
        chosen = tuple(sorted(set(signers)))
        if len(chosen) != len(signers) or not set(chosen) <= view.survivors:
            raise ConsistencyError(
                f"the signers forwarded to site {self.site_id!r} repeat a site or are not all "
                "survivors: nothing revealed"
            )
        if len(chosen) < self._threshold:
            raise ConsistencyError(
                f"{len(chosen)} signatures forwarded to site {self.site_id!r}, fewer than the "
                f"threshold {self._threshold}: nothing revealed"
            )
        if self._draw is not None and self.sampled:
            if (self._draw.root, self._draw.signers) != (root, chosen):
                raise ConsistencyError(
                    f"site {self.site_id!r} drew the signatures it checks this round already, "
                    "from another set: it draws once per round; nothing further revealed"
                )
            return self._draw.drawn
        needed = self._confirmations() if self.sampled else None
        self._draw = SignatureDraw(root, chosen, draw_signatures(len(chosen), needed))
        return self._draw.drawn

    @property
    def drawn_signers(self) -> tuple[str, ...]:
        """The signers whose signatures this site drew to check (``draw``)."""
        if self._draw is None:
            raise ConsistencyError(f"site {self.site_id!r} drew no signatures this round")
        return tuple(self._draw.signers[at] for at in self._draw.drawn)

    def reveal(
        self,
        request: UnmaskRequest,
        *,
        signatures: Mapping[str, bytes],
        proof: Sequence[bytes],
        registered: Mapping[str, ec.EllipticCurvePublicKey],
    ) -> UnmaskResponse:
        """The shares ``request`` asks for, if it names exactly the view this site signed and
        the signatures it drew (``draw``), opened with ``proof`` against the root they were
        committed under, confirm it (``views.check_signatures``: at least t valid; every drawn
        one under a sparse graph).

        As the site signs one view per round, it reveals one kind of share of each site (the
        seed's of a survivor, the mask key's of a dropped participant) whatever it is asked,
        and as it draws once, asking again gives the same verdict.

        Raises:
            ConsistencyError: This site signed no view or drew no signatures, the request names
                other survivors or dropped sites than it signed, the signatures are not the
                drawn ones or do not match their root, or they do not confirm its view.
                Nothing is revealed.
        """
        view = self._signed(request)
        drawn = self.drawn_signers
        assert self._draw is not None
        if sorted(signatures) != sorted(drawn):
            raise ConsistencyError(
                f"the coordinator opened {len(signatures)} signatures, not the {len(drawn)} "
                f"site {self.site_id!r} drew: nothing revealed"
            )
        place = {signer: at for at, signer in enumerate(self._draw.signers)}
        leaves = {place[s]: signature_leaf(s, signatures[s]) for s in drawn}
        try:
            root = root_of(len(self._draw.signers), leaves, proof)
        except KeyBindingError:
            root = b""
        if root != self._draw.root:
            raise ConsistencyError(
                f"the signatures opened to site {self.site_id!r} do not match the root they "
                "were committed under: nothing revealed"
            )
        check_signatures(
            view,
            signatures,
            round_id=self.round_id,
            registered=registered,
            threshold=self._threshold,
            sampled=self.sampled,
        )
        near = set(self._holders(self.site_id))
        return UnmaskResponse(
            site_id=self.site_id,
            seed_shares={u: self._held[u].seed for u in sorted(view.survivors & near)},
            key_shares={d: self._held[d].mask_key for d in sorted(view.dropped & near)},
        )

    def answer(
        self,
        request: UnmaskRequest,
        *,
        signatures: Mapping[str, bytes],
        registered: Mapping[str, ec.EllipticCurvePublicKey],
    ) -> UnmaskResponse:
        """``draw`` and ``reveal`` in one process: the forwarded ``signatures`` (keyed by
        signer) of the request's survivors (the others are not forwarded) committed as the
        coordinator commits them (``views.SignatureBook``), this site's draw opened from them.
        Their errors."""
        book = SignatureBook({s: v for s, v in signatures.items() if s in request.survivors})
        drawn = self.draw(request, signers=book.signers, root=book.root)
        opened, proof = book.open(drawn)
        return self.reveal(request, signatures=opened, proof=proof, registered=registered)

    # -- what the site decided once ---------------------------------------------------------

    def decisions(self) -> RoundDecisions:
        """What this site decided once this round (the threshold it shared with, its masked
        participants, its signed survivors, the signatures it drew to check), for its durable
        record."""
        return RoundDecisions(
            masks=self.masks_id,
            threshold=self._threshold or None,
            participants=self._participants or None,
            survivors=self._survivors,
            draw=self._draw,
        )

    def recall(self, decisions: RoundDecisions) -> None:
        """Take ``decisions`` (this round's durable record) into this object, whose in-memory
        state may be older: what was decided once stays decided.

        Raises:
            MasksUsedError: ``decisions`` belong to other masks (this object is stale).
            ConsistencyError: They contradict what this object decided.
        """
        if decisions.masks != self.masks_id:
            raise MasksUsedError(
                f"site {self.site_id!r}: the round state kept in memory is not the one of its "
                "durable record (stale or replaced): it cannot take part any more this round"
            )
        if decisions.threshold is not None and self._threshold != decisions.threshold:
            raise MasksUsedError(
                f"site {self.site_id!r} shared its secrets this round already; the round state "
                "kept in memory is older than its durable record: it cannot take part any more"
            )
        if decisions.participants is not None:
            if self._participants and self._participants != decisions.participants:
                raise ConsistencyError("the durable record names other participants")
            self._participants = decisions.participants
        if decisions.survivors is not None:
            if self._survivors is not None and self._survivors != decisions.survivors:
                raise ConsistencyError("the durable record names another signed survivor set")
            self._survivors = decisions.survivors
        if decisions.draw is not None:
            if self._draw is not None and self._draw != decisions.draw:
                raise ConsistencyError("the durable record names another draw of signatures")
            self._draw = decisions.draw

    # -- the round's state between messages --------------------------------------------------

    def to_bytes(self) -> bytes:
        """Everything this object holds (its SECRETS included), for the site's own keeping
        between the messages of one round (``from_bytes``); never to be sent anywhere."""

        def keys(a: AdvertisedKeys) -> list[Any]:
            fields = (a.mask_public, a.share_public, a.seed_commitment, a.signature)
            return [
                a.site_id,
                *(f.hex() for f in fields),
                float(a.noise_share).hex(),
                a.honest_sites,
                a.max_dropouts,
            ]

        state: dict[str, Any] = {
            "site": self.site_id,
            "run": self.round_id.run_id,
            "round": self.round_id.server_round,
            "bits": self.bits,
            "honest": self.trust.honest,
            "dropouts": self.trust.dropouts,
            "mask-key": self._mask_key.private_bytes_raw().hex(),
            "share-key": self._share_key.private_bytes_raw().hex(),
            "seed": self._seed.hex(),
            "advertised": keys(self._advertised),
            "ids": list(self._ids),
            "roster": {s: keys(a) for s, a in self._roster.items()},
            "digest": self._digest.hex(),
            "largest": float(self._largest).hex(),
            "threshold": self._threshold,
            "graph": None if self._sparse is None else list(self._sparse),
            "held": {s: [p.seed.hex(), p.mask_key.hex()] for s, p in self._held.items()},
            "participants": sorted(self._participants),
            "survivors": None if self._survivors is None else sorted(self._survivors),
            "draw": None if self._draw is None else self._draw.to_json(),
        }
        return json.dumps(state, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> SiteRound:
        """The ``SiteRound`` that ``to_bytes`` wrote.

        Raises:
            SecureSumError: ``data`` is not such a state.
        """
        try:
            state = json.loads(data)

            def keys(v: list[Any]) -> AdvertisedKeys:
                mask, share, commitment, signature = (bytes.fromhex(x) for x in v[1:5])
                noise = float.fromhex(v[5])
                return AdvertisedKeys(
                    v[0], mask, share, commitment, signature, noise, int(v[6]), int(v[7])
                )

            self = cls.__new__(cls)
            self.site_id = str(state["site"])
            self.round_id = RoundId(str(state["run"]), int(state["round"]))
            self.bits = int(state["bits"])
            check_bits(self.bits)
            self.trust = RoundTrust(int(state["honest"]), int(state["dropouts"]))
            self._mask_key = X25519PrivateKey.from_private_bytes(bytes.fromhex(state["mask-key"]))
            self._share_key = X25519PrivateKey.from_private_bytes(bytes.fromhex(state["share-key"]))
            self._seed = bytes.fromhex(state["seed"])
            self._advertised = keys(state["advertised"])
            self._ids = tuple(str(s) for s in state["ids"])
            self._roster = {str(s): keys(v) for s, v in state["roster"].items()}
            self._digest = bytes.fromhex(state["digest"])
            self._largest = float.fromhex(state["largest"])
            self._threshold = int(state["threshold"])
            graph = state.get("graph")
            self._sparse = None if graph is None else (int(graph[0]), int(graph[1]))
            self._graph = None
            self._transcript = None
            self._held = {
                str(s): SharePair(bytes.fromhex(v[0]), bytes.fromhex(v[1]))
                for s, v in state["held"].items()
            }
            self._participants = frozenset(str(s) for s in state["participants"])
            survivors = state["survivors"]
            self._survivors = None if survivors is None else frozenset(map(str, survivors))
            draw = state.get("draw")
            self._draw = None if draw is None else SignatureDraw.from_json(draw)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise SecureSumError(f"not a stored secure-sum round state ({exc})") from None
        return self

    def _pairwise(self, peer: AdvertisedKeys, purpose: str) -> bytes:
        own = self._mask_key if purpose == MASK_PURPOSE else self._share_key
        public = peer.mask_public if purpose == MASK_PURPOSE else peer.share_public
        return pairwise_key(
            own,
            public,
            purpose=purpose,
            round_id=self.round_id,
            site=self.site_id,
            peer=peer.site_id,
        )
