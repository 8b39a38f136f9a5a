"""The wire format of a secure-sum round (prism_runtime.secure_sum.messages).

One round of four sites (threshold 3, b = 32) runs every exchange through ``encode_*``, Flower's
protobuf serialisation of the ``RecordDict`` and ``decode_*`` on the other side; one site drops
after the share exchange, the three survivors sign their sets, and the sum of the three
survivors is compared exactly (integers, no
tolerance). Each message of that round is then mutated one field at a time: every mutation is
refused with a ``MessageFormatError`` that names the field and quotes no bytes. Oversize fields
are refused before the decoder allocates (measured with ``tracemalloc``).
"""

from __future__ import annotations

import dataclasses
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum import (
    AdvertisedKeys,
    RosterPart,
    RoundId,
    RoundTrust,
    SecureSumError,
    SignatureBook,
    SiteRound,
    UnmaskRequest,
    UnmaskResponse,
    centre,
    encode_signed,
    plan_unmask,
    unmask_sum,
)
from prism_runtime.secure_sum.messages import (
    MAX_SITES,
    MAX_VECTOR_LENGTH,
    RECORD,
    SEALED_SHARES_BYTES,
    SHARE_BYTES,
    AdvertiseRequest,
    ConsistencyRequest,
    MaskRequest,
    MessageFormatError,
    SampleRequest,
    ShareRequest,
    SignedUnmaskRequest,
    Stage,
    decode_advertise_reply,
    decode_advertise_request,
    decode_consistency_reply,
    decode_consistency_request,
    decode_mask_reply,
    decode_mask_request,
    decode_sample_reply,
    decode_sample_request,
    decode_share_reply,
    decode_share_request,
    decode_unmask_reply,
    decode_unmask_request,
    encode_advertise_reply,
    encode_advertise_request,
    encode_consistency_reply,
    encode_consistency_request,
    encode_mask_reply,
    encode_mask_request,
    encode_sample_reply,
    encode_sample_request,
    encode_share_reply,
    encode_share_request,
    encode_unmask_reply,
    encode_unmask_request,
)

ROUND = RoundId("run-7", 3)
SITES = ("s0", "s1", "s2", "s3")
DROPS = "s2"
"""The site that shares its secrets and then never sends its masked input."""
THRESHOLD = 3
TRUST = RoundTrust(4, 1)
"""Every site counts on the four being honest and tolerates one missing: least t = 3."""
BITS = 32
LENGTH = 64
BOUND = 1000
"""Per-coordinate bound of the plain inputs (4 x 1000 < 2^31: the centred sum is exact)."""
SITE = "s0"
"""The site whose messages are mutated (addressee of the requests, sender of the replies)."""


def over_the_wire(content: RecordDict) -> RecordDict:
    """``content`` serialised to protobuf bytes and parsed back, as Flower sends a message."""
    data = recorddict_to_proto(content).SerializeToString()
    proto = ProtoRecordDict()
    proto.ParseFromString(data)
    return recorddict_from_proto(proto)


Decoder = Callable[[RecordDict], object]


@dataclass
class Played:
    """A round played through the codec: the sum, and one message of each stage."""

    total: np.ndarray
    expected: np.ndarray
    sent: dict[Stage, tuple[object, RecordDict, Decoder]] = field(default_factory=dict)
    """Per stage: the object encoded, its message, and the receiver's decoder with its context."""


