"""A site's own durable privacy ledger: every private step it runs, charged BEFORE it runs.

An append-only JSON-lines file in the site's state folder, flushed and fsync'ed per entry (and
the folder fsync'ed when the file is created), so a crash mid-round still leaves the charge on
disk and a restarted site never forgets spent budget. Epsilon is always recomputed from the
entries (``prism_core.accounting``).

Damage and what the site does about it:

- A torn LAST line (no trailing newline and not valid JSON, e.g. blank or cut short or NUL
  bytes) is what power loss during a charge leaves. ``charge`` returns only after the entry is
  durable and the steps it pays for run only after that, so the steps behind a torn charge
  never ran: the line is ignored with a warning, and the next ``charge`` truncates it away
  (fsync'ed) before appending, under a lock, so the file is valid again afterwards. Reading
  never modifies the file. A complete last entry that only lacks its newline is kept, and the
  next charge adds the newline first.
- Anything else (a bad line before the last one, a bad last line that ends in a newline, a
  line of JSON with missing, unknown or mistyped fields) stops the site with a ``ConfigError``
  naming the file and the line; the file is left byte-for-byte unchanged, so spent budget is
  never lost. Restore the file from a backup (or repair that line by hand) and restart.
"""

from __future__ import annotations

import json
import logging
import math
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from prism_core.accounting import collusion_epsilon, epsilon
from prism_core.records import PRIVACY_UNITS, SKELLAM_MECHANISM, EventColumns, PrivacyEvent
from prism_runtime.durable import fsync_dir, locked, make_dirs
from prism_runtime.errors import ConfigError

__all__ = ["SiteLedger", "SiteLedgerEntry"]

log = logging.getLogger(__name__)

_FIELDS: dict[str, type] = {
    "server_round": int,
    "mechanism": str,
    "sigma": float,
    "q": float,
    "steps": int,
    "delta": float,
}
"""A ledger line: one JSON object with these fields, and ``_OPTIONAL`` ones."""
_OPTIONAL: dict[str, type] = {"unit": str, "honest_sites": int, "share_sigma": float}
"""Fields a line may lack: ``unit`` (the event's privacy unit, ``PRIVACY_UNITS``) is written on
every line, and a line without it reads as a record-level event
(``prism_core.records.DEFAULT_UNIT``); ``honest_sites`` and ``share_sigma`` (the honest sites a
secure-aggregation charge counts on and the multiplier of the site's own noise share) are
written on the lines of ``SKELLAM_MECHANISM`` events only, and a line without them reads as
None (the event then refuses the Skellam mechanism)."""

_RANGES: dict[str, tuple[str, typing.Callable[[Any], bool]]] = {
    "server_round": (">= 0", lambda v: v >= 0),
    "sigma": (">= 0", lambda v: v >= 0),
    "q": ("in (0, 1]", lambda v: 0 < v <= 1),
    "steps": (">= 0", lambda v: v >= 0),
    "delta": ("in (0, 1)", lambda v: 0 < v < 1),
    "unit": (f"one of {list(PRIVACY_UNITS)}", lambda v: v in PRIVACY_UNITS),
    "honest_sites": (">= 1", lambda v: v >= 1),
    "share_sigma": (">= 0", lambda v: v >= 0),
}
"""Allowed values of the entry fields that the accountant reads."""


@dataclass(frozen=True)
class SiteLedgerEntry(EventColumns):
    """One charge: the privacy event of a round (``steps`` subsampled-Gaussian steps of one
    mechanism), at the site's delta; ``mechanism``, ``sigma``, ``q``, ``steps``, ``unit``,
    ``honest_sites`` and ``share_sigma`` (the file's fields) read through to the event
    (``EventColumns``)."""

    server_round: int
    event: PrivacyEvent
    delta: float

    def to_json(self) -> dict[str, Any]:
        """The entry's line in the ledger file (``_FIELDS`` and ``unit``; ``honest_sites`` and
        ``share_sigma`` for a ``SKELLAM_MECHANISM`` event)."""
        line: dict[str, Any] = {
            "server_round": self.server_round,
            "mechanism": self.event.mechanism,
            "sigma": self.event.noise_multiplier,
            "q": self.event.sample_rate,
            "steps": self.event.steps,
            "delta": self.delta,
            "unit": self.event.unit,
        }
        if self.event.mechanism == SKELLAM_MECHANISM:
            line["honest_sites"], line["share_sigma"] = self.honest_sites, self.share_sigma
        return line

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SiteLedgerEntry:
        """The entry of a checked ledger line (``_entry_problem`` found nothing wrong)."""
        return cls(obj["server_round"], PrivacyEvent.from_columns(obj), obj["delta"])


class _Parsed(NamedTuple):
    """A ledger file's entries; ``torn_at``: byte offset of a torn last line to drop, if any;
    ``unterminated``: the last entry is complete but lacks its newline."""

    entries: list[SiteLedgerEntry]
    torn_at: int | None
    unterminated: bool


