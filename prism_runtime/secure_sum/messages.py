"""The wire format of a secure-sum round: one codec for the coordinator and the sites.

A round has four exchanges (docs/design.md §3.3), each a request from the coordinator and a
reply from each site; every message is a ``RecordDict`` with one ``ConfigRecord`` (``wire``):

=====================  =====================================================================
message                payload fields (besides ``format``, ``stage``, ``run-id``,
                       ``server-round`` and ``site-id``: addressee or sender)
=====================  =====================================================================
advertise-request      ``bits`` (b), ``length`` (n, the masked vector's public length)
advertise-reply        ``mask-public``, ``share-public``, ``seed-commitment`` (32 bytes each),
                       ``signature`` (DER ECDSA P-256): the site's ``AdvertisedKeys``
share-request          ``threshold`` (t); the roster as parallel lists, sorted by site id:
                       ``roster``, ``roster-mask-public``, ``roster-share-public``,
                       ``roster-seed-commitment``, ``roster-signature``
share-reply            ``receivers`` and ``sealed-shares``: one sealed ``SharePair`` per other
                       site of the roster
mask-request           ``participants`` (U2); ``senders`` and ``sealed-shares``: the
                       ciphertexts the other participants sealed for the addressee
mask-reply             ``length`` (n) and ``masked-input``: n little-endian uint64 values
unmask-request         ``survivors`` and ``dropped`` (disjoint)
unmask-reply           ``seed-share-owners``/``seed-shares`` and ``key-share-owners``/
                       ``key-shares``: exactly the shares the request asked for
=====================  =====================================================================

Every ``decode_*`` takes the ``RoundId`` and the site the receiver expects, checks the whole
message against its stage's rules before it builds anything (types, exact key set, sizes, lists
of at most ``MAX_SITES`` distinct site ids, the cross-field rules listed in each docstring) and
raises ``MessageFormatError`` naming the field. Every ``encode_*`` builds the message and then
decodes it, so a side never sends what the other side refuses (``MessageFormatError`` prefixed
"refusing to send").

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
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import RecordDict

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum.field import MAX_BITS, FieldVector, modulus_mask
from prism_runtime.secure_sum.keys import KEY_BYTES, AdvertisedKeys, RoundId, noise_share_bytes
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
    MessageFormatError,
    MessageReader,
    Stage,
    check_signature,
    new_message,
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
    "MaskRequest",
    "MessageFormatError",
    "ShareRequest",
    "Stage",
    "decode_advertise_reply",
    "decode_advertise_request",
    "decode_mask_reply",
    "decode_mask_request",
    "decode_share_reply",
    "decode_share_request",
    "decode_unmask_reply",
    "decode_unmask_request",
    "encode_advertise_reply",
    "encode_advertise_request",
    "encode_mask_reply",
    "encode_mask_request",
    "encode_share_reply",
    "encode_share_request",
    "encode_unmask_reply",
    "encode_unmask_request",
]

_WORD = 8  # bytes per uint64 coordinate on the wire
_ROSTER = (
    "roster",
    "roster-mask-public",
    "roster-share-public",
    "roster-seed-commitment",
    "roster-signature",
    "roster-noise-share",
)


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
    """The roster of advertised keys (``U1``, keyed by site id) and the threshold t."""

    roster: Mapping[str, AdvertisedKeys]
    threshold: int


@dataclass(frozen=True)
class MaskRequest:
    """The ciphertexts sealed for the addressee, keyed by sender, and the participants ``U2``."""

    sealed: Mapping[str, bytes]
    participants: frozenset[str]


def _sent(content: RecordDict, check: Callable[[RecordDict], object]) -> RecordDict:
    try:
        check(content)
    except MessageFormatError as err:
        raise MessageFormatError(f"refusing to send a malformed message: {err}") from None
    return content


# advertise ------------------------------------------------------------------------------------


def encode_advertise_request(
    request: AdvertiseRequest, *, round_id: RoundId, site_id: str
) -> RecordDict:
    """The coordinator's request that ``site_id`` advertise its keys for ``round_id``."""
    content = new_message(
        Stage.ADVERTISE_REQUEST,
        round_id=round_id,
        site_id=site_id,
        payload={"bits": request.bits, "length": request.length},
    )
    return _sent(content, lambda c: decode_advertise_request(c, round_id=round_id, site_id=site_id))