def play_round() -> Played:
    """Four sites, one dropping after the share exchange, every message through the wire."""
    identities = {s: ec.generate_private_key(ec.SECP256R1()) for s in SITES}
    registered = {s: key.public_key() for s, key in identities.items()}
    rng = np.random.default_rng(7)  # test data only
    plain = {s: rng.integers(-BOUND, BOUND, size=LENGTH, endpoint=True) for s in SITES}
    sent: dict[Stage, tuple[object, RecordDict, Decoder]] = {}

    def send(
        stage: Stage,
        site: str,
        obj: object,
        content: RecordDict,
        decode: Decoder,
        kept: Decoder | None = None,
    ) -> Any:
        """Decode ``content`` after the wire; keep SITE's message with ``kept or decode``."""
        if site == SITE:
            sent[stage] = (obj, content, kept or decode)
        return decode(over_the_wire(content))

    # (1) advertise
    params = AdvertiseRequest(bits=BITS, length=LENGTH)
    sites: dict[str, SiteRound] = {}
    roster: dict[str, AdvertisedKeys] = {}
    for s in SITES:
        asked = send(
            Stage.ADVERTISE_REQUEST,
            s,
            params,
            encode_advertise_request(params, round_id=ROUND, site_id=s),
            lambda c, s=s: decode_advertise_request(c, round_id=ROUND, site_id=s),
        )
        sites[s] = SiteRound(
            site_id=s,
            round_id=ROUND,
            identity_key=identities[s],
            bits=asked.bits,
            noise_share=12.5,
            trust=TRUST,
        )
        keys = sites[s].advertised
        advertised = send(
            Stage.ADVERTISE_REPLY,
            s,
            keys,
            encode_advertise_reply(keys, round_id=ROUND),
            lambda c: decode_advertise_reply(c, round_id=ROUND),  # the coordinator learns the id
            lambda c, s=s: decode_advertise_reply(c, round_id=ROUND, site_id=s),
        )
        roster[advertised.site_id] = advertised

    # (2) share
    request = ShareRequest(roster=RosterPart.whole(roster), threshold=THRESHOLD)
    boxes: dict[str, dict[str, bytes]] = {}
    for s in SITES:
        got = send(
            Stage.SHARE_REQUEST,
            s,
            request,
            encode_share_request(request, round_id=ROUND, site_id=s),
            lambda c, s=s: decode_share_request(c, round_id=ROUND, site_id=s),
        )
        sealed = sites[s].share(got.roster, registered=registered, threshold=got.threshold)
        boxes[s] = send(
            Stage.SHARE_REPLY,
            s,
            sealed,
            encode_share_reply(sealed, round_id=ROUND, site_id=s),
            lambda c, s=s: decode_share_reply(c, round_id=ROUND, site_id=s, roster=list(roster)),
        )

    # (3) mask
    participants = frozenset(boxes)
    masked: dict[str, np.ndarray] = {}
    for s in SITES:
        forward = MaskRequest(
            sealed={sender: boxes[sender][s] for sender in participants - {s}},
            participants=participants,
        )
        got = send(
            Stage.MASK_REQUEST,
            s,
            forward,
            encode_mask_request(forward, round_id=ROUND, site_id=s, roster=SITES),
            lambda c, s=s: decode_mask_request(c, round_id=ROUND, site_id=s, roster=SITES),
        )
        sites[s].receive(got.sealed)
        vector = sites[s].mask(
            encode_signed(plain[s], bits=BITS, bound=BOUND), participants=got.participants
        )
        if s == DROPS:
            continue
        masked[s] = send(
            Stage.MASK_REPLY,
            s,
            vector,
            encode_mask_reply(vector, round_id=ROUND, site_id=s, bits=BITS),
            lambda c, s=s: decode_mask_reply(
                c, round_id=ROUND, site_id=s, length=LENGTH, bits=BITS
            ),
        )

    # (4) consistency
    plan = plan_unmask(masked, participants=participants, threshold=THRESHOLD)
    signatures: dict[str, bytes] = {}
    for s in sorted(plan.survivors):
        ask = ConsistencyRequest(survivors=plan.survivors)
        got = send(
            Stage.CONSISTENCY_REQUEST,
            s,
            ask,
            encode_consistency_request(ask, round_id=ROUND, site_id=s, roster=SITES),
            lambda c, s=s: decode_consistency_request(c, round_id=ROUND, site_id=s, roster=SITES),
        )
        signature = sites[s].sign_view(got.survivors, identity_key=identities[s])
        signatures[s] = send(
            Stage.CONSISTENCY_REPLY,
            s,
            signature,
            encode_consistency_reply(signature, round_id=ROUND, site_id=s),
            lambda c, s=s: decode_consistency_reply(c, round_id=ROUND, site_id=s),
        )

    # (5) sample: the signatures committed, each survivor's draw (all three: the complete graph)
    book = SignatureBook(signatures)
    sample = SampleRequest(request=plan, signers=frozenset(book.signers), root=book.root)
    answers = []
    for s in sorted(plan.survivors):
        got = send(
            Stage.SAMPLE_REQUEST,
            s,
            sample,
            encode_sample_request(sample, round_id=ROUND, site_id=s, roster=SITES),
            lambda c, s=s: decode_sample_request(c, round_id=ROUND, site_id=s, roster=SITES),
        )
        drawn = sites[s].draw(got.request, signers=got.signers, root=got.root)
        forwarded = len(book.signers)
        drawn = send(
            Stage.SAMPLE_REPLY,
            s,
            drawn,
            encode_sample_reply(drawn, round_id=ROUND, site_id=s, forwarded=forwarded),
            lambda c, s=s, f=forwarded: decode_sample_reply(
                c, round_id=ROUND, site_id=s, forwarded=f
            ),
        )
        # (6) unmask: the drawn signatures opened against the root
        opened, proof = book.open(drawn)
        signed = SignedUnmaskRequest(request=plan, signatures=opened, proof=proof)
        got = send(
            Stage.UNMASK_REQUEST,
            s,
            signed,
            encode_unmask_request(signed, round_id=ROUND, site_id=s, roster=SITES, drawn=opened),
            lambda c, s=s, d=tuple(opened): decode_unmask_request(
                c, round_id=ROUND, site_id=s, roster=SITES, drawn=d
            ),
        )
        answer = sites[s].reveal(
            got.request, signatures=got.signatures, proof=got.proof, registered=registered
        )
        answers.append(
            send(
                Stage.UNMASK_REPLY,
                s,
                answer,
                encode_unmask_reply(answer, round_id=ROUND),
                lambda c, s=s: decode_unmask_reply(c, round_id=ROUND, site_id=s, request=plan),
            )
        )
    total = unmask_sum(
        masked,
        answers,
        roster=roster,
        participants=participants,
        threshold=THRESHOLD,
        bits=BITS,
        round_id=ROUND,
    )
    expected = sum(plain[s] for s in SITES if s != DROPS)
    return Played(total=centre(total, bits=BITS), expected=np.asarray(expected), sent=sent)


