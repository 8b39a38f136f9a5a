"""Exceptions raised by the ``deploy`` package. Each message says what was found and what to do."""

from __future__ import annotations

__all__ = ["DeployError", "InsecureSetupError"]


class DeployError(Exception):
    """A deployment setting or file cannot be used; nothing already stored was changed."""


class InsecureSetupError(DeployError):
    """TLS, SuperNode authentication or key-file permissions are missing or too loose."""
