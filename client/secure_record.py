"""A site's durable record of what it decided once in its current secure-aggregation round.

The round's secrets live in the node's memory (``context.state``), which a SuperNode saves only
AFTER the reply has left (and loses on a restart): a stage whose reply went out while the node
kept an older state would otherwise be answered again from that older state, e.g. a re-sent mask
request masked again with the same masks on a fresh input (the coordinator reads the difference
of the two), or a second view signed (and then the other kind of share revealed). So every
stage writes the round's ``prism_runtime.secure_sum.RoundDecisions`` (which masks; the
threshold it shared with; whom it masked with; the one survivor set it signed, the only one it
reveals shares for; the signatures it drew to check, written before the draw leaves so that
under a sparse graph a sampled check is never drawn twice) to ``<state_dir>/secure-round.json``
in one atomic, fsync'ed write BEFORE its reply leaves, and every later stage takes the record
into the round's state first (``SiteRound.recall``): a state older than the record is refused
or completed from it, never used to decide again. The record
holds no secret (masks are named by a digest of their public keys); advertising a new round
replaces it, so a state of an earlier round is refused as stale.
"""

from __future__ import annotations

import json
from pathlib import Path

from prism_runtime.durable import atomic_write
from prism_runtime.secure_sum import MasksUsedError, RoundDecisions, RoundId, SecureSumError

__all__ = ["SecureRecord"]


class SecureRecord:
    """``<state_dir>/secure-round.json``: the current secure round's decisions.

    Args:
        state_dir: the site's own state folder (it exists).
    """

    FILE = "secure-round.json"

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / self.FILE

    def keep(self, round_id: RoundId, decisions: RoundDecisions) -> None:
        """Replace the record with ``decisions`` of ``round_id``, durably (before a reply)."""
        payload = {
            "run-id": round_id.run_id,
            "round": round_id.server_round,
            **decisions.to_json(),
        }
        data = json.dumps(payload, sort_keys=True).encode()
        atomic_write(self.path, lambda f: f.write(data), mode=0o600)

    def load(self) -> RoundDecisions:
        """The decisions of the round advertised last.

        Raises:
            MasksUsedError: there is no record, or it cannot be read: the site cannot know what
                it decided, so it decides nothing more this round.
        """
        try:
            value = json.loads(self.path.read_bytes())
            return RoundDecisions.from_json(value)
        except (OSError, ValueError, SecureSumError):
            raise MasksUsedError(
                f"{self.path}: no readable record of this site's secure round: it cannot know "
                "what it decided and takes no further part in the round"
            ) from None
