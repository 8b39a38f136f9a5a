"""Exceptions raised by the ``server`` package. Each message says what was found and what to do."""

from __future__ import annotations

from prism_runtime.errors import ConfigError  # the one class: a bad setting on either side

__all__ = [
    "ConfigError",
    "InvalidEventError",
    "LedgerConflictError",
    "LedgerError",
    "ReplyError",
    "ServerError",
    "SitesUnavailableError",
]


class ServerError(Exception):
    """Base class of every error raised by the ``server`` package."""


class LedgerError(ServerError):
    """The privacy ledger cannot be used: a missing, corrupt or foreign file, or a refused write.

    The message names the file, what was found and what to do.
    """


class InvalidEventError(LedgerError, ValueError):
    """A ledger event has a value out of range (e.g. ``q > 1``); nothing was written."""


class LedgerConflictError(LedgerError):
    """A site already has a different confirmed record for the same (run, round); nothing was
    written and the stored record is kept."""


class SitesUnavailableError(ServerError):
    """Fewer than ``min-sites`` sites connected within ``connect-timeout``: the run stops."""


class ReplyError(ServerError, ValueError):
    """A site's reply is invalid (missing keys, wrong shapes, impossible accounting facts).

    ``code`` is a short reason class (e.g. ``"shape"``, ``"norm"``, ``"replay"``) counted per
    round in the summary; the message says what was found.
    """

    def __init__(self, message: str, code: str = "invalid") -> None:
        super().__init__(message)
        self.code = code