def decode_advertise_request(
    content: RecordDict, *, round_id: RoundId, site_id: str
) -> AdvertiseRequest:
    """The round parameters asked of this site (``bits`` in [1, 62], ``length`` in [1, 2^24]).

    Raises:
        MessageFormatError: The message is malformed, or for another stage, round or site.
    """
    read = MessageReader(
        content,
        stage=Stage.ADVERTISE_REQUEST,
        payload=("bits", "length"),
        round_id=round_id,
        site_id=site_id,
    )
    return AdvertiseRequest(
        bits=read.integer("bits", low=1, high=MAX_BITS),
        length=read.integer("length", low=1, high=MAX_VECTOR_LENGTH),
    )


_KEY_FIELDS = ("mask-public", "share-public", "seed-commitment", "signature")
_NOISE = "noise-share"
_NOISE_MAX = 2.0**50  # prism_core.distributed.MU_SHARE_MAX: larger draws are not exact


def _noise_share(read: MessageReader, key: str, value: bytes) -> float:
    (share,) = struct.unpack("<d", value)
    if not (math.isfinite(share) and 0 <= share <= _NOISE_MAX):
        raise read.fail(key, f"holds a noise share outside [0, {_NOISE_MAX:g}]")
    return float(share)


def encode_advertise_reply(keys: AdvertisedKeys, *, round_id: RoundId) -> RecordDict:
    """A site's advertised keys for ``round_id`` (its ``SiteRound.advertised``)."""
    content = new_message(
        Stage.ADVERTISE_REPLY,
        round_id=round_id,
        site_id=keys.site_id,
        payload={
            **dict(
                zip(
                    _KEY_FIELDS,
                    (keys.mask_public, keys.share_public, keys.seed_commitment, keys.signature),
                    strict=True,
                )
            ),
            _NOISE: noise_share_bytes(keys.noise_share),
        },
    )
    return _sent(
        content, lambda c: decode_advertise_reply(c, round_id=round_id, site_id=keys.site_id)
    )


def decode_advertise_reply(
    content: RecordDict, *, round_id: RoundId, site_id: str | None = None
) -> AdvertisedKeys:
    """A site's advertised keys, well-formed (the signature is verified by ``verify_keys``).

    Args:
        content: The reply's content.
        round_id: The round the coordinator asked for.
        site_id: The site the reply must come from; None takes the site id the reply states.

    Raises:
        MessageFormatError: The message is malformed, or for another stage, round or site; a
            public key or the commitment is not 32 bytes; the signature is not DER ECDSA P-256.
    """
    read = MessageReader(
        content,
        stage=Stage.ADVERTISE_REPLY,
        payload=(*_KEY_FIELDS, _NOISE),
        round_id=round_id,
        site_id=site_id,
    )
    mask, share, commitment = (
        read.blob(key, low=KEY_BYTES, high=KEY_BYTES) for key in _KEY_FIELDS[:3]
    )
    signature = read.blob("signature", low=SIGNATURE_MIN_BYTES, high=SIGNATURE_MAX_BYTES)
    check_signature(signature, stage=read.stage, key="signature")
    noise = _noise_share(read, _NOISE, read.blob(_NOISE, low=8, high=8))
    return AdvertisedKeys(read.site_id, mask, share, commitment, signature, noise)


# share ----------------------------------------------------------------------------------------


def encode_share_request(request: ShareRequest, *, round_id: RoundId, site_id: str) -> RecordDict:
    """The roster and threshold broadcast to ``site_id`` (the roster is sent sorted by site id).

    Raises:
        MessageFormatError: An advertisement is listed under another site's id, or any rule of
            ``decode_share_request`` fails.
    """
    entries = [request.roster[site] for site in sorted(request.roster)]
    for site in sorted(request.roster):
        if request.roster[site].site_id != site:
            raise MessageFormatError(
                f"refusing to send a malformed message: the roster lists the keys of another "
                f"site under {site!r}"
            )
    content = new_message(
        Stage.SHARE_REQUEST,
        round_id=round_id,
        site_id=site_id,
        payload={
            "threshold": request.threshold,
            "roster": [k.site_id for k in entries],
            "roster-mask-public": [k.mask_public for k in entries],
            "roster-share-public": [k.share_public for k in entries],
            "roster-seed-commitment": [k.seed_commitment for k in entries],
            "roster-signature": [k.signature for k in entries],
            "roster-noise-share": [noise_share_bytes(k.noise_share) for k in entries],
        },
    )
    return _sent(content, lambda c: decode_share_request(c, round_id=round_id, site_id=site_id))


