"""The wire format of a secure-sum round: one codec for the coordinator and the sites.

A round has six exchanges (docs/design.md §3.3), each a request from the coordinator and a
reply from each site; every message is a ``RecordDict`` with one ``ConfigRecord`` (``wire``)
whose envelope names the stage, the round and the site (the addressee of a request, the sender
of a reply). Each message is declared once below as a ``wire.Message``: its payload fields in
wire order, their types and bounds, and the rules across fields. Its ``decode_*`` checks the
whole message against that declaration before it builds anything and raises
``MessageFormatError`` naming the field; its ``encode_*`` builds the message from the same
declaration and then decodes it, so a side never sends what the other side refuses
(``MessageFormatError`` prefixed "refusing to send").

The masked vector travels as ``bytes`` in the ConfigRecord, not as an ``ArrayRecord``: its one
layout (n little-endian uint64 words, no header) is checked by length alone (``8 n`` bytes, n
known to both sides) before it is read with ``numpy.frombuffer``, with no dtype, shape or
serialisation tag for the sender to choose and no ``numpy.load`` of sender-controlled headers;
and a ConfigRecord's bytes are exactly what crossed the wire, whereas an ``Array`` is rebuilt
from deduplicated chunks whose list the sender writes, so a short message can name a large
array. Its cost: a vector travels as one object (``MAX_VECTOR_LENGTH`` bounds it at 128 MiB).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
from flwr.app import RecordDict

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum.field import MAX_BITS, FieldVector, modulus_mask
from prism_runtime.secure_sum.keys import KEY_BYTES, AdvertisedKeys, RoundId, noise_share_bytes
from prism_runtime.secure_sum.merkle import HASH_BYTES
from prism_runtime.secure_sum.roster import RosterPart
from prism_runtime.secure_sum.unmask import UnmaskRequest, UnmaskResponse
from prism_runtime.secure_sum.wire import (
    FORMAT,
    MAX_SITE_ID_CHARS,
    MAX_SITES,
    MAX_VECTOR_LENGTH,
    RECORD,
    SEALED_SHARES_BYTES,
    SHARE_BYTES,
    SIGNATURE_MAX_BYTES,
    SIGNATURE_MIN_BYTES,
    Bytes,
    Int,
    Keyed,
    Message,
    MessageFormatError,
    MessageReader,
    One,
    Signature,
    Stage,
    Table,
    WireValue,
    check_addressee,
)

__all__ = [
    "FORMAT",
    "MAX_SITES",
    "MAX_SITE_ID_CHARS",
    "MAX_VECTOR_LENGTH",
    "RECORD",
    "SEALED_SHARES_BYTES",
    "SHARE_BYTES",
    "SIGNATURE_MAX_BYTES",
    "SIGNATURE_MIN_BYTES",
    "AdvertiseRequest",
    "ConsistencyRequest",
    "MaskRequest",
    "MessageFormatError",
    "SampleRequest",
    "ShareRequest",
    "SignedUnmaskRequest",
    "Stage",
    "decode_advertise_reply",
    "decode_advertise_request",
    "decode_consistency_reply",
    "decode_consistency_request",
    "decode_mask_reply",
    "decode_mask_request",
    "decode_sample_reply",
    "decode_sample_request",
    "decode_share_reply",
    "decode_share_request",
    "decode_unmask_reply",
    "decode_unmask_request",
    "encode_advertise_reply",
    "encode_advertise_request",
    "encode_consistency_reply",
    "encode_consistency_request",
    "encode_mask_reply",
    "encode_mask_request",
    "encode_sample_reply",
    "encode_sample_request",
    "encode_share_reply",
    "encode_share_request",
    "encode_unmask_reply",
    "encode_unmask_request",
    "site_bits",
]

_WORD = 8  # bytes per uint64 coordinate on the wire
_NOISE_MAX = 2.0**50  # prism_core.distributed.MU_SHARE_MAX: larger draws are not exact


@dataclass(frozen=True)
class AdvertiseRequest:
    """The public parameters of the round a site is asked to advertise keys for.

    Attributes:
        bits: b, the modulus exponent of Z_(2^b), in ``[1, MAX_BITS]``.
        length: n, the length of every site's masked vector, in ``[1, MAX_VECTOR_LENGTH]``.
    """

    bits: int
    length: int


@dataclass(frozen=True)
class ShareRequest:
    """The addressee's part of the roster ``U1`` (``roster.RosterPart``: the sorted ids, the
    stated largest noise share, its neighbourhood's advertisements and their Merkle proof), the
    threshold t and the masking graph: ``graph_degree`` k and ``graph_threshold`` of a sparse
    one (``graph``), 0 and 0 for the complete graph."""

    roster: RosterPart
    threshold: int
    graph_degree: int = 0
    graph_threshold: int = 0

    @property
    def graph(self) -> tuple[int, int] | None:
        """(degree, neighbourhood threshold) of a sparse graph; None: the complete graph."""
        return None if self.graph_degree == 0 else (self.graph_degree, self.graph_threshold)


@dataclass(frozen=True)
class MaskRequest:
    """The ciphertexts sealed for the addressee, keyed by sender, and the participants ``U2``."""

    sealed: Mapping[str, bytes]
    participants: frozenset[str]


@dataclass(frozen=True)
class ConsistencyRequest:
    """The survivors ``U3`` (the participants whose masked inputs arrived) for the addressee to
    sign with its participants (``views``)."""

    survivors: frozenset[str]


@dataclass(frozen=True)
class SampleRequest:
    """The unmasking request, the survivors whose signatures of their sets the coordinator
    forwards (``signers``) and the root it commits them under (``views.SignatureBook``): the
    addressee draws which it checks."""

    request: UnmaskRequest
    signers: frozenset[str]
    root: bytes


@dataclass(frozen=True)
class SignedUnmaskRequest:
    """The unmasking request and the signatures the addressee drew, keyed by signer, with
    their multiproof against the committed root (forwarded as they came: the site verifies
    them)."""

    request: UnmaskRequest
    signatures: Mapping[str, bytes]
    proof: tuple[bytes, ...] = ()


# field types ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _NoiseShare(Bytes):
    """A site's noise share: float64 little-endian (``noise_share_bytes``) in [0, 2^50]."""

    low: int = 8
    high: int = 8

    def load(self, read: MessageReader, key: str, raw: bytes) -> float:
        (share,) = struct.unpack("<d", raw)
        if not (math.isfinite(share) and 0 <= share <= _NOISE_MAX):
            raise read.fail(key, f"holds a noise share outside [0, {_NOISE_MAX:g}]")
        return float(share)

    def dump(self, value: Any) -> bytes:
        return noise_share_bytes(value)


