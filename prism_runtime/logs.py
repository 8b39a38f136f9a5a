"""Logging set-up for the apps: prism-fl's own loggers at INFO on stderr, once per process."""

from __future__ import annotations

import logging
import sys

__all__ = ["setup_logging"]

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Attach one stderr handler to each of our packages' loggers."""
    for name in ("client", "server", "prism_runtime", "prism_core"):
        logger = logging.getLogger(name)
        if not any(getattr(h, "_prism_fl", False) for h in logger.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT))
            handler._prism_fl = True  # type: ignore[attr-defined]
            logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