def decode_share_request(content: RecordDict, *, round_id: RoundId, site_id: str) -> ShareRequest:
    """The roster (1 to ``MAX_SITES`` distinct sites, this one among them) and t.

    Every roster list holds one item per site; keys and commitments are 32 bytes, signatures
    well-formed DER ECDSA P-256 (``SiteRound.share`` verifies them); ``len(roster) / 2 < t <=
    len(roster)``.

    Raises:
        MessageFormatError: Any of these rules fails, or the message is for another stage, round
            or site.
    """
    read = MessageReader(
        content,
        stage=Stage.SHARE_REQUEST,
        payload=("threshold", *_ROSTER),
        round_id=round_id,
        site_id=site_id,
    )
    sites = read.sites("roster")
    n = len(sites)
    if site_id not in sites:
        raise read.fail("roster", f"does not list the addressee {site_id!r}")
    masks, shares, commitments = (
        read.blobs(key, count=n, low=KEY_BYTES, high=KEY_BYTES) for key in _ROSTER[1:4]
    )
    signatures = read.blobs(
        "roster-signature", count=n, low=SIGNATURE_MIN_BYTES, high=SIGNATURE_MAX_BYTES
    )
    for signature in signatures:
        check_signature(signature, stage=read.stage, key="roster-signature")
    key = "roster-noise-share"
    noises = [_noise_share(read, key, v) for v in read.blobs(key, count=n, low=8, high=8)]
    threshold = read.integer("threshold", low=1, high=MAX_SITES)
    if not n / 2 < threshold <= n:
        raise read.fail(
            "threshold",
            f"is {threshold} with {n} roster sites, not a majority of them ({n // 2 + 1}..{n})",
        )
    roster = {
        site: AdvertisedKeys(site, mask, share, commitment, signature, noise)
        for site, mask, share, commitment, signature, noise in zip(
            sites, masks, shares, commitments, signatures, noises, strict=True
        )
    }
    return ShareRequest(roster=roster, threshold=threshold)


def encode_share_reply(
    sealed: Mapping[str, bytes], *, round_id: RoundId, site_id: str
) -> RecordDict:
    """``site_id``'s sealed shares, keyed by receiver (``SiteRound.share``'s result)."""
    receivers = sorted(sealed)
    content = new_message(
        Stage.SHARE_REPLY,
        round_id=round_id,
        site_id=site_id,
        payload={"receivers": receivers, "sealed-shares": [sealed[r] for r in receivers]},
    )
    roster = [*receivers, site_id]
    return _sent(
        content,
        lambda c: decode_share_reply(c, round_id=round_id, site_id=site_id, roster=roster),
    )


def decode_share_reply(
    content: RecordDict, *, round_id: RoundId, site_id: str, roster: Collection[str]
) -> dict[str, bytes]:
    """The ciphertexts ``site_id`` sealed, keyed by receiver.

    Args:
        content: The reply's content.
        round_id: The round.
        site_id: The site that was asked.
        roster: The site ids of the roster the coordinator broadcast (``site_id`` among them).

    Raises:
        MessageFormatError: The receivers are not exactly the other sites of the roster, a
            ciphertext is not ``SEALED_SHARES_BYTES`` long, or the message is malformed or for
            another stage, round or site.
    """
    read = MessageReader(
        content,
        stage=Stage.SHARE_REPLY,
        payload=("receivers", "sealed-shares"),
        round_id=round_id,
        site_id=site_id,
    )
    receivers = read.sites("receivers")
    others = set(roster) - {site_id}
    if site_id not in roster or set(receivers) != others:
        raise read.fail(
            "receivers",
            f"lists {len(receivers)} sites, not exactly the {len(others)} other sites of the "
            "roster",
        )
    sealed = read.blobs(
        "sealed-shares", count=len(receivers), low=SEALED_SHARES_BYTES, high=SEALED_SHARES_BYTES
    )
    return dict(zip(receivers, sealed, strict=True))


# mask -----------------------------------------------------------------------------------------