@pytest.fixture(scope="module")
def played() -> Played:
    return play_round()


def test_full_round_through_the_codec_gives_the_exact_sum_with_one_site_dropping(
    played: Played,
) -> None:
    assert played.expected.shape == (LENGTH,)
    np.testing.assert_array_equal(played.total, played.expected)
    assert set(played.sent) == set(Stage)


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    return a == b


@pytest.mark.parametrize("stage", list(Stage))
def test_every_message_round_trips_exactly(played: Played, stage: Stage) -> None:
    obj, content, decode = played.sent[stage]
    decoded = decode(over_the_wire(content))
    assert type(decoded) is type(obj)
    assert _same(decoded, obj)


def test_decoded_objects_have_the_types_the_site_round_uses(played: Played) -> None:
    vector = played.sent[Stage.MASK_REPLY][2](played.sent[Stage.MASK_REPLY][1])
    assert isinstance(vector, np.ndarray) and vector.dtype == np.uint64 and vector.flags.writeable
    share = played.sent[Stage.SHARE_REQUEST][2](played.sent[Stage.SHARE_REQUEST][1])
    assert isinstance(share, ShareRequest)
    assert all(type(k) is AdvertisedKeys for k in share.roster.leaves.values())
    assert share.roster.ids == SITES and share.roster.proof == ()  # the whole roster
    sealed = played.sent[Stage.SHARE_REPLY][0]
    assert isinstance(sealed, dict)
    assert {len(c) for c in sealed.values()} == {SEALED_SHARES_BYTES}
    answer = played.sent[Stage.UNMASK_REPLY][0]
    assert isinstance(answer, UnmaskResponse)
    assert {len(v) for v in answer.seed_shares.values()} == {SHARE_BYTES}


# malformed messages ---------------------------------------------------------------------------

DELETE = object()


@dataclass(frozen=True)
class Change:
    """Field ``key`` replaced by ``new(old value)`` (removed when ``new`` returns ``DELETE``);
    the decoder must name ``key`` when it refuses the result."""

    key: str
    new: Callable[[Any], Any]


def put(key: str, value: Any) -> Change:
    return Change(key, lambda _: value)


def drop(key: str) -> Change:
    return Change(key, lambda _: DELETE)


def at(key: str, i: int, value: Any) -> Change:
    """Item ``i`` of list field ``key`` replaced by ``value``."""
    return Change(key, lambda items: [value if j == i else v for j, v in enumerate(items)])


def cut(key: str, start: int | None, stop: int | None) -> Change:
    """List or bytes field ``key`` sliced to ``[start:stop]``."""
    return Change(key, lambda items: items[start:stop])


def add(key: str, extra: Any) -> Change:
    """List or bytes field ``key`` with ``extra`` appended."""
    return Change(key, lambda items: items + extra)


def mutated(content: RecordDict, change: Change) -> RecordDict:
    """A copy of ``content`` with ``change`` applied to its one ConfigRecord's fields."""
    fields = dict(content[RECORD])
    value = change.new(fields.get(change.key))
    if value is DELETE:
        del fields[change.key]
    else:
        fields[change.key] = value
    return RecordDict({RECORD: ConfigRecord(fields)})


NOT_DER = bytes(70)
MANY = [f"x{i}" for i in range(MAX_SITES + 1)]
SEALED = SEALED_SHARES_BYTES

