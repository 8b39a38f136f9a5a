"""A site's last released reply, kept in its state folder so that a re-asked round costs nothing.

``<state_dir>/last-round.pt`` holds, in one atomic write (``prism_runtime.durable.atomic_write``),
the reply the site released last (the coordinator's run id, the round, the SHA-256 digest of the
broadcast it answers, its arrays and facts) and the optimizer state that round left behind
(PRISM's adaptive moments with the points they belong to). The reply is stored BEFORE it is sent.
When the coordinator asks again for the same round of the same run from the same broadcast point,
the stored reply is sent again: it is already DP output, so resending is post-processing and
spends nothing. A round that must run again (the site stopped before storing its reply) is charged
again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from client.reply import RoundReply
from client.request import RoundRequest
from prism_runtime.durable import atomic_write
from prism_runtime.errors import ConfigError
from prism_runtime.facts import FactsError, ReplyFacts

__all__ = ["RoundStore"]

log = logging.getLogger(__name__)


class RoundStore:
    """``<state_dir>/last-round.pt``: the site's last released reply and its optimizer state.

    Args:
        state_dir: the site's own state folder.
        site_id: this site, for its log.
    """

    FILE = "last-round.pt"
    MOMENTS_FILE = "adaptive-state.pt"
    """PRISM's moments alone, in a file of their own: read when there is no ``FILE``."""

    def __init__(self, state_dir: Path, *, site_id: str) -> None:
        self.site_id = site_id
        self.path = Path(state_dir) / self.FILE
        self.moments_path = Path(state_dir) / self.MOMENTS_FILE

    def load(self) -> dict[str, Any] | None:
        """What the file holds, None if there is none.

        Raises:
            ConfigError: the file cannot be read (it is left as it is).
        """
        if not self.path.exists():
            return None
        try:
            saved: dict[str, Any] = torch.load(self.path, weights_only=True)
        except Exception as exc:
            raise ConfigError(
                f"{self.path}: unreadable site round state ({exc}); it holds the last released "
                "reply and optimizer state. Restore it from backup, or move it away to start "
                "the optimizer state afresh (the privacy ledger is separate and kept)."
            ) from exc
        return saved

    def resend(self, request: RoundRequest) -> RoundReply | None:
        """The stored reply if it answers ``request`` (same run id, round and broadcast digest),
        else None; never for a request without a run id."""
        wanted = (request.run_id, request.server_round, request.digest)
        saved = self.load()
        if not request.run_id or saved is None:
            return None
        if (saved["run-id"], saved["round"], saved["broadcast"]) != wanted:
            return None
        log.info(
            "site %s: round %d of run %s already answered; resending the stored reply",
            self.site_id,
            request.server_round,
            request.run_id,
        )
        try:
            facts = ReplyFacts.parse(saved["accounting"])
        except FactsError as exc:
            raise ConfigError(
                f"{self.path}: the stored reply's accounting facts are not valid ({exc}). Move "
                "the file away: the round is then trained and charged afresh (the privacy "
                "ledger is separate and kept)."
            ) from None
        return RoundReply(dict(saved["arrays"]), facts, saved["nonprivate"])

    def moments(self) -> dict[str, Any] | None:
        """The optimizer state the last stored round left (``store``'s ``moments``), or None."""
        saved = self.load()
        if saved is None and self.moments_path.exists():
            saved = {"adaptive": torch.load(self.moments_path, weights_only=True)}
        if saved is None:
            return None
        moments: dict[str, Any] | None = saved.get("adaptive")
        return moments

    def store(
        self, request: RoundRequest, reply: RoundReply, moments: dict[str, Any] | None
    ) -> None:
        """Store the released ``reply`` to ``request`` and the optimizer state it leaves
        (``moments``: PRISM's, None for a method that keeps none), in one atomic write."""
        payload = {
            "run-id": request.run_id,
            "round": request.server_round,
            "broadcast": request.digest,
            "arrays": reply.arrays,
            "accounting": reply.accounting.to_record(),
            "nonprivate": reply.nonprivate,
            "adaptive": moments,
        }
        atomic_write(self.path, lambda f: torch.save(payload, f))
