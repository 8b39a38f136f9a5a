"""Reading and writing the fields of a secure-sum message, every one of them treated as hostile.

A secure-sum message is a Flower ``RecordDict`` holding exactly one ``ConfigRecord``, under
``RECORD``. Its fields are ``format`` (``FORMAT``), ``stage`` (one of ``Stage``), ``run-id`` and
``server-round`` (the ``RoundId`` it belongs to), ``site-id`` (the addressee of a request, the
sender of a reply) and the stage's own payload (``messages``). ``MessageReader`` checks the
envelope and reads each payload field with its type and bounds: sizes are compared with their
bounds before anything is parsed, copied or turned into a set, so a message never makes its
receiver allocate more than the message already occupies, and a list never holds more than
``MAX_SITES`` items.

Errors are ``MessageFormatError``: the message names the stage and the field and says what was
found (a type, a length, a count, a duplicated or unexpected site id once it is known to be a
valid one), never a key, share, ciphertext or vector, and never a string before its length is
checked.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from enum import StrEnum
from itertools import islice

from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from flwr.app import ConfigRecord, RecordDict

from prism_runtime.protocol import SERVER_ROUND
from prism_runtime.secure_sum._encoding import DOMAIN, frame
from prism_runtime.secure_sum.envelope import NONCE_BYTES
from prism_runtime.secure_sum.errors import SecureSumError
from prism_runtime.secure_sum.keys import KEY_BYTES, RoundId
from prism_runtime.secure_sum.shamir import share_length

__all__ = [
    "FORMAT",
    "MAX_SITES",
    "MAX_SITE_ID_CHARS",
    "MAX_VECTOR_LENGTH",
    "RECORD",
    "RUN_ID",
    "SEALED_SHARES_BYTES",
    "SHARE_BYTES",
    "SIGNATURE_MAX_BYTES",
    "SIGNATURE_MIN_BYTES",
    "SITE_ID",
    "MessageFormatError",
    "MessageReader",
    "Stage",
    "check_signature",
    "check_site_id",
    "new_message",
]

RECORD = "secure-sum"
"""Key of the one ``ConfigRecord`` of a secure-sum message."""
FORMAT = DOMAIN
"""Value of every message's ``format`` field: a message of another version is refused."""
RUN_ID = "run-id"
SITE_ID = "site-id"
_FORMAT_KEY = "format"
_STAGE_KEY = "stage"
_ENVELOPE = (_FORMAT_KEY, _STAGE_KEY, RUN_ID, SERVER_ROUND, SITE_ID)

MAX_SITES = 1_000
"""Most sites in one secure-sum round: the longest roster, participant or survivor list."""
MAX_SITE_ID_CHARS = 128
"""Longest site id (printable characters, at least one)."""
MAX_VECTOR_LENGTH = 2**24
"""Longest masked vector: 2^24 coordinates (16.8 million), 128 MiB as uint64 in one message."""

SHARE_BYTES = share_length(KEY_BYTES)
"""Bytes of one Shamir share of a 32-byte secret (4-byte index, three 16-byte blocks)."""
_TAG_BYTES = 16  # Poly1305
SEALED_SHARES_BYTES = NONCE_BYTES + len(frame(bytes(SHARE_BYTES), bytes(SHARE_BYTES))) + _TAG_BYTES
"""Exact bytes of a sealed ``SharePair``: nonce, the two framed shares, the Poly1305 tag."""
SIGNATURE_MIN_BYTES = 8
"""Shortest DER ECDSA signature: ``SEQUENCE { INTEGER r, INTEGER s }`` with one-byte r and s."""
SIGNATURE_MAX_BYTES = 72
"""Longest DER ECDSA P-256 signature: r and s of 32 bytes, each with a leading zero byte."""
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


class MessageFormatError(SecureSumError):
    """A secure-sum message is malformed: a field is missing, unexpected, of the wrong type or
    size, out of its bounds, inconsistent with another field, or for another stage, round or site.

    The message names the stage and the field; the receiver drops the message (a site takes no
    further part in the round, the coordinator treats the site as dropped).
    """