@dataclass(frozen=True)
class _SiteCount(Bytes):
    """A count of sites (a site's H or D): 4 bytes big-endian, in ``[least, MAX_SITES]``."""

    low: int = 4
    high: int = 4
    least: int = 0

    def load(self, read: MessageReader, key: str, raw: bytes) -> int:
        count = int.from_bytes(raw, "big")
        if not self.least <= count <= MAX_SITES:
            raise read.fail(key, f"holds a count outside [{self.least}, {MAX_SITES}]")
        return count

    def dump(self, value: Any) -> bytes:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
            raise MessageFormatError(
                f"refusing to send a malformed message: a site count of {type(value).__name__}"
            )
        return value.to_bytes(4, "big")


@dataclass(frozen=True)
class _Proof(Bytes):
    """A Merkle proof (``merkle``: of a roster's advertisements or of forwarded signatures): its
    nodes' 32-byte hashes, concatenated (at most 2 per site of the longest roster)."""

    low: int = 0
    high: int = 2 * MAX_SITES * HASH_BYTES

    def load(self, read: MessageReader, key: str, raw: bytes) -> tuple[bytes, ...]:
        if len(raw) % HASH_BYTES:
            raise read.fail(key, f"holds {len(raw)} bytes, not a whole number of hashes")
        return tuple(raw[at : at + HASH_BYTES] for at in range(0, len(raw), HASH_BYTES))

    def dump(self, value: Any) -> bytes:
        return b"".join(value)