ENVELOPE_CASES: dict[str, Change] = {
    "format-wrong": put("format", "prism-fl secure-sum v0"),
    "format-missing": drop("format"),
    "stage-wrong": put("stage", "mask-reply-ish"),
    "run-id-other-run": put("run-id", "run-8"),
    "run-id-int": put("run-id", 7),
    "server-round-other": put("server-round", 4),
    "server-round-negative": put("server-round", -1),
    "server-round-str": put("server-round", "3"),
    "server-round-bool": put("server-round", True),
    "site-id-other-site": put("site-id", "s9"),
    "site-id-empty": put("site-id", ""),
    "site-id-long": put("site-id", "s" * 129),
    "site-id-control": put("site-id", "s0\n"),
    "site-id-bytes": put("site-id", b"s0"),
    "site-id-missing": drop("site-id"),
    "extra-field": put("extra", 1),
}

STAGE_CASES: dict[Stage, dict[str, Change]] = {
    Stage.ADVERTISE_REQUEST: {
        "bits-zero": put("bits", 0),
        "bits-63": put("bits", 63),
        "bits-float": put("bits", 32.0),
        "length-zero": put("length", 0),
        "length-1e12": put("length", 10**12),
        "length-missing": drop("length"),
    },
    Stage.ADVERTISE_REPLY: {
        "mask-public-31": cut("mask-public", None, 31),
        "share-public-33": add("share-public", b"\0"),
        "share-public-str": put("share-public", "k" * 32),
        "commitment-empty": put("seed-commitment", b""),
        "signature-7": put("signature", bytes(7)),
        "signature-73": put("signature", bytes(73)),
        "signature-not-der": put("signature", NOT_DER),
        "signature-trailing-byte": add("signature", b"\0"),
        "signature-r-zero": put("signature", encode_dss_signature(0, 1)),
        "signature-missing": drop("signature"),
        "honest-sites-zero": put("honest-sites", bytes(4)),
        "honest-sites-int": put("honest-sites", 4),
        "honest-sites-above-max": put("honest-sites", (MAX_SITES + 1).to_bytes(4, "big")),
        "max-dropouts-3-bytes": put("max-dropouts", bytes(3)),
        "max-dropouts-missing": drop("max-dropouts"),
    },
    Stage.SHARE_REQUEST: {
        "roster-duplicate": at("roster", 1, "s0"),
        "roster-over-max": put("roster", MANY),
        "roster-not-list": put("roster", "s0"),
        "roster-ints": put("roster", [0, 1, 2, 3]),
        "roster-empty-id": at("roster", 3, ""),
        "roster-long-id": at("roster", 3, "s" * 129),
        "roster-no-addressee": at("roster", 0, "s9"),
        "roster-unsorted": put("roster", ["s1", "s0", "s2", "s3"]),
        "largest-share-7-bytes": put("largest-share", bytes(7)),
        "largest-share-nan": put("largest-share", b"\x00\x00\x00\x00\x00\x00\xf8\x7f"),
        "largest-share-negative": put("largest-share", b"\x00\x00\x00\x00\x00\x00\xf0\xbf"),
        "leaves-no-addressee": at("leaves", 0, "s9"),
        "leaves-outside-roster": at("leaves", 3, "s9"),
        "leaves-keys-short-list": cut("leaves-mask-public", None, 3),
        "leaves-key-31": at("leaves-share-public", 2, bytes(31)),
        "leaves-commitment-str": put("leaves-seed-commitment", ["c" * 32] * 4),
        "leaves-signature-73": at("leaves-signature", 1, bytes(73)),
        "leaves-signature-not-der": at("leaves-signature", 1, NOT_DER),
        "leaves-honest-sites-zero": at("leaves-honest-sites", 1, bytes(4)),
        "leaves-max-dropouts-short-list": cut("leaves-max-dropouts", None, 3),
        "proof-33-bytes": put("proof", bytes(33)),
        "proof-str": put("proof", "p" * 32),
        "proof-oversize": put("proof", bytes(32 * (2 * MAX_SITES + 1))),
        "proof-missing": drop("proof"),
        "threshold-minority": put("threshold", 2),
        "threshold-above-roster": put("threshold", 5),
        "threshold-zero": put("threshold", 0),
    },
    Stage.SHARE_REPLY: {
        "receivers-one-missing": cut("receivers", None, 2),
        "receivers-include-sender": at("receivers", 0, "s0"),
        "receivers-duplicate": at("receivers", 0, "s2"),
        "receivers-stranger": at("receivers", 0, "s9"),
        "sealed-short-list": cut("sealed-shares", None, 2),
        "sealed-one-byte-short": at("sealed-shares", 1, bytes(SEALED - 1)),
        "sealed-one-byte-long": at("sealed-shares", 1, bytes(SEALED + 1)),
        "sealed-megabyte": at("sealed-shares", 0, bytes(2**20)),
    },
    Stage.MASK_REQUEST: {
        "participants-no-addressee": put("participants", bytes([0b1110])),
        "participants-past-the-roster": put("participants", bytes([0b11111])),
        "participants-two-bytes": put("participants", bytes([0b1111, 0])),
        "participants-list": put("participants", ["s0", "s1", "s2", "s3"]),
        "senders-include-addressee": at("senders", 0, "s0"),
        "senders-duplicate": at("senders", 0, "s2"),
        "senders-one-missing": cut("senders", 1, None),
        "sealed-extra-item": add("sealed-shares", [bytes(SEALED)]),
        "sealed-one-byte-short": at("sealed-shares", 2, bytes(SEALED - 1)),
    },
    Stage.MASK_REPLY: {
        "length-1e12": put("length", 10**12),
        "length-other": put("length", LENGTH + 1),
        "masked-uint32": put("masked-input", bytes(4 * LENGTH)),
        "masked-one-byte-long": add("masked-input", b"\0"),
        "masked-one-word-short": cut("masked-input", 8, None),
        "masked-list-of-ints": put("masked-input", list(range(LENGTH))),
        "masked-list-of-floats": put("masked-input", [0.0] * LENGTH),
        "masked-value-2^b": put("masked-input", (1 << BITS).to_bytes(8, "little") * LENGTH),
        "masked-value-2^64-1": put("masked-input", b"\xff" * 8 * LENGTH),
    },
    Stage.CONSISTENCY_REQUEST: {
        "survivors-no-addressee": put("survivors", bytes([0b1010])),
        "survivors-past-the-roster": put("survivors", bytes([0b10001011])),
        "survivors-empty": put("survivors", b""),
        "survivors-list": put("survivors", ["s0", "s1", "s3"]),
        "survivors-missing": drop("survivors"),
    },
    Stage.CONSISTENCY_REPLY: {
        "signature-not-der": put("signature", NOT_DER),
        "signature-73": put("signature", bytes(73)),
        "signature-list": put("signature", [bytes(70)]),
        "signature-missing": drop("signature"),
    },
    Stage.SAMPLE_REQUEST: {
        "signers-not-survivor": put("signers", bytes([0b0111])),
        "signers-past-the-roster": put("signers", bytes([0b11011])),
        "signers-list": put("signers", ["s0", "s1", "s3"]),
        "survivor-also-dropped": put("dropped", bytes([0b0110])),
        "addressee-not-survivor": put("survivors", bytes([0b1010])),
        "dropped-str": put("dropped", "s2"),
        "signatures-root-31": put("signatures-root", bytes(31)),
        "signatures-root-missing": drop("signatures-root"),
    },
    Stage.SAMPLE_REPLY: {
        "drawn-empty": put("drawn", []),
        "drawn-beyond-forwarded": put("drawn", [0, 1, 3]),
        "drawn-negative": put("drawn", [-1, 0]),
        "drawn-twice": put("drawn", [0, 0, 1]),
        "drawn-unsorted": put("drawn", [1, 0]),
        "drawn-str": put("drawn", ["0"]),
        "drawn-bool": put("drawn", [True]),
        "drawn-over-max": put("drawn", list(range(MAX_SITES + 1))),
    },
    Stage.UNMASK_REQUEST: {
        "signers-not-drawn": at("signers", 0, "s2"),
        "signers-duplicate": at("signers", 1, "s0"),
        "signers-one-missing": cut("signers", 1, None),
        "signatures-short-list": cut("signatures", 1, None),
        "signatures-not-der": at("signatures", 0, NOT_DER),
        "signers-missing": drop("signers"),
        "survivor-also-dropped": put("dropped", bytes([0b0110])),
        "addressee-not-survivor": put("survivors", bytes([0b1010])),
        "dropped-str": put("dropped", "s2"),
        "dropped-past-the-roster": put("dropped", bytes([0b10100])),
        "proof-33-bytes": put("proof", bytes(33)),
    },
    Stage.UNMASK_REPLY: {
        "seed-owner-missing": cut("seed-share-owners", 1, None),
        "seed-owner-dropped-site": at("seed-share-owners", 0, "s2"),
        "seed-owner-duplicate": at("seed-share-owners", 0, "s1"),
        "key-owner-extra": add("key-share-owners", ["s1"]),
        "key-owner-missing": put("key-share-owners", []),
        "seed-shares-short-list": cut("seed-shares", 1, None),
        "seed-share-51": at("seed-shares", 0, bytes(SHARE_BYTES - 1)),
        "key-share-53": at("key-shares", 0, bytes(SHARE_BYTES + 1)),
        "key-shares-str": put("key-shares", ["k" * SHARE_BYTES]),
    },
}


