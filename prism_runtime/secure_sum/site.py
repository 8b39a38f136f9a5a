"""A site's part in one round of the secure sum: its secrets, the shares it holds, its answers.

``SiteRound`` holds everything a site must keep for one round and nothing longer: two fresh
X25519 key pairs and a fresh 32-byte self-mask seed (``secrets``). In order, a site

1. publishes ``advertised`` (its public keys and seed commitment, signed with its identity key);
2. ``share``: verifies every advertisement of the roster against the registered identity keys
   (``KeyBindingError`` names a substituted site), splits its seed and mask private key with
   threshold t among the roster and seals each receiver's two shares (``envelope``);
3. ``receive``: opens the shares the other sites sealed for it (``ShareError`` if one fails);
4. ``mask``: masks its one input of the round with its self mask and a pairwise mask per
   participant;
5. ``answer``: reveals, for an unmasking request, the seed shares of the survivors and the
   mask-key shares of the dropped.

The rule that keeps a masked input private is enforced in ``answer``: a site never reveals
both the seed share and the mask-key share of the same site, neither in one request (refused
when a site is both survivor and dropped) nor across requests (it remembers which kind it
revealed for each site and refuses the other). It also answers nothing when fewer than t
survivors are named, since that round must abort.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection, Mapping
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from prism_runtime.secure_sum.envelope import SharePair, open_shares, seal_shares
from prism_runtime.secure_sum.errors import (
    KeyBindingError,
    SecureSumAbortedError,
    SecureSumError,
    ShareError,
    UnmaskRefusedError,
)
from prism_runtime.secure_sum.field import FieldVector, check_bits
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
from prism_runtime.secure_sum.shamir import check_threshold, split_secret
from prism_runtime.secure_sum.unmask import ShareKind, UnmaskRequest, UnmaskResponse

__all__ = ["SiteRound"]


class SiteRound:
    """One site's secrets and share book for one round (make a new one every round)."""

    def __init__(
        self,
        *,
        site_id: str,
        round_id: RoundId,
        identity_key: ec.EllipticCurvePrivateKey,
        bits: int,
        noise_share: float = 0.0,
    ) -> None:
        check_bits(bits)
        self.site_id = site_id
        self.round_id = round_id
        self.bits = bits
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
        )
        self._roster: dict[str, AdvertisedKeys] = {}
        self._threshold = 0
        self._held: dict[str, SharePair] = {}
        self._participants: frozenset[str] = frozenset()
        self._revealed: dict[str, ShareKind] = {}

    @property
    def advertised(self) -> AdvertisedKeys:
        """This site's signed public keys and seed commitment for the round, to publish."""
        return self._advertised

    def share(
        self,
        roster: Mapping[str, AdvertisedKeys],
        *,
        registered: Mapping[str, ec.EllipticCurvePublicKey],
        threshold: int,
    ) -> dict[str, bytes]:
        """Verify the roster, split this site's secrets among it and seal each receiver's shares.

        Args:
            roster: The advertised keys of every site of the round (``U1``), this one included,
                keyed by site id, as relayed by the coordinator.
            registered: The identity public key of each registered site id.
            threshold: t, with ``len(roster) / 2 < t <= len(roster)``.

        Returns:
            The sealed shares for each other site of the roster, keyed by receiver.

        Raises:
            KeyBindingError: An advertisement does not verify (names the site), or the roster
                does not carry this site's own keys unchanged.
            SecureSumAbortedError: The roster has fewer than ``threshold`` sites.
        """
        if self._roster:
            raise SecureSumError(f"site {self.site_id!r} already shared its secrets this round")
        if roster.get(self.site_id) != self._advertised:
            raise KeyBindingError(
                f"the roster does not carry the keys site {self.site_id!r} advertised: they were "
                "substituted or left out; abort the round"
            )
        for site, advertised in sorted(roster.items()):
            if advertised.site_id != site:
                raise KeyBindingError(
                    f"the roster lists the keys of site {advertised.site_id!r} under {site!r}"
                )
            verify_keys(advertised, round_id=self.round_id, registered=registered)
        if len(roster) < threshold:
            raise SecureSumAbortedError(
                f"secure sum aborted: {len(roster)} sites advertised keys and the threshold "
                f"needs {threshold}; nothing was shared"
            )
        check_threshold(threshold, len(roster))
        holders = sorted(roster)
        seeds = split_secret(self._seed, threshold=threshold, holders=holders)
        keys = split_secret(
            self._mask_key.private_bytes_raw(), threshold=threshold, holders=holders
        )
        sealed: dict[str, bytes] = {}
        for peer in holders:
            pair = SharePair(seeds[peer], keys[peer])
            if peer == self.site_id:
                self._held[peer] = pair
                continue
            key = self._pairwise(roster[peer], SHARE_PURPOSE)
            sealed[peer] = seal_shares(
                key, pair, sender=self.site_id, receiver=peer, round_id=self.round_id
            )
        self._roster = dict(roster)
        self._threshold = threshold
        return sealed

    def receive(self, sealed: Mapping[str, bytes]) -> None:
        """Open and keep the shares each sender sealed for this site (all, or none on an error).

        Raises:
            ShareError: A ciphertext fails authentication or comes from a site not in the roster.
        """
        if not self._roster:
            raise SecureSumError(f"site {self.site_id!r} must share before it receives shares")
        opened: dict[str, SharePair] = {}
        for sender in sorted(sealed):
            if sender not in self._roster or sender == self.site_id:
                raise ShareError(f"shares arrived from {sender!r}, not another site of the roster")
            key = self._pairwise(self._roster[sender], SHARE_PURPOSE)
            opened[sender] = open_shares(
                key, sealed[sender], sender=sender, receiver=self.site_id, round_id=self.round_id
            )
        self._held.update(opened)

    def check_participants(self, participants: Collection[str]) -> frozenset[str]:
        """Everything ``mask`` checks of ``participants`` before it masks, so that a site can
        check them before it spends anything on the input (``mask`` calls it again).

        Raises:
            SecureSumAbortedError: Fewer than t participants.
            SecureSumError: A participant is unknown or its shares did not arrive here, or this
                site already masked an input this round.
        """
        if self._participants:
            raise SecureSumError(
                f"site {self.site_id!r} already masked its input this round: it masks one input "
                "once (two masked inputs would reveal their difference); resend the first"
            )
        everyone = frozenset(participants)
        missing = sorted(everyone - set(self._held))
        if self.site_id not in everyone or missing:
            raise SecureSumError(
                f"site {self.site_id!r} cannot mask with participants {sorted(everyone)}: it holds "
                f"no shares from {missing} (or is not listed itself); abort the round"
            )
        if len(everyone) < self._threshold:
            raise SecureSumAbortedError(
                f"secure sum aborted: {len(everyone)} participants and the threshold needs "
                f"{self._threshold}; nothing was sent"
            )
        return everyone

    def mask(self, x: FieldVector, *, participants: Collection[str]) -> FieldVector:
        """This site's masked input: ``x`` plus its self mask and a pairwise mask per participant.

        Args:
            x: The input in Z_(2^b) (``field.encode_signed``).
            participants: The sites whose shares were relayed (``U2``), this one included; this
                site must hold a share from each.

        Raises:
            SecureSumAbortedError: Fewer than t participants.
            SecureSumError: A participant is unknown or its shares did not arrive here, or this
                site already masked an input this round.
        """
        everyone = self.check_participants(participants)
        keys = {
            peer: self._pairwise(self._roster[peer], MASK_PURPOSE)
            for peer in everyone
            if peer != self.site_id
        }
        self._participants = everyone
        return mask_input(
            x, site=self.site_id, self_seed=self._seed, pairwise_keys=keys, bits=self.bits
        )

    def noise_share(self, participants: Collection[str]) -> float:
        """The largest noise share the ``participants`` advertised (signed, verified in
        ``share``): what this site adds, so that every participant's own share is covered by
        each honest site whatever the others' sizes."""
        if not self._roster:
            raise SecureSumError(f"site {self.site_id!r} has no verified roster this round")
        return max(self._roster[p].noise_share for p in participants)

    def answer(self, request: UnmaskRequest) -> UnmaskResponse:
        """The shares ``request`` asks for, unless answering would reveal both secrets of a site.

        Raises:
            UnmaskRefusedError: A site is named both survivor and dropped, a site is asked for the
                other kind of share than this site already revealed for it, a site is not a
                participant, or this site has not masked its input this round. Nothing is
                revealed.
            SecureSumAbortedError: Fewer than t survivors; nothing is revealed.
        """
        if not self._participants:
            raise UnmaskRefusedError(
                f"site {self.site_id!r} has not sent a masked input this round: it answers no "
                "unmasking request"
            )
        both = sorted(request.survivors & request.dropped)
        if both:
            raise UnmaskRefusedError(
                f"site {self.site_id!r} refuses to reveal both the seed share and the mask-key "
                f"share of {both}: a site is either a survivor or dropped, never both"
            )
        unknown = sorted((request.survivors | request.dropped) - self._participants)
        if unknown:
            raise UnmaskRefusedError(
                f"site {self.site_id!r} refuses an unmasking request naming {unknown}, which are "
                "not participants of this round"
            )
        flipped = sorted(
            [u for u in request.survivors if self._revealed.get(u) is ShareKind.MASK_KEY]
            + [d for d in request.dropped if self._revealed.get(d) is ShareKind.SEED]
        )
        if flipped:
            raise UnmaskRefusedError(
                f"site {self.site_id!r} already revealed the other kind of share of {flipped}: "
                "it never reveals both secrets of one site"
            )
        if len(request.survivors) < self._threshold:
            raise SecureSumAbortedError(
                f"secure sum aborted: {len(request.survivors)} survivors named and the threshold "
                f"needs {self._threshold}; nothing was revealed"
            )
        for survivor in request.survivors:
            self._revealed[survivor] = ShareKind.SEED
        for dropped in request.dropped:
            self._revealed[dropped] = ShareKind.MASK_KEY
        return UnmaskResponse(
            site_id=self.site_id,
            seed_shares={u: self._held[u].seed for u in sorted(request.survivors)},
            key_shares={d: self._held[d].mask_key for d in sorted(request.dropped)},
        )

    # -- the round's state between messages --------------------------------------------------

    def to_bytes(self) -> bytes:
        """Everything this object holds (its SECRETS included), for the site's own keeping
        between the messages of one round (``from_bytes``); never to be sent anywhere."""

        def keys(a: AdvertisedKeys) -> list[str]:
            fields = (a.mask_public, a.share_public, a.seed_commitment, a.signature)
            return [a.site_id, *(f.hex() for f in fields), float(a.noise_share).hex()]

        state: dict[str, Any] = {
            "site": self.site_id,
            "run": self.round_id.run_id,
            "round": self.round_id.server_round,
            "bits": self.bits,
            "mask-key": self._mask_key.private_bytes_raw().hex(),
            "share-key": self._share_key.private_bytes_raw().hex(),
            "seed": self._seed.hex(),
            "advertised": keys(self._advertised),
            "roster": {s: keys(a) for s, a in self._roster.items()},
            "threshold": self._threshold,
            "held": {s: [p.seed.hex(), p.mask_key.hex()] for s, p in self._held.items()},
            "participants": sorted(self._participants),
            "revealed": {s: str(k) for s, k in self._revealed.items()},
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

            def keys(v: list[str]) -> AdvertisedKeys:
                mask, share, commitment, signature = (bytes.fromhex(x) for x in v[1:5])
                noise = float.fromhex(v[5])
                return AdvertisedKeys(v[0], mask, share, commitment, signature, noise)

            self = cls.__new__(cls)
            self.site_id = str(state["site"])
            self.round_id = RoundId(str(state["run"]), int(state["round"]))
            self.bits = int(state["bits"])
            check_bits(self.bits)
            self._mask_key = X25519PrivateKey.from_private_bytes(bytes.fromhex(state["mask-key"]))
            self._share_key = X25519PrivateKey.from_private_bytes(bytes.fromhex(state["share-key"]))
            self._seed = bytes.fromhex(state["seed"])
            self._advertised = keys(state["advertised"])
            self._roster = {str(s): keys(v) for s, v in state["roster"].items()}
            self._threshold = int(state["threshold"])
            self._held = {
                str(s): SharePair(bytes.fromhex(v[0]), bytes.fromhex(v[1]))
                for s, v in state["held"].items()
            }
            self._participants = frozenset(str(s) for s in state["participants"])
            self._revealed = {str(s): ShareKind(k) for s, k in state["revealed"].items()}
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
