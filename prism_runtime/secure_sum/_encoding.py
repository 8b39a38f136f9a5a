"""Unambiguous byte framing of the fields that a key derivation, a signature or an AEAD binds.

Each field is tagged with its type and prefixed with its 4-byte length, so no two different
field lists frame to the same bytes (a run id ending in a digit cannot run into the round
number, a site id cannot absorb its neighbour).
"""

from __future__ import annotations

import struct

__all__ = ["DOMAIN", "frame", "unframe"]

DOMAIN = "prism-fl secure-sum v4"
"""Domain-separation label that opens every framed message of the secure sum."""

_INT, _STR, _BYTES = b"i", b"s", b"b"


_LENGTH = struct.Struct(">I").pack
_INT_HEAD = _LENGTH(9) + _INT


def frame(*parts: bytes | str | int) -> bytes:
    """The fields, each as ``len (4 bytes, big-endian) || type tag || value``."""
    chunks: list[bytes] = []
    add = chunks.append
    for part in parts:  # the exact common types first: a roster's transcript frames 7 n fields
        if type(part) is bytes:
            add(_LENGTH(len(part) + 1))
            add(_BYTES)
            add(part)
        elif type(part) is str:
            data = part.encode("utf-8")
            add(_LENGTH(len(data) + 1))
            add(_STR)
            add(data)
        elif isinstance(part, bool):
            raise TypeError("frame() takes bytes, str or int fields, not bool")
        elif isinstance(part, int):
            add(_INT_HEAD)
            add(part.to_bytes(8, "big", signed=True))
        else:
            data = (_STR + part.encode("utf-8")) if isinstance(part, str) else _BYTES + bytes(part)
            add(_LENGTH(len(data)))
            add(data)
    return b"".join(chunks)


def unframe(data: bytes) -> list[bytes]:
    """The fields of ``frame(*fields)`` when all are bytes; ValueError if malformed."""
    fields: list[bytes] = []
    at = 0
    while at < len(data):
        if at + 4 > len(data):
            raise ValueError("truncated field length")
        size = int.from_bytes(data[at : at + 4], "big")
        at += 4
        if size < 1 or at + size > len(data) or data[at : at + 1] != _BYTES:
            raise ValueError("malformed field")
        fields.append(data[at + 1 : at + size])
        at += size
    return fields