def refused(decode: Decoder, content: RecordDict) -> str:
    """The text of the ``MessageFormatError`` decoding ``content`` raises; it quotes no bytes."""
    with pytest.raises(MessageFormatError) as caught:
        decode(content)
    text = str(caught.value)
    assert "b'" not in text and 'b"' not in text and "\\x" not in text
    assert len(text) < 400
    return text


@pytest.mark.parametrize("stage", list(Stage))
@pytest.mark.parametrize("change", ENVELOPE_CASES.values(), ids=ENVELOPE_CASES.keys())
def test_malformed_envelope_field_is_refused_naming_the_field(
    played: Played, stage: Stage, change: Change
) -> None:
    _, content, decode = played.sent[stage]
    assert f"'{change.key}'" in refused(decode, mutated(content, change))


@pytest.mark.parametrize(
    ("stage", "change"),
    [
        pytest.param(stage, change, id=f"{stage}:{name}")
        for stage, cases in STAGE_CASES.items()
        for name, change in cases.items()
    ],
)
def test_malformed_payload_field_is_refused_naming_the_field(
    played: Played, stage: Stage, change: Change
) -> None:
    _, content, decode = played.sent[stage]
    assert f"'{change.key}'" in refused(decode, mutated(content, change))


@pytest.mark.parametrize("stage", list(Stage))
def test_a_message_for_another_stage_is_refused_naming_the_stage(
    played: Played, stage: Stage
) -> None:
    stages = list(Stage)
    other = stages[(stages.index(stage) + 1) % len(stages)]
    _, content, _ = played.sent[other]
    _, _, decode = played.sent[stage]
    assert "'stage'" in refused(decode, content)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(RecordDict(), id="empty"),
        pytest.param(RecordDict({"other": ConfigRecord({"a": 1})}), id="other-key"),
        pytest.param(RecordDict({RECORD: MetricRecord({"a": 1.0})}), id="metric-record"),
        pytest.param(RecordDict({RECORD: ArrayRecord()}), id="array-record"),
        pytest.param(ConfigRecord({"a": 1}), id="not-a-recorddict"),
    ],
)
def test_content_without_one_secure_sum_config_record_is_refused(
    played: Played, content: Any
) -> None:
    for _, _, decode in played.sent.values():
        text = refused(decode, content)
        assert "RecordDict" in text or f"'{RECORD}'" in text


