"""Exceptions raised by ``prism_core``. Each message says what was found and what to do."""

from __future__ import annotations

__all__ = ["AccountingError", "BudgetExceededError", "PrismError", "PrivacyParameterError"]


class PrismError(Exception):
    """Base class of every error raised by ``prism_core``."""


class PrivacyParameterError(PrismError, ValueError):
    """A privacy parameter (sigma, C, q, batch size, delta, epsilon) is out of its range."""


class AccountingError(PrismError):
    """A privacy history cannot be accounted for as claimed (e.g. privacy units mixed)."""


class BudgetExceededError(PrismError):
    """Running the requested steps would take the privacy loss past the allowed epsilon."""