def encode_mask_request(request: MaskRequest, *, round_id: RoundId, site_id: str) -> RecordDict:
    """The ciphertexts sealed for ``site_id`` and the participant list, sent to ``site_id``."""
    senders = sorted(request.sealed)
    content = new_message(
        Stage.MASK_REQUEST,
        round_id=round_id,
        site_id=site_id,
        payload={
            "participants": sorted(request.participants),
            "senders": senders,
            "sealed-shares": [request.sealed[s] for s in senders],
        },
    )
    return _sent(content, lambda c: decode_mask_request(c, round_id=round_id, site_id=site_id))


def decode_mask_request(content: RecordDict, *, round_id: RoundId, site_id: str) -> MaskRequest:
    """The participants (this site among them) and one ciphertext from each other participant.

    Raises:
        MessageFormatError: The senders are not exactly the other participants, a ciphertext is
            not ``SEALED_SHARES_BYTES`` long, or the message is malformed or for another stage,
            round or site.
    """
    read = MessageReader(
        content,
        stage=Stage.MASK_REQUEST,
        payload=("participants", "senders", "sealed-shares"),
        round_id=round_id,
        site_id=site_id,
    )
    participants = frozenset(read.sites("participants"))
    if site_id not in participants:
        raise read.fail("participants", f"does not list the addressee {site_id!r}")
    senders = read.sites("senders")
    if set(senders) != participants - {site_id}:
        raise read.fail(
            "senders",
            f"lists {len(senders)} sites, not exactly the {len(participants) - 1} other "
            "participants",
        )
    sealed = read.blobs(
        "sealed-shares", count=len(senders), low=SEALED_SHARES_BYTES, high=SEALED_SHARES_BYTES
    )
    return MaskRequest(sealed=dict(zip(senders, sealed, strict=True)), participants=participants)


def encode_mask_reply(
    masked: FieldVector, *, round_id: RoundId, site_id: str, bits: int
) -> RecordDict:
    """``site_id``'s masked input (``SiteRound.mask``'s result) as n little-endian uint64 words.

    Raises:
        MessageFormatError: ``masked`` is not a 1-D uint64 array of 1 to ``MAX_VECTOR_LENGTH``
            values in ``[0, 2^bits)``.
    """
    if not isinstance(masked, np.ndarray) or masked.dtype != np.uint64 or masked.ndim != 1:
        raise MessageFormatError(
            "refusing to send a malformed message: field 'masked-input' must be a 1-D numpy "
            f"uint64 vector, not a {type(masked).__name__} {getattr(masked, 'dtype', '')}"
        )
    length = int(masked.shape[0])
    content = new_message(
        Stage.MASK_REPLY,
        round_id=round_id,
        site_id=site_id,
        payload={"length": length, "masked-input": masked.astype("<u8", copy=False).tobytes()},
    )
    return _sent(
        content,
        lambda c: decode_mask_reply(
            c, round_id=round_id, site_id=site_id, length=length, bits=bits
        ),
    )


def decode_mask_reply(
    content: RecordDict, *, round_id: RoundId, site_id: str, length: int, bits: int
) -> FieldVector:
    """``site_id``'s masked input: a new, writable uint64 vector of ``length`` values < 2^bits.

    The declared ``length`` must be the round's and ``masked-input`` exactly ``8 length`` bytes;
    both are checked before the bytes are read.

    Raises:
        MessageFormatError: The length, the byte count or a value is wrong, or the message is
            malformed or for another stage, round or site.
        ConfigError: ``length`` is outside ``[1, MAX_VECTOR_LENGTH]`` (the caller's own value).
    """
    if not 1 <= length <= MAX_VECTOR_LENGTH:
        raise ConfigError(
            f"the masked vector length is {length}: give a length in [1, {MAX_VECTOR_LENGTH}]"
        )
    mask = modulus_mask(bits)
    read = MessageReader(
        content,
        stage=Stage.MASK_REPLY,
        payload=("length", "masked-input"),
        round_id=round_id,
        site_id=site_id,
    )
    declared = read.integer("length", low=1, high=MAX_VECTOR_LENGTH)
    if declared != length:
        raise read.fail("length", f"is {declared}, not the round's vector length {length}")
    data = read.blob("masked-input", low=_WORD * length, high=_WORD * length)
    vector = np.frombuffer(data, dtype="<u8")
    if np.any(vector > mask):
        raise read.fail("masked-input", f"holds a value >= 2^{bits}")
    return vector.astype(np.uint64)