def test_a_second_record_next_to_the_secure_sum_record_is_refused(played: Played) -> None:
    _, content, decode = played.sent[Stage.MASK_REPLY]
    both = RecordDict({RECORD: content[RECORD], "accounting": ConfigRecord({"a": 1})})
    assert f"'{RECORD}'" in refused(decode, both)


def test_decoders_without_an_expected_sender_take_the_stated_site(played: Played) -> None:
    keys, content, _ = played.sent[Stage.ADVERTISE_REPLY]
    assert decode_advertise_reply(content, round_id=ROUND) == keys
    assert decode_advertise_reply(content, round_id=ROUND, site_id=SITE) == keys
    with pytest.raises(MessageFormatError, match=r"'site-id'"):
        decode_advertise_reply(content, round_id=ROUND, site_id="s1")


def test_unmask_reply_from_a_site_that_is_not_a_survivor_is_refused(played: Played) -> None:
    _, content, _ = played.sent[Stage.UNMASK_REPLY]
    signed = played.sent[Stage.UNMASK_REQUEST][0]
    assert isinstance(signed, SignedUnmaskRequest)
    plan = signed.request
    as_dropped = mutated(content, put("site-id", DROPS))
    with pytest.raises(MessageFormatError, match=r"'site-id'.*not a survivor"):
        decode_unmask_reply(as_dropped, round_id=ROUND, site_id=DROPS, request=plan)


# sizes are bounded before anything is allocated ------------------------------------------------


