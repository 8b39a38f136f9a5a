"""What happened in one round: logged, counted in its metrics, kept in the run summary and the
checkpoint (Flower-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.errors import ReplyError

__all__ = ["RoundSummary"]


@dataclass
class RoundSummary:
    """What happened in one round (logged and kept for the run summary).

    ``rejected`` holds ``(who, why)``; ``rejected_by_reason`` counts them by ``ReplyError.code``.
    ``discarded`` says why an aggregate was computed but not applied (non-finite or rank lost).
    ``refusal_codes`` maps each refusing site to its reason code; ``unconfirmed`` lists the sites
    charged an unconfirmed round (asked, no valid answer; see ``PrismStrategy.aggregate_train``).
    """

    server_round: int
    sent: int = 0
    accepted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (who, why)
    applied: bool = False
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    discarded: str = ""
    refusal_codes: dict[str, str] = field(default_factory=dict)
    unconfirmed: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, x: dict[str, Any]) -> RoundSummary:
        """The summary of ``vars(summary)`` as stored in a checkpoint (older fields default)."""
        return cls(
            server_round=int(x["server_round"]),
            sent=int(x["sent"]),
            accepted=list(x["accepted"]),
            refused=list(x["refused"]),
            rejected=[(str(w), str(r)) for w, r in x["rejected"]],
            applied=bool(x["applied"]),
            rejected_by_reason={str(k): int(v) for k, v in x.get("rejected_by_reason", {}).items()},
            discarded=str(x.get("discarded", "")),
            refusal_codes={str(k): str(v) for k, v in x.get("refusal_codes", {}).items()},
            unconfirmed=[str(w) for w in x.get("unconfirmed", [])],
        )

    def reject(self, who: str, exc: ReplyError) -> None:
        self.rejected.append((who, str(exc)))
        self.rejected_by_reason[exc.code] = self.rejected_by_reason.get(exc.code, 0) + 1
