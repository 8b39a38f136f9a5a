"""Unambiguous byte framing of the fields that a key derivation, a signature or an AEAD binds.

Each field is tagged with its type and prefixed with its 4-byte length, so no two different
field lists frame to the same bytes (a run id ending in a digit cannot run into the round
number, a site id cannot absorb its neighbour).
"""

from __future__ import annotations

__all__ = ["DOMAIN", "frame", "unframe"]

DOMAIN = "prism-fl secure-sum v1"
"""Domain-separation label that opens every framed message of the secure sum."""

_INT, _STR, _BYTES = b"i", b"s", b"b"


def frame(*parts: bytes | str | int) -> bytes:
    """The fields, each as ``len (4 bytes, big-endian) || type tag || value``."""
    out = bytearray()
    for part in parts:
        if isinstance(part, bool):
            raise TypeError("frame() takes bytes, str or int fields, not bool")
        if isinstance(part, int):
            data = _INT + part.to_bytes(8, "big", signed=True)
        elif isinstance(part, str):
            data = _STR + part.encode("utf-8")
        else:
            data = _BYTES + bytes(part)
        out += len(data).to_bytes(4, "big") + data
    return bytes(out)


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