class Stage(StrEnum):
    """The eight messages of a secure-sum round: a request and a reply per exchange."""

    ADVERTISE_REQUEST = "advertise-request"
    ADVERTISE_REPLY = "advertise-reply"
    SHARE_REQUEST = "share-request"
    SHARE_REPLY = "share-reply"
    MASK_REQUEST = "mask-request"
    MASK_REPLY = "mask-reply"
    UNMASK_REQUEST = "unmask-request"
    UNMASK_REPLY = "unmask-reply"


def _fail(stage: Stage, key: str, problem: str) -> MessageFormatError:
    return MessageFormatError(
        f"secure-sum {stage} message: field {key!r} {problem}; the message is refused"
    )


def _kind(value: object) -> str:
    """``a str``, ``an int``: the type of a field's value, never the value."""
    name = type(value).__name__
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


def check_site_id(value: object, *, stage: Stage, key: str) -> str:
    """``value`` if it is a site id: a str of 1 to ``MAX_SITE_ID_CHARS`` printable characters."""
    if not isinstance(value, str):
        raise _fail(stage, key, f"holds {_kind(value)}, not a site id string")
    if not 1 <= len(value) <= MAX_SITE_ID_CHARS:
        raise _fail(
            stage, key, f"holds a site id of {len(value)} characters, not 1..{MAX_SITE_ID_CHARS}"
        )
    if not value.isprintable():
        raise _fail(stage, key, "holds a site id with control characters")
    return value


def check_signature(value: bytes, *, stage: Stage, key: str) -> bytes:
    """``value`` if it is a well-formed DER ECDSA P-256 signature (not verified against any key)."""
    if not SIGNATURE_MIN_BYTES <= len(value) <= SIGNATURE_MAX_BYTES:
        raise _fail(
            stage,
            key,
            f"holds a signature of {len(value)} bytes, outside the DER bounds "
            f"{SIGNATURE_MIN_BYTES}..{SIGNATURE_MAX_BYTES} of ECDSA P-256",
        )
    try:
        r, s = decode_dss_signature(value)
    except ValueError:
        raise _fail(stage, key, "holds a signature that is not DER SEQUENCE {r, s}") from None
    if not (0 < r < _P256_ORDER and 0 < s < _P256_ORDER):
        raise _fail(stage, key, "holds a signature with r or s outside [1, n) of P-256")
    return value


def new_message(
    stage: Stage,
    *,
    round_id: RoundId,
    site_id: str,
    payload: dict[str, int | str | bytes | list[str] | list[bytes]],
) -> RecordDict:
    """The ``RecordDict`` of one secure-sum message: the envelope fields and ``payload``."""
    fields: dict[str, int | str | bytes | list[str] | list[bytes]] = {
        _FORMAT_KEY: FORMAT,
        _STAGE_KEY: str(stage),
        RUN_ID: round_id.run_id,
        SERVER_ROUND: round_id.server_round,
        SITE_ID: site_id,
    }
    fields.update(payload)
    # ConfigRecord's value type is a union of invariant lists; each value here is one of them
    return RecordDict({RECORD: ConfigRecord(fields)})  # type: ignore[arg-type]