def peak_bytes_while(decode: Callable[[], object]) -> int:
    """The peak of Python and numpy allocations while ``decode()`` is refused."""
    tracemalloc.start()
    try:
        with pytest.raises(MessageFormatError):
            decode()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_declared_vector_length_of_1e12_is_refused_before_allocation(played: Played) -> None:
    _, reply, _ = played.sent[Stage.MASK_REPLY]
    huge = mutated(reply, put("length", 10**12))
    peak = peak_bytes_while(
        lambda: decode_mask_reply(huge, round_id=ROUND, site_id=SITE, length=LENGTH, bits=BITS)
    )
    assert peak < 64 * 1024
    _, request, decode = played.sent[Stage.ADVERTISE_REQUEST]
    asked = mutated(request, put("length", 10**12))
    assert peak_bytes_while(lambda: decode(asked)) < 64 * 1024


def test_oversize_masked_bytes_are_refused_without_a_copy(played: Played) -> None:
    _, reply, _ = played.sent[Stage.MASK_REPLY]
    big = mutated(reply, put("masked-input", bytes(64 * 2**20)))  # 64 MiB, 8 Mi words
    peak = peak_bytes_while(
        lambda: decode_mask_reply(big, round_id=ROUND, site_id=SITE, length=LENGTH, bits=BITS)
    )
    assert peak < 64 * 1024


def test_a_roster_of_a_million_sites_is_refused_before_it_is_read(played: Played) -> None:
    _, request, decode = played.sent[Stage.SHARE_REQUEST]
    million = [f"x{i}" for i in range(10**6)]
    crowded = mutated(request, put("roster", million))
    assert peak_bytes_while(lambda: decode(crowded)) < 64 * 1024


def test_the_callers_own_vector_length_is_bounded(played: Played) -> None:
    _, reply, _ = played.sent[Stage.MASK_REPLY]
    for length in (0, MAX_VECTOR_LENGTH + 1):
        with pytest.raises(ConfigError, match=r"length"):
            decode_mask_reply(reply, round_id=ROUND, site_id=SITE, length=length, bits=BITS)


# the values of a masked vector --------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 16, 32, 62])
def test_masked_values_at_or_above_2_to_the_b_are_refused(bits: int) -> None:
    top = np.array([0, (1 << bits) - 1, 1], dtype=np.uint64)
    content = encode_mask_reply(top, round_id=ROUND, site_id=SITE, bits=bits)
    decoded = decode_mask_reply(content, round_id=ROUND, site_id=SITE, length=3, bits=bits)
    np.testing.assert_array_equal(decoded, top)
    for value in (1 << bits, (1 << 64) - 1):
        words = np.array([0, value, 1], dtype=np.uint64).astype("<u8").tobytes()
        bad = mutated(content, put("masked-input", words))
        text = refused(
            lambda c: decode_mask_reply(c, round_id=ROUND, site_id=SITE, length=3, bits=bits),
            bad,
        )
        assert "'masked-input'" in text and f">= 2^{bits}" in text


def test_a_vector_above_2_to_the_b_is_not_sent() -> None:
    with pytest.raises(MessageFormatError, match=r"refusing to send.*'masked-input'"):
        encode_mask_reply(np.array([1 << 16], np.uint64), round_id=ROUND, site_id=SITE, bits=16)


@pytest.mark.parametrize(
    "vector",
    [
        pytest.param(np.zeros(4, np.float64), id="float64"),
        pytest.param(np.zeros(4, np.int64), id="int64"),
        pytest.param(np.zeros(4, np.uint32), id="uint32"),
        pytest.param(np.zeros((2, 2), np.uint64), id="2-d"),
        pytest.param([0, 1, 2], id="list"),
    ],
)
def test_a_vector_of_another_dtype_or_shape_is_not_sent(vector: Any) -> None:
    with pytest.raises(MessageFormatError, match=r"'masked-input'"):
        encode_mask_reply(vector, round_id=ROUND, site_id=SITE, bits=BITS)


# encoders refuse what the decoders would refuse ------------------------------------------------


