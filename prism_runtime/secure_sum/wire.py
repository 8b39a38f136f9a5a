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

A message is declared once, as a ``Message``: its stage and its payload fields, each a typed
field (``Int``, ``One``, ``Table``, and the messages' own kinds) that writes its keys and reads
them back with their checks. ``Message.encode`` and ``Message.decode`` are driven by that one
declaration, and ``encode`` decodes what it built, so a side never sends what the other side
refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import islice
from typing import Any, Generic, Protocol, TypeVar

from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from flwr.app import ConfigRecord, RecordDict

from prism_runtime.protocol import MAX_SITE_ID_CHARS, SERVER_ROUND, SITE_ID
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
    "SEALED_SHARES_BYTES",
    "SHARE_BYTES",
    "SIGNATURE_MAX_BYTES",
    "SIGNATURE_MIN_BYTES",
    "Bytes",
    "Int",
    "Keyed",
    "Message",
    "MessageFormatError",
    "MessageReader",
    "One",
    "Signature",
    "Stage",
    "Table",
    "WireValue",
    "check_addressee",
]

RECORD = "secure-sum"
"""Key of the one ``ConfigRecord`` of a secure-sum message."""
FORMAT = DOMAIN
"""Value of every message's ``format`` field: a message of another version is refused."""
RUN_ID = "run-id"
_FORMAT_KEY = "format"
_STAGE_KEY = "stage"
_ENVELOPE = (_FORMAT_KEY, _STAGE_KEY, RUN_ID, SERVER_ROUND, SITE_ID)

MAX_SITES = 1_000
"""Most sites in one secure-sum round: the longest roster, participant or survivor list."""
MAX_VECTOR_LENGTH = 2**24
"""Longest masked vector: 2^24 coordinates (16.8 million), 128 MiB as uint64 in one message."""

SHARE_BYTES = share_length(KEY_BYTES)
"""Bytes of one Shamir share of a 32-byte secret (4-byte index, a 66-byte element of GF(p))."""
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
    """The twelve messages of a secure-sum round: a request and a reply per exchange."""

    ADVERTISE_REQUEST = "advertise-request"
    ADVERTISE_REPLY = "advertise-reply"
    SHARE_REQUEST = "share-request"
    SHARE_REPLY = "share-reply"
    MASK_REQUEST = "mask-request"
    MASK_REPLY = "mask-reply"
    CONSISTENCY_REQUEST = "consistency-request"
    CONSISTENCY_REPLY = "consistency-reply"
    SAMPLE_REQUEST = "sample-request"
    SAMPLE_REPLY = "sample-reply"
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


def _check_site_id(value: object, *, stage: Stage, key: str) -> str:
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


WireValue = int | str | bytes | list[str] | list[bytes] | list[int]
"""The value of one field of a secure-sum message."""


