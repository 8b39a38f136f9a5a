"""The request of one round, checked once: the round number, the coordinator's run id and the
broadcast arrays, with the digest that identifies the broadcast point.

A round number is a message value, hence hostile input: it is accepted only as an integer (not a
bool) in ``[1, SERVER_ROUND_MAX]``, before anything else about the round is read or charged.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TypeGuard

from torch import Tensor

from client.reply import broadcast_digest
from prism_runtime.ranges import SERVER_ROUND_MAX

__all__ = ["RoundRequest", "check_request", "valid_round"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class RoundRequest:
    """One round's request, as the site accepted it.

    Attributes:
        run_id: the coordinator's run; empty when the message names none (a stored reply is then
            never resent).
        server_round: the round number, an integer in ``[1, SERVER_ROUND_MAX]``.
        arrays: the broadcast arrays as received (``client.broadcast.check_broadcast`` checks
            them).
    """

    run_id: str
    server_round: int
    arrays: dict[str, Tensor]

    @functools.cached_property
    def digest(self) -> str:
        """``client.reply.broadcast_digest`` of the arrays, computed once, when first read."""
        return broadcast_digest(self.arrays)


def valid_round(value: object) -> TypeGuard[int]:
    """A round number a site accepts: an integer (not a bool) in ``[1, SERVER_ROUND_MAX]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return 1 <= value <= SERVER_ROUND_MAX


def check_request(
    server_round: object, arrays: dict[str, Tensor], *, run_id: str, site_id: str
) -> RoundRequest | None:
    """The round's request, or None when its round number is not accepted (``bad-round``).

    Args:
        server_round: the message's round number as received, of any type.
        arrays: the broadcast arrays as received.
        run_id: the coordinator's run id from the message ("" if none).
        site_id: this site, for its log.
    """
    if not valid_round(server_round):
        log.warning("site %s: round number %.40r is not accepted", site_id, server_round)
        return None
    return RoundRequest(run_id, server_round, arrays)
