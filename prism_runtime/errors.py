"""Exceptions raised by the ``client`` package. Each message says what was found and what to do."""

from __future__ import annotations

__all__ = ["AccountingMismatchError", "ClientError", "ConfigError", "DataError"]


class ClientError(Exception):
    """Base class of every error raised by the ``client`` package."""


class DataError(ClientError, ValueError):
    """A site's training data cannot be used.

    The message names the file (or folder), the 1-based line or row where the problem was found,
    what was wrong and how to fix it; never the content of a cell (only its kind and length).
    """


class ConfigError(ClientError, ValueError):
    """A client setting is invalid or inconsistent (e.g. a batch size larger than the data)."""


class AccountingMismatchError(ClientError, RuntimeError):
    """The mechanism's records of a round disagree with what the site charged before it.

    The charge stays on the site's ledger (it is conservative) and nothing is released.
    """