def _new_message(
    stage: Stage, *, round_id: RoundId, site_id: str, payload: dict[str, WireValue]
) -> RecordDict:
    """The ``RecordDict`` of one secure-sum message: the envelope fields and ``payload``."""
    fields: dict[str, WireValue] = {
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
    """One secure-sum message of a known stage, round and site, its envelope checked.

    The constructor checks the envelope: a ``RecordDict`` with exactly one ``ConfigRecord``
    under ``RECORD`` whose keys are exactly the envelope's and ``payload``'s, this ``FORMAT``,
    ``stage``, ``round_id`` and (when given) ``site_id``. The declared fields read the payload.
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
        if Int(SERVER_ROUND, 0, 2**63 - 1).read(self, {}) != round_id.server_round:
            raise _fail(stage, SERVER_ROUND, f"is not this round's {round_id.server_round}")
        self.site_id = _check_site_id(self.record[SITE_ID], stage=stage, key=SITE_ID)
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

    def items(self, key: str, *, count: int | None = None) -> Sequence[object]:
        """Field ``key``, a list of at most ``MAX_SITES`` items (``count`` if given)."""
        value = self.record[key]
        if not isinstance(value, list):
            raise self.fail(key, f"holds {_kind(value)}, not a list")
        if len(value) > MAX_SITES:
            raise self.fail(key, f"holds {len(value)} items, more than {MAX_SITES} sites")
        if count is not None and len(value) != count:
            raise self.fail(key, f"holds {len(value)} items, not {count} (one per site)")
        return value

    def sites(self, key: str) -> list[str]:
        """Field ``key``, a list of at most ``MAX_SITES`` distinct site ids."""
        ids: list[str] = []
        seen: set[str] = set()
        for value in self.items(key):
            site = _check_site_id(value, stage=self.stage, key=key)
            if site in seen:
                raise self.fail(key, f"names site {site!r} twice")
            seen.add(site)
            ids.append(site)
        return ids


# the declared fields of a message --------------------------------------------------------------


@dataclass(frozen=True)
class Bytes:
    """A byte string of ``low`` to ``high`` bytes; ``load`` and ``dump`` map it to its value."""

    low: int
    high: int

    def check(self, read: MessageReader, key: str, value: object, item: str = "") -> bytes:
        """``value`` if it is bytes of a valid size (``item``: its place in a list)."""
        where = f"{item} is" if item else "holds"
        if not isinstance(value, bytes):
            raise read.fail(key, f"{where} {_kind(value)}, not bytes")
        if not self.low <= len(value) <= self.high:
            size = f"{self.low}" if self.low == self.high else f"{self.low}..{self.high}"
            raise read.fail(key, f"{item} holds {len(value)} bytes, not {size}".lstrip())
        return value

    def load(self, read: MessageReader, key: str, raw: bytes) -> Any:
        return raw

    def dump(self, value: Any) -> bytes:
        return bytes(value)


@dataclass(frozen=True)
class Signature(Bytes):
    """A DER ECDSA P-256 signature ``SEQUENCE {r, s}`` with r, s in [1, n): well-formed, not
    verified against any key (``verify_keys`` does that)."""

    low: int = SIGNATURE_MIN_BYTES
    high: int = SIGNATURE_MAX_BYTES

    def load(self, read: MessageReader, key: str, raw: bytes) -> bytes:
        try:
            r, s = decode_dss_signature(raw)
        except ValueError:
            raise read.fail(key, "holds a signature that is not DER SEQUENCE {r, s}") from None
        if not (0 < r < _P256_ORDER and 0 < s < _P256_ORDER):
            raise read.fail(key, "holds a signature with r or s outside [1, n) of P-256")
        return raw


class Field(Protocol):
    """A declared payload field: the decoded object's attribute ``name``, its wire ``keys``."""

    @property
    def name(self) -> str: ...
    @property
    def keys(self) -> tuple[str, ...]: ...
    def write(self, value: Any) -> dict[str, WireValue]: ...
    def read(self, read: MessageReader, got: Mapping[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Keyed:
    """A field of one wire key, ``key``; its attribute name is the key with ``_`` for ``-``."""

    key: str

    @property
    def name(self) -> str:
        return self.key.replace("-", "_")

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def write(self, value: Any) -> dict[str, WireValue]:
        return {self.key: value}


@dataclass(frozen=True)
class Int(Keyed):
    """Field ``key``: an int (not a bool) in ``[low, high]``."""

    low: int
    high: int

    def read(self, read: MessageReader, got: Mapping[str, Any]) -> int:
        value = read.record[self.key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise read.fail(self.key, f"holds {_kind(value)}, not an int")
        if not self.low <= value <= self.high:
            shown = value if -(2**63) <= value < 2**64 else "beyond 64 bits"
            raise read.fail(self.key, f"is {shown}, outside [{self.low}, {self.high}]")
        return value


@dataclass(frozen=True)
class One(Keyed):
    """Field ``key``: one ``item``."""

    item: Bytes

    def write(self, value: Any) -> dict[str, WireValue]:
        return {self.key: self.item.dump(value)}

    def read(self, read: MessageReader, got: Mapping[str, Any]) -> Any:
        raw = self.item.check(read, self.key, read.record[self.key])
        return self.item.load(read, self.key, raw)


def check_addressee(read: MessageReader, key: str, sites: Collection[str]) -> None:
    """Refuse field ``key`` unless ``sites`` holds the message's site."""
    if read.site_id not in sites:
        raise read.fail(key, f"does not list the addressee {read.site_id!r}")


Expect = Callable[[Mapping[str, Any]], Collection[str] | None]
"""The owners a ``Table`` must list, from what ``Message.decode`` has read and been given
(None: no list is right)."""


@dataclass(frozen=True)
class Table:
    """A mapping from site id to a row, as parallel lists sorted by site id: ``owners`` and one
    list per column, one item per owner.

    A row is the one column's item when ``row`` is None, else ``row(owner, *items)``, whose
    attributes are the column keys less the ``owners`` prefix (``roster-mask-public``:
    ``mask_public``). ``addressee``: the owners hold the message's site; ``expect``: the owners
    are exactly the sites it gives, which ``what`` names.
    """

    name: str
    owners: str
    columns: tuple[tuple[str, Bytes], ...]
    row: Callable[..., Any] | None = None
    addressee: bool = False
    expect: Expect | None = None
    what: str = ""

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.owners, *(key for key, _ in self.columns))

    def _cells(self, row: Any) -> tuple[Any, ...]:
        if self.row is None:
            return (row,)
        prefix = f"{self.owners}-"
        return tuple(
            getattr(row, key.removeprefix(prefix).replace("-", "_")) for key, _ in self.columns
        )

    def write(self, value: Mapping[str, Any]) -> dict[str, WireValue]:
        owners = sorted(value)
        rows = [self._cells(value[owner]) for owner in owners]
        out: dict[str, WireValue] = {self.owners: owners}
        for at, (key, item) in enumerate(self.columns):
            out[key] = [item.dump(cells[at]) for cells in rows]
        return out

    def read(self, read: MessageReader, got: Mapping[str, Any]) -> dict[str, Any]:
        owners = read.sites(self.owners)
        if self.addressee:
            check_addressee(read, self.owners, owners)
        if self.expect is not None:
            wanted = self.expect(got)
            if wanted is None or set(owners) != set(wanted):
                raise read.fail(
                    self.owners,
                    f"lists {len(owners)} sites, not exactly the {len(wanted or ())} {self.what}",
                )
        columns = [
            [
                item.load(read, key, item.check(read, key, value, f"item {at}"))
                for at, value in enumerate(read.items(key, count=len(owners)))
            ]
            for key, item in self.columns
        ]
        if self.row is None:
            return dict(zip(owners, columns[0], strict=True))
        return {cells[0]: self.row(*cells) for cells in zip(owners, *columns, strict=True)}


T = TypeVar("T")


@dataclass(frozen=True)
class Message(Generic[T]):
    """One message, declared once: its stage and payload ``fields`` in wire order.

    ``decode`` reads the fields in order, then applies ``check`` (the rules across fields),
    and builds ``make(**fields)``, with ``site_id`` (the sender) when ``sender``; the fields and
    ``check`` see in ``got`` the fields read so far, the receiver's ``context`` and ``site_id``.
    ``encode`` writes the fields of a mapping of attribute values and decodes the result.
    """

    stage: Stage
    fields: tuple[Field, ...]
    make: Callable[..., T]
    sender: bool = False
    check: Callable[[MessageReader, Mapping[str, Any]], None] | None = None

    def encode(
        self, values: Mapping[str, Any], *, round_id: RoundId, site_id: str, **context: Any
    ) -> RecordDict:
        """The message of ``values`` to or from ``site_id``; ``MessageFormatError`` ("refusing
        to send") where the receiver's ``decode`` with ``context`` would refuse it."""
        payload: dict[str, WireValue] = {}
        for field in self.fields:
            payload.update(field.write(values[field.name]))
        content = _new_message(self.stage, round_id=round_id, site_id=site_id, payload=payload)
        try:
            self.decode(content, round_id=round_id, site_id=site_id, **context)
        except MessageFormatError as err:
            raise MessageFormatError(f"refusing to send a malformed message: {err}") from None
        return content

    def decode(
        self, content: object, *, round_id: RoundId, site_id: str | None, **context: Any
    ) -> T:
        """The object of ``content`` (``site_id`` None: from the sender it states), or
        ``MessageFormatError`` naming the first field that breaks its declaration or a rule."""
        keys = [key for field in self.fields for key in field.keys]
        read = MessageReader(
            content, stage=self.stage, payload=keys, round_id=round_id, site_id=site_id
        )
        got: dict[str, Any] = {**context, "site_id": read.site_id}
        for field in self.fields:
            got[field.name] = field.read(read, got)
        if self.check is not None:
            self.check(read, got)
        values = {field.name: got[field.name] for field in self.fields}
        return self.make(site_id=read.site_id, **values) if self.sender else self.make(**values)