def _type_ok(value: Any, kind: type) -> bool:
    """Whether a JSON value is of a field's type (numbers finite; bool is not a number)."""
    if kind is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _entry_problem(obj: Any) -> str | None:
    """Why a parsed JSON value is not a ``SiteLedgerEntry``, or None if it is one."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, found {type(obj).__name__}"
    kinds = {**_FIELDS, **_OPTIONAL}
    unknown = sorted(set(obj) - set(kinds))
    required = [name for name in _FIELDS if name not in obj]
    problems = []
    if unknown:
        problems.append(f"unknown fields {unknown}")
    if required:
        problems.append(f"missing fields {required}")
    for name, value in obj.items():
        if name not in kinds:
            continue
        if not _type_ok(value, kinds[name]):
            problems.append(f"{name}={value!r} is not of type {kinds[name].__name__}")
        elif name in _RANGES and not _RANGES[name][1](value):
            problems.append(f"{name}={value!r} must be {_RANGES[name][0]}")
    return "; ".join(problems) if problems else None


class SiteLedger:
    """Append-only site-local ledger at ``<state_dir>/privacy-ledger.jsonl``."""

    FILE = "privacy-ledger.jsonl"
    LOCK = ".privacy-ledger.lock"

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / self.FILE
        make_dirs(self.path.parent)
        self._entries = self._read()
        self.group_size: int | None = None
        """At the person level: the most records of one of the site's people, by which its
        record-level events count per person (group privacy; ``prism_core.accounting.epsilon``).
        None: the ledger holds one unit."""

    def units(self) -> list[str]:
        """The privacy units of the charged events, in order of first appearance."""
        return list(dict.fromkeys(e.unit for e in self.events()))

    def _damaged(self, number: int, problem: str) -> ConfigError:
        return ConfigError(
            f"{self.path}, line {number}: {problem}. This site's privacy ledger is damaged, so "
            "the site will not run: spending budget it cannot account for would break its "
            "guarantee. The file was left unchanged. Restore it from a backup (or repair line "
            f"{number} by hand), then start the site again."
        )

    def _parse(self, data: bytes) -> _Parsed:
        """Entries of the file content ``data``; raises ``ConfigError`` on any damage that is
        not a torn last line (see the module docstring)."""
        entries: list[SiteLedgerEntry] = []
        lines = data.split(b"\n")
        offset = 0
        for number, raw in enumerate(lines, start=1):
            last = number == len(lines)  # non-empty only when the file lacks a final newline
            start, offset = offset, offset + len(raw) + 1
            if not raw.strip():
                if last and raw:
                    return _Parsed(entries, start, False)
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                if last:
                    return _Parsed(entries, start, False)
                raise self._damaged(number, f"not a JSON line ({exc})") from exc
            problem = _entry_problem(obj)
            if problem is not None:
                raise self._damaged(number, f"not a prism-fl site ledger entry: {problem}")
            try:
                entries.append(SiteLedgerEntry.from_json(obj))
            except (TypeError, ValueError) as exc:
                raise self._damaged(number, f"not a prism-fl site ledger entry ({exc})") from exc
        return _Parsed(entries, None, bool(lines[-1]))

    def _read(self) -> list[SiteLedgerEntry]:
        """The entries on disk, without modifying the file (a torn last line is ignored)."""
        if not self.path.exists():
            return []
        parsed = self._parse(self.path.read_bytes())
        if parsed.torn_at is not None:
            log.warning(
                "%s: the last line (from byte %d) is an incomplete charge, left by a crash or "
                "power loss before it was durable; the steps it would have paid for never ran. "
                "It is ignored, and removed before the next charge.",
                self.path,
                parsed.torn_at,
            )
        return parsed.entries

    def reload(self) -> None:
        """Re-read the file (another process of this site may have charged it)."""
        self._entries = self._read()

    def entries(self) -> list[SiteLedgerEntry]:
        return list(self._entries)

    def events(self) -> list[PrivacyEvent]:
        return [e.event for e in self._entries if e.steps > 0]

    def charge(self, entry: SiteLedgerEntry) -> None:
        """Append and fsync one entry before the steps it describes run.

        Under an exclusive lock: re-read the file (a damaged file raises ``ConfigError`` and is
        not touched), truncate a torn last line away (fsync'ed), append the entry, fsync the
        file, and fsync the folder if this charge created the file. On return the charge
        survives power loss.
        """
        line = (json.dumps(entry.to_json(), sort_keys=True) + "\n").encode()
        with locked(self.path.parent / self.LOCK):
            created = not self.path.exists()
            with self.path.open("a+b") as f:
                f.seek(0)
                parsed = self._parse(f.read())
                if parsed.torn_at is not None:
                    log.warning(
                        "%s: removing the incomplete last line (from byte %d) before charging",
                        self.path,
                        parsed.torn_at,
                    )
                    f.truncate(parsed.torn_at)
                    f.flush()
                    os.fsync(f.fileno())
                elif parsed.unterminated:
                    line = b"\n" + line
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            if created:
                fsync_dir(self.path.parent)
        self._entries = [*parsed.entries, entry]

    def epsilon(self, delta: float, events: Sequence[PrivacyEvent] | None = None) -> float:
        """Epsilon of ``events`` (default: the ledger's) at ``delta``, per person when
        ``group_size`` is set."""
        history = self.events() if events is None else events
        return epsilon(history, delta, group_size=self.group_size)

    def collusion_epsilon(
        self, delta: float, events: Sequence[PrivacyEvent] | None = None
    ) -> float:
        """Epsilon of ``events`` (default: the ledger's) at ``delta`` if every other site
        colluded with the coordinator: a secure-aggregation event counts at its own share's
        ``share_sigma`` (``prism_core.accounting.collusion_epsilon``); per person when
        ``group_size`` is set, as ``epsilon``."""
        history = self.events() if events is None else events
        return collusion_epsilon(history, delta, group_size=self.group_size)