@dataclass(frozen=True)
class _RosterIds(Keyed):
    """Field ``key``: the roster's distinct site ids in the order sent (the rules check it is
    sorted), the addressee among them."""

    def write(self, value: Any) -> dict[str, WireValue]:
        return {self.key: list(value)}

    def read(self, read: MessageReader, got: Mapping[str, Any]) -> list[str]:
        sites = read.sites(self.key)
        check_addressee(read, self.key, sites)
        return sites


@dataclass(frozen=True)
class _Places(Keyed):
    """Field ``key``: strictly increasing places in ``[0, forwarded)`` (``forwarded`` from the
    receiver's context), at most ``MAX_SITES``."""

    def write(self, value: Any) -> dict[str, WireValue]:
        return {self.key: [int(at) for at in value]}

    def read(self, read: MessageReader, got: Mapping[str, Any]) -> tuple[int, ...]:
        forwarded: int = got["forwarded"]
        places: list[int] = []
        for item in read.items(self.key):
            if isinstance(item, bool) or not isinstance(item, int):
                raise read.fail(self.key, "holds an item that is not an int")
            if not 0 <= item < forwarded or (places and item <= places[-1]):
                raise read.fail(
                    self.key, f"holds places not strictly increasing in [0, {forwarded})"
                )
            places.append(item)
        if not places:
            raise read.fail(self.key, "draws nothing")
        return tuple(places)


