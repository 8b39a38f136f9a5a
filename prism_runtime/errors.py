"""Exceptions of the shared runtime and the site (``prism_runtime``, ``client``); ``ConfigError`` is
also the coordinator's (``server.errors`` re-exports it: one class for a bad setting anywhere).
Each message says what was found and what to do."""

from __future__ import annotations

__all__ = ["AccountingMismatchError", "ClientError", "ConfigError", "DataError"]


class ClientError(Exception):
    """Base class of every error raised by ``prism_runtime`` and ``client``."""


class DataError(ClientError, ValueError):
    """A site's training data cannot be used.

    The message names the file (or folder), the 1-based line or row where the problem was found,
    what was wrong and how to fix it; never the content of a cell (only its kind and length).
    """


class ConfigError(ClientError, ValueError):
    """A setting is invalid or inconsistent (e.g. a batch size larger than the data), on a site or
    at the coordinator: the one ConfigError class of prism-fl."""


class AccountingMismatchError(ClientError, RuntimeError):
    """The mechanism's records of a round disagree with what the site charged before it.

    The charge stays on the site's ledger (it is conservative) and nothing is released.
    """