class MessageReader:
    """The checked fields of one secure-sum message of a known stage, round and site.

    The constructor checks the envelope: a ``RecordDict`` with exactly one ``ConfigRecord``
    under ``RECORD`` whose keys are exactly the envelope's and ``payload``'s, this ``FORMAT``,
    ``stage``, ``round_id`` and (when given) ``site_id``. The methods read payload fields.
    """

    def __init__(
        self,
        content: object,
        *,
        stage: Stage,
        payload: Collection[str],
        round_id: RoundId,
        site_id: str | None,
    ) -> None:
        self.stage = stage
        if not isinstance(content, RecordDict):
            raise MessageFormatError(
                f"secure-sum {stage} message: the content is {_kind(content)}, not a "
                "RecordDict; the message is refused"
            )
        record = content.get(RECORD) if len(content) == 1 else None
        if not isinstance(record, ConfigRecord):
            raise MessageFormatError(
                f"secure-sum {stage} message: the content holds {len(content)} records; it must "
                f"hold exactly one ConfigRecord under {RECORD!r}; the message is refused"
            )
        self.record = record
        if record.get(_FORMAT_KEY) != FORMAT:
            raise _fail(stage, _FORMAT_KEY, f"is missing or not {FORMAT!r} (another protocol)")
        if record.get(_STAGE_KEY) != str(stage):
            raise _fail(stage, _STAGE_KEY, f"is missing or not {str(stage)!r} (another stage)")
        self._check_keys((*_ENVELOPE, *payload))
        run_id = self.record[RUN_ID]
        if not isinstance(run_id, str):
            raise _fail(stage, RUN_ID, f"holds {_kind(run_id)}, not a str")
        if run_id != round_id.run_id:
            raise _fail(stage, RUN_ID, f"is not this round's run {round_id.run_id!r}")
        if self.integer(SERVER_ROUND, low=0, high=2**63 - 1) != round_id.server_round:
            raise _fail(stage, SERVER_ROUND, f"is not this round's {round_id.server_round}")
        self.site_id = self.site(SITE_ID)
        if site_id is not None and self.site_id != site_id:
            raise _fail(stage, SITE_ID, f"names site {self.site_id!r}, not {site_id!r}")

    def _check_keys(self, expected: Sequence[str]) -> None:
        found = set(self.record)
        missing = sorted(set(expected) - found)
        extra = found - set(expected)
        if missing:
            raise MessageFormatError(
                f"secure-sum {self.stage} message: fields {missing} are missing; the message is "
                "refused"
            )
        if extra:
            shown = sorted(k[:40] for k in islice(extra, 5))
            raise MessageFormatError(
                f"secure-sum {self.stage} message: {len(extra)} unexpected fields (e.g. "
                f"{shown}); the message is refused"
            )

    def fail(self, key: str, problem: str) -> MessageFormatError:
        """The error for field ``key`` of this message (``problem`` never holds its value)."""
        return _fail(self.stage, key, problem)

    def integer(self, key: str, *, low: int, high: int) -> int:
        """Field ``key``, an int (not a bool) in ``[low, high]``."""
        value = self.record[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"holds {_kind(value)}, not an int")
        if not low <= value <= high:
            shown = value if -(2**63) <= value < 2**64 else "beyond 64 bits"
            raise self.fail(key, f"is {shown}, outside [{low}, {high}]")
        return value

    def site(self, key: str) -> str:
        """Field ``key``, a site id."""
        return check_site_id(self.record[key], stage=self.stage, key=key)

    def blob(self, key: str, *, low: int, high: int) -> bytes:
        """Field ``key``, bytes of ``low`` to ``high`` bytes."""
        value = self.record[key]
        if not isinstance(value, bytes):
            raise self.fail(key, f"holds {_kind(value)}, not bytes")
        if not low <= len(value) <= high:
            size = f"{low}" if low == high else f"{low}..{high}"
            raise self.fail(key, f"holds {len(value)} bytes, not {size}")
        return value

    def _items(self, key: str, *, count: int | None) -> Sequence[object]:
        value = self.record[key]
        if not isinstance(value, list):
            raise self.fail(key, f"holds {_kind(value)}, not a list")
        if len(value) > MAX_SITES:
            raise self.fail(key, f"holds {len(value)} items, more than {MAX_SITES} sites")
        if count is not None and len(value) != count:
            raise self.fail(key, f"holds {len(value)} items, not {count} (one per site)")
        return value

    def sites(self, key: str, *, count: int | None = None) -> list[str]:
        """Field ``key``, a list of at most ``MAX_SITES`` distinct site ids (``count`` if given)."""
        ids: list[str] = []
        seen: set[str] = set()
        for value in self._items(key, count=count):
            site = check_site_id(value, stage=self.stage, key=key)
            if site in seen:
                raise self.fail(key, f"names site {site!r} twice")
            seen.add(site)
            ids.append(site)
        return ids

    def blobs(self, key: str, *, count: int, low: int, high: int) -> list[bytes]:
        """Field ``key``, a list of ``count`` byte strings of ``low`` to ``high`` bytes each."""
        out: list[bytes] = []
        for at, value in enumerate(self._items(key, count=count)):
            if not isinstance(value, bytes):
                raise self.fail(key, f"item {at} is {_kind(value)}, not bytes")
            if not low <= len(value) <= high:
                size = f"{low}" if low == high else f"{low}..{high}"
                raise self.fail(key, f"item {at} holds {len(value)} bytes, not {size}")
            out.append(value)
        return out