def site_bits(sites: Collection[str], roster: Sequence[str]) -> bytes:
    """``sites`` as a bitmap over ``roster`` (sorted ids): bit ``i % 8`` of byte ``i // 8`` is
    set when ``roster[i]`` is among them.

    Raises:
        MessageFormatError: a site is not in the roster.
    """
    place = {site: at for at, site in enumerate(roster)}
    bits = bytearray((len(roster) + 7) // 8)
    for site in sites:
        at = place.get(site)
        if at is None:
            raise MessageFormatError(
                "refusing to send a malformed message: a set names a site outside the roster"
            )
        bits[at // 8] |= 1 << (at % 8)
    return bytes(bits)


@dataclass(frozen=True)
class _SiteBits(Keyed):
    """Field ``key``: a set of roster sites as a bitmap over the roster's sorted ids
    (``site_bits``; ``roster`` from the receiver's context), ``ceil(n / 8)`` bytes, no bit set
    past the roster (``addressee``: the message's site among them)."""

    addressee: bool = False

    def write(self, value: Any) -> dict[str, WireValue]:
        return {self.key: bytes(value)}

    def read(self, read: MessageReader, got: Mapping[str, Any]) -> frozenset[str]:
        roster: Sequence[str] = got["roster"]
        size = (len(roster) + 7) // 8
        raw = Bytes(size, size).check(read, self.key, read.record[self.key])
        tail = len(roster) % 8
        if tail and raw[-1] >> tail:
            raise read.fail(self.key, "sets a bit past the roster")
        sites = frozenset(roster[at] for at in range(len(roster)) if raw[at // 8] >> (at % 8) & 1)
        if self.addressee:
            check_addressee(read, self.key, sites)
        return sites


@dataclass(frozen=True)
class _MaskedVector:
    """Fields ``length`` (n, the round's) and ``masked-input``: n little-endian uint64 words,
    each below ``2^bits`` (``length`` and ``bits`` come from the receiver's context)."""

    name: str = "masked"
    keys: tuple[str, ...] = ("length", "masked-input")

    def write(self, value: Any) -> dict[str, WireValue]:
        if not isinstance(value, np.ndarray) or value.dtype != np.uint64 or value.ndim != 1:
            raise MessageFormatError(
                "refusing to send a malformed message: field 'masked-input' must be a 1-D numpy "
                f"uint64 vector, not a {type(value).__name__} {getattr(value, 'dtype', '')}"
            )
        return {
            "length": int(value.shape[0]),
            "masked-input": value.astype("<u8", copy=False).tobytes(),
        }

    def read(self, read: MessageReader, got: Mapping[str, Any]) -> FieldVector:
        length, bits = got["length"], got["bits"]
        declared = Int("length", 1, MAX_VECTOR_LENGTH).read(read, got)
        if declared != length:
            raise read.fail("length", f"is {declared}, not the round's vector length {length}")
        words = Bytes(_WORD * length, _WORD * length)
        data = words.check(read, "masked-input", read.record["masked-input"])
        vector = np.frombuffer(data, dtype="<u8")
        if np.any(vector > modulus_mask(bits)):
            raise read.fail("masked-input", f"holds a value >= 2^{bits}")
        return vector.astype(np.uint64)


_KEY = Bytes(KEY_BYTES, KEY_BYTES)
_SEALED = Bytes(SEALED_SHARES_BYTES, SEALED_SHARES_BYTES)
_SHARE = Bytes(SHARE_BYTES, SHARE_BYTES)
_KEYS = (
    ("mask-public", _KEY),
    ("share-public", _KEY),
    ("seed-commitment", _KEY),
    ("signature", Signature()),
    ("noise-share", _NoiseShare()),
    ("honest-sites", _SiteCount(least=1)),
    ("max-dropouts", _SiteCount()),
)
"""The fields of ``AdvertisedKeys`` besides its site id, in wire order."""


# rules across fields --------------------------------------------------------------------------


def _roster_is_sorted_and_threshold_a_majority(read: MessageReader, got: Mapping[str, Any]) -> None:
    roster = got["roster"]
    if any(a >= b for a, b in pairwise(roster)):
        raise read.fail("roster", "is not sorted by site id")
    strangers = set(got["leaves"]) - set(roster)
    if strangers:
        raise read.fail("leaves", f"names {len(strangers)} sites outside the roster")
    n, threshold = len(roster), got["threshold"]
    if not n / 2 < threshold <= n:
        raise read.fail(
            "threshold",
            f"is {threshold} with {n} roster sites, not a majority of them ({n // 2 + 1}..{n})",
        )
    degree, local = got["graph_degree"], got["graph_threshold"]
    if degree == 0 and local == 0:
        return
    if degree % 2 or not 2 <= degree < n - 1:
        raise read.fail("graph-degree", f"is {degree}: give 0 or an even degree in [2, {n - 2}]")
    if not degree // 2 < local <= degree:
        raise read.fail(
            "graph-threshold",
            f"is {local} for degree {degree}: not a majority of the neighbourhood "
            f"({degree // 2 + 1}..{degree})",
        )


def _survivors_and_dropped_are_disjoint(read: MessageReader, got: Mapping[str, Any]) -> None:
    survivors, dropped = got["survivors"], got["dropped"]
    if len(survivors) + len(dropped) > MAX_SITES:
        raise read.fail("dropped", f"with the survivors names more than {MAX_SITES} sites")
    both = sorted(survivors & dropped)
    if both:
        raise read.fail("dropped", f"also names survivors {both[:5]} ({len(both)} in all)")


def _signers_are_survivors(read: MessageReader, got: Mapping[str, Any]) -> None:
    _survivors_and_dropped_are_disjoint(read, got)
    strangers = sorted(set(got["signers"]) - got["survivors"])
    if strangers:
        raise read.fail("signers", f"names {len(strangers)} sites that are not survivors")


def _sender_is_a_survivor(read: MessageReader, got: Mapping[str, Any]) -> None:
    if got["site_id"] not in got["request"].survivors:
        raise read.fail("site-id", f"names {got['site_id']!r}, which is not a survivor")


def _near(got: Mapping[str, Any], sites: frozenset[str]) -> Collection[str]:
    """``sites`` within the sender's neighbourhood ``near`` of a sparse masking graph (all of
    them without one)."""
    near = got.get("near")
    return sites if near is None else sites & set(near)


def _other_roster_sites(got: Mapping[str, Any]) -> Collection[str] | None:
    roster, site_id = got["roster"], got["site_id"]
    return set(roster) - {site_id} if site_id in roster else None


# the twelve messages ----------------------------------------------------------------------------

_ADVERTISE_REQUEST = Message(
    Stage.ADVERTISE_REQUEST,
    (Int("bits", 1, MAX_BITS), Int("length", 1, MAX_VECTOR_LENGTH)),
    make=AdvertiseRequest,
)
_ADVERTISE_REPLY = Message(
    Stage.ADVERTISE_REPLY,
    tuple(One(key, item) for key, item in _KEYS),
    make=AdvertisedKeys,
    sender=True,
)
_SHARE_REQUEST = Message(
    Stage.SHARE_REQUEST,
    (
        Int("threshold", 1, MAX_SITES),
        Int("graph-degree", 0, MAX_SITES),
        Int("graph-threshold", 0, MAX_SITES),
        _RosterIds("roster"),
        One("largest-share", _NoiseShare()),
        Table(
            "leaves",
            "leaves",
            tuple((f"leaves-{key}", item) for key, item in _KEYS),
            row=AdvertisedKeys,
            addressee=True,
        ),
        One("proof", _Proof()),
    ),
    make=lambda threshold, graph_degree, graph_threshold, roster, largest_share, leaves, proof: (
        ShareRequest(
            RosterPart(tuple(roster), largest_share, leaves, proof),
            threshold,
            graph_degree,
            graph_threshold,
        )
    ),
    check=_roster_is_sorted_and_threshold_a_majority,
)
_SHARE_REPLY: Message[dict[str, bytes]] = Message(
    Stage.SHARE_REPLY,
    (
        Table(
            "sealed",
            "receivers",
            (("sealed-shares", _SEALED),),
            expect=_other_roster_sites,
            what="other sites of the roster",
        ),
    ),
    make=lambda sealed: sealed,
)
_MASK_REQUEST = Message(
    Stage.MASK_REQUEST,
    (
        _SiteBits("participants", addressee=True),
        Table(
            "sealed",
            "senders",
            (("sealed-shares", _SEALED),),
            expect=lambda got: (
                (
                    got["participants"]
                    & (got["participants"] if got.get("near") is None else set(got["near"]))
                )
                - {got["site_id"]}
            ),
            what="other participants of its neighbourhood",
        ),
    ),
    make=MaskRequest,
)
_MASK_REPLY: Message[FieldVector] = Message(
    Stage.MASK_REPLY, (_MaskedVector(),), make=lambda masked: masked
)
_CONSISTENCY_REQUEST = Message(
    Stage.CONSISTENCY_REQUEST,
    (_SiteBits("survivors", addressee=True),),
    make=ConsistencyRequest,
)
_CONSISTENCY_REPLY: Message[bytes] = Message(
    Stage.CONSISTENCY_REPLY,
    (One("signature", Signature()),),
    make=lambda signature: signature,
)
_SAMPLE_REQUEST = Message(
    Stage.SAMPLE_REQUEST,
    (
        _SiteBits("survivors", addressee=True),
        _SiteBits("dropped"),
        _SiteBits("signers"),
        One("signatures-root", Bytes(HASH_BYTES, HASH_BYTES)),
    ),
    make=lambda survivors, dropped, signers, signatures_root: SampleRequest(
        UnmaskRequest(survivors, dropped), signers, signatures_root
    ),
    check=_signers_are_survivors,
)
_SAMPLE_REPLY: Message[tuple[int, ...]] = Message(
    Stage.SAMPLE_REPLY, (_Places("drawn"),), make=lambda drawn: drawn
)
_UNMASK_REQUEST = Message(
    Stage.UNMASK_REQUEST,
    (
        _SiteBits("survivors", addressee=True),
        _SiteBits("dropped"),
        Table(
            "signatures",
            "signers",
            (("signatures", Signature()),),
            expect=lambda got: got["drawn"],
            what="signers drawn",
        ),
        One("proof", _Proof()),
    ),
    make=lambda survivors, dropped, signatures, proof: SignedUnmaskRequest(
        UnmaskRequest(survivors, dropped), signatures, proof
    ),
    check=_survivors_and_dropped_are_disjoint,
)
_UNMASK_REPLY = Message(
    Stage.UNMASK_REPLY,
    (
        Table(
            "seed_shares",
            "seed-share-owners",
            (("seed-shares", _SHARE),),
            expect=lambda got: _near(got, got["request"].survivors),
            what="asked for",
        ),
        Table(
            "key_shares",
            "key-share-owners",
            (("key-shares", _SHARE),),
            expect=lambda got: _near(got, got["request"].dropped),
            what="asked for",
        ),
    ),
    make=UnmaskResponse,
    sender=True,
    check=_sender_is_a_survivor,
)


# the codec's functions --------------------------------------------------------------------------


def encode_advertise_request(
    request: AdvertiseRequest, *, round_id: RoundId, site_id: str
) -> RecordDict:
    """The coordinator's request that ``site_id`` advertise its keys for ``round_id``."""
    return _ADVERTISE_REQUEST.encode(vars(request), round_id=round_id, site_id=site_id)


def decode_advertise_request(
    content: RecordDict, *, round_id: RoundId, site_id: str
) -> AdvertiseRequest:
    """The round parameters asked of this site (``bits`` in [1, 62], ``length`` in [1, 2^24])."""
    return _ADVERTISE_REQUEST.decode(content, round_id=round_id, site_id=site_id)


def encode_advertise_reply(keys: AdvertisedKeys, *, round_id: RoundId) -> RecordDict:
    """A site's advertised keys for ``round_id`` (its ``SiteRound.advertised``)."""
    return _ADVERTISE_REPLY.encode(vars(keys), round_id=round_id, site_id=keys.site_id)


def decode_advertise_reply(
    content: RecordDict, *, round_id: RoundId, site_id: str | None = None
) -> AdvertisedKeys:
    """A site's advertised keys, well-formed (``verify_keys`` verifies the signature), from
    ``site_id`` (None: from the site the reply states)."""
    return _ADVERTISE_REPLY.decode(content, round_id=round_id, site_id=site_id)


def encode_share_request(request: ShareRequest, *, round_id: RoundId, site_id: str) -> RecordDict:
    """The addressee's part of the roster and the threshold, sent to ``site_id`` (ids sorted,
    leaves by site id).

    Raises:
        MessageFormatError: An advertisement is listed under another site's id, or
            ``decode_share_request`` would refuse the message.
    """
    part = request.roster
    for site, keys in part.leaves.items():
        if keys.site_id != site:
            raise MessageFormatError(
                f"refusing to send a malformed message: the roster lists the keys of another "
                f"site under {site!r}"
            )
    values = {
        "threshold": request.threshold,
        "graph_degree": request.graph_degree,
        "graph_threshold": request.graph_threshold,
        "roster": part.ids,
        "largest_share": part.largest_share,
        "leaves": part.leaves,
        "proof": part.proof,
    }
    return _SHARE_REQUEST.encode(values, round_id=round_id, site_id=site_id)


def decode_share_request(content: RecordDict, *, round_id: RoundId, site_id: str) -> ShareRequest:
    """This site's part of the roster (its ids sorted and distinct, this site among them and
    among the leaves; ``SiteRound.share`` checks the proof and verifies the signatures) and t,
    a majority of the roster."""
    return _SHARE_REQUEST.decode(content, round_id=round_id, site_id=site_id)


def encode_share_reply(
    sealed: Mapping[str, bytes], *, round_id: RoundId, site_id: str
) -> RecordDict:
    """``site_id``'s sealed shares, keyed by receiver (``SiteRound.share``'s result)."""
    return _SHARE_REPLY.encode(
        {"sealed": sealed}, round_id=round_id, site_id=site_id, roster=[*sealed, site_id]
    )


def decode_share_reply(
    content: RecordDict, *, round_id: RoundId, site_id: str, roster: Collection[str]
) -> dict[str, bytes]:
    """The ciphertexts ``site_id`` sealed, one for each other site of ``roster`` (the roster
    the coordinator broadcast), keyed by receiver."""
    return _SHARE_REPLY.decode(content, round_id=round_id, site_id=site_id, roster=roster)


def encode_mask_request(
    request: MaskRequest,
    *,
    round_id: RoundId,
    site_id: str,
    roster: Sequence[str],
    near: Collection[str] | None = None,
) -> RecordDict:
    """The ciphertexts sealed for ``site_id`` and the participants (a bitmap over ``roster``,
    the sorted ids), sent to ``site_id`` (``near``: its neighbourhood in a sparse masking
    graph)."""
    values = {"participants": site_bits(request.participants, roster), "sealed": request.sealed}
    return _MASK_REQUEST.encode(
        values, round_id=round_id, site_id=site_id, near=near, roster=roster
    )


def decode_mask_request(
    content: RecordDict,
    *,
    round_id: RoundId,
    site_id: str,
    roster: Sequence[str],
    near: Collection[str] | None = None,
) -> MaskRequest:
    """The participants (sites of ``roster``, this site among them) and one ciphertext from
    each other participant, or, with a sparse masking graph, from each other participant of
    ``near`` (its neighbourhood)."""
    return _MASK_REQUEST.decode(
        content, round_id=round_id, site_id=site_id, near=near, roster=roster
    )


def encode_mask_reply(
    masked: FieldVector, *, round_id: RoundId, site_id: str, bits: int
) -> RecordDict:
    """``site_id``'s masked input (``SiteRound.mask``'s result) as n little-endian uint64 words.

    Raises:
        MessageFormatError: ``masked`` is not a 1-D uint64 array of 1 to ``MAX_VECTOR_LENGTH``
            values in ``[0, 2^bits)``.
    """
    length = int(masked.shape[0]) if isinstance(masked, np.ndarray) and masked.ndim == 1 else 0
    return _MASK_REPLY.encode(
        {"masked": masked}, round_id=round_id, site_id=site_id, length=length, bits=bits
    )


def decode_mask_reply(
    content: RecordDict, *, round_id: RoundId, site_id: str, length: int, bits: int
) -> FieldVector:
    """``site_id``'s masked input: a new, writable uint64 vector of ``length`` values < 2^bits.

    Raises:
        MessageFormatError: The message breaks its declaration.
        ConfigError: ``length`` is outside ``[1, MAX_VECTOR_LENGTH]`` (the caller's own value).
    """
    if not 1 <= length <= MAX_VECTOR_LENGTH:
        raise ConfigError(
            f"the masked vector length is {length}: give a length in [1, {MAX_VECTOR_LENGTH}]"
        )
    modulus_mask(bits)
    return _MASK_REPLY.decode(content, round_id=round_id, site_id=site_id, length=length, bits=bits)


def encode_consistency_request(
    request: ConsistencyRequest, *, round_id: RoundId, site_id: str, roster: Sequence[str]
) -> RecordDict:
    """The survivors sent to ``site_id`` (a survivor itself) to sign with its participants, a
    bitmap over ``roster``."""
    values = {"survivors": site_bits(request.survivors, roster)}
    return _CONSISTENCY_REQUEST.encode(values, round_id=round_id, site_id=site_id, roster=roster)


def decode_consistency_request(
    content: RecordDict, *, round_id: RoundId, site_id: str, roster: Sequence[str]
) -> ConsistencyRequest:
    """The survivors, sites of ``roster`` (sorted ids), this site among them."""
    return _CONSISTENCY_REQUEST.decode(content, round_id=round_id, site_id=site_id, roster=roster)


def encode_consistency_reply(signature: bytes, *, round_id: RoundId, site_id: str) -> RecordDict:
    """``site_id``'s signature of its participant and survivor sets (``SiteRound.sign_view``)."""
    return _CONSISTENCY_REPLY.encode({"signature": signature}, round_id=round_id, site_id=site_id)


def decode_consistency_reply(content: RecordDict, *, round_id: RoundId, site_id: str) -> bytes:
    """``site_id``'s signature: a well-formed DER ECDSA P-256 signature (the sites verify it)."""
    return _CONSISTENCY_REPLY.decode(content, round_id=round_id, site_id=site_id)


def encode_sample_request(
    request: SampleRequest, *, round_id: RoundId, site_id: str, roster: Sequence[str]
) -> RecordDict:
    """The coordinator's unmasking request (``plan_unmask``'s result), the signers it forwards
    and their root, sent to ``site_id`` (the sets bitmaps over ``roster``)."""
    values = {
        "survivors": site_bits(request.request.survivors, roster),
        "dropped": site_bits(request.request.dropped, roster),
        "signers": site_bits(request.signers, roster),
        "signatures_root": request.root,
    }
    return _SAMPLE_REQUEST.encode(values, round_id=round_id, site_id=site_id, roster=roster)


def decode_sample_request(
    content: RecordDict, *, round_id: RoundId, site_id: str, roster: Sequence[str]
) -> SampleRequest:
    """The survivors (this site among them), the dropped (disjoint sites of ``roster``), the
    signers (survivors) and a 32-byte root."""
    return _SAMPLE_REQUEST.decode(content, round_id=round_id, site_id=site_id, roster=roster)


def encode_sample_reply(
    drawn: Sequence[int], *, round_id: RoundId, site_id: str, forwarded: int
) -> RecordDict:
    """``site_id``'s draw: the places, among the ``forwarded`` signatures in signer order, of
    those it checks (``SiteRound.draw``)."""
    return _SAMPLE_REPLY.encode(
        {"drawn": drawn}, round_id=round_id, site_id=site_id, forwarded=forwarded
    )


def decode_sample_reply(
    content: RecordDict, *, round_id: RoundId, site_id: str, forwarded: int
) -> tuple[int, ...]:
    """``site_id``'s draw: one to ``MAX_SITES`` places, strictly increasing, below
    ``forwarded``."""
    return _SAMPLE_REPLY.decode(content, round_id=round_id, site_id=site_id, forwarded=forwarded)


def encode_unmask_request(
    request: SignedUnmaskRequest,
    *,
    round_id: RoundId,
    site_id: str,
    roster: Sequence[str],
    drawn: Collection[str],
) -> RecordDict:
    """The unmasking request (its sets bitmaps over ``roster``) with the signatures of the
    signers ``site_id`` drew and their multiproof, sent to ``site_id``."""
    values = {
        "survivors": site_bits(request.request.survivors, roster),
        "dropped": site_bits(request.request.dropped, roster),
        "signatures": request.signatures,
        "proof": request.proof,
    }
    return _UNMASK_REQUEST.encode(
        values, round_id=round_id, site_id=site_id, roster=roster, drawn=drawn
    )


def decode_unmask_request(
    content: RecordDict,
    *,
    round_id: RoundId,
    site_id: str,
    roster: Sequence[str],
    drawn: Collection[str],
) -> SignedUnmaskRequest:
    """The survivors (this site among them) and the dropped, disjoint sites of ``roster``; one
    well-formed signature of each signer in ``drawn`` (what this site drew), no other; and a
    Merkle proof."""
    return _UNMASK_REQUEST.decode(
        content, round_id=round_id, site_id=site_id, roster=roster, drawn=drawn
    )


def encode_unmask_reply(response: UnmaskResponse, *, round_id: RoundId) -> RecordDict:
    """A survivor's answer (``SiteRound.answer``'s result)."""
    asked = UnmaskRequest(frozenset(response.seed_shares), frozenset(response.key_shares))
    return _UNMASK_REPLY.encode(
        vars(response), round_id=round_id, site_id=response.site_id, request=asked
    )


def decode_unmask_reply(
    content: RecordDict,
    *,
    round_id: RoundId,
    site_id: str,
    request: UnmaskRequest,
    near: Collection[str] | None = None,
) -> UnmaskResponse:
    """A survivor's shares: one ``SHARE_BYTES`` share per site ``request`` named, no other
    (``near``: with a sparse masking graph, per site of the sender's neighbourhood it named)."""
    return _UNMASK_REPLY.decode(
        content, round_id=round_id, site_id=site_id, request=request, near=near
    )