def test_encoders_refuse_to_send_what_the_receiver_refuses(played: Played) -> None:
    share_request = played.sent[Stage.SHARE_REQUEST][0]
    assert isinstance(share_request, ShareRequest)
    with pytest.raises(MessageFormatError, match=r"refusing to send.*'threshold'"):
        encode_share_request(
            ShareRequest(roster=share_request.roster, threshold=2), round_id=ROUND, site_id=SITE
        )
    swapped = dict(share_request.roster.leaves)
    swapped["s1"], swapped["s2"] = swapped["s2"], swapped["s1"]
    part = dataclasses.replace(share_request.roster, leaves=swapped)
    with pytest.raises(MessageFormatError, match=r"refusing to send"):
        encode_share_request(
            ShareRequest(roster=part, threshold=THRESHOLD), round_id=ROUND, site_id=SITE
        )
    with pytest.raises(MessageFormatError, match=r"refusing to send.*'site-id'"):
        encode_advertise_request(
            AdvertiseRequest(bits=BITS, length=LENGTH), round_id=ROUND, site_id=""
        )
    with pytest.raises(MessageFormatError, match=r"refusing to send.*'length'"):
        encode_advertise_request(
            AdvertiseRequest(bits=BITS, length=10**12), round_id=ROUND, site_id=SITE
        )
    with pytest.raises(MessageFormatError, match=r"refusing to send.*'dropped'"):
        encode_sample_request(
            SampleRequest(
                UnmaskRequest(frozenset({"s0", "s1"}), frozenset({"s1"})),
                frozenset({"s0"}),
                bytes(32),
            ),
            round_id=ROUND,
            site_id=SITE,
            roster=SITES,
        )
    with pytest.raises(MessageFormatError, match=r"refusing to send.*outside the roster"):
        encode_consistency_request(
            ConsistencyRequest(frozenset({"s0", "s9"})), round_id=ROUND, site_id=SITE, roster=SITES
        )
    with pytest.raises(MessageFormatError, match=r"refusing to send.*'signers'"):
        encode_sample_request(
            SampleRequest(
                UnmaskRequest(frozenset({"s0", "s1"}), frozenset({"s2"})),
                frozenset({"s2"}),
                bytes(32),
            ),
            round_id=ROUND,
            site_id=SITE,
            roster=SITES,
        )
    signature = played.sent[Stage.CONSISTENCY_REPLY][0]
    assert isinstance(signature, bytes)
    with pytest.raises(MessageFormatError, match=r"refusing to send.*'signers'"):
        encode_unmask_request(
            SignedUnmaskRequest(
                UnmaskRequest(frozenset({"s0", "s1"}), frozenset({"s2"})), {"s1": signature}
            ),
            round_id=ROUND,
            site_id=SITE,
            roster=SITES,
            drawn=("s0",),
        )
    with pytest.raises(MessageFormatError, match=r"refusing to send.*'drawn'"):
        encode_sample_reply((0, 3), round_id=ROUND, site_id=SITE, forwarded=3)


def test_message_format_error_is_a_secure_sum_error() -> None:
    assert issubclass(MessageFormatError, SecureSumError)
    assert issubclass(MessageFormatError, ValueError)


def test_a_share_requests_graph_is_bounded_and_the_neighbourhood_tables_exact(
    played: Played,
) -> None:
    """A sparse graph's degree is even and below n - 1 and its threshold a majority of the
    neighbourhood; with a neighbourhood ``near`` the mask request and unmask reply list exactly
    its sites, no more."""
    share_request = played.sent[Stage.SHARE_REQUEST][0]
    assert isinstance(share_request, ShareRequest)
    roster = share_request.roster  # 4 sites: degree 2 is the only sparse one
    sparse = ShareRequest(roster=roster, threshold=THRESHOLD, graph_degree=2, graph_threshold=2)
    got = decode_share_request(
        encode_share_request(sparse, round_id=ROUND, site_id=SITE), round_id=ROUND, site_id=SITE
    )
    assert got.graph == (2, 2) and share_request.graph is None
    for degree, local, key in [(3, 2, "graph-degree"), (4, 3, "graph-degree"),
                               (2, 1, "graph-threshold"), (2, 3, "graph-threshold")]:  # fmt: skip
        bad = ShareRequest(
            roster=roster, threshold=THRESHOLD, graph_degree=degree, graph_threshold=local
        )
        with pytest.raises(MessageFormatError, match=rf"refusing to send.*'{key}'"):
            encode_share_request(bad, round_id=ROUND, site_id=SITE)
    near = ["s0", "s1", "s3"]
    everyone = frozenset(SITES)
    ask = MaskRequest(
        sealed={"s1": bytes(SEALED_SHARES_BYTES), "s3": bytes(SEALED_SHARES_BYTES)},
        participants=everyone,
    )
    with pytest.raises(MessageFormatError, match=r"refusing to send.*'senders'"):
        # the complete graph's: 3 senders
        encode_mask_request(ask, round_id=ROUND, site_id=SITE, roster=SITES)
    decoded = decode_mask_request(
        encode_mask_request(ask, round_id=ROUND, site_id=SITE, roster=SITES, near=near),
        round_id=ROUND,
        site_id=SITE,
        roster=SITES,
        near=near,
    )
    assert set(decoded.sealed) == {"s1", "s3"}