# unmask ---------------------------------------------------------------------------------------


def encode_unmask_request(request: UnmaskRequest, *, round_id: RoundId, site_id: str) -> RecordDict:
    """The coordinator's unmasking request (``plan_unmask``'s result), sent to ``site_id``."""
    content = new_message(
        Stage.UNMASK_REQUEST,
        round_id=round_id,
        site_id=site_id,
        payload={"survivors": sorted(request.survivors), "dropped": sorted(request.dropped)},
    )
    return _sent(content, lambda c: decode_unmask_request(c, round_id=round_id, site_id=site_id))


def decode_unmask_request(content: RecordDict, *, round_id: RoundId, site_id: str) -> UnmaskRequest:
    """The survivors (this site among them) and the dropped: disjoint, ``MAX_SITES`` in all.

    Raises:
        MessageFormatError: A site is both survivor and dropped, the lists hold more than
            ``MAX_SITES`` sites together, this site is not a survivor, or the message is
            malformed or for another stage, round or site.
    """
    read = MessageReader(
        content,
        stage=Stage.UNMASK_REQUEST,
        payload=("survivors", "dropped"),
        round_id=round_id,
        site_id=site_id,
    )
    survivors = frozenset(read.sites("survivors"))
    dropped = frozenset(read.sites("dropped"))
    if len(survivors) + len(dropped) > MAX_SITES:
        raise read.fail("dropped", f"with the survivors names more than {MAX_SITES} sites")
    both = sorted(survivors & dropped)
    if both:
        raise read.fail("dropped", f"also names survivors {both[:5]} ({len(both)} in all)")
    if site_id not in survivors:
        raise read.fail("survivors", f"does not list the addressee {site_id!r}")
    return UnmaskRequest(survivors, dropped)


_SHARE_BOOKS = (
    ("seed-share-owners", "seed-shares"),
    ("key-share-owners", "key-shares"),
)


def encode_unmask_reply(response: UnmaskResponse, *, round_id: RoundId) -> RecordDict:
    """A survivor's answer (``SiteRound.answer``'s result)."""
    seeds, keys = sorted(response.seed_shares), sorted(response.key_shares)
    content = new_message(
        Stage.UNMASK_REPLY,
        round_id=round_id,
        site_id=response.site_id,
        payload={
            "seed-share-owners": seeds,
            "seed-shares": [response.seed_shares[s] for s in seeds],
            "key-share-owners": keys,
            "key-shares": [response.key_shares[s] for s in keys],
        },
    )
    asked = UnmaskRequest(frozenset(seeds), frozenset(keys))
    return _sent(
        content,
        lambda c: decode_unmask_reply(
            c, round_id=round_id, site_id=response.site_id, request=asked
        ),
    )


def decode_unmask_reply(
    content: RecordDict, *, round_id: RoundId, site_id: str, request: UnmaskRequest
) -> UnmaskResponse:
    """A survivor's shares: one ``SHARE_BYTES`` share per site the request named, no other.

    Raises:
        MessageFormatError: The seed-share owners are not exactly the survivors or the key-share
            owners not exactly the dropped, a share is not ``SHARE_BYTES`` long, ``site_id`` is
            not a survivor, or the message is malformed or for another stage, round or site.
    """
    read = MessageReader(
        content,
        stage=Stage.UNMASK_REPLY,
        payload=[key for book in _SHARE_BOOKS for key in book],
        round_id=round_id,
        site_id=site_id,
    )
    if site_id not in request.survivors:
        raise read.fail("site-id", f"names {site_id!r}, which is not a survivor")
    books: list[dict[str, bytes]] = []
    for (owners_key, shares_key), asked in zip(
        _SHARE_BOOKS, (request.survivors, request.dropped), strict=True
    ):
        owners = read.sites(owners_key)
        if set(owners) != asked:
            raise read.fail(
                owners_key, f"lists {len(owners)} sites, not exactly the {len(asked)} asked for"
            )
        shares = read.blobs(shares_key, count=len(owners), low=SHARE_BYTES, high=SHARE_BYTES)
        books.append(dict(zip(owners, shares, strict=True)))
    return UnmaskResponse(site_id=site_id, seed_shares=books[0], key_shares=books[1])
